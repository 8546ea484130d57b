#!/usr/bin/env bash
# On the device machine (nvidia-h100-x4): the GPU cells of the strategy matrix, the scaling
# benchmark, the GPU tests of tests/distributed. Usage: bash tests/distributed/gpu_run.sh {matrix|scaling|tests|all}
# (carry .whl, or set WHL to the folder holding the lz4 wheel, e.g. WHL=.gpu/.whl)
# Writes under $OUT: matrix-gpu.json, scaling.json, owner-host.json, gpu-tests.log, run.log (at most 8 files come back).
# scaling: 1, 2 and 4 processes (WORLDS) with the current owner path (default) and the one before its
# trusted store calls (store=checked+prepare=lookup) as VARIANTS, REPEAT interleaved repeats each
# (the medians go into docs/benchmarks.md), then the owner's store calls on this host's CPU alone,
# beside a Python thread and beside a writing thread (bench owner_host).
# tests: every @pytest.mark.gpu test of tests/distributed (the 4-GPU cells skip on fewer GPUs).
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site ${WHL:-.whl}/*.whl && export PYTHONPATH=/tmp/site:$PWD
export PYTHONUNBUFFERED=1 PYTHONWARNINGS=ignore NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export TORCHINDUCTOR_COMPILE_THREADS=4
what=${1:-all}
LOG=$OUT/run.log
{ nvidia-smi -L; python3 -c "import torch, lightning; print('torch', torch.__version__, 'lightning', lightning.__version__, torch.cuda.get_device_name(), torch.cuda.device_count(), 'GPUs')"; nproc; } >> $LOG 2>&1
if [[ $what == matrix || $what == all ]]; then
  M=tests/distributed/_matrix.py
  mkdir -p /tmp/m
  gpus() { case $1 in ddp) echo 0,1;; fsdp) echo 2,3;; single) echo ${2:-0};; esac; }
  # every compile-on cell is its own job (inductor compiles take longest); compile-off cells run in
  # one lane per strategy; all jobs at once: 12 jobs on 4 GPUs and 64 cores
  for s in single ddp fsdp; do
    for p in 32-true 16-mixed bf16-mixed; do
      CUDA_VISIBLE_DEVICES=$(gpus $s 3) timeout ${LANE_S:-220} python3 $M --accelerator cuda --devices 2 --tol 1e-5 \
        --cells $s/$p/compile-on --out /tmp/m/$s-$p-on.json > /tmp/m/$s-$p-on.log 2>&1 &
    done
    CUDA_VISIBLE_DEVICES=$(gpus $s 1) timeout ${LANE_S:-220} python3 $M --accelerator cuda --devices 2 --tol 1e-5 \
      --cells $s/32-true/compile-off $s/16-mixed/compile-off $s/bf16-mixed/compile-off --out /tmp/m/$s-off.json > /tmp/m/$s-off.log 2>&1 &
  done
  wait
  python3 $M --merge $OUT/matrix-gpu.json /tmp/m/*.json
  for l in /tmp/m/*.log; do echo "=== $l"; tail -c 3000 $l; done >> $LOG
fi
if [[ $what == scaling || $what == all ]]; then
  timeout ${SCALING_S:-240} python3 -m benchmarks.distributed --world-sizes ${WORLDS:-1 2 4} --rows ${ROWS:-10000000} \
    --dim 64 --batch ${BATCH:-8192} --steps ${STEPS:-100} --warmup 10 --device-fraction 0.5 --threads 4 \
    --variants ${VARIANTS:-default store=checked+prepare=lookup} --repeat ${REPEAT:-5} --out $OUT/scaling.json >> $LOG 2>&1
  timeout ${OWNER_S:-120} python3 -m benchmarks.owner_host --rows 2500000 --busy 0 1 --busy-writes 1 \
    --reps 20 --json $OUT/owner-host.json >> $LOG 2>&1
fi
if [[ $what == tests || $what == all ]]; then
  timeout ${TESTS_S:-300} python3 -m pytest -q -p no:cacheprovider -m gpu -rA tests/distributed > $OUT/gpu-tests.log 2>&1
  echo "tests_rc=$?" >> $OUT/gpu-tests.log
  tail -25 $OUT/gpu-tests.log >> $LOG
fi
grep -h "^single\|^ddp\|^fsdp\|^world\|Error\|error" $LOG | cut -c1-400 | tail -60
