"""Same tokens, different step shapes: are the logits bit-identical? (int8 and float32)"""
import sys, numpy as np, jax
from jaxserve.engine.engine import Engine
from jaxserve.engine.model_runner import BatchEntry

quant = sys.argv[1] if len(sys.argv) > 1 and sys.argv[1] != "f32" else None
eng = Engine(max_total_tokens=2048, chunked_prefill_size=64, context_length=512, disable_precompile=True,
             max_running_requests=8, quantization=quant)
r = eng.runner
ps = r.page_size
rng = np.random.default_rng(0)
toks = list(map(int, rng.integers(3, 40000, size=60)))
P, K = 50, 5
def pages(base, n): return list(range(base, base + (n + ps - 1) // ps))
def logits(entries): return np.asarray(r.forward(entries))
# A: decode one at a time after a prefill of P
tA = pages(1, 64)
logits([BatchEntry(toks[:P], 0, tA)])
dec = []
for i in range(K):
    dec.append(logits([BatchEntry([toks[P + i]], P + i, tA)])[0])
# B: verify K tokens in one extend
tB = pages(10, 64)
logits([BatchEntry(toks[:P], 0, tB)])
ver = logits([BatchEntry(toks[P:P + K], P, tB, num_logits=K)])[:K]
# C: batched decode (with another sequence) 
tC = pages(20, 64); tD = pages(30, 64)
logits([BatchEntry(toks[:P], 0, tC)]); logits([BatchEntry(toks[5:P + 5], 0, tD)])
bat = []
for i in range(K):
    bat.append(logits([BatchEntry([toks[P + i]], P + i, tC), BatchEntry([toks[P + 5 + i]], P + i, tD)])[0])
for i in range(K):
    print(i, "verify-decode", np.abs(ver[i] - dec[i]).max(), "batch2-decode", np.abs(bat[i] - dec[i]).max(),
          "argmax", dec[i].argmax(), ver[i].argmax(), bat[i].argmax())
# D: one extend of the whole P + K tokens (a prefill), logits of the last K
tE = pages(40, 64)
pre = logits([BatchEntry(toks[:P + K], 0, tE, num_logits=K)])[:K]
# E: a long prefill (chunk 64 tokens starting at 0) then the rest
tF = pages(50, 128)
toks2 = toks + list(map(int, rng.integers(3, 40000, size=80)))
logits([BatchEntry(toks[:P], 0, tF)])
for i in range(K):
    print(i, "prefill-decode", np.abs(pre[i] - dec[i]).max())
