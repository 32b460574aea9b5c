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
