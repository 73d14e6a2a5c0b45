"""The agent's side of the local runtime worker link: a unix socket, never the network (RW-1)."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import httpx

log = logging.getLogger(__name__)


def query_runtime_worker(socket_path: Path, *, timeout: float = 2.0) -> dict[str, Any] | None:
    """The worker's version, protocol and health, or None when it does not answer."""
    if not socket_path.exists():
        return None
    transport = httpx.HTTPTransport(uds=str(socket_path))
    try:
        with httpx.Client(
            transport=transport, base_url="http://runtime-worker", timeout=timeout
        ) as client:
            response = client.get("/v1/health")
            response.raise_for_status()
            data = response.json()
    except (httpx.HTTPError, ValueError) as exc:
        log.warning("runtime worker at %s did not answer (%s)", socket_path, type(exc).__name__)
        return None
    return {
        "version": str(data.get("version", "unknown")),
        "protocol_version": data.get("protocol_version"),
        "healthy": bool(data.get("healthy", False)),
    }
