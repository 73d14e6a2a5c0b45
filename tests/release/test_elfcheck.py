"""The ELF dependency check on small images made of shared objects compiled here with gcc
(`-nostdlib`, so they need nothing but what each test links them against)."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from release import elfcheck
from release._tar import write_tree

EPOCH = 1_700_000_000


@pytest.fixture(scope="module")
def objects(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """libdep.so.1 (soname), libcuda.so.1 (a stand-in for the driver's), and users of them."""
    if shutil.which("gcc") is None:
        pytest.fail("these tests compile shared objects: apt-get install gcc", pytrace=False)
    out = tmp_path_factory.mktemp("elf")
    (out / "dep.c").write_text("int dep(void) { return 1; }\n")
    (out / "user.c").write_text("int dep(void);\nint user(void) { return dep(); }\n")
    (out / "main.c").write_text("int dep(void);\nint _start(void) { return dep(); }\n")

    def gcc(name: str, *args: str) -> Path:
        cc = ["gcc", "-fPIC", "-nostdlib", "-Wl,--no-as-needed", "-o", str(out / name)]
        subprocess.run([*cc, *args], check=True, cwd=out)
        return out / name

    dep = gcc("libdep.so.1.0", "-shared", "-Wl,-soname,libdep.so.1", "dep.c")
    cuda = gcc("libcuda.so", "-shared", "-Wl,-soname,libcuda.so.1", "dep.c")
    return {
        "dep": dep,
        "user_runpath": gcc(
            "libuser-runpath.so",
            "-shared",
            "user.c",
            str(dep),
            "-Wl,--enable-new-dtags,-rpath,$ORIGIN/../dep",
        ),
        "user_rpath": gcc(
            "libuser-rpath.so", "-shared", "user.c", str(dep), "-Wl,--disable-new-dtags,-rpath,/x"
        ),
        "user_plain": gcc("libuser-plain.so", "-shared", "user.c", str(dep)),
        "user_cuda": gcc("libuser-cuda.so", "-shared", "user.c", str(cuda)),
        "program": gcc(
            "program",
            "main.c",
            str(dep),
            "-Wl,--dynamic-linker=/lib64/ld-linux-x86-64.so.2,-rpath,$ORIGIN",
        ),
    }


def _layer(root: Path, out: Path, files: dict[str, Path | str]) -> Path:
    """A layer tar holding `files`: image path -> a file to copy, or "->target" for a symlink."""
    for name, source in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        if isinstance(source, str):
            path.symlink_to(source.removeprefix("->"))
        else:
            shutil.copyfile(source, path)
    write_tree(root, out, mtime=EPOCH)
    return out


def _check(
    tmp_path: Path,
    *layers: dict[str, Path | str],
    env: tuple[str, ...] = (),
    provided: dict[str, str] | None = None,
) -> elfcheck.ElfReport:
    paths = [
        _layer(tmp_path / f"layer{i}", tmp_path / f"layer{i}.tar", files)
        for i, files in enumerate(layers)
    ]
    return elfcheck.check_image("test-image", paths, env, provided)


def test_reads_the_dynamic_section_like_readelf(objects: dict[str, Path]) -> None:
    with objects["user_runpath"].open("rb") as stream:
        user = elfcheck.read_elf(stream)
    with objects["program"].open("rb") as stream:
        program = elfcheck.read_elf(stream)
    with objects["dep"].open("rb") as stream:
        dep = elfcheck.read_elf(stream)

    assert user is not None and program is not None and dep is not None
    assert (user.elf_class, user.machine) == (2, 62)  # 64-bit x86-64
    assert user.needed == ("libdep.so.1",)
    assert (user.runpath, user.rpath, user.interpreter) == (("$ORIGIN/../dep",), (), None)
    assert dep.soname == "libdep.so.1" and dep.needed == ()
    assert program.interpreter == "/lib64/ld-linux-x86-64.so.2"
    assert program.needed == ("libdep.so.1",)


def test_reads_a_real_library_as_readelf_does() -> None:
    library = Path("/usr/lib/x86_64-linux-gnu/libstdc++.so.6")
    listing = subprocess.run(
        ["readelf", "-d", str(library)], capture_output=True, text=True, check=True
    ).stdout
    expected = [
        line.split("[", 1)[1].rstrip("]") for line in listing.splitlines() if "(NEEDED)" in line
    ]

    with library.open("rb") as stream:
        found = elfcheck.read_elf(stream)

    assert found is not None and list(found.needed) == expected
    assert found.soname == "libstdc++.so.6"


def test_other_files_are_not_elf_objects(tmp_path: Path, objects: dict[str, Path]) -> None:
    archive = tmp_path / "libdep.a"
    subprocess.run(["ar", "rcs", str(archive), str(objects["dep"])], check=True)
    text = tmp_path / "script.py"
    text.write_text("print('hello')\n")

    for path in (archive, text):
        with path.open("rb") as stream:
            assert elfcheck.read_elf(stream) is None


def test_a_missing_library_fails_naming_the_file_and_the_library(
    tmp_path: Path, objects: dict[str, Path]
) -> None:
    report = _check(tmp_path, {"opt/app/lib/libuser.so": objects["user_runpath"]})

    assert not report.ok
    assert report.problems == [
        "opt/app/lib/libuser.so needs libdep.so.1, which is not in the image (searched "
        "DT_RUNPATH $ORIGIN/../dep, /etc/ld.so.cache, /lib/x86_64-linux-gnu, "
        "/usr/lib/x86_64-linux-gnu, /lib, /usr/lib)"
    ]
    message = elfcheck.failure_message(report)
    assert message.startswith("test-image: ELF dependency check failed: 1 problems")
    assert "opt/app/lib/libuser.so needs libdep.so.1" in message


def test_runpath_with_origin_and_symlinks_resolve(tmp_path: Path, objects: dict[str, Path]) -> None:
    report = _check(
        tmp_path,
        {
            "opt/app/lib/libuser.so": objects["user_runpath"],
            "opt/app/dep/libdep.so.1.0": objects["dep"],
            "opt/app/dep/libdep.so.1": "->libdep.so.1.0",
        },
    )

    assert report.ok, report.problems
    assert report.objects == 2
    assert "2 ELF files, every DT_NEEDED and interpreter found" in report.summary()


def test_ld_library_path_comes_from_the_image_config(
    tmp_path: Path, objects: dict[str, Path]
) -> None:
    files: dict[str, Path | str] = {
        "opt/app/libuser.so": objects["user_plain"],
        "opt/vendor/lib/libdep.so.1": objects["dep"],
    }

    without = _check(tmp_path / "without", files)
    with_path = _check(tmp_path / "with", files, env=("LD_LIBRARY_PATH=/opt/none:/opt/vendor/lib",))

    assert [p.split(",")[0] for p in without.problems] == ["opt/app/libuser.so needs libdep.so.1"]
    # The library is found; the directory that is not in the image is a problem of its own.
    assert with_path.problems == [
        "LD_LIBRARY_PATH names /opt/none, which is not a directory in the image"
    ]


def test_rpath_is_searched_and_a_later_layer_can_remove_a_library(
    tmp_path: Path, objects: dict[str, Path]
) -> None:
    base: dict[str, Path | str] = {
        "opt/app/libuser.so": objects["user_rpath"],
        "x/libdep.so.1": objects["dep"],
    }

    assert _check(tmp_path / "kept", base).ok
    removed = _check(tmp_path / "removed", base, {"x/.wh.libdep.so.1": objects["dep"]})
    assert [p.split(" (")[0] for p in removed.problems] == [
        "opt/app/libuser.so needs libdep.so.1, which is not in the image"
    ]


def test_system_directories_and_ld_so_cache_behind_usrmerge_links(
    tmp_path: Path, objects: dict[str, Path]
) -> None:
    merged = {"lib": "->usr/lib", "lib64": "->usr/lib64"}
    in_system_dir = _check(
        tmp_path / "system",
        {**merged, "usr/lib/x86_64-linux-gnu/libdep.so.1": objects["dep"]},
        {"opt/app/libuser.so": objects["user_plain"]},
    )
    assert in_system_dir.ok, in_system_dir.problems

    # A directory only ld.so.cache knows (from /etc/ld.so.conf), as ldconfig writes it.
    root = tmp_path / "cached"
    (root / "etc").mkdir(parents=True)
    (root / "opt/cached").mkdir(parents=True)
    shutil.copyfile(objects["dep"], root / "opt/cached/libdep.so.1")
    (root / "etc/ld.so.conf").write_text("/opt/cached\n")
    subprocess.run(["ldconfig", "-X", "-r", str(root)], check=True)
    cache = elfcheck.read_ld_so_cache((root / "etc/ld.so.cache").read_bytes())
    assert cache == {"libdep.so.1": ["/opt/cached/libdep.so.1"]}

    report = _check(
        tmp_path / "with-cache",
        {
            "etc/ld.so.cache": root / "etc/ld.so.cache",
            "opt/cached/libdep.so.1": objects["dep"],
            "opt/app/libuser.so": objects["user_plain"],
        },
    )
    assert report.ok, report.problems


def test_a_library_for_another_machine_does_not_count(
    tmp_path: Path, objects: dict[str, Path]
) -> None:
    foreign = tmp_path / "libdep-aarch64.so"
    data = bytearray(objects["dep"].read_bytes())
    data[18:20] = (183).to_bytes(2, "little")  # e_machine: EM_AARCH64
    foreign.write_bytes(bytes(data))

    report = _check(
        tmp_path / "image",
        {"opt/app/libuser.so": objects["user_plain"], "usr/lib/libdep.so.1": foreign},
    )

    assert [p.split(",")[0] for p in report.problems] == ["opt/app/libuser.so needs libdep.so.1"]


def test_an_executable_needs_its_interpreter(tmp_path: Path, objects: dict[str, Path]) -> None:
    files: dict[str, Path | str] = {
        "usr/bin/program": objects["program"],
        "usr/bin/libdep.so.1": objects["dep"],
        "lib64": "->usr/lib64",
    }

    missing = _check(tmp_path / "missing", files)
    present = _check(
        tmp_path / "present",
        {**files, "usr/lib64/ld-linux-x86-64.so.2": objects["dep"]},  # any x86-64 object
    )

    assert missing.problems == [
        "usr/bin/program: its interpreter /lib64/ld-linux-x86-64.so.2 is not in the image"
    ]
    assert present.ok, present.problems


def test_a_library_the_recipe_lists_is_accepted_and_reported(
    tmp_path: Path, objects: dict[str, Path]
) -> None:
    files: dict[str, Path | str] = {"opt/app/libuser.so": objects["user_cuda"]}
    injected = {"libcuda.so.1": "the NVIDIA Container Toolkit injects the driver's library"}

    refused = _check(tmp_path / "refused", files, provided={"libnvidia-ml.so.1": "other"})
    accepted = _check(tmp_path / "accepted", files, provided=injected)

    assert [p.split(",")[0] for p in refused.problems] == ["opt/app/libuser.so needs libcuda.so.1"]
    assert accepted.ok
    assert accepted.provided == {"libcuda.so.1": ["opt/app/libuser.so"]}
    assert accepted.summary().endswith("; provided at run time: libcuda.so.1 (1 files)")


def test_an_unreadable_elf_file_is_a_problem(tmp_path: Path) -> None:
    broken = tmp_path / "broken.so"
    broken.write_bytes(b"\x7fELF\x02\x01\x01" + b"\x00" * 9 + b"\x03\x00")  # header cut short

    report = _check(tmp_path / "image", {"opt/broken.so": broken})

    assert len(report.problems) == 1
    assert report.problems[0].startswith("opt/broken.so: cannot read its ELF headers (truncated")
