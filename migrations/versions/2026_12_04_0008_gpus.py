"""GPUs as a resource: a node's GPUs, the GPUs a share holds; a run's submit warnings

Revision ID: 0008
Revises: 0007
Create Date: 2026-12-04 20:00:00
"""

import sqlalchemy as sa
from alembic import op

revision = "0008"
down_revision = "0007"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("nodes") as batch:
        batch.add_column(sa.Column("gpus", sa.JSON(), server_default="[]", nullable=False))
    with op.batch_alter_table("allocations") as batch:
        batch.add_column(sa.Column("gpus", sa.JSON(), server_default="[]", nullable=False))
    with op.batch_alter_table("runs") as batch:
        batch.add_column(sa.Column("warnings", sa.JSON(), server_default="[]", nullable=False))


def downgrade() -> None:
    with op.batch_alter_table("runs") as batch:
        batch.drop_column("warnings")
    with op.batch_alter_table("allocations") as batch:
        batch.drop_column("gpus")
    with op.batch_alter_table("nodes") as batch:
        batch.drop_column("gpus")
