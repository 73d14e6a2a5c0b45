"""The Bash the Enroll node wizard generates (UI-2..UI-4). Every value put into a script is
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
import shlex

from release.manifest import ImageEntry

ENV_FILE = "modelforge-node.env"
TOKEN_VARIABLE = "MODELFORGE_AGENT_ENROLLMENT_TOKEN"  # noqa: S105 - a variable name
PROJECT = "modelforge-node"
_ENV_END = "MODELFORGE_NODE_ENV"

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
  # Compose v1 has no --pull; the image is proven present before Compose runs, so none is.
  compose=(docker-compose) no_pull=()
else
  fail "neither 'docker compose' nor 'docker-compose' is installed"
fi
files=(); for file in "${compose_files[@]}"; do files+=(-f "$file"); done
dc() { local env="$1"; shift; "${compose[@]}" -p "$project" --env-file "$env" "${files[@]}" "$@"; }
"""

_VERIFY_CONTAINER = r"""container="$(dc "$env_file" ps -q node-agent)"
[ -n "$container" ] || fail "Compose created no node-agent container"
running="$(docker inspect --format '{{.Image}}' "$container")"
if [ "$running" != "$image_id" ]; then
  dc "$env_file" stop node-agent >/dev/null 2>&1 || true
  fail "node-agent runs image $running, not the checked $image_id; stopped it"
fi
"""


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


def compose_files(accelerator_mode: str) -> list[str]:
    files = ["docker-compose.node-agent.yml"]
    if accelerator_mode == "nvidia":
        # The GPU reservations name the runtime worker too, so its file must be in the set.
        files += ["docker-compose.runtime-worker.yml", "docker-compose.gpu.yml"]
    return files


def env_file(
    *,
    enrollment_id: str,
    display_name: str,
    api_origin: str,
    accelerator_mode: str,
    image: str,
) -> str:
    return "\n".join(
        [
            f"# ModelForge node agent for enrollment {enrollment_id} ({_one_line(display_name)}).",
            "# Non-secret settings only: the start command asks for the one-time token at a",
            "# hidden prompt and passes it to Compose through a temporary mode-0600 file.",
            f"COMPOSE_PROJECT_NAME={PROJECT}",
            f"MODELFORGE_NODE_AGENT_IMAGE={image}",
            f"MODELFORGE_AGENT_CONTROL_PLANE_URL={api_origin}",
            f"MODELFORGE_AGENT_ACCELERATOR_MODE={accelerator_mode}",
            "MODELFORGE_AGENT_TLS_VERIFY=true",
            "",
        ]
    )


def _common(*, image: str, env_text: str | None, accelerator_mode: str) -> str:
    lines = [
        f"project={PROJECT}",
        f"image={_quote(image)}",
        f"env_file={ENV_FILE}",
        "compose_files=(" + " ".join(_quote(f) for f in compose_files(accelerator_mode)) + ")",
    ]
    script = _PRELUDE + "\n".join(lines) + "\n" + _COMPOSE
    if env_text is not None:
        script += f"cat > \"$env_file\" <<'{_ENV_END}'\n{env_text}{_ENV_END}\n"
    else:
        script += (
            '[ -f "$env_file" ] || fail "$env_file not found: run this where the start command '
            'ran"\n'
        )
    return script


def _image_checks(image: str, entry: ImageEntry | None) -> str:
    if entry is None:  # registry mode: the digest pins the content; fetch it now, explicitly
        return 'docker pull "$image" >/dev/null || fail "cannot pull $image"\n'
    checks = [
        'docker image inspect "$image" >/dev/null 2>&1 \\\n'
        '  || fail "$image is not loaded: verify the bundle, then docker image load -i '
        'the images tar"\n',
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
    return "".join(checks)


def start_command(
    *, env_file: str, image: str, entry: ImageEntry | None, accelerator_mode: str
) -> str:
    return (
        _common(image=image, env_text=env_file, accelerator_mode=accelerator_mode)
        + "# 1. The image, checked against the release before anything starts.\n"
        + _image_checks(image, entry)
        + 'image_id="$(docker image inspect --format \'{{.Id}}\' "$image")"\n'
        + "# 2. The one-time token: hidden prompt, then a mode-0600 file removed on any exit.\n"
        + "token_file=''\n"
        + 'cleanup() { if [ -n "$token_file" ]; then rm -f -- "$token_file"; fi; }\n'
        + "trap cleanup EXIT\n"
        + "trap 'cleanup; trap - INT; kill -INT \"$BASHPID\"' INT\n"
        + "trap 'cleanup; trap - TERM; kill -TERM \"$BASHPID\"' TERM\n"
        + 'token_file="$(mktemp "${TMPDIR:-/tmp}/modelforge-node.XXXXXXXX")"\n'
        + "IFS= read -rs -p 'One-time enrollment token (input hidden): ' token "
        + '|| fail "no token was entered"\n'
        + "printf '\\n' >&2\n"
        + '[ -n "$token" ] || fail "no token was entered"\n'
        + f'{{ cat "$env_file"; printf \'{TOKEN_VARIABLE}=%s\\n\' "$token"; }} '
        + '> "$token_file"\n'
        + "unset token\n"
        + "# 3. Start: never build, never pull, the local tag set explicitly.\n"
        + 'MODELFORGE_NODE_AGENT_IMAGE="$image" dc "$token_file" up -d --no-build '
        + '"${no_pull[@]}" node-agent\n'
        + _VERIFY_CONTAINER
        + 'echo "modelforge: node agent started from $image ($image_id)."\n'
        + 'echo "modelforge: now use Check node readiness in the console."\n'
        + ")\n"
    )


def recreate_command(*, image: str, accelerator_mode: str) -> str:
    """After the claim: recreate the container from the `.env` alone, so the token leaves its
    environment; identity and credential stay in the state volume."""
    return (
        _common(image=image, env_text=None, accelerator_mode=accelerator_mode)
        + 'image_id="$(docker image inspect --format \'{{.Id}}\' "$image")"\n'
        + 'MODELFORGE_NODE_AGENT_IMAGE="$image" dc "$env_file" up -d --force-recreate '
        + '--no-build "${no_pull[@]}" node-agent\n'
        + _VERIFY_CONTAINER
        + "environment=\"$(docker inspect --format '{{range .Config.Env}}{{println .}}{{end}}' "
        + '"$container")"\n'
        + f"if [[ $'\\n'\"$environment\" == *$'\\n'{TOKEN_VARIABLE}=[!$'\\n']* ]]; then\n"
        + '  fail "the recreated container still has the enrollment token in its environment"\n'
        + "fi\n"
        + 'echo "modelforge: node agent recreated without the enrollment token; identity kept."\n'
        + ")\n"
    )
