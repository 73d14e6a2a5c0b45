"""an access token's tokens_per_minute; a replica's engine load

An API key may be limited in the LLM tokens (prompt and completion) its OpenAI calls use per
minute (issue 43); past it the gateway answers 429 with Retry-After. Existing tokens have no
such limit. An LLM replica's engine reports its own load (requests generating and waiting), as
its agent last read it; none for the others.

Revision ID: 0021
Revises: 0020
"""

import sqlalchemy as sa
from alembic import op

revision = "0021"
down_revision = "0020"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("service_access_tokens") as batch:
        batch.add_column(sa.Column("tokens_per_minute", sa.Integer(), nullable=True))
    with op.batch_alter_table("service_replicas") as batch:
        batch.add_column(sa.Column("engine", sa.JSON(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("service_replicas") as batch:
        batch.drop_column("engine")
    with op.batch_alter_table("service_access_tokens") as batch:
        batch.drop_column("tokens_per_minute")
