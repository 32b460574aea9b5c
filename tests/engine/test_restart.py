"""A restart reuses the persistent compilation cache: the second start of an engine compiles nothing.

Each start is a fresh Python process (the cache is on disk); the first one also converts the weights,
the second restores them from the converted-weights cache, and both must key their executables alike.
"""

from __future__ import annotations

import json
import subprocess
import sys

CHILD = """
import json, logging, sys
misses = []

class Misses(logging.Handler):
    def emit(self, record):
        if "PERSISTENT COMPILATION CACHE MISS" in record.getMessage():
            misses.append(record.getMessage()[:120])

log = logging.getLogger("jax._src.compiler")
log.setLevel(logging.DEBUG)
log.addHandler(Misses())
from jaxserve.engine.engine import Engine

engine = Engine(model_path=sys.argv[1], compilation_cache_dir=sys.argv[2], weights_cache=True, weights_cache_dir=sys.argv[3],
                disable_precompile=False, max_running_requests=2, chunked_prefill_size=32, context_length=64,
                max_total_tokens=256, page_size=16)
out = engine.generate([5, 6, 7], {"max_new_tokens": 3, "temperature": 0})
print(json.dumps({"misses": misses, "output_ids": out["output_ids"],
                  "compiles_after_warmup": engine.runner.num_compiles_after_warmup}))
"""


def start(model_dir: str, tmp_path) -> dict:
    proc = subprocess.run(
        [sys.executable, "-c", CHILD, model_dir, str(tmp_path / "xla"), str(tmp_path / "weights")],
        capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_second_start_compiles_nothing(tiny_model_dir, tmp_path):
    first = start(tiny_model_dir, tmp_path)
    assert first["misses"], "the first start compiles (and fills the cache)"
    second = start(tiny_model_dir, tmp_path)
    assert second["misses"] == []
    assert second["output_ids"] == first["output_ids"]
    assert second["compiles_after_warmup"] == 0
