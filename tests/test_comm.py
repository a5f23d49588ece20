"""The communication figures' arithmetic: unions, exposed time, bandwidths, on a clock the test
advances (exact figures, whatever else the machine runs); and one run under torchrun (``dist``)
where a known injected wait is found by both measures of a sampled step's communication."""

from __future__ import annotations

import math
import statistics
import time
from pathlib import Path
from typing import Any

import pytest
import redis
import torch

from cli.redis_server import RedisServer
from testkit.torchrun import Points, by_rank, torchrun
from testkit.torchrun import spec as torchrun_spec
from torchyard import streams
from workers.runtime.comm import (
    ALL_GATHER,
    ALL_REDUCE,
    BROADCAST,
    CommTimer,
    bus_factor,
    figures,
    union_length,
)
from workers.runtime.steplog import GpuTelemetry, StepLog


class Clock:
    """A stand-in for a CPU timer's clock (``CommTimer.now``): it moves only when the test says."""

    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t

    def advance(self, seconds: float) -> None:
        self.t += seconds


def cpu_timer(world: int = 2) -> tuple[CommTimer, Clock]:
    """A CPU timer on a :class:`Clock` in place of its own (``time.perf_counter``)."""
    timer = CommTimer(world, torch.device("cpu"))
    assert timer.now is time.perf_counter  # the seam replaced here is the real clock
    clock = Clock()
    timer.now = clock
    return timer, clock


def test_union_counts_overlaps_once_and_ignores_empty_intervals() -> None:
    assert union_length([]) == 0
    assert union_length([(0, 1), (0.5, 2), (3, 4), (5, 5), (6, 5)]) == pytest.approx(3)
    assert union_length([(2, 3), (0, 10)]) == pytest.approx(10)


def test_bus_factors_are_the_nccl_tests_ones() -> None:
    assert bus_factor(ALL_REDUCE, 2) == 1 and bus_factor(ALL_REDUCE, 8) == pytest.approx(1.75)
    assert bus_factor(ALL_GATHER, 4) == pytest.approx(0.75) and bus_factor(BROADCAST, 4) == 1
    assert bus_factor(ALL_REDUCE, 1) == 0


def test_figures_from_intervals() -> None:
    comms = [(0.0, 0.2, 100_000_000, ALL_REDUCE, 0), (0.1, 0.3, 100_000_000, ALL_GATHER, 0)]
    fig = figures(comms, exposed=[(0.25, 0.3)], world=4)
    assert fig["comm_time_s"] == pytest.approx(0.3)
    assert fig["exposed_comm_s"] == pytest.approx(0.05)
    assert fig["comm_bytes"] == 200_000_000
    assert fig["comm_bytes_all_reduce"] == fig["comm_bytes_all_gather"] == 100_000_000
    assert fig["algbw_GBps"] == pytest.approx(0.2 / 0.3)
    assert fig["busbw_GBps"] == pytest.approx((0.1 * 1.5 + 0.1 * 0.75) / 0.3)


def test_a_sub_group_collective_gets_its_group_bus_factor_and_kinds_stay_reported() -> None:
    """A 2-D mesh's collectives run on groups smaller than the world: an all-reduce on 2 of 4
    ranks has factor 1, not 1.5. A kind once issued is reported at every later step (0 when idle)."""
    timer = CommTimer(4, torch.device("cpu"))
    timer.begin_step(1)
    timer.add(ALL_REDUCE, 1000, 0.0, 1e-6, ranks=2)
    timer.add_bytes(BROADCAST, 500)  # the world's
    ((_, fig),) = timer.end_step()
    assert fig["busbw_GBps"] == pytest.approx((1000 * 1.0 + 500 * 1.0) / 1e-6 / 1e9)
    assert fig["comm_bytes_all_reduce"] == 1000 and fig["comm_bytes_broadcast"] == 500
    timer.begin_step(2)
    timer.add(ALL_GATHER, 64, 0.0, 1e-6)
    ((_, fig),) = timer.end_step()
    assert (fig["comm_bytes_all_reduce"], fig["comm_bytes_broadcast"], fig["comm_bytes_all_gather"]) == (0, 0, 64)


def test_timer_ddp_tail_and_efficiency_against_calibration() -> None:
    """A bucket's all-reduce in flight 20 ms from the step's start, backward compute done 1 ms in:
    comm 20 ms, of which the step waited 19 ms (the DDP tail)."""
    timer, clock = cpu_timer()
    timer.calibration = {4096: 0.01, 4 << 20: 1.0}
    timer.begin_step(1)
    origin = timer.now()
    done = torch.futures.Future[int]()
    tracked = timer.track(ALL_REDUCE, 4 << 20, origin, done)
    clock.advance(0.001)
    timer.expose_tail(timer.now())
    clock.advance(0.019)
    done.set_result(1)  # its callback reads the clock: the all-reduce ended 20 ms after it started
    assert tracked.wait() == 1
    clock.advance(0.005)
    ((step, fig),) = timer.end_step()
    assert step == 1 and fig["comm_bytes"] == 4 << 20
    assert fig["comm_time_s"] == pytest.approx(0.02) and fig["exposed_comm_s"] == pytest.approx(0.019)
    assert fig["step_time_s"] == pytest.approx(0.025) and fig["first_comm_at_s"] == 0
    assert fig["busbw_GBps"] == pytest.approx((4 << 20) / 0.02 / 1e9)  # 2 ranks: all-reduce factor 1
    assert fig["busbw_efficiency"] == pytest.approx(fig["busbw_GBps"] / 1.0)


def test_reference_busbw_is_interpolated_in_log_log_between_calibrated_sizes() -> None:
    timer = CommTimer(2, torch.device("cpu"))
    assert timer.reference_busbw(1 << 20) == 0  # no calibration
    timer.calibration = {4 << 20: 1.0, 4096: 0.01, 64 << 20: 0.0}  # a failed size (0) is left out
    assert timer.reference_busbw(4096) == pytest.approx(0.01)
    assert timer.reference_busbw(math.sqrt(4096 * (4 << 20))) == pytest.approx(0.1)  # halfway in log-log
    assert timer.reference_busbw(100) == pytest.approx(0.01) and timer.reference_busbw(1 << 30) == pytest.approx(1.0)


def test_a_step_without_collectives_reports_zeros() -> None:
    timer, clock = cpu_timer()
    timer.begin_step(3)
    clock.advance(0.004)
    ((_, fig),) = timer.end_step()
    assert fig.pop("step_time_s") == pytest.approx(0.004)
    assert fig == {
        "comm_time_s": 0, "exposed_comm_s": 0, "comm_bytes": 0, "comm_ops": 0,
        "algbw_GBps": 0, "busbw_GBps": 0, "busbw_efficiency": 0, "first_comm_at_s": 0,
    }  # fmt: skip


def test_step_log_completes_a_step_from_the_timers_marks() -> None:
    """Step time from the timer's begin/end marks; rates, loss, compute and comm fraction from it."""
    logged: list[tuple[int, dict[str, float]]] = []
    timer, clock = cpu_timer()
    steps = StepLog(timer, lambda step, values: logged.append((step, values)))
    timer.begin_step(7)
    clock.advance(0.02)
    timer.call(ALL_REDUCE, 1000, clock.advance, 0.01)  # blocking: 10 ms in flight and waited for
    clock.advance(0.005)
    steps.hold(7, {"data_time_s": 0.005}, per_step={"samples_per_s": 64.0}, loss=torch.tensor(2.5))
    assert steps.end_step() == 1
    ((step, values),) = logged
    assert step == 7 and values["loss"] == 2.5
    assert values["step_time_s"] == pytest.approx(0.035)
    assert values["samples_per_s"] == pytest.approx(64 / 0.035)
    assert values["comm_time_s"] == pytest.approx(0.01) and values["exposed_comm_s"] == pytest.approx(0.01)
    assert values["first_comm_at_s"] == pytest.approx(0.02)
    assert values["compute_time_s"] == pytest.approx(0.035 - 0.005 - 0.01)
    assert values["comm_fraction"] == pytest.approx(0.01 / 0.035)
    assert "comm_ops" not in values and values["max_rss_bytes"] > 0
    assert not [key for key in values if key.startswith("gpu_")], "a CPU step: GPU figures are absent, not zero"
    timer.begin_step(8)  # not held (not a logged step): dropped unread
    assert steps.end_step() == 0 and len(logged) == 1
    steps.hold(9, {})  # held, but no step 9 was timed
    assert steps.flush() == 0 and len(logged) == 1


def test_gpu_telemetry_is_absent_without_a_gpu() -> None:
    cpu = GpuTelemetry(torch.device("cpu"))
    assert cpu.handle is None and cpu.sample() == {}
    # A CUDA device that is not there (on a CPU host cuda:0, on a CUDA host the index after the
    # last device): no handle, no figures, no error.
    absent = GpuTelemetry(torch.device("cuda", torch.cuda.device_count()))
    assert absent.handle is None and absent.sample() == {}


def test_data_time_is_read_on_the_steps_own_clock() -> None:
    """The loop marks when its batch is on the device; data_time_s is origin → that mark on the
    timer's clock (events on CUDA), so compute = step − data − exposed subtracts like from like."""
    logged: list[dict[str, float]] = []
    timer, clock = cpu_timer()
    steps = StepLog(timer, lambda step, values: logged.append(values))
    timer.begin_step(1)
    clock.advance(0.01)
    timer.data_ready()
    clock.advance(0.02)
    steps.hold(1, {"lr": 0.1})
    steps.end_step()
    ((values,),) = [logged]
    assert values["data_time_s"] == pytest.approx(0.01) and values["step_time_s"] == pytest.approx(0.03)
    assert values["compute_time_s"] == pytest.approx(0.02)


def test_data_time_splits_into_waiting_for_the_batch_and_copying_it() -> None:
    """batch_ready between the two: data_wait_s (origin → the batch in host memory) and data_copy_s
    (→ on the device) are parts of one clock that add up to data_time_s; without the mark, neither."""
    logged: list[dict[str, float]] = []
    timer, clock = cpu_timer()
    steps = StepLog(timer, lambda step, values: logged.append(values))
    for step, split in ((1, True), (2, False)):
        timer.begin_step(step)
        clock.advance(0.02)
        if split:
            timer.batch_ready()
        clock.advance(0.01)
        timer.data_ready()
        clock.advance(0.005)
        steps.hold(step, {})
        steps.end_step()
    split_values, plain = logged
    assert split_values["data_wait_s"] == pytest.approx(0.02) and split_values["data_copy_s"] == pytest.approx(0.01)
    assert split_values["data_time_s"] == pytest.approx(0.03)
    assert split_values["data_wait_s"] + split_values["data_copy_s"] == pytest.approx(split_values["data_time_s"])
    assert "data_wait_s" not in plain and "data_copy_s" not in plain and plain["data_time_s"] == pytest.approx(0.03)
    assert split_values["step_time_s"] == pytest.approx(0.035) and plain["step_time_s"] == pytest.approx(0.035)


def metric_points(server: RedisServer, run_id: int) -> Points:
    """(rank, step, values) of every metrics point; the sampled steps' timelines and the facts aside."""
    client = redis.Redis.from_url(server.url)
    try:
        entries: Any = client.xrange(streams.rank_stream(run_id))
    finally:
        client.close()
    out: Points = []
    for _id, fields in entries:
        kind, data = streams.decode(fields)
        if kind == streams.METRICS:
            assert data["dropped"] == 0
            out += [(data["rank"], step, values) for step, _ts, values in data["points"]]
    return out


SLOW_PEER_S = 0.5  # rank 1 joins the all-reduce this late on even steps (TORCHYARD_SLOW_PEER_S)


@pytest.mark.dist
@pytest.mark.timeout(120)
def test_both_measures_of_a_sampled_steps_comm_find_a_known_late_peer(tmp_path: Path) -> None:
    """The two independent measures of a sampled step's communication, the trace's Gloo spans
    (``prof_comm_time_s``) and the DDP hooks' futures (``comm_time_s``), held to a wait injected
    into a real 2-rank DDP run (tests/test_ui.py compares them on a stack, where nothing known is
    injected and so only to one order of size). Rank 1 joins its all-reduce SLOW_PEER_S late on
    even steps, before its own timer starts; rank 0 waits that long inside the collective. So on
    rank 0 both measures are about SLOW_PEER_S on even steps and small on odd ones; on rank 1 both
    are small throughout. Medians over steps, so that one step's scheduling (2 ranks on a shared
    CPU) is not the measure; the bounds fail a measure off by 2x either way."""
    server = RedisServer(tmp_path / "redis").start()
    try:
        spec = torchrun_spec({"name": "mlp", "params": {"hidden": 256}}, steps=13)
        spec["training"]["profile_every"] = 1  # every step sampled: the odd ones are the baseline
        run_id, proc = torchrun(server, spec, timeout=200, env_extra={"TORCHYARD_SLOW_PEER_S": str(SLOW_PEER_S)})
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
        pts = metric_points(server, run_id)
    finally:
        server.stop()
    measures = {"trace": by_rank(pts, "prof_comm_time_s"), "hooks": by_rank(pts, "comm_time_s")}
    step_time = by_rank(pts, "step_time_s")
    even, odd = range(4, 14, 2), range(3, 14, 2)  # from step 3: step 1 builds DDP's buckets, 2 warms the profiler
    for name, series in measures.items():
        assert set(series) == {0, 1} and all(set(series[r]) == set(range(1, 14)) for r in (0, 1)), (name, series)
        for rank in (0, 1):
            for step in (*even, *odd):
                assert 0 < series[rank][step] <= step_time[rank][step], (name, rank, step, series[rank][step])
        waited = statistics.median(series[0][s] for s in even)
        assert 0.7 * SLOW_PEER_S <= waited <= 1.4 * SLOW_PEER_S, (
            f"{name}: rank 0's comm on its late peer's steps is {waited:.3f} s for a {SLOW_PEER_S} s wait"
        )
        quiet = [statistics.median(series[0][s] for s in odd), statistics.median(series[1][s] for s in even)]
        assert max(quiet) < 0.25 * SLOW_PEER_S, f"{name}: comm {quiet} s without a wait (rank 0 odd, rank 1 even)"
