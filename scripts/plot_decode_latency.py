"""Plot decode-latency results: median TPOT per workload, one bar per variant (or server).

Reads the JSON lines that `bench_decode_latency.py --output-file` and `bench_vs_llama_server.py
--output-file` write and draws one bar chart per input file (the variant is a line's "variant", or its
"server"; in-process `Engine.generate` rows are left out). The rows of an `--interleaved` run (they have a
"round") are drawn per round instead (`plot_rounds`): median TPOT, output tok/s and P99 / median ITL of
every counted round, a line per variant, a row of panels per workload.

    python scripts/plot_decode_latency.py docs/bench/spec_adaptive.jsonl --output docs/img/spec_tpot.png
"""

from __future__ import annotations

import argparse
import json

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402 -- the backend must be chosen first
from matplotlib.ticker import MaxNLocator  # noqa: E402


def load(path: str) -> list[dict]:
    with open(path) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    return [r for r in rows if r.get("variant", r.get("server")) != "engine"]


def plot(rows: list[dict], output: str, title: str | None = None) -> None:
    """One group of bars per workload, one bar per variant: median TPOT (ms), labelled with its value."""
    label = lambda r: r.get("variant") or r["server"]  # noqa: E731
    workloads = list(dict.fromkeys(r["workload"] for r in rows))
    variants = list(dict.fromkeys(label(r) for r in rows))
    width = 0.8 / max(1, len(variants))
    fig, ax = plt.subplots(figsize=(1.8 + 1.7 * len(workloads), 3.8))
    for i, v in enumerate(variants):
        xs, ys = [], []
        for k, w in enumerate(workloads):
            match = [r for r in rows if label(r) == v and r["workload"] == w]
            if match:
                xs.append(k + i * width)
                ys.append(match[-1]["median_tpot_ms"])
        bars = ax.bar(xs, ys, width, label=v)
        ax.bar_label(bars, fmt="%.0f", fontsize=7)
    ax.set_xticks([k + width * (len(variants) - 1) / 2 for k in range(len(workloads))], workloads)
    ax.set_ylabel("median TPOT (ms, lower is better)")
    ax.set_xlabel("workload (dataset:concurrency:prompts)")
    if title:
        ax.set_title(title, fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(output, dpi=120)
    plt.close(fig)


PANELS = (("median_tpot_ms", "median TPOT (ms)"), ("output_throughput", "output tok/s"),
          ("itl_ratio", "P99 / median ITL"))


def plot_rounds(rows: list[dict], output: str, title: str | None = None) -> None:
    """The counted rounds (round >= 0) of an interleaved run: for each workload (a row of panels) and
    variant (a line), its median TPOT, output tok/s and P99 / median ITL in each round; a dashed line
    at issue 20's 3x bound on the ITL panel."""
    rows = [r for r in rows if r["round"] >= 0]
    workloads = list(dict.fromkeys(r["workload"] for r in rows))
    variants = list(dict.fromkeys(r["variant"] for r in rows))
    fig, axes = plt.subplots(len(workloads), len(PANELS), figsize=(3.6 * len(PANELS), 2.6 * len(workloads)),
                             squeeze=False)
    for i, w in enumerate(workloads):
        for j, (key, label) in enumerate(PANELS):
            ax = axes[i][j]
            for v in variants:
                mine = sorted((r for r in rows if r["workload"] == w and r["variant"] == v), key=lambda r: r["round"])
                ys = [r["p99_itl_ms"] / r["median_itl_ms"] if key == "itl_ratio" else r[key] for r in mine]
                ax.plot([r["round"] for r in mine], ys, marker="o", label=v)
            if key == "itl_ratio":
                ax.axhline(3.0, color="grey", linestyle="--", linewidth=1)
            ax.set_title(f"{w}: {label}", fontsize=8)
            ax.set_xlabel("round", fontsize=8)
            ax.xaxis.set_major_locator(MaxNLocator(integer=True))
            ax.tick_params(labelsize=7)
    axes[0][0].legend(fontsize=7)
    if title:
        fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(output, dpi=120)
    plt.close(fig)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("inputs", nargs="+", help="JSON-lines result files (one chart from all of them)")
    p.add_argument("--output", required=True, help="PNG path, e.g. docs/img/spec_tpot.png")
    p.add_argument("--title", default=None)
    args = p.parse_args(argv)
    rows = [r for path in args.inputs for r in load(path)]
    if not rows:
        raise SystemExit("no result rows in the inputs")
    if all("round" in r for r in rows):
        plot_rounds(rows, args.output, args.title)
    else:
        plot(rows, args.output, args.title)


if __name__ == "__main__":
    main()
