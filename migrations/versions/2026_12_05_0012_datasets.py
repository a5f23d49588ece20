"""datasets: registered sharded datasets and their shards

Revision ID: 0012
Revises: 0011
Create Date: 2026-12-05 12:00:00
"""

import sqlalchemy as sa
from alembic import op

revision = "0012"
down_revision = "0011"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "datasets",
        sa.Column("id", sa.Integer(), primary_key=True),
        sa.Column("name", sa.String(length=100), nullable=False, unique=True),
        sa.Column("status", sa.String(length=20), nullable=False),
        sa.Column("samples", sa.BigInteger(), nullable=False),
        sa.Column("bytes", sa.BigInteger(), nullable=False),
        sa.Column("digest", sa.String(length=64), nullable=False),
        sa.Column("schema", sa.JSON(), nullable=False),
        sa.Column("owner_id", sa.Integer(), sa.ForeignKey("tokens.id"), nullable=True),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("completed_at", sa.DateTime(timezone=True), nullable=True),
    )
    op.create_table(
        "dataset_shards",
        sa.Column("id", sa.Integer(), primary_key=True),
        sa.Column("dataset_id", sa.Integer(), sa.ForeignKey("datasets.id", ondelete="CASCADE"), nullable=False),
        sa.Column("index", sa.Integer(), nullable=False),
        sa.Column("samples", sa.BigInteger(), nullable=False),
        sa.Column("bytes", sa.BigInteger(), nullable=False),
        sa.Column("sha256", sa.String(length=64), nullable=False),
        sa.Column("index_sha256", sa.String(length=64), nullable=False),
        sa.Column("fields", sa.JSON(), nullable=False),
        sa.Column("schema", sa.JSON(), nullable=False),
        sa.UniqueConstraint("dataset_id", "index", name="uq_dataset_shard"),
    )
    op.create_index("ix_dataset_shards_dataset_id", "dataset_shards", ["dataset_id"])


def downgrade() -> None:
    op.drop_table("dataset_shards")
    op.drop_table("datasets")
