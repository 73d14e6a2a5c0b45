"""replicas, revisions, the gateway's access tokens and tunnels

A service runs `replicas` copies (`service_replicas`), each of a revision of it
(`service_revisions`, what a rolling update moves between), may autoscale (`autoscale`), and is
reached at the control plane's gateway with its access tokens (`service_access_tokens`, hashed)
over the tunnels agents hold (`gateway_tunnels`: which control-plane process holds each)
(issue 27).

Revision ID: 0012
Revises: 0011
"""

import sqlalchemy as sa
from alembic import op

revision = "0012"
down_revision = "0011"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("services", schema=None) as batch_op:
        batch_op.add_column(sa.Column("replicas", sa.Integer(), nullable=False, server_default="1"))
        batch_op.add_column(sa.Column("revision", sa.Integer(), nullable=False, server_default="1"))
        batch_op.add_column(sa.Column("autoscale", sa.JSON(), nullable=True))
        batch_op.add_column(sa.Column("rollout", sa.JSON(), nullable=True))
        batch_op.add_column(sa.Column("last_request_at", sa.DateTime(timezone=True), nullable=True))
    op.create_table(
        "service_revisions",
        sa.Column("service_id", sa.String(length=40), nullable=False),
        sa.Column("revision", sa.Integer(), nullable=False),
        sa.Column("spec", sa.JSON(), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.ForeignKeyConstraint(
            ["service_id"],
            ["services.id"],
            name=op.f("fk_service_revisions_service_id_services"),
            ondelete="CASCADE",
        ),
        sa.PrimaryKeyConstraint("service_id", "revision", name=op.f("pk_service_revisions")),
    )
    op.create_table(
        "service_replicas",
        sa.Column("id", sa.String(length=40), nullable=False),
        sa.Column("service_id", sa.String(length=40), nullable=False),
        sa.Column("ordinal", sa.Integer(), nullable=False),
        sa.Column("revision", sa.Integer(), nullable=False),
        sa.Column("state", sa.String(length=16), nullable=False),
        sa.Column("node_id", sa.String(length=40), nullable=True),
        sa.Column("assigned_gpus", sa.JSON(), nullable=True),
        sa.Column("url", sa.String(length=300), nullable=True),
        sa.Column("grpc_url", sa.String(length=300), nullable=True),
        sa.Column("restarts", sa.Integer(), nullable=False),
        sa.Column("last_exit", sa.JSON(), nullable=True),
        sa.Column("log_tail", sa.JSON(), nullable=True),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("updated_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("placed_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("ready_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("stopped_at", sa.DateTime(timezone=True), nullable=True),
        sa.ForeignKeyConstraint(
            ["service_id"],
            ["services.id"],
            name=op.f("fk_service_replicas_service_id_services"),
            ondelete="CASCADE",
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_service_replicas")),
    )
    op.create_index(
        "ix_service_replicas_service", "service_replicas", ["service_id", "ordinal"], unique=False
    )
    op.create_index("ix_service_replicas_state", "service_replicas", ["state"], unique=False)
    op.create_index(
        op.f("ix_service_replicas_node_id"), "service_replicas", ["node_id"], unique=False
    )
    op.create_table(
        "service_access_tokens",
        sa.Column("id", sa.String(length=40), nullable=False),
        sa.Column("service_id", sa.String(length=40), nullable=False),
        sa.Column("name", sa.String(length=100), nullable=False),
        sa.Column("token_hash", sa.String(length=64), nullable=False),
        sa.Column("hint", sa.String(length=16), nullable=False),
        sa.Column("rate_per_second", sa.Float(), nullable=True),
        sa.Column("burst", sa.Integer(), nullable=True),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("created_by", sa.String(length=64), nullable=False),
        sa.Column("last_used_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("revoked_at", sa.DateTime(timezone=True), nullable=True),
        sa.ForeignKeyConstraint(
            ["service_id"],
            ["services.id"],
            name=op.f("fk_service_access_tokens_service_id_services"),
            ondelete="CASCADE",
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_service_access_tokens")),
        sa.UniqueConstraint("token_hash", name=op.f("uq_service_access_tokens_token_hash")),
    )
    op.create_index(
        op.f("ix_service_access_tokens_service_id"),
        "service_access_tokens",
        ["service_id"],
        unique=False,
    )
    op.create_table(
        "gateway_tunnels",
        sa.Column("node_id", sa.String(length=40), nullable=False),
        sa.Column("holder", sa.String(length=64), nullable=False),
        sa.Column("holder_address", sa.String(length=300), nullable=False),
        sa.Column("connected_at", sa.DateTime(timezone=True), nullable=False),
        sa.ForeignKeyConstraint(
            ["node_id"],
            ["nodes.id"],
            name=op.f("fk_gateway_tunnels_node_id_nodes"),
            ondelete="CASCADE",
        ),
        sa.PrimaryKeyConstraint("node_id", name=op.f("pk_gateway_tunnels")),
    )


def downgrade() -> None:
    op.drop_table("gateway_tunnels")
    op.drop_index(op.f("ix_service_access_tokens_service_id"), table_name="service_access_tokens")
    op.drop_table("service_access_tokens")
    op.drop_index(op.f("ix_service_replicas_node_id"), table_name="service_replicas")
    op.drop_index("ix_service_replicas_state", table_name="service_replicas")
    op.drop_index("ix_service_replicas_service", table_name="service_replicas")
    op.drop_table("service_replicas")
    op.drop_table("service_revisions")
    with op.batch_alter_table("services", schema=None) as batch_op:
        batch_op.drop_column("last_request_at")
        batch_op.drop_column("rollout")
        batch_op.drop_column("autoscale")
        batch_op.drop_column("revision")
        batch_op.drop_column("replicas")
