"""What the platform hears from a share: its ranks' output as log batches on the run's platform
stream (with the first rank traceback kept for the failure reason), and its reports."""

from __future__ import annotations

import logging
import queue
import re
import threading
import time
from collections import deque
from collections.abc import Iterator
from typing import IO

import redis

from torchyard import streams

log = logging.getLogger(__name__)


# Torch elastic's tail threads write each rank's output with this prefix, a line at a time; a rank's
# partial line (its block-buffered stdout flushed mid-line) goes out without its newline, so the next
# prefixed write (often the same rank's stderr: its traceback) lands on the same line. Every prefix,
# wherever it sits, starts a line of its own.
RANK_PREFIX = re.compile(r"\[torchyard-rank (\d+)\]:")


LOG_FLUSH_S = 0.25


TAIL_LINES = 60
AGENT_TAIL_LINES = 400  # torchrun's own last words: its failure report lists every failed rank


PREFIX_ROOM = 64  # bytes read past a line's limit for the rank prefix torch elastic puts before it
SKIP_CHUNK = 1 << 16  # what is read at a time of a line's part past its limit (then dropped)


class LogPump:
    """Reads the launcher's combined output and XADDs it in batches, one entry per ~250 ms (and no
    line waits longer than that). A line
    is read no further than ``line_limit`` bytes: the rest of it is read in chunks and dropped, so a
    rank that prints 100 MB without a newline costs the worker no more memory than a short line,
    and what the live stream relays is already cut (``streams.cut_line``)."""

    def __init__(self, client: redis.Redis, run_id: int, attempt: int, pipe: IO[bytes], line_limit: int) -> None:
        self.client, self.stream, self.attempt, self.pipe = client, streams.run_stream(run_id), attempt, pipe
        self.line_limit = line_limit
        self.tail: deque[str] = deque(maxlen=TAIL_LINES)
        self.agent_tail: deque[str] = deque(maxlen=AGENT_TAIL_LINES)  # rank -1: torchrun and the launcher
        self.rank_traceback: list[str] = []  # the first traceback a rank printed: the root cause
        self._traceback_rank: int | None = None
        self.thread = threading.Thread(target=self._pump, name=f"logs-{run_id}", daemon=True)
        self.thread.start()

    def _read(self, lines: queue.SimpleQueue[tuple[bytes, int] | None]) -> None:
        for line in self._lines():
            lines.put(line)
        lines.put(None)

    def _pump(self) -> None:
        # Lines are read apart, so a batch goes out on time even when the output then falls quiet
        # (else the last lines before a pause waited for the next line: a quiet run's logs sat unsent).
        lines: queue.SimpleQueue[tuple[bytes, int] | None] = queue.SimpleQueue()
        threading.Thread(target=self._read, args=(lines,), name=f"{self.thread.name}-read", daemon=True).start()
        batch: list[list[object]] = []
        cut = 0
        last_flush = time.monotonic()
        while True:
            try:
                got = lines.get(timeout=LOG_FLUSH_S)
            except queue.Empty:
                got = (b"", -1)  # nothing new: what waits goes out below
            if got is None:
                break
            head, unread = got
            if unread >= 0:
                for line, was_cut in self._lines_of(head, unread):
                    batch.append(line)
                    cut += was_cut
            if batch and (time.monotonic() - last_flush >= LOG_FLUSH_S or len(batch) >= 500):
                self._send(batch, cut)
                batch, cut, last_flush = [], 0, time.monotonic()
        self._send(batch, cut)

    def _lines_of(self, head: bytes, unread: int) -> Iterator[tuple[list[object], bool]]:
        """The log lines in what was read as one: (rank or -1 for the launcher's own, text), split
        at every rank prefix; the bytes left unread belong to the last."""
        pieces = RANK_PREFIX.split(head.decode(errors="replace"))  # [before, rank, text, rank, text, ...]
        parts = [(-1, pieces[0])] if pieces[0] or len(pieces) == 1 else []
        parts += [(int(rank), text) for rank, text in zip(pieces[1::2], pieces[2::2], strict=True)]
        for i, (rank, whole) in enumerate(parts):
            text, was_cut = streams.cut_line(whole, self.line_limit, unread if i == len(parts) - 1 else 0)
            self.tail.append(text)
            if rank < 0:
                self.agent_tail.append(text)
            self._note_traceback(rank, text)
            yield [rank, time.time(), text], was_cut

    def _lines(self) -> Iterator[tuple[bytes, int]]:
        """Each line of the output without its newline: its first bytes (up to the limit and a rank
        prefix) and how many bytes after those were skipped unread."""
        while head := self.pipe.readline(self.line_limit + PREFIX_ROOM):
            if head.endswith(b"\n"):
                yield head[:-1], 0
                continue
            unread = 0
            while chunk := self.pipe.readline(SKIP_CHUNK):  # the rest of a long line: counted, not kept
                if chunk.endswith(b"\n"):
                    unread += len(chunk) - 1
                    break
                unread += len(chunk)
            yield head, unread

    def _note_traceback(self, rank: int, text: str) -> None:
        if rank < 0 or len(self.rank_traceback) >= TAIL_LINES:
            return
        if self._traceback_rank is None and text.lstrip().startswith("Traceback (most recent call last)"):
            self._traceback_rank = rank
        if self._traceback_rank == rank:
            self.rank_traceback.append(text)

    def _send(self, lines: list[list[object]], cut: int) -> None:
        if not lines:
            return
        entry = streams.encode(streams.LOGS, {"attempt": self.attempt, "lines": lines, "cut": cut})
        for delay in (0.1, 0.5, 1, 2, 4, 8):  # Redis may be restarting; the lines wait for it
            try:
                self.client.xadd(self.stream, entry)
                return
            except redis.RedisError:
                time.sleep(delay)
        log.error("dropped %d log lines of %s: Redis unreachable", len(lines), self.stream)

    def join(self, timeout: float) -> None:
        self.thread.join(timeout)


def report(client: redis.Redis, run_id: int, attempt: int, node_id: str, event: str, **fields: object) -> None:
    """A report may come after the run ended (a stalled attempt's exit): the stream goes back on
    ingest's list with it, so the share's exit is read whenever it comes."""
    send(client, run_id, streams.REPORT, {"attempt": attempt, "node": node_id, "event": event, **fields})


def send(client: redis.Redis, run_id: int, entry_type: str, data: dict[str, object]) -> None:
    """One entry on the run's platform stream, which goes (back) on ingest's list with it; retried
    while Redis restarts."""
    stream = streams.run_stream(run_id)
    for delay in (0.1, 0.5, 1, 2, 4, 8, 16):
        try:
            pipe = client.pipeline(transaction=True)
            pipe.xadd(stream, streams.encode(entry_type, data))
            pipe.sadd(streams.ACTIVE_STREAMS, stream)
            pipe.execute()
            return
        except redis.RedisError:
            time.sleep(delay)
    raise RuntimeError(f"could not send a {entry_type} entry of run {run_id}: Redis unreachable")
