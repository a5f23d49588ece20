"""The front end's typed client is generated from frontend/openapi.json: that file must be the
api's schema as it is now (rerun `python frontend/scripts/dump_openapi.py` after changing it)."""

from __future__ import annotations

import json
from pathlib import Path

from backend.app import create_app

COMMITTED = Path(__file__).resolve().parent.parent / "frontend" / "openapi.json"


def test_committed_openapi_matches_the_app() -> None:
    current = json.dumps(create_app().openapi(), indent=2, sort_keys=True) + "\n"
    assert COMMITTED.read_text() == current, (
        "frontend/openapi.json drifted from the api: run `python frontend/scripts/dump_openapi.py`"
    )
