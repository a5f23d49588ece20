"""A live run's streams stay bounded while it runs (ingest trims them behind what it committed), and
a live view resumed from an id the streams no longer hold gets what it missed from the database:
every point, log line and state change exactly once; many viewers of a run share one reader, and
each still gets every event once, in the same order. Real stacks (api, ingest, worker, 2 Gloo
ranks): on PostgreSQL with streams keeping 1 s for live viewers, on SQLite keeping nothing (every
committed entry trimmed at once: live readers too cross from the database to the stream)."""

from __future__ import annotations

import itertools
import re
import threading
from collections import Counter
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
import redis
import sqlalchemy

from cli import sse
from cli.redis_server import RedisServer
from cli.wait import wait_for
from testkit.stack import RunningStack, metric_rows, start_stack
from torchyard import streams
from torchyard.states import TERMINAL

pytestmark = [pytest.mark.stack, pytest.mark.timeout(90)]
SLACK_S = 3.0  # past the window: the second between trims (backend/trim.py) and an ingest batch in flight, under load


SQLITE_KEEP0 = pytest.param(("sqlite", 0.0), id="sqlite-keep0")


@pytest.fixture(scope="module", params=[SQLITE_KEEP0, pytest.param(("postgresql", 1.0), id="postgresql-keep1")])
def stack(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningStack]:
    database, keep_s = request.param
    tmp = tmp_path_factory.mktemp(f"bounds-{database}")
    url = f"sqlite:///{tmp / 'torchyard.db'}" if database == "sqlite" else request.getfixturevalue("module_pg_url")
    server = RedisServer(tmp / "redis").start()
    # a viewer left behind by its run's shared reader after 2 batches: the handover between
    # reading on its own and from the shared reader happens many times a run here
    running = start_stack(tmp, url, server, stream_keep_s=keep_s, live_feed_backlog=2)
    yield running
    running.stack.stop()
    server.stop()


def query(stack: RunningStack, sql: str, **params: Any) -> list[Any]:
    engine = sqlalchemy.create_engine(stack.settings.sqlalchemy_url)
    try:
        with engine.connect() as conn:
            return list(conn.execute(sqlalchemy.text(sql), params))
    finally:
        engine.dispose()


def entries_carried(stack: RunningStack, run_id: int) -> int:
    """How many metrics entries the run's rank stream has carried (each stored row names its entry)."""
    sql = "SELECT COUNT(DISTINCT entry_pos) FROM metrics WHERE run_id = :run"
    return int(query(stack, sql, run=run_id)[0][0])


def read(stack: RunningStack, run_id: int, last_event_id: str, until: Any, since: str = "") -> list[sse.Event]:
    headers = {"Authorization": f"Bearer {stack.token}"}
    if last_event_id:
        headers["Last-Event-ID"] = last_event_id
    events: list[sse.Event] = []
    url = f"{stack.url}/api/v1/runs/{run_id}/stream" + (f"?since={since}" if since else "")
    with httpx.stream("GET", url, headers=headers, timeout=httpx.Timeout(30, read=60)) as response:
        assert response.status_code == 200, response.read()
        for event in sse.parse(response.iter_lines()):
            events.append(event)
            if until(event):
                break
    return events


def stale_entries(client: redis.Redis, key: str, keep_s: float) -> tuple[int, list[str]]:
    """The stream's length, and the entries it should no longer hold: committed (below the oldest
    entry the ingest group has not acknowledged) and older than the window and the slack."""
    pipe = client.pipeline(transaction=False)
    pipe.xinfo_groups(key)  # before the entries: one acked meanwhile counts as not acked yet
    pipe.xpending(key, streams.INGEST_GROUP)
    pipe.time()
    pipe.xrange(key)
    groups, pending, (seconds, micros), entries = pipe.execute(raise_on_error=False)
    if isinstance(groups, Exception) or not groups:
        return 0, []  # not made yet
    delivered = streams.id_after(groups[0]["last-delivered-id"].decode())
    unacked = streams.parse_id(pending["min"].decode() if pending["pending"] else delivered)
    old = (seconds * 1000 + micros // 1000 - int((keep_s + SLACK_S) * 1000), 0)
    ids = [entry_id.decode() for entry_id, _ in entries]
    return len(ids), [i for i in ids if streams.parse_id(i) < min(unacked, old)]


def test_a_live_runs_streams_stay_bounded_while_it_runs(stack: RunningStack) -> None:
    run = stack.client.submit(name="bounded", steps=10_000_000, params={"hidden": 32})
    client = redis.Redis.from_url(stack.settings.redis_url)
    keys = (streams.run_stream(run["id"]), streams.rank_stream(run["id"]))
    keep_s = stack.settings.stream_keep_s
    longest = Counter[str]()

    def carried_far_more_than_held() -> bool:
        for key in keys:
            length, stale = stale_entries(client, key, keep_s)
            assert not stale, f"{key} holds {len(stale)} committed entries older than {keep_s} + {SLACK_S} s"
            longest[key] = max(longest[key], length)
        assert stack.client.run(run["id"])["status"] not in TERMINAL
        carried = entries_carried(stack, run["id"])
        return carried >= 300 and carried >= 5 * max(longest.values())

    try:
        wait_for(carried_far_more_than_held, 60, "the run to send 5x what its streams held", interval=0.1)
        print(
            f"keep {keep_s} s: rank stream carried {entries_carried(stack, run['id'])} entries; longest {dict(longest)}"
        )
        assert longest[keys[1]] > 0, "sampled while it ran"

        # "$" is new events only, though the stream no longer holds the entries before them
        newest = streams.parse_id(client.xinfo_stream(keys[1])["last-generated-id"].decode())
        fresh = read(stack, run["id"], "", until=lambda e: e.event == "metrics", since="$")
        assert [e.event for e in fresh] == ["metrics"], "nothing from before (its state changes are in the database)"
        assert streams.parse_id(fresh[0].id.split("_")[1]) > newest, (fresh[0].id, newest)
    finally:
        stack.client.http.post(f"/api/v1/runs/{run['id']}/cancel")
        client.close()
    stack.client.wait_status(run["id"], {"cancelled"}, timeout=30)


def test_a_resume_from_a_trimmed_id_gets_every_step_once_from_the_database_then_live(stack: RunningStack) -> None:
    run_id = stack.client.submit(name="resumed", steps=10_000_000, params={"hidden": 32})["id"]
    first = read(stack, run_id, "0-0", until=lambda e: e.event == "metrics" and e.data["points"][-1][0] > 50)
    _platform, rank_id = first[-1].id.split("_")

    # Away until entries after the last one it saw are gone from the stream (and in the database).
    client = redis.Redis.from_url(stack.settings.redis_url)
    rank_key = streams.rank_stream(run_id)

    def trimmed_past_it() -> str | None:
        oldest: Any = client.xrange(rank_key, count=1)
        if not oldest or streams.parse_id(oldest[0][0].decode()) <= streams.parse_id(rank_id):
            return None
        low, high = streams.entry_position(rank_id, True), streams.entry_position(oldest[0][0].decode(), True)
        sql = "SELECT COUNT(DISTINCT entry_pos) FROM metrics WHERE run_id = :run AND entry_pos > :low AND entry_pos < :high"
        return oldest[0][0].decode() if int(query(stack, sql, run=run_id, low=low, high=high)[0][0]) >= 5 else None

    oldest = streams.parse_id(wait_for(trimmed_past_it, 30, "the entries after the last one seen to be trimmed", 0.1))
    client.close()

    def rank_part(event: sse.Event) -> tuple[int, int]:
        return streams.parse_id(event.id.split("_")[1])

    live: list[sse.Event] = []

    def then_live_until_cancelled(event: sse.Event) -> bool:
        if event.event == "metrics" and rank_part(event) >= oldest:
            live.append(event)
            if len(live) == 20:  # well into what the stream still held: end the run
                assert stack.client.http.post(f"/api/v1/runs/{run_id}/cancel").status_code == 202
        return event.event == "state" and event.data["status"] in TERMINAL

    rest = read(stack, run_id, first[-1].id, until=then_live_until_cancelled)
    assert rest[-1].data["status"] == "cancelled" and len(live) >= 20

    events = first + rest
    ids = [e.id for e in events]
    assert len(set(ids)) == len(ids), "an event came twice"
    cursors = [tuple(streams.parse_id(part) for part in i.split("_")) for i in ids]
    assert all(a[0] <= b[0] and a[1] <= b[1] for a, b in itertools.pairwise(cursors)), "ids only rise"
    replayed = [e for e in rest if e.event == "metrics" and rank_part(e) < oldest]
    assert len(replayed) >= 5, "the resume read the trimmed stretch from the database"

    # Every stored point exactly once across the two connections, nothing else (ingest may still
    # be writing the last entries when the stream ends).
    sent = Counter(
        (e.data["attempt"], e.data["rank"], key, point[0])
        for e in events
        if e.event == "metrics"
        for point in e.data["points"]
        for key in point[2]
    )
    wait_for(lambda: metric_rows(stack.settings, run_id) == sent, 15, "the database to hold what was sent")
    steps = {step for (_, rank, key, step) in sent if key == "loss" and rank == 0}
    assert steps == set(range(1, max(steps) + 1)), "every step of the run, from 1"

    lines = Counter((rank, text) for e in events if e.event == "logs" for rank, _ts, text in e.data["lines"])
    sql = "SELECT rank, text FROM log_lines WHERE run_id = :run AND entry_pos IS NOT NULL"
    assert lines == Counter((rank, text) for rank, text in query(stack, sql, run=run_id)), "log lines once each"
    changes = [e.data["status"] for e in events if e.event == "state"]
    recorded = stack.client.http.get(f"/api/v1/runs/{run_id}/events").json()
    assert changes == [e["to_status"] for e in recorded if e["from_status"] is not None], "state changes once each"
    print(
        f"{len(first)} + {len(rest)} events ({len(replayed)} metrics entries from the database); "
        f"{sum(sent.values())} points of {max(steps)} steps sent, {len(sent)} stored, each once"
    )


def live_figures(stack: RunningStack) -> dict[str, float]:
    text = stack.client.http.get("/metrics").text
    return {name: float(value) for name, value in re.findall(r"^torchyard_(live_\w+) (\S+)$", text, re.M)}


# The api's reading is the same on either database: once is enough (the SQLite stack, shared with
# the tests above, not a PostgreSQL one started for this test).
@pytest.mark.parametrize("stack", [SQLITE_KEEP0], indirect=True)
def test_viewers_of_a_run_share_one_reader_and_each_gets_every_event_once_in_one_order(stack: RunningStack) -> None:
    run_id = stack.client.submit(name="watched", steps=300, params={"hidden": 32}, log_every=1)["id"]
    viewers, from_now = 6, 2  # and 2 more from "now": they join the shared reader at once
    seen: list[list[tuple[str, str, Any]]] = [[] for _ in range(viewers + from_now)]
    failures: list[BaseException] = []

    def watch(index: int) -> None:
        try:
            start = {"last_event_id": "0-0"} if index < viewers else {"last_event_id": "", "since": "$"}
            events = read(stack, run_id, **start, until=lambda e: e.event == "state" and e.data["status"] in TERMINAL)
            # an entry read back from the database lacks the counts of what its sender cut or dropped
            counts = ("cut", "dropped")
            seen[index] = [
                (e.id, e.event, {k: v for k, v in e.data.items() if k not in counts}) for e in events if e.id
            ]
        except BaseException as e:  # re-raised below, in the test's thread
            failures.append(e)

    # half from the start, half once the run is under way (they read what they missed on their own first)
    threads = [threading.Thread(target=watch, args=(i,), daemon=True) for i in range(viewers + from_now)]
    joined_before = live_figures(stack)["live_feed_joined_total"]
    threads[viewers].start()  # the first from now starts the shared reader, the second joins it
    wait_for(lambda: live_figures(stack)["live_feed_viewers"] >= 1, 30, "a shared reader", interval=0.05)
    for thread in threads[: viewers // 2]:
        thread.start()
    wait_for(lambda: stack.client.run(run_id)["last_step"] >= 50, 60, "the run to be under way", interval=0.1)
    for thread in threads[viewers // 2 : viewers] + threads[viewers + 1 :]:
        thread.start()
    most = Counter[str]()
    while any(t.is_alive() for t in threads):
        for name, value in live_figures(stack).items():
            most[name] = max(most[name], int(value))
        assert most["live_feeds"] <= 1, "one shared reader per run"
        threads[0].join(0.2)
    assert not failures, failures
    # Counted, not sampled (a sample misses a viewer that joined and left between two, as on a loaded
    # machine): the viewers from now join at once, those from the start once they caught up.
    joined = live_figures(stack)["live_feed_joined_total"] - joined_before
    assert joined >= from_now, f"viewers read from the shared reader: {joined} joined; peaks {dict(most)}"

    first = seen[0]
    assert first[-1][2]["status"] == "succeeded"
    for other in seen[viewers:]:
        assert other and other == first[len(first) - len(other) :], (
            f"a viewer from now got the others' events from where it joined: {len(other)} events, the first {other[:1]}"
        )
    for other in seen[1:viewers]:
        diff = next((i for i, (a, b) in enumerate(zip(first, other, strict=False)) if a != b), None)
        assert diff is None and len(other) == len(first), (
            f"every viewer got the same events, in the same order: {len(first)} and {len(other)} events, "
            f"first difference at {diff}: {first[diff] if diff is not None else ''} "
            f"vs {other[diff] if diff is not None else ''}"
        )
    ids = [event_id for event_id, _, _ in first]
    assert len(set(ids)) == len(ids), "an event came twice"
    sent = Counter(
        (data["attempt"], data["rank"], key, point[0])
        for _, event, data in first
        if event == "metrics"
        for point in data["points"]
        for key in point[2]
    )
    wait_for(lambda: metric_rows(stack.settings, run_id) == sent, 15, "the database to hold what was sent")
    after = live_figures(stack)
    assert after["live_feeds"] == 0 and after["live_feed_viewers"] == 0, "the shared reader ended with its viewers"
    print(f"{viewers} viewers, {len(first)} events each, {sum(sent.values())} points; /metrics peaks {dict(most)}")
