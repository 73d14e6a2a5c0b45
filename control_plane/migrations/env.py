"""Alembic environment: always runs on the connection handed over by `control_plane.db.migrate`."""

from alembic import context

from control_plane.models import Base

connection = context.config.attributes.get("connection")
if connection is None:  # pragma: no cover - only reachable by calling the alembic CLI directly
    raise RuntimeError("run migrations through control_plane.db.migrate(), not the alembic CLI")

context.configure(
    connection=connection,
    target_metadata=Base.metadata,
    render_as_batch=connection.dialect.name == "sqlite",
)
with context.begin_transaction():
    context.run_migrations()
