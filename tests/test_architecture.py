"""The house rules (issue 29), read from the source: no import circles, no module over 400
lines in ``ring_sp/`` and ``integrations/``, a docstring on every package, the planner below
the runtime.

Every import statement between project files counts, wherever it stands (module level or
inside a function) and ``__init__`` re-exports too; ``from pkg import name`` is an edge to
``pkg.name`` when that is a module of the project, else to ``pkg``.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
FOLDERS = ("ring_sp", "integrations", "benchmarks")
MAX_LINES = 400
# the runtime: what runs attention on process groups; the planner imports none of it
RUNTIME = ("ring_sp.attention", "ring_sp.ring", "ring_sp.ulysses", "ring_sp.function", "ring_sp.comm",
           "ring_sp.kernels", "ring_sp.module", "ring_sp.agreement", "ring_sp.topology", "ring_sp.recompute",
           "ring_sp.offload", "ring_sp.integrations")


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[0] == "integrations":  # installed as ring_sp.integrations (setup.py's package_dir)
        parts.insert(0, "ring_sp")
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def project_modules() -> dict[str, Path]:
    return {_module_name(p): p for folder in FOLDERS for p in sorted((ROOT / folder).rglob("*.py"))}


def _imported(node: ast.Import | ast.ImportFrom, module: str, is_package: bool, modules: dict[str, Path]) -> set[str]:
    """The project modules one import statement reaches."""
    def known(name: str) -> str | None:  # the longest prefix that is a project module
        parts = name.split(".")
        for end in range(len(parts), 0, -1):
            if ".".join(parts[:end]) in modules:
                return ".".join(parts[:end])
        return None

    if isinstance(node, ast.Import):
        return {m for m in (known(alias.name) for alias in node.names) if m}
    if node.level:
        package = module.split(".") if is_package else module.split(".")[:-1]
        base = ".".join(package[:len(package) - node.level + 1])
        source = base + ("." + node.module if node.module else "")
    else:
        source = node.module or ""
    found = set()
    for alias in node.names:
        target = f"{source}.{alias.name}"
        found.add(target if target in modules else known(source))
    return {m for m in found if m}


def import_graph() -> dict[str, set[str]]:
    modules = project_modules()
    graph = {}
    for name, path in modules.items():
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        edges: set[str] = set()
        for node in ast.walk(tree):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                edges |= _imported(node, name, path.name == "__init__.py", modules)
        graph[name] = edges - {name}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def test_the_cycle_finder_finds_circles():
    """A negative control: the finder reports a two-module and a three-module loop."""
    graph = {"a": {"b"}, "b": {"a"}, "c": {"d"}, "d": {"e"}, "e": {"c", "a"}, "f": set()}
    assert sorted(cycles(graph)) == [["a", "b"], ["c", "d", "e"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_the_graph_sees_deferred_and_relative_imports():
    graph = import_graph()
    assert "ring_sp.plan.exchange_choice" in graph["ring_sp.attention"]  # a top-level relative import
    assert "ring_sp.plan.step_memory" in graph["ring_sp.plan.cli"]  # `from . import step_memory as sm`
    assert "ring_sp.integrations.versions" in graph["ring_sp.integrations.deepspeed.engine"]


def test_no_import_circles():
    found = cycles(import_graph())
    assert not found, "import circles (each list imports itself around): " + "; ".join(" <-> ".join(c) for c in found)


def reachable(graph: dict[str, set[str]], start: str) -> set[str]:
    """Every module ``start`` imports, directly or through others."""
    seen, todo = set(), [start]
    while todo:
        for target in graph[todo.pop()] - seen:
            seen.add(target)
            todo.append(target)
    return seen


def test_the_planner_imports_no_runtime():
    """The cost model sits below the runtime: nothing it reaches, even indirectly, runs attention."""
    graph = import_graph()
    planner = [m for m in graph if m == "ring_sp.plan" or m.startswith("ring_sp.plan.")]
    assert len(planner) >= 5
    bad = {m: sorted(t for t in reachable(graph, m) if t.startswith(RUNTIME)) for m in planner}
    assert not any(bad.values()), f"planner modules reaching the runtime: {bad}"
    assert "ring_sp.attention" in reachable(graph, "ring_sp.module")  # the check can see a real path


@pytest.mark.parametrize("folder", ["ring_sp", "integrations"])
def test_no_module_over_400_lines(folder):
    sizes = {str(p.relative_to(ROOT)): len(p.read_text(encoding="utf-8").splitlines())
             for p in (ROOT / folder).rglob("*.py")}
    assert sizes, folder
    too_long = {p: n for p, n in sizes.items() if n > MAX_LINES}
    assert not too_long, f"modules over {MAX_LINES} lines: {too_long}"


def test_every_package_says_its_job():
    packages = [p for folder in FOLDERS for p in (ROOT / folder).rglob("__init__.py")]
    assert len(packages) >= 6
    missing = [str(p.relative_to(ROOT)) for p in packages
               if len((ast.get_docstring(ast.parse(p.read_text(encoding="utf-8"))) or "").split()) < 12]
    assert not missing, f"packages without a docstring naming their job: {missing}"
