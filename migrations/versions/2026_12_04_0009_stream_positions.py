"""stream positions on stored rows, and the platform entries no other table holds

Ingest trims a run's streams behind what it has committed; a live view resumed behind the trim
reads the missed entries back from the database (backend/replay.py). For that each stored metric
point, log line and sampled step carries its stream entry's position (torchyard.streams
.entry_position), and worker reports and state changes are kept as the stream carried them. Rows
stored before this have no position: a replay says it skipped them (a "gap" event).

Revision ID: 0009
Revises: 0008
Create Date: 2026-12-04 20:00:00
"""

import sqlalchemy as sa
from alembic import op

revision = "0009"
down_revision = "0008"
branch_labels = None
depends_on = None


def upgrade() -> None:
    for table in ("metrics", "log_lines", "step_profiles"):
        op.add_column(table, sa.Column("entry_pos", sa.BigInteger(), nullable=True))
    op.create_index("ix_metrics_entry_pos", "metrics", ["run_id", "entry_pos"])
    op.create_index("ix_log_lines_entry_pos", "log_lines", ["run_id", "entry_pos"])
    op.create_table(
        "stream_entries",
        sa.Column("id", sa.BigInteger().with_variant(sa.Integer(), "sqlite"), primary_key=True),
        sa.Column("run_id", sa.Integer(), sa.ForeignKey("runs.id", ondelete="CASCADE"), nullable=False),
        sa.Column("entry_pos", sa.BigInteger(), nullable=False),
        sa.Column("type", sa.String(length=20), nullable=False),
        sa.Column("data", sa.Text(), nullable=False),
        sa.UniqueConstraint("run_id", "entry_pos", name="uq_stream_entry"),
    )


def downgrade() -> None:
    op.drop_table("stream_entries")
    op.drop_index("ix_log_lines_entry_pos", "log_lines")
    op.drop_index("ix_metrics_entry_pos", "metrics")
    for table in ("metrics", "log_lines", "step_profiles"):
        with op.batch_alter_table(table) as batch:
            batch.drop_column("entry_pos")
