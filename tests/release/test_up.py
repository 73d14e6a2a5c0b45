"""What `up` checks before Compose is ever run — the bundle's signature and manifest, the record
`load` left in the state directory, the services Compose would start — and how its command line
is read. The runs against a real engine are in tests/e2e_docker/test_release_docker.py."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

import pytest

from modelforge_contracts.release_manifest import MANIFEST_FILE, manifest_for, parse_manifest
from release import state
from release.archive import write_images_tar
from release.checksums import render_sha256sums
from release.cli import main, parser
from release.up import _plan, _targets
from release.verify import TEMPLATE, images_tar_name
from tests.release.synthetic import VERSION, synthetic_images

COMPOSE = Path(__file__).resolve().parents[2] / "compose" / "docker-compose.yml"
RECORDED = {
    f"{name}:{VERSION}": f"sha256:{index}" + "0" * 63
    for index, name in enumerate(
        ["modelforge-control-plane", "modelforge-node-agent", "modelforge-runtime-worker"]
    )
}


@pytest.fixture(scope="module")
def signed(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, Path]:
    root = tmp_path_factory.mktemp("up")
    private, public = root / "cosign.key", root / "cosign.pub"
    assert main(["keygen", "--private", str(private), "--public", str(public)]) == 0
    images = synthetic_images(root / "layers")
    bundle = root / "bundle"
    bundle.mkdir()
    write_images_tar(images, bundle / images_tar_name(VERSION))
    (bundle / MANIFEST_FILE).write_text(manifest_for(images, version=VERSION, protocol=1).dumps())
    (bundle / "sbom").mkdir()
    for image in images:
        (bundle / "sbom" / f"{image.name}.cdx.json").write_text("{}")
    assert main(["bundle", str(bundle)]) == 0
    assert main(["sign", str(bundle), "--key", str(private)]) == 0
    return bundle, private, public


@pytest.fixture
def state_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    folder = tmp_path / "state"
    monkeypatch.setenv(state.STATE_DIR_VARIABLE, str(folder))
    return folder


@pytest.fixture
def loaded(signed: tuple[Path, Path, Path], state_dir: Path, tmp_path: Path) -> Path:
    """A copy of the signed bundle, to edit, and the record `load` leaves after loading it."""
    bundle = tmp_path / "bundle"
    shutil.copytree(signed[0], bundle)
    raw = (bundle / MANIFEST_FILE).read_bytes()
    state.write_record(state.LoadRecord(VERSION, hashlib.sha256(raw).hexdigest(), dict(RECORDED)))
    return bundle


def _up(bundle: Path, public: Path, capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    capsys.readouterr()
    code = main(["up", str(bundle), "--key", str(public), "-f", str(COMPOSE), "control-plane"])
    return code, capsys.readouterr().err


def test_up_refuses_a_release_manifest_edited_after_load(
    signed: tuple[Path, Path, Path], loaded: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    bundle = loaded
    data = json.loads((bundle / MANIFEST_FILE).read_text())
    data["images"]["modelforge-node-agent"]["labels"]["io.modelforge.protocol"] = "2"
    (bundle / MANIFEST_FILE).write_text(json.dumps(data))

    code, err = _up(bundle, signed[2], capsys)

    assert code == 1
    assert "release-manifest.json: SHA-256 expected" in err and "(from SHA256SUMS)" in err


def test_up_refuses_a_signed_manifest_other_than_the_loaded_one(
    signed: tuple[Path, Path, Path], loaded: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    bundle = loaded
    # The same release, signed with the real key, but a manifest that was never loaded.
    (bundle / MANIFEST_FILE).write_text((bundle / MANIFEST_FILE).read_text() + "\n")
    (bundle / "SHA256SUMS").write_text(render_sha256sums(TEMPLATE, bundle, VERSION))
    assert main(["sign", str(bundle), "--key", str(signed[1])]) == 0

    code, err = _up(bundle, signed[2], capsys)

    assert code == 1
    assert "the manifest `load` verified and loaded" in err


def test_up_without_a_load_says_to_run_load(
    signed: tuple[Path, Path, Path], state_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, err = _up(signed[0], signed[2], capsys)
    assert code == 1
    assert f"no record of a load of release {VERSION} in {state_dir}" in err
    assert "run `modelforge-release load`" in err


def test_up_refuses_a_bundle_signed_by_another_key(
    signed: tuple[Path, Path, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    other = tmp_path / "other.pub"
    assert main(["keygen", "--private", str(tmp_path / "other.key"), "--public", str(other)]) == 0
    code, err = _up(signed[0], other, capsys)
    assert code == 1 and "SHA256SUMS.sig does not verify against the public key" in err


def test_up_reads_options_and_services_in_any_order() -> None:
    args = parser().parse_args(
        ["up", "B", "-f", "a.yml", "control-plane", "--key", "k.pub", "-p", "mf", "postgres"]
        + ["-f", "b.yml"]
    )
    assert args.bundle == Path("B") and args.key == Path("k.pub") and args.project == "mf"
    assert args.compose_file == [Path("a.yml"), Path("b.yml")]
    assert args.services == ["control-plane", "postgres"]


def test_state_directory_is_configurable_and_defaults_outside_the_bundle(tmp_path: Path) -> None:
    assert state.state_dir({state.STATE_DIR_VARIABLE: str(tmp_path / "s")}) == tmp_path / "s"
    assert state.state_dir({"XDG_STATE_HOME": "/var/lib/x"}) == Path(
        "/var/lib/x/modelforge-release"
    )
    assert state.state_dir({}) == Path.home() / ".local" / "state" / "modelforge-release"


def test_load_record_round_trips_with_mode_0600(state_dir: Path) -> None:
    record = state.LoadRecord(VERSION, "ab" * 32, dict(RECORDED))
    path = state.write_record(record)
    assert path == state_dir / VERSION / "loaded-images.json"
    assert path.stat().st_mode & 0o777 == 0o600
    assert state.read_record(VERSION) == record
    path.write_text("[" * 10_000 + "]" * 10_000)
    with pytest.raises(state.StateError, match="nested more than"):
        state.read_record(VERSION)


def _manifest(bundle: Path) -> object:
    return parse_manifest((bundle / MANIFEST_FILE).read_bytes())


def test_a_release_image_runs_only_under_its_own_service(signed: tuple[Path, Path, Path]) -> None:
    manifest = _manifest(signed[0])
    declared = {
        "control-plane": {"image": f"modelforge-control-plane:{VERSION}"},
        "node-agent": {"image": f"modelforge-control-plane:{VERSION}"},
        "helper": {"image": f"modelforge-runtime-worker:{VERSION}"},
    }

    plan, problems = _plan(declared, declared, manifest, RECORDED)  # type: ignore[arg-type]

    assert plan == {"control-plane": RECORDED[f"modelforge-control-plane:{VERSION}"]}
    assert problems == [
        f"service helper: image modelforge-runtime-worker:{VERSION} is the release image "
        "modelforge-runtime-worker; a release image runs only under its own service",
        f"service node-agent: image expected modelforge-node-agent:{VERSION} (its release "
        f"image), found modelforge-control-plane:{VERSION}; a release image runs only under "
        "its own service",
    ]


def test_postgres_by_tag_is_refused_with_how_to_load_it(signed: tuple[Path, Path, Path]) -> None:
    declared = {"postgres": {"image": "postgres:16-bookworm", "profiles": ["postgres"]}}
    plan, problems = _plan(declared, ["postgres"], _manifest(signed[0]), RECORDED)  # type: ignore[arg-type]
    assert plan == {}
    (problem,) = problems
    assert "service postgres: image expected a reference by digest" in problem
    assert "found 'postgres:16-bookworm'" in problem
    assert "MODELFORGE_POSTGRES_IMAGE=<name>@sha256:<digest>" in problem
    assert "docker image load -i postgres.tar" in problem


def test_targets_follow_profiles_requests_and_dependencies() -> None:
    declared = {
        "control-plane": {"depends_on": {"postgres": {"condition": "service_healthy"}}},
        "postgres": {"profiles": ["postgres"]},
        "node-agent": {"depends_on": ["runtime-worker"]},
        "runtime-worker": {},
    }
    everything = {"control-plane", "postgres", "node-agent", "runtime-worker"}
    assert _targets(declared, [], "") == everything  # a dependency is started all the same
    assert _targets({"postgres": {"profiles": ["postgres"]}, "a": {}}, [], "") == {"a"}
    assert _targets({"postgres": {"profiles": ["postgres"]}}, [], "x,postgres") == {"postgres"}
    assert _targets(declared, ["node-agent"], "") == {"node-agent", "runtime-worker"}


def _substitute_engine(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, answer: str) -> Path:
    """A `docker` first on PATH: it writes down each call, answers `docker version` with
    `answer` (a shell command), has Compose v2 (which runs nothing) and no images.
    Returns the file of calls."""
    folder = tmp_path / "engine-bin"
    folder.mkdir()
    calls = tmp_path / "docker-calls"
    script = folder / "docker"
    script.write_text(
        "#!/bin/sh\n"
        f'echo "$*" >> {calls}\n'
        'case "$1" in\n'
        f"  version) {answer} ;;\n"
        "  compose) exit 0 ;;\n"
        "esac\n"
        "echo 'substitute engine: no such object' >&2\n"
        "exit 1\n"
    )
    script.chmod(0o755)
    monkeypatch.setenv("PATH", f"{folder}:{os.environ['PATH']}")
    return calls


def test_up_refuses_a_docker_engine_older_than_24_before_anything_else(
    signed: tuple[Path, Path, Path],
    loaded: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    calls = _substitute_engine(tmp_path, monkeypatch, "echo 20.10.24+dfsg1; exit 0")

    code, err = _up(loaded, signed[2], capsys)

    assert code == 1
    assert err.splitlines() == [
        "modelforge-release up: the Docker Engine is 20.10.24+dfsg1, older than 24: ModelForge "
        "needs Docker Engine 24 or later (docs/nodes.md); upgrade the engine, or pass "
        "--allow-old-docker to start on it anyway, unsupported"
    ]
    # The engine was asked its own version (not the client's), and nothing else: no Compose.
    assert calls.read_text().splitlines() == ["version --format {{.Server.Version}}"]


@pytest.mark.parametrize("version", ["24.0.7", "28.2.2", "v27.1.0"])
def test_up_goes_on_with_a_docker_engine_of_24_or_later(
    signed: tuple[Path, Path, Path],
    loaded: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    version: str,
) -> None:
    calls = _substitute_engine(tmp_path, monkeypatch, f"echo {version}; exit 0")

    code, err = _up(loaded, signed[2], capsys)

    assert code == 1  # the substitute engine holds no release image
    assert "older than" not in err and f"{VERSION} is not loaded" in err
    made = calls.read_text().splitlines()
    assert made[0] == "version --format {{.Server.Version}}"
    assert any(call.startswith("image inspect modelforge-") for call in made[1:])


def test_up_starts_on_an_old_engine_only_when_told_and_says_so(
    signed: tuple[Path, Path, Path],
    loaded: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    calls = _substitute_engine(tmp_path, monkeypatch, "echo 20.10.24; exit 0")
    capsys.readouterr()

    code = main(
        ["up", str(loaded), "--key", str(signed[2]), "-f", str(COMPOSE), "--allow-old-docker"]
    )

    err = capsys.readouterr().err
    assert code == 1  # went on, to the images the substitute engine does not hold
    assert (
        "warning: the Docker Engine is 20.10.24, older than 24; starting on it anyway "
        "(--allow-old-docker), unsupported"
    ) in err
    assert f"{VERSION} is not loaded" in err
    assert any(call.startswith("image inspect ") for call in calls.read_text().splitlines())


@pytest.mark.parametrize(
    ("answer", "message"),
    [
        (
            "echo 'Cannot connect to the Docker daemon at unix:///var/run/docker.sock.' >&2; "
            "exit 1",
            "`docker version --format` failed (exit 1): Cannot connect to the Docker daemon",
        ),
        ("echo podman; exit 0", "the Docker Engine reports version 'podman', not a Docker"),
        ("exit 0", "`docker version` reported no engine version"),
    ],
)
def test_up_stops_when_the_engine_version_cannot_be_read(
    signed: tuple[Path, Path, Path],
    loaded: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    answer: str,
    message: str,
) -> None:
    calls = _substitute_engine(tmp_path, monkeypatch, answer)

    code, err = _up(loaded, signed[2], capsys)

    assert code == 1
    assert message in err and len(err.splitlines()) == 1
    assert calls.read_text().splitlines() == ["version --format {{.Server.Version}}"]
