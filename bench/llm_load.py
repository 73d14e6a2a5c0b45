"""The load generator of bench/llm.py, in a process of its own: `--streams` concurrent chat
completions, streamed (server-sent events), each `--tokens` long (`ignore_eos`, so every stream
generates exactly that many), one after another on each stream for `--duration` seconds.

For each request it records the time to the first token (request sent to the first event that
carries content) and the gaps between later content events (inter-token latency); it prints one
JSON object: the requests, failures (with the first reason), tokens, tokens/s over the run, the
percentiles, and its own CPU seconds (user + system), so the bench can say what the load itself
cost. The key, if any, is read from `--key-file` (never from its arguments).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import resource
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import httpx


def percentile(values: list[float], share: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(share * len(ordered)))]


async def one_stream(
    client: httpx.AsyncClient,
    url: str,
    body: dict[str, Any],
    headers: dict[str, str],
    deadline: float,
    figures: dict[str, Any],
) -> None:
    while time.monotonic() < deadline:
        sent = time.monotonic()
        previous: float | None = None
        tokens = 0
        try:
            async with client.stream("POST", url, json=body, headers=headers) as answer:
                if answer.status_code != 200:
                    await answer.aread()
                    raise RuntimeError(f"HTTP {answer.status_code}: {answer.text[:200]}")
                async for line in answer.aiter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    event = json.loads(line[6:])
                    choices = event.get("choices") or []
                    if not choices or not (choices[0].get("delta") or {}).get("content"):
                        continue
                    now = time.monotonic()
                    if previous is None:
                        figures["ttft"].append(now - sent)
                    else:
                        figures["itl"].append(now - previous)
                    previous = now
                    tokens += 1
        except Exception as exc:  # noqa: BLE001 - counted and reported, the run goes on
            figures["failures"] += 1
            figures["reason"] = figures["reason"] or f"{type(exc).__name__}: {exc}"[:300]
            continue
        figures["requests"] += 1
        figures["tokens"] += tokens


async def run(args: argparse.Namespace) -> dict[str, Any]:
    headers = {}
    if args.key_file:
        headers["Authorization"] = f"Bearer {Path(args.key_file).read_text().strip()}"
    body = {
        "model": args.model,
        "messages": [{"role": "user", "content": "Tell me about the sea."}],
        "max_tokens": args.tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }
    figures: dict[str, Any] = {"ttft": [], "itl": [], "requests": 0, "tokens": 0}
    figures.update(failures=0, reason="")
    # A connection per request, on every path alike: llama-server closes kept-alive
    # connections between calls without saying so, which a reusing client takes for a failure.
    limits = httpx.Limits(max_connections=args.streams, max_keepalive_connections=0)
    timeout = httpx.Timeout(120.0)
    async with httpx.AsyncClient(limits=limits, timeout=timeout) as client:
        started = time.monotonic()
        deadline = started + args.duration
        await asyncio.gather(
            *(
                one_stream(client, args.url, body, headers, deadline, figures)
                for _ in range(args.streams)
            )
        )
        elapsed = time.monotonic() - started
    usage = resource.getrusage(resource.RUSAGE_SELF)
    ms = 1000.0
    return {
        "streams": args.streams,
        "requests": figures["requests"],
        "failures": figures["failures"],
        "reason": figures["reason"],
        "tokens": figures["tokens"],
        "seconds": round(elapsed, 3),
        "tokens_per_second": round(figures["tokens"] / elapsed, 2),
        "ttft_p50_ms": _ms(percentile(figures["ttft"], 0.5), ms),
        "ttft_p99_ms": _ms(percentile(figures["ttft"], 0.99), ms),
        "ttft_mean_ms": _ms(statistics.fmean(figures["ttft"]) if figures["ttft"] else None, ms),
        "itl_p50_ms": _ms(percentile(figures["itl"], 0.5), ms),
        "itl_p99_ms": _ms(percentile(figures["itl"], 0.99), ms),
        "load_cpu_seconds": round(usage.ru_utime + usage.ru_stime, 3),
    }


def _ms(value: float | None, scale: float) -> float | None:
    return None if value is None else round(value * scale, 3)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", required=True, help=".../v1/chat/completions")
    parser.add_argument("--model", required=True)
    parser.add_argument("--key-file")
    parser.add_argument("--streams", type=int, default=1)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--duration", type=float, default=10.0)
    args = parser.parse_args()
    print(json.dumps(asyncio.run(run(args))))
    return 0


if __name__ == "__main__":
    sys.exit(main())
