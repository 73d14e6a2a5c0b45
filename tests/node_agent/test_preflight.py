"""The NVIDIA preflight fails closed with exactly one code and exit 3, sends nothing,
and `--preflight` is a bounded diagnostic that never enrolls. Run as subprocesses over the
substitute NVML (a real shared library loaded by the unchanged bindings)."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from tests.node_agent.conftest import RecordingServer, agent_env, run_agent
from tests.nvml_substitute import CUDA_VERSION, DRIVER_VERSION, EXPECTED_GPUS

CODES = ("NVIDIA_NVML_UNAVAILABLE", "NVIDIA_DEVICE_NOT_FOUND", "NVIDIA_TELEMETRY_UNAVAILABLE")
FAILURES = [
    # (scenario or None for "no library at all", expected code)
    (None, "NVIDIA_NVML_UNAVAILABLE"),
    ("init_fail", "NVIDIA_NVML_UNAVAILABLE"),
    ("no_devices", "NVIDIA_DEVICE_NOT_FOUND"),
    ("telemetry_fail", "NVIDIA_TELEMETRY_UNAVAILABLE"),
]


def _env(tmp_path: Path, fake_nvml_dir: Path, scenario: str | None, **kw: str) -> dict[str, str]:
    return agent_env(
        tmp_path / "state",
        mode=kw.pop("mode", "nvidia"),
        nvml_dir=fake_nvml_dir if scenario is not None else None,
        scenario=scenario,
        **kw,
    )


@pytest.mark.parametrize(("scenario", "code"), FAILURES)
def test_preflight_command_fails_with_one_code(
    tmp_path: Path, fake_nvml_dir: Path, scenario: str | None, code: str
) -> None:
    started = time.monotonic()
    result = run_agent(_env(tmp_path, fake_nvml_dir, scenario), "--preflight")
    assert result.returncode == 3, result.stderr
    assert [c for c in CODES if c in result.stdout] == [code]
    assert "FAILED" in result.stdout and "next step" in result.stdout
    assert time.monotonic() - started < 15
    assert not (tmp_path / "state").exists()  # never enrolls, never writes identity

    as_json = run_agent(_env(tmp_path, fake_nvml_dir, scenario), "--preflight", "--json")
    assert as_json.returncode == 3
    report = json.loads(as_json.stdout)
    assert report["ok"] is False and report["code"] == code and report["next_step"]


def test_preflight_command_passes_with_two_gpus(tmp_path: Path, fake_nvml_dir: Path) -> None:
    result = run_agent(_env(tmp_path, fake_nvml_dir, "healthy"), "--preflight", "--json")
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert report["ok"] is True and report["mode"] == "nvidia" and report["code"] is None
    assert [g["uuid"] for g in report["gpus"]] == [g["uuid"] for g in EXPECTED_GPUS]
    assert {g["driver_version"] for g in report["gpus"]} == {DRIVER_VERSION}
    assert {g["cuda_version"] for g in report["gpus"]} == {CUDA_VERSION}
    human = run_agent(_env(tmp_path, fake_nvml_dir, "healthy"), "--preflight")
    assert human.returncode == 0 and "PASSED" in human.stdout


def test_preflight_needs_no_control_plane_url(tmp_path: Path, fake_nvml_dir: Path) -> None:
    env = _env(tmp_path, fake_nvml_dir, "healthy")
    del env["MODELFORGE_AGENT_CONTROL_PLANE_URL"]
    assert run_agent(env, "--preflight").returncode == 0


def test_cpu_mode_needs_no_nvml(tmp_path: Path, fake_nvml_dir: Path) -> None:
    result = run_agent(_env(tmp_path, fake_nvml_dir, None, mode="cpu"), "--preflight", "--json")
    assert result.returncode == 0
    assert json.loads(result.stdout)["mode"] == "cpu"


def test_auto_mode_requires_nvml_only_when_nvidia_is_observed(
    tmp_path: Path, fake_nvml_dir: Path
) -> None:
    plain = run_agent(_env(tmp_path, fake_nvml_dir, None, mode="auto"), "--preflight", "--json")
    assert plain.returncode == 0 and json.loads(plain.stdout)["mode"] == "cpu"
    observed = run_agent(
        _env(tmp_path, fake_nvml_dir, None, mode="auto", NVIDIA_VISIBLE_DEVICES="all"),
        "--preflight",
        "--json",
    )
    assert observed.returncode == 3
    assert json.loads(observed.stdout)["code"] == "NVIDIA_NVML_UNAVAILABLE"
    with_gpus = run_agent(
        _env(tmp_path, fake_nvml_dir, "healthy", mode="auto", NVIDIA_VISIBLE_DEVICES="all"),
        "--preflight",
        "--json",
    )
    assert with_gpus.returncode == 0 and json.loads(with_gpus.stdout)["mode"] == "nvidia"


@pytest.mark.parametrize(("scenario", "code"), FAILURES)
def test_agent_start_fails_closed_and_sends_nothing(
    tmp_path: Path,
    fake_nvml_dir: Path,
    recording_server: RecordingServer,
    scenario: str | None,
    code: str,
) -> None:
    env = _env(tmp_path, fake_nvml_dir, scenario, url=recording_server.url)
    result = run_agent(env)
    assert result.returncode == 3, result.stderr
    assert [c for c in CODES if c in result.stderr] == [code]
    assert recording_server.requests == []
    assert not (tmp_path / "state" / "identity.json").exists()
