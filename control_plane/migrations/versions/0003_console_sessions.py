"""console sessions

Revision ID: 0003
Revises: 0002
"""

import sqlalchemy as sa
from alembic import op

revision = "0003"
down_revision = "0002"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "console_sessions",
        sa.Column("id_hash", sa.String(length=64), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("expires_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("id_hash", name=op.f("pk_console_sessions")),
    )
    with op.batch_alter_table("console_sessions", schema=None) as batch_op:
        batch_op.create_index(batch_op.f("ix_console_sessions_expires_at"), ["expires_at"])


def downgrade() -> None:
    with op.batch_alter_table("console_sessions", schema=None) as batch_op:
        batch_op.drop_index(batch_op.f("ix_console_sessions_expires_at"))
    op.drop_table("console_sessions")
