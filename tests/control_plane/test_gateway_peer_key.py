"""The replicas' shared key (gateway/peers.py): made once whoever asks first, the same for every
replica starting at once; and a signature holds only for its method, path, query and time."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime

from sqlalchemy import create_engine, func, select
from sqlalchemy.orm import Session

from control_plane.gateway.peers import (
    SIGNATURE_HEADER,
    TIME_HEADER,
    VALIDITY,
    authentic,
    ensure_peer_key,
    sign,
)
from control_plane.models import GatewayPeerKey


def test_replicas_starting_together_agree_on_one_key(pg_database_url: str) -> None:
    engine = create_engine(pg_database_url, pool_size=8)

    def start() -> bytes:
        with Session(engine) as session, session.begin():
            return ensure_peer_key(session, now=datetime.now(UTC))

    try:
        with ThreadPoolExecutor(8) as pool:
            keys = list(pool.map(lambda _: start(), range(8)))
        with Session(engine) as session:
            rows = session.scalar(select(func.count()).select_from(GatewayPeerKey))
    finally:
        engine.dispose()
    assert len(set(keys)) == 1 and len(keys[0]) >= 64
    assert rows == 1


def test_a_signature_holds_for_its_request_and_time_only() -> None:
    key = b"k" * 64
    path = "/api/v1/internal/gateway/n1/r1/infer"
    at = "1000.000"
    signed = sign(key, method="POST", path=path, query="a=1", timestamp=at)
    headers = [(TIME_HEADER, at), (SIGNATURE_HEADER, signed)]

    def check(**changes: object) -> bool:
        request: dict[str, object] = {
            "method": "POST",
            "path": path,
            "query": "a=1",
            "headers": headers,
            "now": 1000.0,
        }
        request.update(changes)
        return authentic(key, **request)  # type: ignore[arg-type]

    assert check()
    assert check(now=1000.0 + VALIDITY - 1)
    assert not check(now=1000.0 + VALIDITY + 1)  # replayed too late
    assert not check(method="GET")
    assert not check(path=path.replace("r1", "r2"))
    assert not check(query="a=2")
    assert not check(headers=[(TIME_HEADER, "1001.000"), (SIGNATURE_HEADER, signed)])
    assert not check(headers=[(TIME_HEADER, "nan"), (SIGNATURE_HEADER, signed)])
    assert not check(headers=[])
    assert not authentic(
        b"x" * 64, method="POST", path=path, query="a=1", headers=headers, now=1000.0
    )
