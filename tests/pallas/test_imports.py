"""Imports go one way, model -> pallas: the attention package imports nothing of ours but config."""

import ast
import pathlib

PALLAS_DIR = pathlib.Path(__file__).resolve().parents[2] / "jaxserve" / "pallas"


def test_pallas_imports_only_itself_and_config():
    offending = []
    for path in sorted(PALLAS_DIR.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.Import):
                modules = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0:
                modules = [node.module or ""]
            else:
                continue
            for module in modules:
                parts = module.split(".")
                if parts[0] == "jaxserve" and parts[1:2] not in (["pallas"], ["config"]):
                    offending.append(f"{path.name}:{node.lineno} imports {module}")
    assert not offending, "\n".join(offending)
