"""Log-likelihood of a fixed text under `--quantization` and `--kv-cache-dtype` variants: what keeping weights or
the KV cache compressed costs.

Each variant (a weights format and a KV pool dtype) gets its own engine on `--model-path` (radix cache off, the whole text in one prefill) and the
text's prompt logprobs (`logprob_start_len` 0, SGLang's `input_token_logprobs`); prints the mean negative
log-likelihood in nats per token and each variant's difference from the first one (float weights, float KV).

    python -m benchmarks.quant.eval_loglik --variants none gguf
    python -m benchmarks.quant.eval_loglik --model-path gemma-3-270m-q4_k_m.gguf --variants none gguf
    python -m benchmarks.quant.eval_loglik --variants none --kv-cache-dtypes auto int8 fp8_e4m3 fp8_e5m2
"""

from __future__ import annotations

import argparse

import numpy as np

from jaxserve.engine.engine import Engine

TEXT = (
    "The history of the printing press begins in the fifteenth century, when Johannes Gutenberg combined movable "
    "metal type, oil-based inks and a screw press. Within decades, printing spread across Europe, lowering the cost "
    "of books and helping ideas travel quickly. Scholars argue about its effects on the Reformation, on science and "
    "on literacy, but few doubt that it changed how knowledge was shared.\n"
    "def merge_sort(xs):\n    if len(xs) <= 1:\n        return xs\n    mid = len(xs) // 2\n"
    "    return merge(merge_sort(xs[:mid]), merge_sort(xs[mid:]))\n"
)


def text_nll(engine: Engine, text: str) -> tuple[float, int]:
    """(mean NLL in nats per predicted token, number of tokens predicted) of `text`'s tokens after its first, from
    `engine`'s prompt logprobs (the whole text in one prefill when its chunk size allows)."""
    engine.add_request(text, {"max_new_tokens": 1, "temperature": 0}, return_logprob=True, logprob_start_len=0)
    meta = None
    while engine.has_unfinished():
        for out in engine.step():
            meta = out.meta
    logprobs = [lp for lp, _ in meta.input_token_logprobs if lp is not None]
    return -float(np.mean(logprobs)), len(logprobs)


def mean_nll(model_path: str, quantization: str | None, text: str, kv_cache_dtype: str = "auto") -> tuple[float, int]:
    """`text_nll` on a fresh engine for `model_path` with these weights and this KV pool."""
    engine = Engine(model_path=model_path, quantization=quantization, kv_cache_dtype=kv_cache_dtype, disable_radix_cache=True,
                    disable_precompile=True, max_total_tokens=4096, chunked_prefill_size=2048)
    try:
        return text_nll(engine, text)
    finally:
        engine.close()


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-path", default="default")
    parser.add_argument("--variants", nargs="+", default=["none", "gguf"], help="--quantization values; none: float")
    parser.add_argument("--kv-cache-dtypes", nargs="+", default=["auto"], help="--kv-cache-dtype values")
    parser.add_argument("--repeat", type=int, default=1, help="the text this many times (a longer context)")
    args = parser.parse_args(argv)
    results = {}
    for variant in args.variants:
        for kv in args.kv_cache_dtypes:
            name = variant if kv == "auto" else f"{variant} kv={kv}"
            results[name], count = mean_nll(args.model_path, None if variant == "none" else variant, TEXT * args.repeat, kv)
            first = next(iter(results.values()))
            print(f"{name}: {results[name]:.4f} nats/token over {count} tokens ({results[name] - first:+.4f})", flush=True)


if __name__ == "__main__":
    main()
