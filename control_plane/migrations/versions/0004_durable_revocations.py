"""durable credential revocations, artifact uploaders

A deleted node's credentials stay behind, revoked, instead of going with the node by cascade:
another replica's revocation refresh reads revoked rows, and a row that vanished is never seen.
Which node uploaded which artifact is recorded: a node may download what it uploaded.

Revision ID: 0004
Revises: 0003
"""

from collections.abc import Iterator
from contextlib import contextmanager

import sqlalchemy as sa
from alembic import op
from alembic.operations import BatchOperations

revision = "0004"
down_revision = "0003"
branch_labels = None
depends_on = None

_ACTIVE_WHERE = sa.text("revoked_at IS NULL")


@contextmanager
def _node_credentials_without_active_index() -> Iterator[BatchOperations]:
    """Alter node_credentials in batch mode with its partial unique index set aside: SQLite
    rebuilds the table in batch mode, so the index is dropped before and created again after,
    each in a batch of its own, for its WHERE clause to survive the copy."""
    with op.batch_alter_table("node_credentials", schema=None) as batch_op:
        batch_op.drop_index(
            "uq_node_credentials_active_node",
            sqlite_where=_ACTIVE_WHERE,
            postgresql_where=_ACTIVE_WHERE,
        )
    with op.batch_alter_table("node_credentials", schema=None) as batch_op:
        yield batch_op
    with op.batch_alter_table("node_credentials", schema=None) as batch_op:
        batch_op.create_index(
            "uq_node_credentials_active_node",
            ["node_id"],
            unique=True,
            sqlite_where=_ACTIVE_WHERE,
            postgresql_where=_ACTIVE_WHERE,
        )


def upgrade() -> None:
    with _node_credentials_without_active_index() as batch_op:
        batch_op.drop_constraint("fk_node_credentials_node_id_nodes", type_="foreignkey")

    op.create_table(
        "artifact_uploads",
        sa.Column("digest", sa.String(length=71), nullable=False),
        sa.Column("node_id", sa.String(length=40), nullable=False),
        sa.Column("uploaded_at", sa.DateTime(timezone=True), nullable=False),
        sa.ForeignKeyConstraint(
            ["digest"],
            ["artifacts.digest"],
            name=op.f("fk_artifact_uploads_digest_artifacts"),
            ondelete="CASCADE",
        ),
        sa.PrimaryKeyConstraint("digest", "node_id", name=op.f("pk_artifact_uploads")),
    )


def downgrade() -> None:
    op.drop_table("artifact_uploads")
    # Credentials of nodes that no longer exist cannot be tied to a node again.
    op.execute("DELETE FROM node_credentials WHERE node_id NOT IN (SELECT id FROM nodes)")
    with _node_credentials_without_active_index() as batch_op:
        batch_op.create_foreign_key(
            "fk_node_credentials_node_id_nodes", "nodes", ["node_id"], ["id"], ondelete="CASCADE"
        )
