"""metric rollups per attempt

A resumed attempt logs again the steps after its checkpoint; rollups merged across attempts showed
the replaced values in every wide view. Rollups written before this keep attempt 1 (they may still
mix attempts for a run resumed before the upgrade; new points never do).

Revision ID: 0006
Revises: 0005
Create Date: 2026-12-04 16:30:00
"""

import sqlalchemy as sa
from alembic import op

revision = "0006"
down_revision = "0005"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("metric_rollups") as batch:
        batch.add_column(sa.Column("attempt", sa.Integer(), server_default="1", nullable=False))
        batch.drop_constraint("uq_metric_rollup", type_="unique")
        batch.create_unique_constraint(
            "uq_metric_rollup_attempt", ["run_id", "key", "level", "bucket", "rank", "attempt"]
        )


def downgrade() -> None:
    # blocks of several attempts cannot merge back into one row: keep the first attempt's
    op.execute(sa.text("DELETE FROM metric_rollups WHERE attempt > 1"))
    with op.batch_alter_table("metric_rollups") as batch:
        batch.drop_constraint("uq_metric_rollup_attempt", type_="unique")
        batch.drop_column("attempt")
        batch.create_unique_constraint("uq_metric_rollup", ["run_id", "key", "level", "bucket", "rank"])
