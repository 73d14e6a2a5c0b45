"""initial schema

Revision ID: 0001
Revises: (none)
"""

import sqlalchemy as sa
from alembic import op

revision = "0001"
down_revision = None
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "node_enrollments",
        sa.Column("id", sa.String(length=40), nullable=False),
        sa.Column("node_id", sa.String(length=40), nullable=False),
        sa.Column("display_name", sa.String(length=120), nullable=False),
        sa.Column("labels", sa.JSON(), nullable=False),
        sa.Column("token_hash", sa.String(length=64), nullable=False),
        sa.Column("state", sa.String(length=16), nullable=False),
        sa.Column("production_eligible", sa.Boolean(), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("expires_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("claimed_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("revoked_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("claim_nonce_hash", sa.String(length=64), nullable=True),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_node_enrollments")),
        sa.UniqueConstraint("node_id", name=op.f("uq_node_enrollments_node_id")),
        sa.UniqueConstraint("token_hash", name=op.f("uq_node_enrollments_token_hash")),
    )
    op.create_table(
        "signing_keys",
        sa.Column("kid", sa.String(length=64), nullable=False),
        sa.Column("public_key_pem", sa.Text(), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("retired_at", sa.DateTime(timezone=True), nullable=True),
        sa.PrimaryKeyConstraint("kid", name=op.f("pk_signing_keys")),
    )
    op.create_table(
        "nodes",
        sa.Column("id", sa.String(length=40), nullable=False),
        sa.Column("enrollment_id", sa.String(length=40), nullable=False),
        sa.Column("display_name", sa.String(length=120), nullable=False),
        sa.Column("hostname", sa.String(length=255), nullable=False),
        sa.Column("labels", sa.JSON(), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("recorded_state", sa.String(length=16), nullable=False),
        sa.Column("last_heartbeat_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("agent_version", sa.String(length=64), nullable=True),
        sa.Column("protocol_version", sa.Integer(), nullable=True),
        sa.Column("health", sa.JSON(), nullable=True),
        sa.Column("inventory", sa.JSON(), nullable=True),
        sa.Column("inventory_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("telemetry", sa.JSON(), nullable=True),
        sa.Column("telemetry_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("fingerprint_hash", sa.String(length=64), nullable=True),
        sa.Column("compat_code", sa.String(length=16), nullable=True),
        sa.Column("compat_component", sa.String(length=32), nullable=True),
        sa.Column("compat_detail", sa.Text(), nullable=True),
        sa.Column("compat_at", sa.DateTime(timezone=True), nullable=True),
        sa.ForeignKeyConstraint(
            ["enrollment_id"],
            ["node_enrollments.id"],
            name=op.f("fk_nodes_enrollment_id_node_enrollments"),
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_nodes")),
    )
    with op.batch_alter_table("nodes", schema=None) as batch_op:
        batch_op.create_index(
            batch_op.f("ix_nodes_fingerprint_hash"), ["fingerprint_hash"], unique=False
        )

    op.create_table(
        "node_credentials",
        sa.Column("jti", sa.String(length=64), nullable=False),
        sa.Column("node_id", sa.String(length=40), nullable=False),
        sa.Column("kid", sa.String(length=64), nullable=False),
        sa.Column("issued_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("revoked_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("revoked_reason", sa.String(length=200), nullable=True),
        sa.ForeignKeyConstraint(
            ["node_id"],
            ["nodes.id"],
            name=op.f("fk_node_credentials_node_id_nodes"),
            ondelete="CASCADE",
        ),
        sa.PrimaryKeyConstraint("jti", name=op.f("pk_node_credentials")),
    )
    with op.batch_alter_table("node_credentials", schema=None) as batch_op:
        batch_op.create_index(batch_op.f("ix_node_credentials_node_id"), ["node_id"], unique=False)
        batch_op.create_index(
            batch_op.f("ix_node_credentials_revoked_at"), ["revoked_at"], unique=False
        )
        batch_op.create_index(
            "uq_node_credentials_active_node",
            ["node_id"],
            unique=True,
            sqlite_where=sa.text("revoked_at IS NULL"),
            postgresql_where=sa.text("revoked_at IS NULL"),
        )

    op.create_table(
        "node_events",
        sa.Column("id", sa.Integer(), autoincrement=True, nullable=False),
        sa.Column("node_id", sa.String(length=40), nullable=False),
        sa.Column("at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("kind", sa.String(length=32), nullable=False),
        sa.Column("from_state", sa.String(length=16), nullable=True),
        sa.Column("to_state", sa.String(length=16), nullable=True),
        sa.Column("reason", sa.Text(), nullable=False),
        sa.ForeignKeyConstraint(
            ["node_id"], ["nodes.id"], name=op.f("fk_node_events_node_id_nodes"), ondelete="CASCADE"
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_node_events")),
    )
    with op.batch_alter_table("node_events", schema=None) as batch_op:
        batch_op.create_index(batch_op.f("ix_node_events_node_id"), ["node_id"], unique=False)

    op.create_table(
        "telemetry_samples",
        sa.Column("id", sa.Integer(), autoincrement=True, nullable=False),
        sa.Column("node_id", sa.String(length=40), nullable=False),
        sa.Column("at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("sample", sa.JSON(), nullable=False),
        sa.ForeignKeyConstraint(
            ["node_id"],
            ["nodes.id"],
            name=op.f("fk_telemetry_samples_node_id_nodes"),
            ondelete="CASCADE",
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_telemetry_samples")),
    )
    with op.batch_alter_table("telemetry_samples", schema=None) as batch_op:
        batch_op.create_index(batch_op.f("ix_telemetry_samples_at"), ["at"], unique=False)
        batch_op.create_index("ix_telemetry_samples_node_at", ["node_id", "at"], unique=False)


def downgrade() -> None:
    with op.batch_alter_table("telemetry_samples", schema=None) as batch_op:
        batch_op.drop_index("ix_telemetry_samples_node_at")
        batch_op.drop_index(batch_op.f("ix_telemetry_samples_at"))

    op.drop_table("telemetry_samples")
    with op.batch_alter_table("node_events", schema=None) as batch_op:
        batch_op.drop_index(batch_op.f("ix_node_events_node_id"))

    op.drop_table("node_events")
    with op.batch_alter_table("node_credentials", schema=None) as batch_op:
        batch_op.drop_index(
            "uq_node_credentials_active_node",
            sqlite_where=sa.text("revoked_at IS NULL"),
            postgresql_where=sa.text("revoked_at IS NULL"),
        )
        batch_op.drop_index(batch_op.f("ix_node_credentials_revoked_at"))
        batch_op.drop_index(batch_op.f("ix_node_credentials_node_id"))

    op.drop_table("node_credentials")
    with op.batch_alter_table("nodes", schema=None) as batch_op:
        batch_op.drop_index(batch_op.f("ix_nodes_fingerprint_hash"))

    op.drop_table("nodes")
    op.drop_table("signing_keys")
    op.drop_table("node_enrollments")
