"""The rank wall, attacked from a real submitted script on a live stack (SQLite, private Redis with
ACLs, api + ingest + worker): every attack fails, a concurrently running run of another member
succeeds with each of its steps stored exactly once, and the platform stays healthy. The attack
script and the scenario live in ``benchmarks/attacks.py`` (``python -m benchmarks.attacks``
prints the same as a table)."""

from __future__ import annotations

import json
import os
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from benchmarks import attacks
from cli.wait import wait_for
from testkit.stack import RunningStack, sqlite_stack
from torchyard import streams

pytestmark = [pytest.mark.stack, pytest.mark.timeout(120)]
IS_ROOT = os.geteuid() == 0
VICTIM_STEPS = attacks.VICTIM_STEPS


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningStack]:
    with sqlite_stack(tmp_path_factory.mktemp("walls")) as running:
        yield running


@pytest.fixture(scope="module")
def scenario(stack: RunningStack) -> attacks.Scenario:
    database = Path(stack.settings.sqlalchemy_url.removeprefix("sqlite:///"))
    assert stack.redis is not None
    result = attacks.run_scenario(
        stack.settings,
        stack.token,
        database,
        stack.redis.data_dir / "platform-password",
        [p.pid for p in stack.stack.procs.values()],
        stack.stack.procs["worker"].pid,
        attacks.row_counter(stack.settings.sqlalchemy_url),
        victim_steps=VICTIM_STEPS,
        timeout=240,
    )
    print("\n" + attacks.table(result.results, width=400))  # in the test's output: what each attack met
    return result


def platform_redis(stack: RunningStack) -> redis.Redis:
    assert stack.redis is not None
    return redis.Redis.from_url(stack.redis.url)


def test_victim_succeeds_with_every_step_once_while_attacked(scenario: attacks.Scenario) -> None:
    assert scenario.victim["status"] == "succeeded", scenario.victim
    rows = scenario.victim_rows
    assert sum(rows.values()) == 2 * VICTIM_STEPS and set(rows.values()) == {1}, "each (rank, step) exactly once"
    assert scenario.attacker["status"] == "succeeded", "the attacker's own forged 'failed' report was not applied"
    assert scenario.worker_alive


def test_redis_and_environment_attacks_fail(scenario: attacks.Scenario) -> None:
    """What the per-attempt Redis credential and the allow-listed environment stop, as any user."""
    results = {r.attack: r for r in scenario.results if r.attack not in attacks.NEEDS_ROOT}
    assert len(results) >= 15, [r.attack for r in scenario.results]
    broken = [f"{r.attack}: {r.detail}" for r in results.values() if not r.held]
    assert not broken, "\n" + attacks.table(scenario.results)
    for name, result in results.items():
        if name.startswith(("XADD", "SET", "SADD", "squat", "register", "pre-plant", "read any")) and "own" not in name:
            assert "NoPermissionError" in result.detail or "NOPERM" in result.detail, (name, result.detail)
    assert "no such env var" in results["platform secrets in the environment"].detail
    assert "ping" in results["Celery broadcast('shutdown')"].detail  # refused at its first command


@pytest.mark.skipif(not IS_ROOT, reason="ranks are walled off (run user, PID namespace) only when the worker is root")
def test_file_process_and_signal_attacks_fail_as_root(scenario: attacks.Scenario) -> None:
    results = {r.attack: r for r in scenario.results if r.attack in attacks.NEEDS_ROOT}
    assert set(results) == attacks.NEEDS_ROOT
    broken = [f"{r.attack}: {r.detail}" for r in results.values() if not r.held]
    assert not broken, "\n" + attacks.table(scenario.results)
    for name, result in results.items():
        assert (
            "PermissionError" in result.detail
            or "ProcessLookupError" in result.detail
            or ("FileNotFoundError" in result.detail)
        ), (name, result.detail)


@pytest.mark.skipif(not IS_ROOT, reason="a run's temp space is its own only when the worker is root")
def test_a_runs_temp_space_is_its_own_bounded_tmpfs(stack: RunningStack, scenario: attacks.Scenario) -> None:
    """Run A left a file in /tmp, /var/tmp and /dev/shm; the attacker, the same run user, neither
    saw nor read them (the rows above), and run A, whose DataLoader workers shared batches through
    its /dev/shm, found its files intact and succeeded."""
    assert scenario.temp_owner["status"] == "succeeded", scenario.temp_owner
    assert scenario.temp_sizes == {"/tmp": stack.settings.run_tmp_bytes, "/dev/shm": stack.settings.run_shm_bytes}


@pytest.mark.skipif(not IS_ROOT, reason="ranks write as the run user only when the worker is root")
def test_checkpoints_of_isolated_ranks_are_readable_by_the_platform_group_only(stack: RunningStack) -> None:
    """docker-compose's api runs as the image's user, not as the root worker: every file of a run's
    checkpoints is readable by the platform's group (the state dir's), and by no other user."""
    run = stack.client.submit(name="ckpt", steps=4, procs=1, checkpoint_every=2)
    stack.client.wait_status(run["id"], {"succeeded"})
    group = stack.settings.state_dir.stat().st_gid
    # where an unprivileged process can reach the checkpoint root (pytest's folders are root's, 0700)
    view = Path(tempfile.mkdtemp(dir="/tmp"))
    view.chmod(0o755)

    def read_all_as(gid: int) -> subprocess.CompletedProcess[str]:
        """``cat`` of every file under the run's checkpoints as user nobody in group ``gid``."""
        as_nobody = (
            f"setpriv --reuid=nobody --regid={gid} --clear-groups find {view}/{run['id']} -type f -exec cat {{}} +"
        )
        script = f"mount --bind {stack.settings.checkpoints} {view} && {as_nobody} | wc -c"
        return subprocess.run(["unshare", "--mount", "sh", "-c", script], capture_output=True, text=True, timeout=30)

    try:
        platform, other = read_all_as(group), read_all_as(65534)  # nogroup
    finally:
        view.rmdir()
    assert platform.returncode == 0 and not platform.stderr and int(platform.stdout) > 0, platform
    assert "Permission denied" in other.stderr and int(other.stdout) == 0, other


def test_attempt_users_are_gone_after_their_runs(stack: RunningStack, scenario: attacks.Scenario) -> None:
    client = platform_redis(stack)
    users = [u.decode() for u in client.execute_command("ACL", "USERS")]
    assert not [u for u in users if u.startswith(streams.RANK_USER_PREFIX)], users
    assert "default" in users and client.acl_getuser("default")["enabled"] is False


def test_scheduler_retires_stale_attempt_users(stack: RunningStack) -> None:
    """A worker that died before deleting its share's user: the scheduler deletes it."""
    client = platform_redis(stack)
    stale = streams.rank_user(987654, 1, 0)
    client.execute_command("ACL", "SETUSER", stale, *streams.rank_acl_rules(987654, "pw-of-a-dead-worker"))
    wait_for(
        lambda: stale.encode() not in client.execute_command("ACL", "USERS"),
        30,
        "the scheduler to delete the stale user",
    )


def test_planted_report_in_the_next_runs_streams_is_never_read(stack: RunningStack) -> None:
    """Even written with the platform's own credential before the run exists: its streams start empty."""
    client = platform_redis(stack)
    next_id = max(r["id"] for r in stack.client.http.get("/api/v1/runs").json()["items"]) + 1
    report = {"attempt": 1, "node": stack.settings.node_id, "event": "exited", "status": "failed", "reason": "PLANTED"}
    for key in (streams.run_stream(next_id), streams.rank_stream(next_id)):
        client.xadd(key, streams.encode(streams.REPORT, report))
    run = stack.client.submit(name="after-plant", steps=20, procs=1)
    assert run["id"] == next_id
    done = stack.client.wait_status(run["id"], {"succeeded"}, timeout=120)
    assert "PLANTED" not in (done["status_reason"] or "")


def test_keys_of_the_wrong_type_are_skipped_and_counted(stack: RunningStack) -> None:
    """A string in the active set, a non-run member, junk heartbeats: ingest and the scheduler go on,
    /metrics answers, and each refusal is counted."""
    client = platform_redis(stack)
    client.set("ty:run:424242", "not a stream")
    client.sadd(streams.ACTIVE_STREAMS, "ty:run:424242", "ty:evil")
    client.set(streams.node_key("junk"), "{not json")
    client.sadd(streams.NODES, "junk")
    run = stack.client.submit(name="after-junk", steps=30, procs=1)
    stack.client.wait_status(run["id"], {"succeeded"}, timeout=120)
    series = stack.client.http.get(f"/api/v1/runs/{run['id']}/metrics", params={"key": "loss"}).json()
    assert len(series["aggregate"]["step"]) == 30, "ingest kept writing"
    assert not client.sismember(streams.ACTIVE_STREAMS, "ty:evil")
    response = stack.client.http.get("/metrics")
    assert response.status_code == 200
    assert 'torchyard_rejected_total{reason="active-not-a-stream"}' in response.text
    rejected = {k.decode(): int(v) for k, v in client.hgetall(streams.REJECTED).items()}
    assert rejected.get("active-not-a-stream", 0) >= 2 and rejected.get("heartbeat", 0) >= 1, rejected
    nodes = [n["id"] for n in stack.client.http.get("/api/v1/nodes").json()]
    assert "junk" not in nodes and "evil" not in nodes


def test_ingest_refuses_what_a_rank_may_not_send(stack: RunningStack, scenario: attacks.Scenario) -> None:
    """The attacker wrote a report and metrics of another rank/attempt into its own rank stream:
    dropped and counted by reason."""
    client = platform_redis(stack)
    rejected = {k.decode(): int(v) for k, v in client.hgetall(streams.REJECTED).items()}
    assert rejected.get("type", 0) >= 1 and rejected.get("rank", 0) >= 1 and rejected.get("attempt", 0) >= 1, rejected


def test_ranks_env_is_an_allow_list() -> None:
    from workers import torchrun

    secret_env = {"TORCHYARD_DATABASE_URL": "postgresql://x", "TORCHYARD_SECRET_KEY": "s" * 40, "AWS_SECRET": "x"}
    old = {k: os.environ.get(k) for k in secret_env}
    os.environ.update(secret_env)
    try:
        from torchyard.settings import Settings

        store = {"dataset_store": "s3://bucket/datasets", "dataset_s3_secret_access_key": "S3-SECRET-0123456789"}
        env = torchrun.training_env(
            Settings(redis_url="redis://u:p@h:1/0", **store), 1, 1, {}, Path("/tmp"), "redis://r:q@h:1/0"
        )
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    assert not set(secret_env) & set(env) and "TORCHYARD_REDIS_URL" not in env
    assert not any("S3-SECRET" in value for value in env.values()), "ranks read a dataset store by presigned URLs"
    assert env["TORCHYARD_RANK_REDIS_URL"] == "redis://r:q@h:1/0"
    assert json.loads(env["TORCHYARD_SPEC"]) == {}
