"""Structured generation cost: output tokens/s with a JSON schema vs unconstrained, on the same prompts.

N chat prompts ("Describe <someone> as JSON.") run twice in one process and one engine: once
constrained by a person JSON schema, once unconstrained. The engine is the in-process `Engine` (no
HTTP), so the numbers are the engine's own: grammar mask computation on the host, the bitmask applied in
the jitted sampler, and jump-forward (tokens the grammar forces are appended without sampling and run
as one extend in the next step). The engine precompiles its shape buckets at start-up, as the server
does; the few compiles left (sampler variants with a bitmask) are counted and their seconds are taken
out of the wall time.

Fairness: an unconstrained request stops where the model emits EOS, a constrained one where its JSON
closes, so their lengths and the batch size over time would differ. The unconstrained pass therefore
uses `ignore_eos` with each request's `max_new_tokens` set to the number of tokens its constrained twin
produced: both passes emit exactly the same number of tokens per request, and the ratio measures what
the grammar costs (mask work) and saves (jump-forward steps) per output token. The prefix cache is
flushed before every pass, so both pay the same prefill. Greedy by default: both passes are then
deterministic and repeatable.

    python -m benchmarks.structured.bench_structured --num-prompts 32 --max-new-tokens 64
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time

import jax

from jaxserve.engine.engine import Engine

PERSON_SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "occupation": {"type": "string", "maxLength": 24},
        "city": {"type": "string", "maxLength": 20},
        "hobbies": {"type": "array", "items": {"type": "string", "maxLength": 16}, "maxItems": 2},
    },
    "required": ["name", "age", "occupation", "city", "hobbies"],
    "additionalProperties": False,
}

PEOPLE = (
    "a baker from Lyon", "a retired astronaut", "a jazz drummer", "a marine biologist", "a chess champion",
    "a high-school teacher", "a lighthouse keeper", "a software engineer", "a beekeeper", "a taxi driver",
    "a famous painter", "a mountain guide", "a nurse in Tokyo", "a medieval knight", "a street musician",
    "a librarian", "a farmer from Kansas", "a fashion designer", "a firefighter", "a professional surfer",
    "a museum curator", "a train conductor", "a young inventor", "a wildlife photographer", "a sushi chef",
    "a village doctor", "a pop singer", "a deep-sea diver", "a clockmaker", "a football coach",
    "a park ranger", "a detective",
)


@dataclasses.dataclass
class PassResult:
    """One timed pass: seconds (compiles excluded), output tokens, tokens forced by jump-forward, steps."""

    wall_s: float
    compile_s: float
    num_output_tokens: int
    num_forced_tokens: int
    num_steps: int
    num_compiles: int
    outputs: list[dict]

    @property
    def tokens_per_s(self) -> float:
        return self.num_output_tokens / self.wall_s


def run_pass(engine: Engine, prompts: list[str], params: list[dict]) -> PassResult:
    engine.flush_cache()
    steps0 = engine.stats.num_steps
    runner = engine.runner
    compiles0, compile_s0 = runner.num_compiles_after_warmup, runner.compile_seconds
    t0 = time.perf_counter()
    outputs = engine.generate(prompts, params)
    wall = time.perf_counter() - t0
    compile_s = runner.compile_seconds - compile_s0
    metas = [o["meta_info"] for o in outputs]
    return PassResult(
        wall_s=wall - compile_s,
        compile_s=compile_s,
        num_output_tokens=sum(m["completion_tokens"] for m in metas),
        num_forced_tokens=sum(m["num_forced_tokens"] for m in metas),
        num_steps=engine.stats.num_steps - steps0,
        num_compiles=runner.num_compiles_after_warmup - compiles0,
        outputs=outputs,
    )


def count_valid(outputs: list[dict], schema: dict) -> int | None:
    try:
        import jsonschema
    except ImportError:
        return None
    num_valid = 0
    for out in outputs:
        try:
            jsonschema.validate(json.loads(out["text"]), schema)
            num_valid += 1
        except (ValueError, jsonschema.ValidationError):
            pass
    return num_valid


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model-path", default="default")
    ap.add_argument("--num-prompts", type=int, default=32)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--temperature", type=float, default=0.0, help="0 = greedy; otherwise request i uses seed i")
    ap.add_argument("--warmup", type=int, default=0, help="untimed passes of both kinds before the timed ones")
    ap.add_argument("--max-running-requests", type=int, default=32)
    args = ap.parse_args()

    engine = Engine(
        model_path=args.model_path, max_total_tokens=16384, max_running_requests=args.max_running_requests,
        chunked_prefill_size=256, context_length=1024,
    )
    people = [PEOPLE[i % len(PEOPLE)] for i in range(args.num_prompts)]
    prompts = [
        engine.tokenizer.apply_chat_template(
            [{"role": "user", "content": f"Describe {who} as JSON."}], tokenize=False, add_generation_prompt=True
        )
        for who in people
    ]
    sampling = [
        {"temperature": args.temperature, "seed": i if args.temperature > 0 else None} for i in range(len(prompts))
    ]
    schema_text = json.dumps(PERSON_SCHEMA)
    constrained_params = [{**s, "json_schema": schema_text, "max_new_tokens": args.max_new_tokens} for s in sampling]

    for i in range(args.warmup + 1):
        constrained = run_pass(engine, prompts, constrained_params)
        lengths = [o["meta_info"]["completion_tokens"] for o in constrained.outputs]
        free_params = [{**s, "max_new_tokens": n, "ignore_eos": True} for s, n in zip(sampling, lengths)]
        free = run_pass(engine, prompts, free_params)
        kind = "warm-up" if i < args.warmup else "timed"
        print(f"{kind} passes: JSON schema {constrained.wall_s:.1f} s, unconstrained {free.wall_s:.1f} s", file=sys.stderr)

    num_valid = count_valid(constrained.outputs, PERSON_SCHEMA)
    num_cut = sum(o["meta_info"]["finish_reason"]["type"] == "length" for o in constrained.outputs)
    forced_share = constrained.num_forced_tokens / max(1, constrained.num_output_tokens)
    print(
        f"\njaxserve structured generation, {args.model_path} model, jax {jax.__version__} on "
        f"{jax.default_backend()} ({os.cpu_count()} CPUs); {len(prompts)} prompts, max_new_tokens "
        f"{args.max_new_tokens}, temperature {args.temperature}\n"
    )
    print("| pass | output tokens | forced by jump-forward | engine steps | time (s) | output tokens/s |")
    print("|---|---|---|---|---|---|")
    print(
        f"| unconstrained (ignore_eos, lengths matched) | {free.num_output_tokens} | - | {free.num_steps} "
        f"| {free.wall_s:.1f} | {free.tokens_per_s:.1f} |"
    )
    print(
        f"| JSON schema | {constrained.num_output_tokens} | {constrained.num_forced_tokens} "
        f"({forced_share:.0%}) | {constrained.num_steps} | {constrained.wall_s:.1f} | {constrained.tokens_per_s:.1f} |"
    )
    print(f"| ratio (JSON schema / unconstrained) | | | | | {constrained.tokens_per_s / free.tokens_per_s:.2f}x |")
    valid = "jsonschema not installed" if num_valid is None else f"{num_valid}/{len(prompts)}"
    print(
        f"\nconstrained outputs valid under the schema: {valid} ({num_cut} cut at max_new_tokens); "
        f"compiles in the timed passes (excluded from the times): {constrained.num_compiles} constrained "
        f"({constrained.compile_s:.1f} s), {free.num_compiles} unconstrained ({free.compile_s:.1f} s)"
    )


if __name__ == "__main__":
    main()
