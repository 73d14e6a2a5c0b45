"""per-GPU health, its timeline, and jobs pinned to one GPU

Each GPU a node's agent reports gets a row: its state as the scheduler reads it, what the
rules made of the agent's reports, an operator's quarantine and the active check running on it;
`gpu_health_events` is its timeline. A job may be pinned to one node's GPU: a GPU's active
check (issue 28).

Revision ID: 0011
Revises: 0010
"""

import sqlalchemy as sa
from alembic import op

revision = "0011"
down_revision = "0010"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "gpu_health",
        sa.Column("node_id", sa.String(length=40), nullable=False),
        sa.Column("uuid", sa.String(length=96), nullable=False),
        sa.Column("index", sa.Integer(), nullable=False),
        sa.Column("state", sa.String(length=16), nullable=False),
        sa.Column("rules_state", sa.String(length=16), nullable=False),
        sa.Column("reported", sa.String(length=16), nullable=False),
        sa.Column("reason", sa.Text(), nullable=False),
        sa.Column("evidence", sa.JSON(), nullable=False),
        sa.Column("since", sa.DateTime(timezone=True), nullable=False),
        sa.Column("reported_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("quarantine_reason", sa.Text(), nullable=True),
        sa.Column("quarantined_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("check_job_id", sa.String(length=40), nullable=True),
        sa.ForeignKeyConstraint(
            ["node_id"],
            ["nodes.id"],
            name=op.f("fk_gpu_health_node_id_nodes"),
            ondelete="CASCADE",
        ),
        sa.PrimaryKeyConstraint("node_id", "uuid", name=op.f("pk_gpu_health")),
    )
    op.create_index("ix_gpu_health_state", "gpu_health", ["state"], unique=False)
    op.create_table(
        "gpu_health_events",
        sa.Column("id", sa.Integer(), autoincrement=True, nullable=False),
        sa.Column("node_id", sa.String(length=40), nullable=False),
        sa.Column("uuid", sa.String(length=96), nullable=False),
        sa.Column("at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("kind", sa.String(length=16), nullable=False),
        sa.Column("from_state", sa.String(length=16), nullable=True),
        sa.Column("to_state", sa.String(length=16), nullable=True),
        sa.Column("reason", sa.Text(), nullable=False),
        sa.Column("evidence", sa.JSON(), nullable=True),
        sa.Column("actor", sa.String(length=64), nullable=False),
        sa.ForeignKeyConstraint(
            ["node_id"],
            ["nodes.id"],
            name=op.f("fk_gpu_health_events_node_id_nodes"),
            ondelete="CASCADE",
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_gpu_health_events")),
    )
    op.create_index(
        "ix_gpu_health_events_node_uuid",
        "gpu_health_events",
        ["node_id", "uuid", "id"],
        unique=False,
    )
    with op.batch_alter_table("jobs", schema=None) as batch_op:
        batch_op.add_column(sa.Column("pinned", sa.JSON(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("jobs", schema=None) as batch_op:
        batch_op.drop_column("pinned")
    op.drop_index("ix_gpu_health_events_node_uuid", table_name="gpu_health_events")
    op.drop_table("gpu_health_events")
    op.drop_index("ix_gpu_health_state", table_name="gpu_health")
    op.drop_table("gpu_health")
