"""No module of jaxserve reads another module's private names.

A private name (one leading underscore, not a dunder) belongs to the module
that defines it. A module that reads `obj._name`, where `_name` is defined
only in other jaxserve modules, is reaching into their internals: the name
should be made public, or the code moved home. Private names that no
jaxserve module defines (`os._exit`, `sys._getframe`, a library's own
privates) are not ours and are not flagged.
"""

import ast
import pathlib
from collections import defaultdict
from typing import NamedTuple

PACKAGE_DIR = pathlib.Path(__file__).resolve().parent.parent / "jaxserve"

# The public API of namedtuples, private-looking to keep clear of field names.
NAMEDTUPLE_API = frozenset({"_replace", "_asdict", "_fields", "_make", "_field_defaults"})


class Finding(NamedTuple):
    """One read of another module's private name."""

    path: str
    line: int
    text: str  # `obj._name`, or `from x import _name`
    defined_in: tuple[str, ...]  # the modules that define the name

    def __str__(self) -> str:
        return f"{self.path}:{self.line} {self.text} (defined in {', '.join(self.defined_in)})"


def is_private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__") and name not in NAMEDTUPLE_API


def _target_names(target: ast.AST) -> list[str]:
    if isinstance(target, ast.Name):
        return [target.id]
    if isinstance(target, (ast.Tuple, ast.List)):
        return [n for elt in target.elts for n in _target_names(elt)]
    if isinstance(target, ast.Starred):
        return _target_names(target.value)
    return []


def defined_names(tree: ast.Module) -> set[str]:
    """Names a module defines: functions, classes, methods, module globals,
    class-level assignments (dataclass fields included), import aliases,
    `self._name = ...` / `cls._name = ...` and `object.__setattr__(self, "_name", ...)`.
    """
    names: set[str] = set()

    def visit_body(body: list[ast.stmt], names_count: bool) -> None:
        # names_count: a plain `name = ...` here is a module global or a class
        # attribute (True), or a function's local variable (False).
        for stmt in body:
            visit_stmt(stmt, names_count)

    def visit_stmt(stmt: ast.stmt, names_count: bool) -> None:
        if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef)):
            names.add(stmt.name)
            visit_body(stmt.body, names_count=False)
            return
        if isinstance(stmt, ast.ClassDef):
            names.add(stmt.name)
            visit_body(stmt.body, names_count=True)
            return
        if isinstance(stmt, (ast.Import, ast.ImportFrom)):
            for alias in stmt.names:
                # `from x import _name` defines nothing here: it is x's name (and a finding).
                if alias.asname is not None or not is_private(alias.name):
                    names.add((alias.asname or alias.name).split(".")[0])
        if names_count:
            if isinstance(stmt, ast.Assign):
                for target in stmt.targets:
                    names.update(_target_names(target))
            elif isinstance(stmt, (ast.AnnAssign, ast.AugAssign, ast.For, ast.AsyncFor)):
                names.update(_target_names(stmt.target))
            elif isinstance(stmt, (ast.With, ast.AsyncWith)):
                for item in stmt.items:
                    if item.optional_vars is not None:
                        names.update(_target_names(item.optional_vars))
        for node in ast.walk(stmt):
            if (
                isinstance(node, ast.Attribute)
                and isinstance(node.ctx, ast.Store)
                and isinstance(node.value, ast.Name)
                and node.value.id in ("self", "cls")
            ):
                names.add(node.attr)
            elif (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Attribute)
                and node.func.attr == "__setattr__"
                and len(node.args) >= 2
                and isinstance(node.args[1], ast.Constant)
                and isinstance(node.args[1].value, str)
            ):
                names.add(node.args[1].value)
            elif isinstance(node, (ast.Assign, ast.AnnAssign)):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                if any(isinstance(t, ast.Name) and t.id == "__slots__" for t in targets):
                    for const in ast.walk(node.value) if node.value is not None else ():
                        if isinstance(const, ast.Constant) and isinstance(const.value, str):
                            names.add(const.value)
        for child in ast.iter_child_nodes(stmt):
            # Blocks nested in if/try/with/for keep the scope they are in.
            if isinstance(child, ast.stmt):
                visit_stmt(child, names_count)
            elif isinstance(child, ast.excepthandler):
                visit_body(child.body, names_count)

    visit_body(tree.body, names_count=True)
    return names


def _is_package_import(node: ast.ImportFrom, package: str) -> bool:
    return node.level > 0 or (node.module or "").split(".")[0] == package


def find_private_reads(sources: dict[str, str], package: str = "jaxserve") -> list[Finding]:
    """Reads of private names defined only in other modules.

    sources maps a module's path to its text. Flags `obj._name` (read, written
    or deleted), `getattr(obj, "_name")`-style calls and `from x import _name`
    of a package module, where `_name` is defined in some other module of
    `sources` but not in the module that uses it.
    """
    trees = {path: ast.parse(text, filename=path) for path, text in sources.items()}
    defined = {path: defined_names(tree) for path, tree in trees.items()}
    definers: dict[str, list[str]] = defaultdict(list)
    for path, names in defined.items():
        for name in names:
            definers[name].append(path)

    def other_definers(name: str, path: str) -> tuple[str, ...]:
        return tuple(sorted(p for p in definers.get(name, ()) if p != path))

    findings = []
    for path, tree in trees.items():
        reads = []  # (name, line, text) of attribute-style uses
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute):
                reads.append((node.attr, node.lineno, f"{ast.unparse(node.value)}.{node.attr}"))
            elif (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Name)
                and node.func.id in ("getattr", "setattr", "hasattr", "delattr")
                and len(node.args) >= 2
                and isinstance(node.args[1], ast.Constant)
                and isinstance(node.args[1].value, str)
            ):
                name = node.args[1].value
                reads.append((name, node.lineno, f"{node.func.id}({ast.unparse(node.args[0])}, {name!r})"))
            elif isinstance(node, ast.ImportFrom) and _is_package_import(node, package):
                module = "." * node.level + (node.module or "")
                for alias in node.names:
                    if is_private(alias.name):
                        others = other_definers(alias.name, path) or ("?",)
                        findings.append(Finding(path, node.lineno, f"from {module} import {alias.name}", others))
        for name, line, text in reads:
            if is_private(name) and name not in defined[path]:
                others = other_definers(name, path)
                if others:
                    findings.append(Finding(path, line, text, others))
    return sorted(findings)


def package_sources() -> dict[str, str]:
    root = PACKAGE_DIR.parent
    return {str(p.relative_to(root)): p.read_text() for p in sorted(PACKAGE_DIR.rglob("*.py"))}


def test_self_check_flags_a_foreign_private_read():
    sources = {
        "pkg/tree.py": (
            "import collections\n"
            "class Tree:\n"
            "    _limit = 3\n"
            "    def __init__(self):\n"
            "        self._root = None\n"
            "    def _walk(self):\n"
            "        return self._root, self._limit\n"
            "def _helper():\n"
            "    pass\n"
        ),
        "pkg/helper.py": (
            "import os, sys\n"
            "from pkg.tree import _helper\n"
            "from pkg.tree import Tree\n"
            "def check(tree, point):\n"
            "    tree._walk()\n"
            "    tree._root = None\n"
            "    n = getattr(tree, '_limit')\n"
            "    point._replace(x=1)\n"
            "    os._exit(0)\n"
            "    return sys._getframe()\n"
        ),
        "pkg/own.py": (
            "class Own:\n"
            "    def __init__(self):\n"
            "        self._root = 1\n"
            "    def get(self, other):\n"
            "        return other._root\n"
        ),
    }
    findings = find_private_reads(sources, package="pkg")
    texts = [(f.path, f.line, f.text, f.defined_in) for f in findings]
    assert texts == [
        ("pkg/helper.py", 2, "from pkg.tree import _helper", ("pkg/tree.py",)),
        ("pkg/helper.py", 5, "tree._walk", ("pkg/tree.py",)),
        ("pkg/helper.py", 6, "tree._root", ("pkg/own.py", "pkg/tree.py")),
        ("pkg/helper.py", 7, "getattr(tree, '_limit')", ("pkg/tree.py",)),
    ]


def test_no_module_reads_another_modules_private_names():
    findings = find_private_reads(package_sources())
    assert not findings, "private names read outside the module that defines them:\n" + "\n".join(
        str(f) for f in findings
    )
