"""Which LoRA adapter an OpenAI request runs under: SGLang 0.5.23's `model: "<served-name>:<adapter>"`,
which wins over the request's `lora_path` (its `OpenAIServingBase._resolve_lora_path`)."""

from __future__ import annotations

from typing import Sequence


def adapter_in_model(model: str | None, served_model_name: str) -> str | None:
    """The adapter named by `model` ("<served-name>:<adapter>", or "<any>:<adapter>"), or None: no colon,
    exactly the served name (which may hold colons itself), or nothing after the colon."""
    if not model or ":" not in model or model == served_model_name:
        return None
    if model.startswith(f"{served_model_name}:"):
        adapter = model[len(served_model_name) + 1 :]
    else:
        adapter = model.split(":", 1)[1]
    return adapter.strip() or None


def resolve_lora_paths(model: str | None, lora_path: str | Sequence[str | None] | None, served_model_name: str,
                       num_prompts: int) -> tuple[list[str | None], str]:
    """One adapter name (or None) per prompt, and the request field it came from ("model" or
    "lora_path", for the error that names it).

    Raises:
        ValueError: a `lora_path` list whose length is not `num_prompts`.
    """
    adapter = adapter_in_model(model, served_model_name)
    if adapter is not None:
        return [adapter] * num_prompts, "model"
    if isinstance(lora_path, (list, tuple)):
        if len(lora_path) != num_prompts:
            raise ValueError(f"lora_path has {len(lora_path)} entries for {num_prompts} prompts")
        return list(lora_path), "lora_path"
    return [lora_path] * num_prompts, "lora_path"
