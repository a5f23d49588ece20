"""Bounds and bad numbers, against a live stack (api, ingest, worker; SQLite): every number a
client sends is finite and bounded (a 422 naming the field and the bound, never a 500), a member
cannot jump the queue, reads are capped, a hostile archive is refused at once; and a victim run
submitted alongside trains on, every step of every rank stored once."""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import tarfile
import time
import zipfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import psutil
import pytest

from cli.wait import wait_for
from testkit.stack import Client, RunningStack, read_sse, run_processes, run_spec, sqlite_stack

pytestmark = [pytest.mark.stack, pytest.mark.timeout(120)]
VICTIM_STEPS = 30


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningStack]:
    with sqlite_stack(
        tmp_path_factory.mktemp("bounds"), metrics_default_points=20, max_metric_keys=40, max_log_line_bytes=4096
    ) as running:
        yield running


@pytest.fixture(scope="module")
def victim(stack: RunningStack) -> Iterator[int]:
    """A run that trains while the others attack; it must end as it would have alone."""
    run = stack.client.submit(name="victim", steps=VICTIM_STEPS, procs=2, log_every=1)
    yield run["id"]
    stack.client.wait_status(run["id"], {"succeeded"})
    series = stack.client.http.get(
        f"/api/v1/runs/{run['id']}/metrics", params={"key": "loss", "max_points": 1000}
    ).json()
    for rank in ("0", "1"):
        assert series["ranks"][rank]["step"] == list(range(1, VICTIM_STEPS + 1)), f"rank {rank}: each step once"
    assert series["downsampled"] is False


def member(stack: RunningStack, name: str) -> Client:
    response = stack.client.http.post("/api/v1/tokens", json={"name": name, "role": "member"})
    assert response.status_code == 201, response.text
    return Client(stack.url, response.json()["token"])


def post_raw(client: Client, body: str) -> httpx.Response:
    return client.http.post("/api/v1/runs", content=body.encode(), headers={"Content-Type": "application/json"})


@pytest.mark.parametrize(
    ("field", "value", "words"),
    [
        ("training.lr", "Infinity", "finite number"),
        ("training.lr", "-Infinity", "finite number"),
        ("training.lr", "NaN", "finite number"),
        ("training.lr", "1e400", "finite number"),  # Python's json reads it as inf
        ("training.steps", "1e400", "finite number"),
        ("training.stall_timeout_s", "NaN", "finite number"),
        ("training.max_duration_s", "1e12", "less than or equal to 2592000"),
        ("training.cancel_grace_s", "Infinity", "finite number"),
        ("training.seed", str(2**64), "less than or equal to 9223372036854775807"),
        ("training.batch_size", str(2**40), "less than or equal to 1048576"),
        ("resources.priority", "1e400", "finite number"),
        ("workload.params.samples", "1000000000", "less than or equal to 10000000"),
        ("workload.params.samples", "9000000", "samples × input_dim (9000000 × 32) must be at most 268,435,456"),
        ("workload.params.hidden", "60000", "parameters"),
    ],
)
def test_non_finite_or_huge_numbers_are_422_naming_the_field(
    stack: RunningStack, victim: int, field: str, value: str, words: str
) -> None:
    spec = run_spec(name="bad-number")
    section, *rest = field.split(".")
    target = spec[section]
    for part in rest[:-1]:
        target = target[part]
    target[rest[-1]] = "__VALUE__"
    body = json.dumps(spec).replace('"__VALUE__"', value)
    response = post_raw(stack.client, body)
    assert response.status_code == 422, response.text
    errors = response.json()["detail"]
    assert any(rest[-1] in json.dumps(e["loc"]) or rest[-1] in e["msg"] for e in errors), errors
    assert words in response.text, response.text


def test_a_charlm_too_big_for_memory_is_refused_before_any_rank_allocates_it(stack: RunningStack) -> None:
    too_wide = run_spec(name="big", workload="charlm", params={"d_model": 4096, "n_layers": 8, "n_heads": 8})
    response = stack.client.http.post("/api/v1/runs", json=too_wide)
    assert response.status_code == 422 and "more than 134,217,728" in response.text
    long_batch = run_spec(name="big", workload="charlm", params={"seq_len": 4096, "n_heads": 8}, batch_size=4096)
    response = stack.client.http.post("/api/v1/runs", json=long_batch)
    assert response.status_code == 422 and "training.batch_size (4096) is too large" in response.text


def test_priority_above_the_member_maximum_is_admin_only(stack: RunningStack) -> None:
    alice = member(stack, "alice")
    spec = run_spec(name="jump", steps=100_000)
    spec["resources"]["priority"] = 5
    jump = alice.http.post("/api/v1/runs", json=spec)
    assert jump.status_code == 422, jump.text
    (error,) = jump.json()["detail"]
    assert error["loc"] == ["body", "resources", "priority"]
    assert "above 0" in error["msg"] and "TORCHYARD_MAX_MEMBER_PRIORITY" in error["msg"] and "admin" in error["msg"]
    spec["resources"]["priority"] = -3
    lower = alice.http.post("/api/v1/runs", json=spec)
    spec["resources"]["priority"] = 50
    admin = stack.client.http.post("/api/v1/runs", json=spec)
    assert lower.status_code == admin.status_code == 201
    assert admin.json()["priority"] == 50
    for run in (lower, admin):
        stack.client.http.post(f"/api/v1/runs/{run.json()['id']}/cancel")


@pytest.mark.parametrize(
    ("path", "params", "headers", "words"),
    [
        ("logs", {"rank": 2**63}, {}, "less than or equal to 2147483647"),
        ("logs", {"after": 2**64}, {}, "less than or equal to 9223372036854775807"),
        ("logs", {"limit": 10**9}, {}, "less than or equal to 10000"),
        ("metrics", {"key": "loss", "max_points": 10**9}, {}, "less than or equal to 10000"),
        ("metrics", {"key": "loss", "step_min": 2**64}, {}, "less than or equal to 9223372036854775807"),
        ("metrics", {"key": "loss", "step_max": -1}, {}, "greater than or equal to 0"),
        ("metrics", {"key": "k" * 201}, {}, "at most 200 characters"),
        ("stream", {}, {"Last-Event-ID": "1" * 23}, "not a stream id"),
        ("stream", {}, {"Last-Event-ID": "1-" + "9" * 21}, "not a stream id"),
        ("stream", {}, {"Last-Event-ID": "18446744073709551616-0"}, "not a stream id"),  # 2**64
        ("stream", {"since": "\u00b2"}, {}, "not a stream id"),  # a digit to str.isdigit, not to int()
        ("stream", {"since": "x" * 5000}, {}, "not a stream id"),
    ],
)
def test_huge_or_garbage_query_values_are_4xx_with_a_message(
    stack: RunningStack, victim: int, path: str, params: dict[str, Any], headers: dict[str, str], words: str
) -> None:
    response = stack.client.http.get(f"/api/v1/runs/{victim}/{path}", params=params, headers=headers)
    assert response.status_code == 422, response.text
    assert words in response.text


def test_a_metrics_read_is_capped_by_default_and_says_it_was_downsampled(stack: RunningStack) -> None:
    run = stack.client.submit(name="long", steps=200, procs=1, batch_size=8)
    stack.client.wait_status(run["id"], {"succeeded"})
    url = f"/api/v1/runs/{run['id']}/metrics"
    capped = stack.client.http.get(url, params={"key": "loss"}).json()  # TORCHYARD_METRICS_DEFAULT_POINTS=20 here
    assert capped["downsampled"] is True
    assert len(capped["ranks"]["0"]["step"]) <= 20 and len(capped["aggregate"]["step"]) <= 20
    whole = stack.client.http.get(url, params={"key": "loss", "max_points": 10_000}).json()
    assert whole["downsampled"] is False and whole["ranks"]["0"]["step"] == list(range(1, 201))


def hostile_tar(members: int) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tf:
        for i in range(members):
            tf.addfile(tarfile.TarInfo(f"f{i}"), io.BytesIO(b""))
    return buf.getvalue()


def hostile_zip(members: int) -> bytes:
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_STORED) as zf:
        for i in range(members):
            zf.writestr(f"f{i}", b"")
    return buf.getvalue()


# A script that floods its run: a 100 kB log line, 60 new metric keys per step and one 300
# characters long (the stack above allows 40 keys and 4 KiB lines).
FLOOD = """
import torchyard

print("x" * 100_000, flush=True)
for step in range(1, 4):
    torchyard.log(step, **{f"k{i:02d}": float(i) for i in range(60)}, **{"y" * 300: 1.0})
print("flood done", flush=True)
"""


def test_a_script_flooding_keys_and_log_is_cut_dropped_and_told(stack: RunningStack, victim: int) -> None:
    run_id = stack.client.submit_script("flood", "flood.py", FLOOD, steps=3)["id"]
    stack.client.wait_status(run_id, {"succeeded"})

    def told() -> dict[str, str] | None:
        lines = stack.client.http.get(f"/api/v1/runs/{run_id}/logs", params={"limit": 10_000}).json()
        texts = {line["text"] for line in lines}
        warnings = {t for t in texts if t.startswith("torchyard: ")}
        return {"texts": "\n".join(texts), "warnings": "\n".join(warnings)} if len(warnings) == 3 else None

    seen = wait_for(told, 30, "the three bound warnings in the flood's log")
    assert "dropped 3 metric points whose key is longer than 200 characters" in seen["warnings"]
    assert "past this run's limit of 40 keys (TORCHYARD_MAX_METRIC_KEYS)" in seen["warnings"]
    assert "cut 1 log lines longer than 4,096 bytes" in seen["warnings"]
    assert "x" * 4067 + " … [truncated 95933 bytes]" in seen["texts"].split("\n")  # 4,095 bytes, marker and all
    assert "flood done" in seen["texts"]
    keys = stack.client.http.get(f"/api/v1/runs/{run_id}/metrics/keys").json()
    assert len(keys) == 40 and all(len(k) <= 200 for k in keys)
    text = stack.client.http.get("/metrics").text
    dropped = re.search(
        r'^torchyard_ingest_dropped_total\{kind="dropped_points_key_limit"\} (\d+)$', text, re.MULTILINE
    )
    assert dropped and int(dropped.group(1)) > 0, text


# 64 MB before its newline, written as a rank would print a huge tensor, then a short line.
HUGE_LINE = """
import sys

chunk = "y" * (1 << 20)
for _ in range(64):
    sys.stdout.write(chunk)
    sys.stdout.flush()
print(flush=True)
print("the line after", flush=True)
"""
HUGE_BYTES = 64 << 20


def status_kb(pid: int, field: str) -> int:
    """A figure of /proc/<pid>/status in kB (VmRSS: resident now, VmHWM: its peak)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(f"{field}:"):
            return int(line.split()[1])
    raise KeyError(field)


def test_a_64_mb_line_is_cut_as_the_worker_reads_it_and_its_memory_stays_flat(stack: RunningStack) -> None:
    """The worker reads no more of a line than the cap (4 KiB here): the stored and the live line
    are cut with the marker, the next line arrives, the run succeeds, and the peak RSS of the
    worker process that ran the share grows by far less than the line."""
    pool = psutil.Process(stack.stack.procs["worker"].pid).children()  # the Celery pool: shares run here
    for proc in pool:
        Path(f"/proc/{proc.pid}/clear_refs").write_text("5")  # resets its VmHWM (peak RSS) to now
    rss_before = {proc.pid: status_kb(proc.pid, "VmRSS") for proc in pool}
    run_id = stack.client.submit_script("huge-line", "huge.py", HUGE_LINE, steps=1)["id"]
    share = wait_for(
        lambda: _running_in(pool, run_id, stack.settings.checkpoints), 60, "the share to start in a pool process"
    )
    live = read_sse(stack, run_id)  # from the start until the run ends: what a browser is sent
    stack.client.wait_status(run_id, {"succeeded"})
    growth_kb = status_kb(share, "VmHWM") - rss_before[share]
    print(f"worker pool process {share}: peak RSS grew {growth_kb / 1024:.1f} MiB while it read a 64 MiB line")

    def stored() -> list[str] | None:
        lines = stack.client.http.get(f"/api/v1/runs/{run_id}/logs", params={"rank": 0, "limit": 100}).json()
        texts = [line["text"] for line in lines]
        return texts if "the line after" in texts else None

    texts = wait_for(stored, 30, "the line after the huge one to be stored")
    (huge,) = [t for t in texts if t.startswith("y")]
    assert huge.startswith("y" * 1000) and len(huge.encode()) <= 4096, huge[-80:]
    cut = re.fullmatch(r"y+ … \[truncated (\d+) bytes\]", huge.replace("[torchyard-rank 0]:", ""))
    assert cut and int(cut.group(1)) >= HUGE_BYTES - 4096, huge[-80:]
    live_lines = [text for e in live if e.event == "logs" for _, _, text in e.data["lines"]]
    assert huge in live_lines and "the line after" in live_lines
    assert max(len(text.encode()) for text in live_lines) <= 4096
    assert growth_kb < 16 * 1024, f"the worker's peak RSS grew {growth_kb / 1024:.1f} MiB for a 64 MiB line"


def _running_in(pool: list[psutil.Process], run_id: int, checkpoints: Path) -> int | None:
    """The pid of the pool process whose descendants are the run's processes."""
    ours = {p.pid for p in run_processes(run_id, checkpoints)}
    for proc in pool:
        with contextlib.suppress(psutil.Error):
            if ours & {c.pid for c in proc.children(recursive=True)}:
                return proc.pid
    return None


def cpu_seconds(pid: int) -> float:
    """User + system CPU of a process (its own threads), from /proc."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def test_an_archive_of_too_many_members_is_refused_while_read(stack: RunningStack, victim: int) -> None:
    """Timed as the api's CPU (this machine's other tenants make wall time noisy): a 1.9 MB tar.gz
    of 300,000 empty members cost 6 s of CPU before its 422 when every member was read first."""
    api = stack.stack.procs["api"].pid
    for name, data in [("many.tar.gz", hostile_tar(300_000)), ("many.zip", hostile_zip(20_000))]:
        before, started = cpu_seconds(api), time.perf_counter()
        response = stack.client.http.post("/api/v1/bundles", files={"file": (name, data)})
        cpu, wall = cpu_seconds(api) - before, time.perf_counter() - started
        assert response.status_code == 422, response.text
        assert "the archive has more than 10000 members" in response.text
        assert cpu < 2.0, f"{name} ({len(data):,} bytes) cost the api {cpu:.2f} s of CPU ({wall:.2f} s) to refuse"


def test_prometheus_counts_what_ingest_dropped_by_kind(stack: RunningStack) -> None:
    text = stack.client.http.get("/metrics").text
    assert "# TYPE torchyard_ingest_dropped_total counter" in text
    kinds = set(re.findall(r'^torchyard_ingest_dropped_total\{kind="(\w+)"\} \d+$', text, re.MULTILINE))
    assert kinds == {"dropped_points_long_key", "dropped_points_key_limit", "truncated_log_lines", "dropped_log_lines"}
