"""images: the file's stamp as it was read; runs: the digest of the card's settings

images.stamp: a rerun of `worker run` (or a restart of `watch` with `inputs: keep`) read and hashed
every file again to learn that it was done. With the stamp of the read that was processed (inode,
mtime, ctime), a file whose size and stamp are unchanged, under the same root, is known done without
reading it. Rows written before have no stamp: their files are read once more, as before.

runs.card_sha256: done meant done with the same ONNX file, so a card whose preprocessing,
postprocessing or labels were corrected (the file unchanged) left every earlier result in place. Runs
recorded before have none: their results count as done with the card as it is now.

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
    with op.batch_alter_table('runs', schema=None) as batch_op:
        batch_op.add_column(sa.Column('card_sha256', sa.String(length=64), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table('runs', schema=None) as batch_op:
        batch_op.drop_column('card_sha256')
    with op.batch_alter_table('images', schema=None) as batch_op:
        batch_op.drop_column('stamp')
