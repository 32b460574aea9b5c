"""30 layers of the default model's projections, feature-major W[out,in] @ x[in,T]."""
import sys, time, json, numpy as np, jax, jax.numpy as jnp
L = 30
SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]
rng = np.random.default_rng(0)
MATS = [[rng.standard_normal(s, dtype=np.float32) * 0.02 for s in SHAPES] for _ in range(L)]

def weights(kind, layout):
    out = []
    for l in MATS:
        row = []
        for m in l:
            if kind == "int8":
                sc = np.abs(m).max(1, keepdims=True) / 127
                q = np.round(m / sc).astype(np.int8)
                w = (q, sc.astype(np.float32))
            else:
                w = (m.astype(np.float32) if kind == "f32" else np.asarray(m, dtype=jnp.bfloat16),)
            if layout == "io":
                w = tuple(a.T.copy() for a in w)
            row.append(tuple(jnp.asarray(a) for a in w))
        out.append(row)
    return out

def layer_dots(ws, x, kind, layout, pad):
    # x: [576, T] f32 feature-major
    acc = jnp.zeros((), jnp.float32)
    for row in ws:
        h = x
        for w in row:
            wm = w[0]
            inn = wm.shape[1] if layout == "oi" else wm.shape[0]
            inp = h if h.shape[0] == inn else jnp.tile(h, (inn // h.shape[0] + 1, 1))[:inn]
            T = inp.shape[1]
            if pad and T == 1:
                inp = jnp.concatenate([inp, jnp.zeros_like(inp)], 1)
            if kind == "f32":
                a = inp
                y = wm @ a if layout == "oi" else (a.T @ wm).T
            elif kind == "bf16":
                a = inp.astype(jnp.bfloat16)
                y = (jnp.dot(wm, a, preferred_element_type=jnp.float32) if layout == "oi"
                     else jnp.dot(a.T, wm, preferred_element_type=jnp.float32).T)
            elif kind == "bf16w_f32x":
                y = jnp.dot(wm, inp, preferred_element_type=jnp.float32) if layout == "oi" else jnp.dot(inp.T, wm, preferred_element_type=jnp.float32).T
            elif kind == "int8":
                s = jnp.max(jnp.abs(inp), axis=0, keepdims=True) / 127 + 1e-12
                q = jnp.round(inp / s).astype(jnp.int8)
                if layout == "oi":
                    yi = jnp.dot(wm, q, preferred_element_type=jnp.int32)
                    y = yi.astype(jnp.float32) * w[1] * s
                else:
                    yi = jnp.dot(q.T, wm, preferred_element_type=jnp.int32).T
                    y = yi.astype(jnp.float32) * w[1].T * s
            if pad and T == 1:
                y = y[:, :1]
            acc = acc + y[0, 0]
        x = x + acc * 1e-6
    return acc

def run(kind, layout, T, opts, pad, reps):
    ws = weights(kind if kind != "bf16w_f32x" else "bf16", layout)
    x = jnp.asarray(rng.standard_normal((576, T), dtype=np.float32))
    f = jax.jit(layer_dots, static_argnums=(2, 3, 4))
    try:
        c = f.lower(ws, x, kind, layout, pad).compile(compiler_options=opts)
    except Exception as e:
        return None, str(e)[:150]
    c(ws, x).block_until_ready()
    ts = []
    for _ in range(reps):
        t = time.perf_counter(); c(ws, x).block_until_ready(); ts.append(time.perf_counter() - t)
    hlo = c.as_text()
    return min(ts) * 1e3, f"ynn={hlo.count('__ynn')} xnn={hlo.count('__xnn')} onednn={hlo.count('onednn')}"

if __name__ == "__main__":
    cfgs = json.loads(sys.argv[1])
    reps = int(sys.argv[2]) if len(sys.argv) > 2 else 10
    for c in cfgs:
        ms, info = run(c["kind"], c.get("layout", "oi"), c["T"], c.get("opts", {}), c.get("pad", False), reps)
        print(json.dumps({**c, "ms": None if ms is None else round(ms, 2), "info": info}), flush=True)
