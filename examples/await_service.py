"""Wait until a service just deployed is healthy, then print its URL:

    curl -s "$CP/api/v1/services" -H "$ADMIN" ... -d '{...}' | python3 examples/await_service.py

It reads the deploy's answer (the service, or an error) on stdin, and follows
`GET $CP/api/v1/services/<id>` with the admin header `$ADMIN` ("X-ModelForge-Admin-Token: …")
until the service is healthy (at most `--timeout` seconds, 120 by default). Standard library only.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import urllib.request
from typing import Any


def _get(url: str, header: str) -> dict[str, Any]:
    name, _, value = header.partition(":")
    request = urllib.request.Request(url, headers={name.strip(): value.strip()})  # noqa: S310
    with urllib.request.urlopen(request, timeout=10) as answer:  # noqa: S310 - $CP, http(s)
        return dict(json.load(answer))


def main() -> int:
    parser = argparse.ArgumentParser(
        description="Wait until the service deployed (on stdin) is healthy; print its URL."
    )
    parser.add_argument("--timeout", type=float, default=120.0)
    args = parser.parse_args()
    control_plane, header = os.environ.get("CP"), os.environ.get("ADMIN")
    if not control_plane or not header:
        sys.exit("await_service.py: set CP (the control plane's URL) and ADMIN (the admin header)")
    try:
        service = json.load(sys.stdin)
    except json.JSONDecodeError:
        sys.exit("await_service.py: the deploy did not answer JSON (is the control plane up?)")
    if "error" in service:
        error = service["error"]
        sys.exit(
            f"await_service.py: deploy refused: {error.get('message')} {error.get('next_step')}"
        )
    url = f"{control_plane.rstrip('/')}/api/v1/services/{service['service_id']}"
    deadline = time.monotonic() + args.timeout
    while service["state"] != "healthy":
        if time.monotonic() > deadline:
            reason = service.get("waiting_reason") or ""
            sys.exit(
                f"await_service.py: service {service['name']} is still {service['state']} after "
                f"{args.timeout:g} s {reason}; see GET {url}/events"
            )
        time.sleep(0.5)
        service = _get(url, header)
    print(service["url"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
