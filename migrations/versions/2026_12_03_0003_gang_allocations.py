"""gang allocations end per node; runs know when they last stepped, attempts where they began

Revision ID: 0003
Revises: 0002
Create Date: 2026-12-03 17:15:00
"""

import sqlalchemy as sa
from alembic import op

revision = "0003"
down_revision = "0002"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("allocations") as batch:
        batch.add_column(sa.Column("started_at", sa.DateTime(timezone=True), nullable=True))
        batch.add_column(sa.Column("exit_status", sa.String(length=20), nullable=True))
        batch.add_column(sa.Column("ended_at", sa.DateTime(timezone=True), nullable=True))
    with op.batch_alter_table("runs") as batch:
        batch.add_column(sa.Column("last_step_at", sa.DateTime(timezone=True), nullable=True))
    with op.batch_alter_table("attempts") as batch:
        batch.add_column(sa.Column("first_step", sa.BigInteger(), nullable=True))
    # Shares of attempts that already ended hold no slots any more.
    op.execute(
        "UPDATE allocations SET ended_at = (SELECT ended_at FROM attempts WHERE attempts.id = allocations.attempt_id),"
        " exit_status = (SELECT status FROM attempts WHERE attempts.id = allocations.attempt_id)"
        " WHERE attempt_id IN (SELECT id FROM attempts WHERE ended_at IS NOT NULL)"
    )


def downgrade() -> None:
    with op.batch_alter_table("attempts") as batch:
        batch.drop_column("first_step")
    with op.batch_alter_table("runs") as batch:
        batch.drop_column("last_step_at")
    with op.batch_alter_table("allocations") as batch:
        batch.drop_column("ended_at")
        batch.drop_column("exit_status")
        batch.drop_column("started_at")
