"""Jobs and services inside the released containers: the cpu-flavour images built without
Docker, bundled, signed, verified, loaded and started with `modelforge-release up` (control
plane, node agent in cpu mode, runtime worker with services enabled), then an ONNX job and a
Python job that imports numpy submitted through the admin API, run by the runtime worker's
runners in its container, and their results checked against numpy and onnxruntime computed
here; and an ONNX service deployed from a model, served by the runtime worker's built-in Open
Inference Protocol server in its container and called with the standard tritonclient; and
three jobs running at once on the node, started with MODELFORGE_AGENT_PARALLEL=3 on the host;
and an LLM service of the `llama.cpp` runner, run by the llama-server the worker image carries
and called with the `openai` client at the control plane's address.

The release is the one `make e2e` builds once (`conftest.release_bundle`); this module removes
its images from the engine when it is done, so the next module loads them itself."""

from __future__ import annotations

import io
import os
import subprocess
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import onnxruntime as ort
import openai
import pytest

from release.cli import main as release
from release.docker import compose_command
from release.state import STATE_DIR_VARIABLE
from tests.e2e.server import free_port
from tests.e2e.test_llm import smollm2_gguf
from tests.e2e_docker.conftest import VERSION
from tests.e2e_docker.test_release_docker import (
    CP_FILES,
    NODE_FILES,
    REPO,
    _logs,
    _project_containers,
    _up,
    _wait,
    docker,
)
from tests.onnx_models import relu_matmul

pytestmark = pytest.mark.e2e

#: The node's MODELFORGE_AGENT_PARALLEL, set on the host for `up`.
PARALLEL = 3
#: The node with services enabled: the runtime worker on the host's network.
SERVICE_NODE_FILES = [*NODE_FILES, REPO / "compose" / "docker-compose.services.yml"]
IMAGES = [
    f"modelforge-{component}:{VERSION}"
    for component in ("control-plane", "node-agent", "runtime-worker")
]


class Stack:
    def __init__(self, url: str, admin: dict[str, str]) -> None:
        self.url, self.admin = url, admin

    def post(self, path: str, **kwargs: Any) -> httpx.Response:
        return httpx.post(self.url + path, headers=self.admin, timeout=30, **kwargs)

    def get(self, path: str, **kwargs: Any) -> httpx.Response:
        return httpx.get(self.url + path, headers=self.admin, timeout=30, **kwargs)

    def delete(self, path: str) -> httpx.Response:
        return httpx.delete(self.url + path, headers=self.admin, timeout=30)

    def deploy_healthy(self, body: dict[str, Any], project: str, timeout: float) -> str:
        """Deploy the service `body` and wait until it is healthy; its id. Failing, the
        service's events and the node's logs say why."""
        deployed = self.post("/api/v1/services", json=body)
        assert deployed.status_code == 201, deployed.text
        service_id = str(deployed.json()["service_id"])
        try:
            _wait(
                lambda: self.get(f"/api/v1/services/{service_id}").json()["state"] == "healthy",
                timeout,
                f"service {body['name']} to be healthy",
            )
        except AssertionError:
            events = self.get(f"/api/v1/services/{service_id}/events").text
            raise AssertionError(f"{events}\n{_logs(project)}") from None
        return service_id

    def upload(self, content: bytes) -> str:
        answer = self.post("/api/v1/artifacts", content=content)
        assert answer.status_code == 201, answer.text
        return str(answer.json()["digest"])

    def run(self, job: dict[str, Any], project: str) -> dict[str, Any]:
        submitted = self.post("/api/v1/jobs", json=job)
        assert submitted.status_code == 201, submitted.text
        job_id = submitted.json()["job_id"]
        _wait(
            lambda: (
                self.get(f"/api/v1/jobs/{job_id}").json()["state"]
                in ("succeeded", "failed", "cancelled")
            ),
            180,
            f"job {job_id} to finish",
        )
        done = dict(self.get(f"/api/v1/jobs/{job_id}").json())
        if done["state"] != "succeeded":
            events = self.get(f"/api/v1/jobs/{job_id}/events").json()
            raise AssertionError(f"{done}\n{events}\n{_logs(project)}")
        return done


def _down(project: str, files: list[Path]) -> None:
    subprocess.run(
        [
            *compose_command(),
            "-p",
            project,
            *sum((["-f", str(f)] for f in files), []),
            "down",
            "-v",
        ],
        capture_output=True,
        env={
            **os.environ,
            "MODELFORGE_AGENT_CONTROL_PLANE_URL": "http://127.0.0.1:1",
            "MODELFORGE_CONTROL_PLANE_IMAGE": "x:local",
            "MODELFORGE_NODE_AGENT_IMAGE": "x:local",
            "MODELFORGE_RUNTIME_WORKER_IMAGE": "x:local",
        },
        check=False,
    )


@pytest.fixture(scope="module")
def stack(
    release_bundle: tuple[Path, Path], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[Stack, str]]:
    """The released stack, up and with its node ready; torn down, images removed, afterwards."""
    root = tmp_path_factory.mktemp("jobs-release")
    bundle, public = release_bundle
    port = free_port()
    cp_project, node_project = f"mfjobscp{port}", f"mfjobsnode{port}"
    with pytest.MonkeyPatch.context() as env:
        env.setenv(STATE_DIR_VARIABLE, str(root / "release-state"))
        env.setenv("MODELFORGE_PORT", str(port))
        env.setenv("MODELFORGE_BIND_ADDRESS", "127.0.0.1")
        try:
            assert release(["load", str(bundle), "--key", str(public)]) == 0
            assert _up(bundle, public, cp_project, CP_FILES[:1]) == 0
            url = f"http://127.0.0.1:{port}"
            _wait(
                lambda: httpx.get(f"{url}/api/v1/health", timeout=2).status_code == 200,
                90,
                "control plane health",
            )
            (container,) = _project_containers(cp_project)
            token = docker(
                "exec",
                container,
                "python3",
                "-c",
                "import sys; sys.stdout.write(open('/var/lib/modelforge/admin-token').read())",
            ).stdout.strip()
            admin = {"X-ModelForge-Admin-Token": token}
            minted = httpx.post(
                f"{url}/api/v1/admin/node-enrollments",
                headers=admin,
                json={"display_name": "jobs-node", "expires_in_seconds": 900},
            ).json()
            env.setenv("MODELFORGE_AGENT_CONTROL_PLANE_URL", url)
            env.setenv("MODELFORGE_AGENT_ACCELERATOR_MODE", "cpu")
            env.setenv("MODELFORGE_AGENT_ENROLLMENT_TOKEN", minted["token"])
            # Through the released Compose file to the agent (test_three_jobs_run_at_once).
            env.setenv("MODELFORGE_AGENT_PARALLEL", str(PARALLEL))
            assert _up(bundle, public, node_project, SERVICE_NODE_FILES) == 0
            env.delenv("MODELFORGE_AGENT_ENROLLMENT_TOKEN")
            readiness = f"{url}/api/v1/admin/nodes/{minted['node_id']}/readiness"
            try:
                _wait(
                    lambda: httpx.get(readiness, headers=admin).json().get("ready") is True,
                    120,
                    "node readiness",
                )
            except AssertionError:
                answer = httpx.get(readiness, headers=admin).text
                raise AssertionError(f"{answer}\n{_logs(node_project)}") from None
            yield Stack(url, admin), node_project
        finally:
            _down(node_project, SERVICE_NODE_FILES)
            _down(cp_project, CP_FILES[:1])
            docker("image", "rm", *IMAGES, check=False)


def _model() -> tuple[bytes, np.ndarray]:
    """A tiny model, y = relu(x @ w), and its weights."""
    weights = (np.arange(12, dtype=np.float32).reshape(4, 3) - 5) / 10
    return relu_matmul(weights), weights


def test_onnx_job_runs_in_the_runtime_worker_container(stack: tuple[Stack, str]) -> None:
    api, project = stack
    model, weights = _model()
    x = np.random.default_rng(11).standard_normal((6, 4)).astype(np.float32)
    feed = io.BytesIO()
    np.savez(feed, x=x)

    done = api.run(
        {
            "entrypoint": {"kind": "onnx", "model": api.upload(model)},
            "inputs": {"tensors": api.upload(feed.getvalue())},
        },
        project,
    )

    assert done["result"] == {"outputs": {"y": [6, 3]}, "provider": "CPUExecutionProvider"}
    outputs = api.get(f"/api/v1/artifacts/{done['outputs']['outputs']}")
    assert outputs.status_code == 200
    with np.load(io.BytesIO(outputs.content)) as result:
        y = result["y"]
    np.testing.assert_allclose(y, np.maximum(x @ weights, 0), rtol=1e-5, atol=1e-6)
    expected = ort.InferenceSession(model, providers=["CPUExecutionProvider"]).run(None, {"x": x})
    np.testing.assert_allclose(y, expected[0], rtol=1e-6)


JOB_SOURCE = """\
import os
import sys

import numpy as np
import onnxruntime

from runtime_worker.job import emit


def solve(matrix, vector):
    emit({"numpy": np.__version__})
    solution = np.linalg.solve(np.array(matrix), np.array(vector))
    return {
        "solution": solution.tolist(),
        "numpy": np.__version__,
        "onnxruntime": onnxruntime.__version__,
        "python": sys.executable,
        "uid": os.getuid(),
    }
"""


def test_python_job_imports_numpy_in_the_runtime_worker_container(
    stack: tuple[Stack, str],
) -> None:
    api, project = stack
    matrix = [[4.0, 1.0, 0.0], [1.0, 3.0, 1.0], [0.0, 1.0, 2.0]]
    vector = [1.0, 2.0, 3.0]

    done = api.run(
        {
            "entrypoint": {
                "kind": "python",
                "module": "linear",
                "function": "solve",
                "source": {"linear.py": JOB_SOURCE},
            },
            "params": {"matrix": matrix, "vector": vector},
        },
        project,
    )

    result = done["result"]
    np.testing.assert_allclose(result["solution"], np.linalg.solve(matrix, vector), rtol=1e-12)
    locked = dict(
        line.split(" ")[0].split("==")
        for line in (REPO / "locks/runtime-worker.lock").read_text().splitlines()
        if "==" in line and not line.startswith((" ", "#"))
    )
    assert result["numpy"] == locked["numpy"]
    assert result["onnxruntime"] == locked["onnxruntime"]
    # The image's own interpreter, as the image's user: the job ran inside the container.
    assert (result["python"], result["uid"]) == ("/usr/bin/python3", 10001)
    events = api.get(f"/api/v1/jobs/{done['job_id']}/events").json()
    assert {"numpy": locked["numpy"]} in [e["data"] for e in events if e["kind"] == "event"]


def test_onnx_service_serves_from_the_runtime_worker_container(stack: tuple[Stack, str]) -> None:
    import tritonclient.grpc as triton_grpc
    import tritonclient.http as triton

    api, project = stack
    model, weights = _model()
    digest = api.upload(model)
    created = api.post("/api/v1/models", json={"name": "relu", "version": "1", "weights": digest})
    assert created.status_code == 201, created.text
    body = {"name": "relu", "model": "relu@1", "resources": {"cpus": 0.5}}
    service_id = api.deploy_healthy(body, project, 120)
    view = api.get(f"/api/v1/services/{service_id}").json()
    client = triton.InferenceServerClient(url=view["url"].removeprefix("http://"))
    x = np.random.default_rng(5).standard_normal((3, 4)).astype(np.float32)
    inputs = [triton.InferInput("x", list(x.shape), "FP32")]
    inputs[0].set_data_from_numpy(x)
    y = client.infer("relu", inputs).as_numpy("y")
    expected = ort.InferenceSession(model, providers=["CPUExecutionProvider"]).run(None, {"x": x})
    np.testing.assert_allclose(y, expected[0], rtol=1e-6)
    np.testing.assert_allclose(y, np.maximum(x @ weights, 0), rtol=1e-5, atol=1e-6)
    # gRPC at the service's grpc_url, on the native front the image carries.
    grpc_client = triton_grpc.InferenceServerClient(url=view["grpc_url"])
    grpc_inputs = [triton_grpc.InferInput("x", list(x.shape), "FP32")]
    grpc_inputs[0].set_data_from_numpy(x)
    np.testing.assert_allclose(grpc_client.infer("relu", grpc_inputs).as_numpy("y"), expected[0])
    grpc_client.close()
    (worker,) = _project_containers(project, "runtime-worker")
    programs = docker("exec", worker, "python3", "-c", RUNNING_PROGRAMS).stdout.split()
    assert "modelforge-grpc-front" in programs, programs
    assert api.delete(f"/api/v1/services/{service_id}").status_code == 200


def test_llm_service_streams_from_the_runtime_worker_container(stack: tuple[Stack, str]) -> None:
    """The `llama.cpp` runner in the released worker image: its own llama-server (the image's
    CPU build), SmolLM2's GGUF uploaded to the control plane's container, called with the
    unchanged `openai` client at the control plane's address, streamed and whole."""
    api, project = stack
    digest = api.upload(smollm2_gguf().read_bytes())
    body = {
        "name": "smol",
        "runner": "llama.cpp",
        "weights": digest,
        "llm": {"context_length": 512, "slots": 1},
        "resources": {"cpus": 1},
    }
    service_id = api.deploy_healthy(body, project, 180)
    minted = api.post(f"/api/v1/services/{service_id}/access-tokens", json={"name": "e2e"})
    assert minted.status_code == 201, minted.text
    client = openai.OpenAI(
        base_url=f"{api.url}/v1", api_key=minted.json()["token"], max_retries=0, timeout=60
    )
    try:
        messages = [{"role": "user", "content": "Say hello."}]
        stream = client.chat.completions.create(
            model="smol",
            messages=messages,  # type: ignore[arg-type]
            max_tokens=16,
            stream=True,
            stream_options={"include_usage": True},
        )
        chunks = list(stream)
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        assert text.strip() and chunks[-1].usage is not None
        assert 0 < chunks[-1].usage.completion_tokens <= 16
        whole = client.completions.create(model="smol", prompt="The sky is", max_tokens=4)
        assert whole.choices[0].text and whole.usage is not None
    finally:
        client.close()
    (worker,) = _project_containers(project, "runtime-worker")
    programs = docker("exec", worker, "python3", "-c", RUNNING_PROGRAMS).stdout.split()
    assert "llama-server" in programs, programs
    assert api.delete(f"/api/v1/services/{service_id}").status_code == 200


#: The names of the programs running in a container (its /proc), one per line.
RUNNING_PROGRAMS = """
import os
for pid in filter(str.isdigit, os.listdir("/proc")):
    try:
        print(os.path.basename(os.readlink(f"/proc/{pid}/exe")))
    except OSError:
        pass
"""


NAP_SOURCE = """\
import time


def nap(seconds):
    started = time.time()
    time.sleep(seconds)
    return {"started": started, "ended": time.time()}
"""


def test_three_jobs_run_at_once_on_a_node_started_with_parallel_3(
    stack: tuple[Stack, str],
) -> None:
    api, project = stack
    job = {
        "entrypoint": {
            "kind": "python",
            "module": "nap",
            "function": "nap",
            "source": {"nap.py": NAP_SOURCE},
        },
        "params": {"seconds": 8},
        "resources": {"cpus": 0.25},  # all of them fit the node's CPUs at once
    }
    results: list[dict[str, Any]] = []
    with ThreadPoolExecutor(PARALLEL) as pool:
        for done in pool.map(lambda _: api.run(job, project), range(PARALLEL)):
            results.append(done["result"])

    # One worker container, one clock: each job ran while every other one did.
    assert max(r["started"] for r in results) < min(r["ended"] for r in results), results
