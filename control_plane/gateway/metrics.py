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

And for an LLM service's OpenAI calls (issue 43), as the native front measured each one
(`native/gateway_front/src/meter.rs`):

- `modelforge_llm_time_to_first_token_seconds{service}`: a streamed call's arrival to its first
  event (the engine writes none before its first token);
- `modelforge_llm_inter_token_seconds{service}`: a streamed call's mean time between tokens
  (first event to last, over its completion tokens less one);
- `modelforge_llm_tokens_total{service,kind}`: prompt and completion tokens, as the engine
  counted them (`rate()` of `kind="completion"` is the tokens per second);
- the requests waiting in each engine's own queue are read from the engines and reported by the
  nodes (`modelforge_llm_engine_waiting`, `control_plane/metrics.py`).

A service label is a deployed service's name (one the routing table knows), never what a
client typed, so a client cannot grow the number of series.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

#: Seconds: from 1 ms (what the gateway adds) to a minute (a long inference).
REQUEST_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
#: Seconds to a first token: a small model's few ms to a long prompt's prefill on a busy engine.
FIRST_TOKEN_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)
#: Seconds between tokens: a fast GPU's 2 ms to a loaded CPU's half second.
INTER_TOKEN_BUCKETS = (0.002, 0.005, 0.01, 0.02, 0.035, 0.05, 0.075, 0.1, 0.2, 0.5, 1)


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

        self.first_token = Histogram(
            "modelforge_llm_time_to_first_token_seconds",
            "Seconds from a streamed OpenAI call's arrival to its first token, by service.",
            ["service"],
            buckets=FIRST_TOKEN_BUCKETS,
            registry=registry,
        )
        self.inter_token = Histogram(
            "modelforge_llm_inter_token_seconds",
            "A streamed OpenAI call's mean seconds between tokens, by service.",
            ["service"],
            buckets=INTER_TOKEN_BUCKETS,
            registry=registry,
        )
        self.tokens = Counter(
            "modelforge_llm_tokens",
            "Tokens of the OpenAI calls as the engine counted them, by service and kind "
            "(prompt, completion).",
            ["service", "kind"],
            registry=registry,
        )

    def llm_call(
        self, service: str, usage: tuple[int, int] | None, timing: tuple[float, float] | None
    ) -> None:
        """One OpenAI call's end: its tokens and, when it streamed, its timing (seconds to the
        first event, and from the first to the last)."""
        if usage is not None:
            self.tokens.labels(service, "prompt").inc(usage[0])
            self.tokens.labels(service, "completion").inc(usage[1])
        if timing is not None:
            self.first_token.labels(service).observe(timing[0])
            if usage is not None and usage[1] > 1:
                self.inter_token.labels(service).observe(timing[1] / (usage[1] - 1))

    def answered(self, service: str, status: int, seconds: float) -> None:
        self.requests.labels(service, str(status)).inc()
        self.seconds.labels(service).observe(seconds)

    def error(self, service: str, cause: str) -> None:
        self.errors.labels(service, cause).inc()
