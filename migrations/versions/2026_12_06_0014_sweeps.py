"""sweeps: hyperparameter sweeps, their trials and their Optuna journals

Revision ID: 0014
Revises: 0013
Create Date: 2026-12-06 09:00:00
"""

import sqlalchemy as sa
from alembic import op

revision = "0014"
down_revision = "0013"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "sweeps",
        sa.Column("id", sa.Integer(), primary_key=True),
        sa.Column("name", sa.String(length=200), nullable=False),
        sa.Column("status", sa.String(length=20), nullable=False),
        sa.Column("status_reason", sa.Text(), nullable=False),
        sa.Column("spec", sa.JSON(), nullable=False),
        sa.Column("owner_id", sa.Integer(), sa.ForeignKey("tokens.id"), nullable=True),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("ended_at", sa.DateTime(timezone=True), nullable=True),
    )
    op.create_index("ix_sweeps_status", "sweeps", ["status"])
    op.create_table(
        "sweep_trials",
        sa.Column("id", sa.Integer(), primary_key=True),
        sa.Column("sweep_id", sa.Integer(), sa.ForeignKey("sweeps.id", ondelete="CASCADE"), nullable=False),
        sa.Column("number", sa.Integer(), nullable=False),
        sa.Column("run_id", sa.Integer(), sa.ForeignKey("runs.id", ondelete="SET NULL"), nullable=True, unique=True),
        sa.Column("params", sa.JSON(), nullable=False),
        sa.Column("state", sa.String(length=20), nullable=False),
        sa.Column("value", sa.Float(), nullable=True),
        sa.Column("reported_step", sa.BigInteger(), nullable=False),
        sa.Column("pruned_at", sa.BigInteger(), nullable=True),
        sa.Column("reason", sa.Text(), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("ended_at", sa.DateTime(timezone=True), nullable=True),
        sa.UniqueConstraint("sweep_id", "number", name="uq_sweep_trial"),
    )
    op.create_table(
        "sweep_journal",
        sa.Column("sweep_id", sa.Integer(), sa.ForeignKey("sweeps.id", ondelete="CASCADE"), primary_key=True),
        sa.Column("seq", sa.BigInteger(), primary_key=True),
        sa.Column("entry", sa.Text(), nullable=False),
    )


def downgrade() -> None:
    op.drop_table("sweep_journal")
    op.drop_table("sweep_trials")
    op.drop_index("ix_sweeps_status", table_name="sweeps")
    op.drop_table("sweeps")
