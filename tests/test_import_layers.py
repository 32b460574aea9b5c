"""Imports go one way (docs/architecture.md, "Who may import whom"), and no module imports itself back.

Every `import` and `from ... import` statement of a jaxserve module counts, wherever it is: at the top,
inside a function (a lazy import) or under `if TYPE_CHECKING`. A layer is a subpackage of jaxserve
(`jaxserve/runner/...` is "runner") or a top-level module (`jaxserve/server_args.py` is "server_args");
`ALLOWED` says which other layers each may import. Every layer may import `core`, the shared types.
"""

from __future__ import annotations

import ast
import pathlib
from collections import defaultdict

PACKAGE_DIR = pathlib.Path(__file__).resolve().parent.parent / "jaxserve"

_BELOW_ENGINE = {"scheduler", "runner", "speculative", "constrained", "cache", "model", "pallas", "parallel", "quant"}
# layer -> the layers it may import (besides itself and core)
ALLOWED: dict[str, set[str]] = {
    "core": set(),
    "log_safe": set(),
    "pallas": set(),
    "parallel": set(),
    "quant": set(),
    "model": {"pallas", "parallel", "quant"},
    "cache": set(),
    "constrained": set(),
    "runner": {"model", "pallas", "parallel", "cache", "quant"},  # never scheduler
    "scheduler": {"cache"},
    "speculative": {"cache", "constrained"},
    "server_args": set(),  # the CLI's flags: nothing of model/ or cache/
    "engine": _BELOW_ENGINE | {"server_args"},
    "lang": {"engine", "model", "server_args"},  # or HTTP
    "server": _BELOW_ENGINE | {"engine", "server_args", "log_safe", "root"},
    "launch": _BELOW_ENGINE | {"engine", "server", "server_args", "log_safe"},
    "root": set(),  # jaxserve/__init__.py names its exports as strings and imports them on first use
}


def module_name(path: pathlib.Path, root: pathlib.Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def layer_of(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "root"


def import_graph(root: pathlib.Path, package: str = "jaxserve") -> dict[str, set[str]]:
    """module -> the package's modules it imports (every import statement, lazy ones included)."""
    paths = {module_name(p, root): p for p in sorted((root / package).rglob("*.py"))}
    graph: dict[str, set[str]] = defaultdict(set)

    def resolve(name: str) -> str | None:
        while name and name not in paths:
            name = name.rpartition(".")[0]
        return name or None

    for module, path in paths.items():
        is_package = path.name == "__init__.py"
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = module.split(".")[: len(module.split(".")) - node.level + (1 if is_package else 0)]
                    source = ".".join(base + ([node.module] if node.module else []))
                else:
                    source = node.module or ""
                # `from pkg import sub` imports the module pkg.sub; `from mod import name`, the module mod
                targets = [f"{source}.{a.name}" if f"{source}.{a.name}" in paths else source for a in node.names]
            for target in targets:
                if target.split(".")[0] == package and (found := resolve(target)) is not None and found != module:
                    graph[module].add(found)
    return graph


def layer_violations(graph: dict[str, set[str]], allowed: dict[str, set[str]]) -> list[str]:
    out = []
    for module, targets in sorted(graph.items()):
        mine = layer_of(module)
        for target in sorted(targets):
            theirs = layer_of(target)
            if theirs not in (mine, "core") and theirs not in allowed.get(mine, set()):
                out.append(f"{module} ({mine}) imports {target} ({theirs})")
    return out


def import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return cycles


def test_self_check_finds_an_upward_import_and_a_lazy_cycle(tmp_path):
    pkg = tmp_path / "jaxserve"
    for folder in ("core", "runner", "scheduler", "engine"):
        (pkg / folder).mkdir(parents=True)
        (pkg / folder / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text("")
    (pkg / "core" / "types.py").write_text("X = 1\n")
    (pkg / "engine" / "engine.py").write_text("from jaxserve.scheduler import queue\n")
    (pkg / "scheduler" / "queue.py").write_text("from jaxserve.core.types import X\nfrom jaxserve.runner import step\n")
    (pkg / "runner" / "step.py").write_text("def f():\n    from jaxserve.scheduler.queue import X  # lazy\n")
    graph = import_graph(tmp_path)
    assert layer_violations(graph, ALLOWED) == [
        "jaxserve.runner.step (runner) imports jaxserve.scheduler.queue (scheduler)",
        "jaxserve.scheduler.queue (scheduler) imports jaxserve.runner.step (runner)",
    ]
    assert import_cycles(graph) == [["jaxserve.runner.step", "jaxserve.scheduler.queue"]]


def test_every_layer_is_in_the_table():
    layers = {layer_of(m) for m in import_graph(PACKAGE_DIR.parent)} | {
        layer_of(module_name(p, PACKAGE_DIR.parent)) for p in PACKAGE_DIR.rglob("*.py")}
    assert layers <= set(ALLOWED), f"layers without a row in ALLOWED: {sorted(layers - set(ALLOWED))}"


def test_imports_go_one_way():
    violations = layer_violations(import_graph(PACKAGE_DIR.parent), ALLOWED)
    assert not violations, "imports against the layers:\n" + "\n".join(violations)


def test_no_import_cycles():
    cycles = import_cycles(import_graph(PACKAGE_DIR.parent))
    assert not cycles, "import cycles (lazy imports included):\n" + "\n".join(" <-> ".join(c) for c in cycles)
