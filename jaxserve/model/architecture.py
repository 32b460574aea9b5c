"""Which architectures jaxserve serves, and a checkpoint's architecture read in milliseconds.

A model whose architecture jaxserve does not implement must be refused before anything expensive
runs: building a GGUF's tokenizer took ~25 CPU-seconds for Gemma 3's 262,144-entry vocabulary, and
the weights more. So this module reads only what names the architecture: an HF directory's
`config.json` (`architectures`, else `model_type`), or a GGUF file's key/value header up to
`general.architecture` (llama.cpp writes it first; `gguf_header.read_gguf_value` stops there, and
walks past at most the keys before it without parsing the vocabulary). It imports neither jax nor
transformers, so the launch path can call it before anything heavy loads.

The tables are data: `ARCHITECTURES` (HF names) and `GGUF_ARCHITECTURES` (GGUF `general.architecture`
-> HF name). `jaxserve.model.registry` maps each HF name to its implementation, and a test checks
that both list the same names.
"""

from __future__ import annotations

import json
import os

from jaxserve.model.gguf_header import read_gguf_value

# HF `architectures` names that jaxserve implements
ARCHITECTURES = (
    "Gemma2ForCausalLM",
    "Gemma3ForCausalLM",
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
)
# GGUF `general.architecture` -> the HF architecture it loads as (llama.cpp names Mistral "llama")
GGUF_ARCHITECTURES = {
    "gemma2": "Gemma2ForCausalLM",
    "gemma3": "Gemma3ForCausalLM",
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
}
# HF `model_type` -> architecture, for a config.json without `architectures`
MODEL_TYPES = {
    "gemma2": "Gemma2ForCausalLM",
    "gemma3_text": "Gemma3ForCausalLM",
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
}

_ARCH_KEY = "general.architecture"


def unsupported_message(architecture: str, kind: str = "") -> str:
    """'unsupported [GGUF ]architecture 'X'; supported: ...' (the GGUF names for a GGUF file)."""
    names = sorted(GGUF_ARCHITECTURES) if kind == "GGUF" else ARCHITECTURES
    return f"unsupported {kind + ' ' if kind else ''}architecture {architecture!r}; supported: {', '.join(names)}"


def hf_architecture(config: dict) -> str:
    """The architecture an HF config dict names: `architectures[0]`, else its `model_type` mapped
    through `MODEL_TYPES` (the model type itself when it is not there)."""
    archs = config.get("architectures") or []
    if archs:
        return archs[0]
    model_type = config.get("model_type", "")
    return MODEL_TYPES.get(model_type, model_type)


def read_gguf_architecture(path: str) -> str:
    """`general.architecture` of a GGUF file, read from its header (the keys before it are skipped
    by their sizes; llama.cpp writes it first, so usually nothing is skipped).

    Raises:
        ValueError: not a GGUF file, a truncated header, or no `general.architecture` key.
    """
    return read_gguf_value(path, _ARCH_KEY)


def checkpoint_architecture(path: str) -> tuple[str, str]:
    """(architecture, kind) of a checkpoint: a GGUF file's `general.architecture` with kind "GGUF",
    or an HF directory's architecture (`hf_architecture` of its config.json) with kind "".

    Raises:
        FileNotFoundError: a directory without config.json.
        ValueError: an unreadable GGUF header or config.json.
    """
    if os.path.isdir(path):
        config_path = os.path.join(path, "config.json")
        if not os.path.isfile(config_path):
            raise FileNotFoundError(f"no config.json in directory {path}")
        try:
            with open(config_path) as f:
                return hf_architecture(json.load(f)), ""
        except (OSError, json.JSONDecodeError) as e:
            raise ValueError(f"{config_path}: cannot read it: {e}") from None
    return read_gguf_architecture(path), "GGUF"


def architecture_problem(path: str) -> str | None:
    """Why the checkpoint at `path` cannot be served because of its architecture (the message names it
    and lists the supported ones), or None. Reads only config.json or the GGUF header; a path that is
    neither a directory with config.json nor a `.gguf` file is left to the loader's own errors (None).

    Raises:
        ValueError: an unreadable GGUF header or config.json.
    """
    is_hf_dir = os.path.isfile(os.path.join(path, "config.json"))
    if not is_hf_dir and not (os.path.isfile(path) and path.endswith(".gguf")):
        return None
    arch, kind = checkpoint_architecture(path)
    supported = GGUF_ARCHITECTURES if kind == "GGUF" else ARCHITECTURES
    return None if arch in supported else unsupported_message(arch, kind)


def check_architecture(path: str) -> None:
    """Raise ValueError with `architecture_problem`'s message when `path`'s architecture is not served.

    Raises:
        ValueError: unsupported, or an unreadable GGUF header or config.json.
    """
    if (problem := architecture_problem(path)) is not None:
        raise ValueError(problem)
