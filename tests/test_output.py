"""What the worker makes of its ranks' output (workers/output.py): lines read no further than the
cap, cut with a marker that says how much went, through a real pipe into a real Redis stream."""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator

import pytest
import redis

from cli.redis_server import RedisServer
from torchyard import streams
from workers.output import LogPump

pytestmark = pytest.mark.timeout(60)
LIMIT = 1024


def test_a_cut_line_fits_its_cap_marker_and_all_keeps_whole_characters_and_is_not_cut_again() -> None:
    for text, unread in [("x" * 5000, 0), ("é" * 3000, 0), ("ab", 10**9), ("€" * 341, 7)]:
        cut, was_cut = streams.cut_line(text, LIMIT, unread)
        total = len(text.encode()) + unread
        assert was_cut and len(cut.encode()) <= LIMIT
        kept, _, marker = cut.partition(" … [truncated ")
        assert text.startswith(kept) and marker == f"{total - len(kept.encode())} bytes]"
        assert streams.cut_line(cut, LIMIT) == (cut, False)
    assert streams.cut_line("x" * LIMIT, LIMIT) == ("x" * LIMIT, False)


@pytest.fixture
def client(redis_server: RedisServer) -> Iterator[redis.Redis]:
    with redis.Redis.from_url(redis_server.url) as c:
        yield c


def pump(client: redis.Redis, chunks: list[bytes]) -> tuple[list[list[object]], int]:
    """Writes ``chunks`` into a pipe a LogPump reads; returns the lines it sent and their cut count."""
    read_end, write_end = os.pipe()
    with os.fdopen(read_end, "rb") as pipe:
        log_pump = LogPump(client, 5, 1, pipe, LIMIT)

        def write() -> None:
            with os.fdopen(write_end, "wb") as out:
                for chunk in chunks:
                    out.write(chunk)

        writer = threading.Thread(target=write)
        writer.start()
        writer.join(30)
        log_pump.join(30)
    lines, cut = [], 0
    for _, fields in client.xrange(streams.run_stream(5)):
        _, data = streams.decode(fields)
        lines += data["lines"]
        cut += data["cut"]
    return lines, cut


def test_a_long_line_is_read_no_further_than_the_cap_and_the_next_line_arrives(client: redis.Redis) -> None:
    chunks = [
        b"[torchyard-rank 1]:" + b"y" * 100_000,  # no newline yet
        b"y" * 100_000 + b"\n",
        b"[torchyard-rank 1]:short\n",
        b"x" * LIMIT + b"\n",  # exactly the cap: whole
        b"[torchyard-rank 0]:" + b"z" * 50_000,  # the output ends without a newline
    ]
    lines, cut = pump(client, chunks)
    texts = [text for _, _, text in lines]
    assert [rank for rank, _, _ in lines] == [1, 1, -1, 0]
    marker = " … [truncated 199005 bytes]"  # 200,000 bytes, 995 kept: 1,024 with the marker
    assert texts[0] == "y" * (LIMIT - len(marker.encode())) + marker
    assert texts[1:3] == ["short", "x" * LIMIT]
    marker = " … [truncated 49004 bytes]"  # 50,000 bytes, 996 kept
    assert texts[3] == "z" * (LIMIT - len(marker.encode())) + marker
    assert cut == 2 and all(len(t.encode()) <= LIMIT for t in texts)


def test_a_rank_prefix_in_the_middle_of_a_line_starts_a_line_of_its_own(client: redis.Redis) -> None:
    # torch elastic writes a rank's partial stdout line (flushed mid-line) with no newline: the same
    # rank's traceback on stderr then follows on that line; its first line must stay a line of its own
    chunks = [
        b"[torchyard-rank 0]:line 10207[torchyard-rank 0]:Traceback (most recent call last):\n",
        b'[torchyard-rank 0]:  File "crash.py", line 11, in <module>\n',
        b"torchrun says[torchyard-rank 1]:" + b"w" * 5000 + b"\n",  # the launcher's partial line; a long rest
        b"[torchyard-rank 0]:\n",
    ]
    lines, cut = pump(client, chunks)
    assert [(rank, text[:40]) for rank, _, text in lines] == [
        (0, "line 10207"),
        (0, "Traceback (most recent call last):"),
        (0, '  File "crash.py", line 11, in <module>'),
        (-1, "torchrun says"),
        (1, "w" * 40),
        (0, ""),
    ]
    assert cut == 1 and lines[4][2].endswith("bytes]")
