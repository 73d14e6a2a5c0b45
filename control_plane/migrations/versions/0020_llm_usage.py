"""the tokens of the OpenAI API's calls, per access token, service and minute

The gateway counts each OpenAI call's prompt and completion tokens as the engine reported them
(issue 43); each control-plane process adds its calls to the minute's row, and `GET
/api/v1/services/{id}/usage` sums the rows over a window.

Revision ID: 0020
Revises: 0019
"""

import sqlalchemy as sa
from alembic import op

revision = "0020"
down_revision = "0019"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "llm_usage",
        sa.Column("token_id", sa.String(length=40), nullable=False),
        sa.Column("service_id", sa.String(length=40), nullable=False),
        sa.Column("minute", sa.DateTime(timezone=True), nullable=False),
        sa.Column("requests", sa.Integer(), nullable=False),
        sa.Column("prompt_tokens", sa.BigInteger(), nullable=False),
        sa.Column("completion_tokens", sa.BigInteger(), nullable=False),
        sa.ForeignKeyConstraint(
            ["token_id"],
            ["service_access_tokens.id"],
            name=op.f("fk_llm_usage_token_id_service_access_tokens"),
            ondelete="CASCADE",
        ),
        sa.ForeignKeyConstraint(
            ["service_id"],
            ["services.id"],
            name=op.f("fk_llm_usage_service_id_services"),
            ondelete="CASCADE",
        ),
        sa.PrimaryKeyConstraint("token_id", "service_id", "minute", name=op.f("pk_llm_usage")),
    )


def downgrade() -> None:
    op.drop_table("llm_usage")
