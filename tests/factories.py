"""Factories for tests: settings, an in-process control plane, and agent-side request bodies."""

from __future__ import annotations

import json
import secrets
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fastapi.testclient import TestClient
from pydantic import SecretStr

from control_plane import RELEASE_VERSION
from control_plane.app import create_app
from control_plane.clock import Clock, ManualClock
from control_plane.context import AppContext
from control_plane.settings import Settings
from modelforge_contracts.protocol import PROTOCOL_VERSION

ADMIN_TOKEN = "mfa_test_" + secrets.token_urlsafe(24)

#: The smallest job a node can be handed: a Python function that returns 1.
PYTHON_JOB: dict[str, Any] = {
    "entrypoint": {
        "kind": "python",
        "module": "m",
        "function": "f",
        "source": {"m.py": "def f():\n    return 1\n"},
    }
}


def make_settings(data_dir: Path, database_url: str, **overrides: Any) -> Settings:
    return Settings(
        data_dir=data_dir,
        database_url=SecretStr(database_url),
        admin_token=SecretStr(ADMIN_TOKEN),
        **overrides,
    )


def heartbeat_body(protocol: Any = 1, **health: Any) -> dict[str, Any]:
    return {
        "protocol_version": protocol,
        "agent_version": "0.1.0",
        "health": {"status": "healthy", "preflight": "passed", **health},
    }


def inventory_body(mode: str = "cpu", worker_protocol: Any = 1, **extra: Any) -> dict[str, Any]:
    body: dict[str, Any] = {
        "hostname": "gpu-host-1",
        "os": "Debian GNU/Linux 12",
        "agent_version": "0.1.0",
        "accelerator_mode": mode,
        "cpu_count": 16,
        "memory_mb": 64000,
        "gpus": [],
        "runtime_worker": {"version": "0.1.0", "protocol_version": worker_protocol},
    }
    if mode == "nvidia":
        body["gpus"] = [
            {"index": 0, "uuid": "GPU-0000-aaaa", "name": "NVIDIA H200", "memory_total_mb": 143771}
        ]
    body.update(extra)
    return body


def telemetry_body() -> dict[str, Any]:
    return {
        "host": {"cpu_percent": 12.5, "memory_used_mb": 2048, "memory_total_mb": 64000},
        "gpus": [
            {
                "index": 0,
                "uuid": "GPU-0000-aaaa",
                "utilization_percent": 37.0,
                "memory_used_mb": 1024,
                "memory_total_mb": 143771,
                "temperature_c": 41,
                "power_draw_w": 120.5,
            }
        ],
    }


def node_agent_entry(**changes: Any) -> dict[str, Any]:
    """The node-agent entry of a release manifest for this control plane's release, as
    the Enroll node wizard is given it. The `&` in a label is there on purpose: Docker's
    `{{json}}` prints it as `\\u0026`, which the generated start command must match."""
    entry: dict[str, Any] = {
        "tag": f"modelforge-node-agent:{RELEASE_VERSION}",
        "architecture": "amd64",
        "os": "linux",
        "rootfs_layers": ["sha256:" + "1" * 64, "sha256:" + "2" * 64],
        "labels": {
            "io.modelforge.component": "node-agent",
            "io.modelforge.protocol": str(PROTOCOL_VERSION),
            "org.opencontainers.image.created": "2026-11-30T00:00:00Z",
            "org.opencontainers.image.licenses": "Apache-2.0",
            "org.opencontainers.image.revision": "0123456789abcdef0123456789abcdef01234567",
            "org.opencontainers.image.source": "https://example.invalid/modelforge?a&b",
            "org.opencontainers.image.title": "modelforge-node-agent",
            "org.opencontainers.image.version": RELEASE_VERSION,
        },
        "config_digest": "sha256:" + "9" * 64,
    }
    entry.update(changes)
    return entry


def write_release_manifest(path: Path) -> Path:
    """A release manifest as `modelforge-release bundle` writes it, with the node-agent entry
    above: what MODELFORGE_RELEASE_MANIFEST points at."""
    manifest = {
        "version": RELEASE_VERSION,
        "protocol": PROTOCOL_VERSION,
        "images": {"modelforge-node-agent": node_agent_entry()},
    }
    path.write_text(json.dumps(manifest, indent=2))
    return path


@dataclass(frozen=True)
class ReadyNode:
    """An enrolled node the scheduler may hand work to: its id and its agent's headers."""

    node_id: str
    headers: dict[str, str]


class ControlPlane:
    """An in-process control plane (real app, real database) driven through HTTP calls."""

    def __init__(self, client: TestClient, clock: ManualClock) -> None:
        self.client = client
        self.clock = clock
        self.ctx: AppContext = client.app.ctx  # type: ignore[attr-defined]

    @property
    def admin(self) -> dict[str, str]:
        return {"X-ModelForge-Admin-Token": ADMIN_TOKEN}

    def mint(self, expires_in_seconds: int = 900, **body: Any) -> dict[str, Any]:
        response = self.client.post(
            "/api/v1/admin/node-enrollments",
            headers=self.admin,
            json={"display_name": "gpu-1", "expires_in_seconds": expires_in_seconds, **body},
        )
        assert response.status_code == 201, response.text
        return dict(response.json())

    def enroll_raw(self, token: str, nonce: str | None = None, **body: Any) -> Any:
        payload = {
            "token": token,
            "claim_nonce": nonce or secrets.token_hex(16),
            "hostname": "gpu-host-1",
            "protocol_version": 1,
            "agent_version": "0.1.0",
            **body,
        }
        return self.client.post("/api/v1/agent/enroll", json=payload)

    def enroll(self, **body: Any) -> dict[str, Any]:
        response = self.enroll_raw(self.mint()["token"], **body)
        assert response.status_code == 200, response.text
        return dict(response.json())

    def agent(self, credential: str) -> dict[str, str]:
        return {"Authorization": f"Bearer {credential}"}

    def heartbeat(self, credential: str, **kw: Any) -> Any:
        return self.client.post(
            "/api/v1/agent/heartbeat", headers=self.agent(credential), json=heartbeat_body(**kw)
        )

    def ready_node(self) -> ReadyNode:
        """Enroll a node that reports a cpu inventory and a healthy heartbeat, flushed: ready."""
        enrolled = self.enroll()
        headers = self.agent(enrolled["credential"])
        inventory = self.client.put(
            "/api/v1/agent/inventory", headers=headers, json=inventory_body()
        )
        assert inventory.is_success, inventory.text
        heartbeat = self.heartbeat(enrolled["credential"])
        assert heartbeat.is_success, heartbeat.text
        self.flush()
        return ReadyNode(enrolled["node_id"], headers)

    def node(self, node_id: str) -> dict[str, Any]:
        response = self.client.get(f"/api/v1/admin/nodes/{node_id}", headers=self.admin)
        assert response.status_code == 200, response.text
        return dict(response.json())

    def readiness(self, node_id: str) -> dict[str, Any]:
        response = self.client.get(f"/api/v1/admin/nodes/{node_id}/readiness", headers=self.admin)
        assert response.status_code == 200, response.text
        return dict(response.json())

    def events(self, node_id: str) -> list[dict[str, Any]]:
        response = self.client.get(f"/api/v1/admin/nodes/{node_id}/events", headers=self.admin)
        assert response.status_code == 200, response.text
        return list(reversed(response.json()))

    def pass_hold(self, seconds: float) -> None:
        """End every hold of at most `seconds` begun so far (a claim's `hold_seconds`, a job
        watch, a job-events `wait`): move the clock `seconds` ahead. Holds count on this
        control plane's `ManualClock`, so real time never ends one. `now` moves too, so liveness
        and expiry see the time pass."""
        self.clock.advance(seconds)

    def flush(self) -> int:
        return self.ctx.heartbeats.flush(session_factory=self.ctx.session_factory)

    def sweep(self) -> int:
        from control_plane.background.loops import sweep

        return sweep(self.ctx)


@contextmanager
def control_plane(
    data_dir: Path, database_url: str, clock: Clock | None = None, **overrides: Any
) -> Iterator[ControlPlane]:
    """A control plane in this process on a `ManualClock` (`clock`, or a new one), its loops
    not started.

    The scheduler's holds are counted on that clock (`Clock.monotonic`, `wait_until`): a claim,
    job watch or job-events wait with a hold above 0 never ends by real time here. A test that
    expects it to end (a 204, an empty list) calls `ControlPlane.pass_hold` while it waits;
    without that it hangs until pytest's timeout."""
    clock = clock or ManualClock()
    assert isinstance(clock, ManualClock)
    app = create_app(
        make_settings(data_dir, database_url, **overrides), clock=clock, run_loops=False
    )
    with TestClient(app) as client:
        yield ControlPlane(client, clock)


@contextmanager
def two_replicas(root: Path, database_url: str) -> Iterator[tuple[ControlPlane, ControlPlane]]:
    """Two in-process replicas, `a` and `b`, on one database: each its own data directory under
    `root`, both on `a`'s clock."""
    with (
        control_plane(root / "a", database_url) as a,
        control_plane(root / "b", database_url, clock=a.clock) as b,
    ):
        yield a, b
