"""The signing keys and the signed synthetic bundle the bundle tests share (built once)."""

from __future__ import annotations

from pathlib import Path

import pytest

from release.cli import main
from tests.release.synthetic import signed_bundle as make_signed_bundle


@pytest.fixture(scope="module")
def keys(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, Path]:
    """The bundle's private and public key, and the public key of another pair."""
    directory = tmp_path_factory.mktemp("keys")
    private, public = directory / "cosign.key", directory / "cosign.pub"
    assert main(["keygen", "--private", str(private), "--public", str(public)]) == 0
    other_private, other_public = directory / "other.key", directory / "other.pub"
    assert main(["keygen", "--private", str(other_private), "--public", str(other_public)]) == 0
    return private, public, other_public


@pytest.fixture(scope="module")
def signed_bundle(tmp_path_factory: pytest.TempPathFactory, keys: tuple[Path, Path, Path]) -> Path:
    return make_signed_bundle(tmp_path_factory.mktemp("bundle"), keys[0])
