"""The chaos suite repeated: every scenario of ``testkit/chaos.py`` N times on one live stack, and the
two-gangs-on-three-nodes scenario N times on a network-namespace cluster (root and iproute2; it is
skipped with a note otherwise). Prints each scenario's pass count, its time, and the first line of
each failure.

    python -m benchmarks.chaos [--repeat 10] [--only kill_worker,api_restart]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path

from testkit import netns
from testkit.chaos import SCENARIOS, Chaos
from testkit.cluster import running_cluster, two_gangs_on_three_nodes
from testkit.stack import sqlite_stack

GANGS = "two_gangs_on_three_nodes"


class Tally:
    def __init__(self) -> None:
        self.passed: dict[str, int] = {}
        self.times: dict[str, list[float]] = {}
        self.failures: dict[str, list[str]] = {}

    def attempt(self, name: str, rep: int, scenario: Callable[[], None]) -> None:
        start = time.monotonic()
        try:
            scenario()
            self.passed[name] = self.passed.get(name, 0) + 1
            outcome = "pass"
        except Exception as error:  # a failed check or a broken scenario: both count against it
            first = (traceback.format_exception_only(error)[-1].strip() or repr(error))[:300]
            self.failures.setdefault(name, []).append(f"rep {rep}: {first}")
            outcome = f"FAIL {first[:120]}"
        self.times.setdefault(name, []).append(time.monotonic() - start)
        print(f"  {name:28s} rep {rep:2d}: {outcome} ({self.times[name][-1]:.1f} s)", flush=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeat", type=int, default=10, help="repetitions of each scenario")
    parser.add_argument("--only", default="", help=f"comma-separated scenarios (of: {', '.join([*SCENARIOS, GANGS])})")
    args = parser.parse_args()
    chosen = [s for s in args.only.split(",") if s] or [*SCENARIOS, GANGS]
    unknown = set(chosen) - {*SCENARIOS, GANGS}
    if unknown:
        parser.error(f"unknown scenario(s): {', '.join(sorted(unknown))}")
    tally = Tally()
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="torchyard-chaos-") as tmp:
        local = [s for s in chosen if s in SCENARIOS]
        if local:
            with sqlite_stack(Path(tmp) / "stack") as running:
                chaos = Chaos(running)
                for rep in range(1, args.repeat + 1):
                    for name in local:
                        tally.attempt(name, rep, lambda name=name: SCENARIOS[name](chaos))  # type: ignore[misc]
        if GANGS in chosen:
            if not netns.available():
                print(f"  {GANGS}: skipped (network namespaces need root and iproute2)")
            else:
                with running_cluster(Path(tmp) / "cluster") as cluster:
                    for rep in range(1, args.repeat + 1):
                        tally.attempt(GANGS, rep, lambda: two_gangs_on_three_nodes(cluster))

    print(f"\nscenario                      passed   median s   max s   ({time.monotonic() - started:.0f} s in all)")
    for name in chosen:
        times = tally.times.get(name)
        if times:
            print(
                f"{name:28s}  {tally.passed.get(name, 0):3d}/{len(times):<3d} {statistics.median(times):9.1f} {max(times):7.1f}"
            )
    for name, failures in tally.failures.items():
        print(f"\n{name} failures:\n  " + "\n  ".join(failures))
    return 0 if not tally.failures else 1


if __name__ == "__main__":
    raise SystemExit(main())
