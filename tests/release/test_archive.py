"""The images tar (docker-archive) and the deterministic tar writer, on small real layer trees."""

from __future__ import annotations

import hashlib
import io
import json
import os
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

from release._tar import canonical_json, write_tree
from release.archive import ArchiveError, read_images_tar, write_images_tar
from release.images import BuiltImage

EPOCH = 1_700_000_000
NAMES = ("modelforge-control-plane", "modelforge-node-agent")


def _tree(root: Path, files: dict[str, bytes]) -> Path:
    for name, data in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_bytes(data)
    return root


def _images(directory: Path) -> list[BuiltImage]:
    """Two images sharing a base layer, built with the same writer as the real images."""
    base = directory / "base.tar"
    base_id = write_tree(
        _tree(directory / "base", {"etc/os-release": b"ID=debian\n"}), base, mtime=EPOCH
    )
    images = []
    for name in NAMES:
        app = directory / f"{name}.tar"
        app_id = write_tree(
            _tree(directory / name, {f"opt/{name}/README": name.encode() * 500}), app, mtime=EPOCH
        )
        labels = {"org.opencontainers.image.version": "0.1.0", "io.modelforge.protocol": "1"}
        config = canonical_json(
            {
                "architecture": "amd64",
                "os": "linux",
                "created": "2023-11-14T22:13:20Z",
                "config": {"Labels": labels, "User": "10001:10001"},
                "rootfs": {"type": "layers", "diff_ids": [base_id, app_id]},
            }
        )
        images.append(
            BuiltImage(
                name=name,
                tag=f"{name}:0.1.0",
                config_digest="sha256:" + hashlib.sha256(config).hexdigest(),
                config_bytes=config,
                layers=(base, app),
                diff_ids=(base_id, app_id),
                architecture="amd64",
                os="linux",
                labels=labels,
                sbom={},
                size_bytes=base.stat().st_size + app.stat().st_size,
            )
        )
    return images


def _rewrite(
    source: Path, target: Path, *, drop: str = "", replace: dict[str, bytes] | None = None
) -> None:
    """Copy a tar entry by entry, leaving one out or replacing some entries' contents."""
    replace = replace or {}
    with tarfile.open(source) as old, tarfile.open(target, "w") as new:
        for member in old.getmembers():
            if member.name == drop:
                continue
            if member.name in replace:
                data = replace[member.name]
                member.size = len(data)
                new.addfile(member, io.BytesIO(data))
            else:
                new.addfile(member, old.extractfile(member))


def test_round_trip_gives_back_every_image(tmp_path: Path) -> None:
    images = _images(tmp_path)
    write_images_tar(images, tmp_path / "images.tar")

    archived = read_images_tar(tmp_path / "images.tar")

    assert [(a.tag, a.config_digest, a.diff_ids) for a in archived] == [
        (i.tag, i.config_digest, i.diff_ids) for i in images
    ]
    assert all(a.architecture == "amd64" and a.os == "linux" for a in archived)
    assert archived[1].labels == {
        "org.opencontainers.image.version": "0.1.0",
        "io.modelforge.protocol": "1",
    }


def test_archive_is_docker_archive_with_shared_layer_stored_once(tmp_path: Path) -> None:
    images = _images(tmp_path)
    write_images_tar(images, tmp_path / "images.tar")

    with tarfile.open(tmp_path / "images.tar") as tar:
        names = tar.getnames()
        manifest = json.loads(tar.extractfile("manifest.json").read())  # type: ignore[union-attr]
        members = tar.getmembers()

    base_entry = images[0].diff_ids[0].removeprefix("sha256:") + "/layer.tar"
    assert names.count(base_entry) == 1
    assert len(names) == 1 + 2 + 3  # manifest, two configs, base + two application layers
    assert manifest[0] == {
        "Config": images[0].config_digest.removeprefix("sha256:") + ".json",
        "RepoTags": ["modelforge-control-plane:0.1.0"],
        "Layers": [d.removeprefix("sha256:") + "/layer.tar" for d in images[0].diff_ids],
    }
    assert {(m.mtime, m.uid, m.gid, m.uname, m.gname) for m in members} == {(EPOCH, 0, 0, "", "")}


def test_two_writes_give_identical_bytes(tmp_path: Path) -> None:
    images = _images(tmp_path)
    write_images_tar(images, tmp_path / "one.tar")
    write_images_tar(images, tmp_path / "two.tar")

    assert (tmp_path / "one.tar").read_bytes() == (tmp_path / "two.tar").read_bytes()


def test_flipped_byte_in_a_layer_names_image_and_layer(tmp_path: Path) -> None:
    images = _images(tmp_path)
    write_images_tar(images, tmp_path / "images.tar")
    layer = images[1].diff_ids[1].removeprefix("sha256:") + "/layer.tar"
    with tarfile.open(tmp_path / "images.tar") as tar:
        offset = tar.getmember(layer).offset_data
    data = bytearray((tmp_path / "images.tar").read_bytes())
    data[offset + 700] ^= 0x01
    (tmp_path / "images.tar").write_bytes(bytes(data))

    with pytest.raises(ArchiveError) as raised:
        read_images_tar(tmp_path / "images.tar")

    message = str(raised.value)
    assert "modelforge-node-agent:0.1.0" in message
    assert f"layer 2/2 ({layer})" in message
    assert f"expected {images[1].diff_ids[1]}, found sha256:" in message


def test_missing_layer_entry_is_named(tmp_path: Path) -> None:
    images = _images(tmp_path)
    write_images_tar(images, tmp_path / "images.tar")
    layer = images[0].diff_ids[0].removeprefix("sha256:") + "/layer.tar"
    _rewrite(tmp_path / "images.tar", tmp_path / "broken.tar", drop=layer)

    with pytest.raises(
        ArchiveError, match=rf"modelforge-control-plane:0.1.0: layer 1: entry {layer} is missing"
    ):
        read_images_tar(tmp_path / "broken.tar")


def test_layer_count_mismatch_is_refused(tmp_path: Path) -> None:
    images = _images(tmp_path)
    write_images_tar(images, tmp_path / "images.tar")
    with tarfile.open(tmp_path / "images.tar") as tar:
        manifest = json.loads(tar.extractfile("manifest.json").read())  # type: ignore[union-attr]
    manifest[0]["Layers"].append(manifest[0]["Layers"][0])
    _rewrite(
        tmp_path / "images.tar",
        tmp_path / "broken.tar",
        replace={"manifest.json": json.dumps(manifest).encode()},
    )

    with pytest.raises(ArchiveError, match="rootfs.diff_ids has 2, manifest.json Layers lists 3"):
        read_images_tar(tmp_path / "broken.tar")


def test_config_that_does_not_match_its_name_is_refused(tmp_path: Path) -> None:
    images = _images(tmp_path)
    write_images_tar(images, tmp_path / "images.tar")
    name = images[0].config_digest.removeprefix("sha256:") + ".json"
    edited = images[0].config_bytes.replace(b'"0.1.0"', b'"0.1.1"')
    _rewrite(tmp_path / "images.tar", tmp_path / "broken.tar", replace={name: edited})

    with pytest.raises(ArchiveError, match=f"config {name}: expected {images[0].config_digest}"):
        read_images_tar(tmp_path / "broken.tar")


def test_missing_manifest_and_garbage_are_refused(tmp_path: Path) -> None:
    images = _images(tmp_path)
    write_images_tar(images, tmp_path / "images.tar")
    _rewrite(tmp_path / "images.tar", tmp_path / "broken.tar", drop="manifest.json")
    (tmp_path / "garbage.tar").write_bytes(b"not a tar at all" * 100)

    with pytest.raises(ArchiveError, match="entry manifest.json is missing"):
        read_images_tar(tmp_path / "broken.tar")
    with pytest.raises(ArchiveError, match="garbage.tar: not a tar archive"):
        read_images_tar(tmp_path / "garbage.tar")


def test_layer_file_changed_after_build_stops_the_write(tmp_path: Path) -> None:
    images = _images(tmp_path)
    with images[0].layers[1].open("r+b") as layer:
        layer.seek(600)
        layer.write(b"X")

    with pytest.raises(ArchiveError, match="changed since the build"):
        write_images_tar(images, tmp_path / "images.tar")
    assert not list(tmp_path.glob("images.tar*"))


def test_a_layer_too_large_for_a_plain_ustar_header_stops_the_write(tmp_path: Path) -> None:
    images = _images(tmp_path)
    with images[0].layers[1].open("r+b") as layer:  # sparse: 8 GiB of nothing on disk
        layer.truncate(8 << 30)

    with pytest.raises(ArchiveError, match=r"8589934592 bytes; .* at most 8589934591 bytes"):
        write_images_tar(images, tmp_path / "images.tar")
    assert not list(tmp_path.glob("images.tar*"))


def test_tree_tar_ignores_host_times_owners_and_umask(tmp_path: Path) -> None:
    one = _tree(tmp_path / "one", {"lib/a.py": b"a", "lib/b/c.so": b"c"})
    two = _tree(tmp_path / "two", {"lib/b/c.so": b"c", "lib/a.py": b"a"})
    os.utime(two / "lib/a.py", (1, 2))
    (two / "lib/b/c.so").chmod(0o600)
    (one / "lib/b/c.so").chmod(0o664)
    (one / "lib/link").symlink_to("a.py")
    (two / "lib/link").symlink_to("a.py")
    os.link(one / "lib/a.py", one / "lib/hard.py")
    os.link(two / "lib/a.py", two / "lib/hard.py")

    first = write_tree(one, tmp_path / "one.tar", mtime=EPOCH)
    second = write_tree(two, tmp_path / "two.tar", mtime=EPOCH)

    assert first == second
    with tarfile.open(tmp_path / "one.tar") as tar:
        members = tar.getmembers()
    assert [m.name for m in members] == [
        "lib", "lib/a.py", "lib/b", "lib/b/c.so", "lib/hard.py", "lib/link",
    ]  # fmt: skip
    assert members[4].islnk() and members[4].linkname == "lib/a.py"
    assert {(m.mtime, m.uid, m.gid, m.uname, m.pax_headers.keys() == set()) for m in members} == {
        (EPOCH, 0, 0, "", True)
    }
    assert oct(members[3].mode) == oct(0o644)


def test_tree_tar_gives_owners_only_where_told(tmp_path: Path) -> None:
    root = _tree(tmp_path / "root", {"var/lib/modelforge/.keep": b""})

    write_tree(root, tmp_path / "l.tar", mtime=EPOCH, owners={"var/lib/modelforge": (10001, 10001)})

    with tarfile.open(tmp_path / "l.tar") as tar:
        owners = {m.name: (m.uid, m.gid) for m in tar.getmembers()}
    assert owners == {
        "var": (0, 0),
        "var/lib": (0, 0),
        "var/lib/modelforge": (10001, 10001),
        "var/lib/modelforge/.keep": (0, 0),
    }


def test_truncated_archive_is_refused(tmp_path: Path) -> None:
    images = _images(tmp_path)
    write_images_tar(images, tmp_path / "images.tar")
    data = (tmp_path / "images.tar").read_bytes()
    (tmp_path / "cut.tar").write_bytes(data[: len(data) // 2])

    with pytest.raises(ArchiveError, match=r"cut.tar: the file ends .* \(truncated\)"):
        read_images_tar(tmp_path / "cut.tar")


# Builds a small layer tree the way a build step does (files, an executable, a special-mode
# directory, a symlink, a hard link, non-ASCII and non-UTF-8 names) under the umask and locale
# of the process, then writes it with write_tree and prints the diff_id.
_BUILD_TREE = """
import os, sys
from pathlib import Path
from release._tar import write_tree
root = Path(sys.argv[1])
(root / "usr/bin").mkdir(parents=True)
(root / "tmp").mkdir()
(root / "usr/share/ca-certificates").mkdir(parents=True)
(root / "usr/bin/tool").write_bytes(b"#!/usr/bin/python3\\n")
os.chmod(root / "usr/bin/tool", 0o777 & ~os.umask(0))
base = os.fsencode(root)  # names as bytes: creating them must not depend on the locale
with open(base + "/usr/share/naïve.txt".encode(), "wb") as handle:
    handle.write("é\\n".encode())
(root / "usr/share/ca-certificates/Zeta.crt").write_bytes(b"z")
(root / "usr/share/ca-certificates/alpha.crt").write_bytes(b"a")
with open(base + b"/usr/share/latin1-\\xe9.txt", "wb") as handle:
    handle.write(b"x")
(root / "usr/bin/link").symlink_to("tool")
os.link(base + "/usr/share/naïve.txt".encode(), base + b"/usr/share/hard.txt")
print(write_tree(root, Path(sys.argv[2]), mtime=1_700_000_000, modes={"tmp": 0o1777}))
"""


@pytest.mark.parametrize(
    ("umask", "locale"), [("022", "C.UTF-8"), ("002", "C.UTF-8"), ("022", "C"), ("077", "C")]
)
def test_layer_digest_does_not_depend_on_umask_or_locale(
    tmp_path: Path, umask: str, locale: str
) -> None:
    def build(name: str, mask: str, lc_all: str) -> str:
        environment = {
            "PATH": os.environ["PATH"],
            "PYTHONPATH": str(Path(__file__).resolve().parents[2]),
            "LC_ALL": lc_all,
            # With C, no UTF-8 coercion: Python's file system encoding is then ASCII.
            "PYTHONUTF8": "0" if lc_all == "C" else "1",
            "PYTHONCOERCECLOCALE": "0",
        }
        script = tmp_path / f"{name}.py"  # a UTF-8 source file: argv must stay ASCII under C
        script.write_text(f"import os\nos.umask(0o{mask})\n{_BUILD_TREE}", encoding="utf-8")
        done = subprocess.run(
            [sys.executable, str(script), str(tmp_path / name), str(tmp_path / f"{name}.tar")],
            env=environment,
            capture_output=True,
            text=True,
            check=False,
        )
        assert done.returncode == 0, done.stderr
        return done.stdout.strip()

    reference = build("reference", "022", "C.UTF-8")
    assert build("other", umask, locale) == reference
    with tarfile.open(tmp_path / "other.tar") as tar:
        modes = {member.name: member.mode for member in tar.getmembers()}
    assert modes["tmp"] == 0o1777
    assert modes["usr/bin"] == modes["usr/share"] == 0o755
    assert modes["usr/share/naïve.txt"] == 0o644
    assert modes["usr/share/latin1-\udce9.txt"] == 0o644
    assert modes["usr/bin/tool"] == 0o755
