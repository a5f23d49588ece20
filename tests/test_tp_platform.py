"""Tensor parallelism through the whole platform: submitted over REST, queued, placed, run by a real
worker under torchrun (2 Gloo ranks), its figures ingested and served back; a shape that cannot
split is a 422 naming the field and the value."""

from __future__ import annotations

from pathlib import Path

import pytest

from testkit.stack import run_spec, sqlite_stack

pytestmark = [pytest.mark.stack, pytest.mark.timeout(120)]

STEPS = 8


def test_a_tp_run_succeeds_and_serves_its_collectives_and_parameter_share(tmp_path: Path) -> None:
    with sqlite_stack(tmp_path) as stack:
        http = stack.client.http
        bad = run_spec(params={"hidden": 33}, steps=STEPS)
        bad["strategy"] = {"kind": "tp"}
        refused = http.post("/api/v1/runs", json=bad)
        assert refused.status_code == 422, refused.text
        assert "workload.params.hidden (33) must be divisible by the TP degree" in refused.text

        spec = run_spec(params={"hidden": 64}, steps=STEPS, batch_size=32)
        del spec["name"]
        spec["strategy"] = {"kind": "tp"}
        created = http.post("/api/v1/runs", json=spec)
        assert created.status_code == 201, created.text
        run = created.json()
        assert run["name"] == "mlp-tp"
        done = stack.client.wait_status(run["id"], {"succeeded"}, timeout=150)
        assert done["last_step"] == STEPS and done["samples_per_s"] > 0

        keys = set(http.get(f"/api/v1/runs/{run['id']}/metrics/keys").json())
        assert {"comm_time_s", "exposed_comm_s", "comm_bytes", "busbw_GBps", "comm_bytes_all_reduce"} <= keys
        assert {"param_bytes", "optimizer_state_bytes", "max_rss_bytes"} <= keys

        def series(key: str) -> dict[str, list[float]]:
            body = http.get(f"/api/v1/runs/{run['id']}/metrics", params={"key": key}).json()
            assert set(body["ranks"]) == {"0", "1"}, key
            return dict(body["aggregate"])

        # every step all-reduced the two row-wise outputs and one input gradient: (64 + 10 + 64) fp32
        # per sample of the whole batch, which both ranks compute on
        assert set(series("comm_bytes_all_reduce")["mean"]) == {32 * (64 + 10 + 64) * 4}
        assert all(t > 0 for t in series("comm_time_s")["mean"])
        # each rank holds about half of the mlp's 32·64 + 2·64² + 64·10 + biases parameters
        whole = (32 * 64 + 64 + 2 * (64 * 64 + 64) + 64 * 10 + 10) * 4
        (share,) = set(series("param_bytes")["mean"])
        assert 0.45 * whole <= share <= 0.52 * whole
