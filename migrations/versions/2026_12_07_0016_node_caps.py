"""node caps: how the node's worker caps a run's processes and memory, as its heartbeat says
(``workers/caps.py support()``); "" from a worker that does not say

Revision ID: 0016
Revises: 0015
Create Date: 2026-12-07 00:16:00
"""

import sqlalchemy as sa
from alembic import op

revision = "0016"
down_revision = "0015"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("nodes") as batch:
        batch.add_column(sa.Column("caps", sa.String(300), nullable=False, server_default=""))


def downgrade() -> None:
    with op.batch_alter_table("nodes") as batch:
        batch.drop_column("caps")
