"""Greedy outputs of the default model (SmolLM2-135M-Instruct) are the same with n-gram speculation on
and off: alone and batched, radix cache on, chunked prefill on (64-token chunks); in float32 and with
`--quantization w8a8_int8` (where a last-bit difference between step shapes changes the text: D-11)."""

from __future__ import annotations

import pytest

from jaxserve.engine.engine import Engine

PASSAGE = ("The river runs past the old mill and under the stone bridge. Children fish there in summer, "
           "and in winter the water freezes along the banks. ")
PROMPTS = [
    f"Copy the passage below word for word.\n\nPassage:\n{PASSAGE * 2}\n\nCopy:\n",
    "Rename `items` to `values`:\n```python\ndef total(items):\n    s = 0\n    for x in items:\n        s += x\n"
    "    return s\n```\nEdited:\n```python\n",
    "Name: Ada Lovelace\nCity: London\nTitle: Countess\n\nThe same fields as JSON:\n{\n",
]
GREEDY = {"max_new_tokens": 40, "temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module", params=[None, "w8a8_int8"], ids=["float32", "int8"])
def engine(request):
    return Engine(max_total_tokens=4096, chunked_prefill_size=64, context_length=1024, disable_precompile=True,
                  max_running_requests=16, speculative_algorithm="NGRAM", speculative_max_batch_size=16,
                  disable_speculative_adaptive=True, quantization=request.param)


def test_default_model_greedy_identical(engine):
    speculator, engine.speculator = engine.speculator, None  # plain decoding in the same engine
    plain = [engine.generate(p, GREEDY)["output_ids"] for p in PROMPTS]
    engine.flush_cache()
    engine.speculator = speculator
    alone = [engine.generate(p, GREEDY)["output_ids"] for p in PROMPTS]
    assert alone == plain
    assert engine.stats.num_spec_accepted_tokens > 0
    engine.flush_cache()
    batched = [o["output_ids"] for o in engine.generate(PROMPTS, GREEDY)]
    assert batched == plain
    engine.cache.check_integrity([])
