"""W8A8 int8 projections (`--quantization w8a8_int8`): the blocked int8 product against a numpy brute
force of the same formula, the quantized model against transformers' float32 forward, the params
layout, and greedy speculation staying exact on the quantized engine."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve.model import functional
from jaxserve.model.loader import load_model
from jaxserve.quant import w8a8
from jaxserve.server_args import ServerArgs
from tests.conftest import make_hf_checkpoint
from tests.model.helpers import SingleSequence

torch = pytest.importorskip("torch")


def numpy_w8a8(w: np.ndarray, x: np.ndarray, block: int) -> np.ndarray:
    """y = W @ x with W int8 per row and x int8 per column and block of `block` inputs, in float64
    (the scheme of jaxserve.quant.w8a8, written independently: loops over blocks, int64 sums)."""
    w_scale = np.abs(w).max(axis=1) / 127.0
    w_scale[w_scale == 0] = 1.0
    qw = np.clip(np.round(w / w_scale[:, None]), -127, 127).astype(np.int64)
    y = np.zeros((w.shape[0], x.shape[1]))
    for start in range(0, w.shape[1], block):
        xb = x[start : start + block]
        x_scale = np.abs(xb).max(axis=0) / 127.0
        x_scale[x_scale == 0] = 1.0
        qx = np.clip(np.round(xb / x_scale[None, :]), -127, 127).astype(np.int64)
        y += (qw[:, start : start + block] @ qx) * x_scale[None, :]
    return y * w_scale[:, None]


@pytest.mark.parametrize("out_f,in_f,cols", [(96, 128, 1), (96, 128, 2), (40, 192, 7), (24, 48, 3)])
def test_int8_matmul_matches_numpy_brute_force(out_f, in_f, cols):
    rng = np.random.default_rng(out_f + in_f + cols)
    w = rng.standard_normal((out_f, in_f)).astype(np.float32)
    x = rng.standard_normal((in_f, cols)).astype(np.float32)
    x[5, 0] = 40.0  # an outlier feature: only its block's scale grows
    x[:, -1] = 0.0 if cols > 1 else x[:, -1]  # an all-zero token
    block = w8a8.ACT_BLOCK if in_f % w8a8.ACT_BLOCK == 0 else in_f
    assert w8a8.act_block(in_f) == block
    q, scale = w8a8.quantize_rows(jnp.asarray(w))
    assert q.dtype == jnp.int8 and q.shape == (in_f // block, out_f, block) and scale.shape == (out_f,)
    ours = np.asarray(jax.jit(w8a8.int8_matmul)(q, scale, jnp.asarray(x)))
    ref = numpy_w8a8(w.astype(np.float64), x.astype(np.float64), block)
    np.testing.assert_allclose(ours, ref, rtol=1e-5, atol=1e-5 * np.abs(ref).max())
    # and close to the float product: the two roundings of 8 bits each
    exact = w.astype(np.float64) @ x
    assert np.linalg.norm(ours - exact) / np.linalg.norm(exact) < 0.02


def test_quantize_rows_round_trip_and_zero_rows():
    rng = np.random.default_rng(0)
    w = rng.standard_normal((3, 8, 128)).astype(np.float32)
    w[1, 2] = 0.0
    q, scale = w8a8.quantize_rows(jnp.asarray(w))
    back = np.asarray(q, np.float32).transpose(1, 0, 2).reshape(24, 128) * np.asarray(scale)[:, None]
    flat = w.reshape(24, 128)
    assert np.all(np.abs(back - flat) <= np.abs(flat).max(axis=1, keepdims=True) / 254 + 1e-7)
    assert np.all(np.asarray(q)[:, 10] == 0) and scale[10] == 1.0


TINY = dict(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
            rms_norm_eps=1e-6, initializer_range=0.05)


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_quantized_tiny_model_near_transformers(tmp_path, tied):
    import transformers

    path = make_hf_checkpoint(tmp_path / "m", "LlamaForCausalLM", dict(TINY, tie_word_embeddings=tied), seed=3)
    config, params = load_model(path, "float32", use_weights_cache=False)
    qconfig, qparams = w8a8.quantize_params(config, params, "w8a8_int8")
    assert qconfig.quantization == "w8a8_int8" and "lm_head" not in qparams
    assert qparams["layers"][0]["mlp"]["w_down"].dtype == jnp.int8
    abstract = functional.abstract_params(qconfig)
    assert jax.tree.structure(qparams) == jax.tree.structure(abstract)
    assert all(a.shape == b.shape and a.dtype == b.dtype
               for a, b in zip(jax.tree.leaves(qparams), jax.tree.leaves(abstract)))
    ids = list(np.random.default_rng(0).integers(0, TINY["vocab_size"], size=100))
    model = transformers.LlamaForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        ref = model(torch.tensor([ids])).logits[0].numpy()
    for p, loop in ((qparams, "host"), (functional.stack_layers(qparams), "scan")):
        seq = SingleSequence(qconfig, p, page_size=8, max_tokens=256, layer_loop=loop)
        ours = seq.all_logits(ids)
        err = np.linalg.norm(ours - ref, axis=-1) / np.linalg.norm(ref, axis=-1)
        assert err.max() < 0.05, f"{loop}: max relative L2 error {err.max():.3f}"
        assert err.max() > 1e-4  # the int8 path ran (float32 matches to 1e-5, tests/model/test_parity.py)
        last = seq.last_logits(ids)  # the model runner's step (one logits row)
        assert np.linalg.norm(last - ref[-1]) / np.linalg.norm(ref[-1]) < 0.05
    # the float config is untouched and quantization None is the identity
    assert w8a8.quantize_params(config, params, None) == (config, params)


def test_unknown_quantization_and_tensor_parallel_refused():
    with pytest.raises(ValueError, match="--quantization"):
        w8a8.quantize_params(None, {}, "fp8")
    with pytest.raises(ValueError, match="--quantization w8a8_int8"):
        ServerArgs(quantization="w8a8_int8", tp_size=2).validate()
    # the Python API's unknown value, before anything loads, with every choice named
    with pytest.raises(ValueError, match="'bogus': choose one of gguf, q8_0, q4_1, w8a8_int8 or leave it out"):
        ServerArgs(quantization="bogus").validate()
    with pytest.raises(ValueError, match="--quantization gguf runs on one device"):
        ServerArgs(quantization="gguf", tp_size=2).validate()
    with pytest.raises(ValueError, match="--enable-lora runs on float weights"):
        ServerArgs(quantization="q4_1", enable_lora=True).validate()


def test_greedy_speculation_exact_on_quantized_engine(tiny_model_dir):
    from tests.speculative.test_spec_decode import GREEDY, assert_no_leak, copy_prompts, make_engine, spec_engine

    prompts = copy_prompts(6, seed=1)
    plain = make_engine(tiny_model_dir, quantization="w8a8_int8")
    assert plain.runner.model_config.quantization == "w8a8_int8"
    ref = [o["output_ids"] for o in plain.generate(prompts, GREEDY)]
    eng = spec_engine(tiny_model_dir, quantization="w8a8_int8")
    outs = [eng.generate(p, GREEDY)["output_ids"] for p in prompts]
    assert outs == ref
    assert eng.stats.num_spec_verifications > 0 and eng.stats.num_spec_accepted_tokens > 0
    assert_no_leak(eng)


def _step_logits(runner, entries):
    return np.asarray(runner.forward(entries))


@pytest.mark.parametrize("model", ["tiny", "default"])
def test_int8_logits_same_bits_in_every_step_shape(tiny_model_dir, model):
    """A token's int8 logits are the same bits decoded alone, beside another request, inside a
    speculative verification and inside a prefill (pallas/numerics.py): int8 rounding turns any
    last-bit difference into a different text, which made greedy speculation inexact."""
    from jaxserve.core.batch import BatchEntry
    from jaxserve.engine.engine import Engine
    from tests.speculative.test_spec_decode import make_engine

    if model == "default":  # SmolLM2-135M: where the break test found int8 speculation inexact
        eng = Engine(max_total_tokens=2048, chunked_prefill_size=64, context_length=512, disable_precompile=True,
                     max_running_requests=8, quantization="w8a8_int8")
    else:
        eng = make_engine(tiny_model_dir, quantization="w8a8_int8")
    r = eng.runner
    rng = np.random.default_rng(0)
    vocab = eng.runner.model_config.vocab_size
    toks = list(map(int, rng.integers(3, vocab, size=70)))
    p, k = 50, 5

    def table(first):
        return list(range(first, first + 4))

    _step_logits(r, [BatchEntry(toks[:p], 0, table(1))])
    decoded = [_step_logits(r, [BatchEntry([toks[p + i]], p + i, table(1))])[0] for i in range(k)]
    _step_logits(r, [BatchEntry(toks[:p], 0, table(10))])
    verified = _step_logits(r, [BatchEntry(toks[p:p + k], p, table(10), num_logits=k)])[:k]
    prefilled = _step_logits(r, [BatchEntry(toks[:p + k], 0, table(20), num_logits=k)])[:k]
    _step_logits(r, [BatchEntry(toks[:p], 0, table(30))])
    _step_logits(r, [BatchEntry(toks[5:p + 5], 0, table(40))])
    batched = [_step_logits(r, [BatchEntry([toks[p + i]], p + i, table(30)),
                                BatchEntry([toks[p + 5 + i]], p + i, table(40))])[0] for i in range(k)]
    for i in range(k):
        np.testing.assert_array_equal(verified[i], decoded[i])
        np.testing.assert_array_equal(prefilled[i], decoded[i])
        np.testing.assert_array_equal(batched[i], decoded[i])
