"""Log-likelihood of a fixed text under `--quantization` variants: what keeping weights compressed costs.

Each variant gets its own engine on `--model-path` (radix cache off, the whole text in one prefill) and the
text's prompt logprobs (`logprob_start_len` 0, SGLang's `input_token_logprobs`); prints the mean negative
log-likelihood in nats per token and each variant's difference from the first one (float weights).

    python -m benchmarks.quant.eval_loglik --variants none gguf
    python -m benchmarks.quant.eval_loglik --model-path gemma-3-270m-q4_k_m.gguf --variants none gguf
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


def mean_nll(model_path: str, quantization: str | None, text: str) -> tuple[float, int]:
    """(mean NLL in nats per predicted token, number of tokens predicted) of `text`'s tokens after its first."""
    engine = Engine(model_path=model_path, quantization=quantization, disable_radix_cache=True,
                    disable_precompile=True, max_total_tokens=4096, chunked_prefill_size=2048)
    try:
        engine.add_request(text, {"max_new_tokens": 1, "temperature": 0}, return_logprob=True, logprob_start_len=0)
        meta = None
        while engine.has_unfinished():
            for out in engine.step():
                meta = out.meta
        logprobs = [lp for lp, _ in meta.input_token_logprobs if lp is not None]
        return -float(np.mean(logprobs)), len(logprobs)
    finally:
        engine.close()


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-path", default="default")
    parser.add_argument("--variants", nargs="+", default=["none", "gguf"], help="--quantization values; none: float")
    args = parser.parse_args(argv)
    results = {}
    for variant in args.variants:
        results[variant], count = mean_nll(args.model_path, None if variant == "none" else variant, TEXT)
        first = results[args.variants[0]]
        print(f"{variant}: {results[variant]:.4f} nats/token over {count} tokens ({results[variant] - first:+.4f})", flush=True)


if __name__ == "__main__":
    main()
