"""What a finished run measured, read for the scaling advisor (``backend/advisor.py``): its newest
attempt's facts (rank 0's word: world, cores, calibration, collectives per step) and medians of its
steady steps. A run the advisor cannot project from is a ``Conflict`` saying why."""

from __future__ import annotations

import statistics
from collections import defaultdict

from sqlalchemy import func, or_, select
from sqlalchemy.orm import Session

from backend import advisor, errors
from backend.models import Attempt, Metric, Run
from torchyard.collectives import KIND_BYTES
from torchyard.facts import RunFacts
from torchyard.spec import ScriptConfig
from torchyard.states import TERMINAL

WARMUP_STEPS = 3  # an attempt's first steps build DDP's buckets, warm allocators and caches
WINDOW = 1000  # the newest steady steps read (at most this many per rank and key)
TIMES = ("step_time_s", "data_time_s", "comm_time_s", "exposed_comm_s")
STATE = ("param_bytes", "optimizer_state_bytes")
PEAK = {"cpu": "max_rss_bytes", "cuda": "cuda_max_allocated_bytes"}


def measured(session: Session, run: Run) -> advisor.Measured:
    spec = run.run_spec
    if run.status not in TERMINAL:
        raise errors.Conflict(f"run {run.id} is {run.status}: the advisor projects from a finished run")
    if isinstance(spec.workload, ScriptConfig):
        raise errors.Conflict(f"run {run.id} runs a script, whose parallelism is its own: not modelled")
    kind = spec.strategy.kind
    if kind not in advisor.PROJECTED:
        raise errors.Conflict(f"run {run.id} is {kind}: {advisor.NOT_PROJECTED.get(kind, 'not modelled')}")
    attempt = next((a for a in reversed(run.attempts) if a.facts), None)
    if attempt is None:
        raise errors.Conflict(
            f"run {run.id} has no facts from its rank 0 (told after its second step): it ended before, "
            "or ran before the advisor existed"
        )
    facts = RunFacts.model_validate(attempt.facts)
    if facts.world < 2:
        raise errors.Conflict(
            f"run {run.id} ran on one rank: no collectives to project from; run it on 2 ranks or more"
        )
    if not facts.calibration:
        raise errors.Conflict(f"run {run.id} has no calibration of its links: nothing to fit the comm model to")
    medians, steps, peak, state = _steady(session, run, attempt, facts.device)
    if not steps:
        raise errors.Conflict(f"run {run.id} logged no step time in attempt {attempt.number}: nothing to project from")
    return advisor.Measured(
        strategy=kind,
        world=facts.world,
        nodes=facts.nodes,
        ranks_per_node=facts.ranks_per_node,
        cpu_cores=facts.cpu_cores,
        device=facts.device,
        per_rank_batch=spec.training.batch_size // facts.world,
        step_time_s=medians.get("step_time_s", 0.0),
        data_time_s=medians.get("data_time_s", 0.0),
        comm_time_s=medians.get("comm_time_s", 0.0),
        exposed_comm_s=medians.get("exposed_comm_s", 0.0),
        bytes_per_step={k.removeprefix(KIND_BYTES): v for k, v in medians.items() if k.startswith(KIND_BYTES)},
        ops_per_step={str(k): n for k, n in facts.ops_per_step.items()},
        calibration=facts.calibration,
        peak_bytes=peak,
        param_bytes=state.get("param_bytes", 0.0),
        optimizer_state_bytes=state.get("optimizer_state_bytes", 0.0),
        steps=steps,
    )


def _steady(
    session: Session, run: Run, attempt: Attempt, device: str
) -> tuple[dict[str, float], int, float, dict[str, float]]:
    """Over the attempt's newest steady steps: each key's median of its per-step figure (step time:
    the slowest rank's; the rest: the mean over ranks), how many steps, the highest peak memory of
    any rank, and the state bytes one rank holds (the most any rank holds)."""
    last = session.scalar(
        select(func.max(Metric.step)).where(
            Metric.run_id == run.id, Metric.attempt == attempt.number, Metric.key == "step_time_s"
        )
    )
    if last is None:
        return {}, 0, 0.0, {}
    first = (attempt.first_step or 1) + WARMUP_STEPS
    lo = max(first, last - WINDOW + 1) if last >= first else 1  # a short run: every step it has
    wanted = (*TIMES, *STATE, PEAK[device])
    rows = (
        session.connection()
        .execute(
            select(Metric.step, Metric.key, Metric.value).where(
                Metric.run_id == run.id,
                Metric.attempt == attempt.number,
                Metric.step >= lo,
                Metric.step <= last,
                or_(Metric.key.in_(wanted), Metric.key.like(f"{KIND_BYTES}%")),
            )
        )
        .all()
    )
    per_step: dict[str, dict[int, list[float]]] = defaultdict(lambda: defaultdict(list))
    for step, key, value in rows:
        if value is not None:  # a NaN stored as NULL
            per_step[key][step].append(value)
    medians = {
        key: statistics.median(max(v) if key == "step_time_s" else statistics.fmean(v) for v in by_step.values())
        for key, by_step in per_step.items()
        if key in TIMES or key.startswith(KIND_BYTES)
    }
    state = {key: statistics.median(max(v) for v in per_step[key].values()) for key in STATE if key in per_step}
    peak = max((max(v) for v in per_step[PEAK[device]].values()), default=0.0)
    return medians, len(per_step["step_time_s"]), peak, state
