"""The specification of a service (WL-5a) as `PUT /v1/services/{service_id}` gives it: parsed
and checked into a `ServiceSpec` (its command, with the built-in `onnx` runner's filled in, the
address it listens on, its health check and its restart policy), or refused with
`InvalidService`.

It starts and supervises nothing (runtime_worker.services does). It must never show a secret:
`env` and `secrets` are kept out of `repr()` and out of the messages it refuses with.
"""

from __future__ import annotations

import ipaddress
import json
import math
import os
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from modelforge_contracts.text import clean_line
from runtime_worker.execution import check_variables, gpu_environment
from runtime_worker.serving.policy import (
    BatchingPolicy,
    InvalidServing,
    batching_policy,
    instance_count,
)

ONNX_HEALTH_PATH = "/v2/health/ready"
#: llama-server answers 200 here once its model is loaded (503 while loading).
LLAMA_HEALTH_PATH = "/health"
#: llama-server's Prometheus metrics (`--metrics`): `llamacpp:requests_processing` and
#: `llamacpp:requests_deferred` are the requests it generates for and holds waiting.
LLAMA_METRICS_PATH = "/metrics"
#: The `llama.cpp` runner's server, built by `make install` (scripts/build-llama-server).
#: llama.cpp's server: `make install` builds it beside this package; the worker images carry it
#: elsewhere and say where (MODELFORGE_WORKER_LLAMA_SERVER, release/recipes.py).
LLAMA_SERVER = Path(
    os.environ.get("MODELFORGE_WORKER_LLAMA_SERVER")
    or Path(__file__).resolve().parent / "bin" / "llama-server"
)
#: The runners the worker knows how to start.
RUNNERS = ("onnx", "llama.cpp")
#: A `llama.cpp` service's defaults (the control plane sends all of them; these are for a
#: specification without `params.llm`).
LLM_DEFAULTS = {
    "context_length": 4096,
    "slots": 4,
    "gpu_layers": None,
    "max_tokens": None,
    "embeddings": None,
}
#: The poolings of token vectors an embeddings engine may use (llama-server's `--pooling`).
LLM_POOLINGS = ("mean", "cls", "last")
#: Where a service listens unless its agent turned direct access on: this node only, where the
#: agent's tunnel (and the worker's health probe) reach it.
LOOPBACK_HOST = "127.0.0.1"
_SERVICE_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,99}")


class InvalidService(ValueError):
    """A service specification the worker cannot run; the message names the field, never a
    value."""


@dataclass(frozen=True)
class HealthCheck:
    path: str = "/"
    interval: float = 5.0
    timeout: float = 2.0
    failure_threshold: int = 3
    start_period: float = 60.0
    #: A request made once after the first healthy answer and before the service is called
    #: healthy (`POST path` with this JSON body): the `llama.cpp` runner's one-token
    #: completion, so the first client does not pay for the engine's first run.
    warm_up: tuple[str, str] | None = None
    #: The engine's Prometheus metrics, read after each healthy probe for the requests it
    #: generates for and holds waiting (`services.engine_load`): the `llama.cpp` runner's.
    load: str | None = None


@dataclass(frozen=True)
class RestartPolicy:
    initial: float = 1.0
    maximum: float = 60.0

    def backoff(self, failures: int) -> float:
        """The wait before the next start after `failures` (≥ 1) failures in a row."""
        return float(min(self.initial * 2 ** max(failures - 1, 0), self.maximum))


@dataclass(frozen=True)
class ServiceSpec:
    """What to run, checked; `argv` has `{weights}` filled in, `{port}`, `{grpc_port}` and
    `{host}` still to fill. `host` is the address it listens on (also in `HOST`): the agent's
    choice, loopback unless the node turned direct access on."""

    service_id: str
    generation: int
    name: str
    argv: tuple[str, ...]
    weights_path: str | None
    health: HealthCheck
    restart: RestartPolicy
    params: dict[str, Any] = field(default_factory=dict)
    env: dict[str, str] = field(default_factory=dict, repr=False)
    secrets: dict[str, str] = field(default_factory=dict, repr=False)
    gpu_env: dict[str, str] = field(default_factory=dict)
    agent_socket: str | None = None
    private_paths: tuple[str, ...] = ()
    host: str = LOOPBACK_HOST

    @classmethod
    def from_json(cls, body: Any, *, service_id: str) -> ServiceSpec:
        """The specification in a `PUT /v1/services/{service_id}` body; `InvalidService`."""
        if not isinstance(body, dict):
            raise InvalidService("the body must be a JSON object")
        if not _SERVICE_ID.fullmatch(service_id):
            raise InvalidService("service_id must be 1-100 letters, digits, '_', '.' or '-'")
        if body.get("service_id", service_id) != service_id:
            raise InvalidService("service_id in the body differs from the one in the path")
        generation = body.get("generation")
        if not isinstance(generation, int) or isinstance(generation, bool) or generation < 0:
            raise InvalidService("generation must be a non-negative integer")
        name = body.get("name")
        if not isinstance(name, str) or not name.strip() or len(name) > 200:
            raise InvalidService("name must be a non-empty string of at most 200 characters")
        weights_path = body.get("weights_path")
        if weights_path is not None and (not isinstance(weights_path, str) or not weights_path):
            raise InvalidService("weights_path must be a path or null")
        argv = _argv(body.get("command"), body.get("runner"), name, weights_path)
        params = body.get("params") or {}
        if not isinstance(params, dict):
            raise InvalidService("params must be an object")
        private_paths = body.get("private_paths") or []
        if not isinstance(private_paths, list) or not all(
            isinstance(path, str) for path in private_paths
        ):
            raise InvalidService("private_paths must be a list of paths")
        agent_socket = body.get("agent_socket")
        if agent_socket is not None and not isinstance(agent_socket, str):
            raise InvalidService("agent_socket must be a path or null")
        resources = body.get("resources") or {}
        if not isinstance(resources, dict):
            raise InvalidService("resources must be an object")
        host = _host(body.get("host"))
        try:
            env = check_variables(body.get("env"), "env")
            secret_values = check_variables(body.get("secrets"), "secrets")
            gpu_env = gpu_environment({**body, "resources": resources})
        except (TypeError, ValueError) as exc:
            raise InvalidService(str(exc)) from None
        runner = body.get("runner")
        default_path = {"onnx": ONNX_HEALTH_PATH, "llama.cpp": LLAMA_HEALTH_PATH}.get(
            str(runner), "/"
        )
        warm_up, load = None, None
        if runner == "onnx":
            argv += serving_flags(params, resources)
        elif runner == "llama.cpp":
            # The GPUs it was assigned (none named: the node's own, when it asked for some).
            gpus = gpu_env.get("CUDA_VISIBLE_DEVICES") if gpu_env else resources.get("gpus")
            argv += llama_flags(params, resources, gpus=bool(gpus))
            warm_up, load = LLAMA_WARM_UP, LLAMA_METRICS_PATH
        return cls(
            service_id=service_id,
            generation=generation,
            name=name,
            argv=tuple(argv),
            weights_path=weights_path,
            health=_health(body.get("health"), default_path, warm_up, load),
            restart=_restart(body.get("restart")),
            params=params,
            env=env,
            secrets=secret_values,
            gpu_env=gpu_env,
            agent_socket=agent_socket,
            private_paths=tuple(private_paths),
            host=host,
        )


def onnx_argv(name: str) -> list[str]:
    """The built-in ONNX runner's command (runtime_worker.onnx_server)."""
    return [
        sys.executable,
        "-m",
        "runtime_worker.onnx_server",
        "--model",
        "{weights}",
        "--port",
        "{port}",
        "--grpc-port",
        "{grpc_port}",
        "--host",
        "{host}",
        "--name",
        name,
    ]


def llama_argv(name: str) -> list[str]:
    """The built-in `llama.cpp` runner's command: llama.cpp's own server, serving the GGUF as
    `name` (the model name its answers carry), with its Prometheus metrics and slot view on."""
    return [
        str(LLAMA_SERVER),
        "--model",
        "{weights}",
        "--host",
        "{host}",
        "--port",
        "{port}",
        "--alias",
        name,
        "--metrics",
        "--slots",
        "--no-webui",
    ]


#: The warm-up of a `llama.cpp` replica: one token of a completion.
LLAMA_WARM_UP = ("/v1/completions", json.dumps({"prompt": "Hello", "max_tokens": 1}))


def llama_flags(params: dict[str, Any], resources: dict[str, Any], *, gpus: bool) -> list[str]:
    """llama-server's flags for the service's `llm` (kept in its params): each request's context
    (`context_length`) times the parallel `slots` is the whole context llama-server holds, one
    share per slot; `gpu_layers` (None: every layer when the replica holds a GPU, none on the
    CPU); threads from the cores it holds (`resources.cpus`, rounded up); `embeddings` (a
    pooling) serves `/v1/embeddings` too."""
    llm = {**LLM_DEFAULTS, **_section(params.get("llm"), "params.llm")}
    context, slots, layers = llm["context_length"], llm["slots"], llm["gpu_layers"]
    for key, value, top in (("context_length", context, 1 << 20), ("slots", slots, 256)):
        if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= top:
            raise InvalidService(f"params.llm.{key} must be an integer from 1 to {top}")
    if layers is not None and (
        isinstance(layers, bool) or not isinstance(layers, int) or layers < 0
    ):
        raise InvalidService("params.llm.gpu_layers must be a non-negative integer or null")
    embeddings = llm["embeddings"]
    if embeddings is not None and embeddings not in LLM_POOLINGS:
        raise InvalidService(f"params.llm.embeddings must be one of {', '.join(LLM_POOLINGS)}")
    if layers is None:
        layers = 999 if gpus else 0
    flags = [
        "--ctx-size",
        str(context * slots),
        "--parallel",
        str(slots),
        "--no-kv-unified",
        "--n-gpu-layers",
        str(layers),
    ]
    if embeddings is not None:
        flags += ["--embeddings", "--pooling", embeddings]
    cpus = resources.get("cpus")
    if isinstance(cpus, int | float) and not isinstance(cpus, bool) and 0 < cpus <= 4096:
        flags += ["--threads", str(math.ceil(cpus))]
    return flags


def serving_flags(params: dict[str, Any], resources: dict[str, Any]) -> list[str]:
    """The onnx runner's flags for the service's `batching` and `instances` (kept in its
    params) and the cores it holds (`resources.cpus`, rounded up: onnxruntime's threads)."""
    try:
        batching = batching_policy(params.get("batching"))
        instances = instance_count(params.get("instances"))
    except InvalidServing as exc:
        raise InvalidService(str(exc)) from None
    flags = []
    if batching != BatchingPolicy():
        flags += ["--batching", json.dumps(batching.to_json(), separators=(",", ":"))]
    if instances is not None:
        flags += ["--instances", str(instances)]
    cpus = resources.get("cpus")
    if isinstance(cpus, int | float) and not isinstance(cpus, bool) and 0 < cpus <= 4096:
        flags += ["--cpus", str(math.ceil(cpus))]
    return flags


def _argv(command: Any, runner: Any, name: str, weights_path: str | None) -> list[str]:
    if runner is not None:
        if runner not in RUNNERS:
            raise InvalidService(
                f"runner must be 'onnx', 'llama.cpp' or null (got {str(runner)[:40]!r})"
            )
        if command is not None:
            raise InvalidService("give either command or runner, not both")
        if weights_path is None:
            raise InvalidService(f"runner {runner!r} needs weights_path")
        command = onnx_argv(name) if runner == "onnx" else llama_argv(name)
    if (
        not isinstance(command, list)
        or not command
        or not all(isinstance(arg, str) and "\0" not in arg for arg in command)
        or not command[0]
    ):
        raise InvalidService("command must be a non-empty list of strings (or give a runner)")
    if weights_path is None and any("{weights}" in arg for arg in command):
        raise InvalidService("command names {weights} but weights_path is null")
    if weights_path is None:
        return list(command)
    return [arg.replace("{weights}", weights_path) for arg in command]


def _host(value: Any) -> str:
    """The address to listen on: an IP address (an agent before direct access sends none:
    loopback)."""
    if value is None:
        return LOOPBACK_HOST
    try:
        return str(ipaddress.ip_address(value if isinstance(value, str) else ""))
    except ValueError:
        raise InvalidService(
            "host must be the IP address to listen on, e.g. 127.0.0.1 or 0.0.0.0"
        ) from None


def _section(value: Any, name: str) -> dict[str, Any]:
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise InvalidService(f"{name} must be an object")
    return {key: item for key, item in value.items() if item is not None}


def _seconds(section: dict[str, Any], name: str, key: str, default: float, low: float) -> float:
    value = section.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int | float) or not value >= low:
        raise InvalidService(f"{name}.{key} must be a number of seconds, at least {low:g}")
    if value > 86400:
        raise InvalidService(f"{name}.{key} must be at most 86400 seconds")
    return float(value)


def _health(
    value: Any, default_path: str, warm_up: tuple[str, str] | None, load: str | None
) -> HealthCheck:
    section = _section(value, "health")
    path = section.get("path", default_path)
    if not isinstance(path, str) or not path.startswith("/") or clean_line(path) != path:
        raise InvalidService("health.path must be a path starting with '/'")
    threshold = section.get("failure_threshold", 3)
    if isinstance(threshold, bool) or not isinstance(threshold, int) or threshold < 1:
        raise InvalidService("health.failure_threshold must be an integer of at least 1")
    return HealthCheck(
        path=path,
        interval=_seconds(section, "health", "interval_seconds", 5.0, 0.05),
        timeout=_seconds(section, "health", "timeout_seconds", 2.0, 0.05),
        failure_threshold=threshold,
        start_period=_seconds(section, "health", "start_period_seconds", 60.0, 0.0),
        warm_up=warm_up,
        load=load,
    )


def _restart(value: Any) -> RestartPolicy:
    section = _section(value, "restart")
    initial = _seconds(section, "restart", "initial_backoff_seconds", 1.0, 0.01)
    maximum = _seconds(section, "restart", "max_backoff_seconds", max(60.0, initial), 0.01)
    if maximum < initial:
        raise InvalidService("restart.max_backoff_seconds must be at least initial_backoff_seconds")
    return RestartPolicy(initial=initial, maximum=maximum)
