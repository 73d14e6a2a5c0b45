"""a service's gRPC address

The `onnx` runner serves the Open Inference Protocol's gRPC API on a second port (issue 26); the
service view shows where, beside its HTTP `url`.

Revision ID: 0009
Revises: 0008
"""

import sqlalchemy as sa
from alembic import op

revision = "0009"
down_revision = "0008"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("services", schema=None) as batch_op:
        batch_op.add_column(sa.Column("grpc_url", sa.String(length=300), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("services", schema=None) as batch_op:
        batch_op.drop_column("grpc_url")
