"""scripts/plot_decode_latency.py: one bar per (variant or server, workload) from the benchmarks' JSON lines."""

from __future__ import annotations

import json

import pytest

from tests.scripts import load_script

plot_mod = load_script("plot_decode_latency")


def test_bars_per_variant_and_workload(tmp_path, monkeypatch):
    rows = [
        {"variant": "off", "workload": "copy-heavy:1:6", "median_tpot_ms": 26.7},
        {"variant": "ngram", "workload": "copy-heavy:1:6", "median_tpot_ms": 11.9},
        {"variant": "off", "workload": "random:8:24", "median_tpot_ms": 113.7},
        {"variant": "engine", "workload": "random:1:6", "median_tpot_ms": 24.2},  # in-process: not a bar
    ]
    vs_llama = [{"server": "llama-server", "workload": "copy-heavy:1:6", "median_tpot_ms": 14.0}]
    a, b = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    a.write_text("\n".join(json.dumps(r) for r in rows) + "\n\n")
    b.write_text(json.dumps(vs_llama[0]) + "\n")
    drawn = {}
    real_bar = plot_mod.plt.Axes.bar

    def spy(self, xs, ys, *args, label=None, **kwargs):
        drawn[label] = list(ys)
        return real_bar(self, xs, ys, *args, label=label, **kwargs)

    monkeypatch.setattr(plot_mod.plt.Axes, "bar", spy)
    out = tmp_path / "tpot.png"
    plot_mod.main([str(a), str(b), "--output", str(out)])
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert drawn == {"off": [26.7, 113.7], "ngram": [11.9], "llama-server": [14.0]}


def test_no_rows_is_an_error(tmp_path):
    empty = tmp_path / "e.jsonl"
    empty.write_text("\n")
    with pytest.raises(SystemExit):
        plot_mod.main([str(empty), "--output", str(tmp_path / "x.png")])


def test_interleaved_rows_are_drawn_per_round(tmp_path, monkeypatch):
    """Rows with a round: one line per (workload, variant, panel) over the counted rounds, in round order;
    the settle round (-1) is left out."""
    def row(variant, round_, tpot, tok_s, p99):
        return {"variant": variant, "workload": "random:8:24", "round": round_, "median_tpot_ms": tpot,
                "output_throughput": tok_s, "median_itl_ms": 100.0, "p99_itl_ms": p99}

    rows = [row("a", -1, 99.0, 1.0, 900.0), row("a", 1, 12.0, 50.0, 250.0), row("a", 0, 10.0, 40.0, 200.0),
            row("b", 0, 11.0, 45.0, 500.0), row("b", 1, 13.0, 47.0, 550.0)]
    path = tmp_path / "r.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    drawn = []
    real_plot = plot_mod.plt.Axes.plot

    def spy(self, xs, ys, *args, label=None, **kwargs):
        drawn.append((label, list(xs), [round(y, 3) for y in ys]))
        return real_plot(self, xs, ys, *args, label=label, **kwargs)

    monkeypatch.setattr(plot_mod.plt.Axes, "plot", spy)
    out = tmp_path / "rounds.png"
    plot_mod.main([str(path), "--output", str(out)])
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert drawn == [("a", [0, 1], [10.0, 12.0]), ("b", [0, 1], [11.0, 13.0]),  # median TPOT
                     ("a", [0, 1], [40.0, 50.0]), ("b", [0, 1], [45.0, 47.0]),  # output tok/s
                     ("a", [0, 1], [2.0, 2.5]), ("b", [0, 1], [5.0, 5.5])]  # P99 / median ITL
