"""The package's face: `from jaxserve import Engine, EngineLoop, SamplingParams, ServerArgs`, and the
README's research-code example on the tiny model."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def test_the_four_names_are_the_engines_own():
    import jaxserve
    from jaxserve import Engine, EngineLoop, SamplingParams, ServerArgs
    from jaxserve.core.sampling_params import SamplingParams as params_cls
    from jaxserve.engine.engine import Engine as engine_cls
    from jaxserve.engine.engine_loop import EngineLoop as loop_cls
    from jaxserve.server_args import ServerArgs as config_args

    assert (Engine, EngineLoop, SamplingParams, ServerArgs) == (engine_cls, loop_cls, params_cls, config_args)
    assert sorted(jaxserve.__all__) == ["Engine", "EngineLoop", "SamplingParams", "ServerArgs"]
    with pytest.raises(AttributeError, match="no attribute 'Engin'"):
        jaxserve.Engin  # noqa: B018


def test_importing_the_package_loads_no_jax():
    """`python -m jaxserve.launch --help` must answer before JAX loads: the names are imported lazily."""
    code = "import sys, jaxserve; assert 'jax' not in sys.modules, 'jax imported'; print(jaxserve.__version__)"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO)
    assert proc.returncode == 0, proc.stderr


def test_the_readme_research_example_runs(tiny_model_dir, capsys):
    """The README's in-process example, on the tiny model instead of the default one."""
    readme = (REPO / "README.md").read_text()
    block = next(b for b in re.findall(r"```python\n(.*?)```", readme, re.S) if "from jaxserve import Engine" in b)
    code = block.replace('model_path="default"', f"model_path={tiny_model_dir!r}, disable_precompile=True")
    assert code != block
    exec(compile(code, "README.md", "exec"), {})
    printed = capsys.readouterr().out.splitlines()
    assert len(printed) >= 2 and printed[-1].endswith("True")  # the last step output is a finished one
