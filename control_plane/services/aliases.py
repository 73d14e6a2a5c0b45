"""An LLM service's aliases (issue 43; docs/llm.md, Aliases): other names the OpenAI API's
`model` may give it, as clients that hard-code a model name (`gpt-4o-mini`) expect.

An alias is a service name's shape and is held by one deployed service at a time: by no other
service's name and by no other service's alias (the table's primary key settles two claims at
once). Undeploying a service frees its aliases; `claim` replaces a service's aliases, with no
rollout (they change where calls go, not what runs). Only LLM services have them.
"""

from __future__ import annotations

from collections.abc import Iterable

from sqlalchemy import delete, select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from control_plane.errors import Conflict, InvalidRequest
from control_plane.models import ModelAlias, Service
from control_plane.services.schemas import LLM_RUNNERS

#: Aliases one service may have.
MAX_ALIASES = 8


def claim(session: Session, service: Service, names: Iterable[str]) -> list[str]:
    """Make `names` the service's aliases (replacing those it had); the aliases now. Refused
    (nothing changed) for a service that is not an LLM's, an alias that is its own name, or
    one another deployed service holds as its name or alias."""
    wanted = list(dict.fromkeys(names))
    if wanted and service.runner not in LLM_RUNNERS:
        raise InvalidRequest(
            "Only an LLM service (runner llama.cpp) has aliases: they are names of the OpenAI "
            "API's models.",
            "Leave aliases out for this service.",
            code="ALIASES_NOT_FOR_THIS_RUNNER",
        )
    if service.name in wanted:
        raise InvalidRequest(
            f"The alias {service.name} is the service's own name.",
            "Give aliases other than the service's name.",
            code="INVALID_ALIAS",
        )
    session.execute(
        delete(ModelAlias)
        .where(ModelAlias.service_id == service.id)
        .execution_options(synchronize_session=False)
    )
    for name in wanted:
        named = session.scalar(
            select(Service.id).where(Service.name == name, Service.state != "stopped").limit(1)
        )
        if named is not None:
            raise _taken(name, named)
        try:
            with session.begin_nested():
                session.add(ModelAlias(alias=name, service_id=service.id))
        except IntegrityError:
            raise _taken(name, holder_of(session, name)) from None
    session.flush()
    return wanted


def release(session: Session, service: Service) -> None:
    """The service's aliases are free again (it was undeployed)."""
    session.execute(
        delete(ModelAlias)
        .where(ModelAlias.service_id == service.id)
        .execution_options(synchronize_session=False)
    )


def holder_of(session: Session, alias: str) -> str | None:
    """The id of the service holding `alias`, if one does."""
    return session.scalar(select(ModelAlias.service_id).where(ModelAlias.alias == alias))


def by_service(session: Session, service_ids: Iterable[str]) -> dict[str, list[str]]:
    """Each service's aliases, sorted (services without any: absent)."""
    ids = sorted(set(service_ids))
    held: dict[str, list[str]] = {}
    if ids:
        for alias, service_id in session.execute(
            select(ModelAlias.alias, ModelAlias.service_id)
            .where(ModelAlias.service_id.in_(ids))
            .order_by(ModelAlias.alias)
        ):
            held.setdefault(service_id, []).append(alias)
    return held


def _taken(name: str, holder: str | None) -> Conflict:
    which = f"service {holder}" if holder else "another service"
    return Conflict(
        f"The model name {name} is taken by {which} (its name or one of its aliases): a call's "
        "model must name one service.",
        f"Choose another alias, or take it from {which} first (PATCH its aliases, or undeploy it).",
        code="MODEL_NAME_TAKEN",
    )
