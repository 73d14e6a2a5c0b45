"""the gateway's peer key: what control-plane replicas sign their requests to one another with

A gateway on one replica forwards a request for a node whose tunnel another replica holds to
that replica's internal route, signed with this key (`gateway/peers.py`) (issue 27).

Revision ID: 0014
Revises: 0013
"""

import sqlalchemy as sa
from alembic import op

revision = "0014"
down_revision = "0013"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "gateway_peer_keys",
        sa.Column("name", sa.String(length=40), nullable=False),
        sa.Column("key", sa.String(length=200), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("name", name=op.f("pk_gateway_peer_keys")),
    )


def downgrade() -> None:
    op.drop_table("gateway_peer_keys")
