"""A rank cannot make the platform's Redis hold more than it should: an XADD argument past
``proto-max-bulk-len`` is refused by Redis while it reads it (it never sits in Redis's memory), and
Redis runs with a memory bound whose policy evicts nothing (a full Redis fails writes; it never
drops a platform key). Against the private redis-server ``torchyard up`` starts."""

from __future__ import annotations

import pytest
import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from cli.redis_server import RedisServer
from torchyard import streams
from torchyard.settings import Settings

pytestmark = [pytest.mark.unit, pytest.mark.timeout(60)]


def rank_client(server: RedisServer, run_id: int) -> redis.Redis:
    """A client with the rights a rank gets (README "Walls"): XADD to its run's rank stream only."""
    admin = redis.Redis.from_url(server.url)
    user = f"{streams.RANK_USER_PREFIX}{run_id}-1-0"
    admin.execute_command("ACL", "SETUSER", user, "on", ">rank-pw", f"~{streams.rank_stream(run_id)}", "+xadd")
    no_retry = Retry(NoBackoff(), 0)  # each attempt is one XADD, refused once
    return redis.Redis(host="127.0.0.1", port=server.port, username=user, password="rank-pw", retry=no_retry)


def test_an_oversize_entry_is_refused_by_redis_and_never_held(redis_server: RedisServer) -> None:
    admin = redis.Redis.from_url(redis_server.url)
    rank = rank_client(redis_server, 7)
    before = int(admin.info("memory")["used_memory"])
    for _ in range(8):  # the attack as found: eight 64 MiB XADDs took Redis to 472 MB
        with pytest.raises(redis.RedisError):
            rank.xadd(streams.rank_stream(7), {"type": "metrics", "data": b"x" * (64 << 20)})
    assert int(admin.info("memory")["used_memory"]) - before < 16 << 20
    assert admin.xlen(streams.rank_stream(7)) == 0
    # The largest entry ingest accepts still goes through, and the victim's next write too.
    rank = rank_client(redis_server, 7)
    rank.xadd(streams.rank_stream(7), {"type": "metrics", "data": b"x" * streams.RANK_LIMITS["entry_bytes"]})
    assert admin.xlen(streams.rank_stream(7)) == 1
    assert admin.ping()


def test_redis_memory_is_bounded_and_nothing_is_evicted(redis_server: RedisServer) -> None:
    admin = redis.Redis.from_url(redis_server.url)
    assert admin.config_get("maxmemory-policy") == {"maxmemory-policy": "noeviction"}
    assert int(admin.config_get("maxmemory")["maxmemory"]) == Settings().redis_max_memory_bytes
    assert int(admin.config_get("proto-max-bulk-len")["proto-max-bulk-len"]) == streams.REDIS_MAX_BULK_BYTES
