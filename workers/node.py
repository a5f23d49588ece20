"""The worker's node-level duties, in its main process: heartbeat its capacity to Redis, end
orphans at start, end running attempts at shutdown (so Ctrl-C leaves no rank behind)."""

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
from workers import launcher

log = logging.getLogger(__name__)
_stop = threading.Event()


def heartbeat_once(client: redis.Redis, settings: Settings) -> None:
    beat = {
        "host": settings.node_host,
        "slots": settings.node_slots,
        "devices": settings.devices,
        "ts": time.time(),
        "pid": os.getpid(),
    }
    ttl_ms = int(settings.node_timeout_s * 1000)
    pipe = client.pipeline(transaction=False)
    pipe.set(streams.node_key(settings.node_id), json.dumps(beat), px=ttl_ms)
    pipe.sadd(streams.NODES, settings.node_id)
    pipe.execute()


def _heartbeat_loop(settings: Settings) -> None:
    client = redis.Redis.from_url(settings.redis_url, socket_timeout=5)
    while not _stop.is_set():
        try:
            heartbeat_once(client, settings)
        except redis.RedisError as exc:
            log.warning("heartbeat failed: %s", exc)
        _stop.wait(settings.heartbeat_s)


@signals.worker_ready.connect
def _on_ready(**_: Any) -> None:
    settings = get_settings()
    launcher.stopping_marker(settings).unlink(missing_ok=True)
    client = redis.Redis.from_url(settings.redis_url, socket_timeout=10)
    ended = launcher.end_orphans(client, settings)
    if ended:
        log.warning("ended %d orphaned attempt(s) left by a previous worker", ended)
    threading.Thread(target=_heartbeat_loop, args=(settings,), name="heartbeat", daemon=True).start()


@signals.worker_shutting_down.connect
def _on_shutdown(**_: Any) -> None:
    # Warm shutdown would wait for training to finish (hours): end the runs' process groups now;
    # their tasks then report the exit and return.
    _stop.set()
    settings = get_settings()
    launcher.stopping_marker(settings).touch()
    launcher.end_recorded_attempts(settings)
