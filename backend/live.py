"""The live stream of a run (Server-Sent Events): its platform and rank streams merged in id order,
each event's id a cursor over both (``torchyard.streams``), what ingest trimmed from them read back
from the database (``backend/replay.py``) so a resume from any id has no gap and no repeat, a quota
of open streams per token given back however a stream ends, and the caller's credential re-checked
while it stays open."""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from collections.abc import AsyncGenerator, Callable
from typing import Any

import anyio
from fastapi import HTTPException, Request, status
from fastapi.responses import StreamingResponse
from starlette.concurrency import run_in_threadpool
from starlette.types import Receive, Scope, Send

from backend import livefeed
from backend.db import get_sessionmaker
from backend.deps import Caller, get_async_redis
from backend.models import Token
from backend.security import live_session
from torchyard import streams
from torchyard.settings import get_settings


def open_stream(request: Request, run_id: int, start: str, finished: bool, caller: Caller) -> StreamingResponse:
    """The response that relays the run's events from ``start`` (a checked cursor, or "$"); a 429
    when the caller's token already holds its quota of live streams in this process."""
    token_id = caller.token.id
    limit = get_settings().max_streams_per_token
    if _open_streams[token_id] >= limit:
        raise HTTPException(
            status.HTTP_429_TOO_MANY_REQUESTS,
            f"token {caller.token.name!r} already has {limit} live streams open here "
            "(TORCHYARD_MAX_STREAMS_PER_TOKEN): close one first",
        )
    _open_streams[token_id] += 1
    return _LiveStream(
        _sse(request, run_id, start, finished, token_id, caller.session_hash),
        release=lambda: _open_streams.subtract([token_id]),
        media_type="text/event-stream",
        headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
    )


# Live streams each token holds open in this api process (each holds a Redis connection).
_open_streams: Counter[int] = Counter()


class _LiveStream(StreamingResponse):
    """Gives the stream's quota back however the response ends: the run ended, the client went
    away (Starlette then cancels the send loop, and a cancelled generator's own ``finally`` may
    never get past its first ``await``), an error, or a generator that never started. Closing
    the generator here runs its ``finally`` (the Redis connection) at once instead of at
    garbage collection."""

    def __init__(self, content: AsyncGenerator[bytes], release: Callable[[], None], **kwargs: Any) -> None:
        super().__init__(content, **kwargs)
        self._generator, self._release = content, release

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._release()
            with anyio.CancelScope(shield=True):
                await self._generator.aclose()


def figures() -> dict[str, int]:
    """This api process's live streams, shared feeds, viewers on them, and viewers that ever joined a
    feed or were left behind by one."""
    return {
        "streams": sum(_open_streams.values()),
        "feeds": len(livefeed.feeds),
        "feed_viewers": sum(len(feed.viewers) for feed in list(livefeed.feeds.values())),
        "joined": livefeed.feed_figures["joined"],
        "left_behind": livefeed.feed_figures["left_behind"],
    }


async def _sse(
    request: Request, run_id: int, start: str, finished: bool, token_id: int, session_hash: str | None
) -> AsyncGenerator[bytes]:
    client = get_async_redis()
    feed: livefeed.Feed | None = None
    queue: asyncio.Queue[livefeed.Batch | None] | None = None
    try:
        # What has been sent (``livefeed.Sent``); how far it has been read (``reader.read``) may be
        # further: past entries never sent (a rank's entry of a type ranks may not write) and past
        # a trimmed stretch the database had nothing of.
        cursor = await livefeed.start_cursor(client, (streams.run_stream(run_id), streams.rank_stream(run_id)), start)
        shared = get_settings().live_shared_feed
        if start == "$" and shared and not finished:
            # "From now" is at the head: join the run's shared reader at once, with no read of our
            # own (100 viewers arriving together each read on their own until at the head, 100
            # times the reading), from where it is (within a read of now), or start it here.
            if (running := livefeed.feeds.get(run_id)) is not None:
                cursor = (running.reader.read[0], running.reader.read[1])
            feed, queue = livefeed.Feed.join(run_id, list(cursor))
        sent = livefeed.Sent(*cursor, told=None)
        reader = livefeed.Reader(client, run_id, list(cursor), finished)
        yield b"retry: 1000\n\n"
        next_check = time.monotonic() + livefeed.RECHECK_S
        joining = False  # joined a shared reader, still reading on our own until at the head again
        while not reader.done and not await request.is_disconnected():
            if time.monotonic() >= next_check:
                next_check = time.monotonic() + livefeed.RECHECK_S
                if not await _allowed(token_id, session_hash):
                    return  # token revoked or session ended: the browser's reconnect gets its 401
            out: list[bytes] = []
            if queue is None or joining:
                events, at_head, idle = await reader.next()
                if queue is None and at_head and shared and not reader.finished:
                    # Joined, it reads on its own once more (and on, until at the head again): the
                    # shared reader may have sent entries after our read before we joined, and
                    # this read's clock is later than the one it read them under, so they are in
                    # it. Then its events past ours (``reader.fresh``) follow on in the one order.
                    feed, queue = livefeed.Feed.join(run_id, reader.read)
                    joining = True
                elif joining and at_head:
                    joining = False
                body, sent = livefeed.render(events, sent)
                out.append(body)
            else:
                batches: list[livefeed.Batch | None] = []
                try:
                    batches.append(await asyncio.wait_for(queue.get(), livefeed.RECHECK_S))
                    idle = False
                except TimeoutError:
                    idle = True
                # A viewer behind takes every batch waiting for it at once, to send them in one write:
                # at 100 viewers of a busy run, a write per batch per viewer was the api's bound.
                while not (batches and batches[-1] is livefeed.FEED_END) and not queue.empty():
                    batches.append(queue.get_nowait())
                for batch in batches:
                    if batch is None:
                        continue
                    if (reader.read[0], reader.read[1]) == batch.before:  # the usual case: bytes made once
                        body, sent = batch.render(sent)
                        reader.read[:] = batch.after
                        reader.finished = reader.finished or any(event.ends for event in batch.events)
                    else:  # just joined: the events past what our own reads got
                        events = [event for event in batch.events if reader.fresh(event)]
                        for event in events:
                            reader.apply(event)
                        body, sent = livefeed.render(events, sent)
                    out.append(body)
                if batches and batches[-1] is livefeed.FEED_END:
                    assert feed is not None
                    feed.leave(queue)
                    feed = queue = None  # read on our own from where we are, once these are sent
            if idle and not reader.finished:
                out.insert(0, b": keep-alive\n\n")
            if data := b"".join(out):
                yield data
    finally:
        if feed is not None and queue is not None:
            feed.leave(queue)
        with anyio.CancelScope(shield=True):  # a cancelled task's await would raise again at once
            await client.aclose()


# Each credential's last check, shared by its streams in this process: 100 viewers of one token
# each asked the database every RECHECK_S, all in the same instant (they opened together), and the
# burst held every stream's events back ~200 ms.
_checks: dict[tuple[int, str | None], tuple[float, asyncio.Future[bool]]] = {}


async def _allowed(token_id: int, session_hash: str | None) -> bool:
    """:func:`_still_allowed`, asked at most once per half ``RECHECK_S`` per credential: a revoked
    token or ended session still ends its streams within 1.5 ``RECHECK_S``."""
    now = time.monotonic()
    key = (token_id, session_hash)
    if (check := _checks.get(key)) is None or check[0] <= now:
        for stale in [k for k, (expires, _) in _checks.items() if expires <= now]:
            del _checks[stale]  # only live credentials' checks are kept
        check = _checks[key] = (
            now + livefeed.RECHECK_S / 2,
            asyncio.ensure_future(run_in_threadpool(_still_allowed, token_id, session_hash)),
        )
    return await asyncio.shield(check[1])


def _still_allowed(token_id: int, session_hash: str | None) -> bool:
    """Whether a live stream's caller may still read: its browser session is live, or (a bearer
    header) its token is not revoked."""
    with get_sessionmaker()() as session:
        if session_hash is not None:
            return live_session(session, session_hash) is not None
        token = session.get(Token, token_id)
        return token is not None and token.revoked_at is None
