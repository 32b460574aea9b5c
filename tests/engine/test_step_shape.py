"""The engine's step reads as schedule -> launch -> read -> process, and no other module drives it.

A step of every kind (plain, overlapped, verifying drafts) goes through `Engine.step` and the one
`OutputProcessor`; the behaviour is tested in test_engine.py, test_overlap_schedule.py and
tests/speculative/. These checks keep the shape: `Engine.step` fits on one screen (at most 15 lines,
signature and docstring included), and no module but the engine's own imports `Engine` to call it.
"""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

from jaxserve.engine.engine import Engine

PACKAGE = Path(__file__).resolve().parents[2] / "jaxserve"
MAX_STEP_LINES = 15


def test_engine_step_fits_on_one_screen():
    lines = inspect.getsource(Engine.step).rstrip("\n").splitlines()
    assert len(lines) <= MAX_STEP_LINES, "\n".join(lines)


def importers_of_engine(root: Path) -> list[str]:
    """Modules under `root` that import `Engine` from jaxserve.engine.engine, but for the engine's
    thread (engine_loop.py) and the frontend language's in-process backend, which call its public API."""
    found = []
    for path in sorted(root.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module == "jaxserve.engine.engine":
                if any(a.name == "Engine" for a in node.names):
                    found.append(str(path.relative_to(root)))
    return found


def test_no_step_module_drives_the_engine(tmp_path):
    users = set(importers_of_engine(PACKAGE))
    drivers = {u for u in users if u.startswith(("engine/", "speculative/", "scheduler/", "runner/"))}
    assert drivers <= {"engine/engine_loop.py", "engine/engine_load.py"}, sorted(drivers)
    # the check can fail: a module of the step that imports Engine is found
    (tmp_path / "speculative").mkdir()
    (tmp_path / "speculative" / "verify.py").write_text("from jaxserve.engine.engine import Engine\n")
    assert importers_of_engine(tmp_path) == ["speculative/verify.py"]
