"""hang diagnoses: requests and each node's answer (its ranks' dumps)

Revision ID: 0010
Revises: 0009
Create Date: 2026-12-04 20:30:00
"""

import sqlalchemy as sa
from alembic import op

revision = "0010"
down_revision = "0009"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "diagnoses",
        sa.Column("id", sa.Integer(), primary_key=True),
        sa.Column("run_id", sa.Integer(), sa.ForeignKey("runs.id", ondelete="CASCADE"), nullable=False),
        sa.Column("attempt", sa.Integer(), nullable=False),
        sa.Column("request", sa.String(length=64), nullable=False, unique=True),
        sa.Column("trigger", sa.String(length=20), nullable=False),
        sa.Column("requested_by", sa.String(length=200), nullable=False),
        sa.Column("requested_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("nodes", sa.Integer(), nullable=False),
        sa.Column("world", sa.Integer(), nullable=False),
    )
    op.create_index("ix_diagnoses_run_id", "diagnoses", ["run_id"])
    op.create_table(
        "diagnosis_answers",
        sa.Column("id", sa.Integer(), primary_key=True),
        sa.Column("diagnosis_id", sa.Integer(), sa.ForeignKey("diagnoses.id", ondelete="CASCADE"), nullable=False),
        sa.Column("node_id", sa.String(length=200), nullable=False),
        sa.Column("received_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("dumps", sa.Text(), nullable=False),
        sa.Column("missing", sa.Text(), nullable=False),
        sa.UniqueConstraint("diagnosis_id", "node_id", name="uq_diagnosis_answer"),
    )
    op.create_index("ix_diagnosis_answers_diagnosis_id", "diagnosis_answers", ["diagnosis_id"])


def downgrade() -> None:
    op.drop_table("diagnosis_answers")
    op.drop_table("diagnoses")
