"""Greedy outputs of a batch mixing LoRA adapters and the base model at several tp sizes, in one process
with forced host devices; prints `RESULT <json>`:

    JAX_NUM_CPU_DEVICES=3 python -m tests.parallel.lora_tp_worker MODEL_DIR NAME=ADAPTER... --tp 1 3

Per tp size: the outputs (one list of ids per (prompt, adapter) pair, in order) and the PartitionSpec of
each LoRA slot array of layer 0.
"""

from __future__ import annotations

import argparse
import json

PROMPTS = [[5, 17, 301, 42, 9, 77, 1003, 12], [88, 7, 1200, 3, 3, 14, 60, 5, 9, 11, 300, 301]]
NEW = 8


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("model_dir")
    parser.add_argument("adapters", nargs="+")
    parser.add_argument("--tp", type=int, nargs="+", default=[1])
    args = parser.parse_args()
    from jaxserve.engine.engine import Engine

    names = [None] + [a.split("=", 1)[0] for a in args.adapters]
    results = []
    for tp in args.tp:
        engine = Engine(model_path=args.model_dir, tp_size=tp, max_total_tokens=1024, max_running_requests=8,
                        chunked_prefill_size=64, context_length=128, page_size=4, disable_precompile=True,
                        prefill_decode_itl_ratio=0, lora_paths=tuple(args.adapters), max_lora_rank=8)
        pairs = [(p, n) for p in PROMPTS for n in names]
        outs = engine.generate([p for p, _ in pairs], {"max_new_tokens": NEW, "temperature": 0},
                               lora_path=[n for _, n in pairs])
        lora = engine.runner.params["layers"][0]["lora"]
        results.append({"tp": tp, "outputs": [o["output_ids"] for o in outs],
                        "specs": {k: str(getattr(v.sharding, "spec", None)) for k, v in lora.items()}})
    print("RESULT " + json.dumps(results))


if __name__ == "__main__":
    main()
