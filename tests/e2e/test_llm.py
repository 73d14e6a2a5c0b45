"""LLMs at the control plane's address (issue 43): the `llama.cpp` runner serving SmolLM2's GGUF
(llama.cpp's own `llama-server`, built by `make install`), deployed through the real control
plane, node agent and runtime worker (`--local-node`), and called with the unchanged `openai`
client at `$CP/v1`: through the native gateway front and the agent's tunnel, never the
replica's own port.

One control plane and one service for the module (a replica's cold start is the slow part);
each test is one behaviour: chat and completions, streamed and not; the first event before the
engine is done (the engine's own slot view, read through the gateway); a client that hangs up
frees its slot; every refusal in OpenAI's shape with its status, and hostile bodies refused
before a replica sees them (the replica's request count does not move); a key's tokens per
minute; and, last, an engine killed mid-stream ends the stream with an error event.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import openai
import psutil
import pytest

from tests.e2e.local_node import LocalControlPlane, short_directory

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parents[2]
MODEL = "smollm2"
#: Another name the service answers to at the OpenAI API.
ALIAS = "gpt-4o-mini"
CONTEXT = 512
MAX_TOKENS = 256
GGUF = ROOT / "build" / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf"


def smollm2_gguf() -> Path:
    """SmolLM2-135M-Instruct's GGUF, pinned in locks/llm.lock, and the server to run it: both
    made by `make install` (the README's test command runs it first)."""
    server = ROOT / "runtime_worker" / "bin" / "llama-server"
    assert server.is_file(), f"{server} is missing: run make install"
    assert GGUF.is_file(), f"{GGUF} is missing: run make install"
    return GGUF


@dataclass
class Llm:
    server: LocalControlPlane
    service_id: str
    key: str
    #: The clients made, closed with the module's control plane.
    clients: list[openai.OpenAI] = field(default_factory=list)

    @property
    def base_url(self) -> str:
        return f"{self.server.url}/v1"

    def client(self, key: str | None = None) -> openai.OpenAI:
        made = openai.OpenAI(base_url=self.base_url, api_key=key or self.key, max_retries=0)
        self.clients.append(made)
        return made

    def slots(self) -> list[dict[str, Any]]:
        """llama-server's slot view, through the gateway (the service's own path)."""
        return list(self.engine("slots").json())

    def engine(self, path: str) -> httpx.Response:
        """One of llama-server's own routes, through the gateway with the module's key."""
        answer = httpx.get(
            f"{self.server.url}/services/{MODEL}/{path}",
            headers={"Authorization": f"Bearer {self.key}"},
            timeout=10,
        )
        assert answer.status_code == 200, answer.text
        return answer

    def processed(self) -> int:
        """Prompt tokens the engine has taken, all requests together: any request that reached
        it moves it."""
        return self.counter("prompt_tokens_total")

    def counter(self, name: str) -> int:
        """One of llama-server's own counters (its Prometheus metrics, through the gateway)."""
        answer = self.engine("metrics")
        for line in answer.text.splitlines():
            if line.startswith(f"llamacpp:{name} "):
                return int(float(line.split()[-1]))
        raise AssertionError(f"no llamacpp:{name} in {answer.text[:500]}")


@pytest.fixture(scope="module")
def llm() -> Iterator[Llm]:
    gguf = smollm2_gguf()
    with short_directory() as short:
        server = LocalControlPlane(short / "cp")
        with server:
            server.wait_online_node(timeout=60)
            admin = server.admin()
            upload = httpx.post(
                f"{server.url}/api/v1/artifacts",
                headers=admin,
                content=gguf.read_bytes(),
                timeout=60,
            )
            assert upload.status_code in (200, 201), upload.text
            deploy = httpx.post(
                f"{server.url}/api/v1/services",
                headers=admin,
                json={
                    "name": MODEL,
                    "runner": "llama.cpp",
                    "weights": upload.json()["digest"],
                    "llm": {
                        "context_length": CONTEXT,
                        "slots": 2,
                        "max_tokens": MAX_TOKENS,
                        "embeddings": "mean",
                    },
                    "aliases": [ALIAS],
                    "resources": {"cpus": 1},
                },
                timeout=30,
            )
            assert deploy.status_code == 201, deploy.text
            service_id = deploy.json()["service_id"]
            deadline = time.monotonic() + 180
            view: dict[str, Any] = {}
            while time.monotonic() < deadline:
                view = server.get(f"/api/v1/services/{service_id}")
                if view["state"] == "healthy":
                    break
                time.sleep(0.5)
            assert view.get("state") == "healthy", f"{view}\n{server.child_logs()}"
            minted = httpx.post(
                f"{server.url}/api/v1/services/{service_id}/access-tokens",
                headers=admin,
                json={"name": "llm tests"},
                timeout=10,
            )
            assert minted.status_code == 201, minted.text
            llm = Llm(server, service_id, minted.json()["token"])
            try:
                yield llm
            finally:
                for client in llm.clients:
                    client.close()


def test_the_replica_is_healthy_after_a_warm_up(llm: Llm) -> None:
    events = llm.server.get(f"/api/v1/services/{llm.service_id}/events")
    ready = [event for event in events if event["kind"] == "ready"]
    assert ready, events
    assert ready[0]["data"]["cold_start_seconds"] > 0
    assert ready[0]["data"]["warm_up_seconds"] >= 0
    view = llm.server.get(f"/api/v1/services/{llm.service_id}")
    assert view["llm"] == {
        "context_length": CONTEXT,
        "slots": 2,
        "gpu_layers": None,
        "max_tokens": MAX_TOKENS,
        "embeddings": "mean",
    }


def test_chat_and_completions_answer_the_openai_client(llm: Llm) -> None:
    client = llm.client()
    chat = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Say hello."}],
        max_tokens=12,
        temperature=0,
    )
    assert chat.choices[0].message.content
    assert chat.usage is not None and 0 < chat.usage.completion_tokens <= 12
    completion = client.completions.create(
        model=MODEL, prompt="The capital of France is", max_tokens=8, temperature=0
    )
    assert completion.choices[0].text
    assert completion.usage is not None and completion.usage.prompt_tokens > 0
    listed = client.models.list()
    assert [model.id for model in listed.data] == [MODEL, ALIAS]
    # The alias reaches the same service (its usage and metrics are the service's).
    aliased = client.chat.completions.create(
        model=ALIAS, messages=[{"role": "user", "content": "Hi."}], max_tokens=2
    )
    assert aliased.usage is not None and aliased.usage.completion_tokens > 0


def test_a_stream_arrives_while_the_engine_generates(llm: Llm) -> None:
    client = llm.client()
    stream = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Count from one to fifty in words."}],
        max_tokens=120,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    arrivals: list[float] = []
    text: list[str] = []
    seen_busy = False
    usage = None
    for chunk in stream:
        arrivals.append(time.monotonic())
        if chunk.usage is not None:
            usage = chunk.usage
        if chunk.choices and chunk.choices[0].delta.content:
            text.append(chunk.choices[0].delta.content)
        if len(text) == 2:
            # The first events are here; the engine is still at work on this request.
            seen_busy = any(slot.get("is_processing") for slot in llm.slots())
    assert seen_busy, "the engine had finished before the client saw its first tokens"
    assert len(text) > 10
    assert arrivals[-1] - arrivals[1] > 0.05  # spread over the generation, not one burst
    assert usage is not None and usage.completion_tokens == 120


def test_embeddings_answer_the_openai_client_and_are_counted(llm: Llm) -> None:
    traffic = f"/api/v1/services/{llm.service_id}/traffic"
    before = llm.server.get(traffic)["tokens"].get("prompt", 0)
    answer = llm.client().embeddings.create(model=MODEL, input=["a red apple", "the sea"])
    vectors = [item.embedding for item in answer.data]
    assert len(vectors) == 2 and len(vectors[0]) == len(vectors[1]) > 100
    assert vectors[0] != vectors[1]
    assert answer.usage.prompt_tokens > 0
    deadline = time.monotonic() + 5
    while llm.server.get(traffic)["tokens"].get("prompt", 0) - before < answer.usage.prompt_tokens:
        assert time.monotonic() < deadline, "the embeddings' input tokens were not counted"
        time.sleep(0.1)


def test_a_completion_streams_too(llm: Llm) -> None:
    stream = llm.client().completions.create(
        model=MODEL, prompt="Once upon a time", max_tokens=24, temperature=0, stream=True
    )
    pieces = [chunk.choices[0].text for chunk in stream if chunk.choices]
    assert len([piece for piece in pieces if piece]) > 5


def test_a_client_that_hangs_up_frees_its_slot(llm: Llm) -> None:
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "Write a very long story about a dragon."}],
        "max_tokens": MAX_TOKENS,
        "stream": True,
    }
    headers = {"Authorization": f"Bearer {llm.key}"}
    with (
        httpx.Client(timeout=30) as client,
        client.stream("POST", f"{llm.base_url}/chat/completions", json=body, headers=headers) as r,
    ):
        assert r.status_code == 200
        lines = r.iter_lines()
        events = [line for line in (next(lines) for _ in range(6)) if line.startswith("data:")]
        assert events
        assert any(slot.get("is_processing") for slot in llm.slots())
    hung_up = time.monotonic()
    while any(slot.get("is_processing") for slot in llm.slots()):
        assert time.monotonic() - hung_up < 1.0, "the slot still generates after the client left"
        time.sleep(0.05)


def _post(llm: Llm, content: bytes, *, key: str | None = None) -> httpx.Response:
    headers = {"Content-Type": "application/json"}
    headers["Authorization"] = f"Bearer {key if key is not None else llm.key}"
    return httpx.post(
        f"{llm.base_url}/chat/completions", content=content, headers=headers, timeout=30
    )


def _error(answer: httpx.Response) -> dict[str, Any]:
    body = answer.json()
    assert set(body) == {"error"}, body
    assert {"message", "type", "code"} <= set(body["error"]), body
    return dict(body["error"])


def test_refusals_come_in_openais_shape(llm: Llm) -> None:
    client = llm.client()
    messages = [{"role": "user", "content": "hi"}]
    with pytest.raises(openai.NotFoundError) as unknown:
        client.chat.completions.create(model="no-such-model", messages=messages, max_tokens=4)
    assert unknown.value.status_code == 404
    assert unknown.value.code == "model_not_found"
    with pytest.raises(openai.AuthenticationError) as wrong:
        llm.client("mfs_" + "x" * 43).chat.completions.create(
            model=MODEL, messages=messages, max_tokens=4
        )
    assert wrong.value.status_code == 401
    assert wrong.value.code == "invalid_api_key"
    with pytest.raises(openai.BadRequestError) as too_many:
        client.chat.completions.create(model=MODEL, messages=messages, max_tokens=MAX_TOKENS + 1)
    assert too_many.value.code == "max_tokens_exceeded"
    # A prompt beyond the context: the engine's own 400.
    with pytest.raises(openai.BadRequestError) as beyond:
        client.completions.create(model=MODEL, prompt="word " * (CONTEXT * 2), max_tokens=4)
    assert beyond.value.status_code == 400
    no_key = httpx.post(f"{llm.base_url}/chat/completions", json={"model": MODEL}, timeout=10)
    assert no_key.status_code == 401 and _error(no_key)["code"] == "invalid_api_key"
    models = httpx.get(f"{llm.base_url}/models", timeout=10)
    assert models.status_code == 401 and _error(models)["type"] == "authentication_error"
    # Generation only through /v1, where it is counted: the service's own path reads.
    direct = httpx.post(
        f"{llm.server.url}/services/{MODEL}/v1/chat/completions",
        json={"model": MODEL, "messages": messages},
        headers={"Authorization": f"Bearer {llm.key}"},
        timeout=10,
    )
    assert direct.status_code == 405 and direct.headers["allow"] == "GET, HEAD", direct.text
    assert "/v1" in direct.json()["error"]


def test_keys_of_several_services_or_every_llm_open_the_model(llm: Llm) -> None:
    messages = [{"role": "user", "content": "Hi."}]
    for scope in ({"llm_services": True}, {"services": [MODEL]}):
        minted = httpx.post(
            f"{llm.server.url}/api/v1/access-tokens",
            headers=llm.server.admin(),
            json={"name": "team", **scope},
            timeout=10,
        )
        assert minted.status_code == 201, minted.text
        client = llm.client(minted.json()["token"])
        assert [model.id for model in client.models.list().data] == [MODEL, ALIAS]
        chat = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=2)
        assert chat.usage is not None and chat.usage.completion_tokens > 0
        with pytest.raises(openai.NotFoundError):
            client.chat.completions.create(model="other", messages=messages, max_tokens=2)


def test_a_key_past_its_tokens_per_minute_is_answered_429(llm: Llm) -> None:
    minted = httpx.post(
        f"{llm.server.url}/api/v1/services/{llm.service_id}/access-tokens",
        headers=llm.server.admin(),
        json={"name": "limited", "tokens_per_minute": 20},
        timeout=10,
    )
    assert minted.status_code == 201, minted.text
    client = llm.client(minted.json()["token"])
    messages = [{"role": "user", "content": "Say one word about the sea, please."}]
    first = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=3)
    assert first.usage is not None and first.usage.total_tokens >= 20  # the minute is spent
    # Counted when the front reports the call's end, a moment after the client has it.
    deadline = time.monotonic() + 5
    while True:
        try:
            client.chat.completions.create(model=MODEL, messages=messages, max_tokens=3)
        except openai.RateLimitError as refused:
            limited = refused
            break
        assert time.monotonic() < deadline, "a key past its tokens per minute was let through"
    assert limited.status_code == 429 and limited.code == "tokens_per_minute_exceeded"
    assert 1 <= int(limited.response.headers["retry-after"]) <= 60
    assert limited.body is not None and "20 tokens per minute" in str(limited.body)
    # Another key of the same service is not held back by it.
    assert llm.client().chat.completions.create(model=MODEL, messages=messages, max_tokens=2)


def test_hostile_bodies_never_reach_the_replica(llm: Llm) -> None:
    before = llm.processed()
    huge = json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "x" * 10_000_000}]})
    answer = _post(llm, huge.encode())
    assert answer.status_code == 413 and _error(answer)["code"] == "request_too_large"
    deep = b'{"model": "smollm2", "messages": ' + b"[" * 1000 + b"]" * 1000 + b"}"
    answer = _post(llm, deep)
    assert answer.status_code == 400 and _error(answer)["type"] == "invalid_request_error"
    for hostile in (
        b'{"model": "smollm2", "messages": [], "temperature": NaN}',
        b'{"model": "smollm2", "messages": [{"role": "user", "content": "a\x01b"}]}',
        b'{"messages": []}',
        b"[]",
        b"not json",
    ):
        answer = _post(llm, hostile)
        assert answer.status_code == 400, hostile
        assert _error(answer)["code"] == "invalid_request", hostile
    assert llm.processed() == before


def test_usage_per_key_matches_the_engines_counts(llm: Llm) -> None:
    minted = httpx.post(
        f"{llm.server.url}/api/v1/services/{llm.service_id}/access-tokens",
        headers=llm.server.admin(),
        json={"name": "usage"},
        timeout=10,
    )
    key = minted.json()["token"]
    client = llm.client(key)
    # Counted from an idle engine: an earlier test's generation is over, its count final.
    deadline = time.monotonic() + 10
    while any(slot.get("is_processing") for slot in llm.slots()):
        assert time.monotonic() < deadline, "the engine is still busy with an earlier call"
        time.sleep(0.1)
    predicted_before = llm.counter("tokens_predicted_total")
    prompt, completion = 0, 0
    for index in range(100):
        messages = [{"role": "user", "content": f"Say a word about the number {index}."}]
        if index % 3 == 0:
            chat = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=3)
            assert chat.usage is not None
            prompt += chat.usage.prompt_tokens
            completion += chat.usage.completion_tokens
        elif index % 3 == 1:  # streamed, usage asked for: the client sees the engine's count
            stream = client.chat.completions.create(
                model=MODEL,
                messages=messages,
                max_tokens=3,
                stream=True,
                stream_options={"include_usage": True},
            )
            chunks = list(stream)
            assert chunks[-1].usage is not None and chunks[-1].choices == []
            prompt += chunks[-1].usage.prompt_tokens
            completion += chunks[-1].usage.completion_tokens
        else:  # streamed without asking: counted at the gateway, never shown to the client
            stream = client.chat.completions.create(
                model=MODEL, messages=messages, max_tokens=3, stream=True
            )
            chunks = list(stream)
            assert all(chunk.usage is None and chunk.choices for chunk in chunks)
    predicted = llm.counter("tokens_predicted_total") - predicted_before
    deadline = time.monotonic() + 10
    while True:
        view = llm.server.get(f"/api/v1/services/{llm.service_id}/usage")
        mine = [row for row in view["tokens"] if row["token_id"] == minted.json()["id"]]
        if mine and mine[0]["requests"] == 100:
            break
        assert time.monotonic() < deadline, view
        time.sleep(0.2)
    assert mine[0]["completion_tokens"] == predicted  # the engine's own total
    assert mine[0]["prompt_tokens"] >= prompt > 0
    assert mine[0]["name"] == "usage"
    shown = json.dumps(view)
    assert key not in shown and llm.key not in shown  # hints only, never a key


def test_the_gateway_measures_tokens_and_reads_the_engines_load(llm: Llm) -> None:
    """Time to first token, between tokens and tokens per kind, as the front measured a
    streamed call; the engine's own load, read from it by its node: in the service's traffic
    (the console's panel) and in `/metrics`."""
    traffic = f"/api/v1/services/{llm.service_id}/traffic"
    before = llm.server.get(traffic)
    asked = time.monotonic()
    stream = llm.client().chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Name three colours."}],
        max_tokens=16,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    took = time.monotonic() - asked
    usage = chunks[-1].usage
    assert usage is not None and usage.completion_tokens > 1

    def count(buckets: list[dict[str, Any]]) -> int:
        return int(buckets[-1]["count"]) if buckets else 0

    def tokens(view: dict[str, Any], kind: str) -> int:
        return int(view["tokens"].get(kind, 0))

    deadline = time.monotonic() + 15
    while True:  # counted when the front reports the call's end; the load at a node's sync
        after = llm.server.get(traffic)
        if count(after["first_token_buckets"]) > count(before["first_token_buckets"]) and (
            after["engine"] is not None
        ):
            break
        assert time.monotonic() < deadline, after
        time.sleep(0.2)
    assert count(after["first_token_buckets"]) - count(before["first_token_buckets"]) == 1
    assert count(after["inter_token_buckets"]) - count(before["inter_token_buckets"]) == 1
    assert tokens(after, "completion") - tokens(before, "completion") == usage.completion_tokens
    assert tokens(after, "prompt") - tokens(before, "prompt") == usage.prompt_tokens
    # The first token came within the call (the bucket it fell in starts below its length).
    first = [b for b in after["first_token_buckets"] if b["count"] > 0]
    lower = [b["le"] for b in after["first_token_buckets"] if b["count"] == 0 and b["le"]]
    assert first and (not lower or max(lower) < took)
    assert set(after["engine"]) == {"processing", "waiting"}
    metrics = httpx.get(f"{llm.server.url}/metrics", headers=llm.server.admin(), timeout=10)
    assert metrics.status_code == 200, metrics.text
    for series in (
        f'modelforge_llm_time_to_first_token_seconds_count{{service="{MODEL}"}}',
        f'modelforge_llm_tokens_total{{kind="completion",service="{MODEL}"}}',
        f'modelforge_llm_engine_requests{{name="{MODEL}",service="{llm.service_id}",state="waiting"}}',
    ):
        assert series in metrics.text, series


def test_a_replica_dying_mid_stream_ends_it_with_an_error_event(llm: Llm) -> None:
    """Last in the module: it kills the engine (the worker then starts another)."""
    assert llm.server.process is not None
    tree = psutil.Process(llm.server.process.pid).children(recursive=True)
    engines = [process for process in tree if process.name() == "llama-server"]
    assert len(engines) == 1, engines
    stream = (
        llm.client()
        .with_options(timeout=20)
        .chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "Write a very long story about a dragon."}],
            max_tokens=MAX_TOKENS,
            stream=True,
        )
    )
    received: list[str] = []
    with pytest.raises(openai.APIError) as failed:
        for chunk in stream:
            if chunk.choices and chunk.choices[0].delta.content:
                received.append(chunk.choices[0].delta.content)
            if len(received) == 3:
                engines[0].kill()
    # The stream's own last event, not a cut connection (APIConnectionError) or a timeout.
    assert type(failed.value) is openai.APIError, repr(failed.value)
    assert failed.value.code == "replica_failed"
    assert len(received) >= 3
