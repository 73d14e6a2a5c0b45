"""Hostile input at the edge: bodies too large, too deep or not finite, unparseable Range
headers, free text with control characters, and error bodies that would quote what was sent.

The focused tests drive the in-process app on SQLite and PostgreSQL. `test_every_route_*` runs
the real server (Granian) and sends every operation of the OpenAPI document the same hostile
set, measuring the server's memory meanwhile.
"""

from __future__ import annotations

import hashlib
import json
import os
import socket
import threading
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx
import psutil
import pytest

from control_plane.api.edge import MAX_JSON_DEPTH
from tests.e2e.server import LiveServer
from tests.factories import ControlPlane, control_plane, heartbeat_body, telemetry_body

SOURCE = {"m.py": "def f(x):\n    return x\n"}
MIB = 1024 * 1024
#: Sent as ids and in strings; no error body may contain it.
MARK = "zqxmarkq"


def _job(**extra: Any) -> dict[str, Any]:
    return {
        "entrypoint": {"kind": "python", "module": "m", "function": "f", "source": SOURCE},
        "params": {"x": 1},
        **extra,
    }


def _nested(depth: int, leaf: Any = 1) -> Any:
    value = leaf
    for _ in range(depth):
        value = [value]
    return value


def _node(cp: ControlPlane) -> dict[str, str]:
    enrolled = cp.enroll()
    headers = cp.agent(enrolled["credential"])
    inventory = {
        "hostname": "gpu-host-1",
        "os": "Debian GNU/Linux 12",
        "agent_version": "0.1.0",
        "accelerator_mode": "cpu",
        "cpu_count": 8,
        "memory_mb": 64000,
        "runtime_worker": {"version": "0.1.0", "protocol_version": 1},
    }
    assert cp.client.put("/api/v1/agent/inventory", headers=headers, json=inventory).is_success
    assert cp.heartbeat(enrolled["credential"]).status_code == 200
    return {"node_id": enrolled["node_id"], **headers}


@dataclass(frozen=True)
class _RunningJob:
    """A job a node has claimed: reported on with that node's `agent` headers, read as the admin."""

    cp: ControlPlane
    job_id: str
    agent: dict[str, str]

    def complete(self, body: dict[str, Any]) -> httpx.Response:
        path = f"/api/v1/agent/jobs/{self.job_id}/complete"
        return self.cp.client.post(path, headers=self.agent, json=body)

    def view(self) -> dict[str, Any]:
        return dict(self.cp.client.get(f"/api/v1/jobs/{self.job_id}", headers=self.cp.admin).json())


def _running_job(cp: ControlPlane) -> _RunningJob:
    node = _node(cp)
    job = cp.client.post("/api/v1/jobs", headers=cp.admin, json=_job())
    assert job.status_code == 201, job.text
    headers = {"Authorization": node["Authorization"]}
    claim = cp.client.post("/api/v1/agent/work/claim", headers=headers, json={"hold_seconds": 0})
    assert claim.status_code == 200, claim.text
    return _RunningJob(cp, str(job.json()["job_id"]), headers)


def _error(response: httpx.Response, status: int, code: str) -> dict[str, Any]:
    assert response.status_code == status, response.text
    error: dict[str, Any] = response.json()["error"]
    assert error["code"] == code, error
    assert error["message"] and error["next_step"]
    return error


# -- depth -------------------------------------------------------------------------------------


def test_a_deep_result_is_refused_and_listings_keep_working(
    tmp_path: Path, database_url: str
) -> None:
    with control_plane(tmp_path, database_url) as cp:
        job = _running_job(cp)
        deep = job.complete({"state": "succeeded", "result": _nested(300)})
        _error(deep, 422, "JSON_TOO_DEEP")
        assert job.view()["state"] == "running"
        listed = cp.client.get("/api/v1/jobs", headers=cp.admin)
        assert listed.status_code == 200, listed.text
        # The deepest body accepted: the result sits two levels down in it.
        deepest = _nested(MAX_JSON_DEPTH - 1)
        done = job.complete({"state": "succeeded", "result": deepest})
        assert done.status_code == 200, done.text
        listed = cp.client.get("/api/v1/jobs", headers=cp.admin)
        assert listed.status_code == 200, listed.text
        assert listed.json()[0]["result"] == deepest


def test_deep_params_are_refused_before_anything_is_stored(
    tmp_path: Path, database_url: str
) -> None:
    with control_plane(tmp_path, database_url) as cp:
        for depth in (MAX_JSON_DEPTH, 600, 100_000):
            body = json.dumps(_job(params={"x": 1})).replace(
                '"x": 1', f'"x": {"[" * depth}{"]" * depth}'
            )
            response = cp.client.post(
                "/api/v1/jobs",
                headers={**cp.admin, "content-type": "application/json"},
                content=body,
            )
            _error(response, 422, "JSON_TOO_DEEP")
        assert cp.client.get("/api/v1/jobs", headers=cp.admin).json() == []
        accepted = cp.client.post(
            "/api/v1/jobs", headers=cp.admin, json=_job(params={"x": _nested(MAX_JSON_DEPTH - 2)})
        )
        assert accepted.status_code == 201, accepted.text
        assert len(cp.client.get("/api/v1/jobs", headers=cp.admin).json()) == 1


# -- non-finite numbers ------------------------------------------------------------------------

NON_FINITE = ["NaN", "Infinity", "-Infinity", "1e999", "-1e999"]


@pytest.mark.parametrize("number", NON_FINITE)
def test_non_finite_numbers_are_refused_and_change_nothing(
    tmp_path: Path, database_url: str, number: str
) -> None:
    with control_plane(tmp_path, database_url) as cp:
        node = _node(cp)
        agent = {"Authorization": node["Authorization"], "content-type": "application/json"}
        telemetry = json.dumps(telemetry_body()).replace("120.5", number)  # power_draw_w
        assert number in telemetry
        response = cp.client.post("/api/v1/agent/telemetry", headers=agent, content=telemetry)
        _error(response, 422, "JSON_NOT_FINITE")
        assert cp.node(node["node_id"])["telemetry"] is None
        params = json.dumps(_job()).replace('"x": 1', f'"x": {number}')
        admin = {**cp.admin, "content-type": "application/json"}
        _error(
            cp.client.post("/api/v1/jobs", headers=admin, content=params), 422, "JSON_NOT_FINITE"
        )
        assert cp.client.get("/api/v1/jobs", headers=cp.admin).json() == []
        heartbeat = json.dumps(heartbeat_body()).replace(
            '"protocol_version": 1', f'"protocol_version": {number}'
        )
        response = cp.client.post("/api/v1/agent/heartbeat", headers=agent, content=heartbeat)
        _error(response, 422, "JSON_NOT_FINITE")


# -- sizes -------------------------------------------------------------------------------------


def _chunks(total: int, chunk: int = 64 * 1024) -> Iterator[bytes]:
    sent = 0
    yield b'{"x": "'
    while sent < total:
        yield b"a" * min(chunk, total - sent)
        sent += chunk
    yield b'"}'


def test_bodies_over_the_limits_are_refused(tmp_path: Path, database_url: str) -> None:
    with control_plane(tmp_path, database_url) as cp:
        token = cp.mint()["token"]
        enroll = {
            "token": token,
            "claim_nonce": "n" * 32,
            "hostname": "h",
            "protocol_version": 1,
            "agent_version": "1",
        }
        padded = json.dumps({**enroll, "fingerprint": {"machine_id": "m"}})
        huge = padded[:-1] + " " * (2 * MIB) + "}"
        response = cp.client.post(
            "/api/v1/agent/enroll", content=huge, headers={"content-type": "application/json"}
        )
        error = _error(response, 413, "REQUEST_TOO_LARGE")
        assert "MODELFORGE_MAX_BODY_BYTES" in error["next_step"]
        # Without a Content-Length (chunked): counted as it arrives.
        streamed = cp.client.post(
            "/api/v1/agent/enroll",
            content=_chunks(2 * MIB),
            headers={"content-type": "application/json"},
        )
        _error(streamed, 413, "REQUEST_TOO_LARGE")
        assert cp.client.post("/api/v1/agent/enroll", json=enroll).status_code == 200  # unused
        # Job submissions have a larger limit of their own.
        big = _job(params={"x": "a" * (2 * MIB)})
        assert cp.client.post("/api/v1/jobs", headers=cp.admin, json=big).status_code == 201
        bigger = _job(params={"x": "a" * (5 * MIB)})
        error = _error(
            cp.client.post("/api/v1/jobs", headers=cp.admin, json=bigger), 413, "REQUEST_TOO_LARGE"
        )
        assert "MODELFORGE_MAX_JOB_BODY_BYTES" in error["next_step"]
        assert len(cp.client.get("/api/v1/jobs", headers=cp.admin).json()) == 1


def test_artifact_uploads_stream_under_their_own_limit(tmp_path: Path, database_url: str) -> None:
    with control_plane(tmp_path, database_url, max_artifact_bytes=3 * MIB) as cp:
        content = os.urandom(2 * MIB)  # over the general limit, under the artifact one
        stored = cp.client.post("/api/v1/artifacts", headers=cp.admin, content=content)
        assert stored.status_code == 201, stored.text
        assert stored.json()["digest"] == "sha256:" + hashlib.sha256(content).hexdigest()
        for body in (os.urandom(4 * MIB), _chunks(4 * MIB)):
            response = cp.client.post("/api/v1/artifacts", headers=cp.admin, content=body)
            error = _error(response, 413, "REQUEST_TOO_LARGE")
            assert "MODELFORGE_MAX_ARTIFACT_BYTES" in error["next_step"]
        leftovers = list((tmp_path / "artifacts" / "tmp").iterdir())
        assert leftovers == []  # the refused upload left nothing behind
        assert len(list((tmp_path / "artifacts" / "sha256").rglob("*"))) == 2  # dir + the one


# -- unparseable bodies and Range headers ------------------------------------------------------


@pytest.mark.parametrize(
    "body", [b"{", b"[1,]", b'{"a": 1} x', b'"\\ud800"', b"\xff\xfe", b"1" * 5000]
)
def test_unparseable_bodies_are_invalid_json(
    tmp_path: Path, database_url: str, body: bytes
) -> None:
    with control_plane(tmp_path, database_url) as cp:
        response = cp.client.post(
            "/api/v1/jobs", headers={**cp.admin, "content-type": "application/json"}, content=body
        )
        _error(response, 400, "INVALID_JSON")


def test_range_headers_are_answered_with_codes(tmp_path: Path, database_url: str) -> None:
    content = bytes(range(256)) * 4  # 1024 bytes
    with control_plane(tmp_path, database_url) as cp:
        digest = cp.client.post("/api/v1/artifacts", headers=cp.admin, content=content).json()[
            "digest"
        ]
        path = f"/api/v1/artifacts/{digest}"

        def get(value: str | bytes) -> httpx.Response:
            return cp.client.get(path, headers={**cp.admin, "Range": value})

        for value in ("bytes", "bytes=abc", "bytes=5-3", "bytes=,", "bytes=1-2-3", "bytes=٣-"):
            error = _error(get(value.encode()), 400, "RANGE_INVALID")
            assert value not in error["message"]
        error = _error(get(",".join(["bytes=0-0"] + ["1-1"] * 100)), 400, "RANGE_INVALID")
        unsatisfiable = get("bytes=1024-")
        _error(unsatisfiable, 416, "RANGE_NOT_SATISFIABLE")
        assert unsatisfiable.headers["content-range"] == "bytes */1024"
        single = get("bytes=10-19")
        assert single.status_code == 206 and single.content == content[10:20]
        assert single.headers["content-range"] == "bytes 10-19/1024"
        assert get("bytes=1000-").content == content[1000:]
        assert get("bytes=-24").content == content[1000:]
        assert get("bytes=1000-99999").content == content[1000:]
        assert get("bytes=0-1, 2000-3000").content == content[:2]  # the satisfiable one only
        several = get("bytes=0-1,4-5")
        assert several.status_code == 206
        assert several.headers["content-type"].startswith("multipart/byteranges")
        whole = get("items=0-1")  # another unit: ignored
        assert whole.status_code == 200 and whole.content == content
        assert cp.client.get(path, headers=cp.admin).content == content


def test_agent_downloads_answer_ranges_with_codes(tmp_path: Path, database_url: str) -> None:
    content = os.urandom(1000)
    digest = "sha256:" + hashlib.sha256(content).hexdigest()
    with control_plane(tmp_path, database_url) as cp:
        agent = cp.agent(cp.enroll()["credential"])
        path = f"/api/v1/agent/artifacts/{digest}"
        assert cp.client.put(path, headers=agent, content=content).status_code == 201
        _error(cp.client.get(path, headers={**agent, "Range": "bytes=x-"}), 400, "RANGE_INVALID")
        done = cp.client.get(path, headers={**agent, "Range": "bytes=1000-"})
        _error(done, 416, "RANGE_NOT_SATISFIABLE")  # what a finished resume asks for
        resumed = cp.client.get(path, headers={**agent, "Range": "bytes=600-"})
        assert resumed.status_code == 206 and resumed.content == content[600:]


# -- free text ---------------------------------------------------------------------------------

HOSTILE_TEXT = ["host\x1b[31mred", "a\u202eb", "tab\there", "line\nbreak", "c1\x85x", "\u2066x"]


@pytest.mark.parametrize("text", HOSTILE_TEXT)
def test_free_text_with_control_characters_is_refused(
    tmp_path: Path, database_url: str, text: str
) -> None:
    with control_plane(tmp_path, database_url) as cp:
        minted = cp.mint()
        cases: list[tuple[str, str, dict[str, Any], str]] = [
            ("POST", "/api/v1/agent/enroll", {"hostname": text}, "hostname"),
            ("POST", "/api/v1/agent/enroll", {"agent_version": text}, "agent_version"),
        ]
        for method, path, change, field in cases:
            body = {
                "token": minted["token"],
                "claim_nonce": "n" * 32,
                "hostname": "h",
                "protocol_version": 1,
                "agent_version": "1",
                **change,
            }
            error = _error(cp.client.request(method, path, json=body), 422, "INVALID_REQUEST")
            assert field in error["message"] and text not in error["message"]
        # The refused claims changed nothing: the token is still unused.
        assert (
            cp.client.get(
                f"/api/v1/admin/node-enrollments/{minted['enrollment_id']}", headers=cp.admin
            ).json()["state"]
            == "pending"
        )
        admin_cases = [
            ({"display_name": text, "expires_in_seconds": 600}, "display_name"),
            ({"display_name": "ok", "expires_in_seconds": 600, "labels": {"a": text}}, "labels"),
        ]
        for body, field in admin_cases:
            response = cp.client.post("/api/v1/admin/node-enrollments", headers=cp.admin, json=body)
            assert field in _error(response, 422, "INVALID_REQUEST")["message"]
        node = _node(cp)
        agent = {"Authorization": node["Authorization"]}
        inventory = {
            "hostname": text,
            "os": "Debian",
            "agent_version": "0.1.0",
            "accelerator_mode": "cpu",
            "cpu_count": 8,
            "memory_mb": 64000,
        }
        response = cp.client.put("/api/v1/agent/inventory", headers=agent, json=inventory)
        assert "hostname" in _error(response, 422, "INVALID_REQUEST")["message"]
        response = cp.client.put(
            "/api/v1/agent/inventory",
            headers=agent,
            json={**inventory, "hostname": "h", "slurm": {"job_id": text}},
        )
        assert "slurm" in _error(response, 422, "INVALID_REQUEST")["message"]
        assert cp.node(node["node_id"])["inventory"]["hostname"] == "gpu-host-1"
        heartbeat = cp.client.post(
            "/api/v1/agent/heartbeat", headers=agent, json=heartbeat_body(message=text)
        )
        assert "message" in _error(heartbeat, 422, "INVALID_REQUEST")["message"]


def test_job_error_messages_keep_line_breaks_but_not_escapes(
    tmp_path: Path, database_url: str
) -> None:
    with control_plane(tmp_path, database_url) as cp:
        job = _running_job(cp)
        for bad in ({"code": "E", "message": "red \x1b[31m"}, {"code": "E\nF", "message": ""}):
            response = job.complete({"state": "failed", "error": bad})
            assert "error" in _error(response, 422, "INVALID_REQUEST")["message"]
        traceback = "Traceback (most recent call last):\n\tline 1\nValueError: x"
        response = job.complete(
            {"state": "failed", "error": {"code": "JOB_EXCEPTION", "message": traceback}}
        )
        assert response.status_code == 200, response.text
        assert job.view()["error"] == {"code": "JOB_EXCEPTION", "message": traceback}


# -- error bodies never quote the request ------------------------------------------------------


def test_error_bodies_never_echo_what_was_sent(tmp_path: Path, database_url: str) -> None:
    digest = "sha256:" + "ab" * 32
    with control_plane(tmp_path, database_url) as cp:
        agent = _running_job(cp).agent
        admin = cp.admin
        requests: list[tuple[str, str, dict[str, str], Any]] = [
            ("GET", f"/api/v1/jobs/{MARK}", admin, None),
            ("POST", f"/api/v1/jobs/{MARK}/cancel", admin, None),
            ("DELETE", f"/api/v1/jobs/{MARK}", admin, None),
            ("GET", f"/api/v1/jobs/{MARK}/events", admin, None),
            ("GET", f"/api/v1/admin/nodes/{MARK}", admin, None),
            ("DELETE", f"/api/v1/admin/nodes/{MARK}", admin, None),
            ("GET", f"/api/v1/admin/node-enrollments/{MARK}", admin, None),
            ("POST", f"/api/v1/admin/node-enrollments/{MARK}/revoke", admin, None),
            ("GET", f"/api/v1/artifacts/{digest}", admin, None),
            ("GET", f"/api/v1/agent/artifacts/{digest}", agent, None),
            ("PUT", f"/api/v1/agent/artifacts/{digest}", agent, MARK.encode()),
            ("POST", f"/api/v1/agent/jobs/{MARK}/events", agent, {"events": []}),
            ("POST", f"/api/v1/agent/jobs/{MARK}/complete", agent, {"state": "succeeded"}),
            ("POST", "/api/v1/jobs", admin, {**_job(), "entrypoint": {"kind": MARK}}),
            ("POST", "/api/v1/jobs", admin, _job(inputs={MARK: "nope"})),
            ("POST", "/api/v1/jobs", admin, _job(inputs={"ok": MARK})),
            ("POST", "/api/v1/jobs", admin, _job(params={MARK: "\x00"})),
            ("POST", "/api/v1/jobs", admin, {**_job(), MARK: "\x00"}),
            ("POST", "/api/v1/jobs", admin, {**_job(), MARK: 1}),
            (
                "POST",
                "/api/v1/jobs",
                admin,
                _job(
                    entrypoint={
                        "kind": "python",
                        "module": "m",
                        "function": "f",
                        "source": {MARK: "x"},
                    }
                ),
            ),
            ("POST", "/api/v1/jobs", admin, _job(labels={MARK.upper(): "x"})),
            ("GET", f"/api/v1/jobs?state={MARK}", admin, None),
        ]
        for method, path, headers, body in requests:
            if isinstance(body, bytes):
                response = cp.client.request(method, path, headers=headers, content=body)
            else:
                response = cp.client.request(method, path, headers=headers, json=body)
            assert 400 <= response.status_code < 500, (method, path, response.text)
            assert response.json()["error"]["code"], response.text
            text = response.text.lower()
            assert MARK not in text and digest not in text, (method, path, response.text)


def test_no_status_is_answered_without_a_documented_code(tmp_path: Path, database_url: str) -> None:
    with control_plane(tmp_path, database_url) as cp:
        answers = [
            cp.client.get("/nope"),
            cp.client.put("/api/v1/health"),
            cp.client.post("/docs"),
            cp.client.get("/docs/assets/index.html"),
        ]
        codes = {(r.status_code, r.json()["error"]["code"]) for r in answers}
        assert codes == {(404, "NOT_FOUND"), (405, "METHOD_NOT_ALLOWED")}, codes


# -- /docs -------------------------------------------------------------------------------------


def test_docs_load_nothing_from_other_origins(tmp_path: Path, database_url: str) -> None:
    with control_plane(tmp_path, database_url) as cp:
        page = cp.client.get("/docs")
        assert page.status_code == 200
        csp = page.headers["content-security-policy"]
        assert "script-src 'self'" in csp and "default-src 'none'" in csp
        assert "unsafe-inline" not in csp and "unsafe-eval" not in csp
        html = page.text
        assert "<script>" not in html.replace(" ", "")  # every script has a src
        urls = [part.split('"')[1] for part in html.split(" src=")[1:] + html.split(" href=")[1:]]
        assert urls and all(url.startswith("/docs/") for url in urls), urls
        for url in urls + ["/docs/assets/oauth2-redirect.js"]:
            asset = cp.client.get(url)
            assert asset.status_code == 200, url
            assert asset.headers["content-security-policy"] == csp
        assert "http" not in html  # no absolute URL at all
        init = cp.client.get("/docs/init.js").text
        assert "SwaggerUIBundle" in init and "/openapi.json" in init
        redirect = cp.client.get("/docs/oauth2-redirect")
        assert redirect.headers["content-security-policy"] == csp
        assert '<script src="/docs/assets/oauth2-redirect.js">' in redirect.text
        for path in ("/openapi.json", "/nope", "/api/v1/health"):
            answer = cp.client.get(path)
            assert "default-src 'none'" in answer.headers["content-security-policy"], path
            assert answer.headers["x-content-type-options"] == "nosniff"
        console = cp.client.get("/")  # the console keeps its own policy
        assert "script-src 'self'" in console.headers["content-security-policy"]


# -- every route, on the real server -----------------------------------------------------------

DIGEST = "sha256:" + "ab" * 32
HOSTILE = [f"{MARK}\x1b[31m\u202e\x85\t\n", f"{MARK}\x00"]
SMALL_BODIES = [
    ("nested 100", "[" * 100 + "]" * 100, "JSON_TOO_DEEP"),
    ("nested 1,000", "[" * 1_000 + "]" * 1_000, "JSON_TOO_DEEP"),
    ("nested 100,000", "[" * 100_000 + "]" * 100_000, "JSON_TOO_DEEP"),
    ("NaN", '{"a": NaN}', "JSON_NOT_FINITE"),
    ("Infinity", '{"a": [Infinity]}', "JSON_NOT_FINITE"),
    ("-Infinity", '{"a": {"b": -Infinity}}', "JSON_NOT_FINITE"),
    ("1e999", '{"a": 1e999}', "JSON_NOT_FINITE"),
]
ARTIFACT_LIMIT = 100 * MIB


class Peak:
    """The resident memory of the server's processes, sampled every 50 ms on a thread."""

    def __init__(self, pid: int) -> None:
        self.root = psutil.Process(pid)
        self.peak = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def now(self) -> int:
        total = 0
        for process in [self.root, *self.root.children(recursive=True)]:
            try:
                total += process.memory_info().rss
            except psutil.NoSuchProcess:
                pass
        return total

    def _run(self) -> None:
        while not self._stop.wait(0.05):
            self.peak = max(self.peak, self.now())

    def __enter__(self) -> Peak:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, self.now())


def _raw_request(
    url: str,
    method: str,
    path: str,
    headers: dict[str, str],
    chunks: Iterator[bytes],
    content_length: int | None,
) -> tuple[int, bytes]:
    """Send a body from `chunks` (with a Content-Length, or chunked) while reading the answer,
    as a client must when a server answers before the body is all sent. Never holds the body."""
    parts = urlsplit(url)
    sock = socket.create_connection((parts.hostname, parts.port), timeout=60)
    answered = threading.Event()
    head = [f"{method} {path} HTTP/1.1", f"Host: {parts.netloc}", "Connection: close"]
    head += [f"{name}: {value}" for name, value in headers.items()]
    head.append(
        f"Content-Length: {content_length}"
        if content_length is not None
        else "Transfer-Encoding: chunked"
    )
    sock.sendall(("\r\n".join(head) + "\r\n\r\n").encode())

    def send_body() -> None:
        try:
            for chunk in chunks:
                if answered.is_set():
                    return
                if content_length is None:
                    sock.sendall(f"{len(chunk):x}\r\n".encode() + chunk + b"\r\n")
                else:
                    sock.sendall(chunk)
            if content_length is None:
                sock.sendall(b"0\r\n\r\n")
        except OSError:
            pass  # the server answered and closed: what is asserted is its answer

    sender = threading.Thread(target=send_body, daemon=True)
    sender.start()
    received = b""
    try:
        while b"\r\n\r\n" not in received:
            data = sock.recv(65536)
            if not data:
                raise AssertionError(f"{method} {path}: connection closed without an answer")
            received += data
        header_block, _, body = received.partition(b"\r\n\r\n")
        lines = header_block.decode("latin-1").split("\r\n")
        status = int(lines[0].split()[1])
        fields = {k.strip().lower(): v.strip() for k, _, v in (x.partition(":") for x in lines[1:])}
        length = int(fields.get("content-length", "0"))
        while len(body) < length:
            data = sock.recv(65536)
            if not data:
                break
            body += data
    finally:
        answered.set()
        sock.close()
        sender.join(timeout=30)
    return status, body[:length]


def _resolve(spec: dict[str, Any], schema: dict[str, Any]) -> dict[str, Any]:
    while "$ref" in schema:
        schema = spec["components"]["schemas"][schema["$ref"].rsplit("/", 1)[1]]
    return schema


def _shaped_bodies(spec: dict[str, Any], schema: dict[str, Any]) -> list[Any]:
    """Bodies in the shape of the operation's schema: hostile strings in every string field,
    and every field of the wrong type; then bodies that are not objects at all."""
    properties = _resolve(spec, schema).get("properties", {})
    wrong: dict[str, Any] = {}
    hostile: list[dict[str, Any]] = [{} for _ in HOSTILE]
    for name, field in properties.items():
        kinds = {_resolve(spec, f).get("type") for f in [field, *field.get("anyOf", [])]}
        wrong[name] = {"x": [1]} if "string" in kinds else "not-a-number"
        for body, text in zip(hostile, HOSTILE, strict=True):
            if "string" in kinds:
                body[name] = text
            elif "object" in kinds:
                body[name] = {text: text}
            elif "array" in kinds:
                body[name] = [text]
            elif kinds & {"number", "integer"}:
                body[name] = 0  # hold_seconds among them: no long poll
    return [*hostile, wrong, [], "text", 123, None, {MARK: MARK}]


def _check_answer(
    failures: list[str], what: str, status: int, body: bytes, expected: str | None = None
) -> None:
    if status >= 500:
        failures.append(f"{what}: {status} {body[:300]!r}")
        return
    if status < 400:
        return
    try:
        error = json.loads(body)["error"]
        assert error["code"] and error["message"] and error["next_step"]
    except (ValueError, KeyError, TypeError, AssertionError):
        failures.append(f"{what}: {status} without an error body: {body[:300]!r}")
        return
    if error["code"] == "HTTP_ERROR" or (expected and error["code"] != expected):
        failures.append(f"{what}: {status} {error['code']}, expected {expected}")
    if MARK in body.decode("utf-8", "replace").lower() or DIGEST in body.decode("latin-1"):
        failures.append(f"{what}: the error body quotes the request: {body[:300]!r}")


@pytest.mark.e2e
def test_every_route_survives_hostile_input(
    tmp_path: Path, database_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    overrides = {"MODELFORGE_MAX_ARTIFACT_BYTES": str(ARTIFACT_LIMIT)}
    with LiveServer(tmp_path / "data", database_url, overrides) as server:
        credential = server.enroll()["credential"]
        spec = httpx.get(f"{server.url}/openapi.json").json()
        operations = [
            (method.upper(), path, op)
            for path, ops in spec["paths"].items()
            for method, op in ops.items()
        ]
        assert len(operations) >= 30
        auth = {
            **server.admin,
            "Authorization": f"Bearer {credential}",
        }
        assert server.process is not None
        peak = Peak(server.process.pid)
        time.sleep(1.0)
        idle = max(peak.now() for _ in range(5))
        statuses: Counter[int | str] = Counter()
        failures: list[str] = []
        started = time.monotonic()
        with peak, server.client(headers=auth) as client:
            for method, template, op in operations:
                path = template
                for parameter in op.get("parameters", []):
                    if parameter["in"] == "path":
                        value = DIGEST if parameter["name"] == "digest" else MARK
                        path = path.replace("{" + parameter["name"] + "}", value)
                upload = method in ("PUT", "POST") and "/artifacts" in template
                big = ARTIFACT_LIMIT if upload else 10 * MIB
                # 10 MB with a Content-Length, 200 MB chunked: neither is ever held here at once.
                for size, length in ((10 * MIB, 10 * MIB), (200 * MIB, None)):
                    chunks = (
                        b"[" + b"0," * (64 * 1024 - 1) + b"0]" for _ in range(size // (128 * 1024))
                    )
                    try:
                        status, body = _raw_request(
                            server.url,
                            method,
                            path,
                            {**auth, "Content-Type": "application/json"},
                            chunks,
                            None if length is None else (size // (128 * 1024)) * (128 * 1024 + 1),
                        )
                    except (AssertionError, OSError) as exc:
                        statuses["no answer"] += 1
                        failures.append(f"{method} {path} {size // MIB} MB: no answer ({exc})")
                        continue
                    statuses[status] += 1
                    over = size > big or not upload
                    _check_answer(
                        failures,
                        f"{method} {path} {size // MIB} MB",
                        status,
                        body,
                        "REQUEST_TOO_LARGE" if over else None,
                    )
                    if over and status != 413:
                        failures.append(f"{method} {path} {size // MIB} MB: {status}, not 413")
                bodies: list[tuple[str, str, str | None]] = [
                    (name, text, None if upload else code) for name, text, code in SMALL_BODIES
                ]
                schema = (op.get("requestBody") or {}).get("content", {}).get("application/json")
                if schema is not None:
                    bodies += [
                        ("shaped", json.dumps(body), None)
                        for body in _shaped_bodies(spec, schema["schema"])
                    ]
                for name, text, code in bodies:
                    try:
                        response = client.request(
                            method, path, content=text, headers={"Content-Type": "application/json"}
                        )
                    except httpx.TransportError as exc:
                        statuses["no answer"] += 1
                        failures.append(f"{method} {path} {name}: no answer ({exc})")
                        continue
                    statuses[response.status_code] += 1
                    _check_answer(
                        failures,
                        f"{method} {path} {name}",
                        response.status_code,
                        response.content,
                        code,
                    )
        elapsed = time.monotonic() - started
        requests = sum(statuses.values())
        with capsys.disabled():  # the figures, in every run
            print(
                f"\nhostile input ({database_url.split(':')[0]}): {requests} requests over "
                f"{len(operations)} operations in {elapsed:.1f} s; "
                f"statuses {dict(sorted(statuses.items(), key=str))}; "
                f"idle RSS {idle / MIB:.0f} MiB, peak RSS {peak.peak / MIB:.0f} MiB"
            )
        assert not failures, "\n".join(failures[:40])
        assert peak.peak < 2 * idle, (idle, peak.peak)
        with server.client(headers=auth) as client:  # still serving
            assert client.get("/api/v1/health").status_code == 200


def test_a_control_character_in_a_query_string_is_refused(
    tmp_path: Path, database_url: str
) -> None:
    """NUL, an escape or a bidirectional mark in any query parameter: 422 INVALID_QUERY before
    any route runs (PostgreSQL cannot compare text holding a NUL; it used to be a 500)."""
    with control_plane(tmp_path, database_url) as cp:
        for query in (
            "/api/v1/jobs?label=site%3D%00",
            "/api/v1/jobs?label=%00%3Da",
            "/api/v1/admin/audit?target=a%00b",
            "/api/v1/admin/audit?actor=%1b%5B31m",
            "/api/v1/admin/credentials?active=true&x=%E2%80%AE",
            "/api/v1/jobs?label=a%3Db+%00",
        ):
            response = cp.client.get(query, headers=cp.admin)
            assert response.status_code == 422, (query, response.text)
            error = response.json()["error"]
            assert error["code"] == "INVALID_QUERY" and error["next_step"], error
            assert "\x00" not in response.text
        # Printable text still filters, on either database.
        fine = cp.client.get("/api/v1/jobs?label=site%3Dé+a", headers=cp.admin)
        assert fine.status_code == 200 and fine.json() == []
