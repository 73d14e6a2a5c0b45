"""an LLM service's aliases

The OpenAI API's `model` names an LLM service by its name or by one of its aliases (issue 43),
as clients that hard-code a model name expect. An alias is held by one service at a time (its
primary key) until that service is undeployed or changes its aliases.

Revision ID: 0023
Revises: 0022
"""

import sqlalchemy as sa
from alembic import op

revision = "0023"
down_revision = "0022"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "model_aliases",
        sa.Column("alias", sa.String(length=100), nullable=False),
        sa.Column("service_id", sa.String(length=40), nullable=False),
        sa.ForeignKeyConstraint(
            ["service_id"],
            ["services.id"],
            name=op.f("fk_model_aliases_service_id_services"),
            ondelete="CASCADE",
        ),
        sa.PrimaryKeyConstraint("alias", name=op.f("pk_model_aliases")),
    )
    op.create_index(op.f("ix_model_aliases_service_id"), "model_aliases", ["service_id"])


def downgrade() -> None:
    op.drop_index(op.f("ix_model_aliases_service_id"), table_name="model_aliases")
    op.drop_table("model_aliases")
