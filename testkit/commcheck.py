"""The collectives our timer counts in a step, next to those torch's own ``CommDebugMode`` sees (it
intercepts every c10d and functional-collective op at dispatch), for a strategy on real Gloo ranks:

    python -m torch.distributed.run --standalone --nproc-per-node N -m testkit.commcheck OUT.json

reads the run spec from ``TORCHYARD_SPEC`` (as the rank entrypoint does), builds the workload and the
strategy with a :class:`CommTimer`, runs one step, then one more under ``CommDebugMode`` inside a
timer step, and rank 0 writes ``{"timer": {kind: count}, "torch": {op: count}}`` to OUT.json.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections import Counter
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
# CommDebugMode's op names → our collective kinds
TORCH_KINDS = {
    "c10d_functional.all_reduce": "all_reduce",
    "c10d.allreduce_": "all_reduce",
    "c10d_functional.all_gather_into_tensor": "all_gather",
    "c10d._allgather_base_": "all_gather",
    "c10d_functional.reduce_scatter_tensor": "reduce_scatter",
    "c10d._reduce_scatter_base_": "reduce_scatter",
}


def comm_counts(spec: dict[str, Any], out: Path, timeout: float = 120) -> dict[str, dict[str, int]]:
    """Run this module under torchrun for ``spec``; {"timer": {kind: n}, "torch": {kind: n}} of one step."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("TORCHYARD_")}
    env.update(TORCHYARD_SPEC=json.dumps(spec), OMP_NUM_THREADS="1")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    procs = str(spec["resources"]["procs_per_node"])
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nnodes", "1", "--nproc-per-node", procs,
           "-m", "testkit.commcheck", str(out)]  # fmt: skip
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-5000:]
    found: dict[str, dict[str, int]] = json.loads(out.read_text())
    return found


def main() -> None:
    import torch
    import torch.distributed as dist
    from torch.distributed.tensor.debug import CommDebugMode

    from torchyard.spec import RunSpec
    from workers.runtime import strategies
    from workers.runtime.comm import CommTimer
    from workers.runtime.train import batches, seed_everything
    from workers.runtime.workloads import build

    spec = RunSpec.model_validate_json(os.environ["TORCHYARD_SPEC"])
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    seed_everything(spec.training.seed)
    workload = build(spec)
    device = torch.device("cpu")
    timer = CommTimer(world, device)
    strategy = strategies.build(spec, workload, device, timer)
    shard, shards = strategy.data_shard(rank, world)
    data = batches(workload, spec.training.batch_size // shards, shard, shards, spec.training.seed)
    strategy.train_step(next(data))  # the first step builds what later steps reuse
    batch = next(data)
    timer.begin_step(1)
    with CommDebugMode() as debug:
        strategy.train_step(batch)
    step = timer._step
    assert step is not None
    ours = Counter(kind for _s, _e, nbytes, kind, _n in step.comms if nbytes > 0)
    ours.update(kind for nbytes, kind, _n in step.extra_bytes if nbytes > 0)
    theirs: Counter[str] = Counter()
    for op, count in debug.get_comm_counts().items():
        theirs[TORCH_KINDS.get(str(op), str(op))] += count
    strategy.close()
    if rank == 0:
        Path(sys.argv[1]).write_text(json.dumps({"timer": dict(ours), "torch": dict(theirs)}))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
