#!/usr/bin/env bash
# On a CUDA machine (≥ 2 GPUs for the 2-rank runs; 1 GPU runs the NCCL path with 1 rank where it
# can): every strategy on NCCL/CUDA through the real entrypoint, checked for a zero exit and for the
# comm figures in the log (every 10th step traced by torch.profiler: the NCCL-kernel path), then the overhead benchmark's DDP rows. Budget: < 8 minutes.
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
WORKLOAD='{"name":"charlm","params":{"d_model":256,"n_layers":4,"n_heads":4,"seq_len":128,"corpus_bytes":2000000}}'
STRATEGIES=(
  '{"kind":"ddp"}'
  '{"kind":"ddp","comm_hook":"fp16"}'
  '{"kind":"ddp","comm_hook":"bf16"}'
  '{"kind":"ddp","comm_hook":"powersgd","powersgd_rank":4,"powersgd_warmup":5}'
  '{"kind":"zero"}'
  '{"kind":"local_sgd","period":4,"warmup_steps":5}'
  '{"kind":"fsdp"}'
  '{"kind":"fsdp","reshard_after_forward":false}'
  '{"kind":"pipeline","microbatches":4,"schedule":"gpipe"}'
  '{"kind":"pipeline","microbatches":4,"schedule":"1f1b"}'
)
fail=0
start=$(date +%s)
for strategy in "${STRATEGIES[@]}"; do
  kind=$(python -c "import json,sys; print(json.loads(sys.argv[1])['kind'])" "$strategy")
  if [ "$PROCS" -lt 2 ] && [ "$kind" != ddp ]; then echo "skip $strategy (needs 2 GPUs)"; continue; fi
  spec="{\"name\":\"gpu-check\",\"workload\":$WORKLOAD,\"strategy\":$strategy,\"resources\":{\"procs_per_node\":$PROCS,\"device\":\"cuda\"},\"training\":{\"steps\":$STEPS,\"batch_size\":32,\"lr\":0.001,\"seed\":0,\"profile_every\":10}}"
  log=$(mktemp)
  if TORCHYARD_SPEC="$spec" timeout 120 python -m torch.distributed.run --standalone --nproc-per-node "$PROCS" \
       -m workers.runtime.train >"$log" 2>&1 && grep -q "done, $STEPS steps" "$log"; then
    echo "ok   $strategy: $(grep -m1 'all-reduce busbw' "$log" | sed 's/.*all-reduce busbw/busbw/') | $(grep "step $STEPS/$STEPS" "$log" | head -1)"
  else
    echo "FAIL $strategy"; tail -30 "$log"; fail=1
  fi
  rm -f "$log"
done
if [ "$PROCS" -ge 2 ]; then
  timeout 180 python -m torch.distributed.run --standalone --nproc-per-node 2 -m benchmarks.overhead \
    --device cuda --steps 20 --reps 5 --only ddp/allreduce ddp/fp16 fsdp || fail=1
fi
echo "gpu_check: $(( $(date +%s) - start )) s, $([ $fail = 0 ] && echo passed || echo FAILED)"
exit $fail
