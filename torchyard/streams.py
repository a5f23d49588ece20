"""Redis key names and the shape of stream entries: the contract between ranks, workers,
ingest and the api. One home for every key, so no two processes spell one differently.

Every run has one stream, ``ty:run:<id>``. Each entry has two fields: ``type`` and ``data``
(JSON). Types:

- ``metrics``: ``{"attempt": a, "rank": r, "points": [[step, ts, {key: value}], ...], "dropped": n}``
  written by the SDK inside each rank;
- ``logs``: ``{"attempt": a, "lines": [[rank, ts, text], ...]}`` written by the worker from the
  ranks' output (rank -1: the elastic agent / launcher itself);
- ``report``: ``{"attempt": a, "node": id, "event": "started"|"exited", "status": ..., "reason": ...,
  "returncode": n}`` written by the worker; ingest applies it to the run's state;
- ``profile``: ``{"attempt": a, "rank": r, "step": s, "timeline": {...}}`` one sampled step's
  torch.profiler timeline (``workers/runtime/profiling.py``), written by the SDK inside each rank;
- ``state``: ``{"status": s, "reason": r, "at": iso}`` written after a state change commits, for
  live readers only (the database already holds it; ingest skips it).
"""

from __future__ import annotations

import json
from typing import Any

ACTIVE_STREAMS = "ty:streams:active"  # set of run streams ingest must read
INGEST_GROUP = "ingest"
INGEST_CONSUMER_ALIVE = "ty:ingest:alive:"  # + consumer name: expires unless the consumer keeps polling
NODES = "ty:nodes"  # set of node ids that ever heartbeated
SCHEDULER_LOCK = "ty:scheduler:leader"
SCHEDULER_WAKE = "ty:scheduler:wake"  # list; a push wakes the scheduler early
INGESTED_POINTS = "ty:stats:ingested_points"  # counter: metric points ingest has written

METRICS, LOGS, REPORT, STATE, PROFILE = "metrics", "logs", "report", "state", "profile"


def run_stream(run_id: int) -> str:
    return f"ty:run:{run_id}"


def run_id_of(stream: str) -> int:
    return int(stream.rsplit(":", 1)[1])


def node_key(node_id: str) -> str:
    """Holds the node's last heartbeat (JSON); expires when the node stops heartbeating."""
    return f"ty:node:{node_id}"


def cancel_key(run_id: int) -> str:
    """Set by the api when a run is cancelled; the worker running it polls it."""
    return f"ty:cancel:{run_id}"


def attempt_claim_key(run_id: int, attempt: int, node_rank: int = 0) -> str:
    """SET NX by the worker that launches one node's share of an attempt: a redelivered task
    finds it and stops."""
    return f"ty:claim:{run_id}:{attempt}:{node_rank}"


def attempt_end_key(run_id: int, attempt: int) -> str:
    """Set once the server has ended an attempt (a node of its gang failed or was lost, it
    stalled): every node still running a share of it stops. Polled by the launchers."""
    return f"ty:attempt-ended:{run_id}:{attempt}"


def rendezvous_key(run_id: int, attempt: int) -> str:
    """``host:port`` of the c10d rendezvous store that node rank 0 of a gang opened."""
    return f"ty:rdzv:{run_id}:{attempt}"


def encode(entry_type: str, data: dict[str, Any]) -> dict[Any, Any]:
    return {"type": entry_type, "data": json.dumps(data, separators=(",", ":"))}


def decode(fields: dict[Any, Any]) -> tuple[str, dict[str, Any]]:
    def text(value: Any) -> str:
        return value.decode() if isinstance(value, bytes) else str(value)

    by_name = {text(k): v for k, v in fields.items()}
    return text(by_name["type"]), json.loads(text(by_name["data"]))
