"""a draining replica's requests in flight, as its agent reports them

A replica leaving the rotation (a rollout, a scale-down) was stopped a fixed drain period
(`MODELFORGE_SERVICE_DRAIN_SECONDS`) after, however soon its last request ended. Its node's agent
now reports the requests in flight to it through the tunnel while it drains, and the rollout
loop stops it once none is left (issue 27).

Revision ID: 0018
Revises: 0017
"""

import sqlalchemy as sa
from alembic import op

revision = "0018"
down_revision = "0017"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("service_replicas") as batch:
        batch.add_column(sa.Column("in_flight", sa.Integer(), nullable=True))
        batch.add_column(sa.Column("in_flight_at", sa.DateTime(timezone=True), nullable=True))
        batch.add_column(sa.Column("in_flight_since", sa.DateTime(timezone=True), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("service_replicas") as batch:
        batch.drop_column("in_flight_since")
        batch.drop_column("in_flight_at")
        batch.drop_column("in_flight")
