"""Tensor parallelism (``tp``, 2 Gloo ranks) and 2-D FSDP × TP (``fsdp_tp``, 4 ranks as 2 × 2) under
the real torch elastic launcher, checked against a 1-process run of the same model and data: the
same losses step by step; every TP collective counted (bytes per kind worked out from the model's
shapes, and the count per kind equal to what torch's own CommDebugMode sees); each rank's share of
the parameters. Plus the spec's refusals of shapes that cannot split."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from pydantic import ValidationError

from cli.redis_server import RedisServer
from testkit.commcheck import comm_counts
from testkit.forked import Forked
from testkit.torchrun import BASE_KEYS, COMM_KEYS, Points, by_rank, global_loss, run_once
from torchyard.spec import RunSpec

pytestmark = pytest.mark.dist

STEPS = 6
BATCH = 16
F32 = 4
MLP = {"name": "mlp", "params": {"samples": 1024}}  # input 32, hidden 128 × 3 layers, 10 classes
HIDDEN, CLASSES = 128, 10
MLP_PARAM_BYTES = 38_538 * F32
D_MODEL, N_LAYERS, SEQ_LEN = 32, 2, 16
CHARLM = {
    "name": "charlm",
    "params": {"d_model": D_MODEL, "n_layers": N_LAYERS, "n_heads": 4, "seq_len": SEQ_LEN, "corpus_bytes": 20_000},
}
ACTIVATION = BATCH * SEQ_LEN * D_MODEL * F32  # one (batch, sequence, d_model) activation of the global batch


def spec(strategy: dict[str, Any], procs: int, workload: dict[str, Any]) -> dict[str, Any]:
    return {
        "name": "test",
        "workload": workload,
        "strategy": strategy,
        "resources": {"procs_per_node": procs, "device": "cpu"},
        "training": {"steps": STEPS, "batch_size": BATCH, "lr": 0.01, "seed": 0, "log_every": 1},
    }


TP = {"kind": "tp"}
TP_NO_SP = {"kind": "tp", "sequence_parallel": False}
FSDP_TP = {"kind": "fsdp_tp", "tp_degree": 2}
RUNS: dict[str, dict[str, Any]] = {
    "mlp baseline": spec({"kind": "ddp"}, 1, MLP),
    "mlp tp": spec(TP, 2, MLP),
    "mlp fsdp_tp": spec(FSDP_TP, 4, MLP),
    "charlm baseline": spec({"kind": "ddp"}, 1, CHARLM),
    "charlm tp": spec(TP, 2, CHARLM),
    "charlm tp no-sp": spec(TP_NO_SP, 2, CHARLM),
    "charlm fsdp_tp": spec(FSDP_TP, 4, CHARLM),
}


@pytest.fixture(scope="module")
def run(forked: Forked, server: RedisServer, tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Points]:
    return run_once(forked, server, RUNS, tmp_path_factory.mktemp("ranks"), timeout=180)


def max_diff(a: list[float], b: list[float]) -> float:
    return max(abs(x - y) for x, y in zip(a, b, strict=True))


def per_step(pts: Points, key: str) -> set[float]:
    """The values ``key`` took, over every rank and step."""
    return {values[key] for _r, _s, values in pts}


@pytest.mark.timeout(120)
@pytest.mark.parametrize(("workload", "bound"), [("mlp", 1e-4), ("charlm", 1e-3)])
def test_tp_and_fsdp_tp_match_one_process_step_by_step(run: Any, workload: str, bound: float) -> None:
    baseline = global_loss(run(f"{workload} baseline"), STEPS)
    for name, ranks in (("tp", 2), ("fsdp_tp", 4)):
        pts = run(f"{workload} {name}")
        assert {(r, s) for r, s, _ in pts} == {(r, s) for r in range(ranks) for s in range(1, STEPS + 1)}, name
        diff = max_diff(global_loss(pts, STEPS), baseline)
        print(f"{workload} {name}: max |loss - 1 process| over {STEPS} steps = {diff:.2e}")
        assert diff <= bound, f"{workload} {name}: {diff:.2e} > {bound:.0e}"
        losses = by_rank(pts, "loss")
        for step in range(1, STEPS + 1):  # a TP group's ranks (consecutive) computed the same loss
            for group in range(0, ranks, 2):
                assert losses[group][step] == pytest.approx(losses[group + 1][step], abs=1e-6)
        assert global_loss(pts, STEPS)[-1] < global_loss(pts, STEPS)[0], "the loss falls"
    if workload == "charlm":
        assert max_diff(global_loss(run("charlm tp no-sp"), STEPS), baseline) <= bound


@pytest.mark.timeout(120)
def test_tp_collectives_are_counted_by_kind_with_the_bytes_the_shapes_give(run: Any) -> None:
    for name in RUNS:
        if "baseline" in name:
            continue
        for rank, step, values in run(name):
            assert set(values) >= COMM_KEYS | BASE_KEYS, (name, rank, step)
            assert values["comm_time_s"] > 0 and values["busbw_GBps"] > 0, (name, rank, step)
            # eager TP uses each collective's result at once: all of it is waited for
            assert values["exposed_comm_s"] == pytest.approx(values["comm_time_s"]), (name, rank, step)
            kinds = sum(v for k, v in values.items() if k.startswith("comm_bytes_"))
            assert kinds == values["comm_bytes"], (name, rank, step)

    # mlp: forward all-reduces the two row-wise outputs; backward, the input gradient of the second
    # column-wise Linear (the first one's input is the data: no gradient)
    mlp_tp = run("mlp tp")
    assert per_step(mlp_tp, "comm_bytes_all_reduce") == {BATCH * (HIDDEN + CLASSES + HIDDEN) * F32}
    assert not any(k.startswith("comm_bytes_") and k != "comm_bytes_all_reduce" for k in mlp_tp[0][2])

    # charlm, sequence parallel: per layer, two TP regions: each all-gathers its input and
    # reduce-scatters its output in forward, the other way round in backward; then the head's input
    # all-gather (backward: a reduce-scatter) and the embedding's sequence split (backward: an all-gather).
    # The logits are never gathered (vocabulary-parallel loss: its all-reduces, and the LayerNorms'
    # gradients', are small)
    sp = run("charlm tp")
    assert per_step(sp, "comm_bytes_all_gather") == {(4 * N_LAYERS + 2) * ACTIVATION}
    assert per_step(sp, "comm_bytes_reduce_scatter") == {(4 * N_LAYERS + 1) * ACTIVATION}
    assert all(0 < b < ACTIVATION for b in per_step(sp, "comm_bytes_all_reduce"))
    # without: per layer two all-reduces in forward (row-wise outputs) and two in backward (the
    # regions' input gradients), the head's input gradient, and the loss's three (max, sum of
    # exponentials, target logit: a float per token each)
    no_sp = run("charlm tp no-sp")
    loss_parallel = 3 * BATCH * SEQ_LEN * F32
    assert per_step(no_sp, "comm_bytes_all_reduce") == {(4 * N_LAYERS + 1) * ACTIVATION + loss_parallel}

    # 2 × 2: TP inside a pair on its half of the batch, FSDP across the pairs: each rank reduce-scatters
    # its whole TP shard's gradients once a step and all-gathers its parameters (forward, backward)
    for workload, tp_collective in (("mlp", "all_reduce"), ("charlm", "all_gather")):
        both = run(f"{workload} fsdp_tp")
        tp_shard = per_step(run(f"{workload} tp"), "param_bytes")
        if workload == "mlp":
            assert per_step(both, "comm_bytes_reduce_scatter") == tp_shard
            assert per_step(both, "comm_bytes_all_reduce") == {BATCH // 2 * (HIDDEN + CLASSES + HIDDEN) * F32}
        for _r, _s, values in both:
            assert values[f"comm_bytes_{tp_collective}"] > 0
            assert values["comm_bytes_all_gather"] >= values["comm_bytes_reduce_scatter"] > 0


@pytest.mark.timeout(120)
@pytest.mark.parametrize(("name", "strategy", "procs"), [("tp", TP, 2), ("fsdp_tp", FSDP_TP, 4)])
def test_every_collective_torch_sees_is_counted(
    tmp_path: Path, name: str, strategy: dict[str, Any], procs: int
) -> None:
    """DTensor's collectives bypass ``torch.distributed.*``: the count per kind our timer took in a
    step equals what torch's CommDebugMode intercepted at dispatch (FSDP's and DTensor's alike)."""
    found = comm_counts(spec(strategy, procs, CHARLM), tmp_path / "counts.json")
    print(name, found)
    assert found["timer"] == found["torch"]
    assert set(found["timer"]) == {"all_gather", "reduce_scatter", "all_reduce"}


@pytest.mark.timeout(120)
def test_each_rank_holds_its_share_of_the_parameters(run: Any) -> None:
    """Data vs model parallelism's memory: DDP (and 1 process) holds every parameter on every
    rank; TP over 2 ranks about half (the embedding and the small replicated biases and norms
    stay whole), FSDP × TP over 2 × 2 about a quarter; Adam's state follows the parameters."""
    shares = {}
    for workload, whole in (("mlp", MLP_PARAM_BYTES), ("charlm", None)):
        full = per_step(run(f"{workload} baseline"), "param_bytes")
        if whole is not None:
            assert full == {whole}
        (full_bytes,) = full
        for name in ("tp", "fsdp_tp"):
            pts = run(f"{workload} {name}")
            (share,) = per_step(pts, "param_bytes")  # the same on every rank and step
            shares[f"{workload} {name}"] = share / full_bytes
            for _r, step, values in pts:
                if step > 1:  # Adam: two moments per parameter, and a step count
                    assert values["optimizer_state_bytes"] >= 2 * values["param_bytes"]
            assert all(v["max_rss_bytes"] > 0 for _r, _s, v in pts)
    print({k: round(v, 3) for k, v in shares.items()})
    assert 0.45 <= shares["mlp tp"] <= 0.51 and 0.22 <= shares["mlp fsdp_tp"] <= 0.26
    assert shares["charlm fsdp_tp"] < shares["charlm tp"] < 0.75


# -- the spec refuses shapes that cannot split, naming the field and the value -------------------


@pytest.mark.parametrize(
    ("strategy", "procs", "workload", "words"),
    [
        (TP, 1, MLP, "strategy.kind 'tp' shards or averages across ranks"),
        (TP, 3, MLP, "workload.params.hidden (128) must be divisible by the TP degree, nodes × procs_per_node (3)"),
        (TP, 8, CHARLM, "workload.params.n_heads (4) must be divisible by the TP degree, nodes × procs_per_node (8)"),
        (
            {"kind": "fsdp_tp", "tp_degree": 4},
            8,
            {"name": "charlm", "params": {"n_heads": 8, "seq_len": 18}},
            "workload.params.seq_len (18) must be divisible by strategy.tp_degree (4) with strategy.sequence_parallel",
        ),
        ({"kind": "fsdp_tp", "tp_degree": 3}, 4, MLP, "strategy.tp_degree (3) must divide nodes × procs_per_node (4)"),
        ({"kind": "fsdp_tp", "tp_degree": 4}, 4, MLP, "strategy.tp_degree (4) must divide nodes × procs_per_node (4) into at least 2"),
        ({"kind": "fsdp_tp", "tp_degree": 1}, 4, MLP, "strategy.tp_degree (1) must be at least 2"),
    ],
)  # fmt: skip
def test_spec_refuses_a_tp_shape_that_cannot_split(
    strategy: dict[str, Any], procs: int, workload: dict[str, Any], words: str
) -> None:
    body = spec(strategy, procs, workload)
    body["training"]["batch_size"] = 48
    with pytest.raises(ValidationError) as err:
        RunSpec.model_validate(body)
    assert words in str(err.value)


def test_sequence_parallel_off_lifts_the_sequence_rule() -> None:
    body = spec({**TP_NO_SP}, 4, {"name": "charlm", "params": {"n_heads": 4, "seq_len": 18}})
    assert RunSpec.model_validate(body).strategy.kind == "tp"
