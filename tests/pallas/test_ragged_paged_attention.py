"""The Pallas ragged paged attention kernel against the XLA path and a brute-force numpy reference.

Interpret mode on CPU. Interpret mode initialises kernel outputs with NaN (`uninitialized_value` in
jax/_src/pallas/hlo_interpreter.py; checked below), so a row the kernel never writes stays NaN and
fails the finiteness check. Pages no sequence owns and the other layer of the pool are NaN too, so a
read of a wrong page or layer shows up in the output.
"""

from __future__ import annotations

import functools
import logging
import os
import re
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from jax._src.lib import version as _jaxlib_version

from jaxserve.pallas import ATTENTION_BACKENDS, get_attention_backend
from jaxserve.pallas.metadata import AttentionMetadata, build_attention_metadata, num_blocks_for
from jaxserve.pallas.ragged_paged_attention import ragged_paged_attention
from jaxserve.pallas.reference import ragged_paged_attention_xla

NUM_LAYERS = 2
NUM_KV_HEADS = 2
TOLERANCE = {"float32": 1e-5, "bfloat16": 2e-2}

_pallas = jax.jit(ragged_paged_attention, static_argnames=("sm_scale", "interpret", "logit_softcap"))
_xla = jax.jit(ragged_paged_attention_xla, static_argnames=("sm_scale", "kv_block", "logit_softcap"))


def _pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def _make_batch(seqs, *, page_size, group, head_dim, dtype, block_q, seed, layer=1):
    """Random pool, queries and metadata for `seqs` = [(prefix_len, extend_len), ...].

    Returns (q, k_pool, v_pool, layer, host_meta, per-sequence contiguous (k, v) as float64).
    """
    rng = np.random.default_rng(seed)
    num_heads = NUM_KV_HEADS * group
    pages_needed = [-(-(pre + ext) // page_size) for pre, ext in seqs]
    num_pages = _pow2(sum(pages_needed) + 2)  # page 0 dummy, at least one page nobody owns
    owner = rng.permutation(np.arange(1, num_pages))
    page_tables, start = [], 0
    for n in pages_needed:
        page_tables.append(owner[start : start + n].tolist())
        start += n

    def rand(*shape):
        return np.asarray(jnp.asarray(rng.standard_normal(shape), dtype).astype(jnp.float32), np.float64)

    shape = (NUM_LAYERS, num_pages, NUM_KV_HEADS, page_size, head_dim)
    k_pool = np.full(shape, np.nan)
    v_pool = np.full(shape, np.nan)
    k_pool[layer, 0] = rand(NUM_KV_HEADS, page_size, head_dim)  # the dummy page is finite
    v_pool[layer, 0] = rand(NUM_KV_HEADS, page_size, head_dim)
    seq_kv = []
    for (pre, ext), pages in zip(seqs, page_tables):
        # Whole pages are finite: slots past the sequence's length are read (masked) by both paths.
        k = rand(len(pages) * page_size, NUM_KV_HEADS, head_dim)
        v = rand(len(pages) * page_size, NUM_KV_HEADS, head_dim)
        # token-major [tokens, KVH, D] -> pages [n, KVH, page_size, D], the pool's layout
        k_pool[layer, pages] = k.reshape(len(pages), page_size, NUM_KV_HEADS, head_dim).transpose(0, 2, 1, 3)
        v_pool[layer, pages] = v.reshape(len(pages), page_size, NUM_KV_HEADS, head_dim).transpose(0, 2, 1, 3)
        seq_kv.append((k[: pre + ext], v[: pre + ext]))

    num_new = sum(ext for _, ext in seqs)
    num_tokens = max(16, _pow2(num_new))
    q = rand(num_tokens, num_heads, head_dim)
    meta = build_attention_metadata(
        [ext for _, ext in seqs],
        [pre for pre, _ in seqs],
        page_tables,
        num_tokens=num_tokens,
        num_seqs=8,
        pages_per_seq=_pow2(max(pages_needed)),
        block_q=block_q,
    )
    as_dtype = lambda x: jnp.asarray(x, dtype)  # noqa: E731
    return as_dtype(q), as_dtype(k_pool), as_dtype(v_pool), jnp.int32(layer), meta, seq_kv


def _numpy_attention(q, seqs, seq_kv, sm_scale, window=None, softcap=None):
    """Brute force in float64: each sequence's new tokens attend causally to its contiguous K/V (only
    to the last `window` positions up to their own, with `window`; scores soft-capped with `softcap`)."""
    q = np.asarray(jnp.asarray(q, jnp.float32), np.float64)
    num_heads = q.shape[1]
    out, t = [], 0
    for (pre, ext), (k, v) in zip(seqs, seq_kv):
        group = num_heads // k.shape[1]
        k = np.repeat(k, group, axis=1)
        v = np.repeat(v, group, axis=1)
        scores = np.einsum("qhd,khd->hqk", q[t : t + ext], k) * sm_scale
        if softcap is not None:
            scores = softcap * np.tanh(scores / softcap)
        q_pos = pre + np.arange(ext)[None, :, None]
        kv_pos = np.arange(pre + ext)[None, None, :]
        visible = (kv_pos <= q_pos) & (kv_pos > q_pos - (window or np.inf))
        scores = np.where(visible, scores, -np.inf)
        probs = np.exp(scores - scores.max(-1, keepdims=True))
        probs /= probs.sum(-1, keepdims=True)
        out.append(np.einsum("hqk,khd->qhd", probs, v))
        t += ext
    return np.concatenate(out)


def _assert_in_range(k_pool, layer, meta) -> None:
    # Interpret mode clamps out-of-range indices silently; the GPU would fault.
    assert 0 <= int(layer) < k_pool.shape[0]
    assert meta.page_table.min() >= 0 and meta.page_table.max() < k_pool.shape[1]
    assert meta.block_seq_id.max() < meta.page_table.shape[0]


def _assert_close(out, ref, tol):
    out = np.asarray(jnp.asarray(out, jnp.float32), np.float64)
    ref = np.asarray(jnp.asarray(ref, jnp.float32), np.float64)
    assert np.isfinite(out).all(), f"{(~np.isfinite(out)).any(axis=(1, 2)).sum()} rows not finite"
    np.testing.assert_allclose(out, ref, rtol=tol, atol=tol * np.abs(ref).max())


def _check(seqs, *, page_size, group, head_dim, dtype, block_q, seed, window=None, softcap=None, kv_block=None):
    q, k_pool, v_pool, layer, host_meta, seq_kv = _make_batch(
        seqs, page_size=page_size, group=group, head_dim=head_dim, dtype=dtype, block_q=block_q, seed=seed
    )
    _assert_in_range(k_pool, layer, host_meta)
    meta = host_meta.to_device()
    sm_scale = head_dim**-0.5
    # the window traced (one program for every layer's window), the soft-cap static
    extra = {} if window is None else dict(sliding_window=jnp.int32(window), logit_softcap=softcap)
    out = _pallas(q, k_pool, v_pool, layer, meta, sm_scale=sm_scale, interpret=True, **extra)
    assert out.shape == q.shape and out.dtype == q.dtype
    num_new = sum(ext for _, ext in seqs)
    tol = TOLERANCE[dtype]
    _assert_close(out[:num_new], _numpy_attention(q, seqs, seq_kv, sm_scale, window, softcap), tol)
    xla_block = {} if kv_block is None else dict(kv_block=kv_block)
    ref = _xla(q, k_pool, v_pool, layer, meta, sm_scale=sm_scale, **xla_block, **extra)
    _assert_close(out[:num_new], ref[:num_new], tol)
    # Padding tokens map to a valid row: their output is finite too.
    assert np.isfinite(np.asarray(out.astype(jnp.float32))).all()


def test_interpret_mode_fills_unwritten_outputs_with_nan():
    """The premise of the finiteness checks: an output row a kernel skips stays NaN."""
    from jax.experimental import pallas as pl

    def kernel(x_ref, o_ref):
        o_ref[0] = x_ref[0]

    out = pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct((2, 16), jnp.float32), interpret=True)(
        jnp.ones((2, 16))
    )
    assert np.isfinite(out[0]).all() and np.isnan(out[1]).all()


seq_strategy = st.tuples(st.integers(0, 300), st.one_of(st.just(1), st.integers(1, 70)))


@settings(max_examples=24, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    seqs=st.lists(seq_strategy, min_size=1, max_size=8),
    page_size=st.sampled_from([1, 8, 16]),
    group=st.sampled_from([1, 3, 4]),
    head_dim=st.sampled_from([64, 128]),
    dtype=st.sampled_from(["float32", "bfloat16"]),
    block_q=st.sampled_from([1, 2, 4, 8, 16]),  # 2-8: the small extend buckets' blocks
    seed=st.integers(0, 2**31 - 1),
)
def test_matches_references_on_random_ragged_batches(seqs, page_size, group, head_dim, dtype, block_q, seed):
    _check(seqs, page_size=page_size, group=group, head_dim=head_dim, dtype=dtype, block_q=block_q, seed=seed)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("page_size", [1, 16])
def test_mixed_extends_and_decodes(page_size, dtype):
    """A fixed batch with every shape of sequence: fresh prefill, prefix + extend, decodes, page edges."""
    seqs = [(0, 70), (300, 1), (15, 1), (16, 33), (0, 1), (129, 64), (300, 70), (47, 2)]
    _check(seqs, page_size=page_size, group=3, head_dim=64, dtype=dtype, block_q=16, seed=0)


@pytest.mark.parametrize("window,softcap,block_q,kv_block", [
    (1, None, 16, None), (5, None, 1, 8), (16, 30.0, 16, 8), (40, None, 4, 16), (100, 20.0, 16, None),
])
def test_sliding_window_and_softcap(window, softcap, block_q, kv_block):
    """Windows shorter than a page, than a query block and than the prefixes, with and without
    Gemma 2's soft-capping, in both backends against brute force; `kv_block` small enough that the XLA
    path skips whole chunks before the window."""
    seqs = [(0, 70), (300, 1), (15, 1), (16, 33), (129, 64), (47, 2)]
    _check(seqs, page_size=8, group=2, head_dim=64, dtype="float32", block_q=block_q, seed=window,
           window=window, softcap=softcap, kv_block=kv_block)


def test_softmax_scale_may_be_traced():
    q, k_pool, v_pool, layer, host_meta, _ = _make_batch(
        [(40, 9), (7, 1)], page_size=8, group=4, head_dim=64, dtype="float32", block_q=16, seed=3
    )
    meta = host_meta.to_device()
    traced = jax.jit(functools.partial(ragged_paged_attention, interpret=True))(
        q, k_pool, v_pool, layer, meta, jnp.float32(0.3)
    )
    static = _pallas(q, k_pool, v_pool, layer, meta, sm_scale=0.3, interpret=True)
    np.testing.assert_array_equal(np.asarray(traced)[:10], np.asarray(static)[:10])


def test_rejects_non_power_of_two_page_size():
    q, k_pool, v_pool, layer, host_meta, _ = _make_batch(
        [(3, 2)], page_size=8, group=1, head_dim=64, dtype="float32", block_q=1, seed=2
    )
    k_pool = k_pool[:, :, :, :6]
    with pytest.raises(ValueError, match="page_size"):
        ragged_paged_attention(q, k_pool, k_pool, layer, host_meta.to_device(), 0.125)


def test_backend_registry(caplog):
    assert set(ATTENTION_BACKENDS) == {"xla", "pallas"}
    assert get_attention_backend("xla") is ragged_paged_attention_xla
    with pytest.raises(ValueError, match="pallas, xla"):
        get_attention_backend("flash")
    from jaxserve import pallas as pallas_pkg

    pallas_pkg._log_interpret_mode_once.cache_clear()
    with caplog.at_level(logging.WARNING, logger="jaxserve.pallas"):
        assert get_attention_backend("pallas") is ragged_paged_attention
        get_attention_backend("pallas")
    assert [r.message for r in caplog.records].count(
        "pallas attention runs in interpret mode on CPU: slow, meant for tests only"
    ) == 1


# jaxlib <= 0.10.2 lowers Pallas-Triton to a `__gpu$xla.gpu.triton` custom call that carries Triton IR
# and leaves the compile to XLA on the GPU, so lowering for "cuda" works on a CPU-only jaxlib. Later
# jaxlibs compile Triton during lowering through a handler that only the CUDA plugin registers.
needs_embedded_triton_ir = pytest.mark.skipif(
    _jaxlib_version > (0, 10, 2), reason="this jaxlib compiles Triton at lowering time (needs the CUDA plugin)"
)


def triton_kernels(lowered) -> list[tuple[str, list[tuple[list[int], list[int]]]]]:
    """The Triton modules embedded in a CUDA lowering: (verified IR text, operand shapes of each `tt.dot`)."""
    from jax._src.lib.mlir import ir
    from jax._src.pallas.triton import lowering as triton_lowering

    def ops(op):
        op = op.operation
        yield op
        for region in op.regions:
            for block in region.blocks:
                for inner in block.operations:
                    yield from ops(inner)

    configs = [
        op.attributes["mhlo.backend_config"]
        for op in ops(lowered.compiler_ir("stablehlo"))
        if op.name == "stablehlo.custom_call" and "triton" in str(op.attributes["call_target_name"])
    ]
    assert configs, "no Triton kernel in the CUDA lowering"
    kernels = []
    with triton_lowering._new_ir_context():
        for config in configs:
            module = ir.Module.parse(ir.StringAttr(config["ir"]).value_bytes)
            assert module.operation.verify()
            dots = [
                tuple(list(ir.RankedTensorType(x.type).shape) for x in op.operands[:2])
                for op in ops(module)
                if op.name == "tt.dot"
            ]
            kernels.append((str(module), dots))
    return kernels


def _abstract_args(
    num_tokens, num_seqs, pages_per_seq, block_q, group, head_dim, dtype, page_size=16, pool_shape=(4, 1024)
):
    i32 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.int32)  # noqa: E731
    num_blocks = num_blocks_for(num_tokens, num_seqs, block_q)
    meta = AttentionMetadata(
        i32(num_blocks, block_q),
        i32(num_blocks),
        i32(num_blocks),
        i32(num_blocks),
        i32(num_seqs, pages_per_seq),
        i32(num_seqs),
        i32(num_tokens),
    )
    pool = jax.ShapeDtypeStruct((*pool_shape, NUM_KV_HEADS, page_size, head_dim), dtype)
    return jax.ShapeDtypeStruct((num_tokens, NUM_KV_HEADS * group, head_dim), dtype), pool, pool, i32(), meta


@needs_embedded_triton_ir
@pytest.mark.parametrize("group", [1, 3, 4])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("block_q", [1, 4, 16])  # 4: the small extend buckets' blocks
def test_lowers_for_cuda(block_q, head_dim, group):
    """Every bucket lowers to a Triton kernel that passes Triton's verifier with dots of M, N, K >= 16.

    JAX 0.10.2 lowers Pallas-Triton to a `__gpu$xla.gpu.triton` custom call holding Triton IR;
    Triton's own compilation to PTX happens inside XLA on a GPU and cannot run here.
    """
    f = functools.partial(ragged_paged_attention, sm_scale=head_dim**-0.5, interpret=False)
    for i, num_tokens in enumerate(2**e for e in range(10)):
        num_seqs = min(num_tokens, 64)
        pages_per_seq = (1, 16, 128)[i % 3]
        dtype = jnp.float32 if i == 4 else jnp.bfloat16
        args = _abstract_args(num_tokens, num_seqs, pages_per_seq, block_q, group, head_dim, dtype)
        lowered = jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",))
        [(_, dots)] = triton_kernels(lowered)
        assert len(dots) == 2
        for a, b in dots:
            assert min(*a, *b) >= 16, (num_tokens, a, b)


@needs_embedded_triton_ir
def test_windowed_softcapped_kernel_lowers_for_cuda():
    """The window (a traced scalar input) and the soft-cap (tanh) lower into the one Triton kernel."""
    f = functools.partial(ragged_paged_attention, sm_scale=0.0625, interpret=False, logit_softcap=50.0)
    args = _abstract_args(64, 8, 16, 16, 4, 256, jnp.bfloat16)
    lowered = jax.jit(f).trace(*args, sliding_window=jax.ShapeDtypeStruct((), jnp.int32)).lower(
        lowering_platforms=("cuda",))
    [(ir_text, dots)] = triton_kernels(lowered)
    assert len(dots) == 2 and "tanh" in ir_text


@needs_embedded_triton_ir
def test_pool_over_4gib_gathers_with_64_bit_offsets():
    """A pool past 4 GiB (here 33 layers x 16385 pages of 8 KiB) is gathered with 64-bit offsets."""
    f = functools.partial(ragged_paged_attention, sm_scale=128**-0.5, interpret=False)
    small = _abstract_args(32, 32, 128, 1, 4, 128, jnp.bfloat16, pool_shape=(2, 4097))
    large = _abstract_args(32, 32, 128, 1, 4, 128, jnp.bfloat16, pool_shape=(33, 16385))
    [(small_ir, _)] = triton_kernels(jax.jit(f).trace(*small).lower(lowering_platforms=("cuda",)))
    [(large_ir, _)] = triton_kernels(jax.jit(f).trace(*large).lower(lowering_platforms=("cuda",)))
    pattern = re.compile(r"tt\.addptr .*i64>")
    assert not pattern.search(small_ir)
    assert len(pattern.findall(large_ir)) == 2  # the K and the V gather


_SHARD_MAP_SCRIPT = textwrap.dedent(
    """
    import jax, jax.numpy as jnp, numpy as np
    from jax.sharding import Mesh, PartitionSpec as P
    from jaxserve.pallas.metadata import build_attention_metadata
    from jaxserve.pallas.ragged_paged_attention import ragged_paged_attention

    assert jax.device_count() == 2, jax.devices()
    rng = np.random.default_rng(0)
    kv_heads, group, head_dim, page_size = 4, 3, 64, 8
    seqs = [(20, 5), (3, 1), (0, 17)]
    pages = [-(-(a + b) // page_size) for a, b in seqs]
    owner = rng.permutation(np.arange(1, sum(pages) + 1))
    tables = [owner[sum(pages[:i]):sum(pages[:i + 1])].tolist() for i in range(len(seqs))]
    meta = build_attention_metadata([b for _, b in seqs], [a for a, _ in seqs], tables,
                                    num_tokens=32, num_seqs=4, pages_per_seq=4, block_q=16).to_device()
    q = jnp.asarray(rng.standard_normal((32, kv_heads * group, head_dim)), jnp.float32)
    shape = (2, sum(pages) + 1, kv_heads, page_size, head_dim)
    k_pool = jnp.asarray(rng.standard_normal(shape), jnp.float32)
    v_pool = jnp.asarray(rng.standard_normal(shape), jnp.float32)
    layer = jnp.int32(1)
    attn = lambda q, k, v, layer, meta: ragged_paged_attention(q, k, v, layer, meta, 0.125, interpret=True)
    mesh = Mesh(np.array(jax.devices()), ("kv",))
    pool_spec = P(None, None, "kv")
    sharded = jax.jit(jax.shard_map(attn, mesh=mesh, in_specs=(P(None, "kv"), pool_spec, pool_spec, P(), P()),
                                    out_specs=P(None, "kv"), check_vma=False))
    out = sharded(q, k_pool, v_pool, layer, meta)
    ref = jax.jit(attn)(q, k_pool, v_pool, layer, meta)
    n = sum(b for _, b in seqs)
    np.testing.assert_allclose(np.asarray(out)[:n], np.asarray(ref)[:n], rtol=1e-6, atol=1e-6)
    # a compressed pool: its values and scales split over kv heads by the same spec
    from jaxserve.pallas.quantized_kv import QuantizedKV, quantize_rows
    kq, vq = (QuantizedKV.of(*quantize_rows(p, jnp.dtype("float8_e4m3fn"))) for p in (k_pool, v_pool))
    out = sharded(q, kq, vq, layer, meta)
    ref = jax.jit(attn)(q, kq, vq, layer, meta)
    np.testing.assert_allclose(np.asarray(out)[:n], np.asarray(ref)[:n], rtol=1e-6, atol=1e-6)
    print("SHARDED_OK", out.sharding)
    """
)


def test_inside_shard_map_with_kv_heads_sharded():
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=2", JAX_PLATFORMS="cpu")
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [root, env.get("PYTHONPATH")]))
    result = subprocess.run(
        [sys.executable, "-c", _SHARD_MAP_SCRIPT], env=env, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr[-4000:]
    assert "SHARDED_OK" in result.stdout


@pytest.mark.parametrize("seqs,block_q", [
    ([(600, 13)], 16), ([(600, 16)], 16), ([(37, 3), (250, 13), (5, 1)], 16),
    ([(600, 3)], 4), ([(511, 2)], 2), ([(300, 5)], 8), ([(37, 3), (250, 2), (5, 1)], 4),
])
def test_xla_path_on_verification_buckets(seqs, block_q):
    """Speculative verification's shape: K + 1 <= 16 query tokens after a long cached prefix, in a
    bucket with several sequence slots, so most query blocks are padding (the XLA path visits only
    the real ones); the 2-, 4- and 8-token buckets have blocks of their size, which a sequence may
    fill only in part. Against the float64 brute force; padding rows come back zero."""
    q, k_pool, v_pool, layer, host_meta, seq_kv = _make_batch(
        seqs, page_size=16, group=3, head_dim=64, dtype="float32", block_q=block_q, seed=3
    )
    out = np.asarray(_xla(q, k_pool, v_pool, layer, host_meta.to_device(), sm_scale=0.125))
    num_new = sum(ext for _, ext in seqs)
    _assert_close(out[:num_new], _numpy_attention(q, seqs, seq_kv, 0.125), TOLERANCE["float32"])
    assert not out[num_new:].any()


# ---- the compressed pool (--kv-cache-dtype; jaxserve/pallas/quantized_kv.py) -----------------------------

KV_QUANT_STORAGE = ["int8", "float8_e4m3fn", "float8_e5m2"]


def _numpy_quantize(x: np.ndarray, dtype: str) -> tuple[np.ndarray, np.ndarray]:
    """An independent numpy quantizer of rows (the last axis), in float32 arithmetic as the step's."""
    import ml_dtypes

    x = np.asarray(x, np.float32)
    top = {"int8": 127.0, "float8_e4m3fn": 448.0, "float8_e5m2": 57344.0}[dtype]
    scale = np.abs(x).max(-1) * np.float32(1.0 / top)
    scaled = x / np.where(scale > 0, scale, np.float32(1))[..., None]
    with np.errstate(invalid="ignore"):  # NaN rows (pages no sequence owns) stay NaN in their scale
        if dtype == "int8":
            return np.clip(np.round(scaled), -127, 127).astype(np.int8), scale
        return scaled.astype(getattr(ml_dtypes, dtype)), scale


@pytest.mark.parametrize("dtype", KV_QUANT_STORAGE)
def test_quantize_rows_equals_numpy_bit_for_bit(dtype):
    from jaxserve.pallas.quantized_kv import dequantize_rows, quantize_rows

    x = np.random.default_rng(0).standard_normal((33, 3, 64)).astype(np.float32) * 5
    x[4, 1] = 0.0  # a zero row: scale 0, values 0
    values, scale = jax.jit(quantize_rows, static_argnums=1)(jnp.asarray(x), jnp.dtype(dtype))
    ref_values, ref_scale = _numpy_quantize(x, dtype)
    np.testing.assert_array_equal(np.asarray(scale), ref_scale)
    np.testing.assert_array_equal(np.asarray(values).view(np.uint8), ref_values.view(np.uint8))
    assert not np.asarray(dequantize_rows(values, scale))[4, 1].any()
    # the round trip's error is within half a step of the row's scale (int8) or fp8's relative precision
    err = np.abs(np.asarray(dequantize_rows(values, scale)) - x)
    bound = {"int8": 0.5 * ref_scale[..., None] * 1.0001, "float8_e4m3fn": np.abs(x) / 16 + 1e-6 * ref_scale[..., None],
             "float8_e5m2": np.abs(x) / 8 + 1e-6 * ref_scale[..., None]}[dtype]
    assert (err <= bound + 1e-12).all()


@pytest.mark.parametrize("dtype", KV_QUANT_STORAGE)
def test_packed_pages_round_trip(dtype):
    """The host tiers' bytes (`pack_pages`) give back the pool's values and scales exactly, on the device and
    in numpy."""
    from jaxserve.pallas.quantized_kv import QuantizedKV, pack_pages, quantize_rows, unpack_pages, unpack_pages_numpy

    x = jnp.asarray(np.random.default_rng(1).standard_normal((2, 3, 2, 4, 16)), jnp.float32)
    pool = QuantizedKV.of(*quantize_rows(x, jnp.dtype(dtype)))
    packed = jax.jit(pack_pages)(pool)
    assert packed.dtype == jnp.uint8 and packed.shape == (2, 3, 2, 4, 16 + 4)
    back = unpack_pages(packed, pool)
    np.testing.assert_array_equal(np.asarray(back.data).view(np.uint8), np.asarray(pool.data).view(np.uint8))
    np.testing.assert_array_equal(np.asarray(back.scale), np.asarray(pool.scale))
    values, scale = unpack_pages_numpy(np.asarray(packed), dtype)
    np.testing.assert_array_equal(values.view(np.uint8), np.asarray(pool.data).view(np.uint8))
    assert values.dtype.name == dtype
    np.testing.assert_array_equal(scale, np.asarray(pool.scale))


def _quantized_batch(seqs, dtype, **kw):
    """`_make_batch`'s float32 batch with its pools compressed to `dtype`, and each sequence's K/V as the
    compressed pool holds it (dequantized in numpy, float64), for the brute force."""
    from jaxserve.pallas.quantized_kv import QuantizedKV

    q, k_pool, v_pool, layer, host_meta, seq_kv = _make_batch(seqs, dtype="float32", **kw)
    pools = [QuantizedKV.of(*map(jnp.asarray, _numpy_quantize(np.asarray(p), dtype))) for p in (k_pool, v_pool)]
    # NaN pages (no owner) keep a NaN scale, so a read of a wrong page still shows
    pools = [QuantizedKV(p.data, jnp.where(jnp.isnan(raw).any(-1), jnp.nan, p.scale), p.format)
             for p, raw in zip(pools, (k_pool, v_pool))]
    held = []
    for k, v in seq_kv:
        pair = []
        for x in (k, v):
            values, scale = _numpy_quantize(x, dtype)
            pair.append(values.astype(np.float64) * scale[..., None].astype(np.float64))
        held.append(tuple(pair))
    return q, pools[0], pools[1], layer, host_meta, held


@pytest.mark.parametrize("dtype", KV_QUANT_STORAGE)
@pytest.mark.parametrize("window", [None, 40])
def test_compressed_pool_attention_on_both_backends(dtype, window):
    """Both backends read a compressed pool: against the float64 brute force over the values the pool holds,
    with decodes and extends mixed, a window, and pages of two sizes."""
    seqs = [(0, 23), (37, 1), (70, 9), (5, 1)]
    for page_size in (4, 16):
        q, k_pool, v_pool, layer, host_meta, held = _quantized_batch(
            seqs, dtype, page_size=page_size, group=3, head_dim=32, block_q=8, seed=page_size)
        meta = host_meta.to_device()
        extra = {} if window is None else dict(sliding_window=jnp.int32(window))
        ref = _numpy_attention(q, seqs, held, 0.2, window)
        num_new = sum(ext for _, ext in seqs)
        xla = _xla(q, k_pool, v_pool, layer, meta, sm_scale=0.2, kv_block=32, **extra)
        _assert_close(xla[:num_new], ref, TOLERANCE["float32"])
        pallas = _pallas(q, k_pool, v_pool, layer, meta, sm_scale=0.2, interpret=True, **extra)
        _assert_close(pallas[:num_new], ref, TOLERANCE["float32"])


def test_write_kv_quantizes_each_token_into_its_slot():
    """`write_kv` into a compressed pool stores each token's rows as the numpy quantizer does, at its slot,
    and drops padding rows aimed past the pool."""
    from jaxserve.pallas.quantized_kv import allocate_pools
    from jaxserve.pallas.reference import write_kv

    k_pool, v_pool = allocate_pools((2, 5, 2, 4, 8), "int8")
    rng = np.random.default_rng(2)
    k, v = (rng.standard_normal((3, 2, 8)).astype(np.float32) for _ in range(2))
    slots = np.array([4 * 3 + 1, 4 * 2 + 0, 99 * 4], np.int32)  # page 3 slot 1, page 2 slot 0, out of range
    k_pool, v_pool = jax.jit(write_kv)(k_pool, v_pool, jnp.int32(1), jnp.asarray(k), jnp.asarray(v), jnp.asarray(slots))
    for pool, x in ((k_pool, k), (v_pool, v)):
        values, scale = _numpy_quantize(x, "int8")
        data, scales = np.asarray(pool.data), np.asarray(pool.scale)
        np.testing.assert_array_equal(data[1, 3, :, 1], values[0])
        np.testing.assert_array_equal(scales[1, 2, :, 0], scale[1])
        assert np.count_nonzero(scales) == np.count_nonzero(scale[:2])  # nothing else written


@needs_embedded_triton_ir
@pytest.mark.parametrize("dtype", [jnp.int8, jnp.float8_e4m3fn])
def test_compressed_pool_kernel_lowers_for_cuda(dtype):
    """The kernel over 8-bit pages and their scales lowers to one verified Triton kernel with two dots."""
    from jaxserve.pallas.quantized_kv import QuantizedKV

    f = functools.partial(ragged_paged_attention, sm_scale=0.125, interpret=False)
    q, pool, _, layer, meta = _abstract_args(64, 8, 16, 16, 4, 64, jnp.bfloat16)
    bits = jnp.int8 if dtype == jnp.int8 else jnp.uint8
    quantized = QuantizedKV(jax.ShapeDtypeStruct(pool.shape, bits), jax.ShapeDtypeStruct(pool.shape[:-1], jnp.float32),
                            jnp.dtype(dtype).name)
    lowered = jax.jit(f).trace(q, quantized, quantized, layer, meta).lower(lowering_platforms=("cuda",))
    [(_, dots)] = triton_kernels(lowered)
    assert len(dots) == 2
