"""PrefillBudget on simulated served runs (tests/scheduler/prefill_sim.py): the machine's measured step costs,
bench_serving's workloads and arrivals, many seeds. Checks the goal's two halves as bench_serving
computes them (numpy's P99 over every ITL of a run, output tok/s against the unbounded server), and
that the rejected alternatives of D-27 do worse on the same runs."""

from __future__ import annotations

import numpy as np
import pytest

from jaxserve.scheduler.prefill_budget import PrefillBudget
from tests.scheduler.prefill_sim import CHUNK, copy_heavy_workload, random_workload, simulate

SEEDS = range(20)
WORKLOADS = {"random": random_workload, "copy-heavy": copy_heavy_workload}


def _default() -> PrefillBudget:
    return PrefillBudget(2.5, 32, CHUNK, stall_fraction=0.01)  # the server's defaults


def _runs(make, workload: str):
    return [simulate(make(), WORKLOADS[workload](seed), seed) for seed in SEEDS]


@pytest.mark.parametrize("workload", ["random", "copy-heavy"])
def test_simulated_served_p99_within_3x_the_median(workload):
    """Bounded, the P99 ITL stays within 3x the median on (nearly) every seed; unbounded it never does
    (a chunk beside 7 decodes is 4-16x a decode step), so the check can fail. Copy-heavy runs spend
    the whole 1% (2032 ITLs, 20 long allowed) and one seed of 20 ends at 3.02x: the margin the
    noise leaves, kept visible here rather than hidden by a looser bound."""
    bounded = [r.p99_over_median for r in _runs(_default, workload)]
    unbounded = [r.p99_over_median for r in _runs(lambda: PrefillBudget(0.0, 32, CHUNK, 0.01), workload)]
    assert sum(p > 3.0 for p in bounded) <= (0 if workload == "random" else 1)
    assert max(bounded) < 3.1
    assert min(unbounded) > 3.0


@pytest.mark.parametrize("workload, floor", [("random", -0.12), ("copy-heavy", -0.15)])
def test_simulated_throughput_against_unbounded(workload, floor):
    """Output tok/s of the bounded server against the unbounded one on the same runs, the mean over
    seeds: at or above `floor` (the simulator's machine is harsher than the real one: in-process the
    real server lost 2.2% and 3.9%, the simulator 9.6% and 12.5%, D-26), and the stall
    credit is what keeps it there: without it the same runs lose 15% and 31%."""
    unbounded = _runs(lambda: PrefillBudget(0.0, 32, CHUNK, 0.01), workload)

    def mean_ratio(make):
        return float(np.mean([b.output_tok_s / u.output_tok_s - 1 for b, u in zip(_runs(make, workload), unbounded)]))

    with_credit = mean_ratio(_default)
    assert with_credit >= floor
    assert mean_ratio(lambda: PrefillBudget(2.5, 32, CHUNK, stall_fraction=0.0)) < with_credit - 0.04


class _MedianReferenced(PrefillBudget):
    """The rejected option: the bound and the long-ITL charge refer to the busy period's median ITL so
    far (what the goal divides by) once 64 ITLs were seen, instead of the decode step of the batch."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.itls: list[float] = []

    def observe(self, num_decodes, num_prefill_tokens, seconds, step_bucket=None, batch_size=0):
        super().observe(num_decodes, num_prefill_tokens, seconds, step_bucket, batch_size)
        self.itls += [seconds] * num_decodes

    def reference_seconds(self, num_decodes, batch_size=0):
        reference = super().reference_seconds(num_decodes, batch_size)
        if reference is not None and len(self.itls) >= 64:
            reference = max(reference, float(np.median(self.itls)))
        return reference


def test_a_bound_on_the_running_median_itl_breaks_the_p99():
    """Sized against the median ITL so far, bounded steps raise the median they are sized by and run
    over 3x the run's final median: the P99 bound breaks on many seeds where the default keeps it."""
    runs = _runs(lambda: _MedianReferenced(2.5, 32, CHUNK, stall_fraction=0.01), "copy-heavy")
    assert sum(r.p99_over_median > 3.0 for r in runs) >= 10
