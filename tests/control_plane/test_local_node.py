"""The local node's supervisor (control_plane/local_node.py) in process: the flag and the
setting, the address the agent is given, what the children inherit, what is refused at start,
the restart backoff and the SIGTERM-then-SIGKILL stop. The children themselves run in
tests/e2e/test_local_node.py."""

from __future__ import annotations

import errno
import os
import socket
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from sqlalchemy import Engine, select
from sqlalchemy.orm import Session

from control_plane import local_node
from control_plane.cli import parse_args, wants_local_node
from control_plane.db import make_engine, migrate
from control_plane.local_node import LocalNode, LocalNodeError
from control_plane.models import AuditEntry, NodeEnrollment
from control_plane.security import sha256_hex
from control_plane.settings import Settings
from tests.e2e.server import control_plane_executable, free_port
from tests.node_agent.conftest import RecordingServer

ROOT = Path(__file__).resolve().parents[2]


def _settings(tmp_path: Path, **values: object) -> Settings:
    return Settings(data_dir=tmp_path / "data", **values)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("argv", "variable", "wanted"),
    [
        ([], None, False),
        ([], "true", True),
        ([], "false", False),
        (["--local-node"], "false", True),
        (["--no-local-node"], "true", False),
        (["--local-node"], None, True),
    ],
)
def test_the_flag_wins_over_the_setting(
    argv: list[str],
    variable: str | None,
    wanted: bool,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    if variable is not None:
        monkeypatch.setenv("MODELFORGE_LOCAL_NODE", variable)
    else:
        monkeypatch.delenv("MODELFORGE_LOCAL_NODE", raising=False)
    assert wants_local_node(parse_args(argv), Settings(data_dir=tmp_path)) is wanted


@pytest.mark.parametrize(
    ("values", "url"),
    [
        ({}, "http://127.0.0.1:8000"),
        ({"host": "0.0.0.0", "port": 9000}, "http://127.0.0.1:9000"),  # noqa: S104
        ({"host": "::"}, "http://[::1]:8000"),
        ({"host": "192.0.2.10"}, "http://192.0.2.10:8000"),
        ({"tls_cert": Path("c.pem"), "tls_key": Path("k.pem")}, "https://127.0.0.1:8000"),
        (
            {"tls_cert": Path("c.pem"), "tls_key": Path("k.pem"), "public_url": "https://cp.lan/"},
            "https://cp.lan",
        ),
    ],
)
def test_the_agent_reaches_the_control_plane_on_this_host(
    values: dict[str, object], url: str, tmp_path: Path
) -> None:
    assert local_node.control_plane_url(_settings(tmp_path, **values)) == url


def test_the_children_inherit_no_control_plane_secret(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("MODELFORGE_ADMIN_TOKEN", "mfa_" + "x" * 40)
    monkeypatch.setenv("MODELFORGE_DATABASE_URL", "postgresql+psycopg://u:secret@db/modelforge")
    monkeypatch.setenv("MODELFORGE_AGENT_PARALLEL", "3")
    monkeypatch.setenv("MODELFORGE_AGENT_ENROLLMENT_TOKEN", "mfe_from_the_environment")
    monkeypatch.setenv("MODELFORGE_AGENT_CONTROL_PLANE_URL", "https://elsewhere.test")
    node = LocalNode(_settings(tmp_path))
    # An identity on disk: nothing is minted.
    node.paths.agent_state.mkdir(parents=True)
    node.paths.identity.write_text("{}")
    agent = node._agent_environment()
    worker = node._worker_environment()
    for env in (agent, worker):
        assert "MODELFORGE_ADMIN_TOKEN" not in env
        assert "MODELFORGE_DATABASE_URL" not in env
        assert "MODELFORGE_AGENT_ENROLLMENT_TOKEN" not in env
    assert agent["MODELFORGE_AGENT_PARALLEL"] == "3"  # the operator's choice reaches the agent
    assert agent["MODELFORGE_AGENT_CONTROL_PLANE_URL"] == "http://127.0.0.1:8000"
    assert agent["MODELFORGE_AGENT_ACCELERATOR_MODE"] == "auto"
    assert agent["MODELFORGE_AGENT_WORKER_SOCKET"] == worker["MODELFORGE_WORKER_SOCKET"]
    assert "MODELFORGE_AGENT_ENROLLMENT_TOKEN_FILE" not in agent
    assert not any(name.startswith("MODELFORGE_AGENT_") for name in worker)


def test_the_local_agent_has_no_idle_exit(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # It would exit, be started again and exit again: it runs as long as its control plane.
    monkeypatch.setenv("MODELFORGE_AGENT_MAX_IDLE_SECONDS", "30")
    node = LocalNode(_settings(tmp_path))
    node.paths.agent_state.mkdir(parents=True)
    node.paths.identity.write_text("{}")
    assert "MODELFORGE_AGENT_MAX_IDLE_SECONDS" not in node._agent_environment()


def test_a_data_dir_too_deep_for_a_unix_socket_is_refused(tmp_path: Path) -> None:
    deep = tmp_path / ("d" * 120)
    with pytest.raises(LocalNodeError, match="too deep for the local node's unix sockets"):
        local_node.check(Settings(data_dir=deep))
    local_node.check(Settings(data_dir=tmp_path / "data"))  # a usual one is fine


def test_missing_packages_are_named(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(local_node, "_NEEDED_MODULES", ("node_agent", "no_such_module_here"))
    with pytest.raises(LocalNodeError, match=r"missing: no_such_module_here\)"):
        local_node.check(_settings(tmp_path))


def test_a_child_that_exits_is_started_again_after_a_growing_backoff(tmp_path: Path) -> None:
    node = LocalNode(_settings(tmp_path))
    worker = node.worker
    node._exited(worker, 1, ran=0.5, now=100.0)
    assert (worker.start_at, worker.backoff) == (101.0, 2.0)
    node._exited(worker, -9, ran=0.5, now=200.0)
    assert (worker.start_at, worker.backoff) == (202.0, 4.0)
    for _ in range(10):
        node._exited(worker, 1, ran=0.5, now=300.0)
    assert worker.backoff == local_node.MAX_BACKOFF_SECONDS
    node._exited(worker, 1, ran=local_node.STABLE_AFTER_SECONDS, now=400.0)
    assert worker.start_at == 401.0  # it had run a minute: the first backoff again


def test_one_control_plane_at_a_time_runs_the_local_node_of_a_data_dir(tmp_path: Path) -> None:
    # A port nothing listens on: the supervisors wait for a server that never answers.
    port = free_port()
    first = LocalNode(_settings(tmp_path, port=port))
    first.start()
    try:
        second = LocalNode(_settings(tmp_path, port=port))
        with pytest.raises(LocalNodeError, match="another control plane runs the local node"):
            second.start()
        assert not second._thread.is_alive()
    finally:
        first.stop()
    # Stopped, it lets the next one take it.
    third = LocalNode(_settings(tmp_path, port=port))
    third.start()
    third.stop()
    assert stat.S_IMODE(third.paths.lock.stat().st_mode) == 0o600


def test_a_local_node_directory_it_cannot_write_is_refused(tmp_path: Path) -> None:
    node = LocalNode(_settings(tmp_path))
    node.paths.root.parent.mkdir(parents=True)
    node.paths.root.write_text("")  # a file where its directory should be
    with pytest.raises(LocalNodeError, match="cannot prepare the local node's directory"):
        node.start()
    assert not node._thread.is_alive()


def test_an_agent_whose_credential_is_refused_is_left_stopped(tmp_path: Path) -> None:
    node = LocalNode(_settings(tmp_path))
    node._exited(node.agent, local_node.AGENT_CREDENTIAL_REFUSED, ran=3.0, now=100.0)
    assert node.agent.start_at is None


def test_a_refused_enrollment_token_is_dropped_for_a_new_one(tmp_path: Path) -> None:
    node = LocalNode(_settings(tmp_path))
    node.paths.root.mkdir(parents=True)
    node.paths.token_file.write_text("mfe_used")
    node._exited(node.agent, local_node.AGENT_ENROLLMENT_REFUSED, ran=3.0, now=100.0)
    assert not node.paths.token_file.exists()
    assert node.agent.start_at == 101.0


def test_a_child_that_ignores_sigterm_is_killed_after_the_grace(tmp_path: Path) -> None:
    node = LocalNode(_settings(tmp_path), grace=1.0)
    stubborn = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
            "print('ready', flush=True); time.sleep(60)",
        ],
        stdout=subprocess.PIPE,
        start_new_session=True,
    )
    assert stubborn.stdout is not None and stubborn.stdout.readline() == b"ready\n"
    node.worker.process = stubborn
    started = time.monotonic()
    node._stop_children()
    took = time.monotonic() - started
    stubborn.stdout.close()
    assert stubborn.returncode == -9
    assert 1.0 <= took < 10


def test_the_compose_appliance_runs_no_local_node() -> None:
    compose = yaml.safe_load((ROOT / "compose" / "docker-compose.yml").read_text())
    service = compose["services"]["control-plane"]
    environment = service.get("environment", {})
    assert str(environment.get("MODELFORGE_LOCAL_NODE", "false")).lower() == "false"
    assert "--local-node" not in " ".join(map(str, service.get("command") or []))


def test_the_start_is_refused_before_anything_is_written(tmp_path: Path) -> None:
    deep = tmp_path / ("d" * 120) / "data"
    env = {k: v for k, v in os.environ.items() if not k.startswith("MODELFORGE_")}
    ran = subprocess.run(
        [control_plane_executable(), "--local-node"],
        env={**env, "MODELFORGE_DATA_DIR": str(deep)},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert ran.returncode == 2, ran.stderr
    assert "too deep for the local node's unix sockets" in ran.stderr
    assert not deep.exists()


def test_an_agent_without_identity_gets_a_token_minted_into_a_private_file(
    tmp_path: Path,
) -> None:
    settings = _settings(tmp_path)
    settings.data_dir.mkdir()
    engine = make_engine(settings.sqlalchemy_url)
    migrate(engine)
    node = LocalNode(settings)
    node.paths.root.mkdir()
    env = node._agent_environment()
    token_file = Path(env["MODELFORGE_AGENT_ENROLLMENT_TOKEN_FILE"])
    assert token_file == node.paths.token_file
    assert stat.S_IMODE(token_file.stat().st_mode) == 0o600
    token = token_file.read_text()
    assert token.startswith("mfe_")
    with Session(engine) as session:
        enrollment = session.scalars(select(NodeEnrollment)).one()
        entry = session.scalars(select(AuditEntry)).one()
    assert enrollment.labels == {"local": "true"}
    assert enrollment.token_hash == sha256_hex(token)
    assert (entry.actor, entry.action, entry.target) == (
        "local-node",
        "enrollment.mint",
        enrollment.id,
    )
    # Started again before it enrolled: the same token, nothing minted.
    assert node._agent_environment()["MODELFORGE_AGENT_ENROLLMENT_TOKEN_FILE"] == str(token_file)
    assert token_file.read_text() == token
    with Session(engine) as session:
        assert len(session.scalars(select(NodeEnrollment)).all()) == 1
    engine.dispose()


def test_a_port_held_by_another_program_is_refused_before_anything_starts(
    tmp_path: Path,
) -> None:
    data = tmp_path / "data"
    env = {k: v for k, v in os.environ.items() if not k.startswith("MODELFORGE_")}
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        ran = subprocess.run(
            [control_plane_executable(), "--local-node"],
            env={**env, "MODELFORGE_DATA_DIR": str(data), "MODELFORGE_PORT": str(port)},
            capture_output=True,
            text=True,
            timeout=60,
        )
    assert ran.returncode == 2, ran.stderr
    assert ran.stderr.splitlines() == [
        f"modelforge-control-plane: MODELFORGE_PORT {port} is in use on 127.0.0.1: stop what "
        "holds it or choose another port"
    ]
    assert not (data / "local-node").exists()


def test_the_children_wait_for_this_control_planes_health_not_any_answer(
    tmp_path: Path,
) -> None:
    import threading

    body: dict[str, object] = {"detail": "Not Found"}
    server = RecordingServer(respond=lambda _request: (200, body)).start()
    try:
        node = LocalNode(_settings(tmp_path, port=server.port))
        answered: list[bool] = []
        waiting = threading.Thread(target=lambda: answered.append(node._wait_until_serving()))
        waiting.start()
        waiting.join(timeout=1.0)
        assert waiting.is_alive()  # another server's 200 is not this control plane
        body = {"status": "ok", "database": "ok", "storage": {"status": "ok"}}
        waiting.join(timeout=5.0)
        assert answered == [True]
    finally:
        server.stop()


def test_the_supervisor_does_nothing_until_the_server_has_forked_its_worker(
    tmp_path: Path,
) -> None:
    # `cli` gives it an event set once Granian forked its worker from this process: a request
    # under way at the fork (its first one imports httpcore) could leave a lock held for ever in
    # the worker.
    import threading

    server = RecordingServer(respond=lambda _request: (503, b"")).start()
    port = server.port
    node = LocalNode(_settings(tmp_path, port=port))
    forked = threading.Event()
    try:
        node.start(not_before=forked)
        time.sleep(1.0)
        assert server.requests == []
        forked.set()
        deadline = time.monotonic() + 10
        while not server.requests:
            assert time.monotonic() < deadline, "no health request once the fork was done"
            time.sleep(0.05)
        assert server.requests[0].path == "/api/v1/health"
    finally:
        node.stop()
        server.stop()
    # Stopped before the fork, it ends at once.
    waiting = LocalNode(_settings(tmp_path / "second", port=port))
    waiting.start(not_before=threading.Event())
    started = time.monotonic()
    waiting.stop()
    assert time.monotonic() - started < 2


def test_an_agent_whose_configuration_is_refused_is_left_stopped(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    node = LocalNode(_settings(tmp_path))
    node._exited(node.agent, local_node.AGENT_CONFIG_REFUSED, ran=3.0, now=100.0)
    assert node.agent.start_at is None
    assert "MODELFORGE_AGENT_* value" in caplog.text
    assert "then restart the control plane" in caplog.text


def _migrated(tmp_path: Path) -> tuple[Settings, Engine]:
    settings = _settings(tmp_path)
    settings.data_dir.mkdir()
    engine = make_engine(settings.sqlalchemy_url)
    migrate(engine)
    return settings, engine


def test_a_token_minted_in_this_run_is_minted_once_until_the_agent_enrolls(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    settings, engine = _migrated(tmp_path)
    node = LocalNode(settings)
    node.paths.root.mkdir()
    node._agent_environment()
    # The agent refuses it (expired, revoked): no second mint, the agent stays stopped.
    node._exited(node.agent, local_node.AGENT_ENROLLMENT_REFUSED, ran=3.0, now=100.0)
    assert node.agent.start_at is None
    assert not node.paths.token_file.exists()
    assert "restart the control plane to mint a new one" in caplog.text
    node._start(node.agent, 200.0)  # even if asked: nothing minted, nothing started
    assert (node.agent.process, node.agent.start_at) == (None, None)
    with Session(engine) as session:
        assert len(session.scalars(select(NodeEnrollment)).all()) == 1
    # Once the agent has enrolled, a later enrollment may mint again.
    node.paths.identity.parent.mkdir()
    node.paths.identity.write_text("{}")
    node._forget_token_once_enrolled()
    node.paths.identity.unlink()
    node._agent_environment()
    with Session(engine) as session:
        assert len(session.scalars(select(NodeEnrollment)).all()) == 2
    engine.dispose()


def test_a_token_that_cannot_be_written_is_revoked_and_the_agent_left_stopped(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    settings, engine = _migrated(tmp_path)
    node = LocalNode(settings)
    node.paths.root.mkdir()

    def full(path: Path, text: str) -> None:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(local_node, "write_private", full)
    node._start(node.agent, 100.0)
    assert (node.agent.process, node.agent.start_at) == (None, None)
    assert "No space left on device" in caplog.text
    assert "then restart the control plane" in caplog.text
    with Session(engine) as session:
        enrollment = session.scalars(select(NodeEnrollment)).one()
        actions = [e.action for e in session.scalars(select(AuditEntry).order_by(AuditEntry.id))]
    assert enrollment.state == "revoked"
    assert sorted(actions) == ["enrollment.mint", "enrollment.revoke"]
    engine.dispose()
