"""Secrets (WL-6a) for users (admin token or console session): set (write-only), list, delete,
and rotate the encryption key. No route here ever returns a secret's value."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Path, status

from control_plane.access.roles import Area
from control_plane.api.deps import AuditDep, ContextDep, SessionDep, needs
from control_plane.api.routing import LaneRoute
from control_plane.vault import vault
from control_plane.vault.schemas import SecretPublic, SecretPut

router = APIRouter(
    prefix="/api/v1/admin/secrets",
    tags=["secrets"],
    dependencies=[needs(Area.WORK)],
    route_class=LaneRoute,
)

SecretNamePath = Annotated[str, Path(pattern=r"^[A-Z_][A-Z0-9_]{0,99}$")]


@router.put("/{name}", response_model=SecretPublic)
def put_secret(
    name: SecretNamePath, body: SecretPut, ctx: ContextDep, session: SessionDep, audit: AuditDep
) -> SecretPublic:
    """Set a secret's value (write-only: no API returns it) and the labels a node's signed
    credential must carry to receive it."""
    audit("secret.set", name, labels=body.labels)
    row = vault.put_secret(
        session=session, clock=ctx.clock, vault=ctx.vault, name=name, request=body
    )
    return vault.secret_public(row)


@router.get("", response_model=list[SecretPublic])
def list_secrets(session: SessionDep) -> list[SecretPublic]:
    return [vault.secret_public(row) for row in vault.list_secrets(session=session)]


@router.delete("/{name}", status_code=status.HTTP_204_NO_CONTENT)
def delete_secret(name: SecretNamePath, session: SessionDep, audit: AuditDep) -> None:
    audit("secret.delete", name)
    vault.delete_secret(session=session, name=name)


@router.post("/rotate-key", dependencies=[needs(Area.PEOPLE)])
def rotate_secret_key(ctx: ContextDep, session: SessionDep, audit: AuditDep) -> dict[str, object]:
    """A new encryption key; every secret re-encrypted with it in one transaction. The old key
    file stays in `<data dir>/secret-keys/` until you delete it."""
    audit("secret.rotate_key", "secret key")
    key_id, count = ctx.vault.rotate(session)
    audit.detail = {"key_id": key_id, "secrets": count}
    return {"key_id": key_id, "reencrypted": count}
