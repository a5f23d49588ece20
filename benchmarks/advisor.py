"""The scaling advisor, validated (prints a table; not a test): for DDP and FSDP, a 2-rank run is
projected to 4 ranks (``GET /runs/{id}/projection``), then 4-rank runs are measured: one node of 4,
and, where network namespaces are at hand (root), 2 nodes × 2 on the netns cluster
(``testkit/cluster.py``). Projected against measured samples/s, and the error.

    python -m benchmarks.advisor [--repeats 3] [--steps 80] [--workload mlp|charlm] [--no-netns] [--json FILE]

Samples/s on both sides is one definition (the advisor's ``measured``): the global batch over the
median of the slowest rank's step time, over the run's steady steps. Weak scaling: each rank keeps
its batch (32), so the 4-rank runs' global batch is twice the 2-rank run's. Runs go one at a time.

The netns cluster's nodes are one machine: its two "nodes" share its cores, so the 2 × 2
projection is asked with ``cores_per_node`` = the machine's cores / 2 (the advisor takes the target
hardware as given). A loaded machine (other work on its cores) moves every figure: the repeats show
how much; the 2-rank runs' own spread is printed beside the errors."""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

from testkit import netns
from testkit.cluster import running_cluster
from testkit.stack import Client, sqlite_stack

PER_RANK_BATCH = 32
WORKLOADS = {
    "mlp": {"name": "mlp", "params": {"hidden": 512, "layers": 3, "samples": 16384}},
    "charlm": {"name": "charlm", "params": {"d_model": 128, "n_layers": 2, "n_heads": 4, "seq_len": 64}},
}
STRATEGIES = {"ddp": {"kind": "ddp"}, "fsdp": {"kind": "fsdp"}}


def spec(workload: str, strategy: str, nodes: int, procs: int, steps: int) -> dict[str, Any]:
    return {
        "name": f"advisor-{strategy}-{nodes}x{procs}",
        "workload": {"kind": "builtin", **WORKLOADS[workload]},
        "strategy": STRATEGIES[strategy],
        "resources": {"nodes": nodes, "procs_per_node": procs, "device": "cpu"},
        "training": {"steps": steps, "batch_size": PER_RANK_BATCH * nodes * procs, "lr": 0.003, "seed": 0},
    }


def finished(client: Client, body: dict[str, Any]) -> int:
    response = client.http.post("/api/v1/runs", json=body)
    assert response.status_code == 201, response.text
    run_id = int(response.json()["id"])
    client.wait_status(run_id, {"succeeded"}, timeout=600)
    return run_id


def projection(client: Client, run_id: int, **query: Any) -> dict[str, Any]:
    response = client.http.get(f"/api/v1/runs/{run_id}/projection", params=query)
    assert response.status_code == 200, response.text
    return dict(response.json())


def parts(figures: dict[str, Any]) -> str:
    ms = [figures[k] * 1e3 for k in ("data_time_s", "compute_time_s", "exposed_comm_s", "comm_time_s")]
    return f"{ms[0]:.1f}+{ms[1]:.1f}+{ms[2]:.1f} ({ms[3]:.1f})"


@contextmanager
def platform(use_netns: bool) -> Iterator[tuple[Client, bool]]:
    """A client of a cluster of netns hosts (host-0 with 4 slots), else of a one-node stack."""
    with ExitStack() as stack:
        tmp = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="advisor-")))
        if use_netns:
            yield stack.enter_context(running_cluster(tmp)).client, True
        else:
            yield stack.enter_context(sqlite_stack(tmp)).client, False


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--steps", type=int, default=80)
    parser.add_argument("--workload", choices=sorted(WORKLOADS), default="mlp")
    parser.add_argument("--no-netns", action="store_true", help="one node only (no 2 × 2 runs)")
    parser.add_argument("--json", type=Path, help="keep every pair's figures (both runs' measured, the projection)")
    args = parser.parse_args()
    cores = len(os.sched_getaffinity(0))
    rows: list[tuple[str, str, int, float, float, float]] = []
    kept: list[dict[str, Any]] = []
    base: dict[str, list[float]] = {s: [] for s in STRATEGIES}
    with platform(netns.available() and not args.no_netns) as (client, multi):
        for repeat in range(1, args.repeats + 1):
            for strategy in STRATEGIES:
                two = finished(client, spec(args.workload, strategy, 1, 2, args.steps))
                one_node = projection(client, two, ranks="4", ranks_per_node=4)
                base[strategy].append(one_node["measured"]["samples_per_s"])
                layouts = [("1 × 4", 1, 4, one_node)]
                if multi:
                    two_nodes = projection(client, two, ranks="4", ranks_per_node=2, cores_per_node=max(1, cores // 2))
                    layouts.append(("2 × 2", 2, 2, two_nodes))
                for layout, nodes, procs, proj in layouts:
                    four = finished(client, spec(args.workload, strategy, nodes, procs, args.steps))
                    got = projection(client, four, ranks="4")["measured"]
                    point = proj["points"][0]
                    projected, measured = point["samples_per_s"], got["samples_per_s"]
                    rows.append((strategy, layout, repeat, projected, measured, projected / measured - 1))
                    kept.append(
                        {"strategy": strategy, "layout": layout, "repeat": repeat, "projection": proj, "four": got}
                    )
                    print(
                        f"{strategy:<5} {layout} #{repeat}: 2 ranks {base[strategy][-1]:,.0f}/s; 4 ranks "
                        f"projected {projected:,.0f}/s, measured {measured:,.0f}/s ({rows[-1][-1]:+.0%}); "
                        f"ms data+compute+exposed (comm): 2 ranks {parts(one_node['measured'])}; 4 ranks "
                        f"projected {parts(point)}, measured {parts(got)}",
                        flush=True,
                    )
    print(f"\n{args.workload}, {PER_RANK_BATCH} samples a rank, {args.steps} steps, {cores} cores\n")
    print(f"{'strategy':<9}{'4 ranks':<8}{'#':>3}{'projected/s':>13}{'measured/s':>12}{'error':>8}")
    for strategy, layout, repeat, projected, measured, error in rows:
        print(f"{strategy:<9}{layout:<8}{repeat:>3}{projected:>13,.0f}{measured:>12,.0f}{error:>+8.0%}")
    within = sum(abs(r[-1]) <= 0.15 for r in rows)
    if args.json:
        args.json.write_text(json.dumps(kept, indent=1))
    print(f"\nwithin 15 %: {within}/{len(rows)}")
    for strategy, values in base.items():
        if len(values) > 1:
            spread = (max(values) - min(values)) / statistics.fmean(values)
            print(f"{strategy}: 2-rank runs {min(values):,.0f}–{max(values):,.0f}/s (spread {spread:.0%})")


if __name__ == "__main__":
    main()
