"""The agent refuses bad configuration at start with a specific message and exit 2,
before sending anything; identity files are atomic and private."""

from __future__ import annotations

import socket
import stat
from pathlib import Path

import pytest

from node_agent.identity import Identity, IdentityStore, StateVolumeError
from tests.node_agent.conftest import RecordingServer, agent_env, run_agent


@pytest.mark.parametrize(
    ("url", "message"),
    [
        ("https://modelforge.example.internal:8000", "placeholder host"),
        ("https://example.com", "placeholder host"),
        ("https://cp.example", "placeholder host"),
        ("http://10.0.0.5:8000", "plain http://"),
        ("http://cp.lan:8000", "plain http://"),
        ("ftp://127.0.0.1", "https:// URL"),
        ("not a url", "https:// URL"),
    ],
)
def test_bad_control_plane_url_is_refused(tmp_path: Path, url: str, message: str) -> None:
    result = run_agent(agent_env(tmp_path / "state", url=url))
    assert result.returncode == 2
    assert "MODELFORGE_AGENT_CONTROL_PLANE_URL" in result.stderr and message in result.stderr
    assert "Traceback" not in result.stderr


@pytest.mark.parametrize(
    ("url", "message"),
    [
        ("http://10.0.0.5:8443", "plain http://"),
        ("https://artifacts.example", "placeholder host"),
        ("nas:8443", "https:// URL"),
    ],
)
def test_bad_artifact_url_is_refused_by_variable_and_by_flag(
    tmp_path: Path, url: str, message: str
) -> None:
    env = dict(agent_env(tmp_path / "state"), MODELFORGE_AGENT_ARTIFACT_URL=url)
    by_variable = run_agent(env)
    assert by_variable.returncode == 2
    assert "MODELFORGE_AGENT_ARTIFACT_URL" in by_variable.stderr and message in by_variable.stderr
    by_flag = run_agent(agent_env(tmp_path / "state"), "--artifact-url", url)
    assert by_flag.returncode == 2
    assert "--artifact-url" in by_flag.stderr and message in by_flag.stderr
    assert "Traceback" not in by_variable.stderr + by_flag.stderr


def test_loopback_http_is_allowed(tmp_path: Path, recording_server: RecordingServer) -> None:
    env = agent_env(tmp_path / "state", url=recording_server.url.replace("127.0.0.1", "localhost"))
    result = run_agent(env, timeout=30)
    assert result.returncode == 6  # reached the server, which refused the enrollment (404)
    assert recording_server.requests[0].path == "/api/v1/agent/enroll"


def _own_non_loopback_address() -> str:
    """This host's outbound interface address (a UDP connect sends no packet)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        probe.connect(("192.0.2.1", 9))
        address = str(probe.getsockname()[0])
    assert not address.startswith("127."), "this test needs a non-loopback interface"
    return address


def test_insecure_http_beyond_loopback_needs_explicit_opt_in(tmp_path: Path) -> None:
    server = RecordingServer(bind="0.0.0.0").start()  # noqa: S104 - on this host only
    try:
        url = f"http://{_own_non_loopback_address()}:{server.port}"
        refused = run_agent(agent_env(tmp_path / "state", url=url))
        assert refused.returncode == 2 and "MODELFORGE_AGENT_ALLOW_INSECURE_HTTP" in refused.stderr
        assert server.requests == []
        allowed = run_agent(
            agent_env(tmp_path / "state", url=url, MODELFORGE_AGENT_ALLOW_INSECURE_HTTP="true")
        )
        assert allowed.returncode == 6  # accepted, reached the server, enrollment refused (404)
        assert [r.path for r in server.requests] == ["/api/v1/agent/enroll"]
    finally:
        server.stop()


def test_missing_control_plane_url(tmp_path: Path) -> None:
    env = agent_env(tmp_path / "state")
    del env["MODELFORGE_AGENT_CONTROL_PLANE_URL"]
    result = run_agent(env)
    assert result.returncode == 2
    assert "MODELFORGE_AGENT_CONTROL_PLANE_URL: is required" in result.stderr


def _problems(stderr: str) -> list[str]:
    return stderr.split("invalid configuration:\n", 1)[1].splitlines()


def test_a_bad_variable_without_the_agent_prefix_is_named_as_set(tmp_path: Path) -> None:
    env = agent_env(tmp_path / "state", MODELFORGE_ARTIFACT_CACHE_BYTES="lots")
    result = run_agent(env)
    assert result.returncode == 2, result.stderr
    assert _problems(result.stderr)[0].startswith("MODELFORGE_ARTIFACT_CACHE_BYTES: ")
    assert "MODELFORGE_AGENT_MODELFORGE_" not in result.stderr
    assert "lots" not in result.stderr  # a value is never echoed: it may be a secret


def test_a_bad_preflight_variable_is_named(tmp_path: Path) -> None:
    env = agent_env(tmp_path / "state", MODELFORGE_AGENT_PREFLIGHT_TIMEOUT_SECONDS="soon")
    result = run_agent(env, "--preflight")
    assert result.returncode == 2, result.stderr
    assert _problems(result.stderr)[0].startswith("MODELFORGE_AGENT_PREFLIGHT_TIMEOUT_SECONDS: ")


def test_unwritable_state_volume(tmp_path: Path, recording_server: RecordingServer) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    result = run_agent(agent_env(blocker / "state", url=recording_server.url))
    assert result.returncode == 2
    assert "MODELFORGE_AGENT_STATE_VOLUME" in result.stderr and "not writable" in result.stderr
    assert recording_server.requests == []


def test_no_identity_and_no_token(tmp_path: Path, recording_server: RecordingServer) -> None:
    result = run_agent(agent_env(tmp_path / "state", url=recording_server.url, token=None))
    assert result.returncode == 2
    assert "MODELFORGE_AGENT_ENROLLMENT_TOKEN" in result.stderr
    assert recording_server.requests == []


def test_missing_ca_file(tmp_path: Path) -> None:
    env = agent_env(
        tmp_path / "state",
        url="https://127.0.0.1:9",
        MODELFORGE_AGENT_CA_CERT_PATH=str(tmp_path / "nope.pem"),
    )
    result = run_agent(env)
    assert result.returncode == 2 and "MODELFORGE_AGENT_CA_CERT_PATH" in result.stderr


def test_identity_is_written_atomically_and_privately(tmp_path: Path) -> None:
    store = IdentityStore(tmp_path / "state")
    store.check_writable()
    nonce = store.claim_nonce("mfe_token-a")
    assert store.claim_nonce("mfe_token-a") == nonce  # persisted before the claim
    assert store.claim_nonce("mfe_token-b") != nonce  # a different token, a different claim
    identity = Identity(
        node_id="node_1", control_plane_url="http://127.0.0.1:8000", credential="secret.jwt.value"
    )
    store.save(identity)
    path = tmp_path / "state" / "identity.json"
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert stat.S_IMODE((tmp_path / "state").stat().st_mode) == 0o700
    assert not (tmp_path / "state" / "claim.json").exists()
    assert [p.name for p in (tmp_path / "state").iterdir()] == ["identity.json"]
    assert IdentityStore(tmp_path / "state").load() == identity
    assert "secret.jwt.value" not in repr(identity)


def test_corrupt_identity_is_a_clear_error(tmp_path: Path) -> None:
    (tmp_path / "identity.json").write_text("{not json")
    with pytest.raises(StateVolumeError, match="cannot read"):
        IdentityStore(tmp_path).load()


def test_an_unknown_socket_group_is_refused(
    tmp_path: Path, recording_server: RecordingServer
) -> None:
    env = agent_env(
        tmp_path / "state",
        url=recording_server.url,
        MODELFORGE_AGENT_SOCKET_GROUP="no-such-group-modelforge",
    )
    result = run_agent(env)
    assert result.returncode == 2
    assert "MODELFORGE_AGENT_SOCKET_GROUP" in result.stderr
    assert "no group 'no-such-group-modelforge'" in result.stderr
    assert recording_server.requests == []


@pytest.mark.parametrize(
    ("variable", "value", "problem"),
    [
        ("MODELFORGE_AGENT_PARALLEL", "0", "greater than or equal to 1"),
        ("MODELFORGE_AGENT_PARALLEL", "257", "less than or equal to 256"),
        ("MODELFORGE_AGENT_PARALLEL", "three", "valid integer"),
        ("MODELFORGE_AGENT_CPUS", "0", "greater than or equal to 1"),
        ("MODELFORGE_AGENT_CPUS", "1.5", "valid integer"),
        ("MODELFORGE_AGENT_GPUS", "-1", "greater than or equal to 0"),
        ("MODELFORGE_AGENT_GPUS", "65", "less than or equal to 64"),
        ("MODELFORGE_AGENT_GPUS", "all", "valid integer"),
        ("MODELFORGE_AGENT_RAM_MB", "0", "greater than or equal to 1"),
        ("MODELFORGE_AGENT_RAM_MB", "16G", "valid integer"),
        ("MODELFORGE_AGENT_MAX_IDLE_SECONDS", "-5", "greater than or equal to 0"),
        ("MODELFORGE_AGENT_MAX_IDLE_SECONDS", "inf", "finite number"),
        ("MODELFORGE_AGENT_MAX_IDLE_SECONDS", "soon", "valid number"),
    ],
)
def test_a_bad_resource_or_idle_variable_is_refused_naming_it(
    tmp_path: Path, recording_server: RecordingServer, variable: str, value: str, problem: str
) -> None:
    env = agent_env(tmp_path / "state", url=recording_server.url, **{variable: value})
    result = run_agent(env)
    assert result.returncode == 2, result.stderr
    (line,) = _problems(result.stderr)
    assert line.startswith(f"{variable}: ") and problem in line
    assert value not in line.removeprefix(f"{variable}: ")  # the value is never echoed
    assert recording_server.requests == []


@pytest.mark.parametrize(
    ("flag", "value"),
    [
        ("--parallel", "-1"),
        ("--cpus", "many"),
        ("--gpus", "-2"),
        ("--ram-mb", "1.5"),
        ("--max-idle-seconds", "-1"),
        ("--max-idle-seconds", "nan"),
    ],
)
def test_a_bad_flag_is_refused_naming_it(
    tmp_path: Path, recording_server: RecordingServer, flag: str, value: str
) -> None:
    result = run_agent(agent_env(tmp_path / "state", url=recording_server.url), flag, value)
    assert result.returncode == 2
    assert f"argument {flag}: " in result.stderr
    assert recording_server.requests == []
