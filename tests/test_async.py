"""The ``async`` strategy (a parameter server on rank 0, workers on the others) under the real torch
elastic launcher, against DDP over as many ranks as it has workers, with the same global batch:
synchronous (``max_staleness`` 0) it computes DDP's losses step by step; stale, it still learns
and ends near DDP's loss (in a seeded order of updates, which replays exactly); no gradient is ever
applied later than the bound; a slowed worker does not slow the others (and under DDP it does),
counted within one run. Plus the spec's refusals."""

from __future__ import annotations

import statistics
from collections.abc import Callable
from typing import Any

import pytest
from pydantic import ValidationError

from cli.redis_server import RedisServer
from testkit.forked import Forked
from testkit.torchrun import BASE_KEYS, COMM_KEYS, Points, by_rank, global_loss, losses, run_once
from torchyard.spec import RunSpec

pytestmark = pytest.mark.dist

STEPS = 80  # at 40 the stale run's final loss came within 4-11 % of DDP's over 3 tries
MLP = {"name": "mlp", "params": {"samples": 4096}}
GRAD_BYTES = 38_538 * 4  # the default mlp's parameters, float32
CHARLM = {
    "name": "charlm",
    "params": {"d_model": 32, "n_layers": 1, "n_heads": 2, "seq_len": 16, "corpus_bytes": 20_000},
}
SLOW_S = 0.1  # the slowed worker's extra time per step: many of the tiny mlp's steps, even on busy cores


def slowed(rank: int) -> dict[str, Any]:
    """The fail workload (its tiny mlp) never failing, ``SLOW_S`` slower on ``rank`` from the first step."""
    return {"name": "fail", "params": {"at_step": 1, "rank": rank, "slow_s": SLOW_S, "slow_in": "compute"}}


# enough versions for the fast worker to run ahead of the slow one for a whole slow step
ROOMY_STALENESS = 64
ROOMY = {"kind": "async", "max_staleness": ROOMY_STALENESS}
STEPS_SLOWED = 60
WORKER_KEYS = {"staleness", "wait_s", "push_bytes", "push_time_s", "pull_bytes", "pull_time_s", "version"}
# the server applies the gradients in an order drawn from this seed, not as they arrive: a replay
SEEDED = {"TORCHYARD_ASYNC_SCHEDULE_SEED": "0"}


def spec(
    strategy: dict[str, Any], procs: int, workload: dict[str, Any] = MLP, steps: int = STEPS, batch: int = 64
) -> dict[str, Any]:
    return {
        "name": "test",
        "workload": workload,
        "strategy": strategy,
        "resources": {"procs_per_node": procs, "device": "cpu"},
        "training": {"steps": steps, "batch_size": batch, "lr": 0.01, "seed": 0, "log_every": 1},
    }


RUNS: dict[str, dict[str, Any] | tuple[dict[str, Any], dict[str, str]]] = {
    "mlp ddp": spec({"kind": "ddp"}, 2),
    "mlp sync": spec({"kind": "async", "max_staleness": 0}, 3),
    "mlp stale": spec({"kind": "async", "max_staleness": 4}, 3),  # as the gradients arrive: the default
    "mlp seeded": (spec({"kind": "async", "max_staleness": 4}, 3), SEEDED),
    "mlp seeded again": (spec({"kind": "async", "max_staleness": 4}, 3), SEEDED),
    "charlm ddp": spec({"kind": "ddp"}, 2, CHARLM, batch=16),
    "charlm seeded": (spec({"kind": "async", "max_staleness": 4}, 3, CHARLM, batch=16), SEEDED),
    # 3 workers, the third slowed, a tight bound: the two fast ones must wait for it
    "bound": spec({"kind": "async", "max_staleness": 2}, 4, slowed(3), 30, 48),
    "slowed": spec(ROOMY, 3, slowed(2), STEPS_SLOWED),
    "ddp slowed": spec({"kind": "ddp"}, 2, slowed(1), 20),
}


@pytest.fixture(scope="module")
def run(forked: Forked, server: RedisServer, tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Points]:
    return run_once(forked, server, RUNS, tmp_path_factory.mktemp("ranks"), timeout=120)


def final(losses: list[float]) -> float:
    """The loss late in the run: the mean over its second half. A stale run's loss depends on the
    order its gradients are applied in; in arrival order its second-half mean came 5-9 % above DDP's
    in repeats of one spec on this machine; in the seeded orders of seeds 0-3, 0.4-4.5 %."""
    return statistics.fmean(losses[len(losses) // 2 :])


def staleness(pts: Points) -> list[float]:
    return [v for series in by_rank(pts, "staleness").values() for v in series.values()]


def histogram(values: list[float]) -> dict[int, int]:
    return dict(sorted((int(v), values.count(v)) for v in set(values)))


@pytest.mark.timeout(120)
def test_synchronous_async_computes_ddp_losses_step_by_step(run: Any) -> None:
    ddp, sync = global_loss(run("mlp ddp"), STEPS), global_loss(run("mlp sync"), STEPS)
    worst = max(abs(a - b) / abs(b) for a, b in zip(sync, ddp, strict=True))
    print(f"max_staleness 0 vs DDP: worst relative loss difference over {STEPS} steps {worst:.1e}")
    assert worst <= 1e-4
    assert set(staleness(run("mlp sync"))) == {0.0}
    assert set(by_rank(run("mlp sync"), "loss")) == {1, 2}, "the workers compute the loss, the server none"


@pytest.mark.timeout(120)
def test_every_rank_reports_its_pushes_pulls_and_comm_for_every_step(run: Any) -> None:
    pts = run("mlp stale")
    assert {(r, s) for r, s, _ in pts} == {(r, s) for r in (0, 1, 2) for s in range(1, STEPS + 1)}
    for rank, step, values in pts:
        assert set(values) >= COMM_KEYS - {"optimizer_state_bytes"} | BASE_KEYS - {"loss"}, (rank, step)
        if rank == 0:  # one gradient from each worker a step (on average), and a reply to each
            assert {"version", "staleness_max", "push_bytes", "pull_bytes"} <= set(values)
            continue
        assert set(values) >= WORKER_KEYS | {"loss"}, (rank, step)
        assert values["push_bytes"] == GRAD_BYTES and values["pull_bytes"] == GRAD_BYTES + 3 * 8
        first_pull = values["pull_bytes"] if step == 1 else 0  # a worker starts with the server's parameters
        assert values["comm_bytes"] == values["push_bytes"] + values["pull_bytes"] + first_pull
        # the server's wait starts once it has the gradient (after the push began, and the pull is
        # posted right after the push) and ends when it replies (before the pull completes)
        assert 0 <= values["wait_s"] <= values["push_time_s"] + values["pull_time_s"], values
        assert values["pull_time_s"] <= values["step_time_s"]
    server = by_rank(pts, "version")[0]
    assert server[STEPS] == 2 * STEPS, "every worker's every gradient is a version"


@pytest.mark.timeout(120)
@pytest.mark.parametrize("workload", ["mlp", "charlm"])
def test_stale_gradients_still_learn_and_end_near_ddp(run: Any, workload: str) -> None:
    """In the seeded order of updates: the same figures in every run, whatever the machine's load."""
    ddp, stale = global_loss(run(f"{workload} ddp"), STEPS), global_loss(run(f"{workload} seeded"), STEPS)
    seen = staleness(run(f"{workload} seeded"))
    print(f"{workload}: final loss async(4) {final(stale):.4f}, ddp {final(ddp):.4f}; staleness {histogram(seen)}")
    assert final(stale) < 0.8 * statistics.fmean(stale[:5]), "the loss falls"
    assert abs(final(stale) - final(ddp)) <= 0.10 * final(ddp)
    assert max(seen) == 4, "gradients are applied up to the bound late, never later"


@pytest.mark.timeout(120)
def test_a_seeded_order_replays_exactly_and_arrival_order_learns_as_well(run: Any) -> None:
    first, again = run("mlp seeded"), run("mlp seeded again")
    assert losses(first) == losses(again), "the same spec and seed: the same loss at every rank and step"
    assert by_rank(first, "staleness") == by_rank(again, "staleness")
    assert by_rank(first, "version") == by_rank(again, "version")
    # the default: applied as they arrive, in the machine's order. It learns as the seeded orders do;
    # its distance to DDP varies with the timing (5-9 % above it here), held with room to spare
    arrival, ddp = global_loss(run("mlp stale"), STEPS), global_loss(run("mlp ddp"), STEPS)
    seen = staleness(run("mlp stale"))
    print(f"mlp in arrival order: final loss {final(arrival):.4f}, ddp {final(ddp):.4f}; staleness {histogram(seen)}")
    assert final(arrival) < 0.8 * statistics.fmean(arrival[:5]), "the loss falls"
    assert abs(final(arrival) - final(ddp)) <= 0.25 * final(ddp)
    assert max(seen) <= 4


@pytest.mark.timeout(120)
def test_no_gradient_is_applied_later_than_the_bound_and_fast_workers_wait(run: Any) -> None:
    pts = run("bound")
    seen = staleness(pts)
    waits = by_rank(pts, "wait_s")
    print(
        f"3 workers, rank 3 slowed, max_staleness 2: staleness {histogram(seen)}; "
        + ", ".join(f"rank {r} median wait {statistics.median(waits[r].values()) * 1e3:.1f} ms" for r in (1, 2, 3))
    )
    assert len(seen) == 3 * 30 and max(seen) <= 2
    assert max(by_rank(pts, "staleness_max")[0].values()) <= 2
    # the fast workers are held back: they wait for the slow one for most of its extra time
    for fast in (1, 2):
        assert statistics.median(waits[fast].values()) >= 0.3 * SLOW_S, fast


@pytest.mark.timeout(120)
def test_a_slowed_worker_does_not_slow_the_others(run: Any) -> None:
    """Counted in one run, not timed across runs: the server's version when it answers a worker's
    push is every gradient applied so far, so it tells how far the other worker had got by then."""
    pts, ddp = run("slowed"), run("ddp slowed")
    fast_version, waits = by_rank(pts, "version")[1], by_rank(pts, "wait_s")[1]
    # the fast worker's last step before the final sync point (where it waits for the slowed one)
    last = STEPS_SLOWED - 1
    slow_done = int(fast_version[last]) - last  # the slowed worker's gradients applied by then
    seen = staleness(pts)
    ddp_steps, ddp_exposed = by_rank(ddp, "step_time_s")[0], by_rank(ddp, "exposed_comm_s")[0]
    print(
        f"worker 1 finished {last} steps while worker 2, {SLOW_S * 1e3:.0f} ms/step slower, finished {slow_done}; "
        f"worker 1's median wait {statistics.median(waits[s] for s in range(1, last + 1)) * 1e3:.1f} ms; "
        f"DDP's rank 0 beside it: median step {statistics.median(ddp_steps.values()) * 1e3:.0f} ms, "
        f"exposed comm {statistics.median(ddp_exposed.values()) * 1e3:.0f} ms; staleness max {max(seen):.0f}"
    )
    assert slow_done <= last // 4, "the fast worker goes on at its own pace, several steps to the slowed one's"
    assert statistics.median(waits[s] for s in range(1, last + 1)) < 0.1 * SLOW_S, "the server never holds it back"
    assert max(seen) <= ROOMY_STALENESS
    # under DDP the same slow peer holds the other rank back: every step waits for it, in the all-reduce
    assert statistics.median(ddp_steps.values()) >= SLOW_S
    assert statistics.median(ddp_exposed.values()) >= 0.5 * SLOW_S


# -- the spec refuses what cannot work, saying why ---------------------------------------------


@pytest.mark.parametrize(
    ("strategy", "procs", "extra", "words"),
    [
        ({"kind": "async"}, 1, {}, "strategy.kind 'async' needs nodes × procs_per_node (1) of at least 2"),
        ({"kind": "async", "max_staleness": -1}, 3, {}, "max_staleness"),
        (
            {"kind": "async", "max_staleness": 1},
            5,
            {},
            "strategy.max_staleness (1) must be 0 (synchronous) or at least the workers − 1 (3)",
        ),
        ({"kind": "async"}, 4, {}, "training.batch_size (64) must be divisible by the workers"),
        ({"kind": "async"}, 3, {"device": "cuda"}, "runs on resources.device 'cpu' only"),
        ({"kind": "async"}, 3, {"checkpoint_on_cancel": True}, "not 'async' yet"),
    ],
)
def test_spec_refuses_an_async_run_that_cannot_work(
    strategy: dict[str, Any], procs: int, extra: dict[str, Any], words: str
) -> None:
    body = spec(strategy, procs)
    if "device" in extra:
        body["resources"]["device"] = extra["device"]
    else:
        body["training"].update(extra)
    with pytest.raises(ValidationError) as err:
        RunSpec.model_validate(body)
    assert words in str(err.value)


def test_spec_takes_async_with_a_batch_the_workers_split() -> None:
    s = RunSpec.model_validate(spec({"kind": "async"}, 4, batch=48) | {})
    assert s.strategy.kind == "async" and s.strategy.max_staleness == 4
    RunSpec.model_validate(spec({"kind": "async", "max_staleness": 0}, 5))  # synchronous: any number of workers
