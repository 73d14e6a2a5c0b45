"""a job's stop_after_disconnect_seconds

A job may ask its node's agent to kill it once the node has not reached the control plane for
that long (issue 42; Nomad's `disconnect.stop_on_client_after`). Existing jobs have none: they
run on through any outage, as before.

Revision ID: 0019
Revises: 0018
"""

import sqlalchemy as sa
from alembic import op

revision = "0019"
down_revision = "0018"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("jobs") as batch:
        batch.add_column(sa.Column("stop_after_disconnect_seconds", sa.Float(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("jobs") as batch:
        batch.drop_column("stop_after_disconnect_seconds")
