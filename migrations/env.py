"""Alembic environment: the URL comes from the caller (backend.migrate) or the settings."""

from __future__ import annotations

from alembic import context

from backend.db import make_engine
from backend.models import Base
from torchyard.settings import get_settings

config = context.config
url = config.get_main_option("sqlalchemy.url") or get_settings().sqlalchemy_url

if context.is_offline_mode():
    context.configure(url=url, target_metadata=Base.metadata, literal_binds=True, render_as_batch=True)
    with context.begin_transaction():
        context.run_migrations()
else:
    engine = make_engine(url)
    with engine.connect() as connection:
        context.configure(connection=connection, target_metadata=Base.metadata, render_as_batch=True)
        with context.begin_transaction():
            context.run_migrations()
    engine.dispose()
