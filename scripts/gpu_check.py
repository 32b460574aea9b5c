"""One-command GPU check of the Pallas ragged paged attention kernel: correctness, speed, bandwidth.

    python scripts/gpu_check.py            # on a GPU: real sizes, under 5 minutes on one GPU
    python scripts/gpu_check.py --iters 50

On a GPU it
1. checks correctness at Llama-3-8B-like attention sizes (32 query heads, 8 kv heads, head_dim 128,
   bfloat16): a decode batch of 32 sequences x 2k context and a mixed batch (extends + decodes),
   against the XLA path and (decode) a float64 numpy reference; a float32 case checks the IEEE dots, and
   int8 and fp8_e4m3 pools (`--kv-cache-dtype`) the compressed pages' reads.
   The pool has enough layers that the layer read lies past 4 GiB, so 64-bit offsets are exercised;
2. times decode for the kernel, the XLA path and `jax.experimental.pallas.ops.gpu.paged_attention`
   (if importable), and the mixed batch for the kernel and the XLA path: jitted, warmed up, then
   `--iters` back-to-back calls ended by `block_until_ready`, best of 3 repeats;
3. prints the achieved bandwidth (K/V bytes the batch needs / time) against a measured device copy;
4. with more than one GPU, runs the default model at tp 1 and at tp = all visible GPUs
   (`benchmarks/scale/bench_tp.py`'s comparison, Pallas backend, scan layer loop): greedy tokens must agree,
   and the prefill and decode step times of both are printed (`--no-tp` skips it);
5. checks and times the Pallas quantized matmul (`--quantization q8_0 | q4_1 | gguf` weights) on SmolLM2's
   projection and head shapes at T = 1, 8 and 256 against the dequantized reference and the XLA path;
6. runs the whole engine on the default model (`--engine-model`; `--no-engine` skips it) with the
   GPU's defaults (Pallas attention, scan layer loop, buckets precompiled, the overlap schedule on)
   three ways: `--disable-overlap-schedule`, the overlap schedule, and the overlap schedule with
   `--speculative-algorithm NGRAM`. A batch of greedy requests (mixed lengths, stops inside the run)
   must give the same text all three ways, the overlap must have overlapped steps, and no step may
   compile after warm-up; one request's time per output token is printed for each (`run_engine_check`).

Without a GPU it runs the same code at tiny sizes in Pallas interpret mode (a smoke run: correctness
only, timings meaningless), and the engine check on the CPU's defaults (XLA attention, host layer
loop, compiles on first use) without its timing and compile verdicts. Exit status 1 when a correctness check fails.
Runs on JAX 0.10.2 / Python 3.11 and JAX 0.11 / Python 3.12: only public JAX APIs, and the optional
reference kernel is imported under a guard.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from jaxserve.pallas.metadata import HostAttentionMetadata, build_attention_metadata  # noqa: E402
from jaxserve.pallas.quantized_kv import QuantizedKV, quantize_rows  # noqa: E402
from jaxserve.pallas.ragged_paged_attention import ragged_paged_attention  # noqa: E402
from jaxserve.pallas.reference import ragged_paged_attention_xla  # noqa: E402

try:  # a reference decode kernel shipped with JAX; its location is not a stable API
    from jax.experimental.pallas.ops.gpu.paged_attention import paged_attention as jax_paged_attention
except Exception as exc:  # noqa: BLE001
    jax_paged_attention = None
    _JAX_PAGED_ATTENTION_ERROR = f"{type(exc).__name__}: {exc}"


@dataclasses.dataclass(frozen=True)
class Sizes:
    num_heads: int
    num_kv_heads: int
    head_dim: int
    page_size: int
    num_layers: int | None  # None: enough layers that the last one starts past 4 GiB
    decode_seqs: int
    context_len: int
    mixed_extends: tuple[tuple[int, int], ...]  # (prefix_len, extend_len)
    mixed_decodes: int


GPU_SIZES = Sizes(
    num_heads=32,
    num_kv_heads=8,
    head_dim=128,
    page_size=16,
    num_layers=None,
    decode_seqs=32,
    context_len=2048,
    mixed_extends=((0, 256), (1792, 256), (512, 256), (1024, 255), (100, 256), (1500, 200), (0, 512), (64, 100)),
    mixed_decodes=24,
)
SMOKE_SIZES = Sizes(
    num_heads=6,
    num_kv_heads=2,
    head_dim=64,
    page_size=16,
    num_layers=2,
    decode_seqs=4,
    context_len=64,
    mixed_extends=((0, 20), (30, 17)),
    mixed_decodes=2,
)


def _pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


@dataclasses.dataclass(frozen=True)
class Batch:
    q: jax.Array  # [T, H, D]
    host_meta: HostAttentionMetadata
    seqs: tuple[tuple[int, int], ...]  # (prefix_len, extend_len)

    @property
    def kv_tokens(self) -> int:
        return sum(pre + ext for pre, ext in self.seqs)


def make_pool(sizes: Sizes, num_pages: int, dtype, key) -> tuple[jax.Array, jax.Array]:
    """Pools `[L, N, KVH, page_size, D]`: random in the last layer (the one attended), zeros elsewhere.

    With `sizes.num_layers` None, L is chosen so that the last layer starts past 4 GiB: its offsets
    then need 64-bit arithmetic in the kernel.
    """
    page_shape = (num_pages, sizes.num_kv_heads, sizes.page_size, sizes.head_dim)
    num_layers = sizes.num_layers
    if num_layers is None:
        layer_bytes = int(np.prod(page_shape)) * jnp.dtype(dtype).itemsize
        num_layers = 2**32 // layer_bytes + 2
    shape = (num_layers, *page_shape)

    @jax.jit
    def build(key):
        k_key, v_key = jax.random.split(key)
        zeros = jnp.zeros(shape, dtype)
        k = zeros.at[-1].set(jax.random.normal(k_key, shape[1:], dtype))
        v = zeros.at[-1].set(jax.random.normal(v_key, shape[1:], dtype))
        return k, v

    return build(key)


def make_batch(sizes: Sizes, seqs, pages: np.ndarray, block_q: int, dtype, key) -> Batch:
    """Metadata for `seqs` with page tables drawn from `pages` (shuffled page ids), random queries."""
    pages_per_seq = _pow2(-(-max(pre + ext for pre, ext in seqs) // sizes.page_size))
    tables, start = [], 0
    for pre, ext in seqs:
        n = -(-(pre + ext) // sizes.page_size)
        tables.append(pages[start : start + n].tolist())
        start += n
    num_tokens = max(16, _pow2(sum(ext for _, ext in seqs)))
    meta = build_attention_metadata(
        [ext for _, ext in seqs],
        [pre for pre, _ in seqs],
        tables,
        num_tokens=num_tokens,
        num_seqs=_pow2(len(seqs)),
        pages_per_seq=pages_per_seq,
        block_q=block_q,
    )
    q = jax.random.normal(key, (num_tokens, sizes.num_heads, sizes.head_dim), dtype)
    return Batch(q, meta, tuple(seqs))


def numpy_reference(batch: Batch, k_pool, v_pool, layer: int, sm_scale: float, seq_ids) -> dict[int, np.ndarray]:
    """Float64 causal attention of the chosen sequences, reading their pages on the host."""
    meta = batch.host_meta
    q = np.asarray(batch.q.astype(jnp.float32), np.float64)
    starts = np.cumsum([0] + [ext for _, ext in batch.seqs])
    out = {}
    for s in seq_ids:
        pre, ext = batch.seqs[s]
        _, _, num_kv_heads, page_size, head_dim = k_pool.shape
        n = -(-(pre + ext) // page_size)
        pages = meta.page_table[s, :n]
        # [n, KVH, ps, D] pages -> [n * ps, KVH, D] tokens
        k, v = (np.asarray(pool[layer, pages].astype(jnp.float32), np.float64).transpose(0, 2, 1, 3)
                .reshape(-1, num_kv_heads, head_dim) for pool in (k_pool, v_pool))
        group = q.shape[1] // k.shape[1]
        k, v = np.repeat(k, group, axis=1), np.repeat(v, group, axis=1)
        qs = q[starts[s] : starts[s] + ext]
        scores = np.einsum("qhd,khd->hqk", qs, k) * sm_scale
        visible = np.arange(k.shape[0])[None, :] <= (pre + np.arange(ext))[:, None]
        scores = np.where(visible[None], scores, -np.inf)
        probs = np.exp(scores - scores.max(-1, keepdims=True))
        out[s] = np.einsum("hqk,khd->qhd", probs / probs.sum(-1, keepdims=True), v)
    return out


def max_rel_err(out, ref) -> float:
    out = np.asarray(jnp.asarray(out, jnp.float32), np.float64)
    ref = np.asarray(jnp.asarray(ref, jnp.float32), np.float64)
    if not np.isfinite(out).all():
        return float("inf")
    return float(np.abs(out - ref).max() / np.abs(ref).max())


def time_call(fn, *args, iters: int, repeats: int = 3) -> float:
    """Seconds per call: warm-up, then `iters` back-to-back calls ended by block_until_ready; best of repeats."""
    jax.block_until_ready(fn(*args))
    jax.block_until_ready(fn(*args))
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(iters):
            out = fn(*args)
        jax.block_until_ready(out)
        best = min(best, (time.perf_counter() - start) / iters)
    return best


def copy_bandwidth(num_bytes: int, iters: int) -> float:
    """Measured device copy ceiling in bytes/s: read + write of a `num_bytes` buffer."""
    x = jnp.ones((num_bytes // 2,), jnp.bfloat16)
    add_one = jax.jit(lambda x: x + jnp.asarray(1, x.dtype))
    return 2 * x.nbytes / time_call(add_one, x, iters=iters)


def kv_bytes(batch: Batch, sizes: Sizes, itemsize: int) -> int:
    """K and V bytes the batch must read: every sequence's context once per kv head."""
    return 2 * batch.kv_tokens * sizes.num_kv_heads * sizes.head_dim * itemsize


def check_range(batch: Batch, num_pages: int, num_layers: int, layer: int) -> None:
    # Out-of-range page ids fault on GPU (and clamp in interpret mode).
    assert 0 <= layer < num_layers
    assert batch.host_meta.page_table.min() >= 0 and batch.host_meta.page_table.max() < num_pages


class Report:
    """Collects correctness verdicts and prints each as it comes."""

    def __init__(self) -> None:
        self.failures: list[str] = []

    def __call__(self, name: str, err: float, tol: float) -> None:
        ok = err <= tol
        print(f"  {name:<48} max rel err {err:.2e} (tol {tol:.0e}) {'ok' if ok else 'FAIL'}")
        if not ok:
            self.failures.append(name)


@dataclasses.dataclass(frozen=True)
class Setup:
    sizes: Sizes
    k_pool: jax.Array
    v_pool: jax.Array
    layer: int
    decode: Batch
    mixed: Batch
    sm_scale: float
    interpret: bool


def build_setup(sizes: Sizes, interpret: bool) -> Setup:
    """The pool and the two batches (decode, mixed) with shuffled, range-checked page tables."""
    dtype = jnp.bfloat16
    keys = jax.random.split(jax.random.key(0), 3)
    decode_seqs = tuple((sizes.context_len - 1, 1) for _ in range(sizes.decode_seqs))
    mixed_seqs = sizes.mixed_extends + tuple(
        ((i * 97) % sizes.context_len, 1) for i in range(1, sizes.mixed_decodes + 1)
    )
    pages_needed = max(sum(-(-(p + e) // sizes.page_size) for p, e in seqs) for seqs in (decode_seqs, mixed_seqs))
    num_pages = pages_needed + 1
    k_pool, v_pool = make_pool(sizes, num_pages, dtype, keys[0])
    num_layers = k_pool.shape[0]
    layer = num_layers - 1
    print(
        f"pool: 2 x {k_pool.shape} {k_pool.dtype} ({2 * k_pool.nbytes / 2**30:.2f} GiB); "
        f"layer {layer} starts at {layer * (k_pool.nbytes // num_layers) / 2**30:.2f} GiB"
    )
    rng = np.random.default_rng(0)
    decode = make_batch(sizes, decode_seqs, rng.permutation(np.arange(1, num_pages)), 1, dtype, keys[1])
    mixed = make_batch(sizes, mixed_seqs, rng.permutation(np.arange(1, num_pages)), 16, dtype, keys[2])
    for batch in (decode, mixed):
        check_range(batch, num_pages, num_layers, layer)
    return Setup(sizes, k_pool, v_pool, layer, decode, mixed, sizes.head_dim**-0.5, interpret)


def jitted_paths(setup: Setup):
    pallas = jax.jit(functools.partial(ragged_paged_attention, sm_scale=setup.sm_scale, interpret=setup.interpret))
    xla = jax.jit(functools.partial(ragged_paged_attention_xla, sm_scale=setup.sm_scale))
    return pallas, xla


def check_correctness(setup: Setup, report: Report) -> jax.Array:
    """Kernel vs XLA path and float64 numpy, bf16 decode + mixed, and f32 mixed. Returns the XLA decode output."""
    pallas, xla = jitted_paths(setup)
    pools = (setup.k_pool, setup.v_pool, jnp.int32(setup.layer))
    decode, mixed = setup.decode, setup.mixed
    decode_meta, mixed_meta = decode.host_meta.to_device(), mixed.host_meta.to_device()

    n_dec = len(decode.seqs)
    out_dec = pallas(decode.q, *pools, decode_meta)[:n_dec]
    ref_dec = xla(decode.q, *pools, decode_meta)[:n_dec]
    report("decode bf16: pallas vs xla", max_rel_err(out_dec, ref_dec), 2e-2)
    ref_np = numpy_reference(decode, setup.k_pool, setup.v_pool, setup.layer, setup.sm_scale, range(n_dec))
    report("decode bf16: pallas vs numpy float64", max_rel_err(out_dec, np.concatenate(list(ref_np.values()))), 2e-2)

    n_mix = sum(ext for _, ext in mixed.seqs)
    out_mix = pallas(mixed.q, *pools, mixed_meta)
    report("mixed bf16: pallas vs xla", max_rel_err(out_mix[:n_mix], xla(mixed.q, *pools, mixed_meta)[:n_mix]), 2e-2)
    # Sequence 1 is an extend after a long prefix.
    ref_np = numpy_reference(mixed, setup.k_pool, setup.v_pool, setup.layer, setup.sm_scale, [1])[1]
    start, ext = mixed.seqs[0][1], mixed.seqs[1][1]
    report("mixed bf16: pallas vs numpy float64 (1 extend)", max_rel_err(out_mix[start : start + ext], ref_np), 2e-2)

    # float32: IEEE dots in the kernel; the XLA reference must not use TF32 either.
    pools32 = (
        setup.k_pool[setup.layer :].astype(jnp.float32),
        setup.v_pool[setup.layer :].astype(jnp.float32),
        jnp.int32(0),
    )
    q32 = mixed.q.astype(jnp.float32)
    out32 = pallas(q32, *pools32, mixed_meta)
    with jax.default_matmul_precision("highest"):
        ref32 = xla(q32, *pools32, mixed_meta)  # the precision setting is part of jit's cache key
    report("mixed f32: pallas vs xla (highest precision)", max_rel_err(out32[:n_mix], ref32[:n_mix]), 1e-5)

    # a compressed pool (--kv-cache-dtype): the layer's pages quantized, the two paths on the same 8-bit pages
    for name in ("int8", "float8_e4m3fn"):
        quantized = [QuantizedKV.of(*quantize_rows(pool[setup.layer :], jnp.dtype(name))) for pool in (setup.k_pool, setup.v_pool)]
        out_q = pallas(mixed.q, *quantized, jnp.int32(0), mixed_meta)
        ref_q = xla(mixed.q, *quantized, jnp.int32(0), mixed_meta)
        report(f"mixed bf16, {name} pool: pallas vs xla", max_rel_err(out_q[:n_mix], ref_q[:n_mix]), 2e-2)
    return ref_dec


def time_jax_paged_attention(setup: Setup, ref_dec, iters: int, report: Report) -> float:
    """Time JAX's reference decode kernel on the decode batch (its pool layout is [KVH, N, page_size, D])."""
    k_pages = jnp.transpose(setup.k_pool[setup.layer], (1, 0, 2, 3))
    v_pages = jnp.transpose(setup.v_pool[setup.layer], (1, 0, 2, 3))
    n = len(setup.decode.seqs)
    meta = setup.decode.host_meta
    block_tables = jnp.asarray(meta.page_table[:n])
    lengths = jnp.asarray(meta.seq_kv_len[:n])
    # It applies no softmax scale of its own: fold sm_scale into q (in float32, then back to q's dtype).
    q = setup.decode.q[meta.block_token_idx[:n, 0]]
    q = (q.astype(jnp.float32) * setup.sm_scale).astype(q.dtype)
    pages_per_seq = block_tables.shape[1]
    k_splits = max(1, min(16, pages_per_seq // 8))
    fn = functools.partial(
        jax_paged_attention,
        k_splits=k_splits,
        pages_per_compute_block=min(8, pages_per_seq // k_splits),
        interpret=setup.interpret,
    )
    out = fn(q, k_pages, v_pages, block_tables, lengths)
    report("decode bf16: jax paged_attention vs xla", max_rel_err(out, ref_dec), 2e-2)
    return time_call(fn, q, k_pages, v_pages, block_tables, lengths, iters=iters)


def run_timings(setup: Setup, ref_dec, iters: int, report: Report) -> list[tuple[str, float, int]]:
    """(path, seconds per call, K/V bytes needed) for every timed path."""
    pallas, xla = jitted_paths(setup)
    pools = (setup.k_pool, setup.v_pool, jnp.int32(setup.layer))
    itemsize = setup.k_pool.dtype.itemsize
    rows = []
    for name, batch in (("decode", setup.decode), ("mixed", setup.mixed)):
        meta = batch.host_meta.to_device()
        num_bytes = kv_bytes(batch, setup.sizes, itemsize)
        rows.append((f"{name}: pallas (this kernel)", time_call(pallas, batch.q, *pools, meta, iters=iters), num_bytes))
        rows.append((f"{name}: xla path", time_call(xla, batch.q, *pools, meta, iters=iters), num_bytes))
        if name != "decode":
            continue
        if jax_paged_attention is None:
            print(f"  jax paged_attention not importable ({_JAX_PAGED_ATTENTION_ERROR})")
            continue
        try:
            seconds = time_jax_paged_attention(setup, ref_dec, iters, report)
            rows.append(("decode: jax ops.gpu.paged_attention", seconds, num_bytes))
        except Exception as exc:  # noqa: BLE001 -- an external reference: report it, don't abort
            print(f"  jax paged_attention failed: {type(exc).__name__}: {str(exc)[:300]}")
    return rows


def print_table(rows, ceiling: float, setup: Setup) -> None:
    print(f"\n{'path':<38} {'ms/call':>9} {'GB/s':>8} {'% copy':>7}")
    for name, seconds, num_bytes in rows:
        bandwidth = num_bytes / seconds
        print(f"{name:<38} {seconds * 1e3:>9.3f} {bandwidth / 1e9:>8.1f} {100 * bandwidth / ceiling:>6.1f}%")
    print(f"{'device copy (x + 1, read + write)':<38} {'':>9} {ceiling / 1e9:>8.1f} {100.0:>6.1f}%")
    n_mix = sum(ext for _, ext in setup.mixed.seqs)
    print(
        f"decode: {len(setup.decode.seqs)} seqs x {setup.sizes.context_len} tokens; mixed: {n_mix} new tokens "
        f"over {setup.mixed.kv_tokens} kv tokens; GB/s = K+V bytes needed / time"
    )


def run_tp_check(tp: int, report: Report) -> None:
    """The default model at tp 1 and tp `tp` (all visible GPUs): same greedy tokens, step times."""
    from benchmarks.scale.bench_tp import compare_tp
    from benchmarks.scale.bench_tp import print_table as print_tp_table

    n = tp
    while n > 1 and 9 % n:  # the default model has 9 query heads: the largest tp that divides them
        n -= 1
    if n == 1:
        print(f"tensor parallel: {tp} GPUs, but no tp size > 1 divides the default model's 9 heads; skipped")
        return
    print(f"tensor parallel: default model, tp 1 vs tp {n} ({tp} GPUs visible)")
    result = compare_tp("default", n, prompt_len=512, batch_sizes=[1, 8, 32], repeats=5,
                        layer_loop="scan", attention_backend="pallas")
    print_tp_table(result, n)
    if not result["same_tokens"]:
        report.failures.append(f"tp {n} greedy tokens differ from tp 1")


ENGINE_PROMPTS = (
    "Copy this list exactly, one item per line: apple, banana, cherry, damson, elderberry, fig, grape.",
    "Write a haiku about a lighthouse.",
    "Rewrite in the past tense: The ship leaves the harbour at dawn and the gulls follow it out to sea.",
    "def add(a, b):\n    return a + b\n\n# Add type hints to the function above and repeat it:",
    "Name three rivers.",
    "Count from one to twenty in words.",
)
ENGINE_VARIANTS = {  # name: Engine keyword arguments on top of the check's base
    "overlap off": dict(disable_overlap_schedule=True),
    "overlap on": dict(disable_overlap_schedule=False),
    "overlap on + NGRAM": dict(disable_overlap_schedule=False, speculative_algorithm="NGRAM"),
}


def engine_request_params(free: list[dict]) -> list[dict]:
    """Greedy sampling params for the check's batch, from each prompt's unconstrained output `free`:
    every third request stops on a token of its own output, every third on a string from its text,
    the rest after a few tokens, so runs end inside an overlapped or verified step."""
    params = []
    for i, out in enumerate(free):
        base = {"max_new_tokens": 32, "temperature": 0, "ignore_eos": True}
        ids, text = out["output_ids"], out["text"]
        if i % 3 == 0 and len(ids) > 8:
            params.append({**base, "stop_token_ids": [int(ids[4 + i % 4])]})
        elif i % 3 == 1 and len(text) > 12:
            params.append({**base, "stop": [text[len(text) // 2 : len(text) // 2 + 3]]})
        else:
            params.append({**base, "max_new_tokens": 5 + i})
    return params


def time_per_output_token(engine, prompt: str, new_tokens: int = 48, repeats: int = 3) -> float:
    """Seconds per output token of one greedy request: (generate `new_tokens` - generate 1) over
    `new_tokens` - 1, best of `repeats` each (TTFT cancels out)."""
    def best(n: int) -> float:
        times = []
        for _ in range(repeats):
            engine.flush_cache()
            t0 = time.perf_counter()
            engine.generate(prompt, {"max_new_tokens": n, "temperature": 0, "ignore_eos": True})
            times.append(time.perf_counter() - t0)
        return min(times)
    return (best(new_tokens) - best(1)) / (new_tokens - 1)


def run_engine_check(model_path: str, report: Report, on_gpu: bool) -> dict[str, dict]:
    """The engine on `model_path` in each of `ENGINE_VARIANTS`, one after the other: same greedy
    outputs as the first, overlapped steps where the overlap is on, no compile after warm-up (GPU:
    buckets precompiled; the CPU smoke run compiles on first use and skips that verdict). Failures go
    to `report`; prints and returns each variant's row: overlapped steps, accepted draft tokens per
    verification, seconds per output token of one request (GPU only, else nan), compiles after warm-up."""
    import gc

    from jaxserve.engine.engine import Engine

    base = dict(model_path=model_path, max_total_tokens=8192, max_running_requests=16, chunked_prefill_size=256,
                context_length=1024, disable_precompile=not on_gpu)
    reference, rows = None, {}
    for name, variant in ENGINE_VARIANTS.items():
        engine = Engine(**base, **variant)
        if reference is None:
            free = engine.generate(list(ENGINE_PROMPTS), {"max_new_tokens": 32, "temperature": 0, "ignore_eos": True})
            params = engine_request_params(free)
        before = engine.stats.num_overlapped_steps
        outs = engine.generate(list(ENGINE_PROMPTS), params)
        got = [(o["output_ids"], o["meta_info"]["finish_reason"]) for o in outs]
        overlapped = engine.stats.num_overlapped_steps - before
        if reference is None:
            reference = got
        elif got != reference:
            bad = [i for i, (a, b) in enumerate(zip(got, reference)) if a != b]
            report.failures.append(f"engine, {name}: greedy outputs differ from {next(iter(ENGINE_VARIANTS))} (requests {bad})")
        if variant.get("disable_overlap_schedule") is False and overlapped == 0:
            report.failures.append(f"engine, {name}: no step was overlapped")
        seconds = time_per_output_token(engine, ENGINE_PROMPTS[0]) if on_gpu else float("nan")
        compiles = engine.runner.num_compiles_after_warmup
        if on_gpu and compiles:
            report.failures.append(f"engine, {name}: {compiles} compiles after warm-up")
        stats = engine.stats
        accepted = (stats.num_spec_accepted_tokens / stats.num_spec_verifications) if stats.num_spec_verifications else 0.0
        rows[name] = dict(overlapped=overlapped, accepted=accepted, seconds=seconds, compiles=compiles)
        del engine
        gc.collect()
    print(f"  {'variant':<22} {'overlapped steps':>16} {'accepted/verify':>15} {'ms/token, 1 req':>16} {'compiles':>9}")
    for name, r in rows.items():
        print(f"  {name:<22} {r['overlapped']:>16} {r['accepted']:>15.2f} {r['seconds'] * 1e3:>16.2f} {r['compiles']:>9}")
    return rows


def run_quant_matmul_check(on_gpu: bool, iters: int, report: Report) -> None:
    """The Pallas quantized matmul (jaxserve/quant/pallas_matmul.py) on SmolLM2's projection shapes and the
    tied head, q8_0 and q4_1, at T = 1, 8 and 256: against the dequantized reference, and timed against the XLA
    path (dequantize, then a float32 dot) with the weight bytes each reads (interpret mode off a GPU: tiny
    shapes, correctness only)."""
    from jaxserve.quant import formats
    from jaxserve.quant.cpu_kernel import xla_matmul
    from jaxserve.quant.pallas_matmul import quant_matmul_pallas

    shapes = [(1536, 576), (576, 1536), (49152, 576)] if on_gpu else [(96, 64)]
    pack = {formats.Q8_0: formats.pack_q8_0, formats.Q4_1: formats.pack_q4_1, formats.Q5_0: formats.pack_q5_0}
    rng = np.random.default_rng(0)
    print(f"  {'format':6} {'W':>12} {'T':>4} {'pallas ms':>10} {'xla ms':>9} {'GB/s (pallas)':>14}")
    for fmt in formats.FORMATS:
        for out_features, in_features in shapes:
            arrays = {k: jnp.asarray(v) for k, v in pack[fmt](rng.standard_normal((out_features, in_features))).items()}
            for num_tokens in (1, 8, 256):
                x = jnp.asarray(rng.standard_normal((in_features, num_tokens)), jnp.float32)
                pallas = jax.jit(functools.partial(quant_matmul_pallas, fmt, interpret=not on_gpu))
                ref = formats.reference_matmul(fmt, arrays, x)
                report(f"quant matmul {fmt} {out_features}x{in_features} T={num_tokens}",
                       max_rel_err(pallas(arrays, x), ref), 1e-4)
                if not on_gpu:
                    continue
                xla = jax.jit(functools.partial(xla_matmul, fmt))
                t_pallas, t_xla = time_call(pallas, arrays, x, iters=iters), time_call(xla, arrays, x, iters=iters)
                print(f"  {fmt:6} {out_features:>6}x{in_features:<5} {num_tokens:>4} {t_pallas * 1e3:10.3f} "
                      f"{t_xla * 1e3:9.3f} {formats.nbytes(arrays) / t_pallas / 1e9:14.1f}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--iters", type=int, default=20, help="timed calls per repeat")
    parser.add_argument("--no-tp", action="store_true", help="skip the tensor-parallel run over all GPUs")
    parser.add_argument("--engine-model", default="default",
                        help="model of the engine check (default: the default model, SmolLM2-135M-Instruct)")
    parser.add_argument("--no-engine", action="store_true", help="skip the engine check")
    parser.add_argument("--only-engine", action="store_true", help="run only the engine check")
    args = parser.parse_args()

    on_gpu = jax.default_backend() == "gpu"
    print(f"jax {jax.__version__}, python {sys.version.split()[0]}, device {jax.devices()[0].device_kind}")
    if not on_gpu:
        print("no GPU: tiny smoke run in Pallas interpret mode (correctness only; timings are meaningless)")
    report = Report()
    if not args.only_engine:
        setup = build_setup(GPU_SIZES if on_gpu else SMOKE_SIZES, interpret=not on_gpu)
        print("correctness")
        ref_dec = check_correctness(setup, report)
        print("timing" + ("" if on_gpu else " (interpret mode: meaningless)"))
        iters = args.iters if on_gpu else 2
        rows = run_timings(setup, ref_dec, iters, report)
        print_table(rows, copy_bandwidth(2**30 if on_gpu else 2**20, iters), setup)
        print("quantized matmul (Pallas)")
        run_quant_matmul_check(on_gpu, iters, report)
        if on_gpu and jax.device_count() > 1 and not args.no_tp:
            run_tp_check(jax.device_count(), report)
    if not args.no_engine:
        print(f"engine: {args.engine_model}, overlap schedule off / on / on with NGRAM speculation")
        run_engine_check(args.engine_model, report, on_gpu)
    print("FAIL: " + ", ".join(report.failures) if report.failures else "PASS")
    return 1 if report.failures else 0


if __name__ == "__main__":
    sys.exit(main())
