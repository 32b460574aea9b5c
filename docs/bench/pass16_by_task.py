"""Issue 20, sixteenth pass: per-task mean TPOT, output tok/s and accept length of a bench_vs_llama_server.py
--interleaved jsonl (copy-heavy rounds >= 0; prompt i is task i mod 3, as bench_datasets.py makes them).

    python docs/bench/pass16_by_task.py docs/bench/tpot16_vs_llama_int8.jsonl docs/bench/tpot16_vs_llama_int8_2.jsonl
"""
import json, sys, statistics as st
from collections import defaultdict
for path in sys.argv[1:]:
    rows = [json.loads(l) for l in open(path)]
    agg = defaultdict(lambda: defaultdict(list)); acc = defaultdict(list); tps = defaultdict(list)
    for r in rows:
        if r["round"] < 0 or not r["workload"].startswith("copy-heavy"): continue
        for i, t in enumerate(r["tpots_ms"]):
            agg[r["variant"]][("rewrite", "code-edit", "extract")[i % 3]].append(t)
            agg[r["variant"]]["all"].append(t)
        tps[r["variant"]].append(r["output_throughput"])
        if r["spec_accept_length"]: acc[r["variant"]].append(r["spec_accept_length"])
    print(path)
    for v, d in agg.items():
        print(f"  {v}: n={len(d['all'])} mean {st.mean(d['all']):.2f} median {st.median(d['all']):.2f} | "
              + " / ".join(f"{k} {st.mean(d[k]):.2f}" for k in ("rewrite", "code-edit", "extract"))
              + f" | tok/s, mean of rounds {st.mean(tps[v]):.1f} | accept {st.mean(acc[v]) if acc[v] else '-'}")
