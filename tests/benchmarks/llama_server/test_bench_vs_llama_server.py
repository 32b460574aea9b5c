"""Tests for benchmarks/llama_server/bench_vs_llama_server.py's interleaved table (no server, no model)."""

import pytest


@pytest.fixture(scope="module")
def bench():
    from benchmarks.llama_server import bench_vs_llama_server

    return bench_vs_llama_server


def _row(server: str, round_: int, tpots_ms: list[float], median_tpot: float, tok_s: float) -> dict:
    return {"variant": server, "workload": "copy-heavy:1:6", "round": round_, "tpots_ms": tpots_ms,
            "median_tpot_ms": median_tpot, "total_output_tokens": 100, "duration_s": 100 / tok_s}


def test_interleaved_table_pairs_each_round(bench, capsys):
    rows = [
        _row("llama-server", -1, [1.0], 1.0, 1.0),  # settle round: not counted
        _row("jaxserve", -1, [99.0], 99.0, 1.0),
        _row("llama-server", 0, [9.0, 10.0, 11.0], 10.0, 80.0),
        _row("jaxserve", 0, [8.0, 9.0, 12.0], 9.0, 100.0),
        _row("llama-server", 1, [10.0, 10.0], 10.0, 80.0),
        _row("jaxserve", 1, [11.0, 11.0], 11.0, 60.0),
    ]
    bench.print_interleaved(rows)
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("| copy-heavy"))
    # medians of all counted requests: llama 9, 10, 10, 10, 11 -> 10; jaxserve 8, 9, 11, 11, 12 -> 11;
    # means 50 / 5 = 10 and 51 / 5 = 10.2; tok/s: 200 / (1.25 + 1.25) = 80 and 200 / (1 + 1/0.6) = 75;
    # per-round ratios 0.9 and 1.1
    assert line == ("| copy-heavy:1:6 | jaxserve | 2 | 10.00 / 11.00 | 10.00 / 10.20 | 80.0 / 75.0 | "
                    "1.000 / 0.900 / 1.100 | 1 of 2 |")


def test_interleaved_table_has_a_row_per_jaxserve_variant(bench, capsys):
    rows = [
        _row("llama-server", 0, [10.0], 10.0, 80.0),
        _row("jaxserve:f32", 0, [12.0], 12.0, 70.0),
        _row("jaxserve:int8", 0, [8.0], 8.0, 90.0),
    ]
    bench.print_interleaved(rows)
    lines = [x for x in capsys.readouterr().out.splitlines() if x.startswith("| copy-heavy")]
    assert lines == [
        "| copy-heavy:1:6 | jaxserve:f32 | 1 | 10.00 / 12.00 | 10.00 / 12.00 | 80.0 / 70.0 | 1.200 / 1.200 / 1.200 | 0 of 1 |",
        "| copy-heavy:1:6 | jaxserve:int8 | 1 | 10.00 / 8.00 | 10.00 / 8.00 | 80.0 / 90.0 | 0.800 / 0.800 / 0.800 | 1 of 1 |",
    ]


def test_variants_need_interleaved(bench):
    with pytest.raises(SystemExit):
        bench.main(["--llama-server", "x", "--workloads", "copy-heavy:1:6", "--jaxserve-variants", "a=--x"])


def test_sequential_table_has_as_many_separators_as_columns(bench, capsys):
    bench.print_sequential([{"server": "llama-server", "workload": "random:1:6", "output_throughput": 40.0,
                             "median_tpot_ms": 14.0, "median_itl_ms": 13.5, "p99_itl_ms": 30.25, "median_ttft_ms": 800.0}])
    header, separator, row = capsys.readouterr().out.strip().splitlines()
    assert header.count("|") == separator.count("|") == row.count("|") == 8
    assert row == "| llama-server | random:1:6 | 40.0 | 14.0 | 13.5 | 30.2 | 800.0 |"
