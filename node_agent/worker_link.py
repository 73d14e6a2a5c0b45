"""The agent's side of the local runtime worker link: a unix socket, never the network.

Plain `http.client` over AF_UNIX: it is small, and it closes the socket when the worker is not
there (httpx's unix transport leaks the socket on a failed connect, which an agent polling a
stopped worker every heartbeat would turn into a descriptor leak).
"""

from __future__ import annotations

import http.client
import json
import logging
from pathlib import Path
from typing import Any

from modelforge_contracts.ipc import UnixHTTPConnection

log = logging.getLogger(__name__)


def query_runtime_worker(socket_path: Path, *, timeout: float = 2.0) -> dict[str, Any] | None:
    """The worker's version, protocol and health, or None when it does not answer."""
    if not socket_path.exists():
        return None
    connection = UnixHTTPConnection(socket_path, timeout)
    try:
        connection.request("GET", "/v1/health")
        response = connection.getresponse()
        if response.status != 200:
            raise ValueError(f"HTTP {response.status}")
        data = json.loads(response.read())
        if not isinstance(data, dict):
            raise ValueError("not a JSON object")
    except (OSError, http.client.HTTPException, ValueError) as exc:
        log.warning("runtime worker at %s did not answer (%s)", socket_path, type(exc).__name__)
        return None
    finally:
        connection.close()
    return {
        "version": str(data.get("version", "unknown")),
        "protocol_version": data.get("protocol_version"),
        "healthy": bool(data.get("healthy", False)),
    }
