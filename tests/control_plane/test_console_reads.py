"""The reads the console's work screens add to the admin API: jobs filtered by label, the queued
work a node could run, and GPU temperature and power in the telemetry history."""

from __future__ import annotations

from pathlib import Path

from tests.control_plane.test_jobs import _claim, _node, _submit
from tests.factories import control_plane, inventory_body, telemetry_body


def test_jobs_filtered_by_label_and_state_newest_first(tmp_path: Path, database_url: str) -> None:
    with control_plane(tmp_path, database_url) as cp:
        a = _submit(cp, labels={"team": "vision", "site": "lab"})
        cp.clock.advance(1)
        b = _submit(cp, labels={"team": "vision"})
        cp.clock.advance(1)
        _submit(cp, labels={"team": "speech"})

        def ids(query: str) -> list[str]:
            response = cp.client.get(f"/api/v1/jobs?{query}", headers=cp.admin)
            assert response.status_code == 200, response.text
            return [job["job_id"] for job in response.json()]

        assert ids("label=team=vision") == [b["job_id"], a["job_id"]]
        assert ids("label=team=vision&label=site=lab") == [a["job_id"]]
        assert ids("label=team=audio") == []
        assert ids("label=team=vision&state=running") == []
        # A value may itself hold "=".
        c = _submit(cp, labels={"expr": "a=b"})
        assert ids("label=expr=a=b") == [c["job_id"]]

        bad = cp.client.get("/api/v1/jobs?label=team", headers=cp.admin)
        assert bad.status_code == 422, bad.text
        assert bad.json()["error"]["code"] == "INVALID_REQUEST"
        assert "label" in bad.json()["error"]["message"]


def test_queued_work_a_node_could_run(tmp_path: Path, database_url: str) -> None:
    with control_plane(tmp_path, database_url) as cp:
        lab = _node(cp, labels={"site": "lab"}, cpus=4, gpus=1)
        other = _node(cp, labels={"site": "cloud"}, cpus=4)
        # The lab node claims nothing yet: queue three jobs and a service.
        fits = _submit(cp, labels={"site": "lab"}, resources={"gpus": 1})
        too_big = _submit(cp, labels={"site": "lab"}, resources={"gpus": 2})
        prefers = _submit(cp, labels={"site": "cloud"}, worker_policy="prefer")
        service = cp.client.post(
            "/api/v1/services",
            headers=cp.admin,
            json={"name": "echo", "command": ["sleep", "60"], "labels": {"site": "nowhere"}},
        )
        assert service.status_code == 201, service.text

        def work(node: dict[str, str]) -> list[tuple[str, str]]:
            response = cp.client.get(
                f"/api/v1/admin/nodes/{node['node_id']}/queued-work", headers=cp.admin
            )
            assert response.status_code == 200, response.text
            return [(item["kind"], item["id"]) for item in response.json()]

        assert work(lab) == [("job", fits["job_id"]), ("job", prefers["job_id"])]
        assert ("job", too_big["job_id"]) not in work(other)
        assert work(other) == [("job", prefers["job_id"])]

        # Claimed work is no longer queued.
        assert _claim(cp, lab)["job_id"] == fits["job_id"]  # type: ignore[index]
        assert work(lab) == [("job", prefers["job_id"])]

        missing = cp.client.get("/api/v1/admin/nodes/nope/queued-work", headers=cp.admin)
        assert missing.status_code == 404 and missing.json()["error"]["code"] == "NODE_NOT_FOUND"


def test_telemetry_history_carries_temperature_and_power(tmp_path: Path, database_url: str) -> None:
    with control_plane(tmp_path, database_url) as cp:
        minted = cp.mint()
        enrolled = cp.enroll_raw(minted["token"]).json()
        headers = cp.agent(enrolled["credential"])
        cp.client.put("/api/v1/agent/inventory", headers=headers, json=inventory_body("nvidia"))
        sent = cp.client.post("/api/v1/agent/telemetry", headers=headers, json=telemetry_body())
        assert sent.status_code == 200, sent.text
        history = cp.client.get(
            f"/api/v1/admin/nodes/{enrolled['node_id']}/telemetry", headers=cp.admin
        ).json()
        gpu = history[-1]["gpus"][0]
        assert gpu["temperature_c"] == 41 and gpu["power_draw_w"] == 120.5
        assert gpu["power_limit_w"] is None  # not reported
