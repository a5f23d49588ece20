"""live alerts: an event's alert kind, and the alerts that hold on a run

Revision ID: 0011
Revises: 0010
Create Date: 2026-12-05 09:00:00
"""

import sqlalchemy as sa
from alembic import op

revision = "0011"
down_revision = "0010"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("run_events") as batch:
        batch.add_column(sa.Column("alert", sa.String(length=20), nullable=True))
    op.create_table(
        "run_alerts",
        sa.Column("run_id", sa.Integer(), sa.ForeignKey("runs.id", ondelete="CASCADE"), primary_key=True),
        sa.Column("kind", sa.String(length=20), primary_key=True),
        sa.Column("step", sa.BigInteger(), nullable=False),
        sa.Column("raised_at", sa.DateTime(timezone=True), nullable=False),
    )


def downgrade() -> None:
    op.drop_table("run_alerts")
    with op.batch_alter_table("run_events") as batch:
        batch.drop_column("alert")
