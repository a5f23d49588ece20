"""TPE + ASHA against random search without pruning, on one live stack, same budget and seed: a
sweep over the mlp's learning rate (log-uniform, diverging rates up to 1.0 included), trials as
2-rank runs. For each: the training steps spent (every trial's steps, pruned ones' up to where they
stopped) and the wall time, in all and until a trial first finished at or below the target loss
(default: the worse of the two sweeps' best losses, which both reached). Prints both and the ratio
random / TPE+ASHA (> 1: the pruned search got there cheaper).

    python -m benchmarks.sweep [--trials 12] [--concurrent 2] [--steps 600] [--target LOSS] [--seed 0]
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path
from typing import Any

from cli.wait import wait_for
from testkit.stack import RunningStack, run_spec, sqlite_stack


def sweep_once(stack: RunningStack, args: argparse.Namespace, sampler: str, pruner: dict[str, Any]) -> dict[str, Any]:
    base = run_spec(name="bench", procs=2, steps=args.steps, batch_size=64, params={"hidden": 32, "samples": 2048})
    base["training"]["log_every"] = 5
    spec = {
        "name": f"bench-{sampler}-{pruner['kind']}",
        "base": base,
        "space": {"training.lr": {"type": "float", "low": 1e-4, "high": 1.0, "log": True}},
        "objective": {"metric": "loss", "direction": "minimize", "take": "last"},
        "n_trials": args.trials,
        "max_concurrent": args.concurrent,
        "sampler": sampler,
        "pruner": pruner,
        "seed": args.seed,
    }
    http = stack.client.http
    started = time.monotonic()
    sweep_id = http.post("/api/v1/sweeps", json=spec).raise_for_status().json()["id"]
    history: list[tuple[float, int, float | None]] = []  # (seconds, steps spent, best loss so far)

    def ended() -> dict[str, Any] | None:
        sweep = http.get(f"/api/v1/sweeps/{sweep_id}").json()
        history.append((time.monotonic() - started, spent(stack, sweep["trials"]), sweep["best_value"]))
        done = sweep["status"] != "running" and all(t["state"] != "running" for t in sweep["trials"])
        return sweep if done else None

    sweep = wait_for(ended, 3600, f"sweep {sweep_id}", interval=0.5)
    return {
        "wall_s": time.monotonic() - started,
        "steps": spent(stack, sweep["trials"]),
        "best": sweep["best_value"],
        "pruned": sum(1 for t in sweep["trials"] if t["state"] == "pruned"),
        "history": history,
    }


def spent(stack: RunningStack, trials: list[dict[str, Any]]) -> int:
    """Steps the trials' runs trained (a pruned run's up to where its ranks stopped)."""
    return sum(stack.client.run(t["run_id"])["last_step"] for t in trials if t["run_id"] is not None)


def reached(result: dict[str, Any], target: float) -> tuple[float, int] | None:
    """(seconds, steps spent) when the best loss first was at or below ``target``."""
    return next(((s, n) for s, n, best in result["history"] if best is not None and best <= target), None)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--trials", type=int, default=12)
    parser.add_argument("--concurrent", type=int, default=2)
    parser.add_argument("--steps", type=int, default=600)
    parser.add_argument("--target", type=float, default=None, help="default: the worse of the two best losses")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    results: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory(prefix="torchyard-sweep-") as tmp, sqlite_stack(Path(tmp)) as stack:
        asha = {"kind": "asha", "min_steps": max(1, args.steps // 8), "reduction_factor": 3}
        for label, sampler, pruner in (("tpe+asha", "tpe", asha), ("random", "random", {"kind": "none"})):
            results[label] = r = sweep_once(stack, args, sampler, pruner)
            print(
                f"{label:9s} {args.trials} trials: {r['steps']:6d} steps, {r['wall_s']:6.1f} s, "
                f"best loss {r['best']:.4g}, {r['pruned']} pruned",
                flush=True,
            )
    a, b = results["tpe+asha"], results["random"]
    print(f"ratio random / tpe+asha, whole budget: steps {b['steps'] / max(1, a['steps']):.2f}×, "
          f"wall {b['wall_s'] / a['wall_s']:.2f}×")  # fmt: skip
    target = args.target if args.target is not None else max(a["best"], b["best"])
    hit_a, hit_b = reached(a, target), reached(b, target)
    for label, hit in (("tpe+asha", hit_a), ("random", hit_b)):
        print(f"{label:9s} to loss ≤ {target:.4g}: " + (f"{hit[1]} steps, {hit[0]:.1f} s" if hit else "never"))
    if hit_a and hit_b:
        print(f"ratio random / tpe+asha, to the target: steps {hit_b[1] / max(1, hit_a[1]):.2f}×, "
              f"wall {hit_b[0] / hit_a[0]:.2f}×")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
