"""The quantized matmul (jaxserve/quant/cpu_kernel.py): the C++ kernel through jax.ffi against the pure-jnp
reference `formats.reference_matmul`, under jit and vmap, and the XLA path where the kernel is not used."""

from __future__ import annotations

import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve.quant import cpu_kernel, formats

PACK = {formats.Q8_0: formats.pack_q8_0, formats.Q4_1: formats.pack_q4_1, formats.Q5_0: formats.pack_q5_0}


def _weight(fmt: str, rows: int = 72, cols: int = 320, seed: int = 0) -> dict[str, jax.Array]:
    """A block weight whose rows are not a multiple of the kernel's 32-row chunks, nor its inputs of 256."""
    rng = np.random.default_rng(seed)
    w = rng.standard_normal((rows, cols)).astype(np.float32) * rng.uniform(0.1, 3, (rows, 1)).astype(np.float32)
    return {k: jnp.asarray(v) for k, v in PACK[fmt](w).items()}


def _close(ours, arrays, fmt, x):
    """Equal to the reference up to float32 summation order: relative to the sum of |w x| per output."""
    ours = np.asarray(ours)
    ref = np.asarray(formats.reference_matmul(fmt, arrays, x))
    bound = np.abs(formats.dequantize_numpy(fmt, {k: np.asarray(v) for k, v in arrays.items()})) @ np.abs(np.asarray(x))
    assert ours.shape == ref.shape
    assert (np.abs(ours - ref) <= bound * 1e-5 + 1e-6).all(), np.abs(ours - ref).max()


def test_the_kernel_builds_here():
    """This machine has a C++ compiler: the kernel is the path CPU decode takes, not the fallback, with the
    widest code the CPU has."""
    assert cpu_kernel.kernel_status() == "ready"
    with open("/proc/cpuinfo") as f:
        flags = next(line for line in f if line.startswith("flags")).split()
    widest = "AVX-512" if "avx512f" in flags else "AVX2" if {"avx2", "fma", "f16c"} <= set(flags) else "scalar"
    assert cpu_kernel.kernel_path() == widest


@pytest.mark.parametrize("fmt", formats.FORMATS)
@pytest.mark.parametrize("num_tokens", [1, 2, 7, 8, 9, 16])
def test_kernel_equals_reference(fmt, num_tokens):
    arrays = _weight(fmt)
    x = jax.random.normal(jax.random.key(num_tokens), (320, num_tokens), jnp.float32)
    _close(jax.jit(cpu_kernel.quant_matmul, static_argnums=0)(fmt, arrays, x), arrays, fmt, x)


@pytest.mark.parametrize("fmt", formats.FORMATS)
def test_integer_part_is_bit_exact(fmt):
    """With one-hot activations the kernel returns single dequantized weights: each equals the
    reference's dequantization bit for bit (the decode of the integer blocks, the scale and the min)."""
    arrays = _weight(fmt, rows=40, cols=64)
    columns = np.array([0, 1, 15, 16, 17, 31, 32, 63])
    x = jnp.asarray(np.eye(64, dtype=np.float32)[:, columns])
    ours = np.asarray(jax.jit(cpu_kernel.quant_matmul, static_argnums=0)(fmt, arrays, x))
    np.testing.assert_array_equal(ours, np.asarray(formats.dequantize(fmt, arrays))[:, columns])


@pytest.mark.parametrize("fmt", formats.FORMATS)
def test_kernel_dequantize_is_the_references_bit_for_bit(fmt):
    """Above the tiles' bound the kernel decodes W to float32 for XLA's dot: the same values as the numpy
    reference's dequantization, under jit, with rows that are no multiple of the 32-row chunks."""
    arrays = _weight(fmt, rows=72, cols=320)
    ours = jax.jit(cpu_kernel.dequantize, static_argnums=(0, 2))(fmt, arrays, 320)
    expected = formats.dequantize_numpy(fmt, {k: np.asarray(v) for k, v in arrays.items()})
    np.testing.assert_array_equal(np.asarray(ours), expected)


@pytest.mark.parametrize("fmt", formats.FORMATS)
def test_vmap_and_large_t(fmt):
    """vmap over a batch of activations (the call's `vmap_method`), T above the tiles' bound (the kernel's
    dequantize, then XLA's dot) and the XLA path give the reference too."""
    arrays = _weight(fmt, rows=64, cols=256)
    xs = jax.random.normal(jax.random.key(1), (3, 256, 4), jnp.float32)
    ours = jax.jit(jax.vmap(lambda x: cpu_kernel.quant_matmul(fmt, arrays, x)))(xs)
    for i in range(3):
        _close(ours[i], arrays, fmt, xs[i])
    big = jax.random.normal(jax.random.key(2), (256, cpu_kernel.KERNEL_MAX_TOKENS[fmt] + 1), jnp.float32)
    _close(cpu_kernel.quant_matmul(fmt, arrays, big), arrays, fmt, big)
    _close(cpu_kernel.xla_matmul(fmt, arrays, big[:, :3]), arrays, fmt, big[:, :3])


def test_bfloat16_activations_are_taken():
    arrays = _weight(formats.Q4_1, rows=32, cols=64)
    x = jax.random.normal(jax.random.key(3), (64, 2), jnp.float32).astype(jnp.bfloat16)
    _close(cpu_kernel.quant_matmul(formats.Q4_1, arrays, x), arrays, formats.Q4_1, x.astype(jnp.float32))


def test_disabled_kernel_runs_the_xla_path_and_says_so():
    """`JAXSERVE_CPU_KERNEL=0` (as no compiler would) leaves the XLA path, with the reason logged once."""
    code = (
        "import logging, jax, jax.numpy as jnp, numpy as np\n"
        "logging.basicConfig(level=logging.INFO)\n"
        "from jaxserve.quant import cpu_kernel, formats\n"
        "a = {k: jnp.asarray(v) for k, v in formats.pack_q8_0(np.full((32, 64), 127.0, np.float32)).items()}\n"
        "y = cpu_kernel.quant_matmul('q8_0', a, jnp.ones((64, 1)))\n"
        "print(cpu_kernel.kernel_status(), float(y[0, 0]))\n"
    )
    env = {**os.environ, "JAXSERVE_CPU_KERNEL": "0"}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["JAXSERVE_CPU_KERNEL=0", "8128.0"]
    assert done.stderr.count("the XLA path only (JAXSERVE_CPU_KERNEL=0)") == 1


def test_build_failures_are_errors_with_the_compilers_words(tmp_path):
    with pytest.raises(RuntimeError, match="does not run"):
        cpu_kernel.build(compiler=str(tmp_path / "no-such-c++"), cache_dir=tmp_path)
    failing = tmp_path / "failing-c++"
    failing.write_text("#!/bin/sh\necho 'fatal: no such header' >&2\nexit 1\n")
    failing.chmod(0o755)
    with pytest.raises(RuntimeError, match="fatal: no such header"):
        cpu_kernel.build(compiler=str(failing), cache_dir=tmp_path)
    assert not list(tmp_path.glob("*.so"))


@pytest.mark.parametrize("fmt", formats.FORMATS)
def test_a_tokens_result_does_not_depend_on_its_batch(fmt):
    """Each token's sums run in one order whatever T and its place in a tile (D-11's invariance): a token
    alone and in a batch as large as the tiles take give the same bits."""
    arrays = _weight(fmt)
    xs = jax.random.normal(jax.random.key(4), (320, cpu_kernel.KERNEL_MAX_TOKENS[fmt]), jnp.float32)
    matmul = jax.jit(cpu_kernel.quant_matmul, static_argnums=0)
    batched = np.asarray(matmul(fmt, arrays, xs))
    for t in (0, 3, xs.shape[1] - 1):
        np.testing.assert_array_equal(np.asarray(matmul(fmt, arrays, xs[:, t : t + 1]))[:, 0], batched[:, t])


@pytest.mark.parametrize("path, name", [("scalar", "scalar"), ("avx2", "AVX2")])
def test_narrower_paths_equal_reference(path, name):
    """`JAXSERVE_CPU_KERNEL=scalar` (the portable loop a CPU without AVX2 runs) and `=avx2` (what a CPU without
    AVX-512 runs), against the reference for every format and token counts around the tile (in a fresh
    process: the choice is made once)."""
    code = (
        "import jax, jax.numpy as jnp, numpy as np\n"
        "from jaxserve.quant import cpu_kernel, formats\n"
        f"assert cpu_kernel.kernel_status() == 'ready' and cpu_kernel.kernel_path() == {name!r}\n"
        "rng = np.random.default_rng(0)\n"
        "w = rng.standard_normal((40, 96), dtype=np.float32)\n"
        "for fmt, pack in [('q8_0', formats.pack_q8_0), ('q4_1', formats.pack_q4_1), ('q5_0', formats.pack_q5_0)]:\n"
        "    a = {k: jnp.asarray(v) for k, v in pack(w).items()}\n"
        "    for t in (1, 5, 9):\n"
        "        x = jnp.asarray(rng.standard_normal((96, t), dtype=np.float32))\n"
        "        ours = np.asarray(jax.jit(cpu_kernel.quant_matmul, static_argnums=0)(fmt, a, x))\n"
        "        ref = np.asarray(formats.reference_matmul(fmt, a, x))\n"
        "        bound = np.abs(formats.dequantize_numpy(fmt, {k: np.asarray(v) for k, v in a.items()})) @ np.abs(np.asarray(x))\n"
        "        assert (np.abs(ours - ref) <= bound * 1e-5 + 1e-6).all(), (fmt, t, np.abs(ours - ref).max())\n"
        "    w_ours = np.asarray(cpu_kernel.dequantize(fmt, a, 96))\n"
        "    assert np.array_equal(w_ours, formats.dequantize_numpy(fmt, {k: np.asarray(v) for k, v in a.items()})), fmt\n"
        "print('ok')\n"
    )
    env = {**os.environ, "JAXSERVE_CPU_KERNEL": path}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-2000:]
