"""Hostile input against the real model server process, including what broke the server it
replaced (a 57 MiB JSON request took its memory from 66 MB to 2.7 GB; a 100k-deep body, 10k-deep
`data`, non-ASCII lengths and `binary_data_size: 12.0` answered 500): each is refused with a 4xx,
memory stays within the stated budget, and other clients are still served, slow clients
holding 200 connections included."""

from __future__ import annotations

import gzip
import http.client
import json
import socket
import statistics
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tests.onnx_models import relu_matmul
from tests.runtime_worker.served import NAME, Served, start_server, stop_server

WEIGHTS = np.array([[1.0, -2.0], [0.5, 1.0], [-1.0, 3.0]], dtype=np.float32)
INFER = f"/v2/models/{NAME}/infer"
SMALL = json.dumps(
    {"inputs": [{"name": "x", "shape": [1, 3], "datatype": "FP32", "data": [1, 2, 3]}]}
).encode()
MiB = 1024 * 1024


@pytest.fixture(scope="module")
def model_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("hostile") / "relu.onnx"
    path.write_bytes(relu_matmul(WEIGHTS))
    return path


@pytest.fixture(scope="module")
def served(model_file: Path) -> Iterator[Served]:
    running = start_server(model_file)
    yield running
    returncode, stderr = stop_server(running)
    assert returncode == 0, stderr


def raw_exchange(served: Served, head: bytes, body: bytes = b"") -> tuple[int, bytes]:
    """Send exactly these bytes; the status and body of the answer (read to the end)."""
    with socket.create_connection(("127.0.0.1", served.port), timeout=30) as connection:
        connection.sendall(head + body)
        answer = b""
        while b"\r\n\r\n" not in answer:
            if not (chunk := connection.recv(65536)):
                break
            answer += chunk
        status_line, _, rest = answer.partition(b"\r\n")
        headers, _, content = rest.partition(b"\r\n\r\n")
        length = 0
        for line in headers.split(b"\r\n"):
            name, _, value = line.partition(b":")
            if name.strip().lower() == b"content-length":
                length = int(value)
        while len(content) < length:
            if not (chunk := connection.recv(65536)):
                break
            content += chunk
    return int(status_line.split()[1]), content


def post_head(length: bytes, extra: bytes = b"") -> bytes:
    return (
        b"POST " + INFER.encode() + b" HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b"Content-Length: " + length + b"\r\n" + extra + b"\r\n"
    )


def post(served: Served, body: bytes, headers: dict[str, str] | None = None) -> tuple[int, Any]:
    connection = http.client.HTTPConnection("127.0.0.1", served.port, timeout=60)
    try:
        connection.request("POST", INFER, body=body, headers=headers or {})
        response = connection.getresponse()
        return response.status, json.loads(response.read())
    finally:
        connection.close()


def still_serving(served: Served) -> None:
    status, answer = post(served, SMALL)
    assert status == 200, answer


def test_a_100k_deep_body_is_400(served: Served) -> None:
    status, answer = post(served, b"[" * 100_000 + b"]" * 100_000)
    assert status == 400 and "nested too deeply" in answer["error"]
    still_serving(served)


def test_10k_deep_data_is_400(served: Served) -> None:
    deep = "[" * 10_000 + "1" + "]" * 10_000
    body = f'{{"inputs":[{{"name":"x","shape":[1,3],"datatype":"FP32","data":{deep}}}]}}'
    status, answer = post(served, body.encode())
    assert status == 400 and "nested too deeply" in answer["error"]
    still_serving(served)


def test_data_nested_deeper_than_its_shape_is_400(served: Served) -> None:
    deep = "[" * 500 + "1" + "]" * 500
    body = f'{{"inputs":[{{"name":"x","shape":[1,3],"datatype":"FP32","data":{deep}}}]}}'
    status, answer = post(served, body.encode())
    assert status == 400 and "'x'" in answer["error"]


def test_a_non_ascii_inference_header_content_length_is_4xx(served: Served) -> None:
    header = json.dumps(
        {
            "inputs": [
                {"name": "x", "shape": [1, 3], "datatype": "FP32"}
                | {"parameters": {"binary_data_size": 12}}
            ]
        }
    ).encode()
    body = header + np.ones(3, np.float32).tobytes()
    digits = "".join(chr(0x0660 + int(d)) for d in str(len(header)))  # Arabic-Indic digits
    extra = b"Inference-Header-Content-Length: " + digits.encode() + b"\r\n"
    status, answer = raw_exchange(served, post_head(str(len(body)).encode(), extra), body)
    assert 400 <= status < 500, answer
    still_serving(served)


def test_a_non_ascii_content_length_is_4xx(served: Served) -> None:
    digits = "".join(chr(0x0660 + int(d)) for d in str(len(SMALL))).encode()
    status, _ = raw_exchange(served, post_head(digits), SMALL)
    assert 400 <= status < 500
    still_serving(served)


def test_a_binary_data_size_that_is_not_a_whole_number_is_400(served: Served) -> None:
    header = json.dumps(
        {
            "inputs": [
                {
                    "name": "x",
                    "shape": [1, 3],
                    "datatype": "FP32",
                    "parameters": {"binary_data_size": 12.0},
                }
            ]
        }
    ).encode()
    body = header + np.ones(3, np.float32).tobytes()
    status, answer = post(served, body, {"Inference-Header-Content-Length": str(len(header))})
    assert status == 400 and "whole number" in answer["error"]
    still_serving(served)


def _json_of_rows(rows: int) -> bytes:
    """A JSON infer request of `rows` rows of 3 values: about 6 bytes a value."""
    head = b'{"inputs":[{"name":"x","shape":[%d,3],"datatype":"FP32","data":[' % rows
    return head + (b"1," * (rows * 3))[:-1] + b"]}]}"


class PeakRss:
    """Samples the server's resident memory every 5 ms while in use."""

    def __init__(self, served: Served) -> None:
        self.served, self.peak, self._stop = served, served.rss(), threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def _sample(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, self.served.rss())
            time.sleep(0.005)

    def __enter__(self) -> PeakRss:
        self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        self._thread.join()


def test_a_57_mib_json_request_is_refused_without_being_kept(served: Served) -> None:
    body = _json_of_rows(10_000_000)  # shape [10000000, 3]: 57 MiB, as broke the old server
    assert 50 * MiB < len(body) < 64 * MiB  # under the request limit
    partial = post_head(str(14 * MiB).encode()), body[: 14 * MiB]
    baseline = served.rss()
    with PeakRss(served) as memory, ThreadPoolExecutor(max_workers=9) as pool:
        # The 57 MiB one, and 8 concurrent 14 MiB ones (3.2 GB in the old server).
        whole = pool.submit(raw_exchange, served, post_head(str(len(body)).encode()), body)
        parts = [pool.submit(raw_exchange, served, *partial) for _ in range(8)]
        answers = [whole.result(), *(part.result() for part in parts)]
    for status, answer in answers:
        assert status == 413  # the JSON part is refused from its declared length
        assert "binary" in json.loads(answer)["error"]  # and the way out named
    grown = memory.peak - baseline
    assert grown < 100 * MiB, f"RSS grew by {grown / MiB:.0f} MiB"
    still_serving(served)


def test_memory_stays_within_the_inflight_budget_with_8_concurrent_14_mib_binary_requests(
    model_file: Path,
) -> None:
    budget = 48 * MiB
    running = start_server(model_file, "--max-inflight-bytes", str(budget))
    rows = 14 * MiB // 12
    header = json.dumps(
        {
            "inputs": [
                {
                    "name": "x",
                    "shape": [rows, 3],
                    "datatype": "FP32",
                    "parameters": {"binary_data_size": rows * 12},
                }
            ],
            "parameters": {"binary_data_output": True},
        }
    ).encode()
    body = header + np.ones((rows, 3), np.float32).tobytes()
    headers = {"Inference-Header-Content-Length": str(len(header))}
    try:
        baseline = running.rss()
        with PeakRss(running) as memory, ThreadPoolExecutor(max_workers=8) as pool:
            answers = list(pool.map(lambda _: _status(running, body, headers), range(8)))
        still_serving(running)
    finally:
        stop_server(running)
    assert set(answers) <= {200, 503} and 200 in answers, answers
    # Each request in flight holds its body (in hyper and in Python), its outputs and their
    # encoding: about 3x what it holds of the budget (docs/services.md).
    grown = memory.peak - baseline
    assert grown < 4 * budget + 64 * MiB, f"RSS grew by {grown / MiB:.0f} MiB"


def _status(served: Served, body: bytes, headers: dict[str, str]) -> int:
    connection = http.client.HTTPConnection("127.0.0.1", served.port, timeout=120)
    try:
        connection.request("POST", INFER, body=body, headers=headers)
        response = connection.getresponse()
        response.read()
        return response.status
    finally:
        connection.close()


def _p50_ms(served: Served, count: int = 60) -> float:
    connection = http.client.HTTPConnection("127.0.0.1", served.port, timeout=30)
    times = []
    for _ in range(count):
        started = time.perf_counter()
        connection.request("POST", INFER, body=SMALL)
        response = connection.getresponse()
        response.read()
        assert response.status == 200
        times.append((time.perf_counter() - started) * 1000)
    connection.close()
    return statistics.median(times)


def test_slow_clients_holding_200_connections_cost_others_under_5_ms(served: Served) -> None:
    before = _p50_ms(served)
    slow = []
    try:
        for index in range(200):
            connection = socket.create_connection(("127.0.0.1", served.port), timeout=30)
            if index % 2:  # headers that never end
                connection.sendall(b"POST " + INFER.encode() + b" HTTP/1.1\r\nHost: x\r\n")
            elif index % 4:  # a body that never ends
                connection.sendall(post_head(b"100000") + b'{"inputs":[')
            else:  # a 60 MiB binary one that never ends (holding 60 MiB of the budget)
                extra = b"Inference-Header-Content-Length: 100\r\n"
                connection.sendall(post_head(str(60 * MiB).encode(), extra) + b"\0" * 65536)
            slow.append(connection)
        time.sleep(0.2)
        during = _p50_ms(served)
    finally:
        for connection in slow:
            connection.close()
    assert during - before < 5.0, f"p50 {before:.2f} ms before, {during:.2f} ms with 200 slow"
    still_serving(served)


def test_clients_slow_to_send_large_bodies_leave_small_requests_room(model_file: Path) -> None:
    budget = 64 * MiB
    running = start_server(model_file, "--max-inflight-bytes", str(budget))
    # Each holds its body and 16x its 100-byte JSON part: two would hold the whole budget.
    declared = budget // 2 - 16 * 100
    extra = b"Inference-Header-Content-Length: 100\r\n"
    slow = []
    try:
        before = _p50_ms(running)
        for _ in range(4):
            connection = socket.create_connection(("127.0.0.1", running.port), timeout=30)
            connection.sendall(post_head(str(declared).encode(), extra) + b"\0" * 65536)
            slow.append(connection)
        time.sleep(0.2)
        during = _p50_ms(running)
    finally:
        for connection in slow:
            connection.close()
        stop_server(running)
    assert during - before < 5.0, f"p50 {before:.2f} ms before, {during:.2f} ms during"


def test_a_chunked_body_is_411_and_a_gzip_bomb_413(served: Served) -> None:
    head = b"POST " + INFER.encode() + b" HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
    chunked = b"%x\r\n%s\r\n0\r\n\r\n" % (len(SMALL), SMALL)
    status, answer = raw_exchange(served, head, chunked)
    assert status == 411 and "Content-Length" in json.loads(answer)["error"]
    bomb = gzip.compress(b"[" + b" " * (80 * MiB) + b"]")  # 80 MiB of JSON once inflated
    status, answer = post(served, bomb, {"Content-Encoding": "gzip"})
    assert status == 413, answer
    zipped = gzip.compress(SMALL)
    assert post(served, zipped, {"Content-Encoding": "gzip"})[0] == 200


def test_a_chunked_body_beside_a_content_length_is_refused_unread(served: Served) -> None:
    # Content-Length: 1, then many MiB of chunks: the server answers 411 before reading any of
    # them (whichever header the HTTP server frames the body by), its memory where it was.
    head = post_head(b"1", b"Transfer-Encoding: chunked\r\n")
    chunk = b"%x\r\n" % MiB + b"\0" * MiB + b"\r\n"
    baseline = served.rss()
    with PeakRss(served) as memory:
        with socket.create_connection(("127.0.0.1", served.port), timeout=30) as connection:
            try:
                connection.sendall(head)
                for _ in range(64):
                    connection.sendall(chunk)
                connection.sendall(b"0\r\n\r\n")
            except OSError:  # refused and closed while the client was still sending
                pass
            answer = connection.recv(65536)
    assert answer.split(b"\r\n", 1)[0] == b"HTTP/1.1 411 Length Required", answer[:100]
    assert b"Transfer-Encoding" in answer
    grown = memory.peak - baseline
    assert grown < 32 * MiB, f"RSS grew by {grown / MiB:.0f} MiB"
    still_serving(served)


def test_clients_slow_to_send_gzip_bodies_leave_large_requests_room(model_file: Path) -> None:
    # A compressed body is charged what it may inflate to (64 MiB + 16 x 8 MiB by default) only
    # once it has arrived: two clients trickling 100-byte gzip bodies hold 200 bytes, not the
    # whole lane of large bodies, so a 2 MiB binary request is answered (it waited 30 s for
    # room, then got a 503).
    running = start_server(model_file)
    rows = 2 * MiB // 12
    header = json.dumps(
        {
            "inputs": [
                {
                    "name": "x",
                    "shape": [rows, 3],
                    "datatype": "FP32",
                    "parameters": {"binary_data_size": rows * 12},
                }
            ],
            "parameters": {"binary_data_output": True},
        }
    ).encode()
    body = header + np.ones((rows, 3), np.float32).tobytes()
    slow = []
    try:
        for _ in range(2):
            connection = socket.create_connection(("127.0.0.1", running.port), timeout=30)
            connection.sendall(post_head(b"100", b"Content-Encoding: gzip\r\n") + b"\x1f\x8b")
            slow.append(connection)
        time.sleep(0.5)  # both are holding what they hold
        status = _status(running, body, {"Inference-Header-Content-Length": str(len(header))})
        assert status == 200, status
        zipped = gzip.compress(SMALL)  # and a gzip body that arrives is inflated and answered
        assert post(running, zipped, {"Content-Encoding": "gzip"})[0] == 200
    finally:
        for connection in slow:
            connection.close()
        stop_server(running)
