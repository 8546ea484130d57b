#!/usr/bin/env bash
# On the device machine (nvidia-h100-x4): the GPU cells of the strategy matrix, then the scaling
# benchmark. Usage: bash tests/distributed/gpu_run.sh {matrix|scaling|all} [cells...]
# Writes under $OUT: matrix-*.json, scaling.json, run.log (at most 8 files come back).
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD
export PYTHONUNBUFFERED=1 PYTHONWARNINGS=ignore NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
what=${1:-all}; shift || true
LOG=$OUT/run.log
{ nvidia-smi -L; python3 -c "import torch, lightning; print('torch', torch.__version__, 'lightning', lightning.__version__, torch.cuda.get_device_name(), torch.cuda.device_count(), 'GPUs')"; nproc; } >> $LOG 2>&1
if [[ $what == matrix || $what == all ]]; then
  M=tests/distributed/_matrix.py
  cells() { for p in 32-true 16-mixed bf16-mixed; do for c in off on; do echo "$1/$p/compile-$c"; done; done; }
  # three lanes at once: DDP on GPUs 0,1; FSDP on GPUs 2,3; single-device cells on GPU 0
  CUDA_VISIBLE_DEVICES=0,1 timeout ${LANE_S:-280} python3 $M --accelerator cuda --devices 2 --tol 1e-5 --cells ${CELLS_DDP:-$(cells ddp)} --out $OUT/matrix-ddp.json > /tmp/lane-ddp.log 2>&1 &
  CUDA_VISIBLE_DEVICES=2,3 timeout ${LANE_S:-280} python3 $M --accelerator cuda --devices 2 --tol 1e-5 --cells ${CELLS_FSDP:-$(cells fsdp)} --out $OUT/matrix-fsdp.json > /tmp/lane-fsdp.log 2>&1 &
  CUDA_VISIBLE_DEVICES=0 timeout ${LANE_S:-280} python3 $M --accelerator cuda --tol 1e-5 --cells ${CELLS_SINGLE:-$(cells single)} --out $OUT/matrix-single.json > /tmp/lane-single.log 2>&1 &
  wait
  for l in ddp fsdp single; do echo "=== lane $l"; cat /tmp/lane-$l.log; done >> $LOG
fi
if [[ $what == scaling || $what == all ]]; then
  timeout ${SCALING_S:-200} python3 -m lightning_embcache.bench.distributed --world-sizes 1 2 4 --rows ${ROWS:-10000000} --dim 64 \
    --batch 4096 --steps ${STEPS:-50} --warmup 10 --dense --out $OUT/scaling.json >> $LOG 2>&1
fi
tail -c 6000 $LOG
