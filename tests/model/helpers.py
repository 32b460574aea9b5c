"""Run our model on single sequences through the paged pool (no engine): logits and greedy decoding."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.cache.kv_pool import PoolShape
from jaxserve.core.batch import BatchEntry
from jaxserve.model import functional
from jaxserve.pallas.reference import ragged_paged_attention_xla
from jaxserve.runner.buckets import MAX_LAYERS_PER_CALL
from jaxserve.runner.model_runner import ModelRunner


class SingleSequence:
    """Pages 1..n of a private pool, handed out in order (page 0 stays the dummy page).

    `all_logits` runs `functional.forward` (under lax.scan if `params` has stacked layers, unrolled if per
    layer); `last_logits` and `greedy` run the
    model runner's step with the given `layer_loop` (and `max_layers_per_call` for the host loop).
    """

    def __init__(
        self, config, params, *, page_size: int, max_tokens: int = 2048, max_extend: int = 1024,
        layer_loop: str = "scan", max_layers_per_call: int = MAX_LAYERS_PER_CALL,
    ):
        num_pages = max_tokens // page_size + 2
        shape = PoolShape(config.num_layers, num_pages, page_size, config.num_kv_heads, config.head_dim, "float32").shape
        dtype = functional.compute_dtype(params)
        self.runner = ModelRunner(
            config, params, jnp.zeros(shape, dtype), jnp.zeros(shape, dtype),
            attn_fn=ragged_paged_attention_xla, max_running_requests=1,
            max_extend_tokens=max_extend, context_length=max_tokens, layer_loop=layer_loop,
            max_layers_per_call=max_layers_per_call,
        )
        self.config, self.params, self.page_size = config, params, page_size
        self.page_table = list(range(1, num_pages))
        self._forward = jax.jit(
            functools.partial(functional.forward, config=config, attn_fn=functional.paged_attention(ragged_paged_attention_xla))
        )

    def all_logits(self, tokens, prefix_len: int = 0, rows=None) -> np.ndarray:
        """Extend by `tokens` after `prefix_len` cached ones; logits [len(tokens), V] of every position
        (or [len(rows), V] of the new tokens `rows` only: a 262k vocabulary makes every row 1 MB)."""
        pages = self.page_table[: -(-(prefix_len + len(tokens)) // self.page_size)]
        batch, _ = self.runner.build_forward_batch([BatchEntry(list(tokens), prefix_len, pages)])
        hidden, self.runner.k_pool, self.runner.v_pool = self._forward(
            self.params, self.runner.k_pool, self.runner.v_pool, batch
        )
        hidden = hidden[: len(tokens)] if rows is None else hidden[np.asarray(rows)]
        return np.asarray(functional.compute_logits(self.params, hidden, config=self.config))

    def last_logits(self, tokens, prefix_len: int = 0) -> np.ndarray:
        pages = self.page_table[: -(-(prefix_len + len(tokens)) // self.page_size)]
        logits = self.runner.forward([BatchEntry(list(tokens), prefix_len, pages)])
        return np.asarray(logits[0])

    def greedy(self, prompt, num_new: int) -> list[int]:
        """Prefill `prompt`, then decode `num_new` tokens one at a time, always taking the argmax."""
        out = [int(np.argmax(self.last_logits(prompt)))]
        while len(out) < num_new:
            out.append(int(np.argmax(self.last_logits([out[-1]], prefix_len=len(prompt) + len(out) - 1))))
        return out
