"""Readers of a compiled program's optimized HLO text (`jax.stages.Compiled.as_text()`).

What the model runner's compiled step does with the KV pools is visible only there: whether XLA
copies a pool-shaped buffer (the small-context decode cliff: one copy of the V pool per layer,
D-15) and whether the donated pools come back aliased to the outputs.
`tests/runner/test_model_runner_hlo.py` asserts on these readers. Plain text parsing: no JAX import, no device.
"""

from __future__ import annotations

import re
from typing import Sequence


def pool_copies(text: str, pool_shape: Sequence[int]) -> list[str]:
    """The instructions of `text` whose result is a whole buffer of `pool_shape` made by `copy(`.

    Args:
        text: optimized HLO (`Compiled.as_text()`).
        pool_shape: the KV pool's shape, e.g. [layers, pages, page_size, kv_heads, head_dim].

    Returns:
        Each such instruction, stripped and cut to 160 characters (empty: no pool-shaped copy). Any
        element type (`f32[...]`, `bf16[...]`) with an optional layout (`{4,3,2,1,0}`) matches; a copy
        of a slice or of another shape does not.
    """
    shape = r"[a-z]+\d*\[" + ",".join(map(str, pool_shape)) + r"\]"
    pattern = re.compile(r"=\s*" + shape + r"\S*\s+copy\(")
    return [line.strip()[:160] for line in text.splitlines() if pattern.search(line)]


def aliased_params(text: str) -> set[str]:
    """Names of the entry parameters aliased to an output (`input_output_alias` of the HloModule line).

    Raises:
        AttributeError: `text` has no ENTRY computation (not an HLO module's text).
    """
    header = text.splitlines()[0]
    alias = header.partition("input_output_alias=")[2].partition("entry_computation_layout")[0]
    entry = re.search(r"^ENTRY [^(]*\((.*?)\) ->", text, re.M).group(1)
    names = re.findall(r"([\w.]+): \w+\[", entry)
    return {names[int(i)] for i in re.findall(r"\((\d+), \{\}", alias)}
