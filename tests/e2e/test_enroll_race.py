"""Over real HTTP: 60 concurrent claims of one token against Granian, 20 times, on SQLite and
PostgreSQL. Exactly one claim wins; the others get ENROLLMENT_TOKEN_USED. A revoke racing the
claims on PostgreSQL: exactly one of claim and revoke wins, never a 500."""

from __future__ import annotations

import asyncio
import secrets
from collections import Counter
from pathlib import Path
from typing import Any

import httpx
import pytest
from sqlalchemy import create_engine, func, select

from control_plane.models import Node, NodeCredential
from tests.e2e.server import LiveServer

pytestmark = pytest.mark.e2e

CLAIMANTS = 60
ROUNDS = 20


async def _race(
    client: httpx.AsyncClient, token: str, claimants: int = CLAIMANTS
) -> list[httpx.Response]:
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

    return list(await asyncio.gather(*(claim(i) for i in range(claimants))))


def _client(server: LiveServer, connections: int) -> httpx.AsyncClient:
    limits = httpx.Limits(max_connections=connections)
    return httpx.AsyncClient(base_url=server.url, limits=limits, timeout=60)


async def _mint(client: httpx.AsyncClient, server: LiveServer) -> dict[str, Any]:
    """Mint an enrollment token as the admin: its enrollment id, node id and token."""
    minted = await client.post(
        "/api/v1/admin/node-enrollments",
        headers=server.admin,
        json={"display_name": "race", "expires_in_seconds": 300},
    )
    assert minted.status_code == 201, minted.text
    return dict(minted.json())


def test_sixty_concurrent_claims_one_winner(tmp_path: Path, database_url: str) -> None:
    with LiveServer(tmp_path / "data", database_url) as server:

        async def run() -> list[tuple[str, Counter[tuple[int, str]]]]:
            results = []
            async with _client(server, CLAIMANTS) as client:
                for _ in range(ROUNDS):
                    minted = await _mint(client, server)
                    responses = await _race(client, minted["token"])
                    outcome: Counter[tuple[int, str]] = Counter(
                        (r.status_code, "ok" if r.status_code == 200 else r.json()["error"]["code"])
                        for r in responses
                    )
                    results.append((minted["node_id"], outcome))
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


REVOKE_ROUNDS = 40
REVOKE_CLAIMANTS = 4


def test_a_revoke_racing_claims_never_fails(tmp_path: Path, pg_database_url: str) -> None:
    """A revoke sent while the token is being claimed (PostgreSQL): never a 500, and exactly one
    of the two wins — the claim (one node; the revoke is ENROLLMENT_ALREADY_CLAIMED) or the
    revoke (every claim is ENROLLMENT_TOKEN_REVOKED, no node)."""
    with LiveServer(tmp_path / "data", pg_database_url) as server:

        async def run() -> list[tuple[str, Counter[tuple[int, str]], tuple[int, str]]]:
            results = []
            async with _client(server, REVOKE_CLAIMANTS + 1) as client:

                async def revoke(enrollment_id: str, delay: float) -> httpx.Response:
                    await asyncio.sleep(delay)
                    return await client.post(
                        f"/api/v1/admin/node-enrollments/{enrollment_id}/revoke",
                        headers=server.admin,
                    )

                for round_number in range(REVOKE_ROUNDS):
                    enrollment = await _mint(client, server)
                    # The revoke lands at staggered moments of the claims' transactions.
                    delay = (round_number % 8) * 0.002
                    claims, revoked = await asyncio.gather(
                        _race(client, enrollment["token"], REVOKE_CLAIMANTS),
                        revoke(enrollment["enrollment_id"], delay),
                    )
                    outcome: Counter[tuple[int, str]] = Counter(_outcome(r) for r in claims)
                    results.append((enrollment["node_id"], outcome, _outcome(revoked)))
            return results

        results = asyncio.run(run())
        log = server.log()
    assert "Traceback" not in log and "INTERNAL_ERROR" not in log
    engine = create_engine(pg_database_url)
    claim_won = revoke_won = 0
    with engine.connect() as conn:
        for node_id, claims, revoked in results:
            nodes = conn.scalar(select(func.count()).where(Node.id == node_id))
            if revoked == (200, "ok"):
                revoke_won += 1
                assert claims == Counter({(410, "ENROLLMENT_TOKEN_REVOKED"): REVOKE_CLAIMANTS})
                assert nodes == 0
            else:
                claim_won += 1
                assert revoked == (409, "ENROLLMENT_ALREADY_CLAIMED"), (claims, revoked)
                assert claims == Counter(
                    {(200, "ok"): 1, (409, "ENROLLMENT_TOKEN_USED"): REVOKE_CLAIMANTS - 1}
                )
                assert nodes == 1
    engine.dispose()
    assert claim_won + revoke_won == REVOKE_ROUNDS


def _outcome(response: httpx.Response) -> tuple[int, str]:
    if response.status_code == 200:
        return 200, "ok"
    return response.status_code, str(response.json()["error"]["code"])
