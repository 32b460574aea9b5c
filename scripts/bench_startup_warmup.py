"""Start-up seconds and RSS of an Engine on the default model with the sampler warm-up list of this
tree against greedy + temperature only (the list before the filters were warmed), each in a fresh
subprocess, in one invocation:

    python scripts/bench_startup_warmup.py [--max-total-tokens 8192]
"""

from __future__ import annotations

import argparse
import subprocess
import sys

CHILD = r"""
import json, resource, sys, time
import jaxserve.engine.engine as engine_mod
from jaxserve.runner import sampler as sampler_lib
from jaxserve.engine.request import SamplingParams
if sys.argv[1] == "baseline":
    def old(buckets, vocab):
        return [sampler_lib.build_sampling_batch([SamplingParams(temperature=t)], [0], [0], None, None, s, vocab)
                for s in sorted(set(buckets)) for t in (0.0, 1.0)]
    engine_mod.sampler_warmup_variants = old
t0 = time.perf_counter()
eng = engine_mod.Engine(model_path="default", max_total_tokens=int(sys.argv[2]))
dt = time.perf_counter() - t0
rss = int(open("/proc/self/statm").read().split()[1]) * resource.getpagesize() / 1e9
print(json.dumps({"mode": sys.argv[1], "engine_init_s": round(dt, 1), "compile_s": round(eng.runner.compile_seconds, 1),
                  "num_sampler_programs": len(eng.runner._sample_exec), "rss_gb": round(rss, 3)}))
"""


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--max-total-tokens", default="8192")
    args = ap.parse_args()
    for mode in ("baseline", "this tree"):
        out = subprocess.run([sys.executable, "-c", CHILD, mode, args.max_total_tokens], capture_output=True, text=True)
        print(out.stdout.strip().splitlines()[-1] if out.returncode == 0 else out.stderr[-2000:], flush=True)


if __name__ == "__main__":
    main()
