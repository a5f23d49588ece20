"""The one reader of the environment: every process takes its configuration from here."""

from __future__ import annotations

import json
import os
import re
import secrets
import socket
import time
from functools import lru_cache
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

POOL_NAME = r"^[a-z0-9][a-z0-9_.-]{0,62}$"
SLURM_NAME = r"^[A-Za-z0-9_.-]{1,64}$"  # a partition or account as Slurm spells them


class PoolConfig(BaseModel):
    """A pool of machines runs go to (``resources.pool``), and what runs them: ``workers`` (the
    built-in pool: torchyard's own workers, placed by its gang scheduler) or ``slurm`` (an existing
    Slurm cluster that gang-schedules the run itself; README "Run on an existing Slurm cluster")."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = Field(..., pattern=POOL_NAME, description="what a run's resources.pool names")
    executor: Literal["workers", "slurm"] = Field("workers", description="who places and runs the pool's runs")
    partition: str = Field(
        "", description="slurm: the partition runs go to unless their spec names one; empty: the cluster's default"
    )
    account: str = Field("", description="slurm: the account jobs are charged to (sbatch --account); empty: none")
    slurm_conf: str = Field(
        "", description="slurm: the slurm.conf the client commands read (SLURM_CONF); empty: the host's own"
    )
    work_dir: Path | None = Field(
        None,
        description="slurm: a directory every node and this host see at the same path (shared storage): job files, "
        "each node's run directories; default state_dir/slurm/<name>",
    )
    python: str = Field("", description="slurm: the interpreter on the nodes (torchyard installed); default: ours")
    node_redis_url: str = Field(
        "", description="slurm: how the nodes reach Redis (a worker's credential); default TORCHYARD_REDIS_URL"
    )

    @field_validator("partition", "account")
    @classmethod
    def _slurm_name(cls, value: str) -> str:
        if value and not re.match(SLURM_NAME, value):
            raise ValueError(f"{value!r} is not a Slurm partition or account name (letters, digits, _ . -)")
        return value


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
    sqlite_busy_timeout_s: float = Field(
        30.0, gt=0, le=600, description="how long a SQLite write waits for another's lock before the api answers 503"
    )
    redis_url: str = Field("", description="Redis for broker and streams; `up` starts one if empty")
    redis_max_memory_bytes: int = Field(
        1 << 30,
        ge=64 << 20,
        description="the private Redis's maxmemory (noeviction: past it writes fail, no platform key is evicted)",
    )
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
    node_devices: str = Field(
        "",
        description="comma list of what this node runs, e.g. cpu,cuda or cuda; default: cpu, and cuda if it has GPUs",
    )
    node_gpus: str = Field(
        "",
        description="GPU indices this node offers, e.g. 0,1,2,3: overrides detection (pinning a worker to some "
        "GPUs, or tests); trusted as given, never checked against the hardware",
    )
    allow_waiting_for_nodes: bool = Field(
        False,
        description="accept a run no registered node can hold (the cluster may grow): it waits, with a warning, "
        "instead of a 422",
    )
    heartbeat_s: float = Field(2.0, gt=0, description="worker heartbeat period")
    node_timeout_s: float = Field(15.0, gt=0, description="a node silent this long is lost")
    cancel_grace_s: float = Field(2.0, ge=0, description="SIGTERM to SIGKILL grace on cancel")
    scheduler_interval_s: float = Field(1.0, gt=0, description="scheduler pass period")
    ingest_batch: int = Field(
        500, ge=1, description="stream entries per read of ingest (a backlog is read on, up to ~4 MiB a transaction)"
    )
    stream_keep_s: float = Field(
        5.0,
        ge=0,
        le=3600,
        description="seconds of entries a run's streams keep for live viewers once ingested (README 'Limits')",
    )
    checkpoint_root: Path | None = Field(
        None, description="run checkpoints (shared storage for multi-node); default state_dir/checkpoints"
    )
    dataset_root: Path | None = Field(
        None,
        description="datasets' shards (shared storage for multi-node: every worker reads them where the api wrote "
        "them); default state_dir/datasets. With TORCHYARD_DATASET_STORE: only where the api stages an upload",
    )
    dataset_store: str = Field(
        "",
        description="where datasets' shards live: empty, the folder TORCHYARD_DATASET_ROOT; or s3://BUCKET/PREFIX, "
        "an S3-compatible object store (AWS S3, MinIO, ...) that the api writes and each rank reads only its run's "
        "dataset from, through presigned GET URLs (README 'Datasets')",
    )
    dataset_s3_endpoint_url: str = Field(
        "", description="the object store's URL (MinIO: http://HOST:9000); empty: AWS S3"
    )
    dataset_s3_region: str = Field("us-east-1", description="the object store's region (signatures name it)")
    dataset_s3_access_key_id: str = Field(
        "", description="the api's and the workers' key for the store; empty: boto3's own (AWS_*, a profile, a role)"
    )
    dataset_s3_secret_access_key: str = Field("", description="its secret; never given to a rank")
    dataset_url_ttl_s: int = Field(
        7 * 86_400,
        ge=60,
        le=7 * 86_400,
        description="how long the presigned URLs a run's ranks read an object store with stay valid (at most 7 "
        "days, SigV4's bound; temporary credentials end them sooner): each attempt gets new ones",
    )
    max_shard_bytes: int = Field(
        1 << 30, ge=1 << 20, description="largest dataset shard an upload may be (413 above); the CLI writes ~64 MB"
    )
    max_dataset_bytes: int = Field(
        1 << 40, ge=1 << 20, description="largest a dataset's shards may add up to (413 for the shard that passes it)"
    )
    max_member_datasets: int = Field(
        100, ge=1, description="datasets one token may own at once (429 for the next create): delete one first"
    )
    max_member_dataset_bytes: int = Field(
        4 << 40,
        ge=1 << 20,
        description="what every dataset one token owns may add up to (413 for the shard that passes it)",
    )
    max_member_checkpoint_bytes: int = Field(
        200 << 30,
        ge=1 << 20,
        description="what the kept checkpoints of one token's runs may take on disk: past it the token's next run is "
        "a 429 until it deletes some (DELETE /api/v1/runs/{id}/checkpoints)",
    )
    frontend_dist: Path | None = Field(
        None,
        description="the built dashboard the api serves at / (default: frontend/dist of this checkout; "
        "an installed wheel or image names it, e.g. /app/frontend/dist)",
    )
    max_request_bytes: int = Field(1 << 20, ge=1024, description="largest request body the api accepts (413 above)")
    max_runs_in_flight: int = Field(50, ge=1, description="unfinished runs one token may have (429 above)")
    max_streams_per_token: int = Field(16, ge=1, description="live streams one token may hold open per api process")
    live_shared_feed: bool = Field(
        True, description="viewers of a run share one reader of its streams (off: a reader per viewer, as before)"
    )
    live_feed_backlog: int = Field(
        200,
        ge=1,
        description="event batches a live viewer may fall behind its run's shared reader before it reads on its own",
    )
    max_bundle_bytes: int = Field(50 * 2**20, ge=1024, description="largest code bundle an upload may be (413 above)")
    # Bounds on what users and their ranks can make the platform hold (README "Limits").
    max_member_priority: int = Field(
        0, ge=-100, le=100, description="the highest resources.priority a member may set; above it only an admin may"
    )
    metrics_default_points: int = Field(
        2000, ge=2, le=10_000, description="points per series a metrics read returns when it gives no max_points"
    )
    max_metric_keys: int = Field(
        1000, ge=1, description="distinct metric keys one run may log; new keys past it are dropped"
    )
    max_log_line_bytes: int = Field(16 * 1024, ge=256, description="a longer log line is cut to this (UTF-8 bytes)")
    max_log_bytes_per_run: int = Field(
        100 * 2**20, ge=1024, description="log text one run may store; lines past it are dropped"
    )
    # Live alerts (backend/alerts.py): a run slower than it was, or waiting more for communication.
    alert_throughput_drop: float = Field(
        0.3,
        gt=0,
        lt=1,
        description="alert when a run's samples/s (rank 0's) falls this share below its own moving baseline "
        "(0.3: to under 70 %) for alert_after_steps logged steps in a row",
    )
    alert_comm_fraction_rise: float = Field(
        0.2,
        gt=0,
        le=1,
        description="alert when a run's comm fraction (rank 0's) rises this much above its own moving baseline "
        "(0.2: 20 points of the step) for alert_after_steps logged steps in a row",
    )
    alert_baseline_steps: int = Field(
        50, ge=2, le=1_000_000, description="span of the alerts' moving baselines (an EWMA), in logged steps"
    )
    alert_after_steps: int = Field(
        3,
        ge=1,
        le=1000,
        description="logged steps in a row past an alert's threshold before it is raised (and back within half "
        "of it before it ends): one slow step (a GC pause, a checkpoint) is no slowdown",
    )
    alert_after_s: float = Field(
        10.0,
        ge=0,
        le=86_400,
        description="seconds (of the points' own times) that the alert_after_steps steps past a threshold must span "
        "before an alert is raised or ends: a moment's load on a run of short steps is no slowdown",
    )
    stall_alert_floor_s: float = Field(
        30.0,
        ge=0,
        le=86_400,
        description="a run without training.stall_timeout_s is flagged as stalled (an alert with the ranks' "
        "diagnosis; it keeps running) after no step for stall_alert_factor x its mean step time, and never "
        "sooner than this (0: no default stall detection)",
    )
    stall_alert_factor: float = Field(
        10.0, ge=1, le=10_000, description="see stall_alert_floor_s: how many mean step times without a step"
    )
    fr_buffer_entries: int = Field(
        200,
        ge=0,
        le=100_000,
        description="collectives each rank's Flight Recorder keeps (TORCH_FR_BUFFER_SIZE; Gloo and NCCL): what a hang "
        "diagnosis compares across ranks; 0: off (the diagnosis then has only the ranks' Python stacks). A dump "
        "reads the whole ring: 200 entries took ~10 ms here, 1,000 ~0.4 s (benchmarks/flight_recorder.py)",
    )
    run_user: str = Field(
        "torchyard-run",
        description="unprivileged user a root worker runs every rank as (created when absent); ignored when "
        "the worker is not root",
    )
    run_tmp_bytes: int = Field(
        2 * 2**30,
        ge=2**20,
        description="size of each run's private /tmp (a tmpfs, also its /var/tmp) on a root worker",
    )
    run_shm_bytes: int = Field(
        2 * 2**30,
        ge=2**20,
        description="size of each run's private /dev/shm (a tmpfs: DataLoader workers, NCCL) on a root worker",
    )
    run_max_pids: int = Field(
        4096,
        ge=16,
        le=4_194_304,
        description="processes and threads one run may have on a node (a pids control group on a root worker; a "
        "fork past it fails in the run alone)",
    )
    run_max_memory_bytes: int = Field(
        0,
        ge=0,
        description="memory one run may take on a node (a memory control group on a root worker: past it the "
        "kernel kills a process of that run); 0: no cap but the node's; resources.memory_limit_bytes lowers it",
    )
    run_max_disk_bytes: int = Field(
        20 * 2**30,
        ge=2**20,
        description="disk one run's run directory and checkpoints may take on a node, watched every few seconds: "
        "past it the run fails, saying so",
    )
    pools: list[PoolConfig] = Field(
        default_factory=lambda: [PoolConfig(name="local")],
        description="where runs go (JSON list): the built-in pool of torchyard's workers (at most one) and Slurm "
        'clusters, e.g. [{"name": "local"}, {"name": "hpc", "executor": "slurm", "partition": "gpu"}]',
    )
    default_pool: str = Field("", description="the pool of a run whose spec names none; empty: the first of pools")
    secret_key: str = Field(
        "",
        description="signs the capabilities workers fetch code bundles with; development: generated once and "
        "kept in state_dir/secret_key; production: required",
    )

    @field_validator("node_gpus")
    @classmethod
    def _gpu_indices(cls, value: str) -> str:
        parse_gpu_indices(value, "TORCHYARD_NODE_GPUS")
        return value

    @field_validator("dataset_store")
    @classmethod
    def _store_url(cls, value: str) -> str:
        if value and not re.match(r"^s3://[a-z0-9][a-z0-9.-]{1,61}[a-z0-9](/[^/].*)?$", value):
            raise ValueError(
                f"TORCHYARD_DATASET_STORE ({value!r}) must be empty (the folder TORCHYARD_DATASET_ROOT) or "
                "s3://BUCKET/PREFIX"
            )
        return value.rstrip("/")

    @model_validator(mode="after")
    def _pools(self) -> Settings:
        names = [p.name for p in self.pools]
        if not names or len(set(names)) != len(names):
            raise ValueError(f"TORCHYARD_POOLS ({names}) must name at least one pool, each once")
        if sum(p.executor == "workers" for p in self.pools) > 1:
            raise ValueError("TORCHYARD_POOLS: at most one pool of executor 'workers' (the built-in one)")
        if self.default_pool and self.default_pool not in names:
            raise ValueError(f"TORCHYARD_DEFAULT_POOL ({self.default_pool!r}) is not in TORCHYARD_POOLS: {names}")
        return self

    def pool(self, name: str | None) -> PoolConfig:
        """The pool ``name`` (None: the default one); a KeyError when there is none of that name."""
        wanted = name or self.default_pool or self.pools[0].name
        for pool in self.pools:
            if pool.name == wanted:
                return pool
        raise KeyError(wanted)

    def slurm_work_dir(self, pool: PoolConfig) -> Path:
        return pool.work_dir or self.state_dir / "slurm" / pool.name

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
    def datasets(self) -> Path:
        return self.dataset_root or self.state_dir / "datasets"


def parse_gpu_indices(text: str, source: str) -> list[int]:
    """``"0,1, 3"`` -> ``[0, 1, 3]``; a ValueError naming ``source`` for anything else."""
    parts = [p.strip() for p in text.split(",") if p.strip()]
    if not all(p.isascii() and p.isdigit() and int(p) < 1024 for p in parts) or len(set(map(int, parts))) != len(parts):
        raise ValueError(f"{source} ({text!r}) must be distinct GPU indices below 1024, e.g. 0,1,2,3")
    return [int(p) for p in parts]


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


def settings_env(settings: Settings) -> dict[str, str]:
    """The settings as TORCHYARD_* variables, for the processes a parent starts."""
    return {
        f"TORCHYARD_{name.upper()}": json.dumps(value) if isinstance(value, (list, dict)) else str(value)
        for name, value in settings.model_dump(mode="json").items()
        if value not in ("", None)
    }


def redact(url: str) -> str:
    """A URL fit for a log line: its password replaced."""
    scheme, sep, rest = url.partition("://")
    userinfo, at, host = rest.rpartition("@")
    if not sep or not at or ":" not in userinfo:
        return url
    return f"{scheme}://{userinfo.split(':', 1)[0]}:***@{host}"


def secure_state_dir(settings: Settings) -> None:
    """The state dir is the platform's alone (0700): secrets, the database, Redis' files, run
    records. Ranks reach their own run directory only through the bind mounts of
    ``workers/isolation.py``, never by walking in here."""
    settings.state_dir.mkdir(parents=True, exist_ok=True)
    settings.state_dir.chmod(0o700)
    url = settings.sqlalchemy_url
    if url.startswith("sqlite:///"):
        database = Path(url.removeprefix("sqlite:///"))
        for path in (database, database.with_name(database.name + "-wal"), database.with_name(database.name + "-shm")):
            if path.exists():
                path.chmod(0o600)


@lru_cache
def get_settings() -> Settings:
    return Settings()
