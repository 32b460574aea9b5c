"""The hybrid sliding-window pool (D-46): the allocator's two page spaces, and through the engine, with a
tiny random Gemma 3 and windowed Mistral (window 16, page 8): window layers hold only the pages their
windows read, a radix match is cut back to where the window layers still hold the last window, and
outputs equal those of a pool that keeps every layer's pages."""

from __future__ import annotations

import numpy as np
import pytest

from jaxserve.cache.window_pool import (
    HybridPageAllocator,
    check_window_pool_fits,
    layers_per_full_token,
    plan_window_layout,
    window_pages_needed,
)
from tests.conftest import make_hf_checkpoint
from tests.parallel.test_sliding_window_tp import CASES, WINDOW

PAGE = 8


def _allocator(num_pages: int = 9, ratio: float = 0.5) -> HybridPageAllocator:
    return HybridPageAllocator(plan_window_layout((16, None, 16), num_pages, ratio))


def test_layout_places_each_layer_in_its_own_page_space():
    layout = plan_window_layout((16, None, 16, 16), 100, 0.5)
    assert layout.num_window_pages == 50 and layout.window == 16
    # full layer 1 at flat page 0; window layers 0, 2, 3 in blocks of 50 after the full layer's 100
    assert layout.page_base().tolist() == [100, 0, 150, 200]
    assert layout.uses_window().tolist() == [1, 0, 1, 1]
    assert layout.num_flat_pages == 250
    assert layers_per_full_token((16, None, 16, 16), 0.5) == 2.5
    with pytest.raises(ValueError, match="no sliding-window layer"):
        plan_window_layout((None, None), 100, 0.5)
    with pytest.raises(ValueError, match="swa-full-tokens-ratio"):
        plan_window_layout((16,), 100, 1.5)


def test_a_window_space_too_small_for_one_request_is_refused():
    layout = plan_window_layout((512, None), 65, 0.1)  # 6 window pages of 16: 96 tokens
    with pytest.raises(ValueError, match=r"needs up to 1024 of it .* lower --chunked-prefill-size"):
        check_window_pool_fits(layout, 512, 16)
    check_window_pool_fits(plan_window_layout((512, None), 65, 1.0), 256, 16)


def test_window_pages_needed_counts_the_pages_of_the_last_window():
    assert window_pages_needed(0, 16, 8) == 0
    assert window_pages_needed(8, 16, 8) == 1
    assert window_pages_needed(100, 16, 8) == 3  # positions 85..99: pages 10..12
    assert window_pages_needed(104, 16, 8) == 2  # positions 89..103: pages 11, 12


def test_allocator_gives_and_takes_both_parts():
    alloc = _allocator()  # 8 full pages, 4 window pages
    assert alloc.num_free == 4 and alloc.num_free_full == 8 and alloc.num_usable == 4
    pages = alloc.allocate(4)
    assert alloc.has_window(pages).all() and len(set(alloc.window_page_of[pages].tolist())) == 4
    assert not alloc.can_allocate(1)
    with pytest.raises(MemoryError, match="window pages free"):
        alloc.allocate(1)
    alloc.drop_window(pages[:2])
    assert not alloc.has_window(pages[:2]).any() and alloc.num_free == 2
    more = alloc.allocate(2)
    alloc.move_window(more[0], pages[0])
    assert alloc.has_window([pages[0]]).all() and not alloc.has_window([more[0]]).any()
    alloc.window_locks[pages[0]] += 1
    with pytest.raises(ValueError, match="window still reads"):
        alloc.free([pages[0]])
    with pytest.raises(ValueError, match="still reads"):
        alloc.drop_window([pages[0]])
    alloc.window_locks[pages[0]] -= 1
    alloc.check_integrity()
    alloc.free(pages + more)
    assert alloc.num_free == 4 and alloc.num_free_full == 8 and not alloc.window_page_of.any()
    alloc.check_integrity()


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory, default_tokenizer, sliding_window_model_dir) -> dict[str, str]:
    pytest.importorskip("torch")
    mistral = make_hf_checkpoint(tmp_path_factory.mktemp("mistral"), *CASES["mistral"], seed=3,
                                 tokenizer=default_tokenizer)
    return {"gemma3": sliding_window_model_dir, "mistral": mistral}


def _engine(path: str, **kw):
    from jaxserve.engine.engine import Engine

    kw = {"max_total_tokens": 1024, "context_length": 512, **kw}
    return Engine(model_path=path, max_running_requests=4, chunked_prefill_size=32, page_size=PAGE,
                  disable_precompile=True, **kw)


GREEDY = {"max_new_tokens": 24, "temperature": 0, "ignore_eos": True}


@pytest.mark.parametrize("case", ["gemma3", "mistral"])
def test_a_request_needs_only_its_window_and_the_tree_keeps_the_rest_as_cache(model_dirs, case):
    rng = np.random.default_rng(11)
    prompt = [int(x) for x in rng.integers(3, 49152, 200)]
    every_page = _engine(model_dirs[case], disable_hybrid_swa_memory=True)
    assert every_page.runner.window_layout is None
    expected = every_page.generate([prompt], GREEDY)[0]["output_ids"]

    engine = _engine(model_dirs[case])
    alloc = engine.cache.allocator
    assert isinstance(alloc, HybridPageAllocator) and alloc.layout.window == WINDOW
    engine.add_request(prompt, GREEDY)
    peak_locked, output_ids = 0, []
    while engine.scheduler.has_work():
        for out in engine.step():
            output_ids = out.output_ids
        engine.cache.check_integrity(engine.scheduler.live_reqs())
        peak_locked = max(peak_locked, int(np.count_nonzero(alloc.window_locks)))
    assert output_ids == expected
    # what the request needs at any step: a 32-token chunk and the 15 tokens before it, 7 pages of 8
    assert 0 < peak_locked <= (32 + WINDOW) // PAGE + 1, peak_locked
    # finished: the tree keeps all 27 full pages; the prompt's window parts stay as cache, the decoded
    # tokens' only for the last window
    assert alloc.num_used == (200 + 24 - 1) // PAGE
    assert alloc.window.num_used <= 200 // PAGE + window_pages_needed(200 + 24 - 1, WINDOW, PAGE)
    # nothing runs: admission sees the full space (free + the tree's 27 pages), a step every window page
    assert engine.cache.available_tokens() == PAGE * (alloc.num_free_full + 27)
    assert engine.cache.window_available_pages() == alloc.window.num_usable

    # the same prompt again hits as it does with every layer's pages
    again, ref = engine.generate([prompt], GREEDY)[0], every_page.generate([prompt], GREEDY)[0]
    assert again["output_ids"] == expected
    assert again["meta_info"]["cached_tokens"] == ref["meta_info"]["cached_tokens"] == 192
    engine.cache.check_integrity([])


def test_a_match_is_cut_back_to_where_the_window_is_held(model_dirs):
    """A window space of 15 pages: after other prompts took it over, the first prompt's window parts are
    gone (its full pages stay), so a prompt sharing its first 96 tokens reuses none of them, and the
    outputs stay those of a pool that keeps every layer's pages."""
    rng = np.random.default_rng(12)
    shared = [int(x) for x in rng.integers(3, 49152, 96)]
    first = shared + [int(x) for x in rng.integers(3, 49152, 40)]
    others = [[int(x) for x in rng.integers(3, 49152, 100)] for _ in range(3)]
    branch = shared + [int(x) for x in rng.integers(3, 49152, 20)]
    every_page = _engine(model_dirs["gemma3"], disable_hybrid_swa_memory=True)
    engine = _engine(model_dirs["gemma3"], swa_full_tokens_ratio=0.12)
    assert engine.runner.window_layout.num_window_pages - 1 == 15
    for prompt in [first] + others:
        assert engine.generate([prompt], GREEDY)[0]["output_ids"] == every_page.generate([prompt], GREEDY)[0]["output_ids"]
        engine.cache.check_integrity([])
    ref_branch, out_branch = every_page.generate([branch], GREEDY)[0], engine.generate([branch], GREEDY)[0]
    assert out_branch["output_ids"] == ref_branch["output_ids"]
    assert ref_branch["meta_info"]["cached_tokens"] == 96
    assert out_branch["meta_info"]["cached_tokens"] == 0
    # the full pages stayed in the tree: nothing was evicted, only window parts dropped
    assert engine.cache.num_evicted_tokens == 0
    # the most recent prompt's window parts are still held: its repeat hits as with every layer's pages
    ref_last, out_last = every_page.generate([branch], GREEDY)[0], engine.generate([branch], GREEDY)[0]
    assert out_last["output_ids"] == ref_last["output_ids"]
    assert out_last["meta_info"]["cached_tokens"] == ref_last["meta_info"]["cached_tokens"] > 0
    engine.cache.check_integrity([])
    engine.flush_cache()
    assert engine.cache.allocator.num_free == engine.cache.allocator.num_usable


def test_retraction_and_the_scan_loop_keep_the_outputs(model_dirs):
    """A pool of 24 pages (19 window pages) for 8 requests of 24 + 64 tokens: requests retract and come
    back through a match of their own prefix; `--layer-loop scan` runs the same pool layout."""
    rng = np.random.default_rng(13)
    prompts = [[int(x) for x in rng.integers(3, 49152, 24)] for _ in range(8)]
    kw = dict(max_total_tokens=192, context_length=128)
    params = dict(GREEDY, max_new_tokens=64)
    expected = [o["output_ids"] for o in _engine(model_dirs["gemma3"], disable_hybrid_swa_memory=True, **kw)
                .generate(prompts, params)]
    for layer_loop in ("host", "scan"):
        engine = _engine(model_dirs["gemma3"], layer_loop=layer_loop, **kw)
        assert [o["output_ids"] for o in engine.generate(prompts, params)] == expected
        assert engine.scheduler.num_retractions > 0, "no request was retracted"
        engine.cache.check_integrity([])
        engine.flush_cache()
        assert engine.cache.allocator.num_free == engine.cache.allocator.num_usable


@pytest.mark.parametrize("layer_loop", ["host", "scan"])
def test_the_hybrid_step_updates_the_flat_pools_in_place(model_dirs, layer_loop):
    """Pools reshaped to flat pages inside the step were copied whole in every layer (a decode step 38x
    slower); the flat `[1, F, ...]` arrays are donated and updated in place (compiled HLO, no timing)."""
    import jax.numpy as jnp

    from jaxserve.cache.kv_pool import PoolShape
    from jaxserve.core.batch import BatchEntry
    from jaxserve.model.loader import load_model
    from jaxserve.pallas.reference import ragged_paged_attention_xla
    from jaxserve.runner.hlo_text import aliased_params, pool_copies
    from jaxserve.runner.model_runner import ModelRunner
    from tests.runner.test_model_runner_hlo import pool_program_text

    config, params = load_model(model_dirs["gemma3"], "float32", use_weights_cache=False)
    alloc = HybridPageAllocator(plan_window_layout(config.layer_sliding_windows(), 64, 0.5))
    shape = alloc.layout.device_pool_shape(
        PoolShape(config.num_layers, 64, PAGE, config.num_kv_heads, config.head_dim, "float32")).shape
    runner = ModelRunner(config, params, jnp.zeros(shape), jnp.zeros(shape), attn_fn=ragged_paged_attention_xla,
                         max_running_requests=4, max_extend_tokens=64, context_length=256, layer_loop=layer_loop,
                         allocator=alloc)
    pages = alloc.allocate(13)
    alloc.drop_window(pages[:8])
    text = pool_program_text(runner, [BatchEntry([5], 100, pages)])
    assert pool_copies(text, runner.k_pool.shape) == []
    assert {name.split(".")[0] for name in aliased_params(text)} >= {"k_pool", "v_pool"}


def test_a_prompt_longer_than_the_window_space_runs(model_dirs):
    """The window space (here 256 tokens) holds a request's window and its next chunk, not its prompt:
    a 400-token prompt is admitted and prefilled chunk by chunk (it waited forever when admission
    counted window tokens as if they held the whole prompt)."""
    rng = np.random.default_rng(14)
    prompt = [int(x) for x in rng.integers(3, 49152, 400)]
    expected = _engine(model_dirs["gemma3"], disable_hybrid_swa_memory=True).generate([prompt], GREEDY)[0]
    engine = _engine(model_dirs["gemma3"], swa_full_tokens_ratio=0.25)
    assert (engine.runner.window_layout.num_window_pages - 1) * PAGE == 256
    out = engine.generate([prompt], GREEDY)[0]
    assert out["output_ids"] == expected["output_ids"]
    engine.cache.check_integrity([])


def test_window_parts_no_window_reads_are_dropped_when_the_window_space_is_short(model_dirs):
    """Each prompt extends the one before, so the tree keeps the last window of each on one path, which
    the next request holds locked: 10 window pages fill up with window parts no window reads. They are
    dropped (the pages stay cached) instead of the engine dying with "cannot hold a single decoding
    request"; outputs stay those of the pool that keeps every layer's pages."""
    rng = np.random.default_rng(15)
    tokens = [int(x) for x in rng.integers(3, 49152, 320)]
    prompts = [tokens[:n] for n in range(40, 321, 20)]
    params = dict(GREEDY, max_new_tokens=8)
    every_page = _engine(model_dirs["gemma3"], disable_hybrid_swa_memory=True)
    engine = _engine(model_dirs["gemma3"], swa_full_tokens_ratio=0.08)
    assert engine.runner.window_layout.num_window_pages - 1 == 10
    for prompt in prompts:
        ref, out = every_page.generate([prompt], params)[0], engine.generate([prompt], params)[0]
        assert out["output_ids"] == ref["output_ids"], len(prompt)
        engine.cache.check_integrity([])
    # the full pages stayed: the last prompt reused the one before it up to where window parts remained
    assert out["meta_info"]["cached_tokens"] > 0


def test_a_host_tier_keeps_every_layers_pages_and_says_so(model_dirs):
    engine = _engine(model_dirs["gemma3"], enable_hierarchical_cache=True)
    assert engine.runner.window_layout is None and not isinstance(engine.cache.allocator, HybridPageAllocator)
    assert engine.args.disable_hybrid_swa_memory  # as /get_server_info reports it
