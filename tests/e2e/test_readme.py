"""The README's first two sections, run exactly as written (issues 29 and 43): their commands
are read from README.md itself, so the README and this test cannot drift apart.

`make run` is `modelforge-control-plane --local-node` once the venv and the console are built;
here the control plane starts that way in a directory of its own (its data dir the default
`modelforge-data` there, the admin token generated into it), on a free port instead of 8000 —
the one change made to the commands — and without the console build. Within 60 s one node is
online; then the README's commands upload the example model, deploy it, and call it at the
control plane's address with its key, with `curl` and `tritonclient`, and the model's answer is
checked here with `tritonclient.http` too; then the second section's commands deploy SmolLM2
with the `llama.cpp` runner and chat with it through `$CP/v1` with the `openai` client.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from tests.e2e.local_node import LocalControlPlane, short_directory

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parents[2]
MAX_COMMANDS = 5


def first_section_blocks(readme: str, section: int = 1) -> list[str]:
    """The `bash` blocks of the README's first (or `section`-th) `##` section, in order."""
    sections = re.split(r"^## ", readme, flags=re.MULTILINE)
    assert len(sections) > section + 1, f"README.md has no section after the {section}-th"
    return re.findall(r"^```bash\n(.*?)^```", sections[section], flags=re.MULTILINE | re.DOTALL)


def commands_of(block: str) -> list[str]:
    """The shell commands of a block: lines joined where they end in a backslash."""
    joined = re.sub(r"\\\n\s*", " ", block)
    return [line for line in joined.splitlines() if line.strip() and not line.startswith("#")]


def test_the_readme_starts_with_make_run_and_at_most_five_commands() -> None:
    blocks = first_section_blocks((ROOT / "README.md").read_text())
    assert blocks[0].strip() == "make run"
    commands = [command for block in blocks[1:] for command in commands_of(block)]
    assert 1 <= len(commands) <= MAX_COMMANDS, commands
    # `make run` starts the control plane with its local node, as the test below does.
    recipe = (ROOT / "Makefile").read_text().split("\nrun:", 1)[1].split("\n\n", 1)[0]
    assert "modelforge-control-plane $(if $(MODELFORGE_LOCAL_NODE),,--local-node)" in recipe


@pytest.fixture
def short() -> Iterator[Path]:
    with short_directory() as path:
        yield path


def test_the_readme_commands_make_a_model_answer(short: Path) -> None:
    import tritonclient.http as httpclient
    from tritonclient.utils import InferenceServerException

    from examples import make_model

    # The example model ships as its generator writes it.
    assert (ROOT / "examples" / "tiny.onnx").read_bytes() == make_model.model_bytes()

    blocks = first_section_blocks((ROOT / "README.md").read_text())
    work = short / "checkout"
    work.mkdir()
    # What the commands name in the checkout: the examples and the venv (`.venv/bin/python`).
    (work / "examples").symlink_to(ROOT / "examples")
    (work / ".venv").symlink_to(Path(sys.executable).parent.parent)
    (work / "build").symlink_to(ROOT / "build")  # the LLM's GGUF, fetched by make install
    server = LocalControlPlane(work)
    script = "\n".join(blocks[1:]).replace("127.0.0.1:8000", f"127.0.0.1:{server.port}")
    llm_blocks = first_section_blocks((ROOT / "README.md").read_text(), section=2)
    assert 1 <= sum(len(commands_of(block)) for block in llm_blocks) <= MAX_COMMANDS
    with server:
        _node, seconds = server.wait_online_node(timeout=60)
        assert seconds < 60
        env = {k: v for k, v in os.environ.items() if not k.startswith("MODELFORGE_")}
        ran = subprocess.run(
            ["bash", "-euo", "pipefail", "-c", script + '\nprintf "\\nKEY=%s\\n" "$KEY"\n'],
            cwd=work,
            env=env,
            capture_output=True,
            text=True,
            timeout=240,
        )
        assert ran.returncode == 0, f"{ran.stdout}\n{ran.stderr}\n{server.child_logs()}"
        lines = ran.stdout.strip().splitlines()
        key = lines[-1].removeprefix("KEY=")
        # curl's answer (JSON), then the tritonclient example's line.
        answer = json.loads(lines[0])
        assert answer["outputs"][0]["name"] == "y"
        assert answer["outputs"][0]["data"] == [5.5, 1.0]
        assert "y = [[5.5, 1.0]]" in ran.stdout

        # The deployed model answers a standard client at the control plane's address, with
        # the model's values; without the key it is refused.
        client = httpclient.InferenceServerClient(url=server.url.removeprefix("http://"))
        x = np.array([[1, 2, 3], [-1, 0, 2], [0.5, -3, 4]], dtype=np.float32)
        inputs = [httpclient.InferInput("x", list(x.shape), "FP32")]
        inputs[0].set_data_from_numpy(x)
        bearer = {"Authorization": f"Bearer {key}"}
        y = client.infer("tiny", inputs, headers=bearer).as_numpy("y")
        np.testing.assert_allclose(y, make_model.expected(x), rtol=1e-6)
        assert y[0].tolist() == [5.5, 1.0]
        with pytest.raises(InferenceServerException, match="401|access token"):
            client.infer("tiny", inputs)

        # The second section: the LLM, in the same shell state as a reader's terminal.
        export = next(line for line in commands_of(blocks[1]) if line.startswith("export CP="))
        llm_script = "\n".join([export, *llm_blocks]).replace(
            "127.0.0.1:8000", f"127.0.0.1:{server.port}"
        )
        chatted = subprocess.run(
            ["bash", "-euo", "pipefail", "-c", llm_script],
            cwd=work,
            env=env,
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert chatted.returncode == 0, f"{chatted.stdout}\n{chatted.stderr}\n{server.child_logs()}"
        text, _, usage = chatted.stdout.rpartition("\n[")
        assert text.strip(), chatted.stdout
        assert re.fullmatch(r"\d+ prompt \+ \d+ completion tokens\]\n?", usage), chatted.stdout
