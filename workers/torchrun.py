"""A share as torchrun runs it: the ranks' whole environment (an allow-list and one credential),
the command line (standalone, or a c10d rendezvous on node rank 0 for a gang), and joining the gang."""

from __future__ import annotations

import json
import math
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import redis

from torchyard import datasets, hangdump, stores, streams
from torchyard.net import free_port
from torchyard.settings import Settings
from torchyard.spec import RunSpec
from workers import code, isolation
from workers.cancel import CANCEL_MARKER, attempt_ended, cancel_requested

PROJECT_ROOT = Path(__file__).resolve().parent.parent


# Variables a training process may inherit: an allow-list, so nothing of the worker's environment
# (its Redis URL, database URL, secret key, tokens: TORCHYARD_* or whatever else it holds) reaches a rank.
PASSED_ENV = (
    "PATH",
    "HOME",
    "LANG",
    "LC_ALL",
    "TMPDIR",
    "TZ",
    "CUDA_VISIBLE_DEVICES",
    "NCCL_DEBUG",
    "NCCL_SOCKET_IFNAME",
    "GLOO_SOCKET_IFNAME",
    "OPENBLAS_CORETYPE",
    "OPENBLAS_L2_SIZE",
)


def is_script(spec: dict) -> bool:
    return bool(spec.get("workload", {}).get("kind") == "script")


DATASET_VIEW = "dataset"  # in the run dir: the view of a dataset in an object store (``stores.S3Store.give``)


def dataset_access(settings: Settings, spec: dict, run_dir: Path) -> stores.Access | None:
    """How the ranks reach the dataset the run reads (None: it reads none), in the store the api
    wrote it to (a folder, bound read-only; or presigned URLs of an object store's, in a view in
    the run dir); a FileNotFoundError naming the node when it is not there."""
    name = (spec.get("data") or {}).get("dataset")
    if not name:
        return None
    store = stores.open_store(settings)
    try:
        return store.give(name, run_dir / DATASET_VIEW, settings.dataset_url_ttl_s)
    except FileNotFoundError:
        raise FileNotFoundError(
            f"dataset {name!r} is not at {store.where(name)} on node {settings.node_id}: {store.setting} must be "
            "where the api stores datasets (shared storage when workers run on other hosts)"
        ) from None


def training_env(
    settings: Settings,
    run_id: int,
    attempt: int,
    spec: dict,
    run_dir: Path,
    rank_redis_url: str,
    gpus: list[int] | None = None,
    dataset: Path | None = None,
) -> dict[str, str]:
    """The ranks' whole environment. Their only credential is ``rank_redis_url``: the attempt's own
    Redis user, which may XADD to the run's rank stream and nothing else (a dataset in an object
    store is reached through the presigned URLs in ``dataset``, the folder it is read in). A CUDA share sees only
    ``gpus``, the GPUs the scheduler gave it (LOCAL_RANK i runs on the i-th: ``cuda:i``); a CPU share
    sees none, so it cannot take a GPU from a CUDA run by mistake."""
    env = {k: os.environ[k] for k in PASSED_ENV if k in os.environ}
    if spec.get("resources", {}).get("device") != "cuda":
        env["CUDA_VISIBLE_DEVICES"] = ""
    elif gpus is not None:  # None: a task sent before GPUs were counted, which runs as it did then
        env["CUDA_VISIBLE_DEVICES"] = ",".join(map(str, gpus))
        env["CUDA_DEVICE_ORDER"] = "PCI_BUS_ID"  # the driver's indices, as the node's inventory counts them
    if isolation.isolating():
        env["HOME"] = str(run_dir)  # the run user's only writable place (caches of torch & co.)
        env["TMPDIR"] = "/tmp"  # the run's private tmpfs (isolation.py), not wherever the worker's TMPDIR points
    if is_script(spec):  # the instrumentation's sitecustomize first: unmodified scripts are measured too
        env.update(PYTHONPATH=os.pathsep.join((str(code.INJECT_DIR), str(PROJECT_ROOT))), TORCHYARD_INSTRUMENT="1")
    else:
        env.update(PYTHONPATH=str(PROJECT_ROOT))
    env.update(
        PYTHONUNBUFFERED="1",
        OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"),
        TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE="[torchyard-rank ${rank}]:",
        # With the agent's rendezvous store shared (torch's default), ranks restarted by
        # --max-restarts read their peers' addresses from the round before and fail to connect
        # (pytorch/pytorch#135712, seen here on Gloo): each round gets a store of its own.
        TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1",
        # Every rank keeps torch's Flight Recorder: a hang diagnosis compares its entries across ranks.
        **{hangdump.FR_BUFFER_ENV: str(settings.fr_buffer_entries)},
        TORCHYARD_RANK_REDIS_URL=rank_redis_url,
        TORCHYARD_RUN_ID=str(run_id),
        TORCHYARD_ATTEMPT=str(attempt),
        TORCHYARD_SPEC=json.dumps(spec),
        TORCHYARD_RUN_DIR=str(run_dir),
        TORCHYARD_CHECKPOINT_DIR=str(settings.checkpoints / str(run_id)),  # shared by the run's attempts
    )
    if dataset is not None:
        env[datasets.DATASET_DIR_ENV] = str(dataset)  # torchyard.data reads it there
    training = spec.get("training", {})
    if training.get("checkpoint_on_cancel") or training.get("cancel_grace_s") is not None:
        # torchrun SIGKILLs its ranks this long after passing our SIGTERM on (default 30 s): give them the run's
        # grace, less a second for torchrun to end them itself before we SIGKILL what remains
        env["TORCH_ELASTIC_SHUTDOWN_TIMEOUT"] = str(
            max(0, math.floor(RunSpec.model_validate(spec).training.cancel_grace(settings.cancel_grace_s)) - 1)
        )
        env["TORCHYARD_CANCEL_MARKER"] = str(run_dir / CANCEL_MARKER)  # present: a SIGTERM is a cancel
    return env


@dataclass(frozen=True)
class Gang:
    """This node's place in a multi-node attempt."""

    node_rank: int = 0
    nnodes: int = 1
    rdzv_endpoint: str = ""  # host:port of the c10d store on node rank 0
    local_addr: str = "127.0.0.1"  # this node's advertised address


RDZV_JOIN_TIMEOUT_S = 300
TORCHRUN_LOGS = "torchrun-logs"  # its --log-dir in the run dir: each rank's output and error file


def torchrun_command(spec: dict, run_dir: Path, run_id: int, attempt: int, gang: Gang) -> list[str]:
    res, training = spec["resources"], spec.get("training", {})
    if is_script(spec):  # as `torchrun ... train.py args` runs it, from the unpacked bundle (the cwd)
        target = [str(run_dir / "code" / spec["workload"]["entry"]), *spec["workload"].get("args", [])]
    else:
        target = ["-m", "workers.runtime.train"]
    if gang.nnodes == 1:
        rendezvous = ["--standalone", "--nnodes", "1"]
    else:  # node rank 0 hosts the store on its own address; the others join it
        rendezvous = [
            "--nnodes",
            str(gang.nnodes),
            "--rdzv-backend",
            "c10d",
            "--rdzv-endpoint",
            gang.rdzv_endpoint,
            "--rdzv-id",
            f"run-{run_id}-attempt-{attempt}",
            "--rdzv-conf",
            f"is_host={str(gang.node_rank == 0).lower()},join_timeout={RDZV_JOIN_TIMEOUT_S}",
            "--local-addr",
            gang.local_addr,
        ]
    return [
        sys.executable, "-m", "torch.distributed.run", *rendezvous,
        "--nproc-per-node", str(res["procs_per_node"]),
        "--max-restarts", str(training.get("max_restarts", 0)),
        "--tee", "3", "--log-dir", str(run_dir / TORCHRUN_LOGS),
        *target,
    ]  # fmt: skip


def join_gang(
    client: redis.Redis,
    settings: Settings,
    run_id: int,
    attempt: int,
    node_rank: int,
    nnodes: int,
    rdzv_host: str,
    cancel_token: str | None = None,
) -> Gang | None:
    """Node rank 0 picks a free port on its own address and publishes the endpoint; the others
    wait for it. None: the run was cancelled or the attempt ended while waiting."""
    if nnodes == 1:
        return Gang(local_addr=settings.node_host)
    key = streams.rendezvous_key(run_id, attempt)
    if node_rank == 0:
        endpoint = f"{settings.node_host}:{free_port(settings.node_host)}"
        client.set(key, endpoint, ex=7 * 86400)
        return Gang(0, nnodes, endpoint, settings.node_host)
    deadline = time.monotonic() + RDZV_JOIN_TIMEOUT_S
    while time.monotonic() < deadline:
        if cancel_requested(client, run_id, cancel_token) or attempt_ended(client, run_id, attempt):
            return None
        published: Any = client.get(key)
        if published:
            return Gang(node_rank, nnodes, published.decode(), settings.node_host)
        time.sleep(0.2)
    raise TimeoutError(f"node rank 0 ({rdzv_host}) did not open the rendezvous within {RDZV_JOIN_TIMEOUT_S}s")
