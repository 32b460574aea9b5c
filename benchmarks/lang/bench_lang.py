"""Frontend-language benchmark: the fork-and-join tips program (examples/tips_fork_join.py) at several
widths, with the radix cache on and off (`disable_radix_cache=True`), two in-process engines with
otherwise identical arguments, in the same run.

Each cell runs the program once untimed (compiling its shape buckets), then `--repeats` timed runs,
each on an emptied prefix cache, so the cache only shares what one program run shares: the prompt of
its fork branches (and the prompt of the summary). Greedy decoding; wall time is the median.

    python -m benchmarks.lang.bench_lang
    python -m benchmarks.lang.bench_lang --widths 1 4 16 --max-tokens 16 --repeats 3
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import logging
import statistics
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def load_tips_example():
    spec = importlib.util.spec_from_file_location("tips_fork_join", REPO / "examples" / "tips_fork_join.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@dataclasses.dataclass
class Cell:
    wall_s: float
    prompt_tokens: int  # tokens of every prompt the engine received (fork commit included)
    cached_tokens: int  # of those, taken from the prefix cache


def run_cell(tips, backend, width: int, max_tokens: int, repeats: int) -> Cell:
    loop = backend.loop
    walls, stats = [], []
    for i in range(repeats + 1):
        loop.flush_cache().result()
        before = loop.call(lambda e: dataclasses.replace(e.stats)).result()
        start = time.perf_counter()
        tips.run(width=width, max_tokens=max_tokens, temperature=0, backend=backend).text()
        wall = time.perf_counter() - start
        after = loop.call(lambda e: dataclasses.replace(e.stats)).result()
        if i > 0:  # the first run compiles
            walls.append(wall)
            stats.append((after.prompt_tokens - before.prompt_tokens, after.cached_tokens - before.cached_tokens))
    return Cell(statistics.median(walls), *stats[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model-path", default="default")
    parser.add_argument("--widths", type=int, nargs="+", default=[1, 4, 16])
    parser.add_argument("--max-tokens", type=int, default=16, help="tokens per tip and for the summary")
    parser.add_argument("--repeats", type=int, default=1, help="timed runs per cell (median reported)")
    parser.add_argument("--max-total-tokens", type=int, default=32768)
    parser.add_argument("--context-length", type=int, default=2048)
    parser.add_argument("--max-running-requests", type=int, default=32)
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)

    from jaxserve.engine.engine import Engine
    from jaxserve.lang.engine_backend import EngineBackend

    tips = load_tips_example().tips
    common = dict(
        model_path=args.model_path, max_total_tokens=args.max_total_tokens, context_length=args.context_length,
        max_running_requests=args.max_running_requests, disable_precompile=True,
    )
    backends = {
        "on": EngineBackend(Engine(**common)),
        "off": EngineBackend(Engine(**common, disable_radix_cache=True)),
    }
    results: dict[tuple[int, str], Cell] = {}
    for width in args.widths:
        for name, backend in backends.items():
            results[width, name] = cell = run_cell(tips, backend, width, args.max_tokens, args.repeats)
            print(f"width {width:>2} radix {name:>3}: {cell.wall_s:6.2f} s, {cell.prompt_tokens} prompt tokens, "
                  f"{cell.cached_tokens} cached", flush=True)
    for backend in backends.values():
        backend.shutdown()

    print()
    print(f"tips fork-and-join, {args.model_path} model, max_tokens {args.max_tokens}, greedy, median of {args.repeats}")
    print()
    print("| width | radix on (s) | radix off (s) | speed-up | prompt tokens | cached tokens (on) | prefill tokens on / off |")
    print("|---:|---:|---:|---:|---:|---:|---:|")
    for width in args.widths:
        on, off = results[width, "on"], results[width, "off"]
        print(
            f"| {width} | {on.wall_s:.2f} | {off.wall_s:.2f} | {off.wall_s / on.wall_s:.2f}x | {off.prompt_tokens} "
            f"| {on.cached_tokens} | {on.prompt_tokens - on.cached_tokens} / {off.prompt_tokens - off.cached_tokens} |"
        )


if __name__ == "__main__":
    main()
