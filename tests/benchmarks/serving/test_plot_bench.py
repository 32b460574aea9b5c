"""Tests for benchmarks/serving/plot_bench.py on synthetic bench_serving.py records."""

import json

import pytest

pytest.importorskip("matplotlib")


from benchmarks.serving import plot_bench  # noqa: E402 -- after the skip: it imports matplotlib


def _write(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return str(path)


def _record(concurrency, rate="inf", tag=None):
    return {"max_concurrency": concurrency, "request_rate": rate, "tag": tag,
            "output_throughput": 100.0 * (concurrency or 1), "mean_ttft_ms": 10.0 + (concurrency or 0)}


def test_series_by_concurrency_and_tag(tmp_path):
    a = _write(tmp_path / "jaxserve.jsonl", [_record(8), _record(1), _record(None), _record(4, tag="cold")])
    b = _write(tmp_path / "sglang.jsonl", [_record(2), _record(16)])
    assert plot_bench.choose_x_axis(plot_bench.load_records(a)) == "max_concurrency"
    series = plot_bench.group_series([a, b], None, "max_concurrency")
    assert series == {
        "jaxserve": [(1.0, 100.0, 11.0), (8.0, 800.0, 18.0)],
        "jaxserve (cold)": [(4.0, 400.0, 14.0)],
        "sglang": [(2.0, 200.0, 12.0), (16.0, 1600.0, 26.0)],
    }


def test_main_writes_png(tmp_path):
    a = _write(tmp_path / "a.jsonl", [_record(None, rate=r) for r in (1.0, 4.0, 2.0)])
    b = _write(tmp_path / "b.jsonl", [_record(None, rate=r) for r in (1.0, 2.0)])
    out = tmp_path / "plot.png"
    plot_bench.main([a, b, "--labels", "x,y", "--output", str(out)])
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert plot_bench.group_series([a], ["x"], "request_rate")["x"][0][0] == 1.0
