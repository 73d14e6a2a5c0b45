"""CycloneDX 1.5 software bills of materials for the release images.

Reads the Debian packages from a root filesystem's dpkg status and the Python distributions from
an install directory's `*.dist-info`, and renders a deterministic CycloneDX 1.5 JSON document:
components sorted, timestamp from SOURCE_DATE_EPOCH, serial number derived from the content.

It must never invent a component it did not read, read the clock, or draw a random serial number.
"""

from __future__ import annotations

import hashlib
import re
import uuid
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from email.parser import HeaderParser
from pathlib import Path
from typing import Any
from urllib.parse import quote

from release._tar import canonical_json, rfc3339

_SERIAL_NAMESPACE = uuid.UUID("0f1c2a4e-5b6d-5e7f-8a9b-0c1d2e3f4a5b")


@dataclass(frozen=True, order=True)
class DebianPackage:
    name: str
    version: str
    architecture: str
    source: str


@dataclass(frozen=True, order=True)
class PythonDistribution:
    name: str
    version: str


@dataclass(frozen=True, order=True)
class BuiltProgram:
    """A program built from a pinned source archive (`<name>.pin` beside it says which)."""

    name: str
    #: The source: the registry's project and version it came from, its file and digest.
    project: str
    version: str
    archive: str
    sha256: str


def built_program(path: Path) -> BuiltProgram:
    """`path`'s program, by the pin `make install` stamped beside it
    (`<project>==<version> <archive> sha256:<hex>`)."""
    pin = path.with_name(path.name + ".pin")
    try:
        requirement, archive, digest = pin.read_text(encoding="utf-8").split()[:3]
        project, version = requirement.split("==")
    except (OSError, ValueError) as exc:
        raise ValueError(f"{pin} does not say which source built {path.name}: {exc}") from None
    return BuiltProgram(path.name, project, version, archive, digest.removeprefix("sha256:"))


def _program_component(program: BuiltProgram) -> dict[str, Any]:
    normalized = re.sub(r"[-_.]+", "-", program.project).lower()
    purl = f"pkg:pypi/{normalized}@{_purl_version(program.version)}?file_name={program.archive}"
    return {
        "type": "application",
        "name": program.name,
        "version": program.version,
        "description": f"built from the source archive {program.archive} on PyPI",
        "purl": purl,
        "bom-ref": purl,
        "hashes": [{"alg": "SHA-256", "content": program.sha256}],
    }


def parse_dpkg_status(text: str) -> dict[str, dict[str, str]]:
    """The installed packages of a dpkg status file: name -> its fields (continuations joined)."""
    packages: dict[str, dict[str, str]] = {}
    for paragraph in re.split(r"\n\s*\n", text.strip()):
        fields: dict[str, str] = {}
        key = ""
        for line in paragraph.splitlines():
            if line[:1] in (" ", "\t") and key:
                fields[key] += "\n" + line
            elif ":" in line:
                key, _, value = line.partition(":")
                fields[key] = value.strip()
        if fields.get("Status", "").endswith(" installed") and "Package" in fields:
            packages[fields["Package"]] = fields
    return packages


def debian_packages(status: dict[str, dict[str, str]]) -> list[DebianPackage]:
    return sorted(
        DebianPackage(
            name=name,
            version=fields["Version"],
            architecture=fields.get("Architecture", "amd64"),
            source=fields.get("Source", name).split(" ")[0],
        )
        for name, fields in status.items()
    )


def python_distributions(site_dir: Path) -> list[PythonDistribution]:
    """Every distribution installed in `site_dir` (one `*.dist-info/METADATA` each)."""
    found = []
    for metadata in site_dir.glob("*.dist-info/METADATA"):
        headers = HeaderParser().parsestr(metadata.read_text(encoding="utf-8"))
        found.append(PythonDistribution(name=headers["Name"], version=headers["Version"]))
    return sorted(found)


def _purl_version(version: str) -> str:
    return quote(version, safe=".-_~")


def _deb_component(package: DebianPackage) -> dict[str, Any]:
    purl = (
        f"pkg:deb/debian/{package.name}@{_purl_version(package.version)}"
        f"?arch={package.architecture}"
    )
    if package.source != package.name:
        purl += f"&upstream={package.source}"
    return {
        "type": "library",
        "name": package.name,
        "version": package.version,
        "purl": purl,
        "bom-ref": purl,
    }


def _pypi_component(dist: PythonDistribution, *, application: str) -> dict[str, Any]:
    normalized = re.sub(r"[-_.]+", "-", dist.name).lower()
    purl = f"pkg:pypi/{normalized}@{_purl_version(dist.version)}"
    kind = "application" if normalized == application else "library"
    return {"type": kind, "name": dist.name, "version": dist.version, "purl": purl, "bom-ref": purl}


def build_sbom(
    *,
    image: str,
    version: str,
    source_date_epoch: int,
    debian: Iterable[DebianPackage],
    python: Iterable[PythonDistribution],
    programs: Iterable[BuiltProgram] = (),
    application: str = "modelforge",
) -> dict[str, Any]:
    """A CycloneDX 1.5 document for one image; equal inputs give byte-equal canonical JSON."""
    components: Sequence[dict[str, Any]] = [
        *(_deb_component(package) for package in sorted(set(debian))),
        *(_pypi_component(dist, application=application) for dist in sorted(set(python))),
        *(_program_component(program) for program in sorted(set(programs))),
    ]
    document: dict[str, Any] = {
        "bomFormat": "CycloneDX",
        "specVersion": "1.5",
        "version": 1,
        "metadata": {
            "timestamp": rfc3339(source_date_epoch),
            "component": {
                "type": "container",
                "name": image,
                "version": version,
                "bom-ref": f"{image}:{version}",
            },
            "tools": {"components": [{"type": "application", "name": "modelforge-release"}]},
        },
        "components": sorted(components, key=lambda component: component["bom-ref"]),
    }
    content = hashlib.sha256(canonical_json(document)).hexdigest()
    document["serialNumber"] = uuid.uuid5(_SERIAL_NAMESPACE, content).urn
    return document
