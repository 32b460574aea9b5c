"""Throwaway (issue 20, sixteenth pass): a float32 decode step of the default model at batch B (each
sequence --context cached tokens) under jax.profiler; prints the step median and the time per trace
event kind (the name before its number), per step, for each B side by side (why a batch-2 step costs ~1.6x a batch-1 step).

    python docs/bench/pass16_step_profile.py [--batch-sizes 1 2] [--context 512]
"""
import argparse, collections, glob, gzip, json, os, sys, time
sys.path.insert(0, "scripts")  # run from the repository root
import numpy as np, jax
import bench_verify
from jaxserve.engine.model_runner import BatchEntry
from jaxserve.model.loader import load_model
from jaxserve.pallas.reference import ragged_paged_attention_xla

ap = argparse.ArgumentParser()
ap.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 2])
ap.add_argument("--context", type=int, default=512)
args = ap.parse_args()
config, params = load_model("default", "float32")
n, ps = args.context, 16
pps = n // ps + 2
prompt = [int(x) for x in np.random.default_rng(0).integers(3, config.vocab_size, size=n)]
r = bench_verify.runner_with(config, params, ragged_paged_attention_xla, max(args.batch_sizes), n + 2 * ps)
pages = [list(range(1 + i * pps, 1 + (i + 1) * pps)) for i in range(max(args.batch_sizes))]
for p in pages:
    r.forward([BatchEntry(prompt, 0, p)])
per_b, medians = {}, {}
for b in args.batch_sizes:
    e = [BatchEntry([prompt[-1]], n, pages[i]) for i in range(b)]
    for _ in range(5):
        r.forward(e).block_until_ready()
    ts = []
    for _ in range(20):
        t = time.perf_counter(); r.forward(e).block_until_ready(); ts.append(time.perf_counter() - t)
    medians[b] = np.median(ts) * 1e3
    d = f"/tmp/pass16_trace_{b}"; os.system(f"rm -rf {d}")
    jax.profiler.start_trace(d, create_perfetto_trace=True)
    for _ in range(10):
        r.forward(e).block_until_ready()
    jax.profiler.stop_trace()
    tr = json.load(gzip.open(glob.glob(d + "/**/*.trace.json.gz", recursive=True)[0]))
    agg = collections.defaultdict(lambda: [0, 0.0])
    for x in tr["traceEvents"]:
        if x.get("ph") == "X":
            kind = x["name"].split(".")[0]  # per op kind: the numbered names differ between executables
            agg[kind][0] += 1; agg[kind][1] += x["dur"]
    per_b[b] = agg
print("step median ms: " + ", ".join(f"batch {b} {m:.2f}" for b, m in medians.items()))
names = sorted(set().union(*per_b.values()), key=lambda k: -max(a[k][1] for a in per_b.values()))
print("| event | " + " | ".join(f"batch {b}: ms/step (calls/step)" for b in per_b) + " |")
print("|---" * (1 + len(per_b)) + "|")
for k in names[:40]:
    print(f"| {k[:70]} | " + " | ".join(f"{a[k][1] / 10 / 1e3:.3f} ({a[k][0] / 10:.0f})" for a in per_b.values()) + " |")
