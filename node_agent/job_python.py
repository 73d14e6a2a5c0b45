"""The node's Python: the interpreter Python jobs run under, when the operator names one
(`MODELFORGE_AGENT_PYTHON` or `--python`), e.g. a virtual environment holding PyTorch. Unset,
jobs run under the runtime worker's own interpreter.

Checked once at start (`check_job_python`), before anything is sent: an absolute path, a file
that exists and may be executed, that runs, and that is Python `MIN_VERSION` or later (what the
job host, `runtime_worker.job_host`, is written for). It runs isolated (`-I`) with nothing of the
agent's environment but `PATH`: the enrollment token never reaches it.
"""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

from node_agent.config import ConfigError

#: The oldest Python a job may run under.
MIN_VERSION = (3, 11)
#: How long the interpreter has to say its version (a cold start on a network file system).
CHECK_TIMEOUT_SECONDS = 30.0
_NAME = "MODELFORGE_AGENT_PYTHON (--python)"
_ASK_VERSION = "import sys; print('%d.%d' % sys.version_info[:2])"
_VERSION = re.compile(r"(\d+)\.(\d+)")
_EXAMPLE = "e.g. /opt/torch-venv/bin/python"


def check_job_python(path: Path) -> tuple[int, int]:
    """The version of the interpreter at `path`; `ConfigError` naming the setting, what is
    wrong and what to do, when jobs cannot run under it."""
    shown = str(path)[:200]
    if not path.is_absolute():
        raise ConfigError(
            f"{_NAME}: {shown!r} is not an absolute path; give the full path, {_EXAMPLE}"
        )
    if not path.exists():
        raise ConfigError(
            f"{_NAME}: {shown} does not exist; create that environment (python3 -m venv ...) or "
            "correct the path"
        )
    if not path.is_file() or not os.access(path, os.X_OK):
        raise ConfigError(
            f"{_NAME}: {shown} is not an executable file; name the environment's interpreter, "
            f"{_EXAMPLE}"
        )
    try:
        answer = subprocess.run(  # noqa: S603 - the operator's interpreter, fixed arguments
            [str(path), "-I", "-c", _ASK_VERSION],
            env={"PATH": os.environ.get("PATH", "/usr/bin:/bin")},
            stdin=subprocess.DEVNULL,
            capture_output=True,
            text=True,
            errors="replace",
            timeout=CHECK_TIMEOUT_SECONDS,
            check=False,
        )
    except subprocess.TimeoutExpired:
        raise ConfigError(
            f"{_NAME}: {shown} did not answer within {CHECK_TIMEOUT_SECONDS:g} s; check that it "
            "runs (run it by hand with --version)"
        ) from None
    except OSError as exc:
        raise ConfigError(
            f"{_NAME}: {shown} cannot be started ({exc.strerror}); name a Python interpreter, "
            f"{_EXAMPLE}"
        ) from None
    found = _VERSION.fullmatch(answer.stdout.strip())
    if answer.returncode != 0 or found is None:
        said = (answer.stderr.strip().splitlines() or [""])[-1][:200]
        raise ConfigError(
            f"{_NAME}: {shown} did not run as a Python interpreter (exit code "
            f"{answer.returncode}{': ' + said if said else ''}); run it by hand with --version "
            "and repair or replace that environment"
        )
    version = (int(found.group(1)), int(found.group(2)))
    if version < MIN_VERSION:
        raise ConfigError(
            f"{_NAME}: {shown} is Python {version[0]}.{version[1]}; jobs need Python "
            f"{MIN_VERSION[0]}.{MIN_VERSION[1]} or later: name an environment made with a newer "
            "Python"
        )
    return version
