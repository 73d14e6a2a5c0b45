"""The built-in `onnx` service runner (WL-5b): one ONNX model served over the Open Inference
Protocol (KServe v2 / Triton HTTP/REST), so that standard clients such as `tritonclient.http`
work unchanged, including the binary tensor data extension those clients use by default.

    python -m runtime_worker.onnx_server --model PATH --port N --name NAME [--host 0.0.0.0]
        [--max-concurrency N] [--max-request-bytes N]

The runtime worker starts it for a deployed service (`runtime_worker.services`); unlike the
worker itself it listens on a network port. The protocol (decoding infer requests into numpy
arrays and encoding responses, HTTP-free) is runtime_worker._oip; this module holds the model
(an onnxruntime session on CUDA when a GPU is usable, the CPU otherwise) and a threaded HTTP/1.1
server that routes to them. It must never write request data to its logs, read a body larger
than its limit, or run more than `--max-concurrency` inferences at once.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import socket
import socketserver
import sys
import threading
import time
import zlib
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, NamedTuple
from urllib.parse import unquote, urlsplit

import numpy as np

from runtime_worker import WORKER_VERSION
from runtime_worker._oip import (
    MODEL_VERSION,
    InferRequest,
    ProtocolError,
    decode_infer_request,
    encode_infer_response,
    split_request,
    tensor_spec,
)

log = logging.getLogger("modelforge.onnx_server")

QUEUE_WAIT_SECONDS = 30.0  # how long a request waits for an inference slot before a 503
LINGER_BYTES = 8 * 1024 * 1024  # discarded after a 413 so the client can read the answer


def choose_providers(available: Sequence[str], environ: Mapping[str, str]) -> list[str]:
    """CUDA when onnxruntime has it and the process may see a GPU; the CPU always as fallback."""
    if "CUDAExecutionProvider" in available and environ.get("CUDA_VISIBLE_DEVICES") != "":
        return ["CUDAExecutionProvider", "CPUExecutionProvider"]
    return ["CPUExecutionProvider"]


class OnnxModel:
    """One onnxruntime session and its tensors as the protocol names them."""

    def __init__(self, name: str, path: Path) -> None:
        import onnxruntime as ort

        providers = choose_providers(ort.get_available_providers(), os.environ)
        self.name, self.session = name, ort.InferenceSession(str(path), providers=providers)
        self.provider: str = self.session.get_providers()[0]
        self.inputs = [tensor_spec(arg) for arg in self.session.get_inputs()]
        self.outputs = [tensor_spec(arg) for arg in self.session.get_outputs()]

    def metadata(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "versions": [MODEL_VERSION],
            "platform": "onnxruntime_onnx",
            "inputs": [asdict(spec) for spec in self.inputs],
            "outputs": [asdict(spec) for spec in self.outputs],
        }

    def run(self, request: InferRequest) -> list[np.ndarray]:
        try:
            return list(self.session.run([name for name, _ in request.outputs], request.feeds))
        except Exception as exc:  # onnxruntime's errors share no base class but Exception
            invalid = type(exc).__name__ == "InvalidArgument"
            log.warning("inference failed: %s", type(exc).__name__)
            raise ProtocolError(400 if invalid else 500, f"the model failed: {exc}") from None


@dataclass(frozen=True)
class Settings:
    model: Path
    port: int
    name: str
    host: str
    max_concurrency: int
    max_request_bytes: int


class Reply(NamedTuple):
    status: int
    body: bytes
    header_length: int | None = None  # set when binary tensor data follows the JSON header


def _json(status: int, payload: Any) -> Reply:
    return Reply(status, json.dumps(payload, separators=(",", ":")).encode())


class ModelServer(ThreadingHTTPServer):
    daemon_threads = True
    request_queue_size = 128  # connections waiting to be accepted (socketserver's 5 is small)

    def __init__(self, settings: Settings) -> None:
        self.address_family = socket.AF_INET6 if ":" in settings.host else socket.AF_INET
        self.settings = settings
        self.model: OnnxModel | None = None  # set once the session is loaded: ready
        self.slots = threading.BoundedSemaphore(settings.max_concurrency)
        super().__init__((settings.host, settings.port), _Handler)

    def server_bind(self) -> None:  # HTTPServer's would ask DNS for the host's name
        socketserver.TCPServer.server_bind(self)

    @contextmanager
    def inference_slot(self) -> Iterator[None]:
        if not self.slots.acquire(timeout=QUEUE_WAIT_SECONDS):
            raise ProtocolError(
                503,
                f"{self.settings.max_concurrency} inferences are running and "
                f"none finished within {QUEUE_WAIT_SECONDS:.0f} s; retry later",
            )
        try:
            yield
        finally:
            self.slots.release()

    def handle_error(self, request: Any, client_address: Any) -> None:
        log.warning("connection failed: %s", type(sys.exc_info()[1]).__name__)


class _Handler(BaseHTTPRequestHandler):
    server: ModelServer
    protocol_version = "HTTP/1.1"  # keep-alive: tritonclient reuses its connections
    server_version = f"modelforge-onnx-server/{WORKER_VERSION}"
    timeout = 300  # an idle keep-alive connection is closed after this

    def do_GET(self) -> None:  # noqa: N802 - http.server's naming
        self._answer(self._get)

    def do_POST(self) -> None:  # noqa: N802 - http.server's naming
        self._answer(self._post)

    def _get(self, path: list[str]) -> Reply:
        if path == ["v2"]:
            name, extensions = "modelforge-onnx-server", ["binary_tensor_data"]
            return _json(200, {"name": name, "version": WORKER_VERSION, "extensions": extensions})
        if path == ["v2", "health", "live"]:
            return _json(200, {"live": True})
        if path == ["v2", "health", "ready"]:
            ready = self.server.model is not None
            return _json(200 if ready else 503, {"ready": ready})
        if (action := self._model_action(path)) == "ready":
            ready = self.server.model is not None
            return _json(200 if ready else 503, {"name": self.server.settings.name, "ready": ready})
        if action == "":
            return _json(200, self._loaded_model().metadata())
        raise self._no_route()

    def _post(self, path: list[str]) -> Reply:
        body = self._read_body()
        if self._model_action(path) != "infer":
            raise self._no_route()
        model = self._loaded_model()
        header, binary = split_request(body, self.headers.get("Inference-Header-Content-Length"))
        request = decode_infer_request(header, binary, model.inputs, model.outputs)
        with self.server.inference_slot():
            arrays = model.run(request)
        return Reply(200, *encode_infer_response(model.name, request, arrays))

    def _model_action(self, path: list[str]) -> str | None:
        """What follows /v2/models/{name}[/versions/{v}] ("" for the model itself), checking
        the name and version; None for a path outside /v2/models."""
        if path[:2] != ["v2", "models"] or len(path) < 3:
            return None
        name, rest, served = path[2], path[3:], self.server.settings.name
        if name != served:
            raise ProtocolError(404, f"unknown model {name!r}; this server serves {served!r}")
        if rest[:1] == ["versions"]:
            if rest[1:2] != [MODEL_VERSION]:
                raise ProtocolError(404, f"model {name!r} has only version {MODEL_VERSION}")
            rest = rest[2:]
        return "/".join(rest)

    def _loaded_model(self) -> OnnxModel:
        if (model := self.server.model) is None:
            raise ProtocolError(
                503,
                f"model {self.server.settings.name!r} is still loading; poll GET /v2/health/ready",
            )
        return model

    def _no_route(self) -> ProtocolError:
        name = self.server.settings.name
        return ProtocolError(
            404,
            f"no route {self.command} {urlsplit(self.path).path}; this "
            f"server answers /v2, /v2/health/live|ready, /v2/models/{name}, "
            f"/v2/models/{name}/ready and POST /v2/models/{name}/infer",
        )

    def _read_body(self) -> bytes:
        length, limit = self._checked_length(), self.server.settings.max_request_bytes
        body = self.rfile.read(length)
        if len(body) != length:
            self.close_connection = True
            raise ProtocolError(400, f"the body ended after {len(body)} of {length} bytes")
        encoding = self.headers.get("Content-Encoding", "identity").lower()
        if encoding not in ("identity", "gzip", "deflate"):
            raise ProtocolError(
                400, f"Content-Encoding {encoding} is not supported; use gzip, deflate or none"
            )
        if encoding != "identity":
            inflater = zlib.decompressobj(31 if encoding == "gzip" else 15)
            try:
                body = inflater.decompress(body, limit + 1)
            except zlib.error as exc:
                raise ProtocolError(400, f"the {encoding} body cannot be decoded: {exc}") from None
            if len(body) > limit:
                raise ProtocolError(413, f"the decoded body is over the limit of {limit} bytes")
        return body

    def _checked_length(self) -> int:
        """The declared body length, refused before any of the body is read when it is over
        the limit (the connection is then closed: the unread body cannot be skipped)."""
        limit, text = self.server.settings.max_request_bytes, self.headers.get("Content-Length")
        if self.headers.get("Transfer-Encoding") or text is None or not text.isdigit():
            self.close_connection = True
            raise ProtocolError(411, "send the body with a Content-Length (no chunked encoding)")
        if int(text) > limit:
            self.close_connection = True
            raise ProtocolError(
                413,
                f"the request body is {text} bytes; this server accepts at "
                f"most {limit} (--max-request-bytes)",
            )
        return int(text)

    def _answer(self, route: Callable[[list[str]], Reply]) -> None:
        try:
            reply = route([unquote(part) for part in urlsplit(self.path).path.split("/") if part])
        except ProtocolError as exc:
            reply = _json(exc.status, {"error": exc.message})
        except Exception as exc:  # a bug: answered, and logged without the request's data
            log.error("internal error on %s: %s", self.command, type(exc).__name__)
            reply = _json(500, {"error": f"internal server error ({type(exc).__name__})"})
        self._send(reply)
        if reply.status in (411, 413) and self.close_connection:  # a body left unread
            self._linger()

    def _send(self, reply: Reply) -> None:
        self.send_response(reply.status)
        content_type = "application/json"
        if reply.header_length is not None:
            content_type = "application/octet-stream"
            self.send_header("Inference-Header-Content-Length", str(reply.header_length))
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(reply.body)))
        if self.close_connection:
            self.send_header("Connection", "close")
        self.end_headers()
        self.wfile.write(reply.body)

    def _linger(self) -> None:
        """Discard (never keep) what the client still sends after a 413, for a moment, so that
        closing does not reset the connection before the client has read the answer."""
        try:
            self.connection.shutdown(socket.SHUT_WR)
            self.connection.settimeout(1.0)
            drained, deadline = 0, time.monotonic() + 2.0
            while drained < LINGER_BYTES and time.monotonic() < deadline:
                if not (chunk := self.rfile.read1(65536)):
                    break
                drained += len(chunk)
        except OSError:
            pass

    def send_error(self, code: int, message: str | None = None, explain: str | None = None) -> None:
        # http.server's own refusals (bad request line, unknown method) in the protocol's shape.
        self.close_connection = True
        self._send(_json(code, {"error": message or HTTPStatus(code).phrase}))

    def log_message(self, format: str, *args: Any) -> None:
        pass  # no access log: request lines are request data


def _positive(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text!r}")
    return int(text)


def parse_settings(argv: Sequence[str] | None, environ: Mapping[str, str]) -> Settings:
    """Flags first, then MODELFORGE_ONNX_MAX_CONCURRENCY / _MAX_REQUEST_BYTES, then defaults."""
    parser = argparse.ArgumentParser(
        prog="python -m runtime_worker.onnx_server",
        description="Serve one ONNX model over the Open Inference Protocol.",
    )
    parser.add_argument("--model", type=Path, required=True, help="the .onnx file")
    parser.add_argument("--port", type=int, required=True, help="TCP port (0: any free one)")
    parser.add_argument("--name", required=True, help="the model's name in /v2/models/{name}")
    # Every interface by default: the control plane reaches a service at the node's address.
    parser.add_argument("--host", default="0.0.0.0")  # noqa: S104
    parser.add_argument("--max-concurrency", type=_positive)
    parser.add_argument("--max-request-bytes", type=_positive)
    args = parser.parse_args(argv)
    limits = {}
    for option, default in (("max_concurrency", 4), ("max_request_bytes", 64 * 1024 * 1024)):
        variable, value = f"MODELFORGE_ONNX_{option.upper()}", getattr(args, option)
        if value is None and (text := environ.get(variable, "")):
            try:
                value = _positive(text)
            except argparse.ArgumentTypeError as exc:
                parser.error(f"{variable} {exc}")
        limits[option] = default if value is None else value
    if not 0 <= args.port <= 65535 or not args.name or "/" in args.name:
        parser.error("--port must be 0..65535 and --name a non-empty name without '/'")
    return Settings(args.model, args.port, args.name, args.host, **limits)


def main(argv: Sequence[str] | None = None) -> int:
    logging.basicConfig(
        level=logging.INFO,
        stream=sys.stderr,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    settings = parse_settings(argv, os.environ)
    try:
        server = ModelServer(settings)
    except OSError as exc:
        log.error("cannot listen on %s:%d: %s", settings.host, settings.port, exc.strerror)
        return 2
    stop = threading.Event()
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda *_: stop.set())
    # Listening before the model loads: live at once, ready (200) once the session exists.
    threading.Thread(target=server.serve_forever, name="http", daemon=True).start()
    try:
        server.model = OnnxModel(settings.name, settings.model)
    except Exception as exc:  # onnxruntime reports unreadable models with plain exceptions
        log.error("cannot load the ONNX model %s: %s", settings.model, exc)
        server.shutdown()
        return 1
    host, port = server.server_address[:2]
    provider, most = server.model.provider, settings.max_concurrency
    log.info("serving %r on %s:%s with %s (%d at once)", settings.name, host, port, provider, most)
    stop.wait()
    server.shutdown()
    server.server_close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
