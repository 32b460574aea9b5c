"""The cross-request n-gram store (`speculative/ngram_store.py`) and the drafts it gives the engine.

References are independent of the code under test: a brute-force search over the fed requests'
token lists for the store's lookup, plain decoding (speculation off) for the outputs.
"""

from __future__ import annotations

import numpy as np
import pytest

from jaxserve.cache.radix_tree import RadixCache
from jaxserve.core.request import Req
from jaxserve.core.sampling_params import SamplingParams
from jaxserve.engine.engine import Engine
from jaxserve.server_args import ServerArgs
from jaxserve.speculative import ngram_store
from jaxserve.speculative.decoder import NgramSpeculator, SpeculativeConfig
from jaxserve.speculative.ngram_store import LEVELS, NgramStore
from jaxserve.speculative.policy import DraftPolicy, DraftState

GREEDY = {"max_new_tokens": 24, "temperature": 0, "ignore_eos": True}


def brute_force_store_match(segments, query, k, max_match, namespace=None):
    """The documented lookup over `segments` [(tokens, namespace)] (oldest first, all live): from the
    longest level down, the latest window of n tokens equal to the query's last n tokens that is not
    the end of its request's text; its match length counted back within that text; the draft after it."""
    for n in reversed(LEVELS):
        if n > len(query):
            continue
        for toks, ns in reversed(segments):
            if ns != namespace:
                continue
            for end in range(len(toks) - 2, n - 2, -1):  # latest first, not the text's last token
                if list(toks[end - n + 1: end + 1]) == list(query[-n:]):
                    w = 0
                    while w < min(max_match, len(query)) and end - w >= 0 and toks[end - w] == query[-1 - w]:
                        w += 1
                    return list(toks[end + 1: end + 1 + k]), w
    return [], 0


@pytest.fixture
def no_collisions(monkeypatch):
    """Tables large enough that no two of a test's windows share a slot (collisions only lose
    entries, which the brute force would not model)."""
    monkeypatch.setattr(ngram_store, "MIN_TABLE_SLOTS", 1 << 20)


def test_match_against_brute_force(no_collisions):
    rng = np.random.default_rng(0)
    store = NgramStore(capacity=100_000, max_match_len=18)
    segments = []
    for i in range(40):
        # a small vocabulary makes repeats, and so matches of every length, common
        toks = list(map(int, rng.integers(0, 6, size=int(rng.integers(1, 60)))))
        ns = "b" if i % 5 == 0 else None
        store.feed(toks, ns)
        segments.append((toks, ns))
    num_hits = 0
    for _ in range(400):
        query = list(map(int, rng.integers(0, 6, size=int(rng.integers(1, 30)))))
        ns = "b" if rng.random() < 0.2 else None
        k = int(rng.integers(1, 16))
        got = store.match(query, k, ns)
        assert (got.draft, got.match_len) == brute_force_store_match(segments, query, k, 18, ns), (query, k, ns)
        num_hits += bool(got.draft)
    assert num_hits > 100


def test_longer_level_wins_over_a_later_shorter_match(no_collisions):
    store = NgramStore(capacity=1000)
    store.feed([1, 2, 3, 4, 5, 6, 7, 8, 9])
    store.feed([3, 4, 70, 80])  # later, but only a 2-token match of [2, 3, 4]
    assert store.match([1, 2, 3, 4], 3) == ([5, 6, 7], 4)
    assert store.match([9, 3, 4], 3) == ([70, 80], 2)  # the latest 2-token match, cut at its text's end
    assert store.match([5], 3) == ([], 0)  # one token is below the shortest level
    assert store.match([8, 9], 3) == ([], 0)  # the end of a text has no draft


def test_capacity_evicts_oldest():
    store = NgramStore(capacity=20)
    store.feed(list(range(100, 110)))  # separator + 10 tokens
    store.feed(list(range(200, 210)))  # 22 > 20: the separator and token 100 are evicted
    assert store.num_tokens == 20
    assert store.match([100, 101], 3) == ([], 0)
    assert store.match([105, 106], 3) == ([107, 108, 109], 2)
    store.feed(list(range(300, 305)))  # 6 more: up to token 105 evicted
    assert store.match([105, 106], 3) == ([], 0)
    assert store.match([107, 108], 3) == ([109], 2)
    assert store.match([201, 202], 3) == ([203, 204, 205], 2)
    assert store.match([302, 303], 3) == ([304], 2)
    assert store.num_tokens == 20
    store.feed(list(range(400, 450)))  # longer than the store: its last 19 tokens are kept
    assert store.match([431, 432], 2) == ([433, 434], 2) and store.match([430, 431], 2) == ([], 0)
    assert store.match([302, 303], 3) == ([], 0)
    store.reset()
    assert store.num_tokens == 0 and store.match([440, 441], 2) == ([], 0)


def test_growth_and_wrap_keep_matches(no_collisions):
    """The ring and tables grow (rehashing) and then wrap; what is live still matches, what is not
    does not, against the brute force over the live requests."""
    rng = np.random.default_rng(1)
    store = NgramStore(capacity=5000, max_match_len=18)
    fed = []
    for _ in range(200):
        toks = list(map(int, rng.integers(0, 1000, size=int(rng.integers(2, 80)))))
        store.feed(toks)
        fed.append(toks)
    # the live requests: those whose text and separator fit in the last `capacity` positions
    live, used = [], 0
    for toks in reversed(fed):
        if used + len(toks) + 1 > store.capacity:
            break
        live.insert(0, (toks, None))
        used += len(toks) + 1
    for toks, _ in live[-50:]:
        i = int(rng.integers(0, len(toks) - 1))
        query = toks[max(0, i - 20): i + 1]
        got = store.match(query, 8)
        assert (got.draft, got.match_len) == brute_force_store_match(live, query, 8, 18)
    for toks in fed[:10]:  # long evicted
        got = store.match(toks[:LEVELS[-1] + 2], 4)
        assert got.draft == [] or got.draft == brute_force_store_match(live, toks[:LEVELS[-1] + 2], 4, 18)[0]


def test_namespaces_do_not_share_drafts():
    store = NgramStore(capacity=1000)
    store.feed([1, 2, 3, 4], namespace="tenant-a")
    assert store.match([2, 3], 2, namespace="tenant-a") == ([4], 2)
    assert store.match([2, 3], 2) == ([], 0)
    assert store.match([2, 3], 2, namespace="tenant-b") == ([], 0)
    store.feed([1, 2, 3, 5])
    assert store.match([2, 3], 2) == ([5], 2)
    assert store.match([2, 3], 2, namespace="tenant-a") == ([4], 2)


def test_bad_store_arguments_and_flag():
    with pytest.raises(ValueError, match="capacity must be >= 2"):
        NgramStore(capacity=1)
    with pytest.raises(ValueError, match="--speculative-ngram-capacity must be >= 2 tokens, or 0"):
        ServerArgs(speculative_ngram_capacity=-3).validate()
    with pytest.raises(SystemExit):
        ServerArgs.from_cli(["--speculative-algorithm", "NGRAM", "--speculative-ngram-capacity", "1"])
    assert ServerArgs.from_cli(["--speculative-ngram-capacity", "0"]).speculative_ngram_capacity == 0
    assert ServerArgs().speculative_ngram_capacity == 10_000_000  # SGLang 0.5.23's default


def make_req(rid: str, tokens, namespace=None) -> Req:
    return Req(rid, list(tokens), SamplingParams(max_new_tokens=32), namespace=namespace)


def test_propose_takes_the_longer_match():
    """The request's own match against the store's: the longer one is drafted, the own one on a tie."""
    config = SpeculativeConfig(num_draft_tokens=4, max_match_len=18, max_batch_size=8, store_capacity=1000)
    spec = NgramSpeculator(config, RadixCache(page_size=4, disable=True))
    spec.observe_finished(make_req("done", [7, 8, 9, 10, 11, 12, 13]))
    # own: [9, 10] occurred before followed by 50 (a 2-token match); store: [8, 9, 10] -> 11, 12, 13
    req = make_req("r", [1, 9, 10, 50, 51, 8, 9, 10])
    assert spec.propose(req, 8) == [11, 12, 13] and req.draft_state.match_len == 3 and req.draft_state.is_from_store
    # own: [8, 9, 10] before (3 tokens, ties with the store's 3): the request's own continuation
    req = make_req("r2", [8, 9, 10, 60, 61, 8, 9, 10])
    assert spec.propose(req, 8) == [60, 61, 8, 9] and req.draft_state.match_len == 3
    assert not req.draft_state.is_from_store
    # no own match at all: the store's
    req = make_req("r3", [20, 21, 12])
    assert spec.propose(req, 8) == [] and spec.propose(make_req("r4", [20, 11, 12]), 8) == [13]
    off = NgramSpeculator(SpeculativeConfig(4, 18, 8, store_capacity=0), RadixCache(page_size=4, disable=True))
    off.observe_finished(make_req("done", [7, 8, 9, 10, 11, 12, 13]))
    assert off.store is None and off.propose(make_req("r", [1, 8, 9, 10]), 8) == []


def test_store_drafts_are_learned_apart_and_across_requests():
    """A store draft's acceptance goes to classes shared by all requests, not to the request's own
    match-length classes (a 4-token store match predicts less than a 4-token match of its own text)."""
    spec = NgramSpeculator(SpeculativeConfig(4, 18, 8, store_capacity=1000), RadixCache(page_size=4, disable=True))
    policy = DraftPolicy()
    a = spec._draft_state(make_req("a", [1]))
    b = spec._draft_state(make_req("b", [1]))
    a.match_len, a.is_from_store = 5, True
    policy.record(a, 15, 1)
    assert a.accept_by_class == {} and spec.store_accept_by_class == {3: 1.0}
    b.match_len, b.is_from_store = 4, True
    assert b.expected_accept() == 1.0
    b.is_from_store = False  # its own 4-token matches: nothing learned yet
    assert b.expected_accept() is None
    policy.record(b, 15, 12)
    assert b.accept_by_class == {3: 12.0} and spec.store_accept_by_class == {3: 1.0}
    assert DraftState().store_accept_by_class is not DraftState().store_accept_by_class


def spec_engine(model_dir, **kwargs) -> Engine:
    base = dict(
        model_path=model_dir, max_total_tokens=4096, max_running_requests=16, chunked_prefill_size=64,
        context_length=512, page_size=16, disable_precompile=True, enable_debug_checks=True,
        prefill_decode_itl_ratio=0,
    )
    base.update(kwargs)
    return Engine(**base)


@pytest.fixture(scope="module")
def engines(tiny_model_dir):
    plain = spec_engine(tiny_model_dir)
    spec = spec_engine(tiny_model_dir, speculative_algorithm="NGRAM", speculative_num_draft_tokens=4,
                       disable_speculative_adaptive=True)
    return plain, spec


def unrelated_prefix(avoid, size, seed):
    rng = np.random.default_rng(seed)
    return [int(t) for t in rng.integers(3, 40000, size=3 * size) if int(t) not in avoid][:size]


def test_second_request_gets_the_first_requests_continuation(engines):
    """A request whose suffix occurs only in an earlier request's output is drafted that output's
    continuation (no draft without the store: its own tokens and the radix tree have none), and both
    decode exactly as without speculation."""
    plain, spec = engines
    first = [int(t) for t in np.random.default_rng(5).integers(3, 40000, size=40)]
    out = spec.generate(first, GREEDY)["output_ids"]
    assert out == plain.generate(first, GREEDY)["output_ids"]
    text = first + out
    # a window of the output that ends where its next tokens are well defined: its last 2 tokens
    # occur once in the first request's text (the tiny model loops, so many windows repeat)
    i = next(i for i in range(8, len(out) - 5)
             if sum(text[j:j + 2] == out[i - 1:i + 1] for j in range(len(text) - 1)) == 1
             and out[i] not in out[i - 5:i])
    window = out[i - 5: i + 1]
    second = unrelated_prefix(set(text), 30, seed=6) + window
    rid = spec.add_request(second, GREEDY)[0]
    req = spec.processor.reqs[rid]
    expected = brute_force_store_match([(text, None)], second, 4, 18)
    assert expected[0] == out[i + 1: i + 5]
    assert spec.speculator.propose(req, 4) == expected[0]
    assert req.draft_state.match_len == expected[1] >= 2
    outs = {}
    while rid not in outs:
        outs.update({o.rid: o.output_ids for o in spec.step() if o.finished})
    assert outs[rid] == plain.generate(second, GREEDY)["output_ids"]
    # another namespace sees nothing of the first request's text
    other = spec.add_request(second, GREEDY, namespace="other")[0]
    assert spec.speculator.propose(spec.processor.reqs[other], 4) == []
    while spec.has_unfinished():
        spec.step()
    spec.flush_cache()
    spec.cache.check_integrity([])
    assert spec.cache.allocator.num_free == spec.cache.allocator.num_usable
    assert spec.speculator.store.num_tokens == 0
