"""Access's request and response bodies: the console's sign-in and its session."""

from __future__ import annotations

from datetime import datetime
from typing import Annotated

from pydantic import BaseModel, SecretStr, StringConstraints

from control_plane.schemas import StrictModel


class SignInRequest(StrictModel):
    # SecretStr: a validation error or a repr() never shows it.
    admin_token: Annotated[SecretStr, StringConstraints(min_length=1, max_length=512)]


class ConsoleSessionInfo(BaseModel):
    """Held by the console in memory only; the session itself is the HttpOnly cookie."""

    csrf_token: str
    expires_at: datetime
