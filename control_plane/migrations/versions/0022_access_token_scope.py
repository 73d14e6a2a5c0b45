"""API keys that open several services, or every LLM service

An access token so far opened its one service (issue 27). An API key of the OpenAI API may open
several named services or every LLM service (issue 43): `scope` says which (`service`, its own
as before; `services`, those linked in `access_token_services`; `llm`, every LLM service), and
such a key belongs to no one service (`service_id` null). Existing tokens keep scope `service`.

Revision ID: 0022
Revises: 0021
"""

import sqlalchemy as sa
from alembic import op

revision = "0022"
down_revision = "0021"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("service_access_tokens") as batch:
        batch.alter_column("service_id", existing_type=sa.String(length=40), nullable=True)
        batch.add_column(
            sa.Column("scope", sa.String(length=16), nullable=False, server_default="service")
        )
    op.create_table(
        "access_token_services",
        sa.Column("token_id", sa.String(length=40), nullable=False),
        sa.Column("service_id", sa.String(length=40), nullable=False),
        sa.ForeignKeyConstraint(
            ["token_id"],
            ["service_access_tokens.id"],
            name=op.f("fk_access_token_services_token_id_service_access_tokens"),
            ondelete="CASCADE",
        ),
        sa.ForeignKeyConstraint(
            ["service_id"],
            ["services.id"],
            name=op.f("fk_access_token_services_service_id_services"),
            ondelete="CASCADE",
        ),
        sa.PrimaryKeyConstraint("token_id", "service_id", name=op.f("pk_access_token_services")),
    )


def downgrade() -> None:
    op.drop_table("access_token_services")
    op.execute("DELETE FROM service_access_tokens WHERE service_id IS NULL")
    with op.batch_alter_table("service_access_tokens") as batch:
        batch.drop_column("scope")
        batch.alter_column("service_id", existing_type=sa.String(length=40), nullable=False)
