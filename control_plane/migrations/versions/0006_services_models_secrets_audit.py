"""services, models, secrets and the audit log

Services (WL-5a) hold resources and GPUs on a node while deployed; models (WL-5c) are immutable
name@version entries; secrets (WL-6a) are stored only encrypted; the audit log (AU-1) records
every admin action.

Revision ID: 0006
Revises: 0005
"""

import sqlalchemy as sa
from alembic import op

revision = "0006"
down_revision = "0005"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("jobs", schema=None) as batch_op:
        batch_op.add_column(sa.Column("model", sa.String(length=201), nullable=True))
        batch_op.add_column(sa.Column("secrets", sa.JSON(), nullable=True))
        batch_op.add_column(sa.Column("required_labels", sa.JSON(), nullable=True))
    op.create_table(
        "models",
        sa.Column("id", sa.String(length=40), nullable=False),
        sa.Column("name", sa.String(length=100), nullable=False),
        sa.Column("version", sa.String(length=100), nullable=False),
        sa.Column("runner", sa.String(length=16), nullable=False),
        sa.Column("weights", sa.String(length=71), nullable=False),
        sa.Column("params", sa.JSON(), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_models")),
    )
    with op.batch_alter_table("models", schema=None) as batch_op:
        batch_op.create_index("uq_models_name_version", ["name", "version"], unique=True)
        batch_op.create_index(batch_op.f("ix_models_weights"), ["weights"], unique=False)

    op.create_table(
        "secrets",
        sa.Column("name", sa.String(length=100), nullable=False),
        sa.Column("ciphertext", sa.LargeBinary(), nullable=False),
        sa.Column("key_id", sa.String(length=32), nullable=False),
        sa.Column("labels", sa.JSON(), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("updated_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("name", name=op.f("pk_secrets")),
    )
    op.create_table(
        "services",
        sa.Column("id", sa.String(length=40), nullable=False),
        sa.Column("name", sa.String(length=100), nullable=False),
        sa.Column("state", sa.String(length=16), nullable=False),
        sa.Column("command", sa.JSON(), nullable=True),
        sa.Column("runner", sa.String(length=16), nullable=True),
        sa.Column("weights", sa.String(length=71), nullable=True),
        sa.Column("model", sa.String(length=201), nullable=True),
        sa.Column("params", sa.JSON(), nullable=False),
        sa.Column("env", sa.JSON(), nullable=False),
        sa.Column("secrets", sa.JSON(), nullable=False),
        sa.Column("labels", sa.JSON(), nullable=False),
        sa.Column("worker_policy", sa.String(length=16), nullable=False),
        sa.Column("resources", sa.JSON(), nullable=False),
        sa.Column("health", sa.JSON(), nullable=False),
        sa.Column("restart", sa.JSON(), nullable=False),
        sa.Column("node_id", sa.String(length=40), nullable=True),
        sa.Column("assigned_gpus", sa.JSON(), nullable=True),
        sa.Column("url", sa.String(length=300), nullable=True),
        sa.Column("restarts", sa.Integer(), nullable=False),
        sa.Column("last_exit", sa.JSON(), nullable=True),
        sa.Column("generation", sa.Integer(), nullable=False),
        sa.Column("log_tail", sa.JSON(), nullable=True),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("updated_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("placed_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("stopped_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("next_event_seq", sa.Integer(), nullable=False),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_services")),
    )
    with op.batch_alter_table("services", schema=None) as batch_op:
        batch_op.create_index(batch_op.f("ix_services_node_id"), ["node_id"], unique=False)
        batch_op.create_index("ix_services_state", ["state"], unique=False)

    op.create_table(
        "service_events",
        sa.Column("id", sa.Integer(), autoincrement=True, nullable=False),
        sa.Column("service_id", sa.String(length=40), nullable=False),
        sa.Column("seq", sa.Integer(), nullable=False),
        sa.Column("at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("kind", sa.String(length=16), nullable=False),
        sa.Column("data", sa.JSON(), nullable=False),
        sa.ForeignKeyConstraint(
            ["service_id"],
            ["services.id"],
            name=op.f("fk_service_events_service_id_services"),
            ondelete="CASCADE",
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_service_events")),
    )
    with op.batch_alter_table("service_events", schema=None) as batch_op:
        batch_op.create_index("uq_service_events_service_seq", ["service_id", "seq"], unique=True)

    op.create_table(
        "audit_log",
        sa.Column("id", sa.Integer(), autoincrement=True, nullable=False),
        sa.Column("at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("actor", sa.String(length=64), nullable=False),
        sa.Column("action", sa.String(length=40), nullable=False),
        sa.Column("target", sa.String(length=300), nullable=False),
        sa.Column("outcome", sa.String(length=40), nullable=False),
        sa.Column("detail", sa.JSON(), nullable=False),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_audit_log")),
    )
    with op.batch_alter_table("audit_log", schema=None) as batch_op:
        batch_op.create_index(batch_op.f("ix_audit_log_at"), ["at"], unique=False)
        batch_op.create_index(batch_op.f("ix_audit_log_action"), ["action"], unique=False)


def downgrade() -> None:
    op.drop_table("audit_log")
    op.drop_table("service_events")
    op.drop_table("services")
    op.drop_table("secrets")
    op.drop_table("models")
    with op.batch_alter_table("jobs", schema=None) as batch_op:
        batch_op.drop_column("required_labels")
        batch_op.drop_column("secrets")
        batch_op.drop_column("model")
