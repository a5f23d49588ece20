"""The attempt's Redis user: created when a node's share starts, the ranks' only credential (XADD to
the run's rank stream, nothing else), deleted however the share ends."""

from __future__ import annotations

import contextlib
import logging
import secrets
import time
from urllib.parse import quote

import redis

from torchyard import streams
from torchyard.settings import Settings

log = logging.getLogger(__name__)


def rank_redis_url(platform_url: str, user: str, password: str) -> str:
    """The platform's Redis address with the attempt's credential instead of the platform's."""
    scheme, _, rest = platform_url.partition("://")
    netloc, slash, path = rest.partition("/")
    host = netloc.rpartition("@")[2]
    database = path.split("?", 1)[0] if slash else "0"
    return f"{scheme}://{quote(user, safe='')}:{quote(password, safe='')}@{host}/{database or '0'}"


def open_rank_credential(client: redis.Redis, settings: Settings, run_id: int, attempt: int, node_rank: int) -> str:
    """Creates the attempt's Redis user for this node's ranks (a fresh password each time: a
    redelivered or repeated share never reuses one); returns the ranks' Redis URL."""
    user, password = streams.rank_user(run_id, attempt, node_rank), secrets.token_hex(24)
    client.execute_command("ACL", "SETUSER", user, *streams.rank_acl_rules(run_id, password))
    _save_acl(client)
    return rank_redis_url(settings.redis_url, user, password)


def close_rank_credential(client: redis.Redis, run_id: int, attempt: int, node_rank: int) -> None:
    """Deletes the attempt's Redis user (Redis drops its connections too). Retried: a user left
    behind is also removed by the scheduler once its attempt has ended."""
    user = streams.rank_user(run_id, attempt, node_rank)
    for delay in (0.1, 0.5, 1, 2):
        try:
            client.execute_command("ACL", "DELUSER", user)
            _save_acl(client)
            return
        except redis.RedisError as exc:
            log.warning("could not delete Redis user %s yet: %s", user, exc)
            time.sleep(delay)


def _save_acl(client: redis.Redis) -> None:
    """Persists the users so a restarted Redis keeps them; a Redis configured without an ACL
    file (its users set by its operator) answers an error, which changes nothing here."""
    with contextlib.suppress(redis.ResponseError):
        client.execute_command("ACL", "SAVE")
