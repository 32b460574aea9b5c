"""Tests for benchmarks/serving/bench_decode_latency.py's served-against-in-process arithmetic (no server, no model):
per-request TPOTs from a bench_serving record, the served / in-process tables, and the option checks."""

import pytest


@pytest.fixture(scope="module")
def bench():
    from benchmarks.serving import bench_decode_latency

    return bench_decode_latency


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


def _run(variant: str, round_: int, tok_s: float, itls_ms: list[float], median_itl: float, p99_itl: float) -> dict:
    """A measure_workload row with `round`: throughput from 100 tokens over 100 / tok_s seconds."""
    return {"variant": variant, "workload": "random:8:24", "round": round_, "output_throughput": tok_s,
            "total_output_tokens": 100, "duration_s": 100 / tok_s, "itls": [[g / 1e3 for g in itls_ms]],
            "median_itl_ms": median_itl, "p99_itl_ms": p99_itl, "median_tpot_ms": median_itl, "tpots_ms": []}


def test_rounds_alternate_the_servers_abba_with_new_prompts_each_round(bench, monkeypatch):
    """run_rounds: every target runs every workload each round, with that round's seed on all targets,
    the targets' order reversed every other round (settle rounds included, numbered below 0)."""
    calls = []

    def fake_measure(name, flags, workload, port, seed, backend="jaxserve", extra_argv=()):
        calls.append((name, workload, seed, port, extra_argv))
        return {"variant": name, "workload": workload, "output_throughput": 1.0, "median_tpot_ms": 1.0,
                "median_itl_ms": 1.0, "p99_itl_ms": 2.0}

    monkeypatch.setattr(bench, "measure_workload", fake_measure)
    targets = [bench.Target("a", [], 1, 0.0), bench.Target("b", ["--x"], 2, 0.0)]
    rows = bench.run_rounds(targets, ["w1", "w2"], rounds=2, settle_rounds=1, seed=10, extra_argv=("--flush-cache",))
    assert [(c[0], c[1], c[2]) for c in calls] == [
        ("a", "w1", 10), ("b", "w1", 10), ("a", "w2", 10), ("b", "w2", 10),  # settle round -1
        ("b", "w1", 11), ("a", "w1", 11), ("b", "w2", 11), ("a", "w2", 11),  # round 0
        ("a", "w1", 12), ("b", "w1", 12), ("a", "w2", 12), ("b", "w2", 12),  # round 1
    ]
    assert {c[3] for c in calls if c[0] == "b"} == {2} and all(c[4] == ("--flush-cache",) for c in calls)
    assert [r["round"] for r in rows] == [-1] * 4 + [0] * 4 + [1] * 4


def test_interleaved_table_pools_itls_and_pairs_rounds(bench, capsys):
    rows = [
        _run("base", -1, 10.0, [1.0] * 10, 1.0, 1.0),  # a settle round: not counted
        _run("new", -1, 1.0, [99.0] * 10, 99.0, 99.0),
        _run("base", 0, 100.0, [10.0] * 99 + [50.0], 10.0, 50.0),
        _run("new", 0, 90.0, [10.0] * 99 + [25.0], 10.0, 25.0),
        _run("base", 1, 100.0, [10.0] * 100, 10.0, 10.0),
        _run("new", 1, 102.0, [10.0] * 98 + [40.0, 40.0], 10.0, 40.0),
        _run("ok", 0, 96.0, [10.0] * 100, 10.0, 30.0),  # -4% and P99 at 3x: met
        _run("ok", 1, 100.0, [10.0] * 100, 10.0, 12.0),
    ]
    bench.print_interleaved(rows, baseline="base")
    lines = {line.split(" | ")[1]: line for line in capsys.readouterr().out.splitlines() if line.startswith("| random")}
    # base: 200 tokens over 2 s = 100 tok/s; 200 ITLs, one of 50 ms: the pooled P99 (linear interpolation
    # between the 198th and 199th of the sorted gaps, both 10) is 10
    assert lines["base"] == "| random:8:24 | base | 2 | 100.0 | (baseline) | 10.0 | 10.0 | 1.00 | - of 2 |"
    # new: 200 tokens over 100/90 + 100/102 s = 95.6 tok/s; rounds -10% and +2% (mean -4%); pooled gaps
    # sorted: 197 of 10, then 25, 40, 40 -> P99 at rank 0.99 x 199 = 197.01 is 25 + 0.01 x 15 = 25.15;
    # round 0 lost 10% (missed), round 1 had P99 40 > 3 x 10 (missed)
    assert lines["new"] == "| random:8:24 | new | 2 | 95.6 | -4.0% / -10.0% / +2.0% | 10.0 | 25.1 | 2.51 | 0 of 2 |"
    assert lines["ok"].endswith("| -2.0% / -4.0% / +0.0% | 10.0 | 10.0 | 1.00 | 2 of 2 |")


def test_interleaved_needs_a_baseline_among_the_variants(bench):
    with pytest.raises(SystemExit):
        bench.main(["--interleaved", "--variants", "a=", "b=--x", "--workloads", "random:8:8", "--baseline", "c"])


@pytest.mark.parametrize("argv, named", [
    (["--workloads", "random:1:2", "--rounds", "3"], "--rounds does nothing without --paired or --interleaved"),
    (["--workloads", "random:1:2", "--settle-rounds", "0"], "--settle-rounds does nothing without"),  # 0 is given too
    (["--workloads", "random:1:2", "--baseline", "off"], "--baseline does nothing without"),
    (["--paired", "random:1:2", "--interleaved"], "--paired and --interleaved"),
    (["--paired", "random:1:2", "--workloads", "random:1:2"], "--workloads would be ignored"),
    (["--paired", "random:1:2", "--port-base", "9000"], "--port-base does nothing with --paired"),
    (["--interleaved", "--workloads", "random:8:8", "--plot", "x.png"], "--plot does nothing with --interleaved"),
    (["--interleaved", "--workloads", "random:8:8", "--paired-rounds", "2"], "--paired-rounds does nothing with --interleaved"),
])
def test_an_option_its_mode_would_ignore_is_refused(bench, capsys, argv, named):
    """Every mode's options are checked before a server starts (no server is started here: exit 2 first)."""
    with pytest.raises(SystemExit) as exc:
        bench.main(["--variants", "off=", *argv])
    assert exc.value.code == 2
    assert named in capsys.readouterr().err
