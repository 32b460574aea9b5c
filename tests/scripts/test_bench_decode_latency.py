"""Tests for scripts/bench_decode_latency.py's served-against-in-process arithmetic (no server, no model):
per-request TPOTs from a bench_serving record, the served / in-process tables, and the option checks."""

import pytest

from tests.scripts import load_script


@pytest.fixture(scope="module")
def bench():
    return load_script("bench_decode_latency")


def test_request_tpots_follow_bench_serving_definition(bench):
    # (E2E - TTFT) / (output - 1): 1.0 s - 0.1 s over 9 gaps is 100 ms; a 1-token request has no TPOT
    record = {"e2e_latencies": [1.0, 0.5, 2.1], "ttfts": [0.1, 0.2, 0.1], "output_lens": [10, 1, 5]}
    assert bench.request_tpots_ms(record) == pytest.approx([100.0, 500.0])


def test_overhead_table_pairs_each_variant_with_its_in_process_run(bench, capsys):
    results = [
        {"variant": "off", "workload": "copy-heavy:1:2", "median_tpot_ms": 33.0, "tpots_ms": [30.0, 36.0]},
        {"variant": "engine:off", "workload": "copy-heavy:1:2", "median_tpot_ms": 30.0, "tpots_ms": [30.0, 30.0]},
        {"variant": "ngram", "workload": "copy-heavy:1:2", "median_tpot_ms": 10.0, "tpots_ms": [8.0, 12.0]},
        {"variant": "engine:ngram", "workload": "copy-heavy:1:2", "median_tpot_ms": 10.0, "tpots_ms": [10.0, 10.0]},
    ]
    bench.print_overhead(results)
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| off") or line.startswith("| ngram")]
    # off: medians 33 / 30 = 1.100; per-request ratios 1.0 and 1.2, mean 1.100
    assert rows[0] == "| off | copy-heavy:1:2 | 33.00 | 30.00 | 1.100 | 1.100 |"
    # ngram: medians equal, per-request ratios 0.8 and 1.2, mean 1.000
    assert rows[1] == "| ngram | copy-heavy:1:2 | 10.00 | 10.00 | 1.000 | 1.000 |"


def test_paired_table(bench, capsys):
    rows = [{"variant": "paired:ngram", "workload": "copy-heavy:1:3", "served_tpots_ms": [11.0, 9.0, 20.0],
             "engine_tpots_ms": [10.0, 10.0, 16.0]}]
    bench.print_paired(rows)
    line = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("| ngram"))
    # medians 11 / 10; per-request ratios 1.1, 0.9, 1.25 (mean 1.0833); min 0.9, max 1.25
    assert line == "| ngram | copy-heavy:1:3 | 3 | 11.00 | 10.00 | 1.100 | 1.083 | 0.900 / 1.250 |"


def test_paired_refuses_concurrency_above_one(bench):
    with pytest.raises(SystemExit):
        bench.main(["--variants", "ngram=--speculative-algorithm NGRAM", "--paired", "copy-heavy:8:16"])


def test_a_run_needs_workloads_or_paired(bench):
    with pytest.raises(SystemExit):
        bench.main(["--variants", "off="])


def test_peak_rss_is_the_kernels_high_water_mark(bench):
    """VmHWM of a live process against getrusage's ru_maxrss (KiB on Linux), read independently;
    a process that does not exist has none."""
    import os
    import resource

    before = bench.peak_rss_mib(os.getpid())
    maxrss_mib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    assert before == pytest.approx(maxrss_mib, rel=0.05)
    assert bench.peak_rss_mib(2**22 + 12345) is None  # above the kernel's pid_max
