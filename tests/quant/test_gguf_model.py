"""The default model (SmolLM2-135M, Q4_1 layers and a Q8_0 tied embedding) with `--quantization gguf`:
its weights stay in blocks, bit-exact to the float loader's dequantization, and its outputs equal the
float model's up to float32 summation order, in the functional forward and in the runner's steps."""

from __future__ import annotations

import os

import jax
import numpy as np
import pytest

from jaxserve.model import functional
from jaxserve.model.loader import load_model
from jaxserve.model.tokenizer import resolve_model_path
from jaxserve.quant import formats
from tests.model.helpers import SingleSequence

pytestmark = pytest.mark.slow
PROMPT = [1, 504, 3458, 282, 4649, 314, 1638, 30, 378, 1095, 2098, 28, 2117]
NUM_NEW = 16


@pytest.fixture(scope="module")
def float_model():
    return load_model("default", "float32")


@pytest.fixture(scope="module")
def block_model():
    return load_model("default", "float32", quantization="gguf")


def test_weights_stay_in_the_files_blocks(block_model):
    config, params = block_model
    assert dict(config.weight_formats) == {"embed": formats.Q8_0, "wqkv": formats.Q4_1, "wo": formats.Q4_1,
                                           "w_gate_up": formats.Q4_1, "w_down": formats.Q4_1}
    leaves = jax.tree.leaves(params)
    resident = sum(leaf.nbytes for leaf in leaves)
    assert resident <= 1.25 * os.path.getsize(resolve_model_path("default"))
    assert all(leaf.ndim == 1 or leaf.dtype != np.float32 for leaf in leaves)  # only norms stay float32


def test_blocks_dequantize_to_the_float_loaders_weights(float_model, block_model):
    """Every block weight, dequantized, equals the float loader's (gguf's dequantization) bit for bit,
    in the params' own row order (q, k, v regrouped per kv head; gate rows before up rows)."""
    config, ours = block_model
    _, ref = float_model

    def check(block, fmt, expected):
        arrays = {f: block[name] for f, name in zip(formats.FIELDS[fmt], ("qs", "scale", "min"))}
        got = formats.dequantize_numpy(fmt, {k: np.asarray(v) for k, v in arrays.items()})
        np.testing.assert_array_equal(got, np.asarray(expected).reshape(got.shape))

    check({"qs": ours["embed"], "scale": ours["embed_scale"]}, formats.Q8_0, ref["embed"])
    for i in (0, config.num_layers - 1):
        for group, name in [("attention", "wqkv"), ("attention", "wo"), ("mlp", "w_gate_up"), ("mlp", "w_down")]:
            p = ours["layers"][i][group]
            check({"qs": p[name], "scale": p[f"{name}_scale"], "min": p[f"{name}_min"]}, formats.Q4_1,
                  ref["layers"][i][group][name])


def test_logits_and_greedy_ids_equal_the_float_models(float_model, block_model):
    """The prompt's logits within float32 summation order of the float model's, and 16 greedy tokens
    decoded one step at a time (the CPU kernel's path) equal, through both layer loops."""
    runs = {}
    for name, (config, params) in [("float", float_model), ("gguf", block_model)]:
        seq = SingleSequence(config, params, page_size=16, max_tokens=256)
        runs[name] = seq.all_logits(PROMPT), seq.greedy(PROMPT, NUM_NEW)
    (ref_logits, ref_ids), (logits, ids) = runs["float"], runs["gguf"]
    err = np.linalg.norm(logits - ref_logits, axis=-1) / np.linalg.norm(ref_logits, axis=-1)
    assert err.max() <= 1e-5, err.max()
    assert ids == ref_ids
    config, params = block_model
    host = SingleSequence(config, params, page_size=16, max_tokens=256, layer_loop="host", max_layers_per_call=8)
    assert host.greedy(PROMPT, NUM_NEW) == ref_ids
    assert functional.compute_dtype(params) == np.float32


def test_engine_serves_the_blocks(float_model):
    """`Engine(quantization="gguf")`: greedy text equal to the float model's, decode steps of 1 and of 3
    sequences (the kernel) and a 40-token prompt (T > `KERNEL_MAX_TOKENS`: the XLA path); the memory
    report (start-up line, /get_server_info) counts the compressed weights."""
    from jaxserve.engine.engine import Engine

    config, params = float_model
    prompts = [PROMPT, PROMPT[:5], list(range(100, 140))]
    expected = [SingleSequence(config, params, page_size=16, max_tokens=256).greedy(p, 8) for p in prompts]
    engine = Engine(quantization="gguf", max_total_tokens=2048, max_running_requests=4, disable_precompile=True)
    try:
        outs = engine.generate(prompts, {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True})
        assert [o["output_ids"] for o in outs] == expected
        usage = engine.memory_usage()
        assert usage.arrays.weights_bytes <= 1.25 * os.path.getsize(resolve_model_path("default"))
        assert "weights 9" in usage.log_line()  # 9x.x MiB, not the float model's 5xx MiB
    finally:
        engine.close()
