"""The scaling advisor: the ring's arithmetic, the comm model fitted to a calibration, hidden comm,
ranks sharing cores, FSDP's memory split, bad input; and a run's facts from its rank stream through
ingest to a projection read from the database (no stack: a finished run over the api is checked in
tests/test_e2e.py)."""

from __future__ import annotations

import dataclasses
import json
from typing import Any

import pytest
from sqlalchemy.orm import Session

from backend import advisor, errors, scaling
from backend.advisor import Measured, fit_link, project
from backend.ingest import apply_entries
from backend.models import Attempt
from backend.routes.projection import parse_ranks
from backend.screening import screen_rank_entry
from testkit.ingest import add_run
from torchyard import streams
from torchyard.collectives import Collective, bus_factor, ring_hops

pytestmark = pytest.mark.timeout(30)
AR, AG, RS = Collective.ALL_REDUCE, Collective.ALL_GATHER, Collective.REDUCE_SCATTER
ALPHA, BETA = 100e-6, 2.0  # the link the calibrations below are made from: 100 µs a hop, 2 GB/s


def calibration(world: int, alpha: float = ALPHA, beta: float = BETA) -> dict[int, float]:
    """All-reduce busbw per size as a link of ``alpha`` and ``beta`` would measure it."""
    table = {}
    for size in (4 << 10, 256 << 10, 4 << 20, 32 << 20):
        seconds = ring_hops(AR, world) * alpha + size * bus_factor(AR, world) / (beta * 1e9)
        table[size] = size * bus_factor(AR, world) / seconds / 1e9
    return table


def measured(**overrides: Any) -> Measured:
    """A DDP run of 2 ranks on a node of 2 cores: 10 ms compute, 1 ms data, one 4 MB all-reduce
    that took 6 ms, 2 of them hidden behind backward."""
    base: dict[str, Any] = dict(
        strategy="ddp", world=2, nodes=1, ranks_per_node=2, cpu_cores=2, device="cpu", per_rank_batch=32,
        step_time_s=0.015, data_time_s=0.001, comm_time_s=0.006, exposed_comm_s=0.004,
        bytes_per_step={AR: 4e6}, ops_per_step={AR: 1}, calibration=calibration(2),
        peak_bytes=500e6, param_bytes=4e6, optimizer_state_bytes=8e6, steps=50,
    )  # fmt: skip
    return Measured(**{**base, **overrides})


def test_bus_factors_and_hops_are_the_rings() -> None:
    assert bus_factor(AR, 4) == 1.5 and ring_hops(AR, 4) == 6
    assert bus_factor(AG, 4) == 0.75 and ring_hops(RS, 4) == 3
    assert bus_factor(Collective.BROADCAST, 4) == 1 and ring_hops(Collective.SEND_RECV, 4) == 1
    assert bus_factor(AR, 1) == 0 and ring_hops(AG, 1) == 0


@pytest.mark.parametrize("world", [2, 4])
def test_the_link_is_fitted_back_from_its_calibration(world: int) -> None:
    link = fit_link(calibration(world), world)
    assert link.latency_s == pytest.approx(ALPHA, rel=1e-6) and link.busbw_GBps == pytest.approx(BETA, rel=1e-6)
    latency_only = fit_link(calibration(world, beta=1e12), world)  # no bandwidth limit in sight
    assert latency_only.latency_s == pytest.approx(ALPHA, rel=1e-3)


def test_the_measured_world_projects_to_the_run_itself() -> None:
    m = measured()
    (point,) = project(m, [2]).points
    assert point.step_time_s == pytest.approx(m.step_time_s) and point.samples_per_s == pytest.approx(m.samples_per_s)
    assert point.comm_time_s == pytest.approx(m.comm_time_s) and point.exposed_comm_s == pytest.approx(0.004)


def test_comm_grows_with_the_rings_hops_and_factor_at_the_runs_own_efficiency() -> None:
    m = measured(cpu_cores=64)  # no core sharing at any world size here
    p = project(m, [1, 2, 4, 8], ranks_per_node=8)
    link = fit_link(m.calibration, 2)
    model = {n: sum(link.seconds(AR, 4e6, n)) for n in (2, 4, 8)}
    assert p.comm_efficiency == pytest.approx(model[2] / m.comm_time_s)
    by_n = {pt.ranks: pt for pt in p.points}
    for n in (4, 8):
        assert by_n[n].comm_time_s == pytest.approx(m.comm_time_s * model[n] / model[2])
        assert by_n[n].compute_time_s == pytest.approx(m.compute_time_s)  # weak scaling: compute stays
        assert by_n[n].samples_per_s == pytest.approx(32 * n / by_n[n].step_time_s)
    assert by_n[1].comm_time_s == 0 and by_n[1].efficiency == 1
    assert by_n[8].efficiency == pytest.approx(by_n[1].step_time_s / by_n[8].step_time_s) and by_n[8].efficiency < 1


def test_comm_hidden_behind_backward_stays_hidden_while_it_fits() -> None:
    # 6 ms of comm, all of it hidden; a latency-bound link: 4 hops at 3 ranks take twice the 2 hops
    m = measured(cpu_cores=64, comm_time_s=0.006, exposed_comm_s=0.0, step_time_s=0.011,
                 calibration=calibration(2, beta=1e12))  # fmt: skip
    by_n = {pt.ranks: pt for pt in project(m, [2, 3]).points}
    assert by_n[2].exposed_comm_s == 0
    assert by_n[3].comm_time_s == pytest.approx(0.012, rel=1e-3)
    assert by_n[3].exposed_comm_s == pytest.approx(0.006, rel=1e-3)  # what no longer fits the window


def test_ranks_beyond_a_nodes_cores_slow_compute_and_the_bandwidth_part() -> None:
    m = measured()  # 2 ranks on 2 cores
    one_node = project(m, [4], ranks_per_node=4).points[0]
    two_nodes = project(m, [4], ranks_per_node=2).points[0]
    more_cores = project(m, [4], ranks_per_node=4, cores_per_node=4).points[0]
    assert one_node.compute_time_s == pytest.approx(2 * m.compute_time_s)
    assert two_nodes.compute_time_s == more_cores.compute_time_s == pytest.approx(m.compute_time_s)
    assert two_nodes.nodes == 2 and one_node.nodes == 1
    bandwidth = one_node.comm_time_s - one_node.latency_s
    assert bandwidth == pytest.approx(2 * (more_cores.comm_time_s - more_cores.latency_s))
    assert one_node.latency_s == pytest.approx(more_cores.latency_s)  # hops, not cores
    gpu = project(measured(device="cuda"), [4], ranks_per_node=4).points[0]
    assert gpu.compute_time_s == pytest.approx(m.compute_time_s)


def test_fsdp_splits_parameters_gradients_and_optimizer_over_the_ranks_and_ddp_keeps_them_whole() -> None:
    fsdp = measured(strategy="fsdp", bytes_per_step={AG: 8e6, RS: 4e6}, ops_per_step={AG: 8, RS: 4},
                    param_bytes=2e6, optimizer_state_bytes=4e6)  # fmt: skip
    by_n = {pt.ranks: pt for pt in project(fsdp, [1, 2, 8]).points}
    whole = 2 * (2 * 2e6 + 4e6)  # 2 ranks held half each: parameters, their gradients, the optimizer state
    assert by_n[1].state_bytes == pytest.approx(whole) and by_n[8].state_bytes == pytest.approx(whole / 8)
    assert by_n[8].peak_bytes == pytest.approx(500e6 - whole / 2 + whole / 8)
    ddp = {pt.ranks: pt for pt in project(measured(), [1, 8]).points}
    assert ddp[1].state_bytes == ddp[8].state_bytes == measured().state_bytes and ddp[8].peak_bytes == 500e6


def test_other_strategies_are_excluded_with_their_reason_and_assumptions_are_spelled_out() -> None:
    p = project(measured(), [4], ranks_per_node=2)
    assert set(p.excluded) == {*advisor.NOT_PROJECTED, "fsdp"} and "pipeline" in p.excluded
    said = " ".join(p.assumptions)
    assert "weak scaling" in said and "hidden" in said and "2 cores" in said and "between nodes" in said
    with pytest.raises(ValueError, match="ZeRO"):
        project(measured(strategy="zero"), [4])


@pytest.mark.parametrize(
    ("ranks", "message"),
    [([0], "between 1 and"), ([], "at least one"), ([5000], "between 1 and"), (list(range(1, 200)), "at most")],
)
def test_world_sizes_out_of_range_are_refused_naming_them(ranks: list[int], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        project(measured(), ranks)


def test_the_ranks_query_takes_lists_and_ranges_and_names_what_it_cannot_read() -> None:
    assert parse_ranks("1,2,4") == [1, 2, 4] and parse_ranks("1-64") == list(range(1, 65))
    assert parse_ranks(None) == list(advisor.DEFAULT_RANKS)
    for bad, said in (("2,x", "'x' is not"), ("8-2", "not a range"), ("-1", "'-1' is not"), ("1-1000", "at most")):
        with pytest.raises(errors.InvalidRequest, match=said):
            parse_ranks(bad)


FACTS = {
    "world": 2, "nodes": 1, "ranks_per_node": 2, "cpu_cores": 2, "device": "cpu",
    "calibration": {str(k): v for k, v in calibration(2).items()}, "ops_per_step": {"all_reduce": 1}, "step": 2,
}  # fmt: skip


def facts_entry(rank: int = 0, **changes: Any) -> dict[str, Any]:
    return streams.encode(streams.FACTS, {"attempt": 1, "rank": rank, "facts": {**FACTS, **changes}})


@pytest.mark.parametrize(
    ("fields", "why"),
    [
        (facts_entry(), ""),
        (facts_entry(rank=1), "rank"),  # rank 0 speaks for the attempt
        (facts_entry(ops_per_step={"teleport": 1}), "malformed"),
        (facts_entry(calibration={str(1 << n): 1.0 for n in range(20)}), "malformed"),
        (facts_entry(cpu_cores=0), "malformed"),
        (facts_entry(extra="x" * 5000), "size"),
    ],
)
def test_facts_come_from_rank_0_well_formed_and_small(fields: dict[str, Any], why: str) -> None:
    assert screen_rank_entry(fields, (1, 2))[2] == why


def test_a_runs_facts_and_metrics_make_its_projection(session: Session) -> None:
    run = add_run(session, "succeeded")
    with pytest.raises(errors.Conflict, match="no facts"):
        scaling.measured(session, run)

    def point(step: int, rank: int) -> list[Any]:
        slow = 0.001 * rank  # rank 1 is the slower: its step is the run's
        values = {"step_time_s": 0.015 + slow, "data_time_s": 0.001, "comm_time_s": 0.006, "exposed_comm_s": 0.004,
                  "comm_bytes_all_reduce": 4e6, "max_rss_bytes": 5e8 + rank, "param_bytes": 4e6,
                  "optimizer_state_bytes": 8e6}  # fmt: skip
        return [step, 1000.0 + step, values if step > 1 else {**values, "step_time_s": 9.0}]  # step 1 warms up

    entries = [facts_entry()] + [
        streams.encode(streams.METRICS, {"attempt": 1, "rank": r, "dropped": 0, "points": [point(s, r) for s in range(1, 21)]})
        for r in (0, 1)
    ]  # fmt: skip
    rank_stream = streams.rank_stream(run.id)
    apply_entries(session, [(rank_stream, f"{i + 1}-0", fields) for i, fields in enumerate(entries)])
    session.expire_all()
    assert json.loads(json.dumps(run.attempts[0].facts))["ops_per_step"] == {"all_reduce": 1}
    m = scaling.measured(session, run)
    assert m.calibration == pytest.approx(calibration(2)) and m.steps == 17  # steps 4..20: past the warm-up
    assert m.step_time_s == pytest.approx(0.016)  # the slower rank's step
    want = dataclasses.replace(measured(), step_time_s=m.step_time_s, peak_bytes=5e8 + 1, steps=17)
    assert dataclasses.replace(m, calibration={}) == dataclasses.replace(want, calibration={})

    run.status = "running"
    with pytest.raises(errors.Conflict, match="finished run"):
        scaling.measured(session, run)
    run.status = "succeeded"
    session.add(Attempt(run_id=run.id, number=2, status="succeeded", facts={**FACTS, "world": 1, "calibration": {}}))
    session.flush()
    session.expire_all()
    with pytest.raises(errors.Conflict, match="one rank"):  # the newest attempt's facts count
        scaling.measured(session, run)
