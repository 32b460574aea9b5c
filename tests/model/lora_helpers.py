"""Random PEFT LoRA adapters for the tiny test model, made by `peft` itself (the reference)."""

from __future__ import annotations

ALL_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def make_peft_adapter(base_dir: str, out_dir: str, *, seed: int, rank: int = 8, alpha: float = 16.0,
                      targets=tuple(ALL_TARGETS), use_rslora: bool = False, scale: float = 0.2) -> str:
    """Save a PEFT LoRA adapter of `base_dir`'s model with random A and B (PEFT's default B is zero,
    which would test nothing) into `out_dir`."""
    import peft
    import torch
    import transformers

    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_pretrained(base_dir, torch_dtype=torch.float32)
    config = peft.LoraConfig(r=rank, lora_alpha=alpha, target_modules=list(targets), use_rslora=use_rslora,
                             lora_dropout=0.0, bias="none", task_type="CAUSAL_LM")
    model = peft.get_peft_model(model, config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn_like(p) * scale)
    model.save_pretrained(out_dir)
    return out_dir


def peft_model(base_dir: str, adapters: dict[str, str]):
    """A PeftModel over `base_dir` with every adapter of `adapters` (name -> directory) loaded."""
    import peft
    import torch
    import transformers

    base = transformers.AutoModelForCausalLM.from_pretrained(base_dir, torch_dtype=torch.float32).eval()
    names = list(adapters)
    model = peft.PeftModel.from_pretrained(base, adapters[names[0]], adapter_name=names[0]).eval()
    for name in names[1:]:
        model.load_adapter(adapters[name], adapter_name=name)
    return model


def peft_last_logits(model, adapter: str | None, prompt: list[int]):
    """Logits [V] at the last prompt position under `adapter` (None: the base model)."""
    import torch

    ids = torch.tensor([prompt])
    with torch.no_grad():
        if adapter is None:
            with model.disable_adapter():
                return model(ids).logits[0, -1].numpy()
        model.set_adapter(adapter)
        return model(ids).logits[0, -1].numpy()


def peft_greedy(model, adapter: str | None, prompt: list[int], num_new: int) -> list[int]:
    """Greedy continuation (ids) under `adapter` (None: the base model)."""
    import torch

    ids = torch.tensor([prompt])
    kwargs = dict(max_new_tokens=num_new, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        if adapter is None:
            with model.disable_adapter():
                out = model.generate(input_ids=ids, **kwargs)
        else:
            model.set_adapter(adapter)
            out = model.generate(input_ids=ids, **kwargs)
    return out[0, len(prompt):].tolist()
