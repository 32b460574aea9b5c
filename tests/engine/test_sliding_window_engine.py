"""A sliding-window model (tiny random Gemma 3, window 16) through the engine's other paths: n-gram
speculative verification, an abort in the middle of a prefill that crosses the window, and a prefix hit
that starts before the window. Outputs equal a plain run's; no page leaks (integrity check)."""

from __future__ import annotations

import numpy as np
import pytest

from jaxserve.engine.engine import Engine

pytest.importorskip("torch")

GREEDY = {"max_new_tokens": 24, "temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def gemma3_dir(sliding_window_model_dir) -> str:
    return sliding_window_model_dir


def _engine(path: str, **kw) -> Engine:
    return Engine(model_path=path, max_total_tokens=1024, max_running_requests=4, chunked_prefill_size=32,
                  context_length=256, page_size=8, disable_precompile=True, **kw)


def _prompts() -> list[list[int]]:
    rng = np.random.default_rng(5)
    motif = [int(x) for x in rng.integers(3, 49152, 12)]
    shared = [int(x) for x in rng.integers(3, 49152, 40)]
    # repeated motifs (n-gram drafts get accepted) and a 40-token shared prefix (a radix hit that starts
    # far before the 16-token window of the tokens after it)
    return [motif * 6, shared + motif * 3, shared + [int(x) for x in rng.integers(3, 49152, 30)]]


def _assert_no_leak(engine: Engine) -> None:
    engine.cache.check_integrity([])
    engine.flush_cache()
    assert engine.cache.allocator.num_free == engine.cache.allocator.num_usable


def test_speculative_verification_and_aborts_keep_window_outputs(gemma3_dir):
    plain = _engine(gemma3_dir)
    expected = [o["output_ids"] for o in plain.generate(_prompts(), GREEDY)]
    # an abort after the first 32-token chunk of an 84-token prompt (its window spans two chunks)
    rid = plain.add_request([7] * 84, {"max_new_tokens": 8, "temperature": 0})[0]
    plain.step()
    assert plain.abort(rid)
    # the prefix hits again, after the abort
    assert [o["output_ids"] for o in plain.generate(_prompts()[1:], GREEDY)] == expected[1:]
    _assert_no_leak(plain)

    spec = _engine(gemma3_dir, speculative_algorithm="NGRAM", speculative_num_draft_tokens=7)
    outs = spec.generate(_prompts(), GREEDY)
    assert [o["output_ids"] for o in outs] == expected
    assert spec.stats.num_spec_accepted_tokens > 0, "no draft token was accepted: nothing verified"
    _assert_no_leak(spec)
