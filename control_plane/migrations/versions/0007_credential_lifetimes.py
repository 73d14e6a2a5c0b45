"""credential lifetimes

Every credential records its expiry (CR-3), the labels signed into it and who had it issued, so
the admin API can list them. Credentials issued before this revision have no expiry recorded.

Revision ID: 0007
Revises: 0006
"""

import sqlalchemy as sa
from alembic import op

revision = "0007"
down_revision = "0006"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("node_credentials", schema=None) as batch_op:
        batch_op.add_column(sa.Column("expires_at", sa.DateTime(timezone=True), nullable=True))
        batch_op.add_column(sa.Column("labels", sa.JSON(), nullable=True))
        batch_op.add_column(sa.Column("issuer", sa.String(length=16), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("node_credentials", schema=None) as batch_op:
        batch_op.drop_column("issuer")
        batch_op.drop_column("labels")
        batch_op.drop_column("expires_at")
