"""slurm: the Slurm job an attempt runs as (attempts of a Slurm pool; NULL on torchyard's own workers)

Revision ID: 0015
Revises: 0014
Create Date: 2026-12-06 00:15:00
"""

import sqlalchemy as sa
from alembic import op

revision = "0015"
down_revision = "0014"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("attempts") as batch:
        batch.add_column(sa.Column("slurm_job_id", sa.String(32), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("attempts") as batch:
        batch.drop_column("slurm_job_id")
