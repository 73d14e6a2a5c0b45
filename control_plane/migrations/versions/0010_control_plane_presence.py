"""the control plane's last moment alive

One row, moved forward every few seconds by each running replica and once more at shutdown: at
the next start, where the control plane's downtime began, so that only nodes whose deadline had
not yet expired then get a full timeout to come back (`liveness.ContactGrace`, issue 24).

Revision ID: 0010
Revises: 0009
"""

import sqlalchemy as sa
from alembic import op

revision = "0010"
down_revision = "0009"
branch_labels = None
depends_on = None


def upgrade() -> None:
    # Empty until the first start marks it: that start falls back on the newest heartbeat a
    # node sent (`liveness.last_alive`).
    op.create_table(
        "control_plane_presence",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("alive_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_control_plane_presence")),
    )


def downgrade() -> None:
    op.drop_table("control_plane_presence")
