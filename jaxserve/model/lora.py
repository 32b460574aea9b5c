"""LoRA adapters (Hu et al. 2021) for the Llama family: PEFT directories read into host arrays, the
stacked device slots they are written into, and the per-token low-rank update the model adds.

Slots. Every adapted projection of every layer holds `A [S, r_max, in]` and `B [S, out, r_max]` for S
slots (`LoraConfig.num_slots`); slot 0 stays zero, the base model's slot. They live in each layer's
params under "lora" (`params["layers"][i]["lora"]["q_a"]`, stacked on a leading L axis under scan, so the
stacked form is `[L, S, r_max, in]`), so they shard, stack and unstack with the layer they belong to.
The step takes a slot per token (`ForwardBatch.lora_ids`) and adds `B[s] @ A[s] @ x` for each token's
slot s. It computes the product for every slot and masks it with a one-hot of the token's slot: one
compiled step serves any mix of adapters and the base model, and writing a slot is a device update of
these arrays, never a compile.

Adapters are PEFT directories (`adapter_config.json` + `adapter_model.safetensors`), targets q/k/v/o
and gate/up/down projections, rank up to `r_max` (zero-padded), the PEFT scaling `lora_alpha / r` (or
`lora_alpha / sqrt(r)` with `use_rslora`, Kalajdzievski 2023) folded into B at load. The names of the
flags and targets follow SGLang 0.5.23 (`--lora-target-modules q_proj ... | all`).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
from typing import Any, Mapping

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Int32

from jaxserve.config import ModelConfig

# PEFT target module name -> jaxserve's target name
TARGET_MODULES: dict[str, str] = {
    "q_proj": "q", "k_proj": "k", "v_proj": "v", "o_proj": "o",
    "gate_proj": "gate", "up_proj": "up", "down_proj": "down",
}
ALL_TARGETS = "all"  # SGLang's --lora-target-modules value for every supported module
_KEY = re.compile(r"layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])(?:\.\w+)?\.weight$")


class LoraError(ValueError):
    """An adapter that cannot be loaded (missing files, rank too large, shapes that do not fit the base
    model, an unsupported target or option); the message says which."""


@dataclasses.dataclass(frozen=True)
class LoraConfig:
    """The device slots: `num_slots` (slot 0 the zero adapter), rank `max_rank`, and the `targets`
    (jaxserve names, `TARGET_MODULES`' values) that get slot arrays."""

    num_slots: int
    max_rank: int
    targets: tuple[str, ...]
    kv_replicas: int = 1  # the model's kv heads were copied this many times (tensor parallelism)

    @staticmethod
    def of(num_slots: int, max_rank: int, target_modules: tuple[str, ...] | None, kv_replicas: int = 1) -> "LoraConfig":
        """From SGLang's flags: `target_modules` PEFT names or "all" (None: all).

        Raises:
            ValueError: an unknown target module, or a rank or slot count below 1.
        """
        if max_rank < 1 or num_slots < 2:
            raise ValueError(f"LoRA needs --max-lora-rank >= 1 and at least one slot, got {max_rank}, {num_slots - 1}")
        modules = tuple(target_modules or (ALL_TARGETS,))
        if ALL_TARGETS in modules:
            modules = tuple(TARGET_MODULES)
        unknown = [m for m in modules if m not in TARGET_MODULES]
        if unknown:
            raise ValueError(f"--lora-target-modules {unknown} not supported; supported: {sorted(TARGET_MODULES)} or all")
        targets = tuple(TARGET_MODULES[m] for m in TARGET_MODULES if m in modules)
        return LoraConfig(num_slots, max_rank, targets, kv_replicas)


def target_shapes(config: ModelConfig) -> dict[str, tuple[int, int]]:
    """(out, in) features of each target projection in the model's runtime layout (after kv-head
    replication: k and v have `num_kv_heads * head_dim` outputs)."""
    e, d, i = config.hidden_size, config.head_dim, config.intermediate_size
    hd, kvd = config.num_heads * d, config.num_kv_heads * d
    return {"q": (hd, e), "k": (kvd, e), "v": (kvd, e), "o": (e, hd), "gate": (i, e), "up": (i, e), "down": (e, i)}


# logical axes of each target's input and output features (like the weight it adapts: q/k/v and
# gate/up are column-parallel, o and down row-parallel; jaxserve/parallel/rules.py)
_IN_AXIS = {"q": "embed", "k": "embed", "v": "embed", "o": "q_heads", "gate": "embed", "up": "embed", "down": "mlp"}
_OUT_AXIS = {"q": "q_heads", "k": "kv_heads", "v": "kv_heads", "o": "embed", "gate": "mlp", "up": "mlp", "down": "embed"}


def slot_axes(lora: LoraConfig) -> dict[str, tuple[str | None, ...]]:
    """Logical axis names of one layer's slot arrays: `<t>_a` [S, r, in], `<t>_b` [S, out, r]."""
    axes = {}
    for t in lora.targets:
        axes[f"{t}_a"] = (None, None, _IN_AXIS[t])
        axes[f"{t}_b"] = (None, _OUT_AXIS[t], None)
    return axes


def empty_slots(config: ModelConfig, lora: LoraConfig, dtype=jnp.float32) -> dict[str, np.ndarray]:
    """One layer's zero slot arrays (host numpy): `<t>_a` [S, r, in], `<t>_b` [S, out, r]."""
    shapes, s, r = target_shapes(config), lora.num_slots, lora.max_rank
    out = {}
    for t in lora.targets:
        o, i = shapes[t]
        out[f"{t}_a"] = np.zeros((s, r, i), dtype)
        out[f"{t}_b"] = np.zeros((s, o, r), dtype)
    return out


def with_lora_slots(params: dict, config: ModelConfig, lora: LoraConfig) -> dict:
    """`params` (per-layer storage) with zero slot arrays under each layer's "lora"."""
    dtype = jax.tree.leaves(params)[0].dtype
    layers = {i: {**p, "lora": jax.tree.map(jnp.asarray, empty_slots(config, lora, dtype))}
              for i, p in params["layers"].items()}
    return {**params, "layers": layers}


def with_lora_axes(axes: dict, lora: LoraConfig) -> dict:
    """`llama.logical_axes(config)` with each layer's slot arrays' axes added."""
    layers = {i: {**a, "lora": slot_axes(lora)} for i, a in axes["layers"].items()}
    return {**axes, "layers": layers}


def split_lora(p: Mapping[str, Any]) -> tuple[dict, dict | None]:
    """One layer's params without "lora", and its slot arrays (None without LoRA)."""
    if "lora" not in p:
        return p, None
    return {k: v for k, v in p.items() if k != "lora"}, p["lora"]


def slot_one_hot(lora_ids: Int32[Array, " T"], num_slots: int, dtype) -> Float[Array, "S T"]:
    """[S, T]: 1 where token t runs under slot s."""
    return (lora_ids[None, :] == jnp.arange(num_slots, dtype=lora_ids.dtype)[:, None]).astype(dtype)


def lora_delta(
    a: Float[Array, "S R I"], b: Float[Array, "S O R"], x: Float[Array, "I T"], one_hot: Float[Array, "S T"]
) -> Float[Array, "O T"]:
    """B[s] @ A[s] @ x[:, t] for each token t's slot s (feature-major, as the layers' W @ x). Every
    slot's A @ x is computed and masked, then one contraction over (slot, rank) applies B: the cost is
    S * r * (in + out) per token, against in * out for the base weight."""
    xa = jnp.einsum("sri,it->srt", a, x) * one_hot[:, None, :]  # [S, R, T]
    return jnp.einsum("sor,srt->ot", b, xa)


def delta_or_zeros(lora: Mapping[str, Any], target: str, x, one_hot, out_features: int):
    """`lora_delta` of `target`, or zeros [out, T] where the slots do not adapt it."""
    if f"{target}_a" not in lora:
        return jnp.zeros((out_features, x.shape[1]), x.dtype)
    return lora_delta(lora[f"{target}_a"], lora[f"{target}_b"], x, one_hot)


@dataclasses.dataclass(frozen=True)
class LoraAdapter:
    """One adapter in host memory, in slot layout: per layer, `<t>_a` [r_max, in] and `<t>_b` [out, r_max]
    (zero-padded, the scaling folded into B) for every target of the slots (zeros where the adapter
    does not adapt it). `rank`, `scaling` and `targets` (PEFT names) as read."""

    path: str
    rank: int
    scaling: float
    targets: tuple[str, ...]
    layers: tuple[dict[str, np.ndarray], ...]

    @property
    def nbytes(self) -> int:
        return sum(x.nbytes for layer in self.layers for x in layer.values())


def read_adapter_config(path: str) -> dict:
    """The adapter's `adapter_config.json`.

    Raises:
        LoraError: the directory or the file is missing or not JSON.
    """
    if not os.path.isdir(path):
        raise LoraError(f"LoRA adapter directory {path!r} not found")
    cfg_path = os.path.join(path, "adapter_config.json")
    if not os.path.isfile(cfg_path):
        raise LoraError(f"{path!r} has no adapter_config.json (a PEFT LoRA directory is expected)")
    try:
        with open(cfg_path) as f:
            return json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise LoraError(f"{cfg_path!r} is not valid JSON: {e}") from e


def load_adapter(path: str, config: ModelConfig, lora: LoraConfig, dtype=np.float32) -> LoraAdapter:
    """Read a PEFT LoRA directory into host arrays in `lora`'s slot layout for the model `config`.

    Raises:
        LoraError: missing files; a rank above `lora.max_rank`; a target outside `lora.targets`, or one
            that jaxserve does not adapt (embeddings, lm_head, `modules_to_save`); DoRA, biases,
            per-module rank/alpha patterns or `fan_in_fan_out`; a tensor whose shape does not fit the
            base model; layers outside the model.
    """
    cfg = read_adapter_config(path)
    if cfg.get("peft_type", "LORA") != "LORA":
        raise LoraError(f"{path!r}: peft_type {cfg.get('peft_type')!r} is not LORA")
    for key, neutral in (("use_dora", False), ("bias", "none"), ("fan_in_fan_out", False)):
        if cfg.get(key, neutral) not in (neutral, None):
            raise LoraError(f"{path!r}: {key}={cfg[key]!r} is not supported")
    for key in ("rank_pattern", "alpha_pattern", "modules_to_save", "layers_to_transform"):
        if cfg.get(key):
            raise LoraError(f"{path!r}: {key} is not supported")
    rank, alpha = int(cfg.get("r", 0)), float(cfg.get("lora_alpha", cfg.get("r", 0)))
    if rank < 1:
        raise LoraError(f"{path!r}: rank r={rank} must be >= 1")
    if rank > lora.max_rank:
        raise LoraError(f"{path!r}: rank {rank} exceeds --max-lora-rank {lora.max_rank}")
    scaling = alpha / math.sqrt(rank) if cfg.get("use_rslora") else alpha / rank
    tensors = _read_tensors(path)
    shapes = target_shapes(config)
    layers = [{name: np.zeros(x.shape[1:], dtype) for name, x in empty_slots(config, lora).items()}
              for _ in range(config.num_layers)]
    seen: set[str] = set()
    for key, w in tensors.items():
        m = _KEY.search(key)
        if m is None:
            raise LoraError(f"{path!r}: tensor {key!r} is not a LoRA A/B of a supported target "
                            f"({', '.join(TARGET_MODULES)})")
        layer, module, ab = int(m.group(1)), m.group(2), m.group(3)
        target = TARGET_MODULES.get(module)
        if target is None:
            raise LoraError(f"{path!r}: target module {module!r} not supported; supported: {', '.join(TARGET_MODULES)}")
        if target not in lora.targets:
            raise LoraError(f"{path!r}: target module {module!r} is not in --lora-target-modules")
        if layer >= config.num_layers:
            raise LoraError(f"{path!r}: tensor {key!r} names layer {layer}; the model has {config.num_layers}")
        seen.add(module)
        out_f, in_f = shapes[target]
        w = np.asarray(w, np.float32)
        if ab == "A":
            if w.shape != (rank, in_f):
                raise LoraError(f"{path!r}: {key} has shape {w.shape}, expected {(rank, in_f)} for this base model")
            layers[layer][f"{target}_a"][:rank] = w
        else:
            if target in ("k", "v"):
                w = _replicate_kv_rows(w, lora.kv_replicas, config.head_dim)
            if w.shape != (out_f, rank):
                raise LoraError(f"{path!r}: {key} has shape {w.shape}, expected {(out_f, rank)} for this base model")
            layers[layer][f"{target}_b"][:, :rank] = w * scaling
    if not seen:
        raise LoraError(f"{path!r}: no LoRA tensors found")
    return LoraAdapter(path, rank, scaling, tuple(sorted(seen)), tuple(layers))


def _read_tensors(path: str) -> dict[str, np.ndarray]:
    from safetensors import SafetensorError, safe_open

    file = os.path.join(path, "adapter_model.safetensors")
    if not os.path.isfile(file):
        raise LoraError(f"{path!r} has no adapter_model.safetensors")
    try:
        with safe_open(file, framework="numpy") as f:
            return {k: f.get_tensor(k) for k in f.keys()}
    except (SafetensorError, OSError, TypeError, ValueError) as e:
        raise LoraError(f"{file!r} cannot be read: {e}") from e


def _replicate_kv_rows(w: np.ndarray, factor: int, head_dim: int) -> np.ndarray:
    """B of k/v [KVH0 * D, r] -> [KVH0 * factor * D, r] where the model copied each kv head `factor`
    times for tensor parallelism (`loader.replicate_kv_heads`): each kv head's rows repeated in place."""
    if factor == 1 or w.shape[0] % head_dim:
        return w
    return np.repeat(w.reshape(-1, head_dim, w.shape[1]), factor, axis=0).reshape(-1, w.shape[1])


@dataclasses.dataclass(frozen=True)
class LoraSource:
    """One adapter to load: `lora_name`, `lora_path`, `pinned` (SGLang's LoRARef fields)."""

    lora_name: str
    lora_path: str
    pinned: bool = False


def parse_lora_paths(values) -> list[LoraSource]:
    """`--lora-paths` entries in SGLang's forms: PATH (named by its path), NAME=PATH, or JSON
    {"lora_name": ..., "lora_path": ..., "pinned": ...}.

    Raises:
        ValueError: a JSON entry without lora_name and lora_path, or a name given twice.
    """
    out: list[LoraSource] = []
    for value in values or ():
        value = value.strip()
        if value.startswith("{") and value.endswith("}"):
            obj = json.loads(value)
            if not isinstance(obj, dict) or "lora_name" not in obj or "lora_path" not in obj:
                raise ValueError(f"--lora-paths {value!r}: a JSON entry needs lora_name and lora_path")
            out.append(LoraSource(str(obj["lora_name"]), str(obj["lora_path"]), bool(obj.get("pinned", False))))
        elif "=" in value:
            name, path = value.split("=", 1)
            out.append(LoraSource(name.strip(), path.strip()))
        else:
            out.append(LoraSource(value, value))
    names = [s.lora_name for s in out]
    if len(set(names)) != len(names):
        raise ValueError(f"--lora-paths names an adapter twice: {names}")
    return out


def infer_rank_and_targets(sources: list[LoraSource]) -> tuple[int | None, tuple[str, ...] | None]:
    """The largest rank and the union of target modules (PEFT names) of `sources`' adapter configs
    (None, None without sources), as SGLang infers --max-lora-rank and --lora-target-modules.

    Raises:
        LoraError: an adapter's config is missing or unreadable.
    """
    if not sources:
        return None, None
    ranks, targets = [], set()
    for s in sources:
        cfg = read_adapter_config(s.lora_path)
        ranks.append(int(cfg.get("r", 0)))
        modules = cfg.get("target_modules") or []
        if isinstance(modules, str):  # a regex or "all-linear": not a list to take the union of
            return max(ranks + [int(c.get("r", 0)) for c in map(read_adapter_config, [x.lora_path for x in sources])]), None
        targets |= set(modules)
    known = tuple(m for m in TARGET_MODULES if m in targets)
    return max(ranks), (known + tuple(sorted(targets - set(known))) if targets else None)
