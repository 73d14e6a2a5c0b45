"""The node's persisted identity in the state volume: node id and credential, and the claim
nonce written before enrollment so a retry after a lost answer gets the same node.

Files are written atomically with mode 0600. Their contents never reach a log or a message.
"""

from __future__ import annotations

import hashlib
import json
import secrets
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from modelforge_contracts.files import write_private

IDENTITY_FILE = "identity.json"
CLAIM_FILE = "claim.json"


class StateVolumeError(Exception):
    """The state volume cannot hold the identity; the message names the path and the cause."""


@dataclass(frozen=True)
class Identity:
    node_id: str
    control_plane_url: str
    credential: str = field(repr=False)


class IdentityStore:
    def __init__(self, state_volume: Path) -> None:
        self.root = state_volume

    def check_writable(self) -> None:
        try:
            self.root.mkdir(mode=0o700, parents=True, exist_ok=True)
            probe = self.root / f".write-probe-{secrets.token_hex(4)}"
            probe.write_text("ok")
            probe.unlink()
        except OSError as exc:
            raise StateVolumeError(
                f"MODELFORGE_AGENT_STATE_VOLUME {self.root} is not writable "
                f"({exc.strerror or type(exc).__name__}); mount durable, writable storage there "
                "so the node keeps its identity across restarts"
            ) from None

    def load(self) -> Identity | None:
        data = self._read(IDENTITY_FILE)
        if data is None:
            return None
        try:
            return Identity(
                node_id=str(data["node_id"]),
                control_plane_url=str(data["control_plane_url"]),
                credential=str(data["credential"]),
            )
        except KeyError as exc:
            raise StateVolumeError(
                f"{self.root / IDENTITY_FILE} is missing {exc.args[0]!r}; restore it from backup "
                "or remove it and enroll again with a new token"
            ) from None

    def save(self, identity: Identity) -> None:
        self._write(
            IDENTITY_FILE,
            {
                "node_id": identity.node_id,
                "control_plane_url": identity.control_plane_url,
                "credential": identity.credential,
            },
        )
        (self.root / CLAIM_FILE).unlink(missing_ok=True)

    def claim_nonce(self, token: str) -> str:
        """The nonce for claiming `token`, created and persisted on first use."""
        token_digest = hashlib.sha256(token.encode()).hexdigest()
        data = self._read(CLAIM_FILE)
        if data and data.get("token_sha256") == token_digest and data.get("claim_nonce"):
            return str(data["claim_nonce"])
        nonce = secrets.token_urlsafe(32)
        self._write(CLAIM_FILE, {"token_sha256": token_digest, "claim_nonce": nonce})
        return nonce

    def _read(self, name: str) -> dict[str, Any] | None:
        path = self.root / name
        try:
            data = json.loads(path.read_text())
        except FileNotFoundError:
            return None
        except (OSError, ValueError) as exc:
            raise StateVolumeError(f"cannot read {path}: {exc}") from None
        if not isinstance(data, dict):
            raise StateVolumeError(f"{path} is not a JSON object")
        return data

    def _write(self, name: str, data: dict[str, Any]) -> None:
        path = self.root / name
        try:
            write_private(path, json.dumps(data))
        except OSError as exc:
            raise StateVolumeError(
                f"cannot write {path} ({exc.strerror or type(exc).__name__})"
            ) from None
