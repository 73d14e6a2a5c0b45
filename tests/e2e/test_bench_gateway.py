"""`bench/gateway.py` (issue 27) at a tiny size: a real control plane, two nodes (agents and
runtime workers), `wrk` direct to a replica and through the gateway with an access token, a
rollout and a node killed under load through the gateway, a
request after a scale to zero. The run must measure every part it
is given, answer every compared request 2xx and lose no request when the node dies; its timings
are not held to the issue's targets here (a loaded CI machine): docs/performance.md has them."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.e2e

BENCH = Path(__file__).resolve().parents[2] / "bench" / "gateway.py"


def test_the_gateway_bench_measures_each_part() -> None:
    assert shutil.which("wrk"), "wrk is missing: apt-get install wrk"
    run = subprocess.run(
        [
            sys.executable,
            str(BENCH),
            "--parts",
            "compare,rollout,cold,kill",
            "--duration",
            "1",
            "--event-duration",
            "8",
            "--idle-seconds",
            "3",
            "--drain-seconds",
            "2",
        ],
        capture_output=True,
        text=True,
        timeout=280,
    )
    out = run.stdout
    assert run.returncode == 0, out + run.stderr[-4000:]
    assert "parts run: compare, rollout, cold, kill" in out, out
    rows = re.findall(r"^(direct|gateway)\s+small http (binary|json)\s+(\d)\s+wrk\s.*$", out, re.M)
    assert sorted(rows) == sorted(
        (route, kind, conns)
        for route in ("direct", "gateway")
        for kind, conns in (("binary", "8"), ("json", "8"), ("binary", "1"))
    ), out
    # Each under-load row ends with its failed requests; the node's death must cost none.
    killed = re.search(
        r"^node killed under load: (\d+) requests.*\n\s+gateway .* (\d+)$", out, re.M
    )
    assert killed is not None and int(killed[1]) > 0 and killed[2] == "0", out
    assert re.search(r"^rollout under load: \d+ requests, model changed to mlp@2", out, re.M), out
    assert re.search(r"weights cached: the first request after 3 s idle answered 200 in", out), out
    assert "8 conns binary: p50 added by the gateway, ms" in out, out
