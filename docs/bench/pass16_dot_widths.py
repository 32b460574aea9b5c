"""Issue 20, sixteenth pass: for which widths T does column 0 of a float32 W @ x [1536, 576] x [576, T] (XLA:CPU,
YNNPACK) differ from its bits at T = 2? Prints the widths that differ."""
import numpy as np, jax, jax.numpy as jnp
rng = np.random.default_rng(0)
O, I = 1536, 576
w = jnp.asarray(rng.standard_normal((O, I)).astype(np.float32))
x0 = rng.standard_normal((I, 1)).astype(np.float32)
f = jax.jit(lambda w, x: w @ x)
ref = np.asarray(f(w, jnp.asarray(np.concatenate([x0, x0], 1))))[:, 0]
bad = []
for T in list(range(1, 140)) + [160, 191, 200, 255, 257, 320, 384, 400, 511, 513, 640, 768, 1000, 1024, 1025, 2048]:
    x = np.concatenate([x0, rng.standard_normal((I, T - 1)).astype(np.float32)], axis=1)
    y = np.asarray(f(w, jnp.asarray(x)))
    d = np.abs(y[:, 0] - ref).max()
    if d: bad.append(T)
print("differ:", bad)
