"""The node's Python (`MODELFORGE_AGENT_PYTHON`, `--python`) is checked when the agent starts:
a path jobs could not run under stops it with exit 2 and one line naming the setting, the
problem and the fix, before anything is sent; a good one lets it go on. Real agent processes,
real interpreters (shell scripts standing in for broken ones)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.node_agent.conftest import RecordingServer, agent_env, run_agent
from tests.node_python import make_node_python

TOKEN = "mfe_test-token-0123456789"


def _script(path: Path, body: str) -> Path:
    path.write_text(f"#!/bin/sh\n{body}\n")
    path.chmod(0o755)
    return path


def _bad_python(tmp_path: Path, kind: str) -> str:
    if kind == "relative":
        return "python3"
    if kind == "missing":
        return str(tmp_path / "no-such-venv" / "bin" / "python")
    if kind == "directory":
        return str(tmp_path)
    if kind == "not executable":
        path = tmp_path / "python"
        path.write_text("#!/bin/sh\necho 3.12\n")
        path.chmod(0o644)
        return str(path)
    if kind == "fails":
        body = 'echo "error while loading shared libraries: libpython3.12.so.1.0" >&2; exit 127'
        return str(_script(tmp_path / "python", body))
    if kind == "not python":
        return str(_script(tmp_path / "python", "echo hello"))
    if kind == "too old":
        return str(_script(tmp_path / "python", "echo 3.9"))
    if kind == "not a program":
        path = tmp_path / "python"
        path.write_bytes(b"\x7fELF garbage")
        path.chmod(0o755)
        return str(path)
    raise AssertionError(kind)


@pytest.mark.parametrize(
    ("kind", "problem"),
    [
        ("relative", "is not an absolute path; give the full path"),
        ("missing", "does not exist; create that environment"),
        ("directory", "is not an executable file"),
        ("not executable", "is not an executable file"),
        ("fails", "did not run as a Python interpreter (exit code 127: error while loading"),
        ("not python", "did not run as a Python interpreter (exit code 0)"),
        ("too old", "is Python 3.9; jobs need Python 3.11 or later"),
        ("not a program", "cannot be started (Exec format error)"),
    ],
)
def test_a_python_jobs_cannot_run_under_stops_the_start(
    tmp_path: Path, recording_server: RecordingServer, kind: str, problem: str
) -> None:
    python = _bad_python(tmp_path, kind)
    env = agent_env(tmp_path / "state", url=recording_server.url, MODELFORGE_AGENT_PYTHON=python)
    result = run_agent(env)
    assert result.returncode == 2, result.stderr
    assert "MODELFORGE_AGENT_PYTHON (--python)" in result.stderr
    assert problem in result.stderr, result.stderr
    assert "Traceback" not in result.stderr
    assert recording_server.requests == []  # nothing sent


def test_the_flag_overrides_the_variable(tmp_path: Path, recording_server: RecordingServer) -> None:
    good = make_node_python(tmp_path / "venv")
    old = _bad_python(tmp_path, "too old")
    env = agent_env(tmp_path / "state", url=recording_server.url, MODELFORGE_AGENT_PYTHON=str(good))
    result = run_agent(env, "--python", old)
    assert result.returncode == 2 and "is Python 3.9" in result.stderr
    env["MODELFORGE_AGENT_PYTHON"] = old
    result = run_agent(env, "--python", str(good))
    assert result.returncode == 6, result.stderr  # past the check: enrollment refused (404)
    assert f"Python jobs run under {good} (Python 3." in result.stderr


def test_the_check_never_shows_the_interpreter_the_agents_secrets(
    tmp_path: Path, recording_server: RecordingServer
) -> None:
    seen = tmp_path / "environment"
    python = _script(tmp_path / "python", f'env > "{seen}"; echo 3.12')
    env = agent_env(
        tmp_path / "state", url=recording_server.url, MODELFORGE_AGENT_PYTHON=str(python)
    )
    assert env["MODELFORGE_AGENT_ENROLLMENT_TOKEN"] == TOKEN
    result = run_agent(env)
    assert result.returncode == 6, result.stderr
    environment = seen.read_text()
    assert TOKEN not in environment and "MODELFORGE_" not in environment
    assert f"PATH={os.environ['PATH']}" in environment.splitlines()
