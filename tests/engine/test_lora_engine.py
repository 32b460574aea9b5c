"""Multi-LoRA serving in the engine on the tiny checkpoint: greedy ids against PEFT, mixed batches,
the radix cache keyed on the adapter, the per-batch adapter limit, and load/unload during traffic."""

from __future__ import annotations

import numpy as np
import pytest

from jaxserve.core.errors import RequestError
from jaxserve.engine.engine import Engine
from jaxserve.engine.request_input import GenerateInput
from jaxserve.model.lora import LoraError
from tests.model.lora_helpers import make_peft_adapter, peft_greedy, peft_model

NEW = 8
GREEDY = {"max_new_tokens": NEW, "temperature": 0}
PROMPTS = [[5, 17, 301, 42, 9, 77, 1003, 12], [88, 7, 1200, 3, 3, 14, 60], [400, 401, 402, 403, 404, 405, 406, 407, 408]]


@pytest.fixture(scope="module")
def adapters(tiny_model_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("engine_adapters")
    return {
        "a": make_peft_adapter(tiny_model_dir, str(root / "a"), seed=11, rank=8, alpha=16),
        "b": make_peft_adapter(tiny_model_dir, str(root / "b"), seed=12, rank=8, alpha=32, use_rslora=True),
        "c": make_peft_adapter(tiny_model_dir, str(root / "c"), seed=13, rank=4, alpha=8,
                               targets=("q_proj", "v_proj", "o_proj", "down_proj")),
    }


def make_engine(model_dir, adapters=None, **kwargs) -> Engine:
    base = dict(model_path=model_dir, max_total_tokens=2048, max_running_requests=8, chunked_prefill_size=64,
                context_length=128, page_size=4, disable_precompile=True, prefill_decode_itl_ratio=0,
                enable_lora=True, max_lora_rank=8,
                lora_paths=tuple(f"{k}={v}" for k, v in (adapters or {}).items()))
    base.update(kwargs)
    return Engine(**base)


@pytest.fixture(scope="module")
def engine(tiny_model_dir, adapters):
    return make_engine(tiny_model_dir, adapters)


@pytest.fixture(scope="module")
def alone(engine):
    """Each (prompt, adapter) run alone: the ids every other test compares with."""
    out = {}
    for i, prompt in enumerate(PROMPTS):
        for name in (None, "a", "b", "c"):
            out[i, name] = engine.generate(prompt, GREEDY, lora_path=name)["output_ids"]
    return out


def assert_no_leak(engine: Engine) -> None:
    assert engine.scheduler.lora.num_slot_users == 0
    freed = engine.cache.tree.reset()
    engine.cache.allocator.free(freed)
    assert engine.cache.allocator.num_free == engine.cache.allocator.num_usable


def test_greedy_matches_peft(tiny_model_dir, adapters, alone):
    ref = peft_model(tiny_model_dir, adapters)
    for i, prompt in enumerate(PROMPTS):
        for name in (None, "a", "b", "c"):
            assert alone[i, name] == peft_greedy(ref, name, prompt, NEW), (i, name)
    # the adapters change what is generated (else the test would pass on the base model)
    assert all(alone[i, "a"] != alone[i, None] for i in range(len(PROMPTS)))


def test_mixed_batch_gives_what_each_gets_alone(engine, alone):
    prompts, names = [], []
    for i, prompt in enumerate(PROMPTS):
        for name in (None, "a", "b"):
            prompts.append(prompt)
            names.append(name)
    outs = engine.generate(prompts, GREEDY, lora_path=names)
    for i, (prompt, name, out) in enumerate(zip(prompts, names, outs)):
        assert out["output_ids"] == alone[PROMPTS.index(prompt), name], (i, name)


def test_base_requests_unchanged_by_loaded_adapters(tiny_model_dir, alone):
    plain = make_engine(tiny_model_dir, enable_lora=False, lora_paths=None)
    for i, prompt in enumerate(PROMPTS):
        assert plain.generate(prompt, GREEDY)["output_ids"] == alone[i, None]


def test_radix_cache_keys_on_the_adapter(engine, alone):
    engine.flush_cache()
    prompt = PROMPTS[0] * 3  # 24 tokens: whole pages to share
    first = engine.generate(prompt, GREEDY, lora_path="a")
    other = engine.generate(prompt, GREEDY, lora_path="b")
    same = engine.generate(prompt, GREEDY, lora_path="a")
    base = engine.generate(prompt, GREEDY)
    assert first["meta_info"]["cached_tokens"] == 0
    assert other["meta_info"]["cached_tokens"] == 0  # same text, other adapter: no shared KV
    assert base["meta_info"]["cached_tokens"] == 0
    assert same["meta_info"]["cached_tokens"] >= 20  # same adapter: shared
    assert same["output_ids"] == first["output_ids"]
    assert other["output_ids"] != first["output_ids"]
    # the cache keys on the adapter's files, not its name: a copy under another name shares the KV
    engine.load_lora_adapter("a-again", engine.loaded_lora_adapters()["a"])
    again = engine.generate(prompt, GREEDY, lora_path="a-again")
    engine.unload_lora_adapter("a-again")
    assert again["meta_info"]["cached_tokens"] >= 20 and again["output_ids"] == first["output_ids"]


def test_batch_holds_at_most_max_loras_per_batch(tiny_model_dir, adapters, alone):
    eng = make_engine(tiny_model_dir, adapters, max_loras_per_batch=2)
    seen = []
    forward = eng.runner.forward

    def spy(entries, *args, **kwargs):
        seen.append({e.lora_slot for e in entries})
        return forward(entries, *args, **kwargs)

    eng.runner.forward = spy
    names = [None, "a", "b", "c"] * 2
    prompts = [PROMPTS[i % 3] for i in range(len(names))]
    outs = eng.generate(prompts, GREEDY, lora_path=names)
    for prompt, name, out in zip(prompts, names, outs):
        assert out["output_ids"] == alone[PROMPTS.index(prompt), name]
    assert max(len(s) for s in seen) == 2
    assert_no_leak(eng)


def test_unknown_adapter_is_refused_naming_lora_path(engine):
    with pytest.raises(RequestError) as e:
        engine.add_request(GenerateInput([1, 2, 3], GREEDY, lora_path="nope"))
    assert e.value.field == "lora_path"


def test_load_errors_leave_the_engine_serving(engine, adapters, tmp_path, alone):
    with pytest.raises(ValueError, match="already loaded"):
        engine.load_lora_adapter("a", adapters["a"])
    with pytest.raises(LoraError, match="not found"):
        engine.load_lora_adapter("x", str(tmp_path / "missing"))
    assert engine.generate(PROMPTS[0], GREEDY, lora_path="a")["output_ids"] == alone[0, "a"]


def test_load_unload_storm_during_traffic(tiny_model_dir, adapters, alone):
    """Adapters loaded and unloaded between steps while requests under them run: every request
    finishes with what it gets alone, unloaded names are refused, nothing leaks."""
    eng = make_engine(tiny_model_dir, {"a": adapters["a"]}, max_loras_per_batch=2, max_loaded_loras=3,
                      enable_debug_checks=True)  # the slot table checked whenever the engine is idle
    rng = np.random.default_rng(0)
    expected, done = {}, {}
    loaded = {"a"}
    for step in range(60):
        if step % 3 == 0 and step < 45:
            name = rng.choice(sorted(loaded | {None}, key=str))
            i = int(rng.integers(len(PROMPTS)))
            rids = eng.add_request(GenerateInput(PROMPTS[i], GREEDY, lora_path=name))
            expected[rids[0]] = alone[i, name]
        if step % 4 == 1:
            name = ["a", "b", "c"][int(rng.integers(3))]
            if name in loaded:
                lora_id = eng.unload_lora_adapter(name)
                loaded.discard(name)
                with pytest.raises(RequestError):
                    eng.add_request(GenerateInput([1, 2], GREEDY, lora_path=name))
                assert isinstance(lora_id, str)
            else:
                evicted = eng.load_lora_adapter(name, adapters[name])
                loaded = (loaded | {name}) - set(evicted)
        for out in eng.step():
            if out.finished:
                done[out.rid] = out.output_ids
    while eng.has_unfinished():
        for out in eng.step():
            if out.finished:
                done[out.rid] = out.output_ids
    assert done == expected
    assert_no_leak(eng)
    assert set(eng.loaded_lora_adapters()) == loaded


def test_speculative_decoding_verifies_under_the_adapter(tiny_model_dir, adapters, engine):
    """NGRAM drafts (from the prompt's repeats and the earlier requests' outputs, under any adapter) are
    verified under each request's adapter: the greedy ids are those of plain decoding."""
    eng = make_engine(tiny_model_dir, adapters, speculative_algorithm="NGRAM", speculative_num_draft_tokens=3,
                      disable_speculative_adaptive=True)
    names = [None, "a", "b", "c"]
    prompt = [5, 17, 301, 42] * 4
    want = [engine.generate(prompt, GREEDY, lora_path=n)["output_ids"] for n in names]
    for _ in range(2):  # the second round drafts from the first round's outputs
        outs = eng.generate([prompt] * 4, GREEDY, lora_path=names)
        assert [o["output_ids"] for o in outs] == want
    assert eng.stats.num_spec_verifications > 0  # drafts were verified (under the adapters)
    assert_no_leak(eng)


def test_overlap_retraction_and_n_under_adapters(tiny_model_dir, adapters, alone):
    """The overlap schedule, n > 1 and retraction (a pool too small for every request at once) keep
    each sequence on its adapter."""
    eng = make_engine(tiny_model_dir, adapters, disable_overlap_schedule=False, max_total_tokens=48,
                      page_size=4, max_running_requests=8)
    names = ["a", "b", None, "c", "a", "b"]
    prompts = [PROMPTS[i % 3] for i in range(len(names))]
    outs = eng.generate(prompts, [{**GREEDY, "n": 2}] * len(names), lora_path=names)
    for k, (prompt, name) in enumerate(zip(prompts, names)):
        for seq in outs[2 * k : 2 * k + 2]:
            assert seq["output_ids"] == alone[PROMPTS.index(prompt), name], (k, name)
    assert eng.scheduler.num_retractions > 0
    assert eng.stats.num_overlapped_steps > 0
    assert_no_leak(eng)


def test_storage_tier_keys_on_the_adapter_files(tiny_model_dir, adapters, tmp_path, monkeypatch):
    """KV stored under one adapter is never read under another, even one loaded later under the same
    name (a restart, other files); the same files under another name read it."""
    from jaxserve.cache.storage import ENV_STORAGE_DIR

    monkeypatch.setenv(ENV_STORAGE_DIR, str(tmp_path / "hicache"))
    flags = dict(page_size=16, hicache_storage_backend="file", hicache_storage_backend_extra_config='{"prefetch_threshold": 16}')
    prompt = PROMPTS[2] * 8  # 72 tokens: four whole pages to store

    def serve(eng, name):
        out = eng.generate(prompt, GREEDY, lora_path=name)
        eng.step()  # an idle iteration: the engine loop runs one when it goes idle
        eng.cache.policy.storage.storage.flush_writes()
        return out["output_ids"], out["meta_info"]["cached_tokens"]

    first = make_engine(tiny_model_dir, {"a": adapters["a"]}, **flags)
    out_a, cached = serve(first, "a")
    assert cached == 0
    first.close()
    # a restart where the name "a" holds adapter b's files: a miss, b's own output
    second = make_engine(tiny_model_dir, {"a": adapters["b"], "copy": adapters["a"]}, **flags)
    out_b, cached = serve(second, "a")
    assert cached == 0
    assert out_b == make_engine(tiny_model_dir, {"b": adapters["b"]}).generate(prompt, GREEDY, lora_path="b")["output_ids"]
    out_copy, cached = serve(second, "copy")  # adapter a's files under another name: a storage hit
    assert cached >= 64 and out_copy == out_a


def test_grammars_constrain_requests_under_adapters(engine):
    """A regex constraint holds under every adapter, alone and in one mixed batch (the bitmask and the
    slot index meet in the same step)."""
    import re

    params = {"regex": "(yes|no) [0-9]{2}", "max_new_tokens": 12, "temperature": 0}
    names = [None, "a", "b", "c"]
    alone = [engine.generate(PROMPTS[0], params, lora_path=name) for name in names]
    mixed = engine.generate([PROMPTS[0]] * len(names), params, lora_path=names)
    for name, one, batched in zip(names, alone, mixed):
        assert re.fullmatch("(yes|no) [0-9]{2}", one["text"]), (name, one["text"])
        assert batched["output_ids"] == one["output_ids"], name
    assert_no_leak(engine)


def test_host_tier_recalls_keep_each_adapters_kv_apart(tiny_model_dir, adapters, engine):
    """With the host tier on and every unlocked page released between requests, a prompt's KV under
    adapter a comes back from the host as a cache hit for a, never for b or the base model, and every
    output is what the plain LoRA engine gives."""
    prompt = PROMPTS[0] * 3  # 24 tokens: whole pages
    want = {name: engine.generate(prompt, GREEDY, lora_path=name)["output_ids"] for name in ("a", "b", None)}
    tiered = make_engine(tiny_model_dir, adapters, enable_hierarchical_cache=True, radix_cache_soft_free_threshold=0.0,
                         radix_cache_evict_threshold=0.0, release_conservative_batch_size=0,
                         release_aggressive_batch_size=0)
    cached = {}
    for name in ("a", "a", "b", None):
        out = tiered.generate(prompt, GREEDY, lora_path=name)
        assert out["output_ids"] == want[name], name
        cached.setdefault(name, []).append(out["meta_info"]["cached_tokens"])
        tiered.step()  # an idle iteration: the release policy's tick moves the cold pages to the host
    assert cached["a"][0] == 0 and cached["a"][1] >= 20  # a's own KV, recalled
    assert cached["b"] == [0] and cached[None] == [0]  # the same text under another adapter: no hit
    assert tiered.radix_cache_stats().num_recalls > 0
    tiered.cache.check_integrity([])
