"""batches: the recorder's last committed batch per run

On PostgreSQL a connection can break after the server committed a transaction and before the worker heard
so. Each recorder (a run has one per process) numbers its batches and writes the number in the batch's own
transaction: asked again, the server says whether the batch it sent last was committed, and a batch that was is not written a second time
(no attempt charged twice, no outcome tallied twice, no claim taken for lost).

Revision ID: 0006
Revises: 0005
Create Date: 2026-12-08
"""
from alembic import op
import sqlalchemy as sa

revision = '0006'
down_revision = '0005'
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        'batches',
        sa.Column('writer', sa.String(length=32), primary_key=True),
        sa.Column('run_id', sa.BigInteger().with_variant(sa.Integer(), 'sqlite'), sa.ForeignKey('runs.id'),
                  nullable=False),
        sa.Column('last', sa.BigInteger(), nullable=False),
    )


def downgrade() -> None:
    op.drop_table('batches')
