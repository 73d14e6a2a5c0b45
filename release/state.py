"""What `load` records about the images it loaded, kept outside the bundle.

A bundle may sit on read-only media, so `load` writes its record — the local image ID of each
release tag and the SHA-256 of the release manifest it verified — under a state directory:
`$MODELFORGE_RELEASE_STATE_DIR`, else `$XDG_STATE_HOME/modelforge-release`, else
`~/.local/state/modelforge-release`; one record per release version, written atomically with
mode 0600. `up` reads it back and trusts it only together with a fresh verification of the
bundle's signature and manifest.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from modelforge_contracts.files import write_private
from modelforge_contracts.release_manifest import ManifestError, parse_json, read_limited
from release.errors import ReleaseError

STATE_DIR_VARIABLE = "MODELFORGE_RELEASE_STATE_DIR"
RECORD_FILE = "loaded-images.json"
_MAX_RECORD_BYTES = 1 << 20
_VERSION = re.compile(r"[0-9A-Za-z][0-9A-Za-z._+-]*")


class StateError(ReleaseError):
    """The record of a load is missing or unusable; the message says what to run."""


@dataclass(frozen=True)
class LoadRecord:
    """One `load`: the release version, the SHA-256 of its manifest, tag -> local image ID."""

    version: str
    manifest_sha256: str
    images: dict[str, str]


def state_dir(environ: Mapping[str, str] | None = None) -> Path:
    """The state directory (absolute) for the environment `environ` (default: os.environ)."""
    environ = os.environ if environ is None else environ
    configured = environ.get(STATE_DIR_VARIABLE)
    if configured:
        return Path(configured).absolute()
    xdg = environ.get("XDG_STATE_HOME")
    base = Path(xdg) if xdg else Path.home() / ".local" / "state"
    return (base / "modelforge-release").absolute()


def record_path(version: str, environ: Mapping[str, str] | None = None) -> Path:
    if not _VERSION.fullmatch(version):
        raise StateError(f"release version {version!r} cannot name a state record")
    return state_dir(environ) / version / RECORD_FILE


def write_record(record: LoadRecord) -> Path:
    path = record_path(record.version)
    content = {
        "version": record.version,
        "manifest_sha256": record.manifest_sha256,
        "images": dict(sorted(record.images.items())),
    }
    try:
        write_private(path, json.dumps(content, indent=2) + "\n")
    except OSError as exc:
        raise StateError(
            f"cannot write {path}: {exc.strerror or exc}; set {STATE_DIR_VARIABLE} to a "
            "writable directory"
        ) from None
    return path


def read_record(version: str) -> LoadRecord:
    path = record_path(version)
    rerun = f"run `modelforge-release load` for release {version} first"
    try:
        data = parse_json(read_limited(path, limit=_MAX_RECORD_BYTES), str(path))
    except FileNotFoundError:
        raise StateError(f"no record of a load of release {version} in {path}: {rerun}") from None
    except OSError as exc:
        raise StateError(f"cannot read {path}: {exc.strerror or exc}") from None
    except ManifestError as exc:
        raise StateError(f"{exc}; {rerun}") from None
    images = data.get("images") if isinstance(data, dict) else None
    digest = data.get("manifest_sha256") if isinstance(data, dict) else None
    if (
        not isinstance(images, dict)
        or not all(isinstance(k, str) and isinstance(v, str) for k, v in images.items())
        or not isinstance(digest, str)
        or data.get("version") != version
    ):
        raise StateError(f"{path} is not a record `modelforge-release load` wrote; {rerun}")
    return LoadRecord(version=version, manifest_sha256=digest, images=dict(images))
