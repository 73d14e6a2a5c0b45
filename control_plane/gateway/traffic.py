"""One service's gateway traffic as data: the numbers `metrics.py` counts for `GET /metrics`,
read back for one service (`GET /api/v1/services/{id}/traffic`, the console's Traffic panel).

The values are this process's, cumulative since it started, exactly as Prometheus scrapes
them: a reader turns two reads into rates and recent latency quantiles (the console keeps its
last reads; Prometheus has `rate()` and `histogram_quantile()`). Only the gateway's own
collectors are read (a restricted registry), never the ones that query the database at scrape
time.
"""

from __future__ import annotations

import math
from datetime import datetime

from prometheus_client import CollectorRegistry
from pydantic import BaseModel, Field

_REQUESTS = "modelforge_gateway_requests_total"
_BUCKETS = "modelforge_gateway_request_seconds_bucket"
_COUNT = "modelforge_gateway_request_seconds_count"
_SUM = "modelforge_gateway_request_seconds_sum"
_IN_FLIGHT = "modelforge_gateway_in_flight"
_QUEUE = "modelforge_gateway_queue"
_ERRORS = "modelforge_gateway_errors_total"
_TO_FIRST = "modelforge_llm_time_to_first_token_seconds"
_BETWEEN = "modelforge_llm_inter_token_seconds"
_LLM_COUNTS = "modelforge_llm_tokens_total"
_NAMES = (
    _REQUESTS,
    _BUCKETS,
    _COUNT,
    _SUM,
    _IN_FLIGHT,
    _QUEUE,
    _ERRORS,
    f"{_TO_FIRST}_bucket",
    f"{_BETWEEN}_bucket",
    _LLM_COUNTS,
)


class LatencyBucket(BaseModel):
    #: Upper bound in seconds; None: +Inf.
    le: float | None
    #: Requests answered within it (cumulative, as Prometheus counts them).
    count: int


class ServiceTraffic(BaseModel):
    """A service's gateway counters in this process (zeros before its first request)."""

    service_id: str
    name: str
    #: When this process read them; the counters are cumulative since it started.
    read_at: datetime
    #: Requests answered, by HTTP status ("200", "503", ...).
    requests: dict[str, int] = Field(default_factory=dict)
    #: What the gateway answered itself or went through, by cause (`metrics.py` names them).
    errors: dict[str, int] = Field(default_factory=dict)
    #: The latency histogram (arrival to the response's end), bounds ascending, +Inf last; with
    #: the count and the sum of seconds of every answered request.
    buckets: list[LatencyBucket] = Field(default_factory=list)
    count: int = 0
    seconds_sum: float = 0.0
    in_flight: int = 0
    queue: int = 0
    #: An LLM service's streamed calls: time to first token and mean time between tokens
    #: (cumulative histograms, as `buckets`), and its tokens by kind (prompt, completion).
    first_token_buckets: list[LatencyBucket] = Field(default_factory=list)
    inter_token_buckets: list[LatencyBucket] = Field(default_factory=list)
    tokens: dict[str, int] = Field(default_factory=dict)
    #: An LLM service's engines' own requests, processing and waiting in their queues, as the
    #: nodes last read them (None: not an LLM service, or none read yet).
    engine: dict[str, int] | None = None


def read_traffic(
    registry: CollectorRegistry, *, service_id: str, name: str, read_at: datetime
) -> ServiceTraffic:
    """The gateway series of service `name` (the metrics' `service` label) from `registry`."""
    traffic = ServiceTraffic(service_id=service_id, name=name, read_at=read_at)
    for metric in registry.restricted_registry(_NAMES).collect():
        for sample in metric.samples:
            if sample.labels.get("service") != name:
                continue
            value = sample.value
            if sample.name in (f"{_TO_FIRST}_bucket", f"{_BETWEEN}_bucket"):
                into = (
                    traffic.first_token_buckets
                    if sample.name.startswith(_TO_FIRST)
                    else traffic.inter_token_buckets
                )
                into.append(_bucket(sample.labels["le"], value))
            elif sample.name == _LLM_COUNTS:
                traffic.tokens[sample.labels["kind"]] = int(value)
            elif sample.name == _REQUESTS:
                traffic.requests[sample.labels["code"]] = int(value)
            elif sample.name == _ERRORS:
                traffic.errors[sample.labels["cause"]] = int(value)
            elif sample.name == _BUCKETS:
                traffic.buckets.append(_bucket(sample.labels["le"], value))
            elif sample.name == _COUNT:
                traffic.count = int(value)
            elif sample.name == _SUM:
                traffic.seconds_sum = value
            elif sample.name == _IN_FLIGHT:
                traffic.in_flight = int(value)
            elif sample.name == _QUEUE:
                traffic.queue = int(value)
    for buckets in (traffic.buckets, traffic.first_token_buckets, traffic.inter_token_buckets):
        buckets.sort(key=lambda bucket: math.inf if bucket.le is None else bucket.le)
    return traffic


def _bucket(le: str, count: float) -> LatencyBucket:
    bound = float(le)
    return LatencyBucket(le=None if math.isinf(bound) else bound, count=int(count))
