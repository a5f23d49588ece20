"""The one reader of the environment: every process takes its configuration from here."""

from __future__ import annotations

import os
import secrets
import socket
import time
from functools import lru_cache
from pathlib import Path
from typing import Literal

from pydantic import Field, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="TORCHYARD_", extra="ignore")

    env: Literal["development", "production"] = Field(
        "development", description="production refuses SQLite and a missing admin token"
    )
    state_dir: Path = Field(
        Path.home() / ".torchyard",
        description="SQLite database, private Redis, worker state and run directories",
    )
    database_url: str = Field("", description="SQLAlchemy URL; default SQLite in state_dir")
    redis_url: str = Field("", description="Redis for broker and streams; `up` starts one if empty")
    api_url: str = Field("http://127.0.0.1:8000", description="where the CLI and workers reach the api")
    token: str = Field("", description="bearer token the CLI sends")
    admin_token: str = Field("", description="admin token `up` installs instead of a new one")
    host: str = Field("127.0.0.1", description="api bind address")
    port: int = Field(8000, description="api port")

    node_id: str = Field(default_factory=socket.gethostname, description="this worker's node id")
    node_host: str = Field("127.0.0.1", description="address other nodes reach this one at")
    node_slots: int = Field(
        default_factory=lambda: os.cpu_count() or 1, ge=1, description="processes this node runs at once"
    )
    node_devices: str = Field("", description="comma list, e.g. cpu,cuda; default: detected")
    heartbeat_s: float = Field(2.0, gt=0, description="worker heartbeat period")
    node_timeout_s: float = Field(15.0, gt=0, description="a node silent this long is lost")
    cancel_grace_s: float = Field(2.0, ge=0, description="SIGTERM to SIGKILL grace on cancel")
    scheduler_interval_s: float = Field(1.0, gt=0, description="scheduler pass period")
    ingest_batch: int = Field(500, ge=1, description="stream entries per ingest transaction")
    checkpoint_root: Path | None = Field(
        None, description="run checkpoints (shared storage for multi-node); default state_dir/checkpoints"
    )
    max_request_bytes: int = Field(1 << 20, ge=1024, description="largest request body the api accepts (413 above)")
    max_runs_in_flight: int = Field(50, ge=1, description="unfinished runs one token may have (429 above)")
    max_streams_per_token: int = Field(16, ge=1, description="live streams one token may hold open per api process")
    max_bundle_bytes: int = Field(50 * 2**20, ge=1024, description="largest code bundle an upload may be (413 above)")
    secret_key: str = Field(
        "",
        description="signs the capabilities workers fetch code bundles with; development: generated once and "
        "kept in state_dir/secret_key; production: required",
    )

    @model_validator(mode="after")
    def _refuse_unsafe_production(self) -> Settings:
        if self.env == "production":
            if self.sqlalchemy_url.startswith("sqlite"):
                raise ValueError("TORCHYARD_ENV=production needs TORCHYARD_DATABASE_URL (PostgreSQL), not SQLite")
            if not self.redis_url:
                raise ValueError("TORCHYARD_ENV=production needs TORCHYARD_REDIS_URL")
            if len(self.secret_key) < 32:
                raise ValueError(
                    "TORCHYARD_ENV=production needs TORCHYARD_SECRET_KEY (at least 32 characters, e.g. "
                    "`python -c 'import secrets; print(secrets.token_urlsafe(48))'`)"
                )
        return self

    @property
    def sqlalchemy_url(self) -> str:
        return self.database_url or f"sqlite:///{self.state_dir / 'torchyard.db'}"

    @property
    def checkpoints(self) -> Path:
        return self.checkpoint_root or self.state_dir / "checkpoints"

    @property
    def devices(self) -> list[str]:
        if self.node_devices:
            return [d.strip() for d in self.node_devices.split(",") if d.strip()]
        return ["cpu", "cuda"] if _has_cuda() else ["cpu"]


def secret_key(settings: Settings) -> bytes:
    """TORCHYARD_SECRET_KEY, else (development) a random key made once and kept in the state
    directory, so the api's restarts, and a scheduler sharing the directory, agree on it."""
    if settings.secret_key:
        return settings.secret_key.encode()
    if settings.env == "production":  # the validator refuses this; never sign with a guessable key
        raise RuntimeError("TORCHYARD_SECRET_KEY is required in production")
    path = settings.state_dir / "secret_key"
    try:
        return path.read_bytes().strip()
    except FileNotFoundError:
        pass
    path.parent.mkdir(parents=True, exist_ok=True)
    try:  # O_EXCL: two processes starting at once keep the first one's key
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        for _ in range(100):  # the other process may not have written it yet
            if key := path.read_bytes().strip():
                return key
            time.sleep(0.02)
        raise RuntimeError(f"{path} is empty: delete it, or set TORCHYARD_SECRET_KEY") from None
    with os.fdopen(fd, "w") as f:
        f.write(secrets.token_urlsafe(48))
    return path.read_bytes().strip()


def _has_cuda() -> bool:
    # Avoid importing torch (2 s) in processes that never train: ask the driver's device nodes.
    return Path("/dev/nvidiactl").exists()


def settings_env(settings: Settings) -> dict[str, str]:
    """The settings as TORCHYARD_* variables, for the processes a parent starts."""
    return {
        f"TORCHYARD_{name.upper()}": str(value)
        for name, value in settings.model_dump().items()
        if value not in ("", None)
    }


@lru_cache
def get_settings() -> Settings:
    return Settings()
