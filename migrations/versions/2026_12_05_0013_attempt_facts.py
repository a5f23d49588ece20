"""attempt facts: how an attempt ran in rank 0's word (world, cores, calibration, collectives per step)

Revision ID: 0013
Revises: 0012
Create Date: 2026-12-05 13:00:00
"""

import sqlalchemy as sa
from alembic import op

revision = "0013"
down_revision = "0012"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("attempts") as batch:
        batch.add_column(sa.Column("facts", sa.JSON(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("attempts") as batch:
        batch.drop_column("facts")
