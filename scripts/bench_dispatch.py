"""Host-to-device cost of one step's batch: `jax.device_put` of the `ForwardBatch` (12 small int32 arrays)
before the compiled call, against handing its numpy arrays to the compiled call (what the model runner
does: the host loop's embed program returns them on the device for the step's other programs).

Both run the host loop's compiled embed program of the default model's decode buckets, in the same
process, interleaved; each number is the median of --repeats calls, dispatch to result ready.

    python scripts/bench_dispatch.py [--repeats 300] [--batch-sizes 1 8 64]
"""

from __future__ import annotations

import argparse
import dataclasses

import jax

from jaxserve.runner.model_runner import BatchEntry
from jaxserve.model.loader import load_model
from bench_model import jax_runner, timed_alternating  # scripts/ is on sys.path when this runs as a script


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=300)
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8, 64])
    args = ap.parse_args()
    config, params = load_model("default", "float32")
    runner = jax_runner(config, params, max(args.batch_sizes), 512, "host")
    outer = dataclasses.replace(runner.params, layers=())
    print(f"\njax {jax.__version__} on {jax.default_backend()}; us per step, median of {args.repeats}\n")
    print("| decode batch | device_put + call (us) | numpy into the call (us) | speed-up |")
    print("|---|---|---|---|")
    for b in args.batch_sizes:
        batch, _ = runner.build_forward_batch([BatchEntry([5], 100, list(range(1, 9))) for _ in range(b)])
        embed = runner._lower_step(batch, False, ["embed"])["embed"].compile()
        times = timed_alternating({
            "put": lambda: jax.block_until_ready(embed(outer, jax.device_put(batch))),
            "numpy": lambda: jax.block_until_ready(embed(outer, batch)),
        }, args.repeats)
        put, direct = times["put"] * 1e6, times["numpy"] * 1e6
        print(f"| {b} | {put:.0f} | {direct:.0f} | {put / direct:.2f}x |")


if __name__ == "__main__":
    main()
