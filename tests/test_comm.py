"""The communication figures' arithmetic (no processes): unions, exposed time, bandwidths."""

from __future__ import annotations

import math
import time

import pytest
import torch

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
    timer = CommTimer(2, torch.device("cpu"))
    timer.calibration = {4096: 0.01, 4 << 20: 1.0}
    timer.begin_step(1)
    origin = timer.now()
    done = torch.futures.Future[int]()
    tracked = timer.track(ALL_REDUCE, 4 << 20, origin, done)
    timer.expose_tail(origin + 0.001)
    time.sleep(0.02)
    done.set_result(1)
    assert tracked.wait() == 1
    ((step, fig),) = timer.end_step()
    assert step == 1 and fig["comm_bytes"] == 4 << 20
    assert 0.015 < fig["exposed_comm_s"] <= fig["comm_time_s"]
    assert fig["busbw_efficiency"] == pytest.approx(fig["busbw_GBps"] / 1.0)


def test_reference_busbw_is_interpolated_in_log_log_between_calibrated_sizes() -> None:
    timer = CommTimer(2, torch.device("cpu"))
    assert timer.reference_busbw(1 << 20) == 0  # no calibration
    timer.calibration = {4 << 20: 1.0, 4096: 0.01, 64 << 20: 0.0}  # a failed size (0) is left out
    assert timer.reference_busbw(4096) == pytest.approx(0.01)
    assert timer.reference_busbw(math.sqrt(4096 * (4 << 20))) == pytest.approx(0.1)  # halfway in log-log
    assert timer.reference_busbw(100) == pytest.approx(0.01) and timer.reference_busbw(1 << 30) == pytest.approx(1.0)


def test_a_step_without_collectives_reports_zeros() -> None:
    timer = CommTimer(2, torch.device("cpu"))
    timer.begin_step(3)
    ((_, fig),) = timer.end_step()
    assert 0 <= fig.pop("step_time_s") < 0.01
    assert fig == {
        "comm_time_s": 0, "exposed_comm_s": 0, "comm_bytes": 0, "comm_ops": 0,
        "algbw_GBps": 0, "busbw_GBps": 0, "busbw_efficiency": 0, "first_comm_at_s": 0,
    }  # fmt: skip


def test_step_log_completes_a_step_from_the_timers_marks() -> None:
    """Step time from the timer's begin/end marks; rates, loss, compute and comm fraction from it."""
    timer, logged = CommTimer(2, torch.device("cpu")), []
    steps = StepLog(timer, lambda step, values: logged.append((step, values)))
    timer.begin_step(7)
    start = timer.now()
    time.sleep(0.02)
    before = time.perf_counter()
    timer.call(ALL_REDUCE, 1000, time.sleep, 0.01)  # blocking: ~10 ms in flight and waited for
    in_flight = time.perf_counter() - before  # a loaded machine oversleeps: compare with what it took
    steps.hold(7, {"data_time_s": 0.005}, per_step={"samples_per_s": 64.0}, loss=torch.tensor(2.5))
    assert steps.end_step() == 1
    ((step, values),) = logged
    assert step == 7 and values["loss"] == 2.5
    assert 0.03 <= values["step_time_s"] < 0.03 + (timer.now() - start)
    assert values["samples_per_s"] == pytest.approx(64 / values["step_time_s"])
    assert 0.01 <= values["exposed_comm_s"] <= in_flight
    assert values["compute_time_s"] == pytest.approx(values["step_time_s"] - 0.005 - values["exposed_comm_s"])
    assert values["comm_fraction"] == pytest.approx(values["exposed_comm_s"] / values["step_time_s"])
    assert "comm_ops" not in values and values["max_rss_bytes"] > 0
    assert not [key for key in values if key.startswith("gpu_")], "no GPU: its figures are absent, not zero"
    timer.begin_step(8)  # not held (not a logged step): dropped unread
    assert steps.end_step() == 0 and len(logged) == 1
    steps.hold(9, {})  # held, but no step 9 was timed
    assert steps.flush() == 0 and len(logged) == 1


def test_gpu_telemetry_is_absent_without_a_gpu() -> None:
    cpu = GpuTelemetry(torch.device("cpu"))
    assert cpu.handle is None and cpu.sample() == {}
    # A CUDA device that is not there (this machine): no handle, no figures, no error.
    assert GpuTelemetry(torch.device("cuda", 0)).sample() == {}


def test_data_time_is_read_on_the_steps_own_clock() -> None:
    """The loop marks when its batch is on the device; data_time_s is origin → that mark on the
    timer's clock (events on CUDA), so compute = step − data − exposed subtracts like from like."""
    timer, logged = CommTimer(2, torch.device("cpu")), []
    steps = StepLog(timer, lambda step, values: logged.append(values))
    timer.begin_step(1)
    time.sleep(0.01)
    timer.data_ready()
    time.sleep(0.01)
    steps.hold(1, {"lr": 0.1})
    steps.end_step()
    ((values,),) = [logged]
    assert 0.01 <= values["data_time_s"] < values["step_time_s"] - 0.01
    assert values["compute_time_s"] == pytest.approx(values["step_time_s"] - values["data_time_s"])


def test_data_time_splits_into_waiting_for_the_batch_and_copying_it() -> None:
    """batch_ready between the two: data_wait_s (origin → the batch in host memory) and data_copy_s
    (→ on the device) are parts of one clock that add up to data_time_s; without the mark, neither."""
    timer, logged = CommTimer(2, torch.device("cpu")), []
    steps = StepLog(timer, lambda step, values: logged.append(values))
    for step, split in ((1, True), (2, False)):
        timer.begin_step(step)
        time.sleep(0.02)
        if split:
            timer.batch_ready()
        time.sleep(0.01)
        timer.data_ready()
        steps.hold(step, {})
        steps.end_step()
    split_values, plain = logged
    assert 0.02 <= split_values["data_wait_s"] < 0.03 + 0.05 and 0.01 <= split_values["data_copy_s"] < 0.05
    assert split_values["data_wait_s"] + split_values["data_copy_s"] == pytest.approx(split_values["data_time_s"])
    assert "data_wait_s" not in plain and "data_copy_s" not in plain and plain["data_time_s"] >= 0.03
