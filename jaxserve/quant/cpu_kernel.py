"""The quantized matmul `quant_matmul(fmt, arrays, x)`: W @ x for a block-quantized W (formats.py) and
float32 activations x [I, T].

On CPU, for up to `KERNEL_MAX_TOKENS` tokens (8: decode and speculative verification), it calls the C++ kernel
quant_matmul.cc through `jax.ffi.ffi_call`: each weight block is decoded once per tile of tokens and the
weights are read once, compressed, instead of XLA:CPU converting an int8 or float16 weight to a float32 copy
at every step (D-47). For larger T (prefill), the same library decodes W to float32 (`dequantize`, at memory
speed, right before its use) and XLA's float32 GEMM multiplies it. On TPU, or where the kernel could not be
built, the XLA path dequantizes W (`formats.dequantize`) and runs a float32 dot. On a GPU, the Pallas kernel
(pallas_matmul.py) reads the blocks at every T.

The kernel is built at first use from the package's own source with the system C++ compiler (`c++`, or
`$CXX`) against jaxlib's FFI headers, into `$JAXSERVE_CACHE_DIR/kernels` (default `~/.cache/jaxserve`),
named by a hash of the source, the compiler and jaxlib's version, so a changed source or jax rebuilds and
later starts load it in milliseconds. No compiler, a failed build or `JAXSERVE_CPU_KERNEL=0` leaves the
XLA path, said once in the log (`kernel_status()`). The kernel runs AVX-512F code where the CPU has it, else
AVX2 + FMA + F16C, else a portable loop (`kernel_path()`); `JAXSERVE_CPU_KERNEL=avx2` or `=scalar` asks for a
narrower one (the tests run all three).
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import pathlib
import shutil
import subprocess
import tempfile
import threading

import jax
import jax.numpy as jnp
import jaxlib
from jaxtyping import Array, Float

from jaxserve.quant import formats
from jaxserve.quant.pallas_matmul import quant_matmul_pallas

logger = logging.getLogger(__name__)

SOURCE = pathlib.Path(__file__).with_name("quant_matmul.cc")
# T up to which the CPU kernel's tiles run, per format; above it the kernel's dequantize and XLA's dot (D-47:
# measured by benchmarks/quant/bench_quant_matmul.py --kernel-dequantize, where the tiles stop beating it)
KERNEL_MAX_TOKENS = {formats.Q8_0: 8, formats.Q4_1: 8, formats.Q5_0: 8}
_TARGETS = {fmt: f"jaxserve_quant_matmul_{fmt}" for fmt in formats.FORMATS}
_SYMBOLS = {fmt: f"JaxserveQuantMatmul{fmt.capitalize()}" for fmt in formats.FORMATS}
_DEQUANTIZE_TARGETS = {fmt: f"jaxserve_dequantize_{fmt}" for fmt in formats.FORMATS}
_DEQUANTIZE_SYMBOLS = {fmt: f"JaxserveDequantize{fmt.capitalize()}" for fmt in formats.FORMATS}
_lock = threading.Lock()
_status: str | None = None  # None: not tried yet; "ready" or why not
_path: str | None = None  # the code the kernel runs here: "AVX-512", "AVX2" or "scalar"
_PATH_NAMES = ("scalar", "AVX2", "AVX-512")  # JaxserveQuantMatmulPath's values


def _cache_dir() -> pathlib.Path:
    root = os.environ.get("JAXSERVE_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "jaxserve")
    return pathlib.Path(root) / "kernels"


def _compiler() -> str | None:
    return shutil.which(os.environ.get("CXX", "c++")) or shutil.which("g++") or shutil.which("clang++")


def build(compiler: str | None = None, cache_dir: pathlib.Path | None = None) -> pathlib.Path:
    """The kernel's shared library, compiled now unless the cache holds this source's build.

    Raises:
        RuntimeError: no C++ compiler, or the compile failed (with the compiler's message).
    """
    compiler = compiler or _compiler()
    if compiler is None:
        raise RuntimeError("no C++ compiler found (set CXX, or install g++)")
    source = SOURCE.read_bytes()
    try:
        version = subprocess.run([compiler, "--version"], capture_output=True, text=True).stdout.splitlines()[:1]
    except OSError as e:
        raise RuntimeError(f"the C++ compiler {compiler!r} does not run: {e}") from e
    key = hashlib.sha256(source + repr((version, jaxlib.__version__)).encode()).hexdigest()[:16]
    cache_dir = cache_dir or _cache_dir()
    target = cache_dir / f"quant_matmul-{key}.so"
    if target.exists():
        return target
    cache_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=cache_dir) as tmp:
        out = pathlib.Path(tmp) / target.name
        cmd = [compiler, "-O3", "-std=c++17", "-shared", "-fPIC",
               "-I", jax.ffi.include_dir(), str(SOURCE), "-o", str(out)]
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode != 0:
            raise RuntimeError(f"compiling {SOURCE.name} failed: {done.stderr.strip()[-2000:]}")
        os.replace(out, target)  # atomic: a concurrent start sees the whole file or none
    return target


def kernel_path() -> str | None:
    """The code the CPU kernel runs on this machine ("AVX-512", "AVX2" or "scalar"; None: no kernel), chosen
    at run time from the CPU's features and `JAXSERVE_CPU_KERNEL` (avx2 or scalar ask for a narrower one)."""
    return _path if kernel_status() == "ready" else None


def kernel_status() -> str:
    """"ready" once the CPU kernel is built and registered with XLA, else why the XLA path is used. The
    first call builds it (a few seconds, once per source and jax version) and logs one line."""
    global _status
    with _lock:
        if _status is None:
            _status = _load()
            if _status == "ready":
                bounds = ", ".join(f"{fmt} tiles up to {n} tokens" for fmt, n in KERNEL_MAX_TOKENS.items())
                logger.info("quantized matmul: the CPU kernel (jax.ffi, %s code) for %s", _path, bounds)
            else:
                logger.warning("quantized matmul: the XLA path only (%s)", _status)
        return _status


def _load() -> str:
    if os.environ.get("JAXSERVE_CPU_KERNEL", "1") == "0":
        return "JAXSERVE_CPU_KERNEL=0"
    global _path
    try:
        library = ctypes.cdll.LoadLibrary(str(build()))
        handlers = {_TARGETS[fmt]: getattr(library, symbol) for fmt, symbol in _SYMBOLS.items()}
        handlers |= {_DEQUANTIZE_TARGETS[fmt]: getattr(library, symbol) for fmt, symbol in _DEQUANTIZE_SYMBOLS.items()}
        _path = _PATH_NAMES[library.JaxserveQuantMatmulPath()]
    except (RuntimeError, OSError, AttributeError) as e:
        return str(e)
    for target, handler in handlers.items():
        jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(handler), platform="cpu")
    return "ready"


def _kernel_call(fmt: str, arrays: dict[str, Array], x: Float[Array, "I T"]) -> Float[Array, "O T"]:
    out_features, num_tokens = arrays["qs"].shape[0], x.shape[1]
    call = jax.ffi.ffi_call(
        _TARGETS[fmt], jax.ShapeDtypeStruct((out_features, num_tokens), jnp.float32), vmap_method="sequential"
    )
    xt = x.astype(jnp.float32).T  # [T, I]: each token's inputs contiguous
    return call(xt, *(arrays[name] for name in formats.FIELDS[fmt]))


def dequantize(fmt: str, arrays: dict[str, Array], in_features: int) -> Float[Array, "O I"]:
    """W [O, I] in float32 by the CPU kernel's decoder (requires `kernel_status() == "ready"`): the values of
    `formats.dequantize`, bit for bit, at memory speed on XLA's thread pool.

    Raises:
        RuntimeError: the kernel is not ready here (`kernel_status()` says why).
    """
    if (status := kernel_status()) != "ready":
        raise RuntimeError(f"the CPU kernel is not available: {status}")
    call = jax.ffi.ffi_call(
        _DEQUANTIZE_TARGETS[fmt], jax.ShapeDtypeStruct((arrays["qs"].shape[0], in_features), jnp.float32),
        vmap_method="sequential",
    )
    return call(*(arrays[name] for name in formats.FIELDS[fmt]))


def _dequantize_dot(fmt: str, arrays: dict[str, Array], x: Float[Array, "I T"]) -> Float[Array, "O T"]:
    # One weight in float32 at a time, decoded just before its dot, under XLA's memory-minimizing order
    # (runner/xla_cpu.py, D-49); XLA's concurrency-optimized order keeps a layer group's decoded weights alive
    # together (5 SmolLM2 layers: 71 MB against 7 MB) and ran 2-4x slower.
    return dequantize(fmt, arrays, x.shape[0]) @ x.astype(jnp.float32)


def xla_matmul(fmt: str, arrays: dict[str, Array], x: Float[Array, "I T"]) -> Float[Array, "O T"]:
    """The XLA path of `quant_matmul`: W dequantized (`formats.dequantize`), then a float32 dot."""
    return formats.dequantize(fmt, arrays) @ x.astype(jnp.float32)


def quant_matmul(fmt: str, arrays: dict[str, Array], x: Float[Array, "I T"]) -> Float[Array, "O T"]:
    """W @ x in float32 for W [O, I] in format `fmt` (`arrays`: its fields, formats.FIELDS) and x [I, T].

    On a GPU backend, the Pallas kernel (pallas_matmul.py). Else, where the CPU kernel is ready (on CPU only:
    other platforms lower the XLA path, `jax.lax.platform_dependent`), its tiles for
    T <= `KERNEL_MAX_TOKENS[fmt]` and its `dequantize` then XLA's dot above; else `xla_matmul`. All equal
    `formats.reference_matmul` up to float32 summation order.
    """
    if jax.default_backend() == "gpu":  # the Pallas kernel reads the blocks on the GPU at every T
        return quant_matmul_pallas(fmt, arrays, x)
    if kernel_status() != "ready":
        return xla_matmul(fmt, arrays, x)
    on_cpu = _kernel_call if x.shape[1] <= KERNEL_MAX_TOKENS[fmt] else _dequantize_dot
    return jax.lax.platform_dependent(
        arrays, x, cpu=functools.partial(on_cpu, fmt), default=functools.partial(xla_matmul, fmt)
    )
