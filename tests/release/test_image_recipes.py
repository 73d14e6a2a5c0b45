"""The pieces of an image build that need neither mmdebstrap nor the network: recipes, labels,
image configs (pinned byte for byte), the base's dependency closure and its cache key."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import pytest

from release import images, rootfs
from release._tar import canonical_json
from release.oci import ImageBuildError, Layer, image_config
from release.recipes import COMPONENTS, DEFAULT_SOURCE, image_labels, recipe

EPOCH = 1_700_000_000
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


# The config digests the builds gave before the build was split into modules.
CONFIG_DIGESTS = {
    ("control-plane", "cuda", "control-plane.lock"): (
        "sha256:42e3d1a0a250974e80c7a236e8f9e1661f0268c28de1619f8b739cda29ae464b"
    ),
    ("node-agent", "cuda", "node-agent.lock"): (
        "sha256:0a3ff2091648c078d5dca6be401d4df2ff65365a53d5c0e3e068268f65e2e3fd"
    ),
    ("runtime-worker", "cpu", "runtime-worker.lock"): (
        "sha256:18b5daac3bb91f389e96da72166a5dfc47b89267791e73c13bd64a71e24559e8"
    ),
    ("runtime-worker", "cuda", "runtime-worker-cuda.lock"): (
        "sha256:18ca42d0243b6cd5e6d9d7fd4908ff9a648f8a90a5e8a45a1712c6589aa582d0"
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
    assert recipe("runtime-worker", "cpu").env == ()
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
        "libc6": {},
        "dpkg": {"Depends": "tar"},
        "openssl": {"Depends": "libssl3"},
        "mawk": {"Provides": "awk"},
        "tar": {},
        "libssl3": {},
    }

    keep = rootfs._keep_closure(status)

    assert keep == {*rootfs._BASE_PACKAGES, "python3.11-minimal", "libc6"}


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
