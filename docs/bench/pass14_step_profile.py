"""Throwaway (issue 20, fourteenth pass): a batch-1 decode step of the default model (200 cached tokens) under
jax.profiler with a Perfetto trace; prints the step median, the heaviest trace events and time per op kind.

    python docs/bench/pass14_step_profile.py        # XLA_FLAGS=--xla_cpu_experimental_ynn_fusion_type= : YNNPACK off
"""
import sys, time, glob, gzip, json, os, collections
sys.path.insert(0, "scripts")  # run from the repository root
import numpy as np, jax
import bench_verify, bench_model
from jaxserve.engine.model_runner import BatchEntry
from jaxserve.model.loader import load_model
from jaxserve.pallas.reference import ragged_paged_attention_xla
config, params = load_model("default", "float32")
n = 200
prompt = [int(x) for x in np.random.default_rng(0).integers(3, config.vocab_size, size=n)]
pages = list(range(1, n // 16 + 3))
r = bench_verify.runner_with(config, params, ragged_paged_attention_xla, 64, n + 32)
r.forward([BatchEntry(prompt, 0, pages)])
e = [BatchEntry([prompt[-1]], n, pages)]
for _ in range(5): r.forward(e).block_until_ready()
ts=[]
for _ in range(20):
    t=time.perf_counter(); r.forward(e).block_until_ready(); ts.append(time.perf_counter()-t)
print("decode step median ms", np.median(ts)*1e3)
d="/tmp/pass14_trace"; os.system(f"rm -rf {d}")
jax.profiler.start_trace(d, create_perfetto_trace=True)
for _ in range(10): r.forward(e).block_until_ready()
jax.profiler.stop_trace()
f=glob.glob(d+"/**/*.trace.json.gz", recursive=True)[0]
tr=json.load(gzip.open(f))
ev=[x for x in tr["traceEvents"] if x.get("ph")=="X"]
agg=collections.defaultdict(lambda:[0,0.0])
tids=collections.Counter()
for x in ev:
    agg[x["name"]][0]+=1; agg[x["name"]][1]+=x["dur"]
    tids[(x.get("pid"),x.get("tid"))]+=1
tot=sum(v[1] for v in agg.values())
print("threads", tids.most_common(8))
for k,v in sorted(agg.items(), key=lambda kv:-kv[1][1])[:45]:
    print(f"{v[1]/10/1e3:8.3f} ms/step  {v[0]/10:6.1f}/step  {k[:110]}")
print("-----")
skip=("ThunkExecutor","$","PjitFunction","Common","Tfrt","Execute")
cat=collections.defaultdict(float); cnt=collections.Counter()
for k,v in agg.items():
    if k.startswith(skip) or "profiler" in k: continue
    c=k.rstrip("0123456789.").rstrip("_") 
    cat[c]+=v[1]/10/1e3; cnt[c]+=v[0]/10
for k,v in sorted(cat.items(), key=lambda kv:-kv[1]):
    print(f"{v:8.3f} ms/step {cnt[k]:6.1f}/step {k}")
