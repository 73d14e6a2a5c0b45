"""The control plane as the agent sees it: one `ControlPlane` object, one method per endpoint.

It holds the HTTP connection pool and, once enrolled, the node credential; every call runs under
the one `RetryRule` (node_agent.retry), so a transient failure is retried with backoff and a
terminal one stops the agent wherever it happens — a heartbeat, a claim, an artifact fetch for
job code. What a non-retryable refusal means is decided here, per endpoint. No loops live here.

It never puts the credential in a log line, an exception, or its own `repr()`, and never builds
a URL from an artifact digest it has not checked (node_agent.digests).
"""

from __future__ import annotations

import logging
import ssl
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx

from modelforge_contracts.errors import error_code
from modelforge_contracts.job_records import dumps_strict
from modelforge_contracts.protocol import PROTOCOL_VERSION
from node_agent import AGENT_VERSION
from node_agent.digests import check_digest
from node_agent.retry import (
    EXIT_ENROLLMENT,
    RUNTIME_WORKER,
    AgentStopped,
    ControlPlaneError,
    RetryRule,
)

log = logging.getLogger("modelforge.node_agent")

_CHUNK = 1024 * 1024
#: Long-poll timeouts: the hold plus room for a slow answer.
_CLAIM_TIMEOUT = 15.0
_WATCH_TIMEOUT = 15.0
_DOWNLOAD_TIMEOUT = httpx.Timeout(60.0, connect=10.0)
_UPLOAD_TIMEOUT = httpx.Timeout(300.0, connect=10.0)


def make_http(
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
    """The refusal as an exception: status, the machine-readable code and the component a
    protocol refusal names — never the rest of the body."""
    try:
        body = response.json()
    except ValueError:
        body = None
    error = body.get("error") if isinstance(body, dict) else None
    component = error.get("component") if isinstance(error, dict) else None
    return ControlPlaneError(
        response.status_code,
        error_code(body) or "HTTP_ERROR",
        method,
        path,
        component=component if isinstance(component, str) else None,
    )


def _json(response: httpx.Response) -> dict[str, Any]:
    data = response.json()
    return data if isinstance(data, dict) else {}


class ControlPlane:
    def __init__(
        self, http: httpx.Client, retry: RetryRule, artifacts: httpx.Client | None = None
    ) -> None:
        self.http = http
        self.retry = retry
        #: Where artifacts go and come from: an artifact host, or the control plane (`http`).
        self.artifacts = artifacts or http
        self._credential: str | None = None

    def __repr__(self) -> str:
        enrolled = "enrolled" if self._credential else "not enrolled"
        return f"<ControlPlane {self.http.base_url} ({enrolled})>"

    def close(self) -> None:
        self.http.close()
        if self.artifacts is not self.http:
            self.artifacts.close()

    def __enter__(self) -> ControlPlane:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def use_credential(self, credential: str) -> None:
        """From now on every call is authenticated as this node."""
        self._credential = credential

    @property
    def stopped(self) -> AgentStopped | None:
        """The terminal outcome that stopped the agent, from whichever call met it."""
        return self.retry.stopped

    # -- the one way a call is made ---------------------------------------------------------

    def _headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self._credential}"} if self._credential else {}

    def _call(
        self,
        method: str,
        path: str,
        body: dict[str, Any] | None = None,
        *,
        accept: tuple[int, ...] = (),
        timeout: httpx.Timeout | None = None,
    ) -> httpx.Response:
        """One JSON call under the retry rule; statuses in `accept` are answers, not refusals."""
        content = None if body is None else dumps_strict(body).encode()

        def attempt() -> httpx.Response:
            headers = self._headers()
            if content is not None:
                headers["Content-Type"] = "application/json"
            response = self.http.request(
                method,
                path,
                content=content,
                headers=headers,
                timeout=self.http.timeout if timeout is None else timeout,
            )
            if response.status_code >= 400 and response.status_code not in accept:
                raise error_from(response, method, path)
            return response

        return self.retry.run(method, path, attempt)

    def _publish(self, method: str, path: str, body: dict[str, Any]) -> dict[str, Any] | None:
        """A report whose refusal concerns only itself: logged and dropped, never retried."""
        try:
            return _json(self._call(method, path, body))
        except ControlPlaneError as exc:
            log.error("%s; this publication is dropped", exc)
            return None

    # -- enrollment and reports -------------------------------------------------------------

    def enroll(
        self, *, token: str, claim_nonce: str, hostname: str, fingerprint: dict[str, Any]
    ) -> dict[str, Any]:
        body = {
            "token": token,
            "claim_nonce": claim_nonce,
            "hostname": hostname,
            "protocol_version": PROTOCOL_VERSION,
            "agent_version": AGENT_VERSION,
            "fingerprint": fingerprint,
        }
        try:
            return _json(self._call("POST", "/api/v1/agent/enroll", body))
        except ControlPlaneError as exc:
            raise AgentStopped(
                EXIT_ENROLLMENT, f"the control plane rejected the enrollment request ({exc})"
            ) from None

    def heartbeat(self, health: dict[str, Any]) -> dict[str, Any] | None:
        body = {
            "protocol_version": PROTOCOL_VERSION,
            "agent_version": AGENT_VERSION,
            "health": health,
        }
        return self._publish("POST", "/api/v1/agent/heartbeat", body)

    def put_inventory(self, inventory: dict[str, Any]) -> bool:
        """Report the inventory; False when this report was refused and dropped.

        A refusal of the runtime worker's protocol (426 naming `runtime-worker`) concerns the
        worker, not this report: it is raised as `ControlPlaneError` for the agent to act on."""
        path = "/api/v1/agent/inventory"
        try:
            self._call("PUT", path, inventory)
        except ControlPlaneError as exc:
            if exc.component == RUNTIME_WORKER:
                raise
            log.error("%s; this publication is dropped", exc)
            return False
        return True

    def post_telemetry(self, telemetry: dict[str, Any]) -> bool:
        return self._publish("POST", "/api/v1/agent/telemetry", telemetry) is not None

    def report_gpu_health(self, body: dict[str, Any]) -> bool:
        """Every GPU's health judgement (`{"gpus": [...]}`, modelforge_contracts.gpu_health);
        False when this report was refused and dropped (the next one carries the full state)."""
        return self._publish("POST", "/api/v1/agent/gpu-health", body) is not None

    # -- work -------------------------------------------------------------------------------

    def claim(self, hold_seconds: float) -> dict[str, Any] | None:
        """Long poll for a job: the assignment, or None when none came within the hold.

        A refusal that is neither retried nor terminal raises `ControlPlaneError`: the caller
        pauses before it claims again, so a persistent refusal never becomes a tight loop."""
        path = "/api/v1/agent/work/claim"
        timeout = httpx.Timeout(hold_seconds + _CLAIM_TIMEOUT, connect=10.0)
        response = self._call("POST", path, {"hold_seconds": hold_seconds}, timeout=timeout)
        return None if response.status_code == 204 else _json(response)

    def watch(self, job_ids: list[str], hold_seconds: float) -> list[str]:
        """Long poll: which of these running jobs must stop (cancelled, or no longer ours)."""
        timeout = httpx.Timeout(hold_seconds + _WATCH_TIMEOUT, connect=10.0)
        body = {"job_ids": job_ids, "hold_seconds": hold_seconds}
        try:
            answer = _json(self._call("POST", "/api/v1/agent/jobs/watch", body, timeout=timeout))
        except ControlPlaneError as exc:
            log.error("%s; no cancellations this time", exc)
            return []
        return [str(job_id) for job_id in answer.get("cancel") or []]

    def events(self, job_id: str, events: list[dict[str, Any]]) -> bool:
        """Report a running job's events; True when the job must stop (or is no longer ours)."""
        path = f"/api/v1/agent/jobs/{job_id}/events"
        try:
            response = self._call("POST", path, {"events": events}, accept=(404, 409))
        except ControlPlaneError as exc:
            log.error("%s; these events are dropped", exc)
            return False
        if response.status_code in (404, 409):
            return True  # not ours or not running any more
        return bool(_json(response).get("cancel"))

    def complete(self, job_id: str, outcome: dict[str, Any]) -> None:
        """Report a job's outcome; one the control plane already ended is left as it is."""
        path = f"/api/v1/agent/jobs/{job_id}/complete"
        try:
            self._call("POST", path, outcome, accept=(404, 409))
        except ControlPlaneError as exc:
            log.error("%s; the outcome is dropped", exc)

    # -- services ---------------------------------------------------------------------------

    def sync_services(self, body: dict[str, Any]) -> dict[str, Any]:
        """Report this node's services; the answer lists those it must run, with their secrets
        (`{"services": [...], "poll_interval_seconds"}`). A refusal that is neither retried nor
        terminal raises `ControlPlaneError` for the caller to log and try again later."""
        return _json(self._call("POST", "/api/v1/agent/services/sync", body))

    # -- artifacts --------------------------------------------------------------------------

    def download_artifact(self, digest: str, partial: Path) -> None:
        """Stream the artifact into `partial`, resuming after what it already holds.

        Raises `InvalidDigest` for anything but a digest (nothing is sent), and
        `ControlPlaneError` when the control plane refuses it (unknown digest, say).
        """
        path = f"/api/v1/agent/artifacts/{check_digest(digest)}"

        def attempt() -> None:
            offset = partial.stat().st_size if partial.exists() else 0
            headers = self._headers()
            if offset:
                headers["Range"] = f"bytes={offset}-"
            with self.artifacts.stream(
                "GET", path, headers=headers, timeout=_DOWNLOAD_TIMEOUT
            ) as response:
                if response.status_code == 416:  # already complete
                    return
                if response.status_code >= 400:
                    response.read()
                    raise error_from(response, "GET", path)
                mode = "ab" if response.status_code == 206 else "wb"
                with partial.open(mode) as handle:
                    for chunk in response.iter_bytes(_CHUNK):
                        handle.write(chunk)

        self.retry.run("GET", path, attempt)

    def upload_artifact(self, digest: str, source: Path) -> None:
        """Stream the file to the control plane, which refuses it unless it hashes to `digest`;
        `InvalidDigest` for anything but a digest (nothing is sent)."""
        path = f"/api/v1/agent/artifacts/{check_digest(digest)}"

        def body() -> Iterator[bytes]:
            with source.open("rb") as handle:
                while chunk := handle.read(_CHUNK):
                    yield chunk

        def attempt() -> None:
            headers = dict(self._headers(), **{"Content-Length": str(source.stat().st_size)})
            response = self.artifacts.put(
                path, content=body(), headers=headers, timeout=_UPLOAD_TIMEOUT
            )
            if response.status_code >= 400:
                raise error_from(response, "PUT", path)

        self.retry.run("PUT", path, attempt)


def connect(
    base_url: str,
    *,
    tls_verify: bool,
    ca_cert_path: Path | None,
    timeout: float,
    stop: threading.Event,
    artifact_url: str | None = None,
) -> ControlPlane:
    """A client for the control plane at `base_url` (its artifacts at `artifact_url` when
    given), stopping its retries when `stop` is set."""
    http = make_http(base_url, tls_verify=tls_verify, ca_cert_path=ca_cert_path, timeout=timeout)
    artifacts = None
    if artifact_url is not None:
        artifacts = make_http(
            artifact_url, tls_verify=tls_verify, ca_cert_path=ca_cert_path, timeout=timeout
        )
    return ControlPlane(http, RetryRule(stop=stop, control_plane_url=base_url), artifacts)
