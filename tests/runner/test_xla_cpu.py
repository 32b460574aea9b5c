"""XLA:CPU's scheduler flag (jaxserve/runner/xla_cpu.py, D-49): set on import before JAX starts, a user's
choice left alone, and in effect: a program's independent temporaries no longer stay alive together."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from jaxserve.runner.xla_cpu import SCHEDULER_FLAG, configure_scheduler


def test_appends_the_flag_to_xla_flags():
    environ = {"XLA_FLAGS": "--xla_force_host_platform_device_count=2"}
    assert configure_scheduler(environ)
    assert environ["XLA_FLAGS"] == f"--xla_force_host_platform_device_count=2 --{SCHEDULER_FLAG}=false"
    assert not configure_scheduler(environ)  # once
    assert environ["XLA_FLAGS"].count(SCHEDULER_FLAG) == 1
    empty: dict[str, str] = {}
    assert configure_scheduler(empty) and empty == {"XLA_FLAGS": f"--{SCHEDULER_FLAG}=false"}


def test_leaves_a_users_choice_alone():
    environ = {"XLA_FLAGS": f"--{SCHEDULER_FLAG}=true"}
    assert not configure_scheduler(environ)
    assert environ == {"XLA_FLAGS": f"--{SCHEDULER_FLAG}=true"}


# Eight independent [512, 512] products, each reduced: XLA's memory-minimizing order keeps about one product
# alive at a time, the concurrency-optimized order all eight (1 MiB each).
_PROGRAM = (
    "import {module}, jax, jax.numpy as jnp\n"
    "def f(xs):\n"
    "    return sum(jnp.sum(jnp.sin(x @ x)) for x in xs)\n"
    "xs = [jnp.full((512, 512), i, jnp.float32) for i in range(8)]\n"
    "print(jax.jit(f).lower(xs).compile().memory_analysis().temp_size_in_bytes)\n"
)


def _temp_bytes(module: str, xla_flags: str | None) -> int:
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env.update(JAX_PLATFORMS="cpu", PYTHONPATH=str(Path(__file__).resolve().parents[2]))
    if xla_flags is not None:
        env["XLA_FLAGS"] = xla_flags
    out = subprocess.run([sys.executable, "-c", _PROGRAM.format(module=module)], env=env, capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    return int(out.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("module", ["jaxserve.engine.engine", "jaxserve.runner.model_runner"])
def test_importing_jaxserve_sets_the_scheduler_before_jax_starts(module):
    ours = _temp_bytes(module, None)
    xla_default = _temp_bytes("os", None)
    users = _temp_bytes(module, f"--{SCHEDULER_FLAG}=true")
    assert users == xla_default  # the user's flag wins
    assert ours * 3 < xla_default, (ours, xla_default)
