"""tallies; images by status and run; timings by run and total: a long run read without its every row

`tallies` holds what a run's outcomes add up to per minute (outcomes, total latency) or per hour (each
stage's latency, labels, scores, results), written by the recorder in the transaction of the outcomes:
`worker stats` and `worker report` read a run of millions of images from it. Runs recorded before this
revision have none and are read row by row, as before.

Revision ID: 0005
Revises: 0004
Create Date: 2026-12-05
"""
from alembic import op
import sqlalchemy as sa

revision = '0005'
down_revision = '0004'
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        'tallies',
        sa.Column('run_id', sa.BigInteger().with_variant(sa.Integer(), 'sqlite'), sa.ForeignKey('runs.id'),
                  primary_key=True),
        sa.Column('at', sa.BigInteger(), primary_key=True, autoincrement=False),
        sa.Column('kind', sa.String(length=16), primary_key=True),
        sa.Column('key', sa.String(length=255), primary_key=True),
        sa.Column('images', sa.BigInteger(), nullable=False),
        sa.Column('amount', sa.Float(), nullable=False),
    )
    op.drop_index('ix_images_status', table_name='images')
    op.create_index('ix_images_status_run', 'images', ['status', 'run_id'])
    op.drop_index('ix_timings_run_id', table_name='timings')
    op.create_index('ix_timings_run_total', 'timings', ['run_id', 'total_ms'])


def downgrade() -> None:
    op.drop_index('ix_timings_run_total', table_name='timings')
    op.create_index('ix_timings_run_id', 'timings', ['run_id'])
    op.drop_index('ix_images_status_run', table_name='images')
    op.create_index('ix_images_status', 'images', ['status'])
    op.drop_table('tallies')
