"""/docs in real headless Chromium (Debian's /usr/bin/chromium): Swagger UI renders the API from
files the control plane serves itself, the page asks no other origin for anything, and its
Content-Security-Policy is never violated. Chromium's own network log tells which requests the
page made; name resolution is switched off for everything but the loopback address, so nothing
leaves the machine either way."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

import pytest

from tests.e2e.server import LiveServer

pytestmark = pytest.mark.e2e

CHROMIUM = Path("/usr/bin/chromium")


def _net_log(path: Path) -> dict[str, Any]:
    text = path.read_text().rstrip()
    if not text.endswith("}"):  # cut off at exit: close the list of events
        text = text.rstrip(",") + "]}"
    log: dict[str, Any] = json.loads(text)
    return log


def _page_requests(log: dict[str, Any], site: str) -> list[str]:
    """The URLs the page fetched: requests keyed to its site, not the browser's own."""
    names = {number: name for name, number in log["constants"]["logEventTypes"].items()}
    urls = []
    for event in log["events"]:
        params = event.get("params") or {}
        if names.get(event["type"]) == "URL_REQUEST_START_JOB" and str(
            params.get("network_isolation_key", "")
        ).startswith(site):
            urls.append(str(params["url"]))
    return urls


def test_docs_render_offline_from_this_origin(tmp_path: Path) -> None:
    assert CHROMIUM.exists(), "Debian's chromium is missing: run scripts/ensure-chromium"
    with LiveServer(tmp_path / "cp", f"sqlite:///{tmp_path / 'cp.db'}") as server:
        net_log = tmp_path / "net-log.json"
        result = subprocess.run(
            [
                str(CHROMIUM),
                "--headless",
                "--no-sandbox",
                "--disable-gpu",
                "--no-first-run",
                "--disable-background-networking",
                "--disable-component-update",
                "--disable-sync",
                "--disable-extensions",
                "--host-resolver-rules=MAP * ~NOTFOUND, EXCLUDE 127.0.0.1",
                f"--user-data-dir={tmp_path / 'profile'}",
                f"--log-net-log={net_log}",
                "--enable-logging=stderr",
                "--v=0",
                "--virtual-time-budget=20000",
                "--dump-dom",
                f"{server.url}/docs",
            ],
            capture_output=True,
            text=True,
            timeout=180,
            check=False,
        )
    dom, console = result.stdout, result.stderr
    assert result.returncode == 0, console[-3000:]
    # Swagger UI ran: the operations of the API are on the page.
    assert "opblock" in dom and "/api/v1/agent/heartbeat" in dom, dom[:3000]
    assert "ModelForge control plane" in dom
    requests = _page_requests(_net_log(net_log), "http://127.0.0.1")
    assert f"{server.url}/openapi.json" in requests, requests
    assert f"{server.url}/docs/assets/swagger-ui-bundle.js" in requests, requests
    foreign = [url for url in requests if not url.startswith(server.url + "/")]
    assert not foreign, foreign
    messages = [line for line in console.splitlines() if ":CONSOLE" in line]
    assert not [m for m in messages if "Content Security Policy" in m], messages
    assert not [m for m in messages if "Failed to load" in m], messages
