"""The control plane API as the agent sees it: one function per endpoint, no loops, no retries.

Errors come out as `ControlPlaneError` (an HTTP answer) or `httpx.TransportError` (no answer);
`is_retryable` decides which are worth another attempt. `describe` renders either as
`<status or exception> on <METHOD> <path>` — never a body, never the credential.
"""

from __future__ import annotations

import ssl
from pathlib import Path
from typing import Any

import httpx

from node_agent import AGENT_VERSION, PROTOCOL_VERSION


class ControlPlaneError(Exception):
    def __init__(self, status: int, code: str, method: str, path: str) -> None:
        super().__init__(f"HTTP {status} {code} on {method} {path}")
        self.status = status
        self.code = code
        self.method = method
        self.path = path


def make_client(
    base_url: str, *, tls_verify: bool, ca_cert_path: Path | None, timeout: float
) -> httpx.Client:
    verify: ssl.SSLContext | bool = tls_verify
    if tls_verify and ca_cert_path is not None:
        # Adds a trust root; the system's roots stay trusted too.
        context = ssl.create_default_context()
        context.load_verify_locations(cafile=str(ca_cert_path))
        verify = context
    return httpx.Client(
        base_url=base_url,
        verify=verify,
        timeout=timeout,
        headers={"User-Agent": f"modelforge-node-agent/{AGENT_VERSION}"},
    )


def error_from(response: httpx.Response, method: str, path: str) -> ControlPlaneError:
    """The refusal as an exception: status and the machine-readable code, never the body."""
    code = "HTTP_ERROR"
    try:
        code = str(response.json()["error"]["code"])
    except (ValueError, KeyError, TypeError):
        pass
    return ControlPlaneError(response.status_code, code, method, path)


def _call(
    client: httpx.Client,
    method: str,
    path: str,
    body: dict[str, Any],
    credential: str | None = None,
) -> dict[str, Any]:
    headers = {"Authorization": f"Bearer {credential}"} if credential else {}
    response = client.request(method, path, json=body, headers=headers)
    if response.status_code >= 400:
        raise error_from(response, method, path)
    data = response.json()
    return data if isinstance(data, dict) else {}


def enroll(
    client: httpx.Client,
    *,
    token: str,
    claim_nonce: str,
    hostname: str,
    fingerprint: dict[str, Any],
) -> dict[str, Any]:
    return _call(
        client,
        "POST",
        "/api/v1/agent/enroll",
        {
            "token": token,
            "claim_nonce": claim_nonce,
            "hostname": hostname,
            "protocol_version": PROTOCOL_VERSION,
            "agent_version": AGENT_VERSION,
            "fingerprint": fingerprint,
        },
    )


def heartbeat(client: httpx.Client, *, credential: str, health: dict[str, Any]) -> dict[str, Any]:
    body = {"protocol_version": PROTOCOL_VERSION, "agent_version": AGENT_VERSION, "health": health}
    return _call(client, "POST", "/api/v1/agent/heartbeat", body, credential)


def put_inventory(
    client: httpx.Client, *, credential: str, inventory: dict[str, Any]
) -> dict[str, Any]:
    return _call(client, "PUT", "/api/v1/agent/inventory", inventory, credential)


def post_telemetry(
    client: httpx.Client, *, credential: str, telemetry: dict[str, Any]
) -> dict[str, Any]:
    return _call(client, "POST", "/api/v1/agent/telemetry", telemetry, credential)


def is_retryable(exc: BaseException) -> bool:
    if isinstance(exc, httpx.TransportError):
        return True
    if isinstance(exc, ControlPlaneError):
        return exc.status == 429 or exc.status >= 500
    return False


def certificate_problem(exc: BaseException) -> str | None:
    """The TLS verification failure behind a connection error, if that is what it is."""
    seen: BaseException | None = exc
    while seen is not None:
        if isinstance(seen, ssl.SSLCertVerificationError):
            return seen.verify_message or str(seen)
        seen = seen.__cause__ or seen.__context__
    text = str(exc)
    return text if "CERTIFICATE_VERIFY_FAILED" in text else None


def describe(exc: BaseException, method: str, path: str) -> str:
    if isinstance(exc, ControlPlaneError):
        return f"HTTP {exc.status} {exc.code} on {method} {path}"
    return f"{type(exc).__name__} on {method} {path}"
