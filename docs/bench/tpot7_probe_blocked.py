import sys, time, numpy as np, jax, jax.numpy as jnp
L = 30
SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]
rng = np.random.default_rng(0)
B = int(sys.argv[1])
def mk():
    out = []
    for _ in range(L):
        row = []
        for o, i in SHAPES:
            q = rng.integers(-127, 128, (i // B, o, B), dtype=np.int8)  # [nb, O, B]
            row.append((jnp.asarray(q), jnp.asarray(rng.random(o, dtype=np.float32))))
        out.append(row)
    return out
def blockmm(q, s, x):
    nb, o, b = q.shape; T = x.shape[1]
    xb = x.reshape(nb, b, T)
    xs = jnp.max(jnp.abs(xb), axis=1) / 127 + 1e-12  # [nb, T]
    xq = jnp.round(xb / xs[:, None, :]).astype(jnp.int8)
    if T == 1: xq = jnp.concatenate([xq, xq], 2)
    acc = jax.lax.dot_general(q, xq, (((2,), (1,)), ((0,), (0,))), preferred_element_type=jnp.int32)[:, :, :T]  # [nb, O, T]
    return jnp.einsum("bot,bt->ot", acc.astype(jnp.float32), xs) * s[:, None]
def f(ws, x):
    acc = jnp.zeros((), jnp.float32)
    for row in ws:
        for q, s in row:
            inn = q.shape[0] * q.shape[2]
            inp = x if x.shape[0] == inn else jnp.tile(x, (inn // x.shape[0] + 1, 1))[:inn]
            acc = acc + blockmm(q, s, inp)[0, 0]
        x = x + acc * 1e-6
    return acc
ws = mk()
for T in [1, 2, 16]:
    x = jnp.asarray(rng.standard_normal((576, T), dtype=np.float32))
    c = jax.jit(f).lower(ws, x).compile()
    c(ws, x).block_until_ready(); ts = []
    for _ in range(10):
        t = time.perf_counter(); c(ws, x).block_until_ready(); ts.append(time.perf_counter() - t)
    print(f"block {B} T={T}: {min(ts)*1e3:.1f} ms  ynn={c.as_text().count('__ynn')}", flush=True)
