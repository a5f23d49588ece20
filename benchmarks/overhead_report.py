"""The overhead benchmark's figures from what every rank measured (``benchmarks/overhead.py``):
per strategy a summary (printed as a few lines, kept for ``--json``) and one row of the table.

Step times are wall time, every step of every rank pooled (p50, p99: a periodic slow step or a GIL
stall shows in p99). The paired figures (ratio, differences) come from the block totals, round by
round, so a drift of the machine's speed during the run cancels."""

from __future__ import annotations

import math
import statistics
from typing import Any

from benchmarks.accounting import HOOK_SWITCH

BARE, HOOK, TIMED = "bare", "hook", "timed"  # the builds (see overhead.Variant)


def median_ci(values: list[float]) -> tuple[float, float, float]:
    """Median and its distribution-free 95 % CI (order statistics n/2 ± 0.98·√n)."""
    xs = sorted(values)
    n = len(xs)
    half = 0.98 * math.sqrt(n)
    lo, hi = max(0, math.floor(n / 2 - half) - 1), min(n - 1, math.ceil(n / 2 + half))
    return statistics.median(xs), xs[lo], xs[hi]


def mean_ci(values: list[float]) -> tuple[float, float]:
    """Mean and the half-width of its 95 % CI (normal approximation)."""
    mean = statistics.fmean(values)
    sd = statistics.stdev(values) if len(values) > 1 else 0.0
    return mean, 1.96 * sd / math.sqrt(len(values))


def percentile(values: list[float], q: int) -> float:
    """The ``q``-th percentile (linear between order statistics)."""
    if len(values) < 2:
        return values[0]
    return statistics.quantiles(values, n=100, method="inclusive")[q - 1]


def round_sums(ranks: list[dict[str, Any]], build: str, rounds: int) -> list[float]:
    """Per round: the build's two blocks' mean step time (each averaged over the ranks), summed."""
    blocks = [
        statistics.fmean(statistics.fmean(r["steps"][build][i]) for r in ranks) for i in range(2 * rounds)
    ]  # each round runs every build twice, so blocks 2q and 2q+1 are round q's
    return [blocks[2 * q] + blocks[2 * q + 1] for q in range(rounds)]


def summarize(result: dict[str, Any]) -> dict[str, Any]:
    ranks, rounds = result["ranks"], result["rounds"]
    builds = list(ranks[0]["steps"])
    pooled = {b: [s for r in ranks for block in r["steps"][b] for s in block] for b in builds}
    p50 = {b: statistics.median(pooled[b]) for b in builds}
    p99 = {b: percentile(pooled[b], 99) for b in builds}
    sums = {b: round_sums(ranks, b, rounds) for b in builds}
    ratio = median_ci([t / b for t, b in zip(sums[TIMED], sums[BARE], strict=True)])
    diff = mean_ci([(t - b) / 2 for t, b in zip(sums[TIMED], sums[BARE], strict=True)])
    hook = mean_ci([(h - b) / 2 for h, b in zip(sums[HOOK], sums[BARE], strict=True)]) if HOOK in sums else None
    # the direct measurement: the rank whose instrumentation cost most, per step on average (a
    # periodic step counts as often as it comes)
    worst = max(ranks, key=lambda r: r["direct"]["main"] + r["direct"]["other"] + r["direct"]["writer"])
    direct = worst["direct"]
    overhead_us = (direct["main"] + direct["other"] + direct["writer"]) / 1e3
    switch_us = worst["by_name"].get(HOOK_SWITCH, 0.0) / 1e3
    per_step = [ns / 1e3 for r in ranks for ns in r["per_step_ns"]]
    return {
        "rounds": rounds,
        "block": result["block"],
        "builds": builds,
        "steps_per_build": len(pooled[BARE]),
        "p50_ms": {b: v * 1e3 for b, v in p50.items()},
        "p99_ms": {b: v * 1e3 for b, v in p99.items()},
        "delta_p50_pct": (p50[TIMED] / p50[BARE] - 1) * 100,
        "delta_p99_pct": (p99[TIMED] / p99[BARE] - 1) * 100,
        "ratio": ratio,
        "diff_pct": (diff[0] / p50[BARE] * 100, diff[1] / p50[BARE] * 100),
        "hook_switch_paired_us": None if hook is None else (hook[0] * 1e6, hook[1] * 1e6),
        "hook_switch_us": switch_us,
        "instrumentation_us": overhead_us - switch_us,
        "threads_us": {
            "training thread": direct["main"] / 1e3,
            "other threads": direct["other"] / 1e3,
            "SDK writer CPU": direct["writer"] / 1e3,
        },
        "overhead_step_us": (statistics.median(per_step), percentile(per_step, 99)),
        "calls": direct["calls"],
        "charge_us": worst["charge_ns"] / 1e3,
        "parts_us": {k: v / 1e3 for k, v in sorted(worst["by_name"].items(), key=lambda kv: -kv[1])},
        "overhead_us": overhead_us,
        "overhead_pct": overhead_us / (p50[BARE] * 1e6) * 100,
    }


def show(name: str, s: dict[str, Any]) -> None:
    """The strategy's summary as a few lines."""
    label = {BARE: "bare (no torchyard)", HOOK: "bare + torch's Python hook", TIMED: "instrumented"}
    order = ", ".join([*s["builds"], *reversed(s["builds"])])
    ratio, lo, hi = s["ratio"]
    bare_us = s["p50_ms"][BARE] * 1e3

    def pct(us: float) -> str:
        return f"{us:9.1f} µs/step = {us / bare_us * 100:.3f} %"

    lines = [
        f"== {name}: {s['rounds']} rounds of {s['block']}-step blocks ({order}); {s['steps_per_build']} steps per build",
        "  step wall time, all ranks           p50 ms     p99 ms",
        *(f"    {label[b]:<31} {s['p50_ms'][b]:9.3f}  {s['p99_ms'][b]:9.3f}" for b in s["builds"]),
        f"  instrumented vs bare           p50 {s['delta_p50_pct']:+.2f} %, p99 {s['delta_p99_pct']:+.2f} %",
        f"  paired ratio timed/bare        {ratio:9.4f}      95% CI [{lo:.4f}, {hi:.4f}]  (median over rounds)",
        f"  paired difference              {s['diff_pct'][0]:+9.2f} %    ± {s['diff_pct'][1]:.2f} % (mean, 95% CI)",
    ]
    if s["hook_switch_paired_us"] is not None:
        us, half = s["hook_switch_paired_us"]
        lines += [
            f"  hook switch, paired            {us:+9.1f} µs/step = {us / bare_us * 100:+.3f} % ± {half / bare_us * 100:.3f} % "
            "(torch's Python allreduce_hook, untimed, vs DDP's built-in all-reduce; wall time, mean, 95% CI)",
            f"  hook switch, measured          {pct(s['hook_switch_us'])} "
            "(the Python hook's own time; the division and the collective's launch in it, which the built-in "
            "path runs too, excluded)",
        ]
    parts = ", ".join(f"{k} {v:.1f}" for k, v in s["threads_us"].items())
    net = max(0.0, s["overhead_us"] - s["calls"] * s["charge_us"])
    lines += [
        f"  instrumentation, measured      {pct(s['instrumentation_us'])} (torchyard's own code)",
        f"  overhead, measured             {pct(s['overhead_us'])} of the bare p50 step "
        f"(instrumentation + hook switch; worst rank's mean over steps: {parts}; {s['calls']:.0f} wrapped calls/step)",
        f"  its steps, all ranks           p50 {s['overhead_step_us'][0]:.1f}, "
        f"p99 {s['overhead_step_us'][1]:.1f} µs (without the SDK writer)",
        f"  less the accounting's own cost {pct(net)} (≈ {s['charge_us']:.2f} µs charged per wrapped call, measured in place)",
        "  accounted parts (µs/step)      " + ", ".join(f"{k} {v:.1f}" for k, v in s["parts_us"].items()),
    ]
    print("\n".join(lines), flush=True)


def row(name: str, s: dict[str, Any]) -> tuple[str, ...]:
    paired = s["hook_switch_paired_us"]
    bare_us = s["p50_ms"][BARE] * 1e3
    return (
        name,
        f"{s['p50_ms'][BARE]:.3f}",
        f"{s['p99_ms'][BARE]:.3f}",
        f"{s['p50_ms'][TIMED]:.3f}",
        f"{s['p99_ms'][TIMED]:.3f}",
        f"{s['delta_p50_pct']:+.2f}",
        "{:.4f} [{:.4f}, {:.4f}]".format(*s["ratio"]),
        "—" if paired is None else f"{paired[0] / bare_us * 100:+.2f}±{paired[1] / bare_us * 100:.2f}",
        "—" if paired is None else f"{s['hook_switch_us']:.1f}",
        f"{s['instrumentation_us']:.1f}",
        f"{s['overhead_pct']:.3f}",
    )


HEADER = (
    "strategy",
    "bare p50",
    "bare p99",
    "instr p50",
    "instr p99",
    "Δp50 %",
    "ratio median [95% CI]",
    "hook Δ % paired",
    "hook µs",
    "instr µs",
    "overhead %",
)


def table(rows: list[tuple[str, ...]], footer: str) -> None:
    widths = [max(len(r[i]) for r in [HEADER, *rows]) for i in range(len(HEADER))]
    print()
    for r in [HEADER, *rows]:
        print("  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths, strict=True))))
    print(footer, flush=True)
