"""`bench/tunnel_floor.py` (issue 27) at its smallest: each transport's minimal app and peer
start, `wrk` gets every request answered 2xx through each, and the figures are printed. The
figures themselves are not held to anything here (a loaded CI machine): docs/performance.md
has them."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.e2e

BENCH = Path(__file__).resolve().parents[2] / "bench" / "tunnel_floor.py"


def test_the_tunnel_floor_bench_measures_each_transport() -> None:
    assert shutil.which("wrk"), "wrk is missing: apt-get install wrk"
    run = subprocess.run(
        [sys.executable, str(BENCH), "--rounds", "1", "--duration", "1"],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert run.returncode == 0, run.stdout + run.stderr
    rows = {line.split()[0]: line.split() for line in run.stdout.splitlines()[1:] if line}
    assert set(rows) == {"plain", "granian-ws", "loop-ws", "loop-tcp"}, run.stdout
    for row in rows.values():
        requests_per_second, failed = float(row[4].replace(",", "")), int(row[-1])
        assert requests_per_second > 0 and failed == 0, run.stdout
