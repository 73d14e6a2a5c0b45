"""GET /metrics (OB-1): exact values after real requests, outcomes counted only once committed,
the admin token or the metrics token (that opens nothing else), and the metrics token never
shown. SQLite and PostgreSQL."""

from __future__ import annotations

import logging
import secrets
import sqlite3
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families
from pydantic import SecretStr, ValidationError
from sqlalchemy import exc, select
from sqlalchemy.orm import Session

from control_plane.jobs import lifecycle
from control_plane.metrics import CONTENT_TYPE, MAX_ERROR_CODES, Metrics
from control_plane.settings import Settings
from tests.factories import (
    ADMIN_TOKEN,
    PYTHON_JOB,
    ControlPlane,
    ReadyNode,
    control_plane,
    make_settings,
)

METRICS_TOKEN = "mfm_test_" + secrets.token_urlsafe(24)
BEARER = {"Authorization": f"Bearer {METRICS_TOKEN}"}
Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


def _parse(text: str) -> Samples:
    return {
        (sample.name, frozenset(sample.labels.items())): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def _scrape(cp: ControlPlane) -> Samples:
    response = cp.client.get("/metrics", headers=BEARER)
    assert response.status_code == 200, response.text
    return _parse(response.text)


def _value(samples: Samples, name: str, **labels: str) -> float:
    return samples[(name, frozenset(labels.items()))]


def _fleet(samples: Samples) -> dict[str, float]:
    return {
        "online": _value(samples, "modelforge_nodes", state="online"),
        "stale": _value(samples, "modelforge_nodes", state="stale"),
        "offline": _value(samples, "modelforge_nodes", state="offline"),
        "needs_upgrade": _value(samples, "modelforge_nodes_needs_upgrade"),
        "queued": _value(samples, "modelforge_jobs", state="queued"),
        "running": _value(samples, "modelforge_jobs", state="running"),
        "artifact_bytes": _value(samples, "modelforge_artifact_store_bytes"),
        "heartbeats": _value(samples, "modelforge_heartbeats_accepted_total"),
    }


def _outcomes(samples: Samples) -> dict[tuple[str, str], float]:
    return {
        (dict(labels)["state"], dict(labels)["code"]): value
        for (name, labels), value in samples.items()
        if name == "modelforge_jobs_finished_total"
    }


def _submit(cp: ControlPlane) -> str:
    response = cp.client.post("/api/v1/jobs", headers=cp.admin, json=PYTHON_JOB)
    assert response.status_code == 201, response.text
    return str(response.json()["job_id"])


def _claim(cp: ControlPlane, node: ReadyNode) -> str:
    response = cp.client.post(
        "/api/v1/agent/work/claim", headers=node.headers, json={"hold_seconds": 0}
    )
    assert response.status_code == 200, response.text
    return str(response.json()["job_id"])


def _complete(cp: ControlPlane, node: ReadyNode, job_id: str, **body: Any) -> None:
    response = cp.client.post(
        f"/api/v1/agent/jobs/{job_id}/complete", headers=node.headers, json=body
    )
    assert response.status_code == 200, response.text


def test_values_are_exact_after_real_requests(tmp_path: Path, database_url: str) -> None:
    with control_plane(tmp_path, database_url, metrics_token=SecretStr(METRICS_TOKEN)) as cp:
        assert _fleet(_scrape(cp)) == dict.fromkeys(
            ("online", "stale", "offline", "needs_upgrade", "queued", "running"), 0
        ) | {"artifact_bytes": 0, "heartbeats": 0}
        assert _outcomes(_scrape(cp)) == {}

        a, b = cp.ready_node(), cp.ready_node()  # one heartbeat each, by the fast path
        # A third node's first heartbeat takes the route (its credential is not cached yet);
        # then it speaks a protocol this control plane refuses: Needs upgrade, and the refused
        # heartbeat is not counted. A fourth never sends one: offline.
        upgrading = cp.enroll()
        assert cp.heartbeat(upgrading["credential"]).is_success
        cp.flush()
        cp.clock.advance(1)
        assert cp.heartbeat(upgrading["credential"], protocol=2).status_code == 426
        cp.enroll()

        submitted = [_submit(cp) for _ in range(5)]
        first, second = _claim(cp, a), _claim(cp, b)
        _complete(cp, a, first, state="succeeded", result=1)
        _complete(cp, b, second, state="failed", error={"code": "MODEL_DIVERGED", "message": "nan"})
        waiting = [job_id for job_id in submitted if job_id not in (first, second)]
        cancelled = cp.client.post(f"/api/v1/jobs/{waiting[0]}/cancel", headers=cp.admin)
        assert cancelled.json()["state"] == "cancelled"
        _claim(cp, a)  # running until the end of the test
        for content in (b"an onnx model", b"weights!"):
            stored = cp.client.post("/api/v1/artifacts", headers=cp.admin, content=content)
            assert stored.is_success, stored.text

        # Past the stale threshold, then one heartbeat from `a`, accepted but not yet flushed:
        # the liveness reader counts it, as the node views do.
        cp.clock.advance(30)
        assert cp.heartbeat(a.headers["Authorization"].removeprefix("Bearer ")).is_success
        assert cp.client.app.heartbeats == 3  # type: ignore[attr-defined]  # and 1 by the route
        samples = _scrape(cp)
        assert _fleet(samples) == {
            "online": 1,
            "stale": 2,
            "offline": 1,
            "needs_upgrade": 1,
            "queued": 1,
            "running": 1,
            "artifact_bytes": len(b"an onnx model") + len(b"weights!"),
            "heartbeats": 4,
        }
        views = cp.client.get("/api/v1/admin/nodes", headers=cp.admin).json()
        assert sorted(node["state"] for node in views) == ["offline", "online", "stale", "stale"]
        assert [node["node_id"] for node in views if node["needs_upgrade"]] == [
            upgrading["node_id"]
        ]
        assert _outcomes(samples) == {
            ("succeeded", ""): 1,
            ("failed", "MODEL_DIVERGED"): 1,
            ("cancelled", "JOB_CANCELLED"): 1,
        }
        # Nothing is counted twice: a second scrape reads the same.
        assert _scrape(cp) == samples


def test_outcomes_count_only_once_committed(tmp_path: Path, database_url: str) -> None:
    with control_plane(tmp_path, database_url, metrics_token=SecretStr(METRICS_TOKEN)) as cp:
        job_id = _submit(cp)
        with cp.ctx.session_factory() as session:
            lifecycle.cancel_job(session=session, clock=cp.clock, job_id=job_id)
            session.rollback()
            # The same session goes on and commits: the rolled-back outcome stays uncounted.
            session.execute(select(1))
            session.commit()
        with pytest.raises(RuntimeError), cp.ctx.session_factory.begin() as session:
            lifecycle.cancel_job(session=session, clock=cp.clock, job_id=job_id)
            raise RuntimeError("the request failed after the job was cancelled")
        samples = _scrape(cp)
        assert _outcomes(samples) == {}
        assert _value(samples, "modelforge_jobs", state="queued") == 1

        with cp.ctx.session_factory.begin() as session:
            lifecycle.cancel_job(session=session, clock=cp.clock, job_id=job_id)
            # Not before the commit (the counter itself: a scrape would wait for this
            # transaction's lock on SQLite).
            assert list(cp.ctx.metrics.jobs_finished.collect())[0].samples == []
        assert _outcomes(_scrape(cp)) == {("cancelled", "JOB_CANCELLED"): 1}


def test_a_database_outage_answers_503(
    tmp_path: Path, database_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The store's values cannot be read: 503 DATABASE_UNAVAILABLE, never a partial answer."""
    with control_plane(tmp_path, database_url, metrics_token=SecretStr(METRICS_TOKEN)) as cp:
        cp.ready_node()

        def unavailable(*_args: Any, **_kwargs: Any) -> Any:
            driver = sqlite3.OperationalError("unable to open database file")
            raise exc.OperationalError("SELECT", {}, driver)

        with monkeypatch.context() as patched:
            patched.setattr(Session, "execute", unavailable)
            response = cp.client.get("/metrics", headers=BEARER)
        assert response.status_code == 503, response.text
        assert response.json()["error"]["code"] == "DATABASE_UNAVAILABLE"
        assert _value(_scrape(cp), "modelforge_heartbeats_accepted_total") == 1


def test_observe_placements_counts_and_buckets() -> None:
    metrics = Metrics()
    metrics.observe_placements([])
    metrics.observe_placements([0.0005, 0.02, 0.3])
    metrics.observe_placements([12.0, -0.001])  # a replica's clock a little behind: 0
    samples = _parse(metrics.render().decode())
    assert _value(samples, "modelforge_placements_total") == 5
    histogram = "modelforge_dispatch_latency_seconds"
    buckets = {
        "0.001": 2,
        "0.01": 2,
        "0.025": 3,
        "0.25": 3,
        "0.5": 4,
        "10.0": 4,
        "+Inf": 5,
    }
    for le, count in buckets.items():
        assert _value(samples, f"{histogram}_bucket", le=le) == count, le
    assert _value(samples, f"{histogram}_count") == 5
    assert _value(samples, f"{histogram}_sum") == pytest.approx(0.0005 + 0.02 + 0.3 + 12.0)
    # Each app owns its registry: another one starts at zero.
    assert _value(_parse(Metrics().render().decode()), "modelforge_placements_total") == 0


def test_error_codes_are_bounded() -> None:
    """A node reports a job's error code: past MAX_ERROR_CODES distinct ones, `OTHER`."""
    metrics = Metrics()
    for index in range(MAX_ERROR_CODES + 5):
        metrics.jobs_finished.labels(state="failed", code=metrics._code_label(f"E{index}")).inc()
    assert metrics._code_label("E0") == "E0"
    assert metrics._code_label("E_NEW") == "OTHER"
    outcomes = _outcomes(_parse(metrics.render().decode()))
    assert len(outcomes) == MAX_ERROR_CODES + 1 and outcomes[("failed", "OTHER")] == 5


def test_admin_token_or_metrics_token(
    tmp_path: Path, database_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    with control_plane(tmp_path, database_url, metrics_token=SecretStr(METRICS_TOKEN)) as cp:
        answers = []
        for headers, status, code in [
            ({}, 401, "METRICS_TOKEN_MISSING"),
            ({"Authorization": "Basic " + METRICS_TOKEN}, 401, "METRICS_TOKEN_MISSING"),
            ({"Authorization": "Bearer mfm_wrong_" + "w" * 24}, 401, "METRICS_TOKEN_INVALID"),
            ({"X-ModelForge-Admin-Token": METRICS_TOKEN}, 401, "ADMIN_TOKEN_INVALID"),
            (cp.admin, 200, None),
            (BEARER, 200, None),
            ({"authorization": f"bearer  {METRICS_TOKEN} "}, 200, None),
        ]:
            response = cp.client.get("/metrics", headers=headers)
            answers.append(response)
            assert response.status_code == status, (headers.keys(), response.text)
            if code is None:
                assert response.headers["content-type"] == CONTENT_TYPE
                assert "modelforge_heartbeats_accepted_total 0.0" in response.text
            else:
                assert response.json()["error"]["code"] == code
        # The metrics token opens /metrics and nothing else, in either header.
        for path in ("/api/v1/admin/nodes", "/api/v1/jobs"):
            for headers, code in [
                (BEARER, "ADMIN_TOKEN_MISSING"),
                ({"X-ModelForge-Admin-Token": METRICS_TOKEN}, "ADMIN_TOKEN_INVALID"),
            ]:
                refused = cp.client.get(path, headers=headers)
                answers.append(refused)
                assert refused.status_code == 401, refused.text
                assert refused.json()["error"]["code"] == code
        for response in answers:
            assert METRICS_TOKEN not in response.text
            assert METRICS_TOKEN not in str(response.headers)
        assert METRICS_TOKEN not in repr(cp.ctx.settings) and METRICS_TOKEN not in str(
            cp.ctx.settings
        )
    assert METRICS_TOKEN not in caplog.text and ADMIN_TOKEN not in caplog.text


def test_wrong_metrics_tokens_do_not_lock_out_the_admin(tmp_path: Path, database_url: str) -> None:
    """A Prometheus server with an old token must not make its address wait for the console;
    wrong admin tokens on /metrics count like anywhere else."""
    with control_plane(tmp_path, database_url, metrics_token=SecretStr(METRICS_TOKEN)) as cp:
        for _ in range(20):
            wrong = cp.client.get("/metrics", headers={"Authorization": "Bearer old-" + "o" * 20})
            assert wrong.status_code == 401
        assert cp.client.get("/api/v1/admin/nodes", headers=cp.admin).status_code == 200
        for _ in range(10):
            wrong_admin = {"X-ModelForge-Admin-Token": "mfa_guess_" + "g" * 24}
            assert cp.client.get("/metrics", headers=wrong_admin).status_code == 401
        limited = cp.client.get("/metrics", headers=cp.admin)
        assert limited.status_code == 429
        assert limited.json()["error"]["code"] == "SIGN_IN_RATE_LIMITED"


def test_without_a_metrics_token_only_the_admin_token_reads(
    tmp_path: Path, database_url: str
) -> None:
    with control_plane(tmp_path, database_url) as cp:
        refused = cp.client.get("/metrics", headers=BEARER)
        assert refused.status_code == 401
        assert refused.json()["error"]["code"] == "METRICS_TOKEN_INVALID"
        assert "No metrics token is configured" in refused.json()["error"]["message"]
        assert cp.client.get("/metrics", headers=cp.admin).status_code == 200


def test_a_short_metrics_token_is_refused_at_start(tmp_path: Path) -> None:
    with pytest.raises(ValidationError) as refused:
        make_settings(tmp_path, "sqlite:///x.db", metrics_token=SecretStr("short-token"))
    assert "MODELFORGE_METRICS_TOKEN must be at least 16 characters" in str(refused.value)
    assert "short-token" not in str(refused.value)
    settings = Settings(metrics_token=SecretStr(METRICS_TOKEN))
    assert settings.metrics_token is not None
    assert METRICS_TOKEN not in repr(settings)
