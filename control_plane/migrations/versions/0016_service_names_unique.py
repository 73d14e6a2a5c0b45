"""one deployed service per name

The gateway reaches a service by its name (`/v2/models/{name}`, `/services/{name}/...`), so no
two services that are not `stopped` may share one: a partial unique index on `services.name`
where `state != 'stopped'` (deploy refuses a name in use with 409 `SERVICE_NAME_TAKEN`; the
index makes two deploys at once agree). Before it, duplicates could be deployed: of each set,
the one the gateway routed to (the greatest id) keeps the name and the others are renamed
`<name>-<id>`, each with a `renamed` event saying so.

Revision ID: 0016
Revises: 0015
"""

from datetime import UTC, datetime

import sqlalchemy as sa
from alembic import op

revision = "0016"
down_revision = "0015"
branch_labels = None
depends_on = None

_DEPLOYED = sa.text("state != 'stopped'")
_NAME_LENGTH = 100

_services = sa.table(
    "services",
    sa.column("id", sa.String),
    sa.column("name", sa.String),
    sa.column("state", sa.String),
    sa.column("next_event_seq", sa.Integer),
)
_events = sa.table(
    "service_events",
    sa.column("service_id", sa.String),
    sa.column("seq", sa.Integer),
    sa.column("at", sa.DateTime(timezone=True)),
    sa.column("kind", sa.String),
    sa.column("data", sa.JSON),
    sa.column("replica_id", sa.String),
)


def upgrade() -> None:
    _rename_duplicates()
    with op.batch_alter_table("services", schema=None) as batch_op:
        batch_op.create_index(
            "uq_services_deployed_name",
            ["name"],
            unique=True,
            sqlite_where=_DEPLOYED,
            postgresql_where=_DEPLOYED,
        )


def _rename_duplicates() -> None:
    conn = op.get_bind()
    rows = conn.execute(
        sa.select(_services.c.id, _services.c.name, _services.c.next_event_seq)
        .where(_services.c.state != "stopped")
        .order_by(_services.c.name, _services.c.id.desc())
    ).all()
    now = datetime.now(UTC)
    kept: set[str] = set()
    for service_id, name, seq in rows:
        if name not in kept:
            kept.add(name)
            continue
        renamed = f"{name[: _NAME_LENGTH - len(service_id) - 1]}-{service_id}"
        conn.execute(
            sa.update(_services)
            .where(_services.c.id == service_id)
            .values(name=renamed, next_event_seq=seq + 1)
        )
        conn.execute(
            sa.insert(_events).values(
                service_id=service_id,
                seq=seq,
                at=now,
                kind="renamed",
                data={
                    "from": name,
                    "to": renamed,
                    "reason": "another deployed service has this name (migration 0016)",
                },
                replica_id=None,
            )
        )


def downgrade() -> None:
    # Renamed services keep their new names.
    with op.batch_alter_table("services", schema=None) as batch_op:
        batch_op.drop_index("uq_services_deployed_name")
