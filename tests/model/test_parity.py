"""Numerical parity of our forward with transformers' PyTorch implementation on the same weights."""

from __future__ import annotations

import os

import numpy as np
import pytest

from jaxserve.model import functional
from jaxserve.model.loader import load_model
from jaxserve.model.tokenizer import DEFAULT_MODEL_GGUF, default_model_path
from tests.conftest import make_hf_checkpoint
from tests.model.helpers import SingleSequence

torch = pytest.importorskip("torch")


def rel_l2(ours: np.ndarray, ref: np.ndarray) -> np.ndarray:
    """Relative L2 error per position: ||ours - ref|| / ||ref|| over the vocabulary axis."""
    return np.linalg.norm(ours - ref, axis=-1) / np.linalg.norm(ref, axis=-1)


@pytest.fixture(scope="module")
def default_model():
    return load_model("default", "float32")


@pytest.fixture(scope="module")
def torch_default_model():
    from transformers import AutoModelForCausalLM

    path = default_model_path()
    torch.set_num_threads(2)
    model = AutoModelForCausalLM.from_pretrained(
        os.path.dirname(path), gguf_file=DEFAULT_MODEL_GGUF, dtype=torch.float32
    )
    return model.eval()


def _prompts(tokenizer) -> list[list[int]]:
    long_text = " ".join(f"Item {i}: the {['red', 'green', 'blue'][i % 3]} box holds {i * 7} marbles." for i in range(50))
    texts = [
        "The capital of France is",
        "def fibonacci(n):\n    ",
        "Once upon a time, in a land far away, there lived a",
        long_text,
    ]
    ids = [tokenizer.encode(t, add_special_tokens=False) for t in texts]
    assert len(ids[3]) > 600
    return ids


@pytest.mark.slow
def test_default_model_logits_match_transformers(default_model, torch_default_model, default_tokenizer):
    config, params = default_model
    for ids in _prompts(default_tokenizer):
        seq = SingleSequence(config, params, page_size=16, max_tokens=1024)
        ours = seq.all_logits(ids)
        with torch.no_grad():
            ref = torch_default_model(torch.tensor([ids])).logits[0].numpy()
        err = rel_l2(ours, ref)
        assert err.max() <= 1e-4, f"max relative L2 error {err.max():.2e} at position {err.argmax()} of {len(ids)}"


@pytest.mark.slow
@pytest.mark.parametrize("page_size,layer_loop", [(1, "scan"), (16, "host")])
def test_default_model_greedy_matches_transformers(
    default_model, torch_default_model, default_tokenizer, page_size, layer_loop
):
    config, params = default_model
    questions = [
        "What is the capital of France?",
        "Write a haiku about the sea.",
        "List three prime numbers.",
        "How do I reverse a list in Python?",
        "Explain gravity in one sentence.",
    ]
    for q in questions:
        prompt = default_tokenizer.apply_chat_template(
            [{"role": "user", "content": q}], tokenize=True, add_generation_prompt=True
        )
        prompt = list(prompt["input_ids"] if isinstance(prompt, dict) or hasattr(prompt, "keys") else prompt)
        seq = SingleSequence(config, params, page_size=page_size, max_tokens=256, layer_loop=layer_loop)
        ours = seq.greedy(prompt, 32)
        with torch.no_grad():
            # explicit attention mask: the chat template contains <|im_end|>, which is also the pad id
            ids = torch.tensor([prompt])
            ref = torch_default_model.generate(
                ids, attention_mask=torch.ones_like(ids), max_new_tokens=32, do_sample=False,
                eos_token_id=None, pad_token_id=2,
            )[0, len(prompt):].tolist()
        assert ours == ref, f"greedy tokens differ for {q!r}"


@pytest.mark.slow
def test_chunked_extend_equals_one_shot_prefill(default_model, default_tokenizer):
    config, params = default_model
    ids = _prompts(default_tokenizer)[3][:300]
    one_shot = SingleSequence(config, params, page_size=16, max_tokens=512).last_logits(ids)
    chunked = SingleSequence(config, params, page_size=16, max_tokens=512)
    cuts = [0, 97, 211, len(ids)]
    for a, b in zip(cuts, cuts[1:]):
        last = chunked.last_logits(ids[a:b], prefix_len=a)
    err = np.linalg.norm(last - one_shot) / np.linalg.norm(one_shot)
    assert err <= 1e-5, err


TINY = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
            rms_norm_eps=1e-6, tie_word_embeddings=False, initializer_range=0.2)
ARCH_CASES = {
    "qwen2": ("Qwen2ForCausalLM", dict(TINY, rope_theta=1e6)),
    "qwen3": ("Qwen3ForCausalLM", dict(TINY, head_dim=32, rope_theta=1e6)),
    "llama3-rope": ("LlamaForCausalLM", dict(TINY, head_dim=16, rope_theta=500000.0, rope_scaling={
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64})),
    "llama-linear-rope": ("LlamaForCausalLM", dict(TINY, rope_scaling={"rope_type": "linear", "factor": 4.0})),
    "mistral": ("MistralForCausalLM", dict(TINY, head_dim=16, sliding_window=None)),
    # windows far shorter than the 200-token prompt (and than the host loop's 120-token chunk)
    "mistral-window": ("MistralForCausalLM", dict(TINY, head_dim=16, sliding_window=24)),
    "gemma2": ("Gemma2ForCausalLM", dict(TINY, num_hidden_layers=4, head_dim=16, sliding_window=24,
                                         query_pre_attn_scalar=24, attn_logit_softcapping=5.0,
                                         final_logit_softcapping=3.0)),
    "gemma3": ("Gemma3ForCausalLM", dict(
        TINY, num_hidden_layers=4, head_dim=16, sliding_window=24, query_pre_attn_scalar=24,
        layer_types=["sliding_attention", "sliding_attention", "full_attention", "sliding_attention"],
        rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 1e6},
                         "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}})),
}


@pytest.mark.parametrize("case", sorted(ARCH_CASES))
def test_tiny_checkpoints_match_transformers(tmp_path, case):
    import transformers

    arch, cfg = ARCH_CASES[case]
    path = make_hf_checkpoint(tmp_path / case, arch, cfg, seed=1, norm_noise=0.5 if "gemma" in case else 0.0)
    config, params = load_model(path, "float32", use_weights_cache=False)
    assert config.architecture == arch
    ids = list(np.random.default_rng(0).integers(0, cfg["vocab_size"], size=200))
    # functional.forward over stacked layers runs lax.scan
    stacked = functional.stack_layers(params)
    ours = SingleSequence(config, stacked, page_size=8, max_tokens=256).all_logits(ids)
    model = getattr(transformers, arch).from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        ref = model(torch.tensor([ids])).logits[0].numpy()
    err = rel_l2(ours, ref)
    assert err.max() <= 1e-4, f"{case}: max relative L2 error {err.max():.2e}"
    # over per-layer params (what the loader returns, the host loop's storage) it unrolls the layers
    unrolled = SingleSequence(config, params, page_size=8, max_tokens=256).all_logits(ids)
    err = rel_l2(unrolled, ref)
    assert err.max() <= 1e-4, f"{case}: unrolled layers, max relative L2 error {err.max():.2e}"
    # the engine's host layer loop (per-layer buffers, jitted groups of layers) on a chunked prompt:
    # both layers in one call, and one layer per call (two calls)
    for per_call in (2, 1):
        host = SingleSequence(config, params, page_size=8, max_tokens=256, max_extend=128, layer_loop="host",
                              max_layers_per_call=per_call)
        assert host.runner.layers_per_call == per_call
        host.last_logits(ids[:120])
        last = host.last_logits(ids[120:], prefix_len=120)
        err = rel_l2(last, ref[-1])
        assert err <= 1e-4, f"{case}: host layer loop, {per_call} per call, relative L2 error {err:.2e}"
