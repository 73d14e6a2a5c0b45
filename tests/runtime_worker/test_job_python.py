"""The node's Python on a real runtime worker: a Python job named with it runs under that
interpreter — its packages importable, the worker's not, the job helpers still working — a job
that asks for the worker's (the GPU check) and an ONNX job keep the worker's, and a path the
worker cannot run fails the job with JOB_PYTHON_UNAVAILABLE before anything starts."""

from __future__ import annotations

import importlib.util
import os
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.node_python import PACKAGE, VALUE, make_node_python
from tests.runtime_worker.real_worker import python_job, run_on_worker, running_worker

TELLS_ITS_PYTHON = f"""
import importlib.util
import subprocess
import sys

from runtime_worker.job import emit


def where():
    emit({{"python": sys.executable}})
    found = importlib.util.find_spec("{PACKAGE}") is not None
    child = subprocess.run(
        [sys.executable, "-c", "import runtime_worker.job"], capture_output=True, text=True
    )
    return {{
        "executable": sys.executable,
        "prefix": sys.prefix,
        "value": __import__("{PACKAGE}").VALUE if found else None,
        "numpy": importlib.util.find_spec("numpy") is not None,
        "child_imports_helpers": child.returncode == 0,
    }}
"""


@pytest.fixture(scope="module")
def node_python(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_node_python(tmp_path_factory.mktemp("node-python") / "venv")


@pytest.fixture(scope="module")
def worker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    with running_worker(tmp_path_factory.mktemp("worker"), dict(os.environ)) as socket:
        yield socket


def test_the_worker_lacks_the_package_and_has_numpy() -> None:
    assert importlib.util.find_spec(PACKAGE) is None
    assert importlib.util.find_spec("numpy") is not None


def test_a_python_job_runs_under_the_nodes_python(worker: Path, node_python: Path) -> None:
    job = python_job("job-node-python", TELLS_ITS_PYTHON, "where", python=str(node_python))
    exit_record = run_on_worker(worker, job)
    assert exit_record.state == "succeeded", exit_record.error
    result = exit_record.result
    assert result["executable"] == str(node_python)
    assert result["prefix"] == str(node_python.parent.parent)
    assert result["value"] == VALUE
    assert result["numpy"] is False  # nothing of the worker's environment but the helpers
    assert result["child_imports_helpers"] is True


def test_a_job_that_asks_for_the_workers_python_gets_it(worker: Path, node_python: Path) -> None:
    job = python_job("job-worker-python", TELLS_ITS_PYTHON, "where", python=str(node_python))
    job["entrypoint"]["python"] = "worker"
    exit_record = run_on_worker(worker, job)
    assert exit_record.state == "succeeded", exit_record.error
    assert exit_record.result["executable"] == sys.executable
    assert exit_record.result["value"] is None and exit_record.result["numpy"] is True


def test_without_a_node_python_the_workers_own_runs_the_job(worker: Path) -> None:
    exit_record = run_on_worker(worker, python_job("job-default", TELLS_ITS_PYTHON, "where"))
    assert exit_record.state == "succeeded", exit_record.error
    assert exit_record.result["executable"] == sys.executable


@pytest.mark.parametrize("made", ["missing", "not executable", "a directory"])
def test_a_python_the_worker_cannot_run_fails_the_job(
    worker: Path, tmp_path: Path, made: str
) -> None:
    path = tmp_path / "bin" / "python"
    if made == "not executable":
        path.parent.mkdir()
        path.write_text("#!/bin/sh\n")
    elif made == "a directory":
        path.mkdir(parents=True)
    exit_record = run_on_worker(
        worker, python_job("job-no-python", TELLS_ITS_PYTHON, "where", python=str(path))
    )
    assert exit_record.state == "failed"
    assert exit_record.error is not None
    assert exit_record.error.code == "JOB_PYTHON_UNAVAILABLE"
    assert str(path) in exit_record.error.message
    assert "MODELFORGE_AGENT_PYTHON" in exit_record.error.message
