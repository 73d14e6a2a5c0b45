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


# --- Inside the control plane: rooms by domain (docs/architecture.md, "Inside the control plane")

CONTROL_PLANE = ROOT / "control_plane"
#: Composition: builds everything, imported by nothing but itself (`local_node`: the node agent
#: and runtime worker `cli` starts beside the control plane; `local_processes`: how it starts
#: and stops them; `native_front`: the native gateway front `cli` starts in front of Granian;
#: `artifact_host`: the artifact host `cli --artifacts-only` serves, composed like `app`).
COMPOSITION = {
    "app",
    "artifact_host",
    "context",
    "cli",
    "__main__",
    "local_node",
    "local_processes",
    "native_front",
}
#: Transport and periodic work: above every domain.
UPPER = {"api", "background"}
#: Domain package -> the other domains it may import. The order, lowest first: access, artifacts,
#: vault, catalog -> fleet -> jobs, services -> scheduling -> gateway -> provisioning.
DOMAINS: dict[str, set[str]] = {
    "access": set(),
    "artifacts": set(),
    "vault": set(),
    "catalog": {"artifacts"},
    "fleet": {"access", "artifacts", "vault", "catalog"},
    "jobs": {"access", "artifacts", "vault", "catalog", "fleet"},
    "services": {"access", "artifacts", "vault", "catalog", "fleet"},
    "scheduling": {"access", "artifacts", "vault", "catalog", "fleet", "jobs", "services"},
    "gateway": {
        "access",
        "artifacts",
        "vault",
        "catalog",
        "fleet",
        "jobs",
        "services",
        "scheduling",
    },
    "provisioning": {
        "access",
        "artifacts",
        "vault",
        "catalog",
        "fleet",
        "jobs",
        "services",
        "scheduling",
        "gateway",
    },
}
#: Scheduling's low modules: value types and wake-ups, which any domain may import; they import
#: only the floor.
LOW = {"control_plane.scheduling.shapes", "control_plane.scheduling.dispatch"}
MAX_LINES = 500


def control_plane_graph(root: Path = ROOT) -> dict[str, set[str]]:
    """Module -> the control-plane modules it imports, anywhere in the file (type-only and
    function-level imports included). `from package import module` counts as the module."""
    files = {
        ".".join(path.relative_to(root).with_suffix("").parts).removesuffix(".__init__"): path
        for path in (root / "control_plane").rglob("*.py")
        if "migrations" not in path.parts and "node_modules" not in path.parts
    }
    graph: dict[str, set[str]] = {}
    for module, path in files.items():
        found: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                if node.module.split(".")[0] != "control_plane":
                    continue
                for alias in node.names:
                    full = f"{node.module}.{alias.name}"
                    found.add(full if full in files else node.module)
            elif isinstance(node, ast.Import):
                found.update(a.name for a in node.names if a.name.split(".")[0] == "control_plane")
        graph[module] = {name for name in found if name in files and name != module}
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected groups of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, edges = work[-1]
            for nxt in edges:
                if nxt not in index:
                    index[nxt] = low[nxt] = len(index)
                    stack.append(nxt)
                    on_stack.add(nxt)
                    work.append((nxt, iter(sorted(graph[nxt]))))
                    break
                if nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    group = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        group.append(member)
                        if member == node:
                            break
                    if len(group) > 1:
                        found.append(sorted(group))
    return found


def room_of(module: str) -> str:
    """`control_plane.fleet.nodes` -> `fleet`; a top-level module -> `floor` or its name."""
    parts = module.split(".")
    if len(parts) == 1:
        return "floor"  # the package itself: its version
    if parts[1] in COMPOSITION:
        return "composition"
    if (CONTROL_PLANE / parts[1]).is_dir():
        return parts[1]
    return "floor"


def wrong_imports(graph: dict[str, set[str]]) -> list[str]:
    wrong = []
    for module, imported in sorted(graph.items()):
        room = room_of(module)
        for name in sorted(imported):
            target = room_of(name)
            if target == "floor" or room == "composition":
                continue
            if target == room and module not in LOW:  # a low module: the floor only
                continue
            if room in UPPER and (target in DOMAINS or name == "control_plane.context"):
                continue
            if room in DOMAINS and module not in LOW:
                if target in DOMAINS[room] or name in LOW:
                    continue
            wrong.append(f"{module} -> {name}")
    return wrong


def test_the_control_plane_has_no_import_circle() -> None:
    assert circles(control_plane_graph()) == []


def test_each_room_imports_only_what_lies_below_it() -> None:
    """The floor imports no room; a domain imports only the domains below it and scheduling's
    low modules; nothing below imports `api/`, `background/` or the composition."""
    assert wrong_imports(control_plane_graph()) == []


def test_the_rules_can_fail() -> None:
    """A circle and a domain reaching up are both named."""
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    graph = {
        "control_plane.fleet.nodes": {
            "control_plane.jobs.lifecycle",
            "control_plane.scheduling.dispatch",
        },
        "control_plane.scheduling.shapes": {"control_plane.fleet.nodes"},
        "control_plane.metrics": {"control_plane.fleet.nodes"},
        "control_plane.jobs.lifecycle": {"control_plane.api.jobs"},
    }
    assert wrong_imports(graph) == [
        "control_plane.fleet.nodes -> control_plane.jobs.lifecycle",
        "control_plane.jobs.lifecycle -> control_plane.api.jobs",
        "control_plane.metrics -> control_plane.fleet.nodes",
        "control_plane.scheduling.shapes -> control_plane.fleet.nodes",
    ]


def test_scheduling_low_modules_import_only_the_floor() -> None:
    """Not even the rest of scheduling: what any domain imports must not reach back up."""
    graph = {
        "control_plane.scheduling.dispatch": {
            "control_plane.clock",
            "control_plane.scheduling.scheduler",
        },
        "control_plane.scheduling.scheduler": {"control_plane.scheduling.dispatch"},
    }
    assert wrong_imports(graph) == [
        "control_plane.scheduling.dispatch -> control_plane.scheduling.scheduler"
    ]


def test_no_control_plane_file_is_over_500_lines() -> None:
    long = {
        str(path.relative_to(ROOT)): lines
        for path in CONTROL_PLANE.rglob("*.py")
        if "migrations" not in path.parts
        and (lines := len(path.read_text().splitlines())) > MAX_LINES
    }
    assert long == {}


def test_api_holds_no_query() -> None:
    """Routers are transport: no `select(`, `.execute(`, `.query(` or `.scalar(s)(` on a session."""
    queries = []
    for path in sorted((CONTROL_PLANE / "api").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if not isinstance(node, ast.Call):
                continue
            func = node.func
            name = (
                func.id
                if isinstance(func, ast.Name)
                else func.attr
                if isinstance(func, ast.Attribute)
                else ""
            )
            if name in {
                "select",
                "execute",
                "query",
                "scalar",
                "scalars",
                "insert",
                "update",
                "delete",
            } and (isinstance(func, ast.Name) or name != "delete"):
                queries.append(f"{path.relative_to(ROOT)}:{node.lineno} {name}(")
    assert queries == []
