"""sampled steps' timelines (torch.profiler)

Revision ID: 0004
Revises: 0003
Create Date: 2026-12-03 23:20:00
"""

import sqlalchemy as sa
from alembic import op

revision = "0004"
down_revision = "0003"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "step_profiles",
        sa.Column("id", sa.BigInteger().with_variant(sa.Integer(), "sqlite"), primary_key=True),
        sa.Column("run_id", sa.Integer(), sa.ForeignKey("runs.id", ondelete="CASCADE"), nullable=False),
        sa.Column("attempt", sa.Integer(), nullable=False),
        sa.Column("rank", sa.Integer(), nullable=False),
        sa.Column("step", sa.BigInteger(), nullable=False),
        sa.Column("timeline", sa.Text(), nullable=False),
        sa.UniqueConstraint("run_id", "step", "rank", "attempt", name="uq_step_profile"),
    )


def downgrade() -> None:
    op.drop_table("step_profiles")
