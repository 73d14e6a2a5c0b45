"""The GPU health watch (node_agent.gpu_health) through the substitute NVML and the real pynvml:
a process of its own runs a `GpuWatcher` whose `on_change` prints each snapshot, and the test
injects faults through the substitute's control file while it runs."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest

from tests.e2e.node import wait_until
from tests.node_agent.conftest import (
    CLAIM,
    ENROLL,
    ENROLLED,
    HEARTBEAT,
    TELEMETRY,
    Answer,
    Recorded,
    RecordingServer,
    agent_env,
    no_work,
    start_agent,
    stop_agent,
)
from tests.nvml_substitute import CONTROL_ENV, EXPECTED_GPUS, FaultInjector

REPO = Path(__file__).resolve().parents[2]
GPU0, GPU1 = (gpu["uuid"] for gpu in EXPECTED_GPUS)

#: Runs a watcher with the keyword arguments in argv[1] until its stdin closes; one JSON line
#: per `on_change`, then one with what `seen()` holds.
DRIVER = """
import json, sys, threading
from node_agent.gpu_health import GpuWatcher

stop = threading.Event()
options = json.loads(sys.argv[1])
if "gpus" in options:  # index -> uuid, its keys strings in JSON
    options["gpus"] = {int(index): uuid for index, uuid in options["gpus"].items()}
watcher = GpuWatcher(
    on_change=lambda gpus: print(json.dumps({"gpus": gpus}), flush=True), **options
)
thread = threading.Thread(target=watcher.run, args=(stop,))
thread.start()
sys.stdin.read()
stop.set()
thread.join()
print(json.dumps({"seen": watcher.seen()}), flush=True)
"""


@dataclass
class Watch:
    faults: FaultInjector
    process: subprocess.Popen[str]
    #: (when it arrived, time.monotonic(); the snapshot)
    reports: list[tuple[float, list[dict[str, Any]]]] = field(default_factory=list)
    seen: list[dict[str, Any]] = field(default_factory=list)
    arrived: threading.Condition = field(default_factory=threading.Condition)

    def read(self) -> None:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            message = json.loads(line)
            with self.arrived:
                if "gpus" in message:
                    self.reports.append((time.monotonic(), message["gpus"]))
                else:
                    self.seen = message["seen"]
                self.arrived.notify_all()

    def report(
        self, accept: Callable[[list[dict[str, Any]]], bool], *, after: int = 0, timeout: float = 10
    ) -> tuple[float, list[dict[str, Any]]]:
        """The first report from the `after`-th on that `accept` takes."""
        deadline = time.monotonic() + timeout
        with self.arrived:
            while True:
                for at, gpus in self.reports[after:]:
                    if accept(gpus):
                        return at, gpus
                left = deadline - time.monotonic()
                if left <= 0 or self.process.poll() is not None:
                    raise AssertionError(f"no such report within {timeout} s: {self.reports}")
                self.arrived.wait(left)

    def first(self) -> list[dict[str, Any]]:
        return self.report(lambda gpus: True)[1]


def _state(index: int, state: str) -> Callable[[list[dict[str, Any]]], bool]:
    return lambda gpus: gpus[index]["state"] == state


@contextmanager
def watching(
    fake_nvml_dir: Path, tmp_path: Path, scenario: str | None = None, **options: Any
) -> Iterator[Watch]:
    """A watcher process over the substitute's two GPUs, faults through `Watch.faults`; lines
    already in the control file apply from its first reading."""
    control = tmp_path / "nvml-control"
    control.touch()
    env = agent_env(
        tmp_path / "state",
        nvml_dir=fake_nvml_dir,
        scenario=scenario,
        **{CONTROL_ENV: str(control)},
    )
    options.setdefault("poll_seconds", 0.1)
    with (tmp_path / "watcher.log").open("w") as log:
        process = subprocess.Popen(
            [sys.executable, "-c", DRIVER, json.dumps(options)],
            cwd=REPO,
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=log,
            text=True,
        )
    watch = Watch(FaultInjector(control), process)
    reader = threading.Thread(target=watch.read, daemon=True)
    reader.start()
    try:
        yield watch
    finally:
        assert process.stdin is not None
        process.stdin.close()
        try:
            process.wait(timeout=20)
        finally:
            process.kill()
        reader.join(timeout=5)
        assert process.stdout is not None
        process.stdout.close()
    assert process.returncode == 0, (tmp_path / "watcher.log").read_text()


def test_first_snapshot_every_gpu_healthy(fake_nvml_dir: Path, tmp_path: Path) -> None:
    with watching(fake_nvml_dir, tmp_path) as watch:
        gpus = watch.first()
    assert gpus == [
        {"index": 0, "uuid": GPU0, "state": "healthy", "reason": "", "evidence": []},
        {"index": 1, "uuid": GPU1, "state": "healthy", "reason": "", "evidence": []},
    ]


def test_xid_79_makes_gpu_1_unhealthy_within_a_second(fake_nvml_dir: Path, tmp_path: Path) -> None:
    with watching(fake_nvml_dir, tmp_path) as watch:
        watch.first()
        injected, wall = time.monotonic(), datetime.now(UTC)
        watch.faults.xid(1, 79)
        at, gpus = watch.report(_state(1, "unhealthy"))
    assert at - injected < 1.0, f"reported {at - injected:.3f} s after the XID"
    assert gpus[0]["state"] == "healthy"
    [evidence] = gpus[1]["evidence"]
    assert evidence["kind"] == "xid"
    assert evidence["xid"] == 79
    assert evidence["detail"] == "XID 79 (GPU has fallen off the bus)"
    observed = datetime.fromisoformat(evidence["at"])
    assert observed.utcoffset() == timedelta(0)
    assert wall - timedelta(seconds=1) <= observed <= wall + timedelta(seconds=2)
    assert gpus[1]["reason"] == "XID 79 (GPU has fallen off the bus)"
    assert gpus[1]["xid_counts"] == {"79": 1}
    assert watch.seen[0]["uuid"] == GPU1 and watch.seen[0]["xid"] == 79


def test_xid_13_a_hundred_times_is_counted_and_changes_nothing(
    fake_nvml_dir: Path, tmp_path: Path
) -> None:
    with watching(fake_nvml_dir, tmp_path) as watch:
        watch.first()
        for _ in range(100):
            watch.faults.xid(1, 13)
        # Events come in order: once this one is reported, the hundred before it were handled.
        watch.faults.xid(0, 48)
        _, gpus = watch.report(_state(0, "unhealthy"))
        reports = len(watch.reports)
    assert reports == 2, "an application XID changed the report"
    assert gpus[1]["state"] == "healthy"
    assert gpus[1]["evidence"] == []
    assert gpus[1]["xid_counts"] == {"13": 100}
    counted = [s for s in watch.seen if s["uuid"] == GPU1]
    assert len(counted) == 100
    assert all(s["xid"] == 13 and s["counted"] for s in counted)


# Each fault on GPU 1, the evidence it leaves and the state it makes; a reset clears it.
FAULTS: list[tuple[str, Callable[[FaultInjector], None], str, str]] = [
    ("lost", lambda f: f.lose(1), "lost", "unhealthy"),
    (
        "volatile uncorrected ECC",
        lambda f: f.ecc(1, "uncorrected", "volatile", 2),
        "ecc",
        "unhealthy",
    ),
    (
        "remap pending",
        lambda f: f.remap(1, 0, 1, pending=True, failure=False),
        "remap",
        "unhealthy",
    ),
    ("retired pages pending", lambda f: f.retired_pending(1, True), "retired_pages", "unhealthy"),
    ("hardware thermal slowdown", lambda f: f.throttle(1, 0x40), "throttle", "degraded"),
    (
        "corrected ECC growing",
        lambda f: f.ecc(1, "corrected", "volatile", 160),
        "corrected_ecc",
        "degraded",
    ),
]


@pytest.mark.parametrize(
    ("inject", "kind", "state"), [f[1:] for f in FAULTS], ids=[f[0] for f in FAULTS]
)
def test_a_fault_judged_then_a_reset_healthy_again(
    fake_nvml_dir: Path,
    tmp_path: Path,
    inject: Callable[[FaultInjector], None],
    kind: str,
    state: str,
) -> None:
    faults = FaultInjector(tmp_path / "nvml-control")
    faults.ecc(1, "corrected", "volatile", 10)  # read from the start: growth is measured from it
    options: dict[str, Any] = {"throttle_window": 0.5, "corrected_ecc_threshold": 100}
    with watching(fake_nvml_dir, tmp_path, **options) as watch:
        watch.first()
        inject(watch.faults)
        _, gpus = watch.report(_state(1, state))
        after = len(watch.reports)
        watch.faults.reset(1)
        _, healthy = watch.report(_state(1, "healthy"), after=after)
    assert [e["kind"] for e in gpus[1]["evidence"]] == [kind]
    assert gpus[1]["reason"] == gpus[1]["evidence"][0]["detail"]
    assert gpus[0]["state"] == "healthy"
    assert healthy[1]["evidence"] == [] and healthy[1]["reason"] == ""


def test_a_remap_failure_outlasts_a_reset(fake_nvml_dir: Path, tmp_path: Path) -> None:
    with watching(fake_nvml_dir, tmp_path) as watch:
        watch.first()
        watch.faults.remap(1, 0, 3, pending=False, failure=True)
        watch.report(_state(1, "unhealthy"))
        watch.faults.reset(1)
        watch.faults.xid(0, 48)  # a marker: the reset was read before it
        _, gpus = watch.report(_state(0, "unhealthy"))
    assert gpus[1]["state"] == "unhealthy"
    assert gpus[1]["evidence"][0]["kind"] == "remap"
    assert gpus[1]["evidence"][0]["detail"].startswith("row remapping failed")


def test_xid_79_holds_until_the_lost_gpu_is_reset(fake_nvml_dir: Path, tmp_path: Path) -> None:
    with watching(fake_nvml_dir, tmp_path) as watch:
        watch.first()
        watch.faults.xid(1, 79)
        watch.faults.lose(1)
        _, lost = watch.report(lambda gpus: len(gpus[1]["evidence"]) == 2)
        after = len(watch.reports)
        watch.faults.reset(1)
        _, healthy = watch.report(_state(1, "healthy"), after=after)
    assert [e["kind"] for e in lost[1]["evidence"]] == ["xid", "lost"]
    assert lost[1]["state"] == "unhealthy"
    assert healthy[1]["xid_counts"] == {"79": 1}  # counted for the watcher's life


def test_a_hardware_xid_without_a_reset_is_held_for_the_hold(
    fake_nvml_dir: Path, tmp_path: Path
) -> None:
    with watching(fake_nvml_dir, tmp_path, hold_seconds=1.0) as watch:
        watch.first()
        watch.faults.xid(1, 74)
        unhealthy_at, _ = watch.report(_state(1, "unhealthy"))
        after = len(watch.reports)
        healthy_at, _ = watch.report(_state(1, "healthy"), after=after)
    assert 0.9 <= healthy_at - unhealthy_at < 3.0


def test_aggregate_uncorrected_ecc_growing_is_unhealthy(
    fake_nvml_dir: Path, tmp_path: Path
) -> None:
    FaultInjector(tmp_path / "nvml-control").ecc(1, "uncorrected", "aggregate", 3)
    with watching(fake_nvml_dir, tmp_path) as watch:
        assert watch.first()[1]["state"] == "healthy"  # an old count is history, not a fault
        watch.faults.ecc(1, "uncorrected", "aggregate", 5)
        _, gpus = watch.report(_state(1, "unhealthy"))
    [evidence] = gpus[1]["evidence"]
    assert evidence["kind"] == "ecc"
    assert evidence["value"] == 5
    assert evidence["detail"] == "aggregate uncorrected ECC errors grew from 3 to 5"


def test_nvml_failing_is_logged_once_and_tried_again(fake_nvml_dir: Path, tmp_path: Path) -> None:
    """NVML cannot be initialised: the watch neither dies nor reports, and says so once while
    it tries again (after 1 s, then 2 s). The substitute complains of an unknown scenario at
    each nvmlInit, so its lines count the tries."""
    with watching(fake_nvml_dir, tmp_path, scenario="no-such-scenario") as watch:
        time.sleep(3.5)
        assert watch.process.poll() is None
    log = (tmp_path / "watcher.log").read_text()
    assert watch.reports == []
    assert log.count("fake NVML: unknown MODELFORGE_FAKE_NVML_SCENARIO") >= 2, log
    assert log.count("GPU health watch: cannot initialise NVML") == 1, log
    assert "trying again with backoff up to 60 s" in log


GPU_HEALTH = "/api/v1/agent/gpu-health"


def test_the_agent_reports_gpu_health_at_once_and_again(
    fake_nvml_dir: Path, tmp_path: Path
) -> None:
    """A whole agent on the substitute's two GPUs: the first report once the watch read them,
    the XID's report within a second, the body as the contract says."""

    with _health_agent(fake_nvml_dir, tmp_path, ENROLLED) as (server, control, log):

        def reports() -> list[Recorded]:
            return [r for r in list(server.requests) if r.path == GPU_HEALTH]

        wait_until(lambda: reports(), 30, "the first GPU health report")
        first = json.loads(reports()[0].body)
        assert [(g["uuid"], g["state"]) for g in first["gpus"]] == [
            (GPU0, "healthy"),
            (GPU1, "healthy"),
        ]
        injected = time.monotonic()
        FaultInjector(control).xid(1, 79)
        wait_until(lambda: len(reports()) >= 2, 10, "the XID's report")
        second = reports()[1]
        assert second.at - injected < 1.0, f"sent {second.at - injected:.3f} s after the XID"
        assert second.headers["Authorization"] == f"Bearer {ENROLLED['credential']}"
        gpus = json.loads(second.body)["gpus"]
        assert gpus[0]["state"] == "healthy"
        assert gpus[1]["state"] == "unhealthy"
        assert gpus[1]["evidence"][0]["xid"] == 79
    assert "GPU 1 (GPU-66666666-7777-8888-9999-000000000000) is now unhealthy" in log.read_text()


def test_a_gpu_lost_from_the_start_is_watched_as_lost_until_it_answers(
    fake_nvml_dir: Path, tmp_path: Path
) -> None:
    """NVML answers GPU_IS_LOST to the lookup of GPU 1 (as real NVML does for a GPU off the
    bus) from the watch's start: the watch runs, GPU 1 unhealthy (lost), GPU 0 healthy; once
    it answers again, after a reset, it is healthy and registered for its XID events."""
    (tmp_path / "nvml-control").write_text("lost 1\n")
    with watching(fake_nvml_dir, tmp_path, gpus={0: GPU0, 1: GPU1}) as watch:
        first = watch.first()
        assert [(g["uuid"], g["state"]) for g in first] == [(GPU0, "healthy"), (GPU1, "unhealthy")]
        assert [e["kind"] for e in first[1]["evidence"]] == ["lost"]
        watch.faults.reset(1)
        count = len(watch.reports)
        watch.report(_state(1, "healthy"), after=count)
        watch.faults.xid(1, 79)
        _, gpus = watch.report(_state(1, "unhealthy"), after=count)
        assert gpus[1]["evidence"][-1]["xid"] == 79
    assert "unexpected error" not in (tmp_path / "watcher.log").read_text()


def test_a_gpu_lost_before_its_uuid_was_read_is_left_out_and_said(
    fake_nvml_dir: Path, tmp_path: Path
) -> None:
    """Asked to watch every GPU, the watch cannot name one lost from the start (its UUID is
    unreadable): it watches the others and logs the one it leaves out."""
    (tmp_path / "nvml-control").write_text("lost 1\n")
    with watching(fake_nvml_dir, tmp_path) as watch:
        assert [(g["uuid"], g["state"]) for g in watch.first()] == [(GPU0, "healthy")]
    log = (tmp_path / "watcher.log").read_text()
    assert "GPU 1 is lost (GPU is lost): not watched" in log
    assert "NVML failed" not in log


def test_the_agent_s_telemetry_goes_on_while_a_gpu_is_lost(
    fake_nvml_dir: Path, tmp_path: Path
) -> None:
    """GPU 1 falls off the bus while the agent runs (NVML answers GPU_IS_LOST, its handle's
    lookup included): telemetry goes on with GPU 0's readings and GPU 1's index and UUID, the
    heartbeat says which GPU gave none, the health report has GPU 1 unhealthy (lost); after a
    reset GPU 1's readings come back. No loop fails."""

    enrolled = dict(ENROLLED, heartbeat_interval_seconds=0.2, telemetry_interval_seconds=0.2)
    with _health_agent(fake_nvml_dir, tmp_path, enrolled) as (server, control, log):

        def bodies(path: str) -> list[dict[str, Any]]:
            return [json.loads(r.body) for r in list(server.requests) if r.path == path]

        def telemetry_where(accept: Callable[[list[dict[str, Any]]], bool]) -> bool:
            return any(accept(body["gpus"]) for body in bodies(TELEMETRY))

        wait_until(lambda: bodies(GPU_HEALTH), 30, "the first GPU health report")
        FaultInjector(control).lose(1)
        wait_until(
            lambda: telemetry_where(lambda g: "utilization_percent" not in g[1]),
            10,
            "telemetry without GPU 1's readings",
        )
        lost = next(
            body["gpus"]
            for body in bodies(TELEMETRY)
            if "utilization_percent" not in body["gpus"][1]
        )
        assert lost[1] == {"index": 1, "uuid": GPU1}
        assert "utilization_percent" in lost[0] and lost[0]["uuid"] == GPU0
        wait_until(
            lambda: any(
                "NVML returned no utilisation for GPU(s) [1]" in b["health"].get("message", "")
                for b in bodies(HEARTBEAT)
            ),
            10,
            "a heartbeat naming GPU 1",
        )
        wait_until(
            lambda: any(b["gpus"][1]["state"] == "unhealthy" for b in bodies(GPU_HEALTH)),
            10,
            "GPU 1 reported unhealthy",
        )
        report = [b for b in bodies(GPU_HEALTH) if b["gpus"][1]["state"] == "unhealthy"][0]
        assert [e["kind"] for e in report["gpus"][1]["evidence"]] == ["lost"]
        seen = len(bodies(TELEMETRY))
        FaultInjector(control).reset(1)
        wait_until(
            lambda: any(
                "utilization_percent" in body["gpus"][1] for body in bodies(TELEMETRY)[seen:]
            ),
            10,
            "GPU 1's readings back",
        )
    assert "unexpected error" not in log.read_text()


@contextmanager
def _health_agent(
    fake_nvml_dir: Path, tmp_path: Path, enrolled: dict[str, Any]
) -> Iterator[tuple[RecordingServer, Path, Path]]:
    """A whole agent on the substitute's GPUs (their health read every 0.2 s) against a
    recording control plane that answers its enrolment with `enrolled`: the server, the
    substitute's control file and the agent's log; at the end the agent stops (exit 0)."""

    def respond(request: Recorded) -> Answer:
        if request.path == ENROLL:
            return 200, enrolled
        if request.path == CLAIM:
            return no_work(request)
        if request.path == GPU_HEALTH:
            return 200, {"accepted": True}
        return 200, {}

    control = tmp_path / "nvml-control"
    control.touch()
    server = RecordingServer(respond=respond).start()
    env = agent_env(
        tmp_path / "state",
        url=server.url,
        mode="nvidia",
        nvml_dir=fake_nvml_dir,
        MODELFORGE_AGENT_GPU_HEALTH_POLL_SECONDS="0.2",
        **{CONTROL_ENV: str(control)},
    )
    log = tmp_path / "agent.log"
    agent = start_agent(env, log)
    try:
        yield server, control, log
    finally:
        assert stop_agent(agent) == 0, log.read_text()
        server.stop()
