"""The model server's metrics under Triton's names, so that dashboards built for Triton work
unchanged: per model and version, requests that succeeded and failed, inferences (rows) and
executions (batches run), and the cumulative microseconds of each stage of a request — queue,
compute input, compute infer, compute output — and of the whole request.

Triton exposes these as counters named exactly so (`nv_inference_count`, not
`nv_inference_count_total`), which prometheus-client's counters cannot produce; they are
plain integers updated on the event loop (no lock on the hot path) and rendered here in the
Prometheus text format. It records numbers only, never request data.
"""

from __future__ import annotations

from dataclasses import dataclass, field

#: name -> (Prometheus type, help), in Triton's order and words.
FAMILIES: dict[str, tuple[str, str]] = {
    "nv_inference_request_success": ("counter", "Number of successful inference requests"),
    "nv_inference_request_failure": ("counter", "Number of failed inference requests"),
    "nv_inference_count": ("counter", "Number of inferences performed (rows of a batch)"),
    "nv_inference_exec_count": ("counter", "Number of model executions performed"),
    "nv_inference_request_duration_us": (
        "counter",
        "Cumulative inference request duration in microseconds",
    ),
    "nv_inference_queue_duration_us": ("counter", "Cumulative inference queuing duration"),
    "nv_inference_compute_input_duration_us": (
        "counter",
        "Cumulative compute input duration in microseconds",
    ),
    "nv_inference_compute_infer_duration_us": (
        "counter",
        "Cumulative compute inference duration in microseconds",
    ),
    "nv_inference_compute_output_duration_us": (
        "counter",
        "Cumulative inference compute output duration in microseconds",
    ),
    "nv_inference_pending_request_count": (
        "gauge",
        "Instantaneous number of pending requests awaiting execution",
    ),
}


@dataclass
class RequestTimes:
    """One request's stages in nanoseconds (Triton's breakdown)."""

    queue: int = 0
    compute_input: int = 0
    compute_infer: int = 0
    compute_output: int = 0


@dataclass
class ModelMetrics:
    """The counters of one model version."""

    model: str
    version: str
    values: dict[str, int] = field(default_factory=lambda: dict.fromkeys(FAMILIES, 0))

    def succeeded(self, rows: int, total_ns: int, times: RequestTimes) -> None:
        values = self.values
        values["nv_inference_request_success"] += 1
        values["nv_inference_count"] += rows
        values["nv_inference_request_duration_us"] += total_ns // 1000
        values["nv_inference_queue_duration_us"] += times.queue // 1000
        values["nv_inference_compute_input_duration_us"] += times.compute_input // 1000
        values["nv_inference_compute_infer_duration_us"] += times.compute_infer // 1000
        values["nv_inference_compute_output_duration_us"] += times.compute_output // 1000

    def failed(self) -> None:
        """A failed request counts only here: as Triton's, the durations are of successful
        requests, so that a duration's increase over the successes' is their mean."""
        self.values["nv_inference_request_failure"] += 1

    def executed(self) -> None:
        self.values["nv_inference_exec_count"] += 1

    def pending(self, change: int) -> None:
        self.values["nv_inference_pending_request_count"] += change


def _label(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def render(models: list[ModelMetrics]) -> bytes:
    """The Prometheus text exposition (version 0.0.4) of every model's counters."""
    lines = []
    for name, (kind, text) in FAMILIES.items():
        lines.append(f"# HELP {name} {text}")
        lines.append(f"# TYPE {name} {kind}")
        for metrics in models:
            labels = f'model="{_label(metrics.model)}",version="{_label(metrics.version)}"'
            lines.append(f"{name}{{{labels}}} {metrics.values[name]}")
    return ("\n".join(lines) + "\n").encode()


CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
