"""LLM serving benchmark (issue 43): the same `llama-server` with SmolLM2 called directly on its
port, through ModelForge (the OpenAI API at the control plane's address: the native gateway
front, the node's tunnel), and through LiteLLM's proxy pointed at the same server, in one run.

What runs
---------
A real control plane (Granian, SQLite, the native gateway front) and one node (a node agent and
its runtime worker), as bench/gateway.py starts them; a `llama.cpp` service of SmolLM2's GGUF
(`make install` fetched it) with 32 slots and the machine's cores; LiteLLM's proxy
(`litellm[proxy]`, pinned below, in its own virtual environment under build/bench: created on
first use with ``--install-litellm``) with one model entry pointing at the replica's own port.
The load generator (bench/llm_load.py) runs in its own process: 1, 8 and 32 concurrent streams,
each request 64 tokens (`ignore_eos`), for ``--duration`` seconds per run after a short warm-up,
the three paths taking turns within each concurrency.

It prints, per concurrency and path: time to first token p50/p99, inter-token latency p50/p99,
tokens/s, failed requests, the load generator's CPU, and for ModelForge the control plane's CPU
(its gateway front and Granian) per thousand tokens, its idle CPU over the run taken off. Each
request opens its own connection on every path: llama-server closes kept-alive connections
between calls without saying so, which a reusing client would count as failures.

Targets (printed, not failed): through ModelForge, time to first token p50 <= direct + 1 ms at 1
and 8 streams; tokens/s >= 0.97x direct at 8 and 32; less added time to first token than
LiteLLM's proxy at every concurrency. The exit status is 1 when a run had a failed request.

Run::

    python bench/llm.py --install-litellm      # about 3 minutes (the first time, + install)
    python bench/llm.py --streams 1 8 --duration 5
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.gateway import PartUnavailable, Stack, started, warm  # noqa: E402
from tests.e2e.node import wait_until  # noqa: E402
from tests.e2e.server import free_port  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
GGUF = ROOT / "build" / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf"
MODEL = "smollm2"
LITELLM = "litellm[proxy]==1.85.0"  # the newest whose proxy extra installs from PyPI here
LITELLM_VENV = ROOT / "build" / "bench" / "litellm"
PATHS = ("direct", "modelforge", "litellm")


def deploy(stack: Stack, cores: int) -> dict[str, Any]:
    if not GGUF.is_file():
        raise PartUnavailable(f"{GGUF} is missing: run make install")
    digest = stack.call("POST", "/api/v1/artifacts", 201, content=GGUF.read_bytes())["digest"]
    body = {
        "name": MODEL,
        "runner": "llama.cpp",
        "weights": digest,
        "llm": {"context_length": 256, "slots": 32},
        "resources": {"cpus": cores},
    }
    service = stack.call("POST", "/api/v1/services", 201, json=body)
    service_id = service["service_id"]
    wait_until(lambda: warm(stack.service(service_id), 1), 180, f"{MODEL} healthy")
    return stack.service(service_id)


def litellm_proxy(stack: ExitStack, scratch: Path, upstream: str, install: bool) -> str | None:
    """LiteLLM's proxy in front of `upstream` (the replica's `/v1`); its base URL, or None."""
    executable = LITELLM_VENV / "bin" / "litellm"
    if not executable.exists():
        if not install:
            print(f"litellm: not measured ({executable} missing: run with --install-litellm)")
            return None
        subprocess.run([sys.executable, "-m", "venv", str(LITELLM_VENV)], check=True)
        pip = [str(LITELLM_VENV / "bin" / "pip"), "install", "-q", LITELLM]
        subprocess.run(pip, check=True)
    config = scratch / "litellm.yaml"
    model = {
        "model_name": MODEL,
        "litellm_params": {"model": f"openai/{MODEL}", "api_base": upstream, "api_key": "none"},
    }
    config.write_text(json.dumps({"model_list": [model]}))  # YAML reads JSON
    port = free_port()
    log = (scratch / "litellm.log").open("wb")
    process = subprocess.Popen(
        [str(executable), "--config", str(config), "--port", str(port), "--num_workers", "1"],
        stdout=log,
        stderr=subprocess.STDOUT,
        cwd=scratch,
    )
    stack.callback(process.wait, 30)
    stack.callback(process.terminate)
    url = f"http://127.0.0.1:{port}"
    wait_until(lambda: _answers(f"{url}/health/liveliness"), 120, "LiteLLM's proxy up")
    return url


def _answers(url: str) -> bool:
    try:
        return httpx.get(url, timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def load(url: str, streams: int, seconds: float, key_file: Path | None) -> dict[str, Any]:
    command = [
        sys.executable,
        str(ROOT / "bench" / "llm_load.py"),
        "--url",
        f"{url}/chat/completions",
        "--model",
        MODEL,
        "--streams",
        str(streams),
        "--duration",
        str(seconds),
    ]
    if key_file is not None:
        command += ["--key-file", str(key_file)]
    ran = subprocess.run(command, capture_output=True, text=True, check=True)
    return dict(json.loads(ran.stdout))


def run(args: argparse.Namespace) -> int:
    failed = 0
    with tempfile.TemporaryDirectory(prefix="mf-llm-") as name, ExitStack() as stack:
        scratch = Path(name)
        fleet = stack.enter_context(started(scratch, 1, 5.0))
        service = deploy(fleet, args.cores)
        minted = fleet.call(
            "POST",
            f"/api/v1/services/{service['service_id']}/access-tokens",
            201,
            json={"name": "bench"},
        )
        key_file = scratch / "key"
        key_file.touch(mode=0o600)
        key_file.write_text(minted["token"])
        urls = {"direct": f"{service['url']}/v1", "modelforge": f"{fleet.server.url}/v1"}
        litellm = litellm_proxy(stack, scratch, urls["direct"], args.install_litellm)
        if litellm is not None:
            urls["litellm"] = f"{litellm}/v1"
        # The control plane's own CPU while idle (its loops, the routes' pushes), taken off
        # what it spent during a run through it: what is left is the calls' share.
        idle_from = fleet.cpu_by_group()["control plane"]
        time.sleep(5.0)
        idle_rate = (fleet.cpu_by_group()["control plane"] - idle_from) / 5.0
        print(f"control plane idle: {1000 * idle_rate:.1f} ms CPU a second")
        results: dict[int, dict[str, dict[str, Any]]] = {}
        for streams in args.streams:
            results[streams] = {}
            for path, url in urls.items():
                key = key_file if path == "modelforge" else None
                load(url, streams, 2.0, key)  # warm-up: connections, the prompt cache
                before, began = fleet.cpu_by_group()["control plane"], time.monotonic()
                figures = load(url, streams, args.duration, key)
                spent = fleet.cpu_by_group()["control plane"] - before
                spent -= idle_rate * (time.monotonic() - began)
                if path == "modelforge" and figures["tokens"]:
                    figures["cp_cpu_ms_per_1k_tokens"] = round(1e6 * spent / figures["tokens"], 1)
                results[streams][path] = figures
                failed += figures["failures"]
                print(f"{streams:>3} streams {path:<10} {json.dumps(figures)}", flush=True)
        report(results)
    return 1 if failed else 0


def report(results: dict[int, dict[str, dict[str, Any]]]) -> None:
    print("\nstreams path       ttft p50  ttft p99   itl p50   itl p99   tokens/s  fail  load cpu")
    for streams, paths in results.items():
        for path, f in paths.items():
            print(
                f"{streams:>7} {path:<10} {f['ttft_p50_ms']:>8} {f['ttft_p99_ms']:>9} "
                f"{f['itl_p50_ms']:>9} {f['itl_p99_ms']:>9} {f['tokens_per_second']:>10} "
                f"{f['failures']:>5} {f['load_cpu_seconds']:>8}"
            )
    print()
    for streams, paths in results.items():
        direct, ours = paths["direct"], paths["modelforge"]
        added = ours["ttft_p50_ms"] - direct["ttft_p50_ms"]
        ratio = ours["tokens_per_second"] / max(direct["tokens_per_second"], 1e-9)
        line = (
            f"{streams:>3} streams: ModelForge adds {added:+.2f} ms to TTFT p50, "
            f"tokens/s {ratio:.3f}x direct, control plane "
            f"{ours.get('cp_cpu_ms_per_1k_tokens')} ms CPU per 1000 tokens"
        )
        if "litellm" in paths:
            theirs = paths["litellm"]["ttft_p50_ms"] - direct["ttft_p50_ms"]
            ratio_l = paths["litellm"]["tokens_per_second"] / max(direct["tokens_per_second"], 1e-9)
            line += f"; LiteLLM adds {theirs:+.2f} ms, tokens/s {ratio_l:.3f}x"
        print(line)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--streams", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--duration", type=float, default=12.0)
    parser.add_argument(
        "--cores",
        type=int,
        default=1,
        help="the replica's cpus: its threads (leave the load a core)",
    )
    parser.add_argument("--install-litellm", action="store_true")
    args = parser.parse_args()
    try:
        return run(args)
    except PartUnavailable as exc:
        print(f"not measured: {exc}")
        return 1


if __name__ == "__main__":
    sys.exit(main())
