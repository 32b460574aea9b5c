"""A transformers fast tokenizer built from a GGUF file's metadata, without torch.

transformers converts GGUF tokenizers itself (`transformers.integrations.gguf`), but its GGUF file
reader imports torch, which jaxserve does not depend on at run time. This module reads the metadata
with `gguf_header` instead (the values `gguf.GGUFReader` gives, tests/model/test_tokenizer.py checks
it on the real GGUFs; Gemma 3's 262,144-entry vocabulary in 0.07-0.13 s where GGUFReader took
10-12 s, on the shared 2-core machine at load average 5) and hands it to transformers' own converter
(`convert_gguf_tokenizer`), so the vocabulary, merges, pre-tokenizer split and special tokens are
exactly what `AutoTokenizer.from_pretrained(dir, gguf_file=...)` builds (tests/model/test_tokenizer.py
checks it against that path).
"""

from __future__ import annotations

from typing import Any

from jaxserve.model.gguf_header import read_gguf_header


def read_tokenizer_metadata(path: str) -> dict[str, Any]:
    """The `general.architecture` and `tokenizer.*` keys of a GGUF file (tokens and merges as lists),
    as `gguf.GGUFReader`'s `ReaderField.contents()` gives them; the other keys are skipped unread.

    Raises:
        ValueError: an unreadable GGUF header (`gguf_header.read_gguf_header`).
    """
    return read_gguf_header(path, keep_key=_is_tokenizer_key).metadata


def _is_tokenizer_key(key: str) -> bool:
    return key == "general.architecture" or key.startswith("tokenizer.")


def tokenizer_from_gguf(path: str):
    """Build a `PreTrainedTokenizerFast` (with chat template and special tokens) from a GGUF file.

    Raises:
        ValueError: the file has no tokenizer metadata or a tokenizer type transformers cannot convert.
    """
    from transformers import PreTrainedTokenizerFast
    from transformers.integrations.gguf.gguf_tokenizer_mapping import (
        _SPECIAL_TOKENS,
        GGUF_TOKENIZER_MAPPING,
        convert_gguf_tokenizer,
    )

    meta = read_tokenizer_metadata(path)
    if "tokenizer.ggml.tokens" not in meta:
        raise ValueError(f"{path} has no tokenizer metadata; pass --tokenizer-path")
    grouped = {
        group: {name: meta[f"tokenizer.{key}"] for key, name in renames.items() if f"tokenizer.{key}" in meta}
        for group, renames in GGUF_TOKENIZER_MAPPING.items()
    }
    tokenizer_dict, config = grouped["tokenizer"], grouped["tokenizer_config"]
    if tokenizer_dict.get("tokenizer_type") == "llama":
        config.setdefault("add_bos_token", True)  # llama.cpp's default for sentencepiece vocabularies
    for name, key in _SPECIAL_TOKENS.items():
        token_id = meta.get(f"tokenizer.ggml.{key}")
        config[name] = tokenizer_dict["tokens"][token_id] if token_id is not None else None
    backend, extra = convert_gguf_tokenizer(meta["general.architecture"], tokenizer_dict)
    config.update(extra)
    return PreTrainedTokenizerFast(tokenizer_object=backend, **config)
