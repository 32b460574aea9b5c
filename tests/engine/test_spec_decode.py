"""N-gram speculative decoding on the tiny random Llama: exact outputs, rollback, counters, compiles.

References are independent of the code under test: plain decoding (speculation off) for the outputs,
brute force for the n-gram search and the tree continuation.
"""

from __future__ import annotations

import numpy as np
import pytest

from jaxserve.cache.radix_tree import RadixCache
from jaxserve.engine.engine import Engine
from jaxserve.engine.speculative import ngram_draft, num_accepted

GREEDY = {"max_new_tokens": 24, "temperature": 0, "ignore_eos": True}


def make_engine(model_dir, **kwargs) -> Engine:
    base = dict(
        model_path=model_dir, max_total_tokens=4096, max_running_requests=16, chunked_prefill_size=64,
        context_length=512, page_size=16, disable_precompile=True, enable_debug_checks=True,
    )
    base.update(kwargs)
    return Engine(**base)


def spec_engine(model_dir, **kwargs) -> Engine:
    return make_engine(model_dir, speculative_algorithm="NGRAM", speculative_num_draft_tokens=4,
                       speculative_max_batch_size=16, **kwargs)


def copy_prompts(n: int, seed: int = 0) -> list[list[int]]:
    """Prompts that repeat a random phrase, so drafts from the request's own tokens get accepted."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        phrase = list(map(int, rng.integers(3, 40000, size=int(rng.integers(3, 12)))))
        out.append(phrase * int(rng.integers(2, 8)) + list(map(int, rng.integers(3, 40000, size=int(rng.integers(0, 40))))))
    return out


def brute_force_draft(tokens, k, max_match):
    best_len, best_end = 0, -1
    n = len(tokens)
    for end in range(n - 1):
        w = 0
        while w < max_match and end - w >= 0 and w < n - 1 and tokens[end - w] == tokens[n - 1 - w]:
            w += 1
        if w > 0 and w >= best_len:
            best_len, best_end = w, end
    return [] if best_end < 0 else list(tokens[best_end + 1 : best_end + 1 + k])


def test_ngram_draft_matches_brute_force():
    rng = np.random.default_rng(0)
    for _ in range(300):
        tokens = list(map(int, rng.integers(0, 4, size=int(rng.integers(1, 40)))))
        k, m = int(rng.integers(1, 6)), int(rng.integers(1, 6))
        assert ngram_draft(tokens, k, m) == brute_force_draft(tokens, k, m), (tokens, k, m)


def test_num_accepted():
    assert num_accepted([5, 6, 7], [5, 6, 9, 1]) == 2
    assert num_accepted([5, 6, 7], [1, 6, 7, 1]) == 0
    assert num_accepted([5, 6, 7], [5, 6, 7, 8]) == 3
    assert num_accepted([], [4]) == 0
    with pytest.raises(ValueError):
        num_accepted([1], [1])


def test_tree_continuation():
    tree = RadixCache(page_size=4)
    seq = list(range(100, 124))  # 6 pages
    tree.insert(seq, np.arange(1, 7, dtype=np.int32))
    for cut in range(1, 23):
        assert tree.continuation(seq[:cut], 5) == seq[cut : cut + 5]
    assert tree.continuation([100, 101, 999], 5) == []
    assert tree.continuation(seq, 5) == []
    assert tree.continuation(seq[:6], 5, namespace="other") == []
    other = seq[:8] + [7, 7, 7, 7]  # a sibling continuation, used more recently
    tree.insert(other, np.arange(7, 10, dtype=np.int32))
    tree.match_prefix(other)
    assert tree.continuation(seq[:8], 3) == [7, 7, 7]
    assert RadixCache(page_size=4, disable=True).continuation(seq[:3], 2) == []


@pytest.fixture(scope="module")
def plain_outputs(tiny_model_dir):
    eng = make_engine(tiny_model_dir)
    return [eng.generate(p, GREEDY)["output_ids"] for p in copy_prompts(12)]


def assert_no_leak(engine: Engine) -> None:
    engine.cache.check_integrity([])
    engine.allocator.free(engine.tree.reset())
    assert engine.allocator.num_free == engine.allocator.num_usable


@pytest.mark.parametrize("batched", [False, True], ids=["alone", "batched"])
def test_greedy_identical_with_speculation(tiny_model_dir, plain_outputs, batched):
    """Drafts from the request's own tokens (alone) and from the radix tree: batched, the first half
    of the prompts was served before, so the tree holds their continuations."""
    eng = spec_engine(tiny_model_dir, chunked_prefill_size=64, max_running_requests=64)
    prompts = copy_prompts(12)
    if batched:
        first = [eng.generate(p, GREEDY)["output_ids"] for p in prompts[:6]]
        outs = [o["output_ids"] for o in eng.generate(prompts, GREEDY)]
        assert first == outs[:6]
    else:
        outs = [eng.generate(p, GREEDY)["output_ids"] for p in prompts]
    assert outs == plain_outputs
    s = eng.stats
    assert s.num_spec_verifications > 0 and s.num_spec_accepted_tokens > 0
    snap = eng.snapshot()
    assert snap.spec_accept_length > 1 and 0 < snap.spec_accept_rate <= 1
    assert_no_leak(eng)
