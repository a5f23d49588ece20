"""Writes frontend/openapi.json from the api itself (backend.app.create_app().openapi()). The
typed client (src/api/schema.d.ts) is generated from this file at build time; a test fails
when the committed file drifts from the app: rerun `python frontend/scripts/dump_openapi.py`."""

from __future__ import annotations

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TARGET = ROOT / "frontend" / "openapi.json"


def render() -> str:
    sys.path.insert(0, str(ROOT))
    from backend.app import create_app

    return json.dumps(create_app().openapi(), indent=2, sort_keys=True) + "\n"


if __name__ == "__main__":
    TARGET.write_text(render())
    print(f"wrote {TARGET}")
