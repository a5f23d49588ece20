"""Reading a run's live streams for its viewers: a reader of its platform and rank streams (and of
the database behind their trimmed part) from a cursor, in the one order every reader sends them in,
each entry encoded once as a Server-Sent Event; and the shared feed, one reader for every viewer of
a run in this api process that has caught up with its streams. ``backend/live.py`` serves them."""

from __future__ import annotations

import asyncio
import json
import logging
import math
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import anyio
import orjson
import redis
from starlette.concurrency import run_in_threadpool

from backend import replay, runs
from backend.db import get_sessionmaker
from backend.deps import get_async_redis
from torchyard import streams
from torchyard.settings import get_settings
from torchyard.states import TERMINAL

logger = logging.getLogger(__name__)
RECHECK_S = 2.0  # how often a live stream re-reads its run's state and its caller's credential
SSE_BATCH = 500
# A shared feed reads at most once a tick, the tick as long as its viewers are many (up to
# MAX_TICK_S): each read wakes every viewer, and 100 viewers woken for each of a busy run's ~500
# reads a second took the api's whole core, fell behind and were left to read on their own.
VIEWER_WAKEUPS_PER_S = 10000
MAX_TICK_S = 0.025
Entry = tuple[str, str | None, dict[str, Any]]  # (id, type, data); type None: read past, never sent


@dataclass(frozen=True)
class Event:
    """One event of a run's live stream, encoded once for every viewer. ``index``: the stream an
    entry came from (0 platform, 1 rank), None for an event without an id (``ingested``, ``gap``);
    ``body`` None: an entry read past and never sent."""

    index: int | None
    entry_id: str
    body: bytes | None
    ends: bool = False  # a terminal state change


class Read(NamedTuple):
    events: list[Event]
    at_head: bool  # this read got all there was: a viewer here can take a shared feed's events instead
    idle: bool  # a blocking read that got nothing for RECHECK_S


class Reader:
    """Reads a run's two streams (and the database behind their trimmed part) from a cursor, in the
    one order every reader sends them in (``_in_order``). ``read``: per stream, how far it has read."""

    def __init__(self, client: Any, run_id: int, read: list[str], finished: bool) -> None:
        self.client, self.run_id, self.read, self.finished = client, run_id, read, finished
        self.keys = (streams.run_stream(run_id), streams.rank_stream(run_id))  # index 0: platform, 1: rank
        self.quick = True  # do not block: the first read, and after a page from the database
        self.gap_checked = False
        self.done = False  # finished, and everything the streams (and the database) hold has been read
        self.told: bytes | None = None  # ingest's last word on the run, as last sent

    async def next(self) -> Read:
        """The next events, applied to ``read``."""
        block = None if self.finished or self.quick else int(RECHECK_S * 1000)
        # The clock before the read: an entry of an earlier millisecond is in this read or in none
        # (read after it, an entry added between the read and the clock could have such a
        # millisecond and be missing here while the other stream's later entries were sent).
        now = await self.client.time()
        got, ends, replayed, told = await _read(self.client, self.run_id, self.keys, self.read, block)
        events: list[Event] = []
        if told and told != self.told and not self.finished:
            self.told = told
            # ingest's word on the run (streams.ingested_key): an event without an id, so the
            # client's Last-Event-ID stays that of the last stream entry it was sent
            events.append(Event(None, "", f"event: {streams.INGESTED}\ndata: {_text(told)}\n\n".encode()))
        if replayed and not self.gap_checked:
            self.gap_checked = True
            if skipped := await run_in_threadpool(_unplaced, self.run_id):
                gap = json.dumps({"skipped": skipped, "reason": UNPLACED})
                events.append(Event(None, "", f"event: gap\ndata: {gap}\n\n".encode()))
        self.quick = replayed
        if not any(got):
            if self.finished:
                self.done = True
            elif block is not None:  # the database is the truth: a state change whose publish was lost still ends us
                self.finished = await run_in_threadpool(_is_terminal, self.run_id)
            return Read(events, at_head=not replayed, idle=block is not None)
        ready = _in_order(got, ends, now)
        if not ready:  # only entries of the current millisecond: wait for it to pass
            await asyncio.sleep(0.002)
        for index, entry_id, entry_type, data in ready:
            ends_run = entry_type == streams.STATE and data.get("status") in TERMINAL
            body = None if entry_type is None else f"event: {entry_type}\ndata: {_browser_json(data)}\n\n".encode()
            events.append(Event(index, entry_id, body, ends_run))
            self.apply(events[-1])
        return Read(events, at_head=not replayed and ends == [None, None], idle=False)

    def fresh(self, event: Event) -> bool:
        """Whether ``event`` is past what this reader has read (an id-less event always is)."""
        return event.index is None or streams.parse_id(event.entry_id) > streams.parse_id(self.read[event.index])

    def apply(self, event: Event) -> None:
        if event.index is not None:
            self.read[event.index] = event.entry_id
        self.finished = self.finished or event.ends


class Sent(NamedTuple):
    """What a viewer has sent: per stream, the last entry (what event ids carry: a resume starts
    there), and ingest's last word on the run."""

    platform: str
    rank: str
    told: bytes | None


@dataclass
class Batch:
    """One read of a shared feed, as every viewer gets it: its events, where the feed's read was
    before and after them, and their Server-Sent Event bytes for each viewer state that asked
    (``rendered``): the viewers of a run are nearly always in one state, so the bytes are made
    once, however many send them (per viewer, that work was the api's bound at 100 viewers)."""

    events: list[Event]
    before: tuple[str, str]
    after: tuple[str, str]
    rendered: dict[Sent, tuple[bytes, Sent]] = field(default_factory=dict)

    def render(self, sent: Sent) -> tuple[bytes, Sent]:
        """The events' bytes for a viewer in state ``sent`` that has read exactly up to ``before``."""
        if (hit := self.rendered.get(sent)) is None:
            hit = self.rendered[sent] = render(self.events, sent)
        return hit


def render(events: list[Event], sent: Sent) -> tuple[bytes, Sent]:
    """The events as Server-Sent Events for a viewer in state ``sent``, and its state after them."""
    ids, told = [sent.platform, sent.rank], sent.told
    out: list[bytes] = []
    for event in events:
        if event.body is None:
            continue
        if event.index is None:
            if event.body != told:  # the same word of ingest, from a viewer's own read and then the feed's
                out.append(event.body)
            told = event.body
            continue
        ids[event.index] = event.entry_id
        out.append(b"id: " + streams.format_cursor(*ids).encode() + b"\n" + event.body)
    return b"".join(out), Sent(ids[0], ids[1], told)


FEED_END = None  # put on a viewer's queue when the feed stops or leaves it behind: it reads on its own again


class Feed:
    """One reader of a run's streams for every viewer of the run in this api process that has caught
    up with them: each entry is read from Redis, decoded and encoded once, however many watch (a
    reader per viewer re-did that work per viewer: 100 viewers of a 10,000 points/s run got 4
    points/s each). A viewer joins at the streams' head and leaves (reads on its own from its own
    cursor) when the feed ends or when it falls ``live_feed_backlog`` batches behind."""

    def __init__(self, run_id: int, read: list[str]) -> None:
        self.run_id = run_id
        self.reader = Reader(get_async_redis(), run_id, list(read), finished=False)
        self.viewers: set[asyncio.Queue[Batch | None]] = set()
        self.backlog = get_settings().live_feed_backlog
        self.task = asyncio.create_task(self._run())

    @classmethod
    def join(cls, run_id: int, read: list[str]) -> tuple[Feed, asyncio.Queue[Batch | None]]:
        feed = feeds.get(run_id)
        if feed is None:
            feed = feeds[run_id] = cls(run_id, read)
        queue: asyncio.Queue[Batch | None] = asyncio.Queue()
        feed.viewers.add(queue)
        feed_figures["joined"] += 1
        return feed, queue

    def leave(self, queue: asyncio.Queue[Batch | None]) -> None:
        self.viewers.discard(queue)

    async def _run(self) -> None:
        try:
            clock = asyncio.get_running_loop().time
            while self.viewers and not self.reader.done:
                started = clock()
                before = (self.reader.read[0], self.reader.read[1])
                events = (await self.reader.next()).events
                if not events:
                    continue
                batch = Batch(events, before, (self.reader.read[0], self.reader.read[1]))
                for queue in list(self.viewers):
                    if queue.qsize() >= self.backlog:
                        self.viewers.discard(queue)
                        feed_figures["left_behind"] += 1
                        queue.put_nowait(FEED_END)
                    else:
                        queue.put_nowait(batch)
                tick = min(MAX_TICK_S, len(self.viewers) / VIEWER_WAKEUPS_PER_S)
                await asyncio.sleep(started + tick - clock())
        except Exception:
            logger.exception("run %s: the shared live feed stopped (its viewers read on their own)", self.run_id)
        finally:
            if feeds.get(self.run_id) is self:  # no await before: no viewer joins a feed that has ended
                del feeds[self.run_id]
            for queue in self.viewers:
                queue.put_nowait(FEED_END)
            with anyio.CancelScope(shield=True):
                await self.reader.client.aclose()


feeds: dict[int, Feed] = {}  # run id → its shared feed in this api process
# viewers that joined a feed ("joined") and that a feed left behind, since this process started
feed_figures: Counter[str] = Counter()


UNPLACED = "stored before rows kept their stream positions: read them from the run's metrics and logs"


async def _read(
    client: Any, run_id: int, keys: tuple[str, str], read: list[str], block: int | None
) -> tuple[list[list[Entry]], list[str | None], bool, bytes | None]:
    """Each stream's entries after ``read``, in id order, and the id from which this read has not
    got them (None: it got all there were); and whether any came from the database. Below a
    stream's trim mark (``torchyard.streams``) the stream may have lost entries: that part comes
    from the database (``backend/replay.py``). The mark is read after the XREAD, so it covers every
    trim the XREAD could have missed (ingest raises it before it trims)."""
    pipe = client.pipeline(transaction=False)
    pipe.xread(dict(zip(keys, read, strict=True)), count=SSE_BATCH, block=block)
    pipe.hmget(streams.trim_key(run_id), list(keys))
    pipe.get(streams.ingested_key(run_id))
    batch, marks, told = await pipe.execute()
    got: list[list[Entry]] = [[], []]
    ends: list[str | None] = [None, None]
    for stream, items in batch or []:
        index = keys.index(_text(stream))
        got[index] = [(_text(raw_id), *decode_entry(fields, index == 1)) for raw_id, fields in items]
        if len(items) >= SSE_BATCH:  # it stopped there: the stream may hold more
            ends[index] = streams.id_after(got[index][-1][0])
    replayed = False
    for index, raw_mark in enumerate(marks):
        mark = _text(raw_mark) if raw_mark else "0-0"
        if mark == "0-0" or streams.parse_id(read[index]) >= streams.parse_id(streams.id_before(mark)):
            continue  # nothing after `read` was trimmed
        page = await run_in_threadpool(_replay, run_id, index == 1, read[index], mark)
        replayed = True
        if page.below != mark:  # a page of a long stretch: the rest next time
            got[index], ends[index] = list[Entry](page.entries), page.below
            continue
        # The database had everything below the mark; the XREAD has what is not trimmed. The marker
        # entry lets the read go past the stretch even where the database had nothing of it.
        tail = [e for e in got[index] if streams.parse_id(e[0]) >= streams.parse_id(mark)]
        got[index] = [*page.entries, (streams.id_before(mark), None, {}), *tail]
        if ends[index] is not None and not tail:
            ends[index] = mark  # the XREAD stopped below the mark: the stream from the mark is unread
    return got, ends, replayed, told


def decode_entry(fields: Any, from_ranks: bool) -> tuple[str | None, dict[str, Any]]:
    """An entry's type and data; type None for one not to send: malformed, or a type ranks may
    not write (a rank's "state" must not end its viewers' streams)."""
    try:
        entry_type, data = streams.decode(fields)
    except (ValueError, TypeError, KeyError, UnicodeDecodeError):
        return None, {}
    if not isinstance(data, dict) or (from_ranks and entry_type not in streams.RANK_TYPES):
        return None, {}
    if entry_type == streams.FACTS:  # kept on the attempt (GET /runs/{id}), not a live event: no replay needs it
        return None, {}
    if entry_type == streams.DIAGNOSIS:  # viewers hear that a node answered; the dumps are read from /diagnosis
        data = {key: data.get(key) for key in ("attempt", "node", "request")}
    return entry_type, data


async def start_cursor(client: Any, keys: tuple[str, str], start: str) -> tuple[str, str]:
    if start != "$":
        parsed = streams.parse_cursor(start)
        assert parsed is not None  # checked before the response started
        return parsed
    newest = []
    for key in keys:  # the last id each stream was given, whether or not ingest has trimmed it since
        try:
            info: Any = await client.xinfo_stream(key)
        except redis.ResponseError:  # no such stream (yet)
            newest.append("0-0")
        else:
            newest.append(_text(info["last-generated-id"]))
    return newest[0], newest[1]


def _in_order(
    got: list[list[Entry]], ends: list[str | None], now: tuple[int, int]
) -> list[tuple[int, str, str | None, dict[str, Any]]]:
    """The entries of one read of both streams that can be sent now, in the one order every reader
    sends them in (by id, then platform before rank), so a live reader, a resumed one and a replay
    all see the same sequence. Held back for the next read: entries of the millisecond ``now`` (the
    clock read before the read) or later (an entry of the other stream may still get such a
    millisecond, and be missing from this read)
    and entries past where either stream's read stopped (``ends``: it may hold earlier ones still)."""
    bound = (int(now[0]) * 1000 + int(now[1]) // 1000, 0)
    for end in ends:
        if end is not None:
            bound = min(bound, streams.parse_id(end))
    entries = sorted(  # stable: a marker (``_read``) stays after a sent entry of its id
        (
            (streams.parse_id(entry_id), index, entry_id, entry_type, data)
            for index, items in enumerate(got)
            for entry_id, entry_type, data in items
        ),
        key=lambda entry: entry[:2],
    )
    return [(index, entry_id, entry_type, data) for key, index, entry_id, entry_type, data in entries if key < bound]


def _replay(run_id: int, from_ranks: bool, after: str, below: str) -> replay.Page:
    with get_sessionmaker()() as session:
        return replay.read(session, run_id, from_ranks, after, below)


def _unplaced(run_id: int) -> list[str]:
    with get_sessionmaker()() as session:
        return replay.unplaced(session, run_id)


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _browser_json(data: Any) -> str:
    """JSON a browser can parse: NaN and infinities (a diverged loss) become null. orjson writes
    them so, in a fifth of json's time (once per entry, but at 10,000 points/s)."""
    try:
        return orjson.dumps(data).decode()
    except TypeError:  # an integer past 64 bits (json reads any), or a non-string key
        pass

    def clean(value: Any) -> Any:
        if isinstance(value, float):
            return value if math.isfinite(value) else None
        if isinstance(value, dict):
            return {k: clean(v) for k, v in value.items()}
        if isinstance(value, list):
            return [clean(v) for v in value]
        return value

    return json.dumps(clean(data))


def _is_terminal(run_id: int) -> bool:
    with get_sessionmaker()() as session:
        return runs.get_run(session, run_id).status in TERMINAL
