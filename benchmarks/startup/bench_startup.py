"""Start-up cost of loading a model (default: the default model): from its checkpoint vs from the
converted-weights cache.

Each variant runs in a fresh subprocess (so nothing is shared through memory) --repeats times; the
table gives the median wall time of `load_model` and of `load_tokenizer`, and their ratio.

    python -m benchmarks.startup.bench_startup [--repeats 3] [--model-path PATH]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile

CHILD = """
import json, sys, time
t0 = time.perf_counter()
from jaxserve.model.loader import load_model
from jaxserve.model.tokenizer import load_tokenizer
t1 = time.perf_counter()
load_model(sys.argv[3], "float32", weights_cache_dir=sys.argv[1], use_weights_cache=sys.argv[2] == "1")
t2 = time.perf_counter()
load_tokenizer(sys.argv[3])
t3 = time.perf_counter()
print(json.dumps({"import": t1 - t0, "weights": t2 - t1, "tokenizer": t3 - t2}))
"""


def run(cache_dir: str, use_cache: bool, model_path: str) -> dict:
    out = subprocess.run([sys.executable, "-c", CHILD, cache_dir, "1" if use_cache else "0", model_path],
                         capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--model-path", default="default", help="a GGUF file or an HF directory (default: the default model)")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as cache:
        run(cache, True, args.model_path)  # fills the cache
        cold = [run(cache, False, args.model_path) for _ in range(args.repeats)]
        warm = [run(cache, True, args.model_path) for _ in range(args.repeats)]
    med = lambda rs, k: statistics.median(r[k] for r in rs)  # noqa: E731
    print("| load | weights (s) | tokenizer (s) |")
    print("|---|---|---|")
    print(f"| the checkpoint, converted at each start (default) | {med(cold, 'weights'):.2f} | {med(cold, 'tokenizer'):.2f} |")
    print(f"| converted-weights cache (orbax, --weights-cache) | {med(warm, 'weights'):.2f} | {med(warm, 'tokenizer'):.2f} |")
    print(f"\nweights load speed-up from the cache: {med(cold, 'weights') / med(warm, 'weights'):.1f}x")


if __name__ == "__main__":
    main()
