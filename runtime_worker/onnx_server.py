"""The built-in `onnx` service runner (WL-5b): one ONNX model served over the Open Inference
Protocol (KServe v2 / Triton HTTP/REST, and KServe v2 gRPC with `--grpc-port`), so that standard
clients such as `tritonclient.http` and `tritonclient.grpc` work unchanged.

    python -m runtime_worker.onnx_server --model PATH --port N --name NAME [--grpc-port N]
        [--host 127.0.0.1] [--max-concurrency N] [--max-request-bytes N] [--max-json-bytes N]
        [--max-inflight-bytes N] [--instances N] [--cpus N] [--batching JSON]

The runtime worker starts it for a deployed service (`runtime_worker.services`); unlike the
worker itself it listens on network ports. This module parses the flags and starts Granian
with one worker process; in that process, on Granian's event loop, `ServedModel` builds the
data plane (runtime_worker.serving), starts the gRPC front, and loads and warms up the model
in the background: live at once, ready once warm, the cold start (process start to ready)
logged. An unusable model ends the server with exit status 1. It never logs request data.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import socket
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from runtime_worker.serving import grpc_native, grpc_service
from runtime_worker.serving.dataplane import ModelLoadFailed
from runtime_worker.serving.http import Limits, ModelApp
from runtime_worker.serving.policy import (
    BatchingPolicy,
    InvalidServing,
    batching_policy,
    instance_count,
)

log = logging.getLogger("modelforge.onnx_server")

#: The settings, as JSON, from the command line to Granian's worker process.
SETTINGS_VARIABLE = "MODELFORGE_ONNX_SERVER_SETTINGS"
#: How long the gRPC front may finish the calls in flight at stop.
GRPC_GRACE_SECONDS = 5.0


@dataclass(frozen=True)
class Settings:
    model: Path
    port: int
    name: str
    host: str
    max_concurrency: int = 512
    max_request_bytes: int = 64 * 1024 * 1024
    max_json_bytes: int = 8 * 1024 * 1024
    max_inflight_bytes: int = 512 * 1024 * 1024
    grpc_port: int | None = None
    instances: int | None = None
    cpus: int | None = None
    batching: BatchingPolicy = field(default_factory=BatchingPolicy)
    started_at: float = 0.0  # time.time() when the process started

    @property
    def limits(self) -> Limits:
        return Limits(self.max_request_bytes, self.max_json_bytes, self.max_inflight_bytes)

    def to_json(self) -> str:
        values = asdict(self) | {"model": str(self.model), "batching": self.batching.to_json()}
        return json.dumps(values)

    @classmethod
    def from_json(cls, text: str) -> Settings:
        values = json.loads(text)
        values["model"] = Path(values["model"])
        values["batching"] = batching_policy(values["batching"])
        return cls(**values)


class ServedModel(ModelApp):
    """What Granian's worker process serves: the HTTP front over a data plane built here,
    the gRPC front beside it, the model loaded in the background."""

    def __init__(self, settings: Settings) -> None:
        import onnxruntime as ort

        from runtime_worker.serving.dataplane import DataPlane
        from runtime_worker.serving.model import InstancePlan, OnnxModel

        plan = InstancePlan.of(
            instances=settings.instances,
            cpus=settings.cpus,
            available=ort.get_available_providers(),
            environ=os.environ,
        )
        model = OnnxModel(settings.name, settings.model, plan)
        super().__init__(DataPlane(model, settings.batching), settings.limits)
        self.settings = settings
        self._grpc: grpc_native.NativeFront | None = None
        self._loading: asyncio.Task[None] | None = None

    def __rsgi_init__(self, loop: asyncio.AbstractEventLoop) -> None:
        settings = self.settings
        if settings.grpc_port is not None:
            try:
                self._grpc = self._start_grpc()
            except Exception as exc:
                log.error("cannot serve gRPC on port %d: %s", settings.grpc_port, exc)
                raise SystemExit(2) from None
        self._loading = loop.create_task(self._load())

    def _start_grpc(self) -> grpc_native.NativeFront:
        """The native gRPC front, answering with one `GrpcService` on this data plane and byte
        budget (the HTTP front's)."""
        settings = self.settings
        calls = grpc_service.max_calls(self.budget.limit, settings.max_request_bytes)
        relay = grpc_native.Relay(
            grpc_service.GrpcService(self.dataplane, self.budget), settings.max_request_bytes
        )
        front = grpc_native.start(
            settings.host,
            settings.grpc_port or 0,
            settings.port,
            max_message_bytes=settings.max_request_bytes,
            max_calls=calls or grpc_service.MIN_CALLS,
            grace_seconds=int(GRPC_GRACE_SECONDS),
            token=relay.token,
        )
        self.relay = relay
        return front

    def __rsgi_del__(self, loop: asyncio.AbstractEventLoop) -> None:
        if self._loading is not None and not self._loading.done():
            self._loading.cancel()
        if self._grpc is not None:
            loop.run_until_complete(self._grpc.stop(GRPC_GRACE_SECONDS))
        self.dataplane.model.close()

    async def _load(self) -> None:
        settings, model = self.settings, self.dataplane.model
        try:
            await asyncio.get_running_loop().run_in_executor(None, self.dataplane.load)
        except ModelLoadFailed as exc:
            log.error("%s", exc)
            # Granian's main process ends with status 1 when its only worker dies.
            os._exit(1)
        self.dataplane.start()
        if settings.batching.max_batch_size and not model.batch_dimension_dynamic:
            log.warning(
                "batching stays off: not every input and output of the model has a dynamic "
                "first dimension to merge requests along"
            )
        grpc_port = self._grpc.port if self._grpc is not None else None
        ports = f"{settings.port}" + (f", gRPC {grpc_port}" if grpc_port is not None else "")
        policy = self.dataplane.scheduler.batching if self.dataplane.scheduler else False
        log.info(
            "serving %r on %s:%s with %s: %d instance(s), %d intra-op thread(s) each, "
            "batching %s; ready %.2f s after the process started (cold start)",
            settings.name,
            settings.host,
            ports,
            model.provider,
            model.plan.count,
            model.plan.threads,
            "on" if policy else "off",
            time.time() - settings.started_at,
        )


def served_app() -> ServedModel:
    """Granian's factory, in its worker process: the settings come from the environment."""
    logging.basicConfig(
        level=logging.INFO,
        stream=sys.stderr,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    return ServedModel(Settings.from_json(os.environ[SETTINGS_VARIABLE]))


def _positive(text: str) -> int:
    if not text.isascii() or not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text[:40]!r}")
    return int(text)


_LIMITS = {
    "max_concurrency": 512,
    "max_request_bytes": 64 * 1024 * 1024,
    "max_json_bytes": 8 * 1024 * 1024,
    "max_inflight_bytes": 512 * 1024 * 1024,
}


def parse_settings(argv: Sequence[str] | None, environ: Mapping[str, str]) -> Settings:
    """Flags first, then MODELFORGE_ONNX_<LIMIT> variables, then defaults."""
    parser = argparse.ArgumentParser(
        prog="python -m runtime_worker.onnx_server",
        description="Serve one ONNX model over the Open Inference Protocol.",
    )
    parser.add_argument("--model", type=Path, required=True, help="the .onnx file")
    parser.add_argument("--port", type=int, required=True, help="TCP port (0: any free one)")
    parser.add_argument("--grpc-port", type=int, help="TCP port of the KServe v2 gRPC front")
    parser.add_argument("--name", required=True, help="the model's name in /v2/models/{name}")
    # This node only by default: the gateway reaches a replica through its agent's tunnel on
    # loopback; the worker passes 0.0.0.0 when the node turned direct access on.
    parser.add_argument("--host", default="127.0.0.1", help="the address to listen on")
    parser.add_argument("--max-concurrency", type=_positive, help="requests handled at once")
    parser.add_argument("--max-request-bytes", type=_positive, help="the largest body")
    parser.add_argument("--max-json-bytes", type=_positive, help="the largest JSON part")
    parser.add_argument("--max-inflight-bytes", type=_positive, help="bodies in flight, in all")
    parser.add_argument("--instances", type=_positive, help="sessions (default: one per GPU)")
    parser.add_argument("--cpus", type=_positive, help="cores the service holds")
    parser.add_argument("--batching", help="dynamic batching, as JSON (Triton's fields)")
    args = parser.parse_args(argv)
    limits = {}
    for option, default in _LIMITS.items():
        variable, value = f"MODELFORGE_ONNX_{option.upper()}", getattr(args, option)
        if value is None and (text := environ.get(variable, "")):
            try:
                value = _positive(text)
            except argparse.ArgumentTypeError as exc:
                parser.error(f"{variable} {exc}")
        limits[option] = default if value is None else value
    ports = [args.port] + ([args.grpc_port] if args.grpc_port is not None else [])
    if not all(0 <= port <= 65535 for port in ports) or not args.name or "/" in args.name:
        parser.error("--port and --grpc-port must be 0..65535 and --name a name without '/'")
    try:
        batching = batching_policy(json.loads(args.batching) if args.batching else None)
        instances = instance_count(args.instances)
    except (ValueError, InvalidServing) as exc:
        parser.error(f"--batching: {exc}" if not isinstance(exc, InvalidServing) else str(exc))
    return Settings(
        args.model,
        args.port,
        args.name,
        args.host,
        grpc_port=args.grpc_port,
        instances=instances,
        cpus=args.cpus,
        batching=batching,
        started_at=time.time(),
        **limits,
    )


def _free_port(host: str) -> int:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.bind((host, 0))
        return int(probe.getsockname()[1])


def main(argv: Sequence[str] | None = None) -> int:
    logging.basicConfig(
        level=logging.INFO,
        stream=sys.stderr,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    settings = parse_settings(argv, os.environ)
    if settings.port == 0:  # Granian's own choice would be known to nobody (the gRPC front)
        settings = replace(settings, port=_free_port(settings.host))
    os.environ[SETTINGS_VARIABLE] = settings.to_json()

    from granian import Granian
    from granian.constants import HTTPModes, Interfaces, Loops

    server = Granian(
        target="runtime_worker.onnx_server:served_app",
        factory=True,
        interface=Interfaces.RSGI,
        http=HTTPModes.http1,
        websockets=False,
        loop=Loops.uvloop,
        address=settings.host,
        port=settings.port,
        workers=1,
        backpressure=settings.max_concurrency,
        log_level="info",  # type: ignore[arg-type]
    )
    server.serve()
    return 0


if __name__ == "__main__":
    sys.exit(main())
