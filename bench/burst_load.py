"""The admin burst of issue 24, as its own process: the load generator of `bench/burst.py` and
of `tests/e2e/test_burst.py` (so that its work does not slow the probes that measure the
control plane meanwhile).

    python bench/burst_load.py URL ADMIN_TOKEN WRITES READS CONCURRENT [TIMEOUT_S]

WRITES secret PUTs, with READS job lists sent 50 ms after them (as a console's tabs would), then
CONCURRENT job lists at once. Prints one JSON list of `[phase, kind, status, code, seconds]`
(`phase` is `mixed` or `reads`; `status` 0: no answer within TIMEOUT_S, default 120).
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
from typing import Any

import httpx


async def _one(
    client: httpx.AsyncClient, admin: dict[str, str], phase: str, kind: str, index: int
) -> list[Any]:
    started = time.monotonic()
    try:
        if kind == "write":
            response = await client.put(
                f"/api/v1/admin/secrets/BURST_{index}",
                headers=admin,
                json={"value": f"value-{index}", "labels": {}},
            )
        else:
            response = await client.get("/api/v1/jobs", headers=admin)
        status = response.status_code
        code = response.json()["error"]["code"] if status >= 300 else ""
    except httpx.HTTPError:
        status, code = 0, "no answer"
    return [phase, kind, status, code, time.monotonic() - started]


async def _burst(
    url: str, token: str, writes: int, reads: int, concurrent: int, timeout: float
) -> list[list[Any]]:
    admin = {"X-ModelForge-Admin-Token": token}
    limits = httpx.Limits(max_connections=2000, max_keepalive_connections=2000)
    async with httpx.AsyncClient(base_url=url, timeout=timeout, limits=limits) as client:
        writing = [
            asyncio.create_task(_one(client, admin, "mixed", "write", i)) for i in range(writes)
        ]
        await asyncio.sleep(0.05)  # the writes first
        reading = [
            asyncio.create_task(_one(client, admin, "mixed", "read", i)) for i in range(reads)
        ]
        results = list(await asyncio.gather(*writing, *reading))
        results += await asyncio.gather(
            *(_one(client, admin, "reads", "read", i) for i in range(concurrent))
        )
    return results


def main(argv: list[str]) -> int:
    url, token = argv[0], argv[1]
    writes, reads, concurrent = (int(value) for value in argv[2:5])
    timeout = float(argv[5]) if len(argv) > 5 else 120.0
    print(json.dumps(asyncio.run(_burst(url, token, writes, reads, concurrent, timeout))))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
