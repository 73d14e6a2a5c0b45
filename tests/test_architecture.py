"""The import graph of the shipped parts (docs/architecture.md): the control plane, the node
agent and the runtime worker are peers over `modelforge_contracts`; the release tool builds them
but imports none of them, and none of them imports it; the contracts import nothing of ours."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
CONTRACTS = "modelforge_contracts"
SHIPPED = ("control_plane", "node_agent", "runtime_worker")
OURS = (*SHIPPED, "release", CONTRACTS)
#: package -> what it may import of ours (besides itself).
ALLOWED = {
    CONTRACTS: set(),
    "control_plane": {CONTRACTS},
    "node_agent": {CONTRACTS},
    "runtime_worker": {CONTRACTS},
    "release": {CONTRACTS},
}


def imports_of(package: str, root: Path = ROOT) -> dict[str, set[str]]:
    """Module file -> the top-level packages of ours it imports (anywhere in the file)."""
    found: dict[str, set[str]] = {}
    for path in sorted((root / package).rglob("*.py")):
        if "node_modules" in path.parts:
            continue
        names: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.Import):
                names.update(alias.name.split(".")[0] for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names.add(node.module.split(".")[0])
            elif isinstance(node, ast.ImportFrom) and node.level > 0:
                names.add(package)  # relative: inside the package
        found[str(path.relative_to(root))] = {name for name in names if name in OURS}
    return found


@pytest.mark.parametrize("package", OURS)
def test_imports_point_down_to_the_contracts(package: str) -> None:
    modules = imports_of(package)
    assert modules, f"no modules found under {package}/"
    wrong = {
        module: sorted(names - ALLOWED[package] - {package})
        for module, names in modules.items()
        if names - ALLOWED[package] - {package}
    }
    assert not wrong, f"{package} may import only {sorted(ALLOWED[package])}: {wrong}"


def test_the_checker_sees_a_forbidden_import(tmp_path: Path) -> None:
    """The rule can fail: a module importing the release tool is named."""
    (tmp_path / "node_agent").mkdir()
    (tmp_path / "node_agent" / "probe.py").write_text(
        "from . import sibling\n\ndef late():\n    from release.cli import main\n"
    )
    assert imports_of("node_agent", tmp_path) == {"node_agent/probe.py": {"node_agent", "release"}}
