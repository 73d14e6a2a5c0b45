"""The metrics token (`MODELFORGE_METRICS_TOKEN`): it opens `GET /metrics` and nothing else.

Never logged or echoed; compared by digest, and not throttled like the admin token (a
Prometheus server with an old token would otherwise lock its address out of the console)."""

from __future__ import annotations

import hmac

from pydantic import SecretStr

from control_plane.errors import AdminAuthError
from control_plane.security import sha256_hex


def check_presented(*, presented: str, configured: SecretStr | None) -> None:
    """`METRICS_TOKEN_INVALID` unless `presented` is the configured metrics token."""
    # Digests of both sides: equal lengths, so the comparison's time says nothing. Settings
    # require 16 characters or more.
    if configured is None or not hmac.compare_digest(
        sha256_hex(presented.strip()), sha256_hex(configured.get_secret_value().strip())
    ):
        raise AdminAuthError(
            "The metrics token is not valid."
            if configured is not None
            else "No metrics token is configured on this control plane.",
            "Use the value of MODELFORGE_METRICS_TOKEN, or set it and restart; or send the "
            "admin token in the X-ModelForge-Admin-Token header.",
            code="METRICS_TOKEN_INVALID",
        )
