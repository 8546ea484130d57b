#!/usr/bin/env bash
# GPU checks, run on the device machine (not in CI): GPU-marked tests and the profiler's GPU bench.
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD
export PYTHONUNBUFFERED=1
nvidia-smi -L
python3 -c "import torch, lightning; print('torch', torch.__version__, 'lightning', lightning.__version__, torch.cuda.get_device_name())"
python3 -m pytest -q -p no:cacheprovider -m gpu tests/ -o addopts="" 2>&1 | tee "$OUT/gpu-tests.log" | tail -25
python3 -m lightning_embcache.cli bench profiler --device cuda --models gpu_small --configs none,simple,step --reps 3 --out "$OUT/profiler-gpu.json" 2>&1 | tail -25
