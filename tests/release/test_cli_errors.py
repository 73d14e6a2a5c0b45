"""A failed `modelforge-release build` ends in one line naming the problem and a non-zero exit,
never a traceback: the real command, run as a process, refused before it builds anything."""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

import pytest

PROJECT_DIR = Path(__file__).resolve().parents[2]
#: What the `modelforge-release` script runs (`release.cli:main`), from this checkout.
COMMAND = [sys.executable, "-m", "release.cli"]


def _build(
    tmp_path: Path, *options: str, prefix: Sequence[str] = ()
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [
            *prefix,
            *COMMAND,
            "build",
            "--work-dir",
            str(tmp_path / "work"),
            "--revision",
            "0" * 40,
            "--source-date-epoch",
            "1700000000",
            "--worker-flavour",
            "cpu",
            *options,
        ],
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": os.pathsep.join([str(PROJECT_DIR), *_python_path()])},
        capture_output=True,
        text=True,
        timeout=120,
    )


def _python_path() -> list[str]:
    return [entry for entry in os.environ.get("PYTHONPATH", "").split(os.pathsep) if entry]


def _without_root_override() -> list[str]:
    """root writes through a read-only directory; without CAP_DAC_OVERRIDE it cannot."""
    if os.geteuid() != 0:
        return []
    setpriv = shutil.which("setpriv")
    if setpriv is None:
        pytest.skip("running as root without setpriv: a read-only directory is writable")
    return [setpriv, "--bounding-set=-dac_override,-dac_read_search", "--"]


def test_a_bad_recipe_ends_in_one_line_naming_it(tmp_path: Path) -> None:
    # The version is every image's tag and the value of its version label.
    done = _build(tmp_path, "--out", str(tmp_path / "bundle"), "--version", "1.0 beta")

    assert done.returncode == 1
    assert "Traceback" not in done.stderr
    assert done.stderr.splitlines() == [
        "modelforge-release build: version '1.0 beta' is not a valid image tag"
    ]
    assert not (tmp_path / "work").exists()


def test_an_unwritable_output_ends_in_one_line_naming_it(tmp_path: Path) -> None:
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(stat.S_IRUSR | stat.S_IXUSR | stat.S_IRGRP | stat.S_IXGRP)
    out = locked / "bundle"
    try:
        done = _build(
            tmp_path, "--out", str(out), "--version", "0.1.0", prefix=_without_root_override()
        )
    finally:
        locked.chmod(stat.S_IRWXU)

    assert done.returncode == 1
    assert "Traceback" not in done.stderr
    [line] = done.stderr.splitlines()
    assert line.startswith("modelforge-release build: ")
    assert "Permission denied" in line
    assert str(out) in line
    assert not out.exists()
