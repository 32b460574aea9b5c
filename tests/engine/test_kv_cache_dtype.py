"""--kv-cache-dtype on the default model (SmolLM2-135M): a compressed pool (8-bit K/V and a scale per token and
kv head, jaxserve/pallas/quantized_kv.py) against the float32 pool (`auto`).

- log-likelihood: the mean NLL of a text's tokens (prompt logprobs, the whole text in one prefill, so every
  token attends to compressed K/V) within 0.02 nats/token of auto's;
- greedy outputs: equal to auto's up to near ties: where they first differ, the token chosen was within
  NEAR_TIE nats of auto's best.
"""

from __future__ import annotations

import pytest

from benchmarks.quant.eval_loglik import text_nll
from jaxserve.engine.engine import Engine

TEXT = (
    "The history of the printing press begins in the fifteenth century, when Johannes Gutenberg combined movable "
    "metal type, oil-based inks and a screw press. Within decades, printing spread across Europe, lowering the cost "
    "of books and helping ideas travel quickly.\n"
    "def merge_sort(xs):\n    if len(xs) <= 1:\n        return xs\n    mid = len(xs) // 2\n"
    "    return merge(merge_sort(xs[:mid]), merge_sort(xs[mid:]))\n"
)
PROMPTS = ["The capital of France is", "def fibonacci(n):", "List three colors:", "Once upon a time",
           "The boiling point of water", "import numpy as np\n"]
MAX_NEW_TOKENS = 16
# nats between auto's best token and the one a compressed pool chose; fp8_e5m2 keeps 2 mantissa bits (a 25%
# step against int8's 1/127 of the row's maximum) and moved a flat step (best token at p = 0.2) by 0.70 nats
NEAR_TIE = {"int8": 0.5, "fp8_e4m3": 0.5, "fp8_e5m2": 1.0}
# prompts whose 16 greedy tokens equal auto's: measured 4 of 6 for int8 and fp8_e4m3, 1 of 6 for fp8_e5m2 (every
# difference at a near tie, checked above), so e5m2's outputs are auto's only up to near ties (D-48)
MIN_IDENTICAL = {"int8": 3, "fp8_e4m3": 3, "fp8_e5m2": 0}
MAX_NLL_INCREASE = 0.02  # nats/token, the bound D-48 holds the compressed pool to


def run(kv_cache_dtype: str) -> tuple[float, list[dict]]:
    engine = Engine(kv_cache_dtype=kv_cache_dtype, max_total_tokens=2048, chunked_prefill_size=512,
                    disable_radix_cache=True, disable_precompile=True)
    try:
        nll, _ = text_nll(engine, TEXT)
        outputs = engine.generate(PROMPTS, {"max_new_tokens": MAX_NEW_TOKENS, "temperature": 0},
                                  return_logprob=True, top_logprobs_num=5)
        return nll, outputs
    finally:
        engine.close()


@pytest.fixture(scope="module")
def auto():
    return run("auto")


def first_difference(a: list[int], b: list[int]) -> int | None:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)


@pytest.mark.slow
@pytest.mark.parametrize("kv_cache_dtype", ["int8", "fp8_e4m3", "fp8_e5m2"])
def test_compressed_pool_keeps_log_likelihood_and_greedy_outputs(auto, kv_cache_dtype):
    nll, outputs = run(kv_cache_dtype)
    auto_nll, auto_outputs = auto
    assert abs(nll - auto_nll) <= MAX_NLL_INCREASE, (kv_cache_dtype, nll, auto_nll)
    same = 0
    for ours, theirs in zip(outputs, auto_outputs):
        i = first_difference(ours["output_ids"], theirs["output_ids"])
        if i is None:
            same += 1
            continue
        top = {token: logprob for logprob, token, _ in theirs["meta_info"]["output_top_logprobs"][i]}
        chosen = ours["output_ids"][i]
        assert chosen in top and max(top.values()) - top[chosen] < NEAR_TIE[kv_cache_dtype], (
            kv_cache_dtype, ours["text"], theirs["text"], i, top, chosen)
    assert same >= MIN_IDENTICAL[kv_cache_dtype]
