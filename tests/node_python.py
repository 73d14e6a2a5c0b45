"""A second Python environment for the node's Python (`MODELFORGE_AGENT_PYTHON`): a virtual
environment made from the test interpreter's base Python, without pip and without network,
holding one package the runtime worker's environment lacks (`only_in_node_python`), written
into its site-packages."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

PACKAGE = "only_in_node_python"
VALUE = "imported from the node's own environment"


def make_node_python(directory: Path) -> Path:
    """A virtual environment in `directory` holding `PACKAGE`; its interpreter's path."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(directory)], check=True)
    python = directory / "bin" / "python"
    purelib = subprocess.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    package = Path(purelib) / PACKAGE
    package.mkdir(parents=True)
    (package / "__init__.py").write_text(f"VALUE = {VALUE!r}\n")
    return python
