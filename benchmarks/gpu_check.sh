#!/usr/bin/env bash
# On a CUDA machine (≥ 2 GPUs for the 2-rank runs; 1 GPU runs the NCCL path with 1 rank where it
# can): every strategy on NCCL/CUDA through the real entrypoint with its metrics checked
# (benchmarks/gpu_check.py; every 10th step traced by torch.profiler: the NCCL-kernel path), then the
# overhead benchmark's DDP rows. Budget: < 8 minutes.
# CI skips this (no GPU). Usage: benchmarks/gpu_check.sh [steps]
set -euo pipefail
cd "$(dirname "$0")/.."
STEPS=${1:-30}
command -v nvidia-smi >/dev/null || { echo "gpu_check: no nvidia-smi: not a CUDA machine, skipped"; exit 0; }
GPUS=$(python -c 'import torch; print(torch.cuda.device_count())')
[ "$GPUS" -ge 1 ] || { echo "gpu_check: torch sees no CUDA device, skipped"; exit 0; }
PROCS=$(( GPUS >= 2 ? 2 : 1 ))
echo "gpu_check: $GPUS GPU(s), runs of $PROCS rank(s), $STEPS steps each"
export OMP_NUM_THREADS=1
unset TORCH_DISTRIBUTED_DEBUG   # DETAIL segfaults DDP on Gloo; never set it here either
fail=0
start=$(date +%s)
# Every strategy through the real entrypoint, the SDK into a private Redis; what the ranks wrote is
# checked (benchmarks/gpu_check.py: every step once, plausible event-timed figures, NVML figures,
# kernel lanes per stream, FSDP's exposed < comm). `--device cpu` runs the same checks on Gloo.
python -m benchmarks.gpu_check --device cuda --procs "$PROCS" --steps "$STEPS" || fail=1
if [ "$GPUS" -ge 4 ]; then  # the 2-D mesh (FSDP across 2 groups of TP over 2 GPUs) needs 4 ranks
  python -m benchmarks.gpu_check --device cuda --procs 4 --steps "$STEPS" --only fsdp_tp || fail=1
fi
if [ "$PROCS" -ge 2 ]; then
  timeout 180 python -m torch.distributed.run --standalone --nproc-per-node 2 -m benchmarks.overhead \
    --device cuda --steps 20 --reps 5 --only ddp/allreduce ddp/fp16 fsdp || fail=1
fi
echo "gpu_check: $(( $(date +%s) - start )) s, $([ $fail = 0 ] && echo passed || echo FAILED)"
exit $fail
