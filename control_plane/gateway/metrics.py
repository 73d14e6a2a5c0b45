"""The gateway's Prometheus series, in the app's own registry (`control_plane.metrics.Metrics`).

- `modelforge_gateway_requests_total{service,code}`: requests answered, by HTTP status (an
  answer broken off after it began: the status it began with, and `response_broken` below);
- `modelforge_gateway_request_seconds{service}`: from arrival to the response's end;
- `modelforge_gateway_in_flight{service}`: requests being served now (queued ones not);
- `modelforge_gateway_queue{service}`: requests waiting for a place (`balancer.Admission`);
- `modelforge_gateway_errors_total{service,cause}`: what the gateway answered itself, by cause
  (`unauthorized`, `rate_limited`, `headers_too_large`, `target_too_large`, `too_large`,
  `client_timeout`, `busy`, `no_replica`, `transport`, `retried`, `client_gone`,
  `response_broken`, ...).

A service label is a deployed service's name (one the routing table knows), never what a
client typed, so a client cannot grow the number of series.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

#: Seconds: from 1 ms (what the gateway adds) to a minute (a long inference).
REQUEST_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)


class GatewayMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.requests = Counter(
            "modelforge_gateway_requests",
            "Requests the gateway answered, by service and HTTP status.",
            ["service", "code"],
            registry=registry,
        )
        self.seconds = Histogram(
            "modelforge_gateway_request_seconds",
            "Seconds from a gateway request's arrival to the end of its response.",
            ["service"],
            buckets=REQUEST_BUCKETS,
            registry=registry,
        )
        self.in_flight = Gauge(
            "modelforge_gateway_in_flight",
            "Gateway requests being served now, by service.",
            ["service"],
            registry=registry,
        )
        self.queue = Gauge(
            "modelforge_gateway_queue",
            "Gateway requests waiting for a place, by service.",
            ["service"],
            registry=registry,
        )
        self.errors = Counter(
            "modelforge_gateway_errors",
            "What the gateway answered itself or went through, by service and cause.",
            ["service", "cause"],
            registry=registry,
        )

    def answered(self, service: str, status: int, seconds: float) -> None:
        self.requests.labels(service, str(status)).inc()
        self.seconds.labels(service).observe(seconds)

    def error(self, service: str, cause: str) -> None:
        self.errors.labels(service, cause).inc()
