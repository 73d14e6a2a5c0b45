"""A `llama.cpp` service's `llm` (issue 43): its defaults filled in at deploy, kept with the
service's params, handed to its node, and turned by the runtime worker into llama-server's
flags; refused with a clear error that changes nothing beside another runner. The real app over
HTTP, SQLite and PostgreSQL. (The engine itself runs in tests/e2e/test_llm.py.)"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from control_plane.background.service_placement import place_services
from control_plane.clock import ManualClock
from control_plane.gateway.routing import read_snapshot
from control_plane.gateway.usage import UsageBook
from runtime_worker._service_spec import (
    LLAMA_HEALTH_PATH,
    LLAMA_SERVER,
    LLAMA_WARM_UP,
    InvalidService,
    ServiceSpec,
)
from tests.control_plane.test_jobs import _node
from tests.control_plane.test_workloads import _sync, _upload
from tests.factories import control_plane


def test_an_llm_service_reaches_the_node_and_becomes_llama_servers_flags(
    tmp_path: Path, database_url: str
) -> None:
    with control_plane(tmp_path, database_url) as cp:
        weights = _upload(cp, b"GGUF weights")
        body = {
            "name": "smol",
            "runner": "llama.cpp",
            "weights": weights,
            "llm": {"context_length": 2048, "slots": 3, "max_tokens": 512, "embeddings": "mean"},
            "resources": {"cpus": 1.5},
        }
        created = cp.client.post("/api/v1/services", headers=cp.admin, json=body)
        assert created.status_code == 201, created.text
        view = created.json()
        assert view["llm"] == {
            "context_length": 2048,
            "slots": 3,
            "gpu_layers": None,
            "max_tokens": 512,
            "embeddings": "mean",
        }
        assert view["health"]["path"] == LLAMA_HEALTH_PATH
        node = _node(cp)
        assert place_services(cp.ctx) == 1
        (spec,) = _sync(cp, node, service_host="127.0.0.1")["services"]
    assert spec["runner"] == "llama.cpp" and spec["params"]["llm"] == view["llm"]
    worker_body = {
        "generation": spec["generation"],
        "name": spec["name"],
        "runner": spec["runner"],
        "weights_path": "/cache/smol.gguf",
        "params": spec["params"],
        "resources": spec["resources"],
    }
    parsed = ServiceSpec.from_json(worker_body, service_id=spec["service_id"])
    assert parsed.argv[0] == str(LLAMA_SERVER)
    flags = _flags(parsed.argv)
    assert flags["--model"] == "/cache/smol.gguf" and flags["--alias"] == "smol"
    assert flags["--ctx-size"] == str(2048 * 3)  # one context per slot
    assert flags["--parallel"] == "3"
    assert flags["--n-gpu-layers"] == "0"  # no GPU held: the CPU
    assert flags["--threads"] == "2"  # 1.5 cores, rounded up
    assert "--no-kv-unified" in parsed.argv and "--metrics" in parsed.argv
    assert "--embeddings" in parsed.argv and flags["--pooling"] == "mean"
    assert parsed.health.path == LLAMA_HEALTH_PATH
    assert parsed.health.warm_up == LLAMA_WARM_UP


def test_a_gpu_replica_offloads_every_layer_unless_told() -> None:
    body = {
        "generation": 1,
        "name": "smol",
        "runner": "llama.cpp",
        "weights_path": "/cache/smol.gguf",
        "params": {"llm": {"context_length": 1024, "slots": 1, "gpu_layers": None}},
        "resources": {"gpus": 1},
        "assigned_gpus": [{"index": 0, "uuid": "GPU-1"}],
    }
    argv = ServiceSpec.from_json(body, service_id="rep_1").argv
    assert argv[argv.index("--n-gpu-layers") + 1] == "999"
    body["params"] = {"llm": {"context_length": 1024, "slots": 1, "gpu_layers": 12}}
    argv = ServiceSpec.from_json(body, service_id="rep_1").argv
    assert argv[argv.index("--n-gpu-layers") + 1] == "12"


@pytest.mark.parametrize(
    "llm",
    [
        {"context_length": 0},
        {"slots": "4"},
        {"gpu_layers": -1},
        {"slots": True},
        {"embeddings": "max"},
    ],
)
def test_the_worker_refuses_a_bad_llm_section(llm: dict[str, object]) -> None:
    body = {
        "generation": 1,
        "name": "smol",
        "runner": "llama.cpp",
        "weights_path": "/cache/smol.gguf",
        "params": {"llm": llm},
    }
    with pytest.raises(InvalidService, match=r"params\.llm\."):
        ServiceSpec.from_json(body, service_id="rep_1")


@pytest.mark.parametrize(
    ("extra", "problem"),
    [
        ({"runner": "onnx", "llm": {}}, "llm is the llama.cpp runner's"),
        ({"command": ["srv", "{port}"], "llm": {}}, "llm is the llama.cpp runner's"),
        ({"runner": "llama.cpp", "llm": {"slots": 0}}, "greater than or equal to 1"),
        (
            {"runner": "llama.cpp", "llm": {"context_length": 128, "max_tokens": 129}},
            "max_tokens must not exceed context_length",
        ),
        ({"runner": "llama.cpp", "llm": {"temperature": 1}}, "Extra inputs"),
        ({"runner": "llama.cpp", "llm": {"embeddings": "sum"}}, "'mean', 'cls' or 'last'"),
    ],
)
def test_a_bad_llm_is_refused_and_changes_nothing(
    tmp_path: Path, database_url: str, extra: dict[str, object], problem: str
) -> None:
    with control_plane(tmp_path, database_url) as cp:
        weights = _upload(cp, b"GGUF weights")
        body = {"name": "smol", **({} if "command" in extra else {"weights": weights}), **extra}
        refused = cp.client.post("/api/v1/services", headers=cp.admin, json=body)
        assert refused.status_code == 422, refused.text
        assert problem in refused.text
        assert cp.client.get("/api/v1/services", headers=cp.admin).json() == []


def test_a_rollout_keeps_or_changes_the_llm(tmp_path: Path, database_url: str) -> None:
    with control_plane(tmp_path, database_url) as cp:
        weights = _upload(cp, b"GGUF weights")
        body = {"name": "smol", "runner": "llama.cpp", "weights": weights}
        created = cp.client.post("/api/v1/services", headers=cp.admin, json=body)
        assert created.status_code == 201, created.text
        service_id = created.json()["service_id"]
        assert created.json()["llm"]["slots"] == 4  # the default
        changed = cp.client.patch(
            f"/api/v1/services/{service_id}", headers=cp.admin, json={"llm": {"slots": 8}}
        )
        assert changed.status_code == 200, changed.text
        assert changed.json()["llm"]["slots"] == 8 and changed.json()["revision"] == 2
        kept = cp.client.get(f"/api/v1/services/{service_id}", headers=cp.admin).json()
        assert kept["llm"] == {**created.json()["llm"], "slots": 8}
        assert kept["runner"] == "llama.cpp" and kept["weights"] == weights


def _flags(argv: tuple[str, ...]) -> dict[str, str]:
    """`--flag value` pairs of a command (a flag followed by another takes no value)."""
    return {
        arg: argv[index + 1]
        for index, arg in enumerate(argv[:-1])
        if arg.startswith("--") and not argv[index + 1].startswith("--")
    }


def test_a_keys_tokens_per_minute_window_says_how_long_to_wait(tmp_path: Path) -> None:
    """`UsageBook.wait_for`: a key at its limit waits until enough of its last minute's tokens
    have left the window; another key, and calls with no count, are not held."""
    clock = ManualClock()
    book = UsageBook(write_sessions=lambda: pytest.fail("nothing is written here"), clock=clock)
    spend = book._spend  # what `record` adds for a counted call, without its write
    with book._lock:
        spend("key_a", 30)
    assert book.wait_for("key_a", 100) is None
    clock.advance(20)
    with book._lock:
        spend("key_a", 80)  # 110 in the last minute: over 100
    assert book.wait_for("key_a", 100) == 40  # the first 30 leave 60 s after they came
    assert book.wait_for("key_b", 100) is None
    assert book.wait_for("key_a", 200) is None
    clock.advance(40)
    assert book.wait_for("key_a", 100) is None  # 80 left
    assert book.wait_for("key_a", 80) == 20
    clock.advance(20)
    assert book.wait_for("key_a", 1) is None
    assert "key_a" not in book._recent  # nothing kept for a key whose minute is empty


def test_a_tokens_per_minute_is_kept_with_the_key_and_checked(
    tmp_path: Path, database_url: str
) -> None:
    with control_plane(tmp_path, database_url) as cp:
        weights = _upload(cp, b"GGUF weights")
        body = {"name": "smol", "runner": "llama.cpp", "weights": weights}
        service = cp.client.post("/api/v1/services", headers=cp.admin, json=body).json()
        tokens = f"/api/v1/services/{service['service_id']}/access-tokens"
        for bad in (0, -5, 1.5, "100", 10**10):
            refused = cp.client.post(
                tokens, headers=cp.admin, json={"name": "k", "tokens_per_minute": bad}
            )
            assert refused.status_code == 422, bad
        assert cp.client.get(tokens, headers=cp.admin).json() == []
        minted = cp.client.post(
            tokens, headers=cp.admin, json={"name": "k", "tokens_per_minute": 5000}
        )
        assert minted.status_code == 201, minted.text
        assert minted.json()["tokens_per_minute"] == 5000
        listed = cp.client.get(tokens, headers=cp.admin).json()
        assert [row["tokens_per_minute"] for row in listed] == [5000]


def test_an_llm_services_aliases_are_its_own_until_it_gives_them_up(
    tmp_path: Path, database_url: str
) -> None:
    """An alias is held by one deployed service: not another's name or alias; a `PATCH`
    replaces them with no rollout; undeploying frees them; the routing table maps them."""
    with control_plane(tmp_path, database_url) as cp:
        weights = _upload(cp, b"GGUF weights")

        def deploy(name: str, **extra: object) -> Any:
            body = {"name": name, "runner": "llama.cpp", "weights": weights, **extra}
            return cp.client.post("/api/v1/services", headers=cp.admin, json=body)

        smol = deploy("smol", aliases=["gpt-4o-mini", "small"])
        assert smol.status_code == 201, smol.text
        assert smol.json()["aliases"] == ["gpt-4o-mini", "small"]
        service_id = smol.json()["service_id"]
        for refused, code in (
            (deploy("other", aliases=["small"]), "MODEL_NAME_TAKEN"),  # another's alias
            (deploy("other", aliases=["smol"]), "MODEL_NAME_TAKEN"),  # another's name
            (deploy("gpt-4o-mini"), "SERVICE_NAME_TAKEN"),  # a name that is an alias
            (deploy("other", aliases=["other"]), "INVALID_ALIAS"),
        ):
            assert refused.status_code in (409, 422), refused.text
            assert refused.json()["error"]["code"] == code, refused.text
        command = {"name": "cmd", "command": ["srv", "{port}"], "aliases": ["x"]}
        wrong = cp.client.post("/api/v1/services", headers=cp.admin, json=command)
        assert wrong.json()["error"]["code"] == "ALIASES_NOT_FOR_THIS_RUNNER", wrong.text
        listed = cp.client.get("/api/v1/services", headers=cp.admin).json()
        assert [s["name"] for s in listed] == ["smol"]  # nothing refused was deployed

        with cp.ctx.read_session_factory() as session:
            assert read_snapshot(session).aliases == {"gpt-4o-mini": "smol", "small": "smol"}
        changed = cp.client.patch(
            f"/api/v1/services/{service_id}", headers=cp.admin, json={"aliases": ["tiny"]}
        )
        assert changed.status_code == 200, changed.text
        assert changed.json()["aliases"] == ["tiny"] and changed.json()["rollout"] is None
        assert deploy("other", aliases=["small"]).status_code == 201  # given up: free
        events = cp.client.get(f"/api/v1/services/{service_id}/events", headers=cp.admin).json()
        assert [e["data"] for e in events if e["kind"] == "aliases"] == [
            {"from": ["gpt-4o-mini", "small"], "to": ["tiny"]}
        ]
        cp.client.delete(f"/api/v1/services/{service_id}", headers=cp.admin)
        assert deploy("tiny").status_code == 201  # undeployed: its aliases are free
