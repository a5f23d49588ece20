"""What an owner may submit, beyond what the spec itself allows: the rules a run's and a sweep's
submission share (a sweep checks them for its base spec and every value of its space at submit,
so a trial can never be refused by them pass after pass)."""

from __future__ import annotations

from backend import errors
from backend.models import Token


def check_priority(
    priority: int,
    owner: Token | None,
    max_member_priority: int | None,
    loc: list[str | int] | None = None,
    field: str = "resources.priority",
) -> None:
    """InvalidRequest when a member asks for more than ``max_member_priority`` (else any member
    could jump every queue); an admin may set any priority the spec allows."""
    member = owner is not None and owner.role != "admin"
    if member and max_member_priority is not None and priority > max_member_priority:
        raise errors.InvalidRequest(
            loc or ["body", "resources", "priority"],
            f"{field} ({priority}) is above {max_member_priority}, the most a member may set "
            "(TORCHYARD_MAX_MEMBER_PRIORITY): a higher priority needs an admin token",
            priority,
        )
