"""The torch-free GGUF tokenizer equals transformers' own GGUF conversion; cache behaviour."""

from __future__ import annotations

import os

import pytest

from jaxserve.model.gguf_tokenizer import read_tokenizer_metadata
from jaxserve.model.tokenizer import DEFAULT_MODEL_GGUF, default_model_path, load_tokenizer
from tests.model.gguf_reference import assert_same_values, reader_metadata

TEXTS = [
    "The quick brown fox jumps over the lazy dog.",
    "  leading spaces, naïve café über, 数字 12345 and emoji 🦊🔥",
    "def f(x):\n\treturn x ** 2  # comment\n",
    "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n",
]


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("jaxserve_cache")


@pytest.fixture(scope="module")
def ours(cache_dir):
    """Built from the GGUF file through `load_tokenizer` with an empty cache (so it is written there)."""
    mp = pytest.MonkeyPatch()
    mp.setenv("JAXSERVE_CACHE_DIR", str(cache_dir))
    try:
        return load_tokenizer("default")
    finally:
        mp.undo()


def test_matches_transformers_gguf_conversion(ours):
    pytest.importorskip("torch")  # transformers' own GGUF reader needs torch
    from transformers import AutoTokenizer

    path = default_model_path()
    ref = AutoTokenizer.from_pretrained(os.path.dirname(path), gguf_file=DEFAULT_MODEL_GGUF)
    for text in TEXTS:
        assert ours.encode(text) == ref.encode(text), text
        assert ours.decode(ours.encode(text)) == ref.decode(ref.encode(text))
    messages = [{"role": "user", "content": "hi"}]
    assert ours.apply_chat_template(messages, tokenize=False, add_generation_prompt=True) == \
        ref.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert (ours.eos_token_id, ours.bos_token_id) == (ref.eos_token_id, ref.bos_token_id)


def assert_metadata_is_what_gguf_reader_gave(path: str) -> None:
    """`read_tokenizer_metadata` against the GGUFReader loop it replaced: same keys in the same order,
    same values of the same types (the vocabulary's strings, scores, token types, merges)."""
    pytest.importorskip("gguf")
    meta = read_tokenizer_metadata(path)
    assert_same_values(meta, reader_metadata(path, lambda k: k == "general.architecture" or k.startswith("tokenizer.")))
    assert len(meta["tokenizer.ggml.tokens"]) > 1000


def test_metadata_is_what_gguf_reader_gave():
    assert_metadata_is_what_gguf_reader_gave(default_model_path())


@pytest.mark.slow  # GGUFReader takes about 8 s over Gemma 3's 262,144-entry vocabulary
def test_gemma3_metadata_is_what_gguf_reader_gave(gemma3_gguf):
    assert_metadata_is_what_gguf_reader_gave(gemma3_gguf)


def test_cached_copy_is_identical(ours, cache_dir, monkeypatch):
    assert any((cache_dir / "tokenizers").iterdir())
    monkeypatch.setenv("JAXSERVE_CACHE_DIR", str(cache_dir))
    cached = load_tokenizer("default")
    for text in TEXTS:
        assert cached.encode(text) == ours.encode(text)
    assert cached.chat_template == ours.chat_template


def test_missing_tokenizer_path():
    with pytest.raises(FileNotFoundError, match="tokenizer path does not exist"):
        load_tokenizer("default", tokenizer_path="/nope/tokenizer")
