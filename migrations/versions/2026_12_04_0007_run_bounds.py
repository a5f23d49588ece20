"""a run's metric keys and its counters against the bounds (log bytes, lines and points dropped)

Revision ID: 0007
Revises: 0006
Create Date: 2026-12-04 16:30:00
"""

import sqlalchemy as sa
from alembic import op

revision = "0007"
down_revision = "0006"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "run_metric_keys",
        sa.Column("run_id", sa.Integer(), sa.ForeignKey("runs.id", ondelete="CASCADE"), primary_key=True),
        sa.Column("key", sa.String(length=200), primary_key=True),
    )
    op.create_table(
        "run_counters",
        sa.Column("run_id", sa.Integer(), sa.ForeignKey("runs.id", ondelete="CASCADE"), primary_key=True),
        sa.Column("name", sa.String(length=40), primary_key=True),
        sa.Column("value", sa.BigInteger(), nullable=False),
    )
    # Runs logged before this keep their charts: their keys are read once from their points.
    op.execute("INSERT INTO run_metric_keys (run_id, key) SELECT DISTINCT run_id, key FROM metrics")
    op.execute(
        "INSERT INTO run_counters (run_id, name, value)"
        " SELECT run_id, 'log_bytes', SUM(LENGTH(text)) FROM log_lines GROUP BY run_id"
    )


def downgrade() -> None:
    op.drop_table("run_counters")
    op.drop_table("run_metric_keys")
