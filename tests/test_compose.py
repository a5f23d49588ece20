"""docker-compose.yml: valid (Debian's docker-compose v1 checks it without an engine), refusing to
start without its secrets, and every service's command started here as a process with the
environment `docker-compose config` resolves, from the installed wheel (not this checkout): the
system migrates, serves the dashboard and runs a run. No Docker engine runs on this machine."""

from __future__ import annotations

import os
import secrets
import shutil
import signal
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import psutil
import psycopg
import pytest
import yaml  # type: ignore[import-untyped]

from cli.redis_server import redis_server_binary
from cli.wait import wait_for
from testkit.require import require
from testkit.stack import run_spec
from torchyard.net import free_port
from torchyard.settings import Settings

ROOT = Path(__file__).resolve().parent.parent
PG_ADMIN_DSN = os.environ.get("TORCHYARD_TEST_PG", "postgresql://postgres@127.0.0.1:5432/test")

# Not the unit tier: a fresh clone may lack docker-compose (CI installs it: .ci/run).
pytestmark = pytest.mark.tools


def compose_config(env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    require(
        shutil.which("docker-compose"), "docker-compose (v1) checks docker-compose.yml: apt-get install docker-compose"
    )
    base = {
        k: v for k, v in os.environ.items() if k not in {"TORCHYARD_SECRET_KEY", "POSTGRES_PASSWORD", "REDIS_PASSWORD"}
    }
    return subprocess.run(
        ["docker-compose", "-f", "docker-compose.yml", "config"],
        cwd=ROOT,
        env={**base, **env},
        capture_output=True,
        text=True,
        timeout=60,
    )


def dot_env() -> dict[str, str]:
    """What README's one command writes to .env."""
    return {
        "TORCHYARD_SECRET_KEY": secrets.token_hex(32),
        "POSTGRES_PASSWORD": secrets.token_hex(16),
        "REDIS_PASSWORD": secrets.token_hex(16),
        "TORCHYARD_ADMIN_TOKEN": f"ty_{secrets.token_urlsafe(32)}",
    }


def test_compose_file_is_valid_and_refuses_to_start_without_its_secrets() -> None:
    missing = compose_config({})
    assert missing.returncode != 0 and "make .env first" in missing.stderr, missing.stderr
    check = compose_config(dot_env())
    assert check.returncode == 0, check.stderr
    services = yaml.safe_load(check.stdout)["services"]
    assert {"postgres", "redis", "migrate", "api", "ingest", "worker", "gpu-worker"} <= set(services)
    # A CPU worker by default (a host without NVIDIA's toolkit still gets one); the GPU worker only
    # with --profile gpu, reserving the GPUs.
    assert services["worker"]["environment"]["TORCHYARD_NODE_DEVICES"] == "cpu" and "deploy" not in services["worker"]
    assert services["gpu-worker"]["profiles"] == ["gpu"] and "worker" not in services["gpu-worker"].get("profiles", [])
    gpu = services["gpu-worker"]["deploy"]["resources"]["reservations"]["devices"][0]
    assert (
        gpu["capabilities"] == ["gpu"] and services["gpu-worker"]["environment"]["TORCHYARD_NODE_DEVICES"] == "cpu,cuda"
    )
    assert "version" not in yaml.safe_load((ROOT / "docker-compose.yml").read_text())  # obsolete in Compose
    ignored = set((ROOT / ".dockerignore").read_text().split())
    assert {".env", ".git", "frontend/node_modules"} <= ignored  # secrets and 90 MB out of the context
    assert services["migrate"]["command"] == ["torchyard", "migrate"]
    for name in ("migrate", "api", "ingest", "worker", "gpu-worker"):  # one volume: bundles, checkpoints, run dirs
        assert any(":/var/lib/torchyard" in str(v) for v in services[name].get("volumes", [])), name
    # A worker is root so that runs are isolated, with the capabilities that takes and no more;
    # the rest run as the image's user, and the image has the run user.
    for name in ("worker", "gpu-worker"):
        worker = services[name]
        assert worker["command"] == ["torchyard", "worker"], name
        assert worker["user"] == "root" and worker["cap_drop"] == ["ALL"] and not worker.get("privileged"), name
        assert {"SYS_ADMIN", "SETUID", "SETGID", "KILL"} <= set(worker["cap_add"]) and len(worker["cap_add"]) <= 8
    assert not any(services[name].get("user") for name in ("migrate", "api", "ingest"))
    run_user = Settings.model_fields["run_user"].default
    assert f"--shell /usr/sbin/nologin {run_user}" in (ROOT / "Dockerfile").read_text()


@pytest.fixture
def wheel_site(tmp_path: Path) -> Path:
    """This project installed from its wheel into a folder of its own (no dependencies: they are
    the environment's), as the image installs it."""
    site = tmp_path / "site"
    # setuptools builds in the checkout's build/ and reuses it: a module deleted since would ship
    shutil.rmtree(ROOT / "build", ignore_errors=True)
    built = subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation", "--target", str(site), "."],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=180,
    )
    shutil.rmtree(ROOT / "build", ignore_errors=True)
    assert built.returncode == 0, built.stderr[-3000:]
    return site


@pytest.fixture
def compose_db(tmp_path: Path) -> Iterator[tuple[str, str]]:
    """The compose database as PostgreSQL here: a role `torchyard` owning a fresh database."""
    name = f"torchyard_compose_{uuid.uuid4().hex[:8]}"
    with psycopg.connect(PG_ADMIN_DSN, autocommit=True) as conn:
        if conn.execute("SELECT 1 FROM pg_roles WHERE rolname = 'torchyard'").fetchone() is None:
            conn.execute("CREATE ROLE torchyard LOGIN")
        conn.execute(f'CREATE DATABASE "{name}" OWNER torchyard')
    yield "127.0.0.1:5432", name
    with psycopg.connect(PG_ADMIN_DSN, autocommit=True) as conn:
        conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


@pytest.mark.stack
@pytest.mark.timeout(120)
def test_every_compose_service_starts_as_a_process_and_the_system_runs_a_run(
    tmp_path: Path, wheel_site: Path, compose_db: tuple[str, str]
) -> None:
    env = dot_env()
    services = yaml.safe_load(compose_config(env).stdout)["services"]
    pg_host, pg_db = compose_db
    redis_port, api_port = free_port(), free_port()
    here = {  # compose's service names, as this machine reaches them
        "@postgres:5432/torchyard": f"@{pg_host}/{pg_db}",
        "@redis:6379/": f"@127.0.0.1:{redis_port}/",
        "http://api:8000": f"http://127.0.0.1:{api_port}",
    }

    def service_env(name: str) -> dict[str, str]:
        out = {k: v for k, v in os.environ.items() if not k.startswith("TORCHYARD_") and k != "PYTHONPATH"}
        for key, value in services[name].get("environment", {}).items():
            for compose_name, local in here.items():
                value = str(value).replace(compose_name, local)
            out[key] = value
        # the volume, and the image's own settings (Dockerfile ENV): the installed wheel, its dashboard
        out.update(
            TORCHYARD_STATE_DIR=str(tmp_path / "state"),
            TORCHYARD_FRONTEND_DIST=str(ROOT / "frontend" / "dist"),
            PYTHONPATH=str(wheel_site),
        )
        return out

    def command(name: str) -> list[str]:
        args = [str(a) for a in services[name]["command"]]
        assert args[0] == "torchyard", args
        args = [sys.executable, "-m", "cli.main", *args[1:]]  # the console script, from the wheel
        return [f"{api_port}" if a == "8000" else "127.0.0.1" if a == "0.0.0.0" else a for a in args]

    redis_cmd = [str(a) for a in services["redis"]["command"]]
    assert redis_cmd[0] == "redis-server" and "default" in redis_cmd
    processes: list[subprocess.Popen[bytes]] = []
    started = lambda argv, name: processes.append(  # noqa: E731
        subprocess.Popen(argv, cwd=tmp_path, env=service_env(name), start_new_session=True)
    )
    try:
        (tmp_path / "redis").mkdir()
        started([redis_server_binary(), *redis_cmd[1:], "--port", str(redis_port), "--bind", "127.0.0.1",
                 "--dir", str(tmp_path / "redis")], "redis")  # fmt: skip
        migrated = subprocess.run(
            command("migrate"), cwd=tmp_path, env=service_env("migrate"), capture_output=True, text=True, timeout=120
        )
        assert migrated.returncode == 0, migrated.stderr[-3000:]
        for name in ("api", "ingest", "worker"):
            started(command(name), name)
        api = httpx.Client(
            base_url=f"http://127.0.0.1:{api_port}",
            headers={"Authorization": f"Bearer {env['TORCHYARD_ADMIN_TOKEN']}"},
            timeout=30,
        )
        wait_for(lambda: api.get("/readyz").status_code == 200, 60, "the compose api")
        page = api.get("/")
        assert page.status_code == 200 and '<div id="app">' in page.text, page.text[:300]
        wait_for(lambda: api.get("/api/v1/nodes").json(), 60, "the compose worker's heartbeat")
        submitted = api.post("/api/v1/runs", json=run_spec(name="compose", procs=1, steps=5, batch_size=8))
        assert submitted.status_code == 201, submitted.text

        def ended() -> dict[str, Any] | None:
            run = api.get(f"/api/v1/runs/{submitted.json()['id']}").json()
            return run if run["status"] in ("succeeded", "failed", "cancelled") else None

        run = wait_for(ended, 120, "the compose run to end")
        assert run["status"] == "succeeded", run["status_reason"]
        # Prometheus as docs/prometheus.yml tells it to scrape: its path, with a viewer token of its own.
        (job,) = yaml.safe_load((ROOT / "docs" / "prometheus.yml").read_text())["scrape_configs"]
        assert job["authorization"]["type"] == "Bearer" and job["static_configs"][0]["targets"] == ["api:8000"]
        viewer = api.post("/api/v1/tokens", json={"name": "prometheus", "role": "viewer"}).json()["token"]
        scraped = httpx.get(
            f"http://127.0.0.1:{api_port}{job['metrics_path']}", headers={"Authorization": f"Bearer {viewer}"}
        )
        assert scraped.status_code == 200 and 'torchyard_runs{status="succeeded"} 1' in scraped.text, scraped.text[:500]
        assert httpx.get(f"http://127.0.0.1:{api_port}{job['metrics_path']}").status_code == 401
    finally:
        for proc in reversed(processes):
            for child in psutil.Process(proc.pid).children(recursive=True) if proc.poll() is None else []:
                child.kill()
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)
