"""a service's placement lives on its replicas only

Migration 0013 copied each service's placement (node, GPUs, URLs, last exit, output, when it
was placed) into its first replica; since then nothing reads those columns of `services`, so
they go. `restarts` stays: the sum over the service's replicas.

Revision ID: 0015
Revises: 0014
"""

import sqlalchemy as sa
from alembic import op

revision = "0015"
down_revision = "0014"
branch_labels = None
depends_on = None

_GONE = ("node_id", "assigned_gpus", "url", "grpc_url", "last_exit", "log_tail", "placed_at")


def upgrade() -> None:
    op.drop_index("ix_services_node_id", table_name="services")
    with op.batch_alter_table("services", schema=None) as batch_op:
        for column in _GONE:
            batch_op.drop_column(column)


def downgrade() -> None:
    # The columns come back empty: the replicas hold the placement.
    with op.batch_alter_table("services", schema=None) as batch_op:
        batch_op.add_column(sa.Column("node_id", sa.String(length=40), nullable=True))
        batch_op.add_column(sa.Column("assigned_gpus", sa.JSON(), nullable=True))
        batch_op.add_column(sa.Column("url", sa.String(length=300), nullable=True))
        batch_op.add_column(sa.Column("grpc_url", sa.String(length=300), nullable=True))
        batch_op.add_column(sa.Column("last_exit", sa.JSON(), nullable=True))
        batch_op.add_column(sa.Column("log_tail", sa.JSON(), nullable=True))
        batch_op.add_column(sa.Column("placed_at", sa.DateTime(timezone=True), nullable=True))
    op.create_index("ix_services_node_id", "services", ["node_id"], unique=False)
