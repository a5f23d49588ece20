"""The api's domain errors, in one place: raised by the data layer (``backend/runs.py`` and others),
turned into HTTP answers by one handler each in ``backend/app.py``."""

from __future__ import annotations


class NotFound(Exception):
    pass


class InvalidRequest(Exception):
    """A request that is well-formed but cannot be met (e.g. a device no node has): a 422."""

    def __init__(self, loc: list[str | int], msg: str, value: object) -> None:
        super().__init__(msg)
        self.loc, self.msg, self.value = loc, msg, value


class LimitExceeded(Exception):
    """A quota the caller has used up: a 429 saying which and how to get under it."""


class Conflict(Exception):
    """A request the resource's current state refuses (e.g. revoking a revoked token): a 409."""
