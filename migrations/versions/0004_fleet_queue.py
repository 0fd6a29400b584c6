"""queue, scanners, runs.heartbeat_at: fleet mode's claim queue

Several hosts on one PostgreSQL database share a folder through `queue`: one scanner (the run holding
the `scanners` lease) lists the folder and inserts a row per file; workers claim rows with FOR UPDATE
SKIP LOCKED under a lease in the server's clock, renew it while they live (`runs.heartbeat_at` with it),
and finish a row only while they still own its claim. `runs.session` names the run's PostgreSQL sessions
(their application_name): a run whose leases passed has them ended, so that the row locks of a frozen
worker (SIGSTOP, a suspended VM) do not hold up the worker that takes its claims over.

Revision ID: 0004
Revises: 0003
Create Date: 2026-12-05
"""
from alembic import op
import sqlalchemy as sa

Id = sa.BigInteger().with_variant(sa.Integer(), 'sqlite')

revision = '0004'
down_revision = '0003'
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        'queue',
        sa.Column('id', Id, primary_key=True, autoincrement=True),
        sa.Column('model', sa.String(length=255), nullable=False),
        sa.Column('root', sa.Text(), nullable=False),
        sa.Column('rel_path', sa.Text(), nullable=False),
        sa.Column('size', sa.BigInteger(), nullable=False),
        sa.Column('mtime_ns', sa.BigInteger(), nullable=False),
        sa.Column('state', sa.String(length=16), nullable=False),
        sa.Column('owner', sa.BigInteger(), nullable=True),
        sa.Column('generation', sa.Integer(), nullable=False),
        sa.Column('lease_until', sa.DateTime(timezone=True), nullable=True),
        sa.Column('attempts', sa.Integer(), nullable=False),
        sa.Column('created_at', sa.DateTime(timezone=True), nullable=False),
        sa.Column('updated_at', sa.DateTime(timezone=True), nullable=False),
        sa.UniqueConstraint('model', 'root', 'rel_path', 'size', 'mtime_ns', name='uq_queue_file'),
    )
    op.create_index('ix_queue_claimable', 'queue', ['model', 'root', 'state', 'id'])
    op.create_index('ix_queue_owner', 'queue', ['owner'])
    op.create_table(
        'scanners',
        sa.Column('model', sa.String(length=255), primary_key=True),
        sa.Column('root', sa.Text(), primary_key=True),
        sa.Column('leader', sa.BigInteger(), nullable=True),
        sa.Column('lease_until', sa.DateTime(timezone=True), nullable=True),
        sa.Column('scan_started', sa.DateTime(timezone=True), nullable=True),
        sa.Column('scan_finished', sa.DateTime(timezone=True), nullable=True),
        sa.Column('scan_wanted', sa.DateTime(timezone=True), nullable=True),
    )
    with op.batch_alter_table('runs', schema=None) as batch_op:
        batch_op.add_column(sa.Column('heartbeat_at', sa.DateTime(timezone=True), nullable=True))
        batch_op.add_column(sa.Column('session', sa.String(length=63), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table('runs', schema=None) as batch_op:
        batch_op.drop_column('session')
        batch_op.drop_column('heartbeat_at')
    op.drop_table('scanners')
    op.drop_index('ix_queue_owner', table_name='queue')
    op.drop_index('ix_queue_claimable', table_name='queue')
    op.drop_table('queue')
