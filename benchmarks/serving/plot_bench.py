"""Plot bench_serving.py results: output token throughput and mean TTFT against max concurrency or
request rate, one line per result file (or per --tag within a file).

    python -m benchmarks.serving.plot_bench jaxserve.jsonl sglang.jsonl --output plot.png
"""

from __future__ import annotations

import argparse
import json
import math
from collections import defaultdict
from pathlib import Path
from typing import Any, Sequence

import matplotlib
import matplotlib.ticker

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402 -- the backend must be chosen first

X_AXES = {"max_concurrency": "Max request concurrency", "request_rate": "Request rate (req/s)"}


def load_records(path: str | Path) -> list[dict[str, Any]]:
    """The JSON lines of one --output-file; blank lines are skipped."""
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def x_value(record: dict[str, Any], x_axis: str) -> float | None:
    """The record's max_concurrency or request_rate as a finite number; None if unset or infinite
    (bench_serving.py writes an infinite rate as the string "inf")."""
    value = record.get(x_axis)
    if value is None:
        return None
    value = float(value)
    return value if math.isfinite(value) else None


def choose_x_axis(records: Sequence[dict[str, Any]]) -> str:
    """request_rate when every record has a finite one, else max_concurrency."""
    if records and all(x_value(r, "request_rate") is not None for r in records):
        return "request_rate"
    return "max_concurrency"


def group_series(
    files: Sequence[str], labels: Sequence[str] | None, x_axis: str
) -> dict[str, list[tuple[float, float, float]]]:
    """label -> [(x, output throughput in tok/s, mean TTFT in ms)] sorted by x. The label is the
    given one for the file, else the file's stem; records with a tag get " (tag)" appended.
    Records without a finite x are left out."""
    series: dict[str, list[tuple[float, float, float]]] = defaultdict(list)
    for i, path in enumerate(files):
        base = labels[i] if labels else Path(path).stem
        for record in load_records(path):
            x = x_value(record, x_axis)
            if x is None:
                continue
            tag = record.get("tag")
            label = (tag if len(files) == 1 and not labels else f"{base} ({tag})") if tag else base
            series[label].append((x, record["output_throughput"], record["mean_ttft_ms"]))
    return {label: sorted(points) for label, points in series.items()}


def plot(series: dict[str, list[tuple[float, float, float]]], x_axis: str, output: str | Path,
         title: str | None = None) -> None:
    """Writes a PNG with two panels: output throughput and mean TTFT against x_axis."""
    fig, (ax_tput, ax_ttft) = plt.subplots(1, 2, figsize=(12, 4.5))
    for label, points in series.items():
        xs, tputs, ttfts = zip(*points)
        ax_tput.plot(xs, tputs, marker="o", label=label)
        ax_ttft.plot(xs, ttfts, marker="o", label=label)
    ax_tput.set_ylabel("Output throughput (tok/s)")
    ax_ttft.set_ylabel("Mean TTFT (ms)")
    for ax in (ax_tput, ax_ttft):
        ax.set_xlabel(X_AXES[x_axis])
        ax.grid(True, alpha=0.3)
        ax.legend()
        if x_axis == "max_concurrency":
            ax.set_xscale("log", base=2)
            ax.xaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(lambda v, _: f"{v:g}"))
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(output, dpi=120)
    plt.close(fig)


def main(argv: Sequence[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("files", nargs="+", help="bench_serving.py --output-file results (JSONL)")
    p.add_argument("--output", default="plot.png")
    p.add_argument("--labels", default=None, help="comma-separated, one per file (default: file names)")
    p.add_argument("--x-axis", choices=["auto", *X_AXES], default="auto")
    p.add_argument("--title", default=None)
    args = p.parse_args(argv)
    labels = args.labels.split(",") if args.labels else None
    if labels and len(labels) != len(args.files):
        raise SystemExit(f"--labels has {len(labels)} names for {len(args.files)} files")
    x_axis = args.x_axis
    if x_axis == "auto":
        x_axis = choose_x_axis([r for path in args.files for r in load_records(path)])
    series = group_series(args.files, labels, x_axis)
    if not series:
        raise SystemExit(f"No result has a finite {x_axis}")
    plot(series, x_axis, args.output, args.title)
    print(f"Wrote {args.output}")


if __name__ == "__main__":
    main()
