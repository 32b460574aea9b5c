"""XLA:CPU's thread pool for forced host devices: NPROC set from the device count the environment asks for."""

from __future__ import annotations

import pytest

from jaxserve.parallel.host_devices import configure_cpu_thread_pool, requested_cpu_devices


@pytest.mark.parametrize("environ, expected", [
    ({}, 1),
    ({"JAX_NUM_CPU_DEVICES": "3"}, 3),
    ({"XLA_FLAGS": "--xla_cpu_multi_thread_eigen=false --xla_force_host_platform_device_count=4"}, 4),
    ({"JAX_NUM_CPU_DEVICES": "2", "XLA_FLAGS": "--xla_force_host_platform_device_count=8"}, 2),
    ({"JAX_NUM_CPU_DEVICES": "-1"}, 1),  # jax's "unset"
])
def test_requested_cpu_devices(environ, expected):
    assert requested_cpu_devices(environ) == expected


def test_pool_gets_twice_the_devices_on_few_cores():
    environ = {"JAX_NUM_CPU_DEVICES": "3"}
    assert configure_cpu_thread_pool(environ, cpu_count=2) == 6
    assert environ["NPROC"] == "6"


def test_pool_never_below_the_cores():
    environ = {"XLA_FLAGS": "--xla_force_host_platform_device_count=2"}
    assert configure_cpu_thread_pool(environ, cpu_count=16) == 16 and environ["NPROC"] == "16"


@pytest.mark.parametrize("environ", [{}, {"JAX_NUM_CPU_DEVICES": "1"}, {"JAX_NUM_CPU_DEVICES": "3", "NPROC": "3"}])
def test_leaves_one_device_and_a_users_nproc_alone(environ):
    before = dict(environ)
    assert configure_cpu_thread_pool(environ, cpu_count=2) is None
    assert environ == before


def test_engine_import_sizes_xla_pool_before_jax_starts():
    import os
    import subprocess
    import sys
    from pathlib import Path

    if not Path("/proc/self/task").exists():
        pytest.skip("counts threads through /proc (Linux)")
    code = (
        "import jaxserve.engine.engine, os, jax.numpy as jnp\n"
        "(jnp.ones((256, 256)) @ jnp.ones((256, 256))).block_until_ready()\n"
        "print(sum(open(f'/proc/self/task/{t}/comm').read().strip() == 'tf_XLAEigen' for t in os.listdir('/proc/self/task')))\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "NPROC"}
    env.update(JAX_PLATFORMS="cpu", JAX_NUM_CPU_DEVICES="3", PYTHONPATH=str(Path(__file__).resolve().parents[2]))
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert int(out.stdout.strip().splitlines()[-1]) == max(os.cpu_count() or 1, 6)
