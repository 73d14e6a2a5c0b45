"""A `docker` stand-in for running the wizard's generated commands under real Bash.

It records every call (argv, and for `--env-file` the file's mode and content at that moment)
as JSON lines in $MF_DOCKER_LOG, and answers from $MF_DOCKER_FACTS (a JSON file): the loaded
images' inspect fields by tag, and per Compose service its container's ID, image ID and
environment. $MF_DOCKER_UP says what
`compose up` does: `ok`, `fail` (exit 1) or `hang` (wait to be signalled).
"""

from __future__ import annotations

import json
import os
import stat
import sys
import time
from pathlib import Path


def main(argv: list[str]) -> int:
    facts = json.loads(Path(os.environ["MF_DOCKER_FACTS"]).read_text())
    record: dict[str, object] = {"argv": argv}
    if "--env-file" in argv:
        env_file = Path(argv[argv.index("--env-file") + 1])
        record["env_file"] = str(env_file)
        if env_file.exists():
            record["env_file_mode"] = stat.S_IMODE(env_file.stat().st_mode)
            record["env_file_content"] = env_file.read_text()
    with open(os.environ["MF_DOCKER_LOG"], "a") as log:
        log.write(json.dumps(record) + "\n")

    if argv[:2] == ["compose", "version"]:
        # MF_DOCKER_COMPOSE=v1: only the separate `docker-compose` (v1) program exists.
        return 1 if os.environ.get("MF_DOCKER_COMPOSE") == "v1" else 0
    if argv[:2] == ["image", "inspect"]:
        image = facts["images"].get(argv[-1])
        if image is None:
            print(f"Error: No such image: {argv[-1]}", file=sys.stderr)
            return 1
        template = argv[argv.index("--format") + 1]
        answers = {
            "{{json .RootFS.Layers}}": json.dumps(image.get("layers"), separators=(",", ":")),
            "{{.Architecture}}": image.get("architecture"),
            "{{.Os}}": image.get("os"),
            "{{json .Config.Labels}}": image.get("labels_json"),
            "{{.Id}}": image["id"],
        }
        print(answers[template])
        return 0
    containers = facts["containers"]
    if argv[0] == "compose" and "up" in argv:
        mode = os.environ.get("MF_DOCKER_UP", "ok")
        if mode == "fail":
            print("Error response from daemon: substitute failure", file=sys.stderr)
            return 1
        if mode == "hang":
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline:
                time.sleep(0.05)
            return 1
        return 0
    if argv[0] == "compose" and "ps" in argv:
        print(containers[argv[-1]]["id"])
        return 0
    if argv[0] == "compose" and "stop" in argv:
        return 0
    if argv[:1] == ["inspect"]:
        template = argv[argv.index("--format") + 1]
        (container,) = [c for c in containers.values() if c["id"] == argv[-1]]
        if template == "{{.Image}}":
            print(container["image"])
        else:
            print("\n".join(container.get("env", [])))
        return 0
    print(f"docker substitute: unexpected call {argv}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
