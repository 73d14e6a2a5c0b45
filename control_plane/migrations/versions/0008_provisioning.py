"""provision requests and their events

Node agents asked of Slurm profiles (PV-1): at most one outstanding request per profile, which
a partial unique index enforces across replicas.

Revision ID: 0008
Revises: 0007
"""

import sqlalchemy as sa
from alembic import op

revision = "0008"
down_revision = "0007"
branch_labels = None
depends_on = None

OUTSTANDING = sa.text("state IN ('submitting', 'pending')")


def upgrade() -> None:
    op.create_table(
        "provision_requests",
        sa.Column("id", sa.String(length=40), nullable=False),
        sa.Column("provisioner", sa.String(length=63), nullable=False),
        sa.Column("profile", sa.String(length=63), nullable=False),
        sa.Column("state", sa.String(length=16), nullable=False),
        sa.Column("slurm_job_id", sa.String(length=32), nullable=True),
        sa.Column("node_id", sa.String(length=40), nullable=True),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("updated_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("attached_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("ended_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("reason", sa.Text(), nullable=True),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_provision_requests")),
    )
    with op.batch_alter_table("provision_requests", schema=None) as batch_op:
        batch_op.create_index(batch_op.f("ix_provision_requests_state"), ["state"], unique=False)
        batch_op.create_index(
            "uq_provision_requests_outstanding",
            ["provisioner", "profile"],
            unique=True,
            sqlite_where=OUTSTANDING,
            postgresql_where=OUTSTANDING,
        )
    op.create_table(
        "provision_events",
        sa.Column("id", sa.Integer(), autoincrement=True, nullable=False),
        sa.Column("request_id", sa.String(length=40), nullable=False),
        sa.Column("at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("kind", sa.String(length=16), nullable=False),
        sa.Column("data", sa.JSON(), nullable=False),
        sa.ForeignKeyConstraint(
            ["request_id"],
            ["provision_requests.id"],
            name=op.f("fk_provision_events_request_id_provision_requests"),
            ondelete="CASCADE",
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_provision_events")),
    )
    with op.batch_alter_table("provision_events", schema=None) as batch_op:
        batch_op.create_index(
            batch_op.f("ix_provision_events_request_id"), ["request_id"], unique=False
        )


def downgrade() -> None:
    op.drop_table("provision_events")
    op.drop_table("provision_requests")
