"""Image builds: reproducible IDs (whatever the umask), no shell or package manager, non-root,
labels, SBOMs, every ELF dependency inside the image, and runtime workers that run models: the
cpu flavour and the cuda flavour import numpy and onnxruntime and run an ONNX model in a chroot
of their unpacked layers (the cuda image is about 2.5 GB; a chroot avoids loading it into the
engine), and the cuda flavour's onnxruntime offers the CUDA execution provider, whose libraries
all load there (no GPU needed for that).

The e2e tests build real images with mmdebstrap (root, network to Debian's mirror and PyPI) and
take a few minutes; the others check the SBOM and the argument checks without building anything.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import tarfile
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from release import sbom
from release.images import PROJECT_DIR, BuiltImage, ImageBuildError, build_images
from release.oci import copy_project
from tests.onnx_models import relu_matmul

EPOCH = 1_700_000_000
VERSION = "0.1.0"
FORBIDDEN = re.compile(r"^(usr/)?s?bin/(\w*sh|apt[^/]*|dpkg[^/]*)$")
STATUS = """\
Package: libc6
Status: install ok installed
Architecture: amd64
Source: glibc
Version: 2.36-9+deb12u14
Description: GNU C Library
 shared libraries

Package: gone
Status: deinstall ok config-files
Version: 1.0

Package: libcrypt1
Status: install ok installed
Architecture: amd64
Source: libxcrypt
Version: 1:4.4.33-2
"""


def _entries(image: BuiltImage) -> list[tarfile.TarInfo]:
    members = []
    for layer in image.layers:
        with tarfile.open(layer) as tar:
            members.extend(tar.getmembers())
    return members


def _build(
    work_dir: Path, *, umask: int = 0o022, output: list[str] | None = None, **options: object
) -> list[BuiltImage]:
    """Build under `umask` (every file the build and its tools create gets its modes from it);
    the build's progress lines go to `output`."""
    lines = output if output is not None else []
    previous = os.umask(umask)
    try:
        return build_images(
            version=VERSION,
            revision="0123abc",
            source_date_epoch=EPOCH,
            work_dir=work_dir,
            progress=lines.append,
            project_dir=work_dir.parent / "project",
            **options,  # type: ignore[arg-type]
        )
    finally:
        os.umask(previous)


@pytest.fixture(scope="module")
def build_output() -> list[str]:
    return []


@pytest.fixture(scope="module")
def built(
    tmp_path_factory: pytest.TempPathFactory, build_output: list[str]
) -> Iterator[tuple[Path, list[BuiltImage]]]:
    """The cpu-flavour images, built once under umask 022 from a snapshot of the project (the
    same inputs for every build in this module, even while the checkout is being edited)."""
    if os.geteuid() != 0 or shutil.which("mmdebstrap") is None:
        pytest.fail(
            "building images needs root and mmdebstrap (apt-get install mmdebstrap)", pytrace=False
        )
    root = tmp_path_factory.mktemp("images")
    copy_project(PROJECT_DIR, root / "project")
    shutil.copytree(PROJECT_DIR / "locks", root / "project" / "locks")
    images = _build(root / "first", umask=0o022, output=build_output, worker_flavour="cpu")
    yield root / "first", images


def _unpack(image: BuiltImage, rootfs: Path) -> dict[str, str]:
    """Unpack the image's layers as a container runtime does (modes and owners kept); return
    the environment its config sets."""
    rootfs.mkdir()
    for layer in image.layers:
        subprocess.run(["tar", "-xpf", str(layer), "-C", str(rootfs)], check=True)
    config = json.loads(image.config_bytes)["config"]
    return dict(item.split("=", 1) for item in config["Env"])


def _run_in(rootfs: Path, env: dict[str, str], *argv: str) -> subprocess.CompletedProcess[str]:
    """Run `argv` in a chroot of `rootfs` as the image's user, with the image's environment."""
    return subprocess.run(
        ["chroot", "--userspec=10001:10001", str(rootfs), *argv],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


def _tiny_model() -> tuple[bytes, np.ndarray]:
    """y = relu(x @ w), made with the onnx package; returns the model and w."""
    weights = (np.arange(12, dtype=np.float32).reshape(4, 3) - 5) / 10
    return relu_matmul(weights), weights


# Runs in the image: imports numpy and onnxruntime, runs the model in /tmp/model.onnx on
# /tmp/x.npy with the providers the ONNX runner asks for, writes /tmp/y.npy, prints facts.
MODEL_RUN = """import json, numpy, onnxruntime
available = onnxruntime.get_available_providers()
wanted = ["CUDAExecutionProvider"] if "CUDAExecutionProvider" in available else []
wanted.append("CPUExecutionProvider")
session = onnxruntime.InferenceSession("/tmp/model.onnx", providers=wanted)
numpy.save("/tmp/y.npy", session.run(None, {"x": numpy.load("/tmp/x.npy")})[0])
print(json.dumps({"available": available, "used": session.get_providers(),
                  "numpy": numpy.__version__, "onnxruntime": onnxruntime.__version__}))
"""


def _runs_the_model(rootfs: Path, env: dict[str, str]) -> dict[str, object]:
    """Run MODEL_RUN in the image; check its output against numpy here; return its facts."""
    model, weights = _tiny_model()
    x = np.random.default_rng(3).standard_normal((5, 4)).astype(np.float32)
    (rootfs / "tmp/model.onnx").write_bytes(model)
    np.save(rootfs / "tmp/x.npy", x)

    done = _run_in(rootfs, env, "python3", "-c", MODEL_RUN)

    assert done.returncode == 0, done.stderr
    y = np.load(rootfs / "tmp/y.npy")
    np.testing.assert_allclose(y, np.maximum(x @ weights, 0), rtol=1e-5, atol=1e-6)
    return dict(json.loads(done.stdout.splitlines()[-1]))


def test_sbom_lists_installed_debian_packages_with_purls() -> None:
    packages = sbom.debian_packages(sbom.parse_dpkg_status(STATUS))

    document = sbom.build_sbom(
        image="modelforge-node-agent",
        version=VERSION,
        source_date_epoch=EPOCH,
        debian=packages,
        python=[sbom.PythonDistribution("Pydantic_Core", "2.50.5")],
    )

    assert document["specVersion"] == "1.5"
    assert document["metadata"]["timestamp"] == "2023-11-14T22:13:20Z"
    assert [c["purl"] for c in document["components"]] == [
        "pkg:deb/debian/libc6@2.36-9%2Bdeb12u14?arch=amd64&upstream=glibc",
        "pkg:deb/debian/libcrypt1@1%3A4.4.33-2?arch=amd64&upstream=libxcrypt",
        "pkg:pypi/pydantic-core@2.50.5",
    ]
    assert document["components"][0]["version"] == "2.36-9+deb12u14"


def test_sbom_serial_number_follows_the_content() -> None:
    def document(version: str) -> dict[str, object]:
        return sbom.build_sbom(
            image="x", version=version, source_date_epoch=EPOCH, debian=[], python=[]
        )

    assert document("1")["serialNumber"] == document("1")["serialNumber"]
    assert document("1")["serialNumber"] != document("2")["serialNumber"]
    assert str(document("1")["serialNumber"]).startswith("urn:uuid:")


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"version": "0.1.0 beta"}, "is not a valid image tag"),
        ({"components": ["gateway"]}, "unknown components"),
        ({"worker_flavour": "rocm"}, "neither 'cpu' nor 'cuda'"),
    ],
)
def test_bad_arguments_are_refused_before_building(
    tmp_path: Path, options: dict[str, object], message: str
) -> None:
    arguments: dict[str, object] = {
        "version": VERSION,
        "revision": "r",
        "source_date_epoch": EPOCH,
        "work_dir": tmp_path / "work",
        **options,
    }
    with pytest.raises(ImageBuildError, match=message):
        build_images(**arguments)  # type: ignore[arg-type]
    assert not (tmp_path / "work").exists()


@pytest.mark.e2e
@pytest.mark.timeout(1200)
def test_two_builds_from_scratch_under_umask_022_and_002_give_identical_images(
    built: tuple[Path, list[BuiltImage]],
) -> None:
    work_dir, first = built

    # An empty cache: the Debian base, the wheels and the project are all made afresh, every
    # file group-writable this time.
    second = _build(work_dir.parent / "second", umask=0o002, worker_flavour="cpu")

    assert [(i.tag, i.config_digest, i.diff_ids) for i in second] == [
        (i.tag, i.config_digest, i.diff_ids) for i in first
    ]
    assert [i.config_bytes for i in second] == [i.config_bytes for i in first]
    assert [i.sbom for i in second] == [i.sbom for i in first]


@pytest.mark.e2e
@pytest.mark.timeout(1200)
def test_images_share_the_base_and_application_layers(
    built: tuple[Path, list[BuiltImage]],
) -> None:
    _, images = built

    assert [i.tag for i in images] == [
        "modelforge-control-plane:0.1.0",
        "modelforge-node-agent:0.1.0",
        "modelforge-runtime-worker:0.1.0",
    ]
    assert len({i.diff_ids[0] for i in images}) == 1
    assert len({i.diff_ids[-1] for i in images}) == 1
    assert len({i.diff_ids[1] for i in images}) == 3
    node_agent = images[1]
    assert node_agent.size_bytes <= 120_000_000, node_agent.size_bytes


@pytest.mark.e2e
@pytest.mark.timeout(1200)
def test_no_shell_no_package_manager_no_bytecode(built: tuple[Path, list[BuiltImage]]) -> None:
    _, images = built
    for image in images:
        names = [m.name for m in _entries(image)]

        assert [n for n in names if FORBIDDEN.match(n)] == [], image.tag
        assert [n for n in names if n.startswith(("etc/apt", "var/lib/apt", "usr/lib/dpkg"))] == []
        assert [n for n in names if n.endswith(".pyc") or "__pycache__" in n] == [], image.tag
        assert "usr/bin/python3.11" in names


@pytest.mark.e2e
@pytest.mark.timeout(1200)
def test_node_agent_carries_no_nvidia_driver_library(
    built: tuple[Path, list[BuiltImage]],
) -> None:
    _, images = built
    names = [m.name for m in _entries(images[1])]

    assert [n for n in names if "libnvidia-ml" in n] == []
    assert "opt/modelforge/lib/pynvml.py" in names  # the pure-Python bindings


@pytest.mark.e2e
@pytest.mark.timeout(1200)
def test_layers_have_fixed_metadata(built: tuple[Path, list[BuiltImage]]) -> None:
    _, images = built
    members = _entries(images[0])

    assert {m.mtime for m in members} == {EPOCH}
    assert {(m.uname, m.gname) for m in members} == {("", "")}
    owned = {m.name: (m.uid, m.gid) for m in members if (m.uid, m.gid) != (0, 0)}
    # The mount points of the named volumes (artifact cache, sockets, data).
    shared = ("run/modelforge", "var/lib/modelforge", "var/cache/modelforge/artifacts")
    assert owned == dict.fromkeys(shared, (10001, 10001))
    assert not [m.name for m in members if {"atime", "ctime"} & set(m.pax_headers)]
    assert not [m.name for m in members if m.isdev() or m.isfifo()]


@pytest.mark.e2e
@pytest.mark.timeout(1200)
def test_only_the_node_agent_image_has_the_agent_state_directory(
    built: tuple[Path, list[BuiltImage]],
) -> None:
    # The agent names its state directory private in every job; a runtime worker that can read
    # that path must hide it from the job, which an unprivileged container cannot do.
    _, images = built
    state = "var/lib/modelforge/agent"

    for image in images:
        merged = {m.name: m for m in _entries(image)}  # a later layer's entry wins
        if image.name == "modelforge-node-agent":
            assert (merged[state].uid, merged[state].gid, merged[state].mode) == (
                10001,
                10001,
                0o755,
            )
            home = merged["var/lib/modelforge"]
            assert (home.uid, home.gid, home.mode) == (10001, 10001, 0o755)
        else:
            assert state not in merged, image.name


@pytest.mark.e2e
@pytest.mark.timeout(1200)
def test_configs_run_as_non_root_with_labels(built: tuple[Path, list[BuiltImage]]) -> None:
    _, images = built
    expected_cmd = {
        "control-plane": ["python3", "-m", "control_plane"],
        "node-agent": ["python3", "-m", "node_agent"],
        "runtime-worker": ["python3", "-m", "runtime_worker"],
    }
    with tarfile.open(images[0].layers[0]) as base:
        passwd = base.extractfile("etc/passwd").read().decode()  # type: ignore[union-attr]
        group = base.extractfile("etc/group").read().decode()  # type: ignore[union-attr]
    assert "modelforge:x:10001:10001:" in passwd
    assert "modelforge:x:10001:" in group

    for image in images:
        config = json.loads(image.config_bytes)
        component = image.name.removeprefix("modelforge-")
        assert config["config"]["User"] == "10001:10001"
        assert config["config"]["Cmd"] == expected_cmd[component]
        assert "Entrypoint" not in config["config"]
        assert {"PYTHONDONTWRITEBYTECODE=1", "PYTHONPATH=/opt/modelforge/lib"} <= set(
            config["config"]["Env"]
        )
        assert config["rootfs"]["diff_ids"] == list(image.diff_ids)
        assert len(config["history"]) == len(image.diff_ids)
        assert config["config"]["Labels"] == dict(image.labels)
        assert image.labels["org.opencontainers.image.version"] == VERSION
        assert image.labels["org.opencontainers.image.revision"] == "0123abc"
        assert image.labels["org.opencontainers.image.created"] == "2023-11-14T22:13:20Z"
        assert image.labels["org.opencontainers.image.title"] == image.name
        assert image.labels["org.opencontainers.image.licenses"] == "Apache-2.0"
        assert image.labels["io.modelforge.component"] == component
        assert image.labels["io.modelforge.protocol"] == "1"
    control_plane = json.loads(images[0].config_bytes)["config"]
    assert control_plane["ExposedPorts"] == {"8000/tcp": {}}
    assert {"MODELFORGE_HOST=0.0.0.0", "MODELFORGE_DATA_DIR=/var/lib/modelforge"} <= set(
        control_plane["Env"]
    )
    assert images[2].labels["io.modelforge.flavour"] == "cpu"


@pytest.mark.e2e
@pytest.mark.timeout(1200)
def test_sbom_covers_debian_and_python_components(
    built: tuple[Path, list[BuiltImage]],
) -> None:
    _, images = built
    purls = {c["purl"].split("@")[0] for c in images[1].sbom["components"]}

    assert {"pkg:deb/debian/libc6", "pkg:deb/debian/python3.11-minimal"} <= purls
    assert {"pkg:pypi/pydantic", "pkg:pypi/nvidia-ml-py", "pkg:pypi/modelforge"} <= purls
    assert not [p for p in purls if p.endswith(("/dpkg", "/apt", "/bash", "/dash"))]
    # The worker's llama-server, by the source archive pinned in locks/llm.lock.
    (llama,) = [c for c in images[2].sbom["components"] if c["name"] == "llama-server"]
    pinned = (PROJECT_DIR / "locks" / "llm.lock").read_text()
    assert llama["purl"].startswith("pkg:pypi/llama-cpp-python@0.3.36?file_name=")
    assert f"sha256:{llama['hashes'][0]['content']}" in pinned


@pytest.mark.e2e
@pytest.mark.timeout(1200)
def test_node_agent_runs_its_preflight_without_a_shell(
    built: tuple[Path, list[BuiltImage]], tmp_path: Path
) -> None:
    _, images = built
    rootfs = tmp_path / "rootfs"
    rootfs.mkdir()
    for layer in images[1].layers:  # as a container runtime unpacks them: modes and owners kept
        subprocess.run(["tar", "-xpf", str(layer), "-C", str(rootfs)], check=True)
    env = dict(item.split("=", 1) for item in json.loads(images[1].config_bytes)["config"]["Env"])

    done = subprocess.run(
        ["chroot", "--userspec=10001:10001", str(rootfs), "python3", "-m", "node_agent",
         "--preflight", "--json"],
        env={**env, "MODELFORGE_AGENT_ACCELERATOR_MODE": "cpu"},
        capture_output=True,
        text=True,
        timeout=60,
    )  # fmt: skip

    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["ok"] is True

    # The agent's tunnel relay ships in the image, where the agent's start check finds it, and
    # runs there (its libraries found): with no configuration on its stdin it says so and
    # exits 2.
    chosen = subprocess.run(
        ["chroot", "--userspec=10001:10001", str(rootfs), "python3", "-c",
         "from node_agent.tunnel import check_relay; print(check_relay())"],
        env=env, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    relay = chosen.stdout.strip()
    assert relay.endswith("/node_agent/bin/modelforge-tunnel-relay"), chosen.stderr
    ran = subprocess.run(
        ["chroot", "--userspec=10001:10001", str(rootfs), relay],
        env=env, input="", capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert (ran.returncode, ran.stderr) == (2, "error no configuration on stdin\n")


@pytest.mark.e2e
@pytest.mark.timeout(1200)
def test_the_control_planes_native_front_ships_and_runs_in_its_image(
    built: tuple[Path, list[BuiltImage]], tmp_path: Path
) -> None:
    """The gateway's native front (`MODELFORGE_GATEWAY_FRONT=native`) is in the control plane's
    image where `native_front` looks for it, and runs there (its libraries found): with no
    configuration on its stdin it says so and exits 2."""
    _, images = built
    rootfs = tmp_path / "rootfs"
    rootfs.mkdir()
    for layer in images[0].layers:
        subprocess.run(["tar", "-xpf", str(layer), "-C", str(rootfs)], check=True)
    env = dict(item.split("=", 1) for item in json.loads(images[0].config_bytes)["config"]["Env"])
    found = subprocess.run(
        ["chroot", "--userspec=10001:10001", str(rootfs), "python3", "-c",
         "from control_plane.native_front import BINARY; print(BINARY, BINARY.is_file())"],
        env=env, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    front, present = found.stdout.split()
    assert (front.endswith("/control_plane/bin/modelforge-gateway-front"), present) == (
        True,
        "True",
    ), found.stderr
    ran = subprocess.run(
        ["chroot", "--userspec=10001:10001", str(rootfs), front],
        env=env, input="", capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert (ran.returncode, ran.stderr) == (2, "error no configuration on stdin\n")


@pytest.mark.e2e
@pytest.mark.timeout(1200)
def test_every_build_checks_every_elf_file(
    built: tuple[Path, list[BuiltImage]], build_output: list[str]
) -> None:
    _, images = built
    checked = {
        line.split(":")[0]: int(line.split("ELF check: ")[1].split()[0])
        for line in build_output
        if "ELF check: " in line
    }

    assert list(checked) == [image.name for image in images]
    # python3, its standard library's extension modules, the wheels' shared objects.
    assert all(count > 300 for count in checked.values()), checked
    assert all(
        "every DT_NEEDED and interpreter found in the image" in line
        for line in build_output
        if "ELF check: " in line
    )


@pytest.mark.e2e
@pytest.mark.timeout(1200)
def test_cpu_worker_imports_numpy_and_runs_an_onnx_model(
    built: tuple[Path, list[BuiltImage]], tmp_path: Path
) -> None:
    _, images = built
    env = _unpack(images[2], tmp_path / "rootfs")

    facts = _runs_the_model(tmp_path / "rootfs", env)

    assert facts["used"] == ["CPUExecutionProvider"]
    assert "CUDAExecutionProvider" not in facts["available"]  # type: ignore[operator]
    # Its llama-server runs from where the image tells the worker it is.
    server = env["MODELFORGE_WORKER_LLAMA_SERVER"]
    done = _run_in(tmp_path / "rootfs", env, server, "--version")
    assert done.returncode == 0 and "version:" in done.stdout + done.stderr, done


@pytest.mark.e2e
@pytest.mark.timeout(1800)
def test_cuda_worker_runs_models_and_offers_the_cuda_provider(
    built: tuple[Path, list[BuiltImage]], tmp_path: Path
) -> None:
    work_dir, cpu_images = built
    output: list[str] = []

    (cuda,) = _build(work_dir, output=output, worker_flavour="cuda", components=["runtime-worker"])

    names = [m.name for m in _entries(cuda)]
    site = "opt/modelforge/lib"
    assert f"{site}/nvidia/cuda_runtime/lib/libcudart.so.12" in names
    assert f"{site}/onnxruntime/capi/libonnxruntime_providers_cuda.so" in names
    assert f"{site}/onnxruntime/capi/libonnxruntime_providers_tensorrt.so" not in names
    nvidia = [n for n in names if n.startswith(f"{site}/nvidia/")]
    assert not [n for n in nvidia if n.endswith(".a") or "/include" in n]
    assert cuda.tag == cpu_images[2].tag
    assert cuda.labels["io.modelforge.flavour"] == "cuda"
    assert cuda.diff_ids[0] == cpu_images[2].diff_ids[0]
    purls = {c["purl"].split("@")[0] for c in cuda.sbom["components"]}
    assert {"pkg:pypi/nvidia-cuda-runtime-cu12", "pkg:pypi/onnxruntime-gpu"} <= purls
    assert "pkg:pypi/onnxruntime" not in purls
    assert not [n for n in _entries(cpu_images[2]) if "libcudart" in n.name]
    # The ELF check passed with the driver's libcuda.so.1 as the one library left to the
    # NVIDIA Container Toolkit.
    (elf,) = [line for line in output if "ELF check: " in line]
    assert "every DT_NEEDED and interpreter found in the image" in elf
    assert elf.split("; provided at run time: ")[1].startswith("libcuda.so.1 (")

    try:
        env = _unpack(cuda, tmp_path / "rootfs")
        facts = _runs_the_model(tmp_path / "rootfs", env)

        assert "CUDAExecutionProvider" in facts["available"]  # type: ignore[operator]
        assert facts["used"] == ["CPUExecutionProvider"]  # no GPU here: the runner's fallback
        # Every library of the CUDA provider loads in the image from LD_LIBRARY_PATH, and so do
        # those cuDNN loads by name; only the driver is missing, so creating the provider fails
        # on the driver, not on a library.
        load = _run_in(
            tmp_path / "rootfs",
            env,
            "python3",
            "-c",
            "import ctypes, onnxruntime.capi as c, os; d = os.path.dirname(c.__file__); "
            "ctypes.CDLL(d + '/libonnxruntime_providers_shared.so', mode=ctypes.RTLD_GLOBAL); "
            "ctypes.CDLL(d + '/libonnxruntime_providers_cuda.so'); "
            "[ctypes.CDLL(n) for n in ('libcudnn_graph.so.9', 'libcudnn_ops.so.9', "
            "'libcudnn_cnn.so.9', 'libcudnn_adv.so.9', 'libcudnn_heuristic.so.9', "
            "'libcudnn_engines_precompiled.so.9', 'libnvrtc.so.12', 'libnvJitLink.so.12')]",
        )
        assert load.returncode == 0, load.stderr
    finally:  # 6 GB of layer and tree: not for pytest to keep
        shutil.rmtree(tmp_path / "rootfs", ignore_errors=True)
        cuda.layers[1].unlink(missing_ok=True)
