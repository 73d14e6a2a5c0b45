"""Wait until a service just deployed is healthy, then mint it an access token and print it:
the key its clients call it with at the control plane's address ($CP).

    KEY=$(curl -s "$CP/api/v1/services" -H "$ADMIN" ... -d '{...}' \
      | python3 examples/await_service.py --key my-app)

It reads the deploy's answer (the service, or an error) on stdin, and follows
`GET $CP/api/v1/services/<id>` with the admin header `$ADMIN` ("X-ModelForge-Admin-Token: …")
until the service is healthy (at most `--timeout` seconds, 120 by default), then asks
`POST $CP/api/v1/services/<id>/access-tokens` for a token named by `--key` (shown once: only its
digest is kept). Without `--key` it prints the service's id instead. Standard library only.

A `failed` service (it could not start) is tried again by the control plane with backoff, so
this keeps waiting, saying on stderr why it failed each time that changes. It exits non-zero,
with one line, when the time runs out or the control plane refuses the admin header (HTTP 401).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import urllib.error
import urllib.request
from typing import Any


def _get(url: str, header: str, body: dict[str, Any] | None = None) -> Any:
    """The JSON answer (to a POST of `body` when given); an HTTP error or an unreachable control
    plane ends here in one line."""
    name, _, value = header.partition(":")
    headers = {name.strip(): value.strip()}
    data = None
    if body is not None:
        data = json.dumps(body).encode()
        headers["Content-Type"] = "application/json"
    request = urllib.request.Request(url, data=data, headers=headers)  # noqa: S310
    try:
        with urllib.request.urlopen(request, timeout=10) as answer:  # noqa: S310 - $CP, http(s)
            return json.load(answer)
    except urllib.error.HTTPError as exc:
        if exc.code == 401:
            sys.exit(
                "await_service.py: the control plane refused the admin header (HTTP 401): set "
                'ADMIN to "X-ModelForge-Admin-Token: <the admin token>"'
            )
        try:
            error = json.load(exc).get("error") or {}
        except (ValueError, AttributeError):
            error = {}
        sys.exit(
            f"await_service.py: {request.get_method()} {url} answered HTTP {exc.code}: "
            f"{error.get('message', exc.reason)} {error.get('next_step', '')}".rstrip()
        )
    except (urllib.error.URLError, TimeoutError) as exc:
        reason = getattr(exc, "reason", exc)
        sys.exit(f"await_service.py: cannot reach the control plane at {url}: {reason}")


def _reason(reason: dict[str, str] | None) -> str:
    """A `waiting_reason` (code, message, next_step) as one line."""
    if not reason:
        return ""
    return f"({reason.get('code')}: {reason.get('message')}; {reason.get('next_step', '')})"


def _last_error(events: list[dict[str, Any]], error: str) -> str:
    """The last error event's code and message, else `error` (the one seen before)."""
    for event in reversed(events):
        data = event.get("data")
        if event.get("kind") == "error" and isinstance(data, dict):
            return f"{data.get('code', 'error')}: {data.get('message', '')}"
    return error


def main() -> int:
    parser = argparse.ArgumentParser(
        description="Wait until the service deployed (on stdin) is healthy; print a new key "
        "for it (--key NAME), or its id."
    )
    parser.add_argument("--timeout", type=float, default=120.0)
    parser.add_argument("--key", metavar="NAME", help="mint an access token named NAME; print it")
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
    said, error, seen = "", "no error event yet", 0
    while service["state"] != "healthy":
        if service["state"] == "stopped":
            sys.exit(f"await_service.py: service {service['name']} was undeployed (stopped)")
        if service["state"] == "failed":
            # Not final: the control plane tries it again with backoff. Say why, once per change.
            events = _get(f"{url}/events?after={seen}", header)
            seen = max([seen, *(event["seq"] for event in events)])
            error = _last_error(events, error)
            news = f"service {service['name']} failed ({error}); it is tried again, waiting"
            if news != said:
                print(f"await_service.py: {news}", file=sys.stderr)
                said = news
        if time.monotonic() > deadline:
            sys.exit(
                f"await_service.py: service {service['name']} is still {service['state']} after "
                f"{args.timeout:g} s {_reason(service.get('waiting_reason'))}".rstrip()
                + f"; see GET {url}/events"
            )
        time.sleep(0.5)
        service = _get(url, header)
    if args.key is None:
        print(service["service_id"])
        return 0
    print(_get(f"{url}/access-tokens", header, {"name": args.key})["token"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
