"""Migrations upgrade an empty database to head and back down, on SQLite and PostgreSQL, and
head matches the models."""

from __future__ import annotations

from pathlib import Path

import pytest
from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext
from sqlalchemy import create_engine, inspect

from backend.migrate import downgrade, upgrade
from backend.models import Base

pytestmark = pytest.mark.timeout(120)
TABLES = {"runs", "attempts", "allocations", "nodes", "run_events", "metrics", "log_lines", "tokens", "sessions"}


@pytest.fixture(params=["sqlite", "postgresql"])
def empty_db(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path / 'm.db'}"
    return str(request.getfixturevalue("pg_url"))


def test_upgrade_to_head_matches_the_models_and_downgrade_empties(empty_db: str) -> None:
    if "postgresql" in empty_db:
        downgrade(empty_db)  # the session's database may hold another test's schema
    upgrade(empty_db)
    engine = create_engine(empty_db)
    with engine.connect() as conn:
        assert set(inspect(conn).get_table_names()) >= TABLES
        diff = compare_metadata(MigrationContext.configure(conn), Base.metadata)
        assert diff == [], f"models and migrations differ: {diff}"
    downgrade(empty_db)
    with engine.connect() as conn:
        assert not TABLES & set(inspect(conn).get_table_names())
    upgrade(empty_db)  # and up again: the down migration left nothing behind that blocks it
    engine.dispose()
