"""A bounded property-based run (schemathesis) over every endpoint of the OpenAPI schema against
a Granian-served control plane on PostgreSQL: no request may produce a 5xx."""

from __future__ import annotations

import secrets
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings

from tests.conftest import _truncate
from tests.e2e.server import LiveServer

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def live(tmp_path_factory: pytest.TempPathFactory, postgres_url: str) -> Iterator[LiveServer]:
    _truncate(postgres_url)
    data_dir: Path = tmp_path_factory.mktemp("fuzz") / "data"
    with LiveServer(data_dir, postgres_url) as server:
        yield server


@pytest.fixture(scope="module")
def credential(live: LiveServer) -> str:
    return str(live.enroll("fuzz")["credential"])


def test_no_server_errors(live: LiveServer, credential: str) -> None:
    # Driven operation by operation with Hypothesis: schemathesis' pytest plugin does not
    # support this pytest release.
    schema = schemathesis.openapi.from_url(f"{live.url}/openapi.json")
    operations = [result.ok() for result in schema.get_all_operations()]
    assert len(operations) >= 15
    failures: list[str] = []
    for operation in operations:

        @given(case=operation.as_strategy())
        @settings(
            max_examples=40, deadline=None, database=None, suppress_health_check=list(HealthCheck)
        )
        def check(case: schemathesis.Case) -> None:
            headers = dict(case.headers or {})
            # Authenticated half the time, so validation and the services behind auth run. The
            # other half sends no admin token at all: generated wrong tokens would trip the
            # per-address throttle (429 after 10) and lock the authenticated half out too;
            # wrong tokens are covered by tests/control_plane/test_admin_auth.py.
            headers = {k: v for k, v in headers.items() if k.lower() != "x-modelforge-admin-token"}
            if secrets.randbelow(2):
                headers["X-ModelForge-Admin-Token"] = live.admin["X-ModelForge-Admin-Token"]
                headers["Authorization"] = f"Bearer {credential}"
            _bound_long_polls(case)
            response = case.call(base_url=live.url, headers=headers)
            assert response.status_code < 500, (case.method, case.path, response.text)
            page = "text/html" in str(response.headers.get("content-type"))
            if response.status_code >= 400 and page:
                # Single sign-on's routes are a browser's navigations: their refusal is a page
                # with its code and next step (docs/access.md); a malformed query is the API's
                # usual JSON.
                assert case.path.startswith("/api/v1/console/oidc/"), case.path
                assert "<code>OIDC_" in response.text and "Next step:" in response.text
            elif response.status_code >= 400:
                error = response.json()["error"]
                if case.path.startswith("/v1/"):  # the OpenAI API answers in OpenAI's shape
                    assert error["code"] and error["message"] and error["type"]
                else:
                    assert error["code"] and error["message"] and error["next_step"]

        try:
            check()
        except AssertionError as exc:
            failures.append(f"{operation.method.upper()} {operation.path}: {exc}")
    assert not failures, "\n".join(failures)


#: The longest hold a fuzzed long poll may ask for: the claim, the cancellation watch and the
#: job events' `wait` hold for as long as asked (up to 60 s, 25 s by default) when nothing
#: comes, which is their contract, not an error; this run looks for 5xx answers, not for holds.
LONG_POLL_MAX_SECONDS = 0.5
HOLDING_BODIES = ("/api/v1/agent/work/claim", "/api/v1/agent/jobs/watch")


def _bound_long_polls(case: schemathesis.Case) -> None:
    """Cap what the generated case asks a long poll to hold (an absent hold is the default)."""
    if isinstance(case.body, dict) and case.path in HOLDING_BODIES:
        hold = case.body.get("hold_seconds", LONG_POLL_MAX_SECONDS)
        if isinstance(hold, int | float) and not isinstance(hold, bool):
            case.body["hold_seconds"] = min(hold, LONG_POLL_MAX_SECONDS)
    if case.query and isinstance(case.query.get("wait"), int | float):
        case.query["wait"] = min(case.query["wait"], LONG_POLL_MAX_SECONDS)


def test_openapi_lists_every_route(live: LiveServer) -> None:
    paths = httpx.get(f"{live.url}/openapi.json").json()["paths"]
    assert "/api/v1/agent/heartbeat" in paths and "/api/v1/admin/nodes/{node_id}/readiness" in paths
    assert httpx.get(f"{live.url}/docs").status_code == 200
