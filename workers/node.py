"""The worker's node-level duties, in its main process: heartbeat its capacity (CPU slots, devices,
GPUs) to Redis, end orphans at start, end running attempts at shutdown (so Ctrl-C leaves no rank
behind)."""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from typing import Any

import redis
from celery import signals

from torchyard import streams
from torchyard.settings import Settings, get_settings
from workers import caps, gpus, isolation, launcher, rundirs

log = logging.getLogger(__name__)
_stop = threading.Event()


def heartbeat_once(client: redis.Redis, settings: Settings, inventory: list[gpus.Gpu], capped: str = "") -> None:
    beat = {
        "host": settings.node_host,
        "slots": settings.node_slots,
        "devices": gpus.devices(settings, inventory),
        "gpus": [g.as_dict() for g in inventory],
        "ts": time.time(),
        "pid": os.getpid(),
        "caps": capped,
    }
    ttl_ms = int(settings.node_timeout_s * 1000)
    pipe = client.pipeline(transaction=False)
    pipe.set(streams.node_key(settings.node_id), json.dumps(beat), px=ttl_ms)
    pipe.sadd(streams.NODES, settings.node_id)
    pipe.execute()


def _heartbeat_loop(settings: Settings) -> None:
    inventory = gpus.inventory(settings)  # once: a GPU does not come and go while the worker runs
    listed = ", ".join(f"{g.index} {g.name}".strip() for g in inventory) or "none"
    log.info("GPUs: %s%s", listed, " (TORCHYARD_NODE_GPUS: trusted, not checked)" if settings.node_gpus.strip() else "")
    client = redis.Redis.from_url(settings.redis_url, socket_timeout=5)
    capped = caps.support()  # once too: the worker's control groups do not change under it
    while not _stop.is_set():
        try:
            heartbeat_once(client, settings, inventory, capped)
        except redis.RedisError as exc:
            log.warning("heartbeat failed: %s", exc)
        _stop.wait(settings.heartbeat_s)


@signals.worker_ready.connect
def _on_ready(**_: Any) -> None:
    settings = get_settings()
    rundirs.stopping_marker(settings).unlink(missing_ok=True)
    settings.state_dir.mkdir(parents=True, exist_ok=True)
    settings.state_dir.chmod(0o700)  # the platform's alone: ranks see only their own run dir (workers/isolation.py)
    if isolation.isolating():
        user = isolation.ensure_run_user(settings.run_user)
        log.info("runs are isolated: ranks run as %s (uid %s) in a PID namespace of their own", user.name, user.uid)
    else:
        log.warning("runs are not isolated (worker is not root): ranks run as this worker's user")
    capped = caps.support()
    (log.info if capped.startswith("processes and memory capped") else log.warning)("%s", capped)
    client = redis.Redis.from_url(settings.redis_url, socket_timeout=10)
    ended = launcher.end_orphans(client, settings)
    if ended:
        log.warning("ended %d orphaned attempt(s) left by a previous worker", ended)
    # Before any task runs (the consumer takes none until this returns), as end_orphans.
    rundirs.remove_stale_run_dirs(settings)
    threading.Thread(target=_heartbeat_loop, args=(settings,), name="heartbeat", daemon=True).start()


@signals.worker_shutting_down.connect
def _on_shutdown(**_: Any) -> None:
    # Warm shutdown would wait for training to finish (hours): end the runs' process groups now;
    # their tasks then report the exit and return.
    _stop.set()
    settings = get_settings()
    rundirs.stopping_marker(settings).touch()
    launcher.end_recorded_attempts(settings)
