"""LoRA adapters (Hu et al. 2021) for the Llama family: PEFT directories read into host arrays, the
stacked device slots they are written into, and the per-token low-rank update the model adds.

Slots. Every adapted projection of every layer holds A [S, r_max, in] and B [out, S, r_max] for S slots
(`LoraConfig.num_slots`); slot 0 stays zero, the base model's slot. Targets that share an input are
fused like the weights they adapt (q/k/v as `wqkv`, gate/up as `w_gate_up`; `slot_layout`). The arrays
live in each layer's params under "lora" (`params["layers"][i]["lora"]["qkv_a"]`; stacked on a leading
L axis under scan), so they shard, stack and unstack with the layer they belong to. The step takes a
slot per token (`ForwardBatch.lora_ids`) and adds `B[s] @ A[s] @ x` for each token's slot s: it
computes A @ x for every slot, masks it with a one-hot of the token's slot and applies B in one
contraction over (slot, rank). One compiled step serves any mix of adapters and the base model, and
writing a slot is a device update of these arrays, never a compile (D-43).

Adapters are PEFT directories (`adapter_config.json` + `adapter_model.safetensors`), targets q/k/v/o
and gate/up/down projections, rank up to `r_max` (zero-padded), the PEFT scaling `lora_alpha / r` (or
`lora_alpha / sqrt(r)` with `use_rslora`, Kalajdzievski 2023) folded into B at load. The names of the
flags and targets follow SGLang 0.5.23 (`--lora-target-modules q_proj ... | all`).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
import re
from typing import Any, Mapping, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Int32

from jaxserve.model.config import ModelConfig

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


# The slot arrays of one layer, one pair per group of targets that share an input, fused like the
# weights they adapt (`wqkv`, `w_gate_up`): group -> its targets in order. A group's A stacks its
# targets' A's along the rank axis; its B is block-structured (target j's rows read only ranks
# [j R, (j + 1) R)), so a group costs one matmul for A and one for B.
GROUPS: dict[str, tuple[str, ...]] = {"qkv": ("q", "k", "v"), "o": ("o",), "gate_up": ("gate", "up"), "down": ("down",)}


def groups(lora: LoraConfig) -> tuple[str, ...]:
    """The groups with at least one target in `lora.targets`."""
    return tuple(g for g, members in GROUPS.items() if any(t in lora.targets for t in members))


def slot_layout(config: ModelConfig, lora: LoraConfig) -> dict[str, tuple[tuple[int, ...], tuple[str | None, ...], int]]:
    """One layer's slot arrays: name -> (shape, logical axes, slot axis). S slots, R = r_max:

    - `qkv_a` [S, 3R, E], `qkv_b` [KVH, (G + 2) D, S, 3R] (wqkv's grouped rows: split over kv heads);
    - `o_a` [S, R, H D] (split over heads, as wo's input), `o_b` [E, S, R];
    - `gate_up_a` [S, 2R, E], `gate_up_b` [2, I, S, 2R] (split over I, as w_gate_up);
    - `down_a` [S, R, I] (split over I, as w_down's input), `down_b` [E, S, R].

    B keeps (S, R) last and contiguous, so B @ (A x) is one matmul with no transpose; A and B of
    column-parallel weights split B's outputs, of row-parallel ones A's inputs (parallel/rules.py).
    """
    s, r, e, d, i = lora.num_slots, lora.max_rank, config.hidden_size, config.head_dim, config.intermediate_size
    nkv, g, hd = config.num_kv_heads, config.group_size, config.num_heads * config.head_dim
    layout = {
        "qkv": {"qkv_a": ((s, 3 * r, e), (None, None, "embed"), 0),
                "qkv_b": ((nkv, (g + 2) * d, s, 3 * r), ("kv_heads", "qkv", None, None), 2)},
        "o": {"o_a": ((s, r, hd), (None, None, "q_heads"), 0), "o_b": ((e, s, r), ("embed", None, None), 1)},
        "gate_up": {"gate_up_a": ((s, 2 * r, e), (None, None, "embed"), 0),
                    "gate_up_b": ((2, i, s, 2 * r), ("gate_up", "mlp", None, None), 2)},
        "down": {"down_a": ((s, r, i), (None, None, "mlp"), 0), "down_b": ((e, s, r), ("embed", None, None), 1)},
    }
    return {name: spec for grp in groups(lora) for name, spec in layout[grp].items()}


def slot_axes(config: ModelConfig, lora: LoraConfig) -> dict[str, tuple[str | None, ...]]:
    """Logical axis names of one layer's slot arrays (`slot_layout`)."""
    return {name: axes for name, (_, axes, _) in slot_layout(config, lora).items()}


def empty_slots(config: ModelConfig, lora: LoraConfig, dtype=np.float32) -> dict[str, np.ndarray]:
    """One layer's zero slot arrays (host numpy), in `slot_layout`."""
    return {name: np.zeros(shape, dtype) for name, (shape, _, _) in slot_layout(config, lora).items()}


def with_lora_slots(params: dict, config: ModelConfig, lora: LoraConfig) -> dict:
    """`params` (per-layer storage) with zero slot arrays under each layer's "lora"."""
    dtype = params["final_norm"].dtype  # the activations' (weights may be quantized)
    layers = {i: {**p, "lora": {k: jnp.zeros(v.shape, dtype) for k, v in empty_slots(config, lora).items()}}
              for i, p in params["layers"].items()}
    return {**params, "layers": layers}


def with_lora_axes(axes: dict, config: ModelConfig, lora: LoraConfig) -> dict:
    """`functional.logical_axes(config)` with each layer's slot arrays' axes added."""
    layers = {i: {**a, "lora": slot_axes(config, lora)} for i, a in axes["layers"].items()}
    return {**axes, "layers": layers}


def split_lora(p: Mapping[str, Any]) -> tuple[dict, dict | None]:
    """One layer's params without "lora", and its slot arrays (None without LoRA)."""
    if "lora" not in p:
        return p, None
    return {k: v for k, v in p.items() if k != "lora"}, p["lora"]


class SlotMask(NamedTuple):
    """Which slot each token of a step runs under: `one_hot` [S, T] (1 where token t runs under slot
    s), and `has_adapter`, whether any token runs under an adapter (slot > 0)."""

    one_hot: Float[Array, "S T"]
    has_adapter: jax.Array


def slot_mask(lora: Mapping[str, Any], lora_ids: Int32[Array, " T"], dtype) -> SlotMask:
    """The `SlotMask` of a step's `lora_ids` for one layer's slot arrays `lora`."""
    num_slots = next(v for k, v in lora.items() if k.endswith("_a")).shape[0]
    one_hot = (lora_ids[None, :] == jnp.arange(num_slots, dtype=lora_ids.dtype)[:, None]).astype(dtype)
    return SlotMask(one_hot, jnp.any(lora_ids > 0))


def group_delta(lora: Mapping[str, Any], group: str, x: Float[Array, "I T"], mask: SlotMask) -> jax.Array:
    """B[s] @ A[s] @ x[:, t] of `group` for each token t's slot s (feature-major, as the layers' W @ x):
    [..., T] with B's leading (output) axes. Every slot's A @ x is computed and masked by the token's
    slot, then one contraction over (slot, rank) applies B: the cost is S * R * (in + out) per token
    and group member, against in * out for the base weight. A step whose tokens all run under the base
    model skips both (`lax.cond`): it returns zeros."""
    a, b = lora[f"{group}_a"], lora[f"{group}_b"]

    def delta():
        xa = jnp.einsum("sri,it->srt", a, x) * mask.one_hot[:, None, :]  # [S, R', T]
        return jnp.einsum("...sr,srt->...t", b, xa)

    return jax.lax.cond(mask.has_adapter, delta, lambda: jnp.zeros(b.shape[:-2] + x.shape[1:], x.dtype))


@dataclasses.dataclass(frozen=True)
class LoraAdapter:
    """One adapter in host memory, in one slot of `slot_layout` per layer (the slot axis dropped; zeros
    where the adapter does not adapt a target; ranks zero-padded to r_max; the scaling folded into B).
    `rank`, `scaling` and `targets` (PEFT names) as read."""

    path: str
    rank: int
    scaling: float
    targets: tuple[str, ...]
    layers: tuple[dict[str, np.ndarray], ...]
    digest: str = ""  # sha256 of adapter_config.json and adapter_model.safetensors: what the KV caches key on

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
    layout = slot_layout(config, lora)
    layers = [{name: np.zeros(tuple(n for k, n in enumerate(shape) if k != axis), dtype)
               for name, (shape, _, axis) in layout.items()} for _ in range(config.num_layers)]
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
            _place_a(layers[layer], target, w, lora.max_rank)
        else:
            if target in ("k", "v"):
                w = _replicate_kv_rows(w, lora.kv_replicas, config.head_dim)
            if w.shape != (out_f, rank):
                raise LoraError(f"{path!r}: {key} has shape {w.shape}, expected {(out_f, rank)} for this base model")
            _place_b(layers[layer], target, w * scaling, lora.max_rank, config)
    if not seen:
        raise LoraError(f"{path!r}: no LoRA tensors found")
    return LoraAdapter(path, rank, scaling, tuple(sorted(seen)), tuple(layers), _digest(path))


def _group_of(target: str) -> tuple[str, int]:
    """The group of `target` and its index in it."""
    return next((g, members.index(target)) for g, members in GROUPS.items() if target in members)


def _place_a(layer: dict[str, np.ndarray], target: str, a: np.ndarray, max_rank: int) -> None:
    """A [r, in] into its group's A [members R, in], at ranks [j R, j R + r)."""
    group, j = _group_of(target)
    layer[f"{group}_a"][j * max_rank : j * max_rank + a.shape[0]] = a


def _place_b(layer: dict[str, np.ndarray], target: str, b: np.ndarray, max_rank: int, config: ModelConfig) -> None:
    """B [out, r] into its group's B at ranks [j R, j R + r): q/k/v into wqkv's grouped rows (per kv
    head its G query heads' rows, then K's, then V's), gate/up into their half of [2, I, ...]."""
    group, j = _group_of(target)
    ranks = slice(j * max_rank, j * max_rank + b.shape[1])
    out = layer[f"{group}_b"]
    if group == "qkv":
        nkv, d, g = config.num_kv_heads, config.head_dim, config.group_size
        rows = {"q": slice(0, g * d), "k": slice(g * d, (g + 1) * d), "v": slice((g + 1) * d, (g + 2) * d)}[target]
        out[:, rows, ranks] = b.reshape(nkv, -1, b.shape[1])
    elif group == "gate_up":
        out[j, :, ranks] = b
    else:
        out[:, ranks] = b


def _digest(path: str) -> str:
    """sha256 of the adapter's two files: the same adapter (under any name, in any process) has the same
    digest, so KV computed under it may be shared and stored; a different one never collides."""
    h = hashlib.sha256()
    for name in ("adapter_config.json", "adapter_model.safetensors"):
        with open(os.path.join(path, name), "rb") as f:
            for chunk in iter(lambda: f.read(1 << 20), b""):
                h.update(chunk)
    return h.hexdigest()


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
