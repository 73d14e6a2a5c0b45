"""What the Enroll node wizard hands the operator: the image to run, checked against
the release, a `.env` of non-secret settings, and the Bash commands that start the agent and later
recreate it without the one-time token.

Nothing here ever sees the token: the start command reads it at a hidden prompt on the node.
"""

from __future__ import annotations

import ipaddress
import json
import re
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

from sqlalchemy.orm import Session

from control_plane import RELEASE_VERSION
from control_plane.errors import InvalidRequest
from control_plane.fleet import start_script
from control_plane.fleet.enrollments import get_enrollment
from control_plane.fleet.schemas import NodeImage, NodeImageRequest, NodeSetup, NodeSetupRequest
from modelforge_contracts.addresses import ip_address_of, is_loopback_host
from modelforge_contracts.protocol import PROTOCOL_VERSION
from modelforge_contracts.release_manifest import (
    ImageEntry,
    ManifestError,
    load_manifest,
    mismatches,
    parse_image_entry,
)

NODE_AGENT = "modelforge-node-agent"
RUNTIME_WORKER = "modelforge-runtime-worker"
_REGISTRY_REF = re.compile(
    r"^[a-z0-9]+(?:[._-][a-z0-9]+)*(?::[0-9]+)?(?:/[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*)+"
    r"@sha256:[0-9a-f]{64}$"
)
#: scheme://host[:port][/], nothing more; the host and port are judged on their own below.
_ORIGIN = re.compile(
    r"(?P<scheme>[A-Za-z]+)://(?P<host>\[[^\]/]*\]|[^/:\[\]@?#]*)(?::(?P<port>[^/]*))?/?"
)
_DNS_LABEL = re.compile(r"[a-z0-9](?:[a-z0-9-]{0,61}[a-z0-9])?")
_PORT = re.compile(r"[0-9]{1,5}")
_PASTE_STEP = (
    f"Paste `images.{NODE_AGENT}` from the release-manifest.json of the bundle you loaded on "
    "the node (`jq '.images.\"modelforge-node-agent\"' release-manifest.json`)."
)


@dataclass(frozen=True)
class ImageChoice:
    reference: str
    #: Bundle mode: the entry the start command checks the loaded image against.
    entry: ImageEntry | None
    checked_against: str
    #: Bundle mode: the same release's runtime worker (`release load` verified it on the node).
    worker_image: str | None = None


def check_image(*, request: NodeImageRequest, release_manifest: Path | None) -> NodeImage:
    """The wizard checks the image before any token is minted; changes nothing."""
    image = _image_for(request, release_manifest)
    return NodeImage(image=image.reference, checked_against=image.checked_against)


def setup_for_enrollment(
    *,
    session: Session,
    enrollment_id: str,
    request: NodeSetupRequest,
    request_origin: str | None,
    release_manifest: Path | None,
) -> NodeSetup:
    """The wizard's `.env` and commands for an enrollment, pointing the node at the console's
    own origin (`request_origin`: the browser's `Origin` header); changes nothing."""
    enrollment = get_enrollment(session=session, enrollment_id=enrollment_id)
    origin = check_api_origin(request.api_origin, request_origin)
    insecure = check_plain_http(origin, confirmed=request.allow_insecure_http)
    image = _image_for(request, release_manifest)
    env_file, start, recreate = render(
        enrollment_id=enrollment.id,
        display_name=enrollment.display_name,
        api_origin=origin,
        accelerator_mode=request.accelerator_mode,
        image=image,
        offer=start_script.AgentOffer(
            parallel=request.parallel,
            cpus=request.cpus,
            gpus=request.gpus,
            ram_mb=request.ram_mb,
            max_idle_seconds=request.max_idle_seconds,
        ),
        allow_insecure_http=insecure,
    )
    return NodeSetup(
        enrollment_id=enrollment.id,
        node_id=enrollment.node_id,
        insecure_http=insecure,
        image=image.reference,
        checked_against=image.checked_against,
        env_file=env_file,
        start_command=start,
        recreate_command=recreate,
    )


def _image_for(request: NodeImageRequest, release_manifest: Path | None) -> ImageChoice:
    return choose_image(
        image_source=request.image_source,
        manifest_entry=request.manifest_entry,
        registry_image=request.registry_image,
        release_manifest=release_manifest,
    )


def check_api_origin(api_origin: str, request_origin: str | None) -> str:
    """The node talks to the console's own origin, nothing else. Returns it in canonical form
    (lower-case scheme and host), the only form that reaches a `.env` line."""
    origin = canonical_origin(api_origin)
    if origin is None:
        raise InvalidRequest(
            "api_origin must be an origin like https://modelforge.example:8000: scheme http or "
            "https, a host name or IP address, an optional port 1..65535, and no path.",
            "Open the wizard from the console served by this control plane.",
            code="API_ORIGIN_INVALID",
        )
    if request_origin is not None and canonical_origin(request_origin) != origin:
        raise InvalidRequest(
            "api_origin differs from the origin this request came from; the node's API origin "
            "is locked to the console's own origin.",
            "Open the wizard from the console at the address the nodes will use.",
            code="API_ORIGIN_MISMATCH",
        )
    return origin


def check_plain_http(origin: str, *, confirmed: bool) -> bool:
    """Whether the node's `.env` lets its agent use plain http:// to `origin` (a canonical
    origin): only for `http://` beyond loopback (the agent takes loopback without it), only once
    the operator has confirmed the network is a trusted LAN, and never at a public IP address."""
    parts = urlsplit(origin)
    host = parts.hostname or ""
    needed = parts.scheme == "http" and not is_loopback_host(host)
    if not needed:
        if confirmed:
            raise InvalidRequest(
                f"allow_insecure_http is only for a plain http:// origin beyond this host; the "
                f"nodes reach {origin} without it.",
                "Leave allow_insecure_http out.",
                code="INSECURE_HTTP_NOT_NEEDED",
            )
        return False
    address = ip_address_of(host)
    if address is not None and not address.is_private:
        raise InvalidRequest(
            f"The console is open at {origin}: plain http:// to a public address. The node's "
            "one-time token, its credential and every call would cross the internet "
            "unencrypted.",
            "Serve the control plane over https:// (docs/operations.md) and open the console "
            "there.",
            code="INSECURE_HTTP_PUBLIC",
        )
    if not confirmed:
        raise InvalidRequest(
            f"The console is open at {origin}: plain http://. The node's one-time token, its "
            "credential and every call would cross the network unencrypted, readable and "
            "changeable by anyone on it.",
            "Serve the control plane over https://, or, on a trusted LAN only, confirm with "
            "allow_insecure_http: true (the console asks).",
            code="INSECURE_HTTP_NOT_CONFIRMED",
        )
    return True


def canonical_origin(text: str) -> str | None:
    """`scheme://host[:port]` for a strictly valid origin, None for anything else."""
    match = _ORIGIN.fullmatch(text)
    if match is None:
        return None
    scheme = match["scheme"].lower()
    host = _canonical_host(match["host"])
    port = match["port"]
    if scheme not in ("http", "https") or host is None:
        return None
    if port is None:
        return f"{scheme}://{host}"
    if not _PORT.fullmatch(port) or not 1 <= int(port) <= 65535:
        return None
    return f"{scheme}://{host}:{int(port)}"


def _canonical_host(host: str) -> str | None:
    if host.startswith("["):
        if "%" in host:  # a zone index names an interface of one host, not an origin
            return None
        try:
            return f"[{ipaddress.IPv6Address(host[1:-1]).compressed}]"
        except ValueError:
            return None
    try:
        return str(ipaddress.IPv4Address(host))
    except ValueError:
        pass
    name = host.lower().removesuffix(".")
    labels = name.split(".")
    if not name or len(name) > 253 or not all(_DNS_LABEL.fullmatch(label) for label in labels):
        return None
    if labels[-1].isdigit():  # all-numeric: a mistyped IPv4 address, not a name
        return None
    return name


def choose_image(
    *,
    image_source: str,
    manifest_entry: str | None,
    registry_image: str | None,
    release_manifest: Path | None,
) -> ImageChoice:
    if image_source == "registry":
        return _registry_image(registry_image)
    if not manifest_entry or not manifest_entry.strip():
        raise InvalidRequest(
            "manifest_entry is required for the local release bundle.",
            _PASTE_STEP,
            code="MANIFEST_ENTRY_MISSING",
        )
    entry = _parse_pasted(manifest_entry)
    if release_manifest is not None:
        problems = mismatches(_trusted_entry(release_manifest), entry)
        against = f"the release manifest {release_manifest}"
    else:
        problems = _own_release_mismatches(entry)
        against = (
            f"this control plane's release {RELEASE_VERSION} (tag, version, component and "
            "protocol labels); set MODELFORGE_RELEASE_MANIFEST to also check every layer and label"
        )
    if problems:
        raise InvalidRequest(
            "The pasted node-agent entry does not match this release: " + "; ".join(problems),
            _PASTE_STEP,
            code="MANIFEST_ENTRY_MISMATCH",
        )
    version = entry.tag.rsplit(":", 1)[1]
    return ImageChoice(
        reference=entry.tag,
        entry=entry,
        checked_against=against,
        worker_image=f"{RUNTIME_WORKER}:{version}",
    )


def _registry_image(reference: str | None) -> ImageChoice:
    if not reference or not _REGISTRY_REF.match(reference.strip()):
        raise InvalidRequest(
            "registry_image must be a registry image pinned by digest, "
            "like registry.example:5000/modelforge-node-agent@sha256:<64 hex digits>; "
            "a tag alone can move.",
            "Copy the digest from your registry (`docker buildx imagetools inspect`).",
            code="REGISTRY_IMAGE_NOT_PINNED",
        )
    return ImageChoice(
        reference=reference.strip(), entry=None, checked_against="the registry digest"
    )


def _parse_pasted(text: str) -> ImageEntry:
    try:
        data = json.loads(text)
    except RecursionError:
        data = None  # absurdly nested: not an entry, refused below
    except ValueError as exc:
        raise InvalidRequest(
            f"manifest_entry is not valid JSON (line {getattr(exc, 'lineno', '?')}, "
            f"column {getattr(exc, 'colno', '?')}).",
            _PASTE_STEP,
            code="MANIFEST_ENTRY_INVALID",
        ) from None
    # Forgiving about how much was copied: the whole manifest, or `{"modelforge-node-agent": …}`.
    if isinstance(data, dict) and isinstance(data.get("images"), dict):
        data = data["images"].get(NODE_AGENT, data)
    if isinstance(data, dict) and set(data) == {NODE_AGENT}:
        data = data[NODE_AGENT]
    try:
        return parse_image_entry(NODE_AGENT, data)
    except ManifestError as exc:
        raise InvalidRequest(str(exc), _PASTE_STEP, code="MANIFEST_ENTRY_INVALID") from None


def _trusted_entry(path: Path) -> ImageEntry:
    try:
        manifest = load_manifest(path)
    except ManifestError as exc:
        raise InvalidRequest(
            f"The configured release manifest cannot be used: {exc}.",
            "Point MODELFORGE_RELEASE_MANIFEST at the verified release-manifest.json.",
            code="RELEASE_MANIFEST_UNREADABLE",
        ) from None
    if NODE_AGENT not in manifest.images:
        raise InvalidRequest(
            f"The configured release manifest has no {NODE_AGENT} image.",
            "Point MODELFORGE_RELEASE_MANIFEST at the verified release-manifest.json.",
            code="RELEASE_MANIFEST_UNREADABLE",
        )
    return manifest.images[NODE_AGENT]


def _own_release_mismatches(entry: ImageEntry) -> list[str]:
    """Without a configured manifest: what this control plane knows of its own release."""
    expected = {
        "tag": f"{NODE_AGENT}:{RELEASE_VERSION}",
        "label org.opencontainers.image.version": RELEASE_VERSION,
        "label org.opencontainers.image.title": NODE_AGENT,
        "label io.modelforge.component": "node-agent",
        "label io.modelforge.protocol": str(PROTOCOL_VERSION),
        "os": "linux",
    }
    found = {
        "tag": entry.tag,
        "os": entry.os,
        **{f"label {key}": value for key, value in entry.labels.items()},
    }
    out = [
        f"{NODE_AGENT}: {name} expected {want!r}, found {found.get(name)!r}"
        for name, want in expected.items()
        if found.get(name) != want
    ]
    if entry.architecture not in ("amd64", "arm64"):
        out.append(
            f"{NODE_AGENT}: architecture expected 'amd64' or 'arm64', found {entry.architecture!r}"
        )
    return out


def render(
    *,
    enrollment_id: str,
    display_name: str,
    api_origin: str,
    accelerator_mode: str,
    image: ImageChoice,
    offer: start_script.AgentOffer | None = None,
    allow_insecure_http: bool = False,
) -> tuple[str, str, str]:
    """The `.env` (non-secret), the start command and the token-removing recreation command."""
    start = start_script.NodeStart(
        enrollment_id=enrollment_id,
        display_name=display_name,
        api_origin=api_origin,
        accelerator_mode=accelerator_mode,
        image=image.reference,
        entry=image.entry,
        worker_image=image.worker_image,
        offer=offer or start_script.AgentOffer(),
        allow_insecure_http=allow_insecure_http,
    )
    return (
        start_script.env_file(start),
        start_script.start_command(start),
        start_script.recreate_command(start),
    )
