"""images: the file's stamp as it was read (inode, mtime, ctime)

A rerun of `worker run` (or a restart of `watch` with `inputs: keep`) read and hashed every file again
to learn that it was done. With the stamp of the read that was processed, a file whose size and stamp
are unchanged, under the same root, is known done without reading it. Rows written before have no
stamp: their files are read once more, as before.

Revision ID: 0003
Revises: 0002
Create Date: 2026-12-01
"""
from alembic import op
import sqlalchemy as sa

revision = '0003'
down_revision = '0002'
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table('images', schema=None) as batch_op:
        batch_op.add_column(sa.Column('stamp', sa.String(length=80), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table('images', schema=None) as batch_op:
        batch_op.drop_column('stamp')
