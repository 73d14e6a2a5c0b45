"""The release every Docker test of `make e2e` shares: the cpu-flavour images built once with
`modelforge-release build`, bundled, and signed with a key made for this run. Building takes a
minute or two; the modules that load and start it (`test_release_docker`, `test_jobs_in_containers`)
only read it, and copy it before changing anything. `test_images` builds on its own, from a
snapshot of the project, to compare a second build with its first."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from release.cli import main as release

REPO = Path(__file__).resolve().parents[2]
#: The version the shared release's images are tagged with (the package's own).
VERSION = "0.1.0"


@pytest.fixture(scope="session")
def release_bundle(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(the signed bundle's folder, the public key that verifies it)."""
    root = tmp_path_factory.mktemp("release")
    bundle, private, public = root / "bundle", root / "cosign.key", root / "cosign.pub"
    work = Path(os.environ.get("MODELFORGE_RELEASE_WORK_DIR", REPO / "build" / "release"))
    build = ["build", "--out", str(bundle), "--work-dir", str(work), "--worker-flavour", "cpu"]
    assert release([*build, "--version", VERSION]) == 0
    assert release(["bundle", str(bundle)]) == 0
    assert release(["keygen", "--private", str(private), "--public", str(public)]) == 0
    assert release(["sign", str(bundle), "--key", str(private)]) == 0
    return bundle, public
