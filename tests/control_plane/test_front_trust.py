"""The client's address behind the native front (`api/rsgi.py`, `FrontTrust`): the front's
`x-modelforge-client` and `x-modelforge-scheme` are believed only beside this start's key, and no
such header reaches the app; and when the control plane uses the front at all
(`native_front.why_not`)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import pytest
from pydantic import ValidationError

from control_plane.api.rsgi import FRONT_KEY_ENV, FrontTrust, _asgi_scope
from control_plane.native_front import BINARY, FrontUnavailable, NativeFront, why_not
from control_plane.settings import Settings

KEY = "k" * 64


@pytest.fixture
def trust(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.setenv(FRONT_KEY_ENV, KEY)
    FrontTrust.load()
    yield
    monkeypatch.delenv(FRONT_KEY_ENV)
    FrontTrust.load()


def _scope(headers: dict[str, str]) -> SimpleNamespace:
    return SimpleNamespace(
        http_version="1.1",
        method="GET",
        scheme="http",
        path="/api/v1/health",
        query_string="",
        headers=headers,
        client="127.0.0.1:50000",
        server="127.0.0.1:8080",
    )


def test_the_fronts_address_is_taken_with_its_key(trust: None) -> None:
    scope = _asgi_scope(
        _scope({"x-modelforge-client": "10.1.2.3:4444", "x-modelforge-front-key": KEY}), {}
    )
    assert scope["client"] == ("10.1.2.3", 4444)
    names = [name for name, _ in scope["headers"]]
    assert b"x-modelforge-client" not in names and b"x-modelforge-front-key" not in names


@pytest.mark.parametrize(
    "headers",
    [
        {"x-modelforge-client": "10.1.2.3:4444"},
        {"x-modelforge-client": "10.1.2.3:4444", "x-modelforge-front-key": "wrong"},
        {"x-modelforge-client": "10.1.2.3:4444", "x-modelforge-front-key": KEY[:-1]},
    ],
)
def test_an_address_without_the_key_is_ignored(trust: None, headers: dict[str, str]) -> None:
    scope = _asgi_scope(_scope(headers), {})
    assert scope["client"] == ("127.0.0.1", 50000)
    assert b"x-modelforge-client" not in [name for name, _ in scope["headers"]]


def test_without_a_front_no_header_is_believed() -> None:
    FrontTrust.load()
    assert FrontTrust.key is None
    scope = _asgi_scope(
        _scope({"x-modelforge-client": "10.1.2.3:4444", "x-modelforge-front-key": ""}), {}
    )
    assert scope["client"] == ("127.0.0.1", 50000)


def test_the_fronts_scheme_is_taken_with_its_key(trust: None) -> None:
    told = {"x-modelforge-scheme": "https", "x-modelforge-front-key": KEY}
    scope = _asgi_scope(_scope(told), {})
    assert scope["scheme"] == "https"
    assert b"x-modelforge-scheme" not in [name for name, _ in scope["headers"]]
    for headers in ({"x-modelforge-scheme": "https"}, {**told, "x-modelforge-front-key": "no"}):
        scope = _asgi_scope(_scope(headers), {})
        assert scope["scheme"] == "http"  # Granian's, not the header's
        assert b"x-modelforge-scheme" not in [name for name, _ in scope["headers"]]
    odd = _asgi_scope(_scope({**told, "x-modelforge-scheme": "gopher"}), {})
    assert odd["scheme"] == "http"


def test_the_front_is_the_default_with_tls_and_not_with_peers(tmp_path: Path) -> None:
    base = {"data_dir": tmp_path}
    assert BINARY.is_file(), "the native front is not built: run `make install`"
    assert why_not(Settings(**base)) is None  # native by default
    assert why_not(Settings(**base, gateway_front="python")) == "MODELFORGE_GATEWAY_FRONT=python"
    assert why_not(Settings(**base, gateway_front="native")) is None
    tls = Settings(**base, gateway_front="native", tls_cert=tmp_path / "c", tls_key=tmp_path / "k")
    assert why_not(tls) is None
    peers = Settings(**base, gateway_peer_address="http://10.0.0.1:8080")
    assert "does not forward requests to other control-plane replicas" in (why_not(peers) or "")


def test_native_with_a_peer_address_is_refused_naming_the_fix(tmp_path: Path) -> None:
    with pytest.raises(ValidationError) as refused:
        Settings(
            data_dir=tmp_path, gateway_front="native", gateway_peer_address="http://10.0.0.1:8080"
        )
    assert "unset MODELFORGE_GATEWAY_FRONT" in str(refused.value)


def test_a_missing_front_stops_the_start_naming_the_fix_never_a_fallback(tmp_path: Path) -> None:
    """Unset, the setting means the native front, so a missing binary is the start-up error
    (`cli` exits with it), not a quiet Python gateway."""
    settings = Settings(data_dir=tmp_path)
    assert why_not(settings) is None
    with pytest.raises(FrontUnavailable, match="not installed .*run `make install`"):
        NativeFront(settings, binary=tmp_path / "modelforge-gateway-front")
