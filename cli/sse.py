"""Reading Server-Sent Events (the api's live stream): one parser for the CLI and the tests."""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from typing import Any, NamedTuple


class Event(NamedTuple):
    id: str
    event: str
    data: Any  # the decoded JSON


def parse(lines: Iterable[str], ephemeral: bool = False) -> Iterator[Event]:
    """Yields each event as its closing blank line arrives; comments (keep-alives) are skipped, and
    so are events without an id of their own (ingest's word on a live run, a replay's note of a gap:
    never stored, never replayed) unless ``ephemeral``. An event's id is the last id the stream sent, as a browser's."""
    event_id, event, data, own_id = "", "message", list[str](), False
    for line in lines:
        if not line:
            if data and (own_id or ephemeral):
                yield Event(event_id, event, json.loads("\n".join(data)))
            event, data, own_id = "message", [], False
            continue
        field, _, value = line.partition(":")
        value = value.removeprefix(" ")
        if field == "id":
            event_id, own_id = value, True
        elif field == "event":
            event = value
        elif field == "data":
            data.append(value)
