"""The Bash the Enroll node wizard generates. Every value put into a script is
shell-quoted here; nothing secret is ever put into one.

The start command is one compound command, so an interactive shell parses all of it before the
hidden prompt reads the token (a pasted block cannot feed its own next line to `read`). It runs
in a subshell: `set -e`, traps and `umask` never leak into the operator's shell. The token goes
from the prompt into a mode-0600 temporary env file given to Compose (never an argument, never
traced, never in history), and that file is removed on success, on any error and on SIGINT or
SIGTERM.
"""

from __future__ import annotations

import json
import re
import shlex
from dataclasses import dataclass

from control_plane.errors import InvalidRequest
from modelforge_contracts.release_manifest import ImageEntry

ENV_FILE = "modelforge-node.env"
TOKEN_VARIABLE = "MODELFORGE_AGENT_ENROLLMENT_TOKEN"  # noqa: S105 - a variable name
PROJECT = "modelforge-node"
_ENV_END = "MODELFORGE_NODE_ENV"
#: The only shape of API origin written into a `.env` (node_setup.check_api_origin produces
#: it): a lower-case scheme, a host name or IP address, an optional port of digits.
_SAFE_ORIGIN = re.compile(r"https?://(?:[a-z0-9.-]+|\[[0-9a-f:.]+\])(?::[0-9]{1,5})?")

_PRELUDE = r"""{ set +x; } 2>/dev/null; (
set +x
set -euo pipefail
set +o history 2>/dev/null || true
umask 077
fail() { printf 'modelforge: %s\n' "$*" >&2; exit 1; }
"""

_COMPOSE = r"""for file in "${compose_files[@]}"; do
  [ -f "$file" ] || fail "$file not found: run this in the compose/ folder of the release"
done
if docker compose version >/dev/null 2>&1; then
  compose=(docker compose) no_pull=(--pull never)
elif command -v docker-compose >/dev/null 2>&1; then
  # Compose v1 has no --pull; every image is proven present before Compose runs.
  compose=(docker-compose) no_pull=()
else
  fail "neither 'docker compose' nor 'docker-compose' is installed"
fi
files=(); for file in "${compose_files[@]}"; do files+=(-f "$file"); done
dc() { local env="$1"; shift; "${compose[@]}" -p "$project" --env-file "$env" "${files[@]}" "$@"; }
image_id() {
  docker image inspect --format '{{.Id}}' "$1" 2>/dev/null \
    || fail "image $1 is not on this host: verify the release bundle, then modelforge-release load"
}
verify_container() {  # service, expected image ID; leaves the container's ID in $container
  local running
  container="$(dc "$env_file" ps -a -q "$1")"
  [ -n "$container" ] || fail "Compose created no $1 container"
  running="$(docker inspect --format '{{.Image}}' "$container")"
  if [ "$running" != "$2" ]; then
    dc "$env_file" stop "${services[@]}" >/dev/null 2>&1 || true
    fail "$1 runs image $running, not the checked $2; stopped the node services"
  fi
}
"""

_CLEANUP = r"""token_file=''
cleanup() { if [ -n "$token_file" ]; then rm -f -- "$token_file"; fi; }
trap cleanup EXIT
trap 'cleanup; trap - INT; kill -INT "$BASHPID"' INT
trap 'cleanup; trap - TERM; kill -TERM "$BASHPID"' TERM
token_file="$(mktemp "${TMPDIR:-/tmp}/modelforge-node.XXXXXXXX")"
IFS= read -rs -p 'One-time enrollment token (input hidden): ' token || fail "no token was entered"
printf '\n' >&2
[ -n "$token" ] || fail "no token was entered"
"""


#: The agent's variable for each setting of `AgentOffer`, in the order the docs list them.
OFFER_VARIABLES = {
    "parallel": "MODELFORGE_AGENT_PARALLEL",
    "cpus": "MODELFORGE_AGENT_CPUS",
    "gpus": "MODELFORGE_AGENT_GPUS",
    "ram_mb": "MODELFORGE_AGENT_RAM_MB",
    "max_idle_seconds": "MODELFORGE_AGENT_MAX_IDLE_SECONDS",
}


@dataclass(frozen=True)
class AgentOffer:
    """What the node offers and its idle exit, as the agent's variables (docs/nodes.md). None
    leaves a setting to the agent: detected, or its default; the `.env` then has no line for it."""

    parallel: int | None = None
    cpus: int | None = None
    gpus: int | None = None
    ram_mb: int | None = None
    max_idle_seconds: int | None = None

    def __post_init__(self) -> None:
        # Written into the `.env` as they are: nothing but a whole number gets there.
        for name in OFFER_VARIABLES:
            value = getattr(self, name)
            if value is not None and (type(value) is not int or value < 0):
                raise InvalidRequest(
                    f"{name} cannot be written into the node's settings: it must be a whole "
                    "number of 0 or more.",
                    "Leave it empty to let the node agent decide.",
                )

    def env_lines(self) -> list[str]:
        lines = [
            f"{variable}={getattr(self, name)}"
            for name, variable in OFFER_VARIABLES.items()
            if getattr(self, name) is not None
        ]
        if self.max_idle_seconds:
            # An idle exit is code 0: under `unless-stopped` Docker would start the agent again.
            lines.append("MODELFORGE_AGENT_RESTART=on-failure")
        return lines


@dataclass(frozen=True)
class NodeStart:
    """Everything a generated command needs; none of it secret."""

    enrollment_id: str
    display_name: str
    api_origin: str
    accelerator_mode: str
    #: The node-agent image: a release tag (bundle) or a digest-pinned registry reference.
    image: str
    #: Bundle mode: the pasted manifest entry the loaded image must match.
    entry: ImageEntry | None
    #: Bundle mode: the release's runtime worker, started alongside (readiness needs it).
    worker_image: str | None
    #: What the node offers and its idle exit; by default all left to the agent.
    offer: AgentOffer = AgentOffer()
    #: A trusted LAN's plain http:// origin, confirmed by the operator (node_setup).
    allow_insecure_http: bool = False

    def __post_init__(self) -> None:
        if not _SAFE_ORIGIN.fullmatch(self.api_origin):
            raise InvalidRequest(
                "The API origin cannot be written into the node's settings.",
                "Open the wizard from the console served by this control plane.",
                code="API_ORIGIN_INVALID",
            )

    @property
    def services(self) -> list[str]:
        return ["node-agent"] + (["runtime-worker"] if self.worker_image else [])

    @property
    def compose_files(self) -> list[str]:
        files = ["docker-compose.node-agent.yml"]
        if self.worker_image or self.accelerator_mode == "nvidia":
            # The GPU reservations name the runtime worker too, so its file must be in the set.
            files.append("docker-compose.runtime-worker.yml")
        if self.accelerator_mode == "nvidia":
            files.append("docker-compose.gpu.yml")
        return files


def _quote(value: str) -> str:
    return shlex.quote(value)


def _go_json(value: object) -> str:
    """What Docker's `{{json …}}` template prints: Go's encoding/json, sorted keys, HTML-safe."""
    text = json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    for raw, escaped in (
        ("<", "\\u003c"),
        (">", "\\u003e"),
        ("&", "\\u0026"),
        ("\u2028", "\\u2028"),
        ("\u2029", "\\u2029"),
    ):
        text = text.replace(raw, escaped)
    return text


def _one_line(text: str) -> str:
    return "".join(ch if ch.isprintable() else " " for ch in text)


def env_file(start: NodeStart) -> str:
    lines = [
        f"# ModelForge node: enrollment {start.enrollment_id} ({_one_line(start.display_name)}).",
        "# Non-secret settings only: the start command asks for the one-time token at a",
        "# hidden prompt and passes it to Compose through a temporary mode-0600 file.",
        f"COMPOSE_PROJECT_NAME={PROJECT}",
        f"MODELFORGE_NODE_AGENT_IMAGE={start.image}",
    ]
    if start.worker_image:
        lines.append(f"MODELFORGE_RUNTIME_WORKER_IMAGE={start.worker_image}")
    lines += [
        f"MODELFORGE_AGENT_CONTROL_PLANE_URL={start.api_origin}",
        f"MODELFORGE_AGENT_ACCELERATOR_MODE={start.accelerator_mode}",
        "MODELFORGE_AGENT_TLS_VERIFY=true",
        *(
            [
                "# Plain http:// on a trusted LAN, confirmed in the wizard: the credential and",
                "# every call cross this network unencrypted.",
                "MODELFORGE_AGENT_ALLOW_INSECURE_HTTP=true",
            ]
            if start.allow_insecure_http
            else []
        ),
        *start.offer.env_lines(),
        "",
    ]
    return "\n".join(lines)


def _header(start: NodeStart, *, write_env: bool) -> str:
    lines = [
        f"project={PROJECT}",
        f"image={_quote(start.image)}",
        f"worker_image={_quote(start.worker_image or '')}",
        f"env_file={ENV_FILE}",
        "compose_files=(" + " ".join(_quote(f) for f in start.compose_files) + ")",
        "services=(" + " ".join(start.services) + ")",
    ]
    script = _PRELUDE + "\n".join(lines) + "\n" + _COMPOSE
    if write_env:
        script += f"cat > \"$env_file\" <<'{_ENV_END}'\n{env_file(start)}{_ENV_END}\n"
    else:
        script += (
            '[ -f "$env_file" ] || fail "$env_file not found: run this where the start command '
            'ran"\n'
        )
    return script


def _fetch(entry: ImageEntry | None) -> str:
    if entry is None:  # registry mode: the digest pins the content; fetch it now, explicitly
        return 'docker pull "$image" >/dev/null || fail "cannot pull $image"\n'
    return ""  # bundle mode: `modelforge-release load` put it there


def _field_checks(entry: ImageEntry | None) -> str:
    """Bundle mode: the loaded image against every field of the pasted manifest entry."""
    if entry is None:
        return ""
    return "".join(
        [
            "check() {\n"
            '  found="$(docker image inspect --format "$2" "$image")"\n'
            '  [ "$found" = "$3" ] || fail "$image: $1 differs from the release manifest entry '
            '(expected $3, found $found)"\n'
            "}\n",
            f"check rootfs_layers '{{{{json .RootFS.Layers}}}}' "
            f"{_quote(_go_json(list(entry.rootfs_layers)))}\n",
            f"check architecture '{{{{.Architecture}}}}' {_quote(entry.architecture)}\n",
            f"check os '{{{{.Os}}}}' {_quote(entry.os)}\n",
            f"check labels '{{{{json .Config.Labels}}}}' {_quote(_go_json(entry.labels))}\n",
        ]
    )


#: The local image IDs, captured before Compose runs; the containers are checked against them.
_CAPTURE_IDS = (
    'agent_id="$(image_id "$image")"\n'
    'worker_id=""; if [ -n "$worker_image" ]; then worker_id="$(image_id "$worker_image")"; fi\n'
)
_VERIFY_AGENT = 'verify_container node-agent "$agent_id"\n'
_VERIFY_WORKER = (
    'if [ -n "$worker_image" ]; then verify_container runtime-worker "$worker_id"; fi\n'
)


def start_command(start: NodeStart) -> str:
    return (
        _header(start, write_env=True)
        + "# 1. The images, checked before anything starts; their local IDs captured.\n"
        + _fetch(start.entry)
        + _CAPTURE_IDS
        + _field_checks(start.entry)
        + "# 2. The one-time token: hidden prompt, then a mode-0600 file removed on any exit.\n"
        + _CLEANUP
        + f'{{ cat "$env_file"; printf \'{TOKEN_VARIABLE}=%s\\n\' "$token"; }} '
        + '> "$token_file"\n'
        + "unset token\n"
        + "# 3. Start: never build, never pull, the local tags set explicitly.\n"
        + 'MODELFORGE_NODE_AGENT_IMAGE="$image" dc "$token_file" up -d --no-build '
        + '${no_pull[@]+"${no_pull[@]}"} "${services[@]}"\n'
        + _VERIFY_AGENT
        + _VERIFY_WORKER
        + 'echo "modelforge: node agent started from $image ($agent_id)."\n'
        + (
            ""
            if start.worker_image
            else 'echo "modelforge: start the runtime worker next to it '
            '(docker-compose.runtime-worker.yml) before checking readiness."\n'
        )
        + 'echo "modelforge: now use Check node readiness in the console."\n'
        + ")\n"
    )


def recreate_command(start: NodeStart) -> str:
    """After the claim: recreate the agent's container from the `.env` alone, so the token leaves
    its environment; identity and credential stay in the state volume."""
    return (
        _header(start, write_env=False)
        + _CAPTURE_IDS
        + 'MODELFORGE_NODE_AGENT_IMAGE="$image" dc "$env_file" up -d --force-recreate '
        + '--no-build ${no_pull[@]+"${no_pull[@]}"} node-agent\n'
        + _VERIFY_AGENT
        + "environment=\"$(docker inspect --format '{{range .Config.Env}}{{println .}}{{end}}' "
        + '"$container")"\n'
        + f"if [[ $'\\n'\"$environment\" == *$'\\n'{TOKEN_VARIABLE}=[!$'\\n']* ]]; then\n"
        + '  fail "the recreated container still has the enrollment token in its environment"\n'
        + "fi\n"
        + _VERIFY_WORKER
        + 'echo "modelforge: node agent recreated without the enrollment token; identity kept."\n'
        + ")\n"
    )
