"""The pieces of an image build that need neither mmdebstrap nor the network: recipes, labels,
image configs (pinned byte for byte), the locks of the runtime worker's flavours, the base's
dependency closure and its cache key."""

from __future__ import annotations

import hashlib
import json
import re
import shutil
import tomllib
from pathlib import Path

import pytest

from release import images, rootfs
from release._tar import canonical_json
from release.oci import SITE_DIR, ImageBuildError, Layer, Steps, image_config
from release.recipes import COMPONENTS, DEFAULT_SOURCE, image_labels, recipe

EPOCH = 1_700_000_000
LOCKS = images.PROJECT_DIR / "locks"
LAYERS = [Layer(Path(f"/x/{i}"), "sha256:" + str(i) * 64, f"step {i}") for i in range(3)]


def _config(component: str, flavour: str) -> bytes:
    chosen = recipe(component, flavour)
    labels = image_labels(
        component,
        chosen,
        version="0.1.0",
        revision="0123abc",
        source_date_epoch=EPOCH,
        source=DEFAULT_SOURCE,
    )
    return canonical_json(
        image_config(
            layers=LAYERS,
            user=rootfs.USER_ID,
            cmd=chosen.cmd,
            env=chosen.env,
            ports=chosen.ports,
            labels=labels,
            epoch=EPOCH,
        )
    )


# The config digests the builds gave before the build was split into modules; the cuda worker's
# changed on purpose when its LD_LIBRARY_PATH came to list every NVIDIA library directory, and
# both workers' when they came to carry llama-server (MODELFORGE_WORKER_LLAMA_SERVER).
CONFIG_DIGESTS = {
    ("control-plane", "cuda", "control-plane.lock"): (
        "sha256:42e3d1a0a250974e80c7a236e8f9e1661f0268c28de1619f8b739cda29ae464b"
    ),
    ("node-agent", "cuda", "node-agent.lock"): (
        "sha256:0a3ff2091648c078d5dca6be401d4df2ff65365a53d5c0e3e068268f65e2e3fd"
    ),
    ("runtime-worker", "cpu", "runtime-worker.lock"): (
        "sha256:94f581829526aa97e36bf1245f884465a2608f620c37bccdf907be5192f7fcfa"
    ),
    ("runtime-worker", "cuda", "runtime-worker-cuda.lock"): (
        "sha256:43308a1f644fc9f3ba29bfc15b56b3ee1ab522c01fe98f014aff2d4364c3eb63"
    ),
}


@pytest.mark.parametrize(("component", "flavour", "lock"), CONFIG_DIGESTS)
def test_image_configs_are_pinned_byte_for_byte(component: str, flavour: str, lock: str) -> None:
    # A change here changes every released image ID: only on purpose.
    digest = "sha256:" + hashlib.sha256(_config(component, flavour)).hexdigest()

    assert recipe(component, flavour).lock == lock
    assert digest == CONFIG_DIGESTS[component, flavour, lock]


def test_config_runs_the_component_as_the_image_user() -> None:
    config = json.loads(_config("control-plane", "cuda"))

    assert config["config"]["User"] == "10001:10001"
    assert config["config"]["Cmd"] == ["python3", "-m", "control_plane"]
    assert config["config"]["Env"][:2] == [
        "PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
        "PYTHONPATH=/opt/modelforge/lib",
    ]
    assert config["config"]["ExposedPorts"] == {"8000/tcp": {}}
    assert config["rootfs"]["diff_ids"] == [layer.diff_id for layer in LAYERS]
    assert [h["created_by"] for h in config["history"]] == ["step 0", "step 1", "step 2"]
    assert config["config"]["Labels"]["io.modelforge.protocol"] == "1"
    assert "ExposedPorts" not in json.loads(_config("node-agent", "cuda"))["config"]


def test_only_the_runtime_worker_has_a_flavour() -> None:
    assert images.COMPONENTS == COMPONENTS
    assert recipe("runtime-worker", "cpu").labels == (("io.modelforge.flavour", "cpu"),)
    # Its one variable says where the llama-server both flavours carry is.
    assert recipe("runtime-worker", "cpu").env == (
        "MODELFORGE_WORKER_LLAMA_SERVER=/opt/modelforge/bin/llama-server",
    )
    assert recipe("runtime-worker", "cpu").programs == recipe("runtime-worker", "cuda").programs
    assert recipe("node-agent", "cpu") == recipe("node-agent", "cuda")
    assert recipe("control-plane", "cpu") == recipe("control-plane", "cuda")


def test_keep_closure_follows_depends_alternatives_and_provides() -> None:
    status = {
        "base-files": {"Depends": "libc6 (>= 2.36)"},
        "netbase": {"Pre-Depends": "dpkg"},
        "ca-certificates": {"Depends": "openssl, awk | virtual-awk"},
        "python3-minimal": {"Depends": "python3.11-minimal:any (>= 3.11.2)"},
        "python3.11-minimal": {"Depends": "libc6"},
        "libpython3.11-stdlib": {"Depends": "libc6"},
        "libstdc++6": {"Depends": "gcc-12-base (= 12.2.0-14), libc6 (>= 2.36), libgcc-s1"},
        "gcc-12-base": {},
        "libgcc-s1": {"Depends": "gcc-12-base (= 12.2.0-14), libc6 (>= 2.35)"},
        "libc6": {"Depends": "libgcc-s1"},
        "dpkg": {"Depends": "tar"},
        "openssl": {"Depends": "libssl3"},
        "mawk": {"Provides": "awk"},
        "tar": {},
        "libssl3": {},
    }

    keep = rootfs._keep_closure(status)

    assert keep == {
        *rootfs._BASE_PACKAGES,
        "python3.11-minimal",
        "libc6",
        "libgcc-s1",
        "gcc-12-base",
    }


def test_the_base_carries_the_cpp_runtime_wheels_link_against() -> None:
    # numpy, onnxruntime and protobuf's upb need libstdc++.so.6; manylinux wheels never bundle
    # it, so without it `import numpy` fails in the runtime worker.
    assert "libstdc++6" in rootfs._BASE_PACKAGES


def test_keep_closure_refuses_a_missing_dependency() -> None:
    status = {name: {} for name in rootfs._BASE_PACKAGES}
    status["netbase"] = {"Depends": "libmissing1"}

    with pytest.raises(ImageBuildError, match="netbase: dependency 'libmissing1'"):
        rootfs._keep_closure(status)


def test_base_cache_key_follows_the_code_that_makes_the_base(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    sources = rootfs.DEBIAN_SOURCES
    assert Path(rootfs.__file__) in rootfs._CODE
    assert Path(images.__file__) not in rootfs._CODE
    copies = tuple(tmp_path / path.name for path in rootfs._CODE)
    for original, copy in zip(rootfs._CODE, copies, strict=True):
        shutil.copyfile(original, copy)
    monkeypatch.setattr(rootfs, "_CODE", copies)
    key = rootfs.base_cache_key(sources, EPOCH)

    assert rootfs.base_cache_key(sources, EPOCH) == key
    assert rootfs.base_cache_key(sources, EPOCH + 1) != key
    assert rootfs.base_cache_key(sources[:1], EPOCH) != key
    with copies[0].open("a") as pruning:
        pruning.write("# a change to the pruning\n")
    assert rootfs.base_cache_key(sources, EPOCH) != key


def _pins(lock: Path) -> dict[str, str]:
    return dict(re.findall(r"^([a-z0-9][a-z0-9._-]*)==(\S+)", lock.read_text(), re.MULTILINE))


def test_the_cuda_lock_swaps_onnxruntime_for_its_cuda_build() -> None:
    cpu, cuda = _pins(LOCKS / "runtime-worker.lock"), _pins(LOCKS / "runtime-worker-cuda.lock")

    # Both install the package `onnxruntime`: one lock never holds the two.
    assert "onnxruntime" in cpu and "onnxruntime-gpu" not in cpu
    assert "onnxruntime-gpu" in cuda and "onnxruntime" not in cuda
    # Everything else the worker needs, at the same versions.
    assert {k: v for k, v in cpu.items() if k != "onnxruntime"}.items() <= cuda.items()
    # What onnxruntime's CUDA provider links against (its DT_NEEDED), from NVIDIA's wheels.
    assert {
        "nvidia-cuda-runtime-cu12",
        "nvidia-cublas-cu12",
        "nvidia-cudnn-cu12",
        "nvidia-cufft-cu12",
        "nvidia-curand-cu12",
    } <= cuda.keys()
    # NVIDIA's other wheels are CUDA 12's, but for the NVML bindings (the GPU's active check).
    nvidia = [name for name in cuda if name.startswith("nvidia-") and name != "nvidia-ml-py"]
    assert not [name for name in nvidia if "-cu12" not in name]


def test_the_cuda_input_keeps_the_worker_extras_pins() -> None:
    extra = tomllib.loads((images.PROJECT_DIR / "pyproject.toml").read_text())["project"][
        "optional-dependencies"
    ]["worker"]
    worker = dict(pin.split("==") for pin in extra)
    cuda_in = _pins(LOCKS / "runtime-worker-cuda.in")

    assert {k: v for k, v in worker.items() if k != "onnxruntime"}.items() <= cuda_in.items()
    assert "onnxruntime" not in cuda_in


def test_the_cuda_worker_finds_every_nvidia_library_directory() -> None:
    cuda = recipe("runtime-worker", "cuda")
    env = dict(item.split("=", 1) for item in cuda.env)
    directories = env["LD_LIBRARY_PATH"].split(":")
    # nvidia-ml-py is Python bindings (pynvml), no library directory of its own.
    packages = [
        n for n in _pins(LOCKS / cuda.lock) if n.startswith("nvidia-") and n != "nvidia-ml-py"
    ]

    # nvidia-cuda-runtime-cu12 installs nvidia/cuda_runtime/lib, nvidia-cublas-cu12 nvidia/cublas/…
    expected = {
        f"/{SITE_DIR}/nvidia/{name.removeprefix('nvidia-').removesuffix('-cu12').replace('-', '_')}"
        "/lib"
        for name in packages
    }
    assert set(directories) == expected
    assert env["NVIDIA_DRIVER_CAPABILITIES"] == "compute,utility"


def test_only_the_cuda_worker_may_need_a_library_it_does_not_carry() -> None:
    provided = {
        (component, flavour): dict(recipe(component, flavour).provided_at_run_time)
        for component in COMPONENTS
        for flavour in ("cpu", "cuda")
    }

    assert provided.pop(("runtime-worker", "cuda")).keys() == {"libcuda.so.1"}
    assert all(not libraries for libraries in provided.values())
    assert recipe("runtime-worker", "cpu").unshipped == ()
    assert "onnxruntime/capi/libonnxruntime_providers_tensorrt.so" in (
        recipe("runtime-worker", "cuda").unshipped
    )


def test_unshipped_paths_leave_the_tree_and_its_records(tmp_path: Path) -> None:
    site = tmp_path / "site"
    for name in ("nvidia/cublas/include/cublas.h", "nvidia/cublas/lib/libcublas.so.12", "x.a"):
        (site / name).parent.mkdir(parents=True, exist_ok=True)
        (site / name).write_bytes(b"x" * 10)
    record = site / "nvidia_cublas-12.dist-info/RECORD"
    record.parent.mkdir()
    record.write_text(
        "nvidia/cublas/include/cublas.h,sha256=a,10\nnvidia/cublas/lib/libcublas.so.12,sha256=b,10\n"
    )
    lines: list[str] = []
    steps = Steps(tmp_path / "work", EPOCH, lines.append)

    steps._remove(site, ["nvidia/*/include", "*.a"])

    assert sorted(p.relative_to(site).as_posix() for p in site.rglob("*") if p.is_file()) == [
        "nvidia/cublas/lib/libcublas.so.12",
        "nvidia_cublas-12.dist-info/RECORD",
    ]
    assert record.read_text() == "nvidia/cublas/lib/libcublas.so.12,sha256=b,10\n"
    assert lines == [
        "  left out nvidia/*/include: 1 paths, 0.0 MB",
        "  left out *.a: 1 paths, 0.0 MB",
    ]
    # A pattern that matches nothing means the recipe no longer fits the lock.
    with pytest.raises(ImageBuildError, match="'nvidia/\\*/include' matches nothing"):
        steps._remove(site, ["nvidia/*/include"])
