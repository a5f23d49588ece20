"""Reading Server-Sent Events (the api's live stream): one parser for the CLI and the tests."""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from typing import Any, NamedTuple


class Event(NamedTuple):
    id: str
    event: str
    data: Any  # the decoded JSON


def parse(lines: Iterable[str]) -> Iterator[Event]:
    """Yields each event as its closing blank line arrives; comments (keep-alives) are skipped."""
    event_id, event, data = "", "message", list[str]()
    for line in lines:
        if not line:
            if data:
                yield Event(event_id, event, json.loads("\n".join(data)))
            event, data = "message", []
            continue
        field, _, value = line.partition(":")
        value = value.removeprefix(" ")
        if field == "id":
            event_id = value
        elif field == "event":
            event = value
        elif field == "data":
            data.append(value)
