import numpy as np, jax, jax.numpy as jnp, time
rng = np.random.default_rng(0)
E = 576
x = rng.standard_normal((E, 512)).astype(np.float32) * 3
w = rng.standard_normal(E).astype(np.float32)
def tree_sum0(y):
    # pairwise sum over axis 0 in a fixed order: elementwise adds only
    while y.shape[0] > 1:
        n = y.shape[0]; h = n // 2
        s = y[:h] + y[h:2 * h]
        y = jnp.concatenate([s, y[2 * h:]], 0) if n % 2 else s
    return y[0]
def norm_tree(x):
    x32 = x.astype(jnp.float32)
    ms = tree_sum0(x32 * x32) * (1.0 / x.shape[0])
    return w[:, None] * (x32 * jax.lax.rsqrt(ms + 1e-5)[None, :])
def norm_ref(x):
    x32 = x.astype(jnp.float32)
    x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=0, keepdims=True) + 1e-5)
    return w[:, None] * x32
for name, f in (("ref", norm_ref), ("tree", norm_tree)):
    f = jax.jit(f)
    full = np.asarray(f(x))
    print(name, [float(np.abs(np.asarray(f(x[:, :T])) - full[:, :T]).max()) for T in (1, 2, 3, 4, 8, 16, 64, 256)])
    for T in (1, 8, 512):
        xx = jnp.asarray(x[:, :T]); f(xx).block_until_ready()
        t = time.perf_counter()
        for _ in range(200): r = f(xx)
        r.block_until_ready()
        print("  T", T, "us", (time.perf_counter() - t) / 200 * 1e6)
