"""Settings errors as an operator reads them: one line per problem, naming the environment
variable they set (or must set), never echoing its value — a value may be a secret."""

from __future__ import annotations

from pydantic import ValidationError
from pydantic_settings import BaseSettings


def variable_name(settings: type[BaseSettings], field: str) -> str:
    """The environment variable behind `field` of `settings` (its alias, or prefix + name)."""
    info = settings.model_fields.get(field)
    if info is None:
        return field.upper()  # already an alias: the variable's own name
    alias = info.validation_alias or info.alias
    if isinstance(alias, str):
        return alias.upper()
    prefix = str(settings.model_config.get("env_prefix") or "")
    return f"{prefix}{field}".upper()


def describe_validation_error(error: ValidationError, settings: type[BaseSettings]) -> str:
    """One readable line per problem in `error`, raised while loading `settings`."""
    lines = []
    for item in error.errors():
        loc = [str(part) for part in item["loc"] if part != "__root__"]
        message = str(item["msg"]).removeprefix("Value error, ")
        if item["type"] == "missing":
            message = "is required"
        if not loc:
            lines.append(message)
            continue
        name = variable_name(settings, loc[0])
        lines.append(f"{'.'.join([name, *loc[1:]])}: {message}")
    return "\n".join(lines)
