"""Issue 20, sixteenth pass: one float32 W @ x at T columns, XLA:CPU with YNNPACK (the default) and without
(compiler option xla_cpu_experimental_ynn_fusion_type=""), median us of 40 calls."""
import time, numpy as np, jax, jax.numpy as jnp
rng = np.random.default_rng(0)
def bench(f, *a):
    f(*a).block_until_ready(); ts = []
    for _ in range(40):
        t0 = time.perf_counter(); f(*a).block_until_ready(); ts.append(time.perf_counter() - t0)
    return round(float(np.median(ts)) * 1e6)
for (O, I) in [(49152, 576), (3072, 576), (576, 1536)]:
    w = jnp.asarray(rng.standard_normal((O, I)).astype(np.float32))
    fn = lambda w, x: w @ x
    ref = None
    for T in [1, 2, 4, 8, 16, 32]:
        x = jnp.asarray(rng.standard_normal((I, T)).astype(np.float32))
        a = jax.jit(fn).lower(w, x).compile()
        b = jax.jit(fn).lower(w, x).compile(compiler_options={"xla_cpu_experimental_ynn_fusion_type": ""})
        print(O, I, T, "ynn", bench(a, w, x), "no-ynn", bench(b, w, x), flush=True)
