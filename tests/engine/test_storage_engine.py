"""The storage tier end to end on the tiny random Llama: a prefix survives a restart and is shared by two
engines on one directory, with the same greedy output; another configuration, a damaged file or a full
bound never serves a wrong page; the cache's integrity check holds throughout."""

from __future__ import annotations

import logging
import os

import numpy as np
import pytest

from jaxserve.cache.storage import ENV_MAX_SIZE, ENV_STORAGE_DIR, StorageError
from jaxserve.engine.engine import Engine

GREEDY = {"max_new_tokens": 6, "temperature": 0}
PAGE_SIZE = 16
EXTRA = '{"prefetch_threshold": 16}'  # SGLang's 256-token threshold is longer than these prompts


@pytest.fixture
def storage_dir(tmp_path, monkeypatch):
    path = tmp_path / "hicache"
    monkeypatch.setenv(ENV_STORAGE_DIR, str(path))
    return path


def make_engine(model_dir, **kwargs) -> Engine:
    base = dict(model_path=model_dir, max_total_tokens=1024, max_running_requests=4, chunked_prefill_size=64,
                context_length=256, page_size=PAGE_SIZE, disable_precompile=True, prefill_decode_itl_ratio=0,
                hicache_storage_backend="file", hicache_storage_backend_extra_config=EXTRA)
    base.update(kwargs)
    return Engine(**base)


def prompt(seed: int, n: int = 150) -> list[int]:
    return list(map(int, np.random.default_rng(seed).integers(3, 40000, n)))


def serve(engine: Engine, tokens: list[int]) -> tuple[list[int], int]:
    out = serve_out(engine, tokens)
    return out["output_ids"], out["meta_info"]["cached_tokens"]


def serve_out(engine: Engine, tokens: list[int]) -> dict:
    out = engine.generate(tokens, GREEDY)
    engine.step()  # an idle iteration, as the engine loop runs one when it goes idle
    engine.cache.policy.storage.storage.flush_writes()
    engine.cache.check_integrity([])
    return out


def aligned(tokens: list[int]) -> int:
    return (len(tokens) - 1) // PAGE_SIZE * PAGE_SIZE


def test_a_prefix_survives_a_restart(tiny_model_dir, storage_dir, caplog):
    tokens = prompt(0)
    a = make_engine(tiny_model_dir)
    out = serve_out(a, tokens)
    output = out["output_ids"]
    assert out["meta_info"]["cached_tokens"] == 0 and out["meta_info"]["cached_tokens_details"] is None
    a.close()
    b = make_engine(tiny_model_dir, decode_log_interval=1)  # a restart: empty tree, empty pool, the same directory
    with caplog.at_level(logging.INFO, logger="jaxserve.engine.engine"):
        out = serve_out(b, tokens)
    output_b, cached_b = out["output_ids"], out["meta_info"]["cached_tokens"]
    assert cached_b >= aligned(tokens) and output_b == output
    # every cached token came from storage, SGLang's meta_info shape says so
    assert out["meta_info"]["cached_tokens_details"] == {"device": 0, "host": 0, "storage": cached_b,
                                                         "storage_backend": "HiCacheFile"}
    stats = b.radix_cache_stats()
    assert stats.storage_hit_tokens == cached_b and stats.storage_bytes_read > 0
    # the periodic stats line carries the storage tier's numbers
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("Storage tier.")]
    assert lines and lines[-1] == (
        f"Storage tier. hits: {cached_b} tokens, read: {stats.storage_bytes_read} B, "
        f"written: {stats.storage_bytes_written} B, prefetch waits: {stats.storage_prefetch_waits}, files evicted: 0")
    # the same prompt again: a device hit
    out = serve_out(b, tokens)
    assert out["meta_info"]["cached_tokens_details"] == {"device": out["meta_info"]["cached_tokens"], "host": 0,
                                                         "storage": 0, "storage_backend": "HiCacheFile"}
    # /flush_cache empties the device (and host) tiers; the files stay, so the prompt is a storage hit again
    b.flush_cache()
    assert b.cache.tree.total_size() == 0
    output_b, cached_b = serve(b, tokens)
    assert cached_b >= aligned(tokens) and output_b == output
    assert b.radix_cache_stats().storage_hit_tokens == 2 * cached_b
    # a request aborted while it waits leaves no prefetch behind
    b.flush_cache()
    rid = b.add_request(tokens, GREEDY)[0]
    assert b.cache.policy.storage.num_prefetching == 1
    assert b.abort(rid)
    b.step()
    assert b.cache.policy.storage.num_prefetching == 0
    b.cache.check_integrity([])
    # another quantization on the same directory: other KV bytes, other keys, no hit
    c = make_engine(tiny_model_dir, quantization="w8a8_int8")
    _, cached_c = serve(c, tokens)
    assert cached_c == 0
    b.close(), c.close()


def test_a_bfloat16_pool_survives_a_restart(tiny_model_dir, storage_dir):
    """bfloat16, the pool's dtype on GPU and TPU: its pages go through files and back bit for bit."""
    tokens = prompt(4, 100)
    a = make_engine(tiny_model_dir, dtype="bfloat16")
    output, _ = serve(a, tokens)
    a.close()
    b = make_engine(tiny_model_dir, dtype="bfloat16")
    output_b, cached_b = serve(b, tokens)
    assert cached_b >= aligned(tokens) and output_b == output
    c = make_engine(tiny_model_dir)  # float32 on the same directory: another fingerprint, no hit
    assert serve(c, tokens)[1] == 0
    b.close(), c.close()


def test_two_engines_share_one_directory(tiny_model_dir, storage_dir):
    a, b = make_engine(tiny_model_dir), make_engine(tiny_model_dir)
    tokens = prompt(1)
    output, _ = serve(a, tokens)
    output_b, cached_b = serve(b, tokens)  # b never computed it
    assert cached_b >= aligned(tokens) and output_b == output
    longer = tokens + prompt(2, 40)
    output_b, _ = serve(b, longer)  # b computes the rest; a reads b's pages
    output_a, cached_a = serve(a, longer)
    assert cached_a >= aligned(longer) and output_a == output_b
    a.close(), b.close()


def test_damaged_files_are_misses_with_the_same_output(tiny_model_dir, storage_dir):
    tokens = prompt(3)
    a = make_engine(tiny_model_dir)
    output, _ = serve(a, tokens)
    a.close()
    keys = a.cache.policy.storage.keys(tokens[:-1])
    path = a.cache.policy.storage.storage.path(keys[4])
    with open(path, "r+b") as f:  # a few bytes of page 4 rot
        f.seek(-100, os.SEEK_END)
        f.write(b"\x00\x01\x02\x03")
    os.truncate(a.cache.policy.storage.storage.path(keys[6]), 64)  # and page 6 is torn
    b = make_engine(tiny_model_dir)
    output_b, cached_b = serve(b, tokens)
    assert cached_b == 4 * PAGE_SIZE and output_b == output
    assert b.radix_cache_stats().storage_bad_files == 1  # the chain stopped at page 4
    b.close()


def test_the_directory_stays_within_its_bound(tiny_model_dir, storage_dir, monkeypatch):
    a = make_engine(tiny_model_dir)
    file_bytes = a.cache.policy.storage.storage.file_bytes
    a.close()
    monkeypatch.setenv(ENV_MAX_SIZE, str(12 * file_bytes))
    a = make_engine(tiny_model_dir)
    for seed in range(4):  # 4 x 9 pages of prompt, more than the 12 the bound holds
        serve(a, prompt(10 + seed))
        files = [n for n in os.listdir(storage_dir) if n.endswith(".kv")]
        assert len(files) * file_bytes <= 12 * file_bytes
    assert a.radix_cache_stats().storage_files_evicted > 0
    a.close()


def test_an_unwritable_directory_is_an_error_at_start_up(tiny_model_dir, tmp_path, monkeypatch):
    blocker = tmp_path / "not_a_dir"
    blocker.write_text("x")
    monkeypatch.setenv(ENV_STORAGE_DIR, str(blocker / "hicache"))
    with pytest.raises(StorageError, match=ENV_STORAGE_DIR):
        make_engine(tiny_model_dir)


LIFE = """
import json, sys
from jaxserve.engine.engine import Engine
engine = Engine(model_path="default", max_total_tokens=4096, context_length=2048, chunked_prefill_size=512,
                disable_precompile=True, hicache_storage_backend="file")
out = engine.generate(json.loads(sys.argv[1]), {"max_new_tokens": 16, "temperature": 0})
engine.step()
engine.close()
print(json.dumps({"output_ids": out["output_ids"], "cached_tokens": out["meta_info"]["cached_tokens"]}))
"""


@pytest.mark.slow
def test_default_model_1600_token_prompt_survives_a_process_restart(default_tokenizer, tmp_path):
    import json
    import subprocess
    import sys

    text = " ".join(f"Record {i}: the {['red', 'green', 'blue'][i % 3]} crate in aisle {i % 17} holds {i * 7} parts."
                    for i in range(160))
    tokens = default_tokenizer.encode(text, add_special_tokens=False)[:1600]
    assert len(tokens) == 1600
    env = {**os.environ, ENV_STORAGE_DIR: str(tmp_path / "hicache")}

    def life() -> dict:
        done = subprocess.run([sys.executable, "-c", LIFE, json.dumps(tokens)], env=env, capture_output=True,
                              text=True, timeout=600)
        assert done.returncode == 0, done.stderr[-2000:]
        return json.loads(done.stdout.splitlines()[-1])

    first, second = life(), life()  # two processes: the second starts after the first exited
    assert first["cached_tokens"] == 0
    assert second["cached_tokens"] >= 1024 and second["output_ids"] == first["output_ids"]


KILLED_LIFE = """
import sys
import numpy as np
from jaxserve.engine.engine import Engine
engine = Engine(model_path=sys.argv[1], max_total_tokens=1024, max_running_requests=4, chunked_prefill_size=64,
                context_length=256, page_size=16, disable_precompile=True, prefill_decode_itl_ratio=0,
                hicache_storage_backend="file", hicache_storage_backend_extra_config='{"prefetch_threshold": 16}')
print("ready", flush=True)
for seed in range(1000):  # serve until killed
    tokens = list(map(int, np.random.default_rng(seed).integers(3, 40000, 150)))
    engine.generate(tokens, {"max_new_tokens": 6, "temperature": 0})
    engine.step()
"""


@pytest.mark.slow
def test_kill_9_while_writing_then_a_restart_serves_no_torn_page(tiny_model_dir, storage_dir):
    import signal
    import subprocess
    import sys
    import time

    env = {**os.environ, ENV_STORAGE_DIR: str(storage_dir)}
    child = subprocess.Popen([sys.executable, "-c", KILLED_LIFE, tiny_model_dir], env=env, stdout=subprocess.PIPE,
                             text=True)
    assert child.stdout.readline().strip() == "ready"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and len(list(storage_dir.glob("*.kv"))) < 40:
        time.sleep(0.05)
    os.kill(child.pid, signal.SIGKILL)  # mid-stream: its writer thread is writing pages
    child.wait()
    assert len(list(storage_dir.glob("*.kv"))) >= 40
    restarted = make_engine(tiny_model_dir)
    reference = make_engine(tiny_model_dir, hicache_storage_backend=None)  # recomputes everything
    num_hits = 0
    for seed in range(4):
        tokens = prompt(seed, 150)
        expected = reference.generate(tokens, GREEDY)["output_ids"]
        output, cached = serve(restarted, tokens)
        assert output == expected, f"prompt {seed}: a page read back differs from the computed one"
        num_hits += cached > 0
    assert num_hits >= 2  # the prompts the killed process finished are storage hits
    assert not list(storage_dir.glob(".*.tmp")), "the dead writer's temporary files are removed at start-up"
    restarted.close()


def test_a_compressed_pool_survives_a_restart_and_is_kept_apart(tiny_model_dir, storage_dir):
    """--kv-cache-dtype fp8_e4m3: the storage tier's files hold the compressed pages (values and scales), a
    restart serves them with the same greedy output, and a float pool on the same directory never reads them."""
    tokens = prompt(5)
    a = make_engine(tiny_model_dir, kv_cache_dtype="fp8_e4m3")
    output = serve(a, tokens)[0]
    shape = a.runner.pool_shape
    assert a.cache.policy.storage.storage.page_bytes * 2 == shape.bytes_per_token * shape.page_size
    assert shape.bytes_per_token == 2 * shape.num_layers * shape.num_kv_heads * (shape.head_dim + 4)
    a.close()
    b = make_engine(tiny_model_dir, kv_cache_dtype="fp8_e4m3")
    output_b, cached_b = serve(b, tokens)
    assert cached_b >= aligned(tokens) and output_b == output
    b.close()
    c = make_engine(tiny_model_dir)  # a float pool: another fingerprint
    assert serve(c, tokens)[1] == 0
    c.close()
