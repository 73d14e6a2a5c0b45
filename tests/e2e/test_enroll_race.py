"""Over real HTTP: 60 concurrent claims of one token against Granian, 20 times, on SQLite and
PostgreSQL. Exactly one claim wins; the others get ENROLLMENT_TOKEN_USED."""

from __future__ import annotations

import asyncio
import secrets
from collections import Counter
from pathlib import Path

import httpx
import pytest
from sqlalchemy import create_engine, func, select

from control_plane.models import Node, NodeCredential
from tests.e2e.server import LiveServer

pytestmark = pytest.mark.e2e

CLAIMANTS = 60
ROUNDS = 20


async def _race(client: httpx.AsyncClient, token: str) -> list[httpx.Response]:
    async def claim(i: int) -> httpx.Response:
        return await client.post(
            "/api/v1/agent/enroll",
            json={
                "token": token,
                "claim_nonce": secrets.token_hex(16),
                "hostname": f"claimant-{i}",
                "protocol_version": 1,
                "agent_version": "0.1.0",
            },
        )

    return list(await asyncio.gather(*(claim(i) for i in range(CLAIMANTS))))


def test_sixty_concurrent_claims_one_winner(tmp_path: Path, database_url: str) -> None:
    with LiveServer(tmp_path / "data", database_url) as server:

        async def run() -> list[tuple[str, Counter[tuple[int, str]]]]:
            limits = httpx.Limits(max_connections=CLAIMANTS)
            results = []
            async with httpx.AsyncClient(base_url=server.url, limits=limits, timeout=60) as client:
                for _ in range(ROUNDS):
                    minted = await client.post(
                        "/api/v1/admin/node-enrollments",
                        headers=server.admin,
                        json={"display_name": "race", "expires_in_seconds": 300},
                    )
                    assert minted.status_code == 201, minted.text
                    responses = await _race(client, minted.json()["token"])
                    outcome: Counter[tuple[int, str]] = Counter(
                        (r.status_code, "ok" if r.status_code == 200 else r.json()["error"]["code"])
                        for r in responses
                    )
                    results.append((minted.json()["node_id"], outcome))
            return results

        results = asyncio.run(run())

    engine = create_engine(database_url)
    with engine.connect() as conn:
        for node_id, outcome in results:
            assert outcome == Counter({(200, "ok"): 1, (409, "ENROLLMENT_TOKEN_USED"): 59})
            assert conn.scalar(select(func.count()).where(Node.id == node_id)) == 1
            active = conn.scalar(
                select(func.count()).where(
                    NodeCredential.node_id == node_id, NodeCredential.revoked_at.is_(None)
                )
            )
            assert active == 1
        assert conn.scalar(select(func.count()).select_from(Node)) == ROUNDS
    engine.dispose()
