"""the gateway's requests in flight, shared by the control-plane processes

Each control-plane process's gateway counts the requests in flight to each service in memory;
with several processes behind a load balancer, each saw only its share, and the autoscaler of a
process that received few requests wished the service smaller while another's wished it larger.
Each process now writes its counts of autoscaled services here once a round
(`services/autoscale.py`), and every process sizes a service from the sum of the fresh rows
(issue 27).

Revision ID: 0017
Revises: 0016
"""

import sqlalchemy as sa
from alembic import op

revision = "0017"
down_revision = "0016"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "gateway_traffic",
        sa.Column("process", sa.String(length=64), nullable=False),
        sa.Column("service_id", sa.String(length=40), nullable=False),
        sa.Column("in_flight", sa.Integer(), nullable=False),
        sa.Column("reported_at", sa.DateTime(timezone=True), nullable=False),
        sa.ForeignKeyConstraint(
            ["service_id"],
            ["services.id"],
            name=op.f("fk_gateway_traffic_service_id_services"),
            ondelete="CASCADE",
        ),
        sa.PrimaryKeyConstraint("process", "service_id", name=op.f("pk_gateway_traffic")),
    )


def downgrade() -> None:
    op.drop_table("gateway_traffic")
