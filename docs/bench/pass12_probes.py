"""Issue 20, twelfth pass: the throwaway probes behind docs/benchmarks.md's "Twelfth pass" (kept so the
numbers there can be rerun; not part of the engine or its tests).

    python docs/bench/pass12_probes.py attention-share [--context 200]   # step time with and without attention
    python docs/bench/pass12_probes.py attention-floor                   # the XLA path against a loop-free floor
    python docs/bench/pass12_probes.py head-bandwidth                     # the output head's matvec against a plain read
    python docs/bench/pass12_probes.py head-screen                        # int8 screening of the head with an exact bound
    python docs/bench/pass12_probes.py class-drafts                       # n-gram drafts matched on normalized token text

The last two need torch and transformers (the reference models of the test suite: `pip install -e
".[dev]"`); the model is the default GGUF, read by transformers.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "scripts")]


def _median_ms(fn, repeats: int = 30) -> float:
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return float(np.median(times)) * 1e3


def attention_share(context: int) -> None:
    """The engine's host-loop step (bench_verify's runner) with the XLA attention and with attention
    replaced by the identity (K/V still written), timed alternating in one process."""
    import bench_model
    import bench_verify
    from jaxserve.engine.model_runner import BatchEntry
    from jaxserve.model.loader import load_model
    from jaxserve.pallas.reference import ragged_paged_attention_xla

    config, params = load_model("default", "float32")
    prompt = [int(x) for x in np.random.default_rng(0).integers(3, config.vocab_size, size=context)]
    pages_per_seq = context // bench_model.PAGE_SIZE + 2
    variants = {"xla": ragged_paged_attention_xla, "none": lambda q, kp, vp, layer, meta, sm: q}
    fns = {}
    for name, attn in variants.items():
        runner = bench_verify.runner_with(config, params, attn, 8, context + 2 * bench_model.PAGE_SIZE)
        tables = [list(range(1 + s * pages_per_seq, 1 + (s + 1) * pages_per_seq)) for s in range(8)]
        for table in tables:
            runner.forward([BatchEntry(prompt, 0, table)]).block_until_ready()
        cases = {"decode, batch 1": [BatchEntry(prompt[-1:], context, tables[0])],
                 "verify 8 tokens, batch 1": [BatchEntry(prompt[-8:], context, tables[0], num_logits=8)],
                 "decode, batch 8": [BatchEntry(prompt[-1:], context, t) for t in tables]}
        for case, entries in cases.items():
            fns[(name, case)] = lambda r=runner, e=entries: r.forward(e).block_until_ready()
    times = bench_model.timed_alternating(fns, 15, np.median)
    print(f"| step ({context} cached tokens) | with attention (ms) | attention as identity (ms) | attention's share |")
    print("|---|---|---|---|")
    for case in ("decode, batch 1", "verify 8 tokens, batch 1", "decode, batch 8"):
        a, b = times[("xla", case)] * 1e3, times[("none", case)] * 1e3
        print(f"| {case} | {a:.2f} | {b:.2f} | {(a - b) / a:.0%} |")


def attention_floor() -> None:
    """30 chained calls of the XLA attention (batch 1, one decode token, 200 cached tokens, the page
    table of a 4096-token bucket) against a floor with no loops: one static 256-key chunk."""
    import jax
    import jax.numpy as jnp

    from jaxserve.pallas.metadata import build_attention_metadata
    from jaxserve.pallas.reference import _MASK_VALUE, ragged_paged_attention_xla

    layers, pages, kvh, ps, d, h, n = 30, 300, 3, 16, 64, 9, 200
    rng = np.random.default_rng(0)
    k_pool = jnp.asarray(rng.standard_normal((layers, pages, kvh, ps, d), np.float32))
    v_pool = jnp.asarray(rng.standard_normal((layers, pages, kvh, ps, d), np.float32))
    meta = build_attention_metadata([1], [n], [list(range(1, 2 + n // ps))], num_tokens=1, num_seqs=1,
                                    pages_per_seq=256, block_q=1).to_device()
    q = jnp.asarray(rng.standard_normal((1, h, d), np.float32))

    def floor(q, k_pool, v_pool, layer, meta, sm_scale):
        table = meta.page_table[0, :16]
        k = k_pool[layer, table].transpose(1, 0, 2, 3).reshape(kvh, 256, d)
        v = v_pool[layer, table].transpose(1, 0, 2, 3).reshape(kvh, 256, d)
        s = jnp.einsum("krd,ksd->krs", q.reshape(kvh, h // kvh, d), k) * sm_scale
        s = jnp.where(jnp.arange(256)[None, None] < meta.seq_kv_len[0], s, _MASK_VALUE)
        return jnp.einsum("krs,ksd->krd", jax.nn.softmax(s, -1), v).reshape(1, h, d)

    def chained(attn):
        def run(q, k_pool, v_pool, meta):
            for layer in range(layers):
                q = attn(q, k_pool, v_pool, jnp.int32(layer), meta, 0.125) * 1.0001
            return q
        return jax.jit(run)

    outs = {}
    for name, attn in (("XLA path", ragged_paged_attention_xla), ("loop-free floor", floor)):
        fn = chained(attn)
        outs[name] = fn(q, k_pool, v_pool, meta)
        print(f"{name}: {_median_ms(lambda: fn(q, k_pool, v_pool, meta).block_until_ready()):.2f} ms for 30 layers")
    np.testing.assert_allclose(*outs.values(), rtol=1e-4, atol=1e-5)


def head_bandwidth() -> None:
    """The default model's output head shape [49152, 576] float32 (113 MB) at one token: W @ x,
    x^T @ W^T, and a plain sum over the same array (a read with no product)."""
    import jax
    import jax.numpy as jnp

    w = jnp.asarray(np.random.default_rng(0).standard_normal((49152, 576), np.float32) * 0.05)
    x = jnp.asarray(np.random.default_rng(1).standard_normal((576, 1), np.float32))
    cases = {"W @ x": (jax.jit(lambda w, x: w @ x), (w, x)), "x^T @ W^T": (jax.jit(lambda w, x: x.T @ w.T), (w, x)),
             "sum(W)": (jax.jit(lambda w: w.sum()), (w,))}
    for name, (fn, args) in cases.items():
        ms = _median_ms(lambda: fn(*args).block_until_ready())
        print(f"{name}: {ms:.2f} ms, {w.nbytes / ms / 1e6:.1f} GB/s")


def _hf_model():
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from jaxserve.model.loader import resolve_model_path

    path = resolve_model_path("default")
    folder, name = os.path.dirname(path), os.path.basename(path)
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    return torch, tokenizer, AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)


def head_screen() -> None:
    """Greedy head screening: int8 logits (per-row weight scale, per-token activation scale) pick K
    candidates, float32 logits of those decide, and the pick is provably the argmax when the best
    candidate beats every other row's int8 logit plus its error bound (|W - W8| <= s_w / 2 per
    weight, |x - x8| <= s_x / 2 per feature). How often that holds, over the final hidden states of
    greedy copy-heavy outputs."""
    import bench_datasets

    torch, tokenizer, model = _hf_model()
    head = model.lm_head.weight.detach().numpy().astype(np.float32)
    w_scale = np.abs(head).max(1) / 127
    w8 = np.round(head / w_scale[:, None]).clip(-127, 127)
    w8_l1 = np.abs(w8).sum(1) * w_scale
    rng, hidden = np.random.default_rng(0), []
    for task in bench_datasets.COPY_HEAVY_TASKS:
        for _ in range(3):
            ids = tokenizer(bench_datasets._copy_heavy_prompt(task, rng, 6), return_tensors="pt").input_ids
            out = model.generate(ids, max_new_tokens=64, do_sample=False)
            with torch.no_grad():
                states = model(out, output_hidden_states=True).hidden_states[-1][0].numpy()
            hidden.append(states[ids.shape[1] - 1 :])
    hidden = np.concatenate(hidden)
    exact = hidden @ head.T
    print(f"{len(hidden)} positions")
    for k in (4, 8, 16, 64):
        proven, bounds = 0, []
        for x, logits in zip(hidden, exact):
            x_scale = np.abs(x).max() / 127
            approx = (w8 @ np.round(x / x_scale)) * w_scale * x_scale
            bound = w_scale / 2 * np.abs(x).sum() + w8_l1 * x_scale / 2
            top = np.argpartition(-approx, k)[:k]
            rest = np.ones(len(approx), bool)
            rest[top] = False
            proven += logits[top].max() > (approx[rest] + bound[rest]).max()
            bounds.append(np.median(bound))
        print(f"K = {k}: argmax proven at {proven / len(hidden):.0%} of positions; median bound {np.median(bounds):.2f} logits")


def class_drafts() -> None:
    """Replays greedy outputs as verification steps (as bench_draft_headroom does) with today's draft
    against one matched on token classes (the token's text lowercased, its leading space dropped), so
    that a word copied after a quote or at a sentence start still matches the prompt's copy."""
    import bench_datasets
    from jaxserve.engine.speculative.ngram import ngram_match

    _, tokenizer, model = _hf_model()
    texts = tokenizer.convert_ids_to_tokens(list(range(len(tokenizer))))
    keys: dict[str, int] = {}
    classes = np.array([keys.setdefault(t.replace("\u0120", "").lower() or t, len(keys)) for t in texts])
    num_draft = 15

    def class_draft(ctx: np.ndarray) -> list[int]:
        own = ngram_match(ctx, num_draft)
        c = classes[ctx]
        if ngram_match(c, 1).match_len <= own.match_len:
            return own.draft
        last, ends, w = len(c) - 1, np.flatnonzero(c[:-1] == c[-1]), 1
        while w < min(18, len(c) - 1):
            ok = ends >= w
            ok[ok] &= c[ends[ok] - w] == c[last - w]
            if not ok.any():
                break
            ends, w = ends[ok], w + 1
        end = int(ends[-1])
        return [int(ctx[end + 1 + j % (last - end)]) for j in range(num_draft)]

    def steps(seq: list[int], start: int, draft_of) -> int:
        i, n = start, 0
        while i < len(seq):
            draft = draft_of(np.asarray(seq[:i]))
            accepted = 0
            while accepted < len(draft) and i + accepted < len(seq) and draft[accepted] == seq[i + accepted]:
                accepted += 1
            i, n = i + accepted + 1, n + 1
        return n

    rng = np.random.default_rng(5)
    print("| task | output tokens | steps, today's drafts | steps, class-matched drafts |\n|---|---|---|---|")
    for task in bench_datasets.COPY_HEAVY_TASKS:
        total, today, by_class = 0, 0, 0
        for _ in range(4):
            ids = tokenizer(bench_datasets._copy_heavy_prompt(task, rng, 6), return_tensors="pt").input_ids
            out = model.generate(ids, max_new_tokens=64, do_sample=False)[0].tolist()
            total += len(out) - ids.shape[1]
            today += steps(out, ids.shape[1], lambda ctx: ngram_match(ctx, num_draft).draft)
            by_class += steps(out, ids.shape[1], class_draft)
        print(f"| {task} | {total} | {today} | {by_class} |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("probe", choices=["attention-share", "attention-floor", "head-bandwidth", "head-screen", "class-drafts"])
    ap.add_argument("--context", type=int, default=200)
    args = ap.parse_args()
    {"attention-share": lambda: attention_share(args.context), "attention-floor": attention_floor,
     "head-bandwidth": head_bandwidth, "head-screen": head_screen, "class-drafts": class_drafts}[args.probe]()


if __name__ == "__main__":
    main()
