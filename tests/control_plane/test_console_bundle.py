"""The console's JavaScript stays small enough to load quickly on an operator's laptop over a
VPN: under 150 KB gzipped, all of it (UI-6)."""

from __future__ import annotations

import gzip
from pathlib import Path

DIST = Path(__file__).resolve().parents[2] / "control_plane" / "console" / "dist"
LIMIT = 150 * 1024


def test_console_javascript_is_under_150_kb_gzipped() -> None:
    scripts = sorted((DIST / "assets").glob("*.js"))
    assert scripts, f"no built console under {DIST}: run make console"
    sizes = {path.name: len(gzip.compress(path.read_bytes(), compresslevel=9)) for path in scripts}
    total = sum(sizes.values())
    print(f"console JavaScript: {total / 1024:.1f} KiB gzipped ({sizes})")
    assert total < LIMIT, f"{total} bytes gzipped > {LIMIT}: {sizes}"
