"""Issue 20, sixteenth pass: served greedy identity, 19 prompts x 48 tokens through /generate, with NGRAM off and
on, sent one by one and 8 at a time; argv[1]: w8a8_int8 (default) or f32. Run from the repository root:

    python docs/bench/pass16_served_identity.py [w8a8_int8|f32]
"""
import sys, concurrent.futures as cf
from pathlib import Path
import numpy as np, httpx
sys.path.insert(0, "scripts")  # run from the repository root
import bench_decode_latency as bdl
from bench_datasets import _copy_heavy_prompt, COPY_HEAVY_TASKS
quant = sys.argv[1:] and sys.argv[1] or "w8a8_int8"
rng = np.random.default_rng(5)
prompts = [_copy_heavy_prompt(COPY_HEAVY_TASKS[i % 3], rng, 4) for i in range(12)]
prompts += ["Write a haiku about autumn.", "List three prime numbers and explain why.", "Once upon a time",
            "def fib(n):", "The capital of France is", "Translate to French: good morning, my friend.",
            "Summarize: The cat sat on the mat. The dog barked at the cat. The cat ran away."]
base = ["--max-total-tokens", "8192", "--context-length", "2048"] + (["--quantization", quant] if quant != "f32" else [])
variants = {"plain": base, "ngram": base + ["--speculative-algorithm", "NGRAM"]}
def gen(port, p):
    r = httpx.post(f"http://127.0.0.1:{port}/generate", json={"text": p, "sampling_params": {"temperature": 0, "max_new_tokens": 48}}, timeout=600, trust_env=False)
    r.raise_for_status(); return r.json()["text"]
res = {}
for name, flags in variants.items():
    port = bdl.free_port()
    proc = bdl.start_server(flags, port, Path(f"/tmp/identity_{name}.log"))
    try:
        res[name, "seq"] = [gen(port, p) for p in prompts]
        with cf.ThreadPoolExecutor(8) as ex:
            res[name, "conc"] = list(ex.map(lambda p: gen(port, p), prompts))
    finally:
        proc.terminate(); proc.wait()
ref = res["plain", "seq"]
for k, v in res.items():
    diff = [i for i, (a, b) in enumerate(zip(ref, v)) if a != b]
    print(quant, k, f"{len(prompts) - len(diff)} of {len(prompts)} identical to plain sequential; differ at {diff}")
