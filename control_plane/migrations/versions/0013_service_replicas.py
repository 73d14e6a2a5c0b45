"""services run as replicas: each deployed service's placement becomes its replica 0

Every service gets its revision 1 (`service_revisions`) from its columns, and every service not
undeployed gets replica 0 (`service_replicas`) holding what the service held: its state, node,
GPUs, URLs, restarts, last exit and output. From here on a service's placement is its replicas'
and `services.node_id` and the columns beside it are no longer read. Service events name the
replica they happened to (`service_events.replica_id`) (issue 27).

Revision ID: 0013
Revises: 0012
"""

import secrets
from datetime import UTC, datetime

import sqlalchemy as sa
from alembic import op

revision = "0013"
down_revision = "0012"
branch_labels = None
depends_on = None

#: The fields a replica is started from, as `control_plane.services.replicas.REVISION_FIELDS`.
_SPEC_FIELDS = (
    "command",
    "runner",
    "weights",
    "model",
    "params",
    "env",
    "secrets",
    "labels",
    "worker_policy",
    "resources",
    "health",
    "restart",
)
_TEXT = ("runner", "weights", "model", "worker_policy")
_PLACED = ("starting", "healthy", "unhealthy", "restarting", "failed")

_services = sa.table(
    "services",
    *(sa.column(name, sa.String() if name in _TEXT else sa.JSON()) for name in _SPEC_FIELDS),
    sa.column("id", sa.String()),
    sa.column("state", sa.String()),
    sa.column("node_id", sa.String()),
    sa.column("assigned_gpus", sa.JSON()),
    sa.column("url", sa.String()),
    sa.column("grpc_url", sa.String()),
    sa.column("restarts", sa.Integer()),
    sa.column("last_exit", sa.JSON()),
    sa.column("log_tail", sa.JSON()),
    sa.column("created_at", sa.DateTime(timezone=True)),
    sa.column("updated_at", sa.DateTime(timezone=True)),
    sa.column("placed_at", sa.DateTime(timezone=True)),
)
_revisions = sa.table(
    "service_revisions",
    sa.column("service_id", sa.String()),
    sa.column("revision", sa.Integer()),
    sa.column("spec", sa.JSON()),
    sa.column("created_at", sa.DateTime(timezone=True)),
)
_replicas = sa.table(
    "service_replicas",
    sa.column("id", sa.String()),
    sa.column("service_id", sa.String()),
    sa.column("ordinal", sa.Integer()),
    sa.column("revision", sa.Integer()),
    sa.column("state", sa.String()),
    sa.column("node_id", sa.String()),
    sa.column("assigned_gpus", sa.JSON()),
    sa.column("url", sa.String()),
    sa.column("grpc_url", sa.String()),
    sa.column("restarts", sa.Integer()),
    sa.column("last_exit", sa.JSON()),
    sa.column("log_tail", sa.JSON()),
    sa.column("created_at", sa.DateTime(timezone=True)),
    sa.column("updated_at", sa.DateTime(timezone=True)),
    sa.column("placed_at", sa.DateTime(timezone=True)),
    sa.column("ready_at", sa.DateTime(timezone=True)),
)


def upgrade() -> None:
    with op.batch_alter_table("service_events", schema=None) as batch_op:
        batch_op.add_column(sa.Column("replica_id", sa.String(length=40), nullable=True))
    connection = op.get_bind()
    now = datetime.now(UTC)
    have = {row[0] for row in connection.execute(sa.select(_revisions.c.service_id))}
    for row in connection.execute(sa.select(_services)).mappings().all():
        if row["id"] not in have:
            connection.execute(
                _revisions.insert().values(
                    service_id=row["id"],
                    revision=1,
                    spec={name: row[name] for name in _SPEC_FIELDS},
                    created_at=row["created_at"] or now,
                )
            )
        if row["state"] == "stopped":
            continue
        placed = row["state"] in _PLACED and row["node_id"] is not None
        updated = row["updated_at"] or now
        connection.execute(
            _replicas.insert().values(
                id=f"rep_{secrets.token_hex(10)}",
                service_id=row["id"],
                ordinal=0,
                revision=1,
                state=row["state"] if placed else "pending",
                node_id=row["node_id"] if placed else None,
                assigned_gpus=row["assigned_gpus"] if placed else None,
                url=row["url"] if placed else None,
                grpc_url=row["grpc_url"] if placed else None,
                restarts=row["restarts"] or 0,
                last_exit=row["last_exit"],
                log_tail=row["log_tail"],
                created_at=row["created_at"] or now,
                updated_at=updated,
                placed_at=row["placed_at"] if placed else None,
                # Healthy now: warm already; the gateway may send it requests at once.
                ready_at=updated if placed and row["state"] == "healthy" else None,
            )
        )
        if not placed and row["state"] != "pending":
            connection.execute(
                _services.update().where(_services.c.id == row["id"]).values(state="pending")
            )


def downgrade() -> None:
    # The replicas' rows stay (0012 drops them); only the events' column goes.
    with op.batch_alter_table("service_events", schema=None) as batch_op:
        batch_op.drop_column("replica_id")
