"""PrefillBudget: the prefill tokens beside running decodes follow the measured step costs."""

from __future__ import annotations

import jax

from jaxserve.scheduler.prefill_budget import PrefillBudget


def test_budget_from_measured_costs():
    b = PrefillBudget(itl_ratio=3.0, min_tokens=8, max_tokens=512)
    assert b.budget(0) == 512  # nothing to stall
    assert b.budget(4) == 0  # no decode step measured: run one (a decode-only step) first
    b.observe(num_decodes=4, num_prefill_tokens=0, seconds=0.05)
    assert b.budget(4) == 8  # no prefill measured: the minimum
    b.observe(num_decodes=0, num_prefill_tokens=100, seconds=1.0)  # 10 ms per prompt token
    b.observe(num_decodes=4, num_prefill_tokens=0, seconds=0.05)  # a 4-decode step: 50 ms
    # (3 - 1) x 50 ms / 10 ms = 10 tokens
    assert b.budget(4) == 10
    assert b.budget(3) == 10  # same decode bucket (4)
    assert b.budget(2) == 0  # bucket 2 not measured, no smaller one: measure it first
    b.observe(num_decodes=16, num_prefill_tokens=0, seconds=0.5)
    assert b.budget(16) == 100  # a longer decode step absorbs a larger chunk
    assert b.budget(9) == 100  # same bucket (16)
    assert b.budget(5) == 0  # bucket 8 not measured: measure it first (bucket 4 is only a lower bound)
    assert b.decode_seconds(5) == 0.05  # which decode_seconds gives


def test_budget_clamped_and_off():
    b = PrefillBudget(itl_ratio=2.0, min_tokens=16, max_tokens=64)
    b.observe(0, 10, 0.001)
    b.observe(8, 0, 1.0)
    assert b.budget(8) == 64
    off = PrefillBudget(itl_ratio=0.0, min_tokens=16, max_tokens=64)
    off.observe(8, 0, 1.0)
    assert off.budget(8) == 64


def test_mixed_step_marginal_cost():
    b = PrefillBudget(itl_ratio=2.0, min_tokens=1, max_tokens=1000)
    b.observe(4, 0, 0.1)
    b.observe(4, 50, 0.6)  # (0.6 - 0.1) / 50 = 10 ms per token
    assert b.budget(4) == 10


def test_step_bucket_steps_down_from_buckets_measured_over_the_bound():
    """A step costs its whole extend bucket: buckets are first tried from the bottom up, each one above
    a measured bucket that keeps the bound (itl_ratio x decode); one whose steps measured over it is
    not filled again, and the next smaller one that holds a prefill token is taken instead."""
    buckets = (16, 32, 64, 128)
    b = PrefillBudget(itl_ratio=2.0, min_tokens=8, max_tokens=512)
    assert b.step_tokens(7, 32, buckets) == 64  # no decode step measured: the bucket of 7 + 32
    b.observe(num_decodes=7, num_prefill_tokens=0, seconds=0.050)
    assert b.step_tokens(7, 32, buckets) == 16  # nothing measured beside 7 decodes: the smallest first
    b.observe(7, 9, 0.080, step_bucket=16)  # 1.6x
    assert b.step_tokens(7, 32, buckets) == 32  # then one bucket up
    b.observe(7, 25, 0.072, step_bucket=32)  # 1.44x: within the bound, and its prefill part (22 ms)
    assert b.step_tokens(7, 32, buckets) == 64  # doubled says 94 ms at 64: tried
    b.observe(7, 57, 0.180, step_bucket=64)  # 3.6x a decode step
    assert b.step_tokens(7, 32, buckets) == 64  # one step is not enough to judge it: tried again
    b.observe(7, 57, 0.180, step_bucket=64)
    b.observe(7, 57, 0.180, step_bucket=64)
    assert b.step_tokens(7, 32, buckets) == 32  # three: its median is over the bound
    assert b.step_tokens(7, 100, buckets) == 32  # 128 unmeasured, but above 64, which is over: not tried
    for _ in range(8):
        b.observe(7, 25, 0.110, step_bucket=32)  # 2.2x, eight times: its cost is over the bound
    assert b.step_tokens(7, 32, buckets) == 16
    for _ in range(8):
        b.observe(7, 9, 0.105, step_bucket=16)
    assert b.step_tokens(7, 32, buckets) == 16  # all over: the smallest that still prefills
    assert b.step_tokens(15, 8, buckets) == 16  # nothing measured beside 15 decodes: the smallest


def test_first_try_of_a_larger_bucket_scales_the_bucket_below():
    """The measured case: beside 7 decodes (60 ms) at ratio 2.5 the 16- and 32-token buckets took 107
    and 141 ms (64 then measured 240); the 32-token step's prefill part (81 ms) doubled says 222 ms at
    64, over the 150 ms bound, so 64 is not tried. Where the line through 16 and 32 is flat (120, 125
    ms: 135 at 64) proportion still says 190: not tried; a 32-token step at 100 ms (140) is."""
    b = PrefillBudget(itl_ratio=2.5, min_tokens=32, max_tokens=512)
    b.observe(7, 0, 0.060)
    b.observe(7, 9, 0.107, step_bucket=16)
    assert b.step_tokens(7, 32, (16, 32, 64)) == 32  # the second bucket is tried on the first alone
    b.observe(7, 25, 0.141, step_bucket=32)
    assert b.step_tokens(7, 32, (16, 32, 64)) == 32
    b.observe(7, 25, 0.160, step_bucket=32)
    b.observe(7, 25, 0.160, step_bucket=32)  # 32's median of three steps over the bound
    assert b.step_tokens(7, 32, (16, 32, 64)) == 16
    for cost_32, expected in ((0.125, 32), (0.100, 64)):
        flat = PrefillBudget(itl_ratio=2.5, min_tokens=32, max_tokens=512)
        flat.observe(7, 0, 0.060)
        flat.observe(7, 9, 0.120, step_bucket=16)
        flat.observe(7, 25, cost_32, step_bucket=32)
        assert flat.step_tokens(7, 40, (16, 32, 64)) == expected


def test_bucket_costs_are_medians_of_recent_steps():
    """A bucket's cost is the median of its last steps: one slow step does not shut a bucket out (it is
    tried again until it has three steps), and after a slower spell a bucket over the bound comes back
    only until three steps of the slower machine say it is still over."""
    buckets = (16, 32, 64)
    b = PrefillBudget(itl_ratio=2.5, min_tokens=8, max_tokens=512)
    b.observe(7, 0, 0.050)
    b.observe(7, 9, 0.080, step_bucket=16)
    b.observe(7, 25, 0.140, step_bucket=32)  # 2.8x once: over the bound
    assert b.step_tokens(7, 20, buckets) == 32  # tried again
    b.observe(7, 25, 0.110, step_bucket=32)
    b.observe(7, 25, 0.110, step_bucket=32)
    assert b.mixed_seconds(7, 32) == 0.110
    b.observe(7, 57, 0.180, step_bucket=64)  # 3.6x: over the bound and a long ITL
    assert b.step_tokens(7, 40, buckets) == 32  # not tried again
    for _ in range(8):
        b.observe(7, 0, 0.080)  # a slower spell: the decode step's median is 80 ms, the bound 200 ms
    assert b.decode_seconds(7) == 0.080
    assert b.step_tokens(7, 40, buckets) == 64  # 180 ms is within: tried once
    b.observe(7, 57, 0.330, step_bucket=64)  # slower too; with two steps it is tried once more
    assert b.step_tokens(7, 40, buckets) == 64
    b.observe(7, 57, 0.330, step_bucket=64)  # the median of three is over the bound: out again
    assert b.step_tokens(7, 40, buckets) == 32


def test_only_steps_long_by_the_goal_are_charged():
    """The credit pays for long ITLs as the P99 goal counts them (over 3x a decode step, or the bound if
    larger): a bounded step that overshoots the bound a little is not charged."""
    import pytest

    from jaxserve.scheduler.prefill_budget import LONG_ITL_RATIO

    assert LONG_ITL_RATIO == 3.0
    b = PrefillBudget(itl_ratio=2.5, min_tokens=8, max_tokens=512, stall_fraction=0.01)
    b.observe(4, 0, 0.05)
    b.admit_request("a", 401)  # 400 ITLs: 4 may be long
    assert b.stall_credit == pytest.approx(4.0)
    b.observe(4, 30, 0.14)  # 2.8x: over the bound, not a long ITL
    assert b.stall_credit == pytest.approx(4.0)
    b.observe(4, 60, 0.16)  # 3.2x: four long ITLs
    assert b.stall_credit == pytest.approx(0.0)
    loose = PrefillBudget(itl_ratio=4.0, min_tokens=8, max_tokens=512, stall_fraction=0.01)
    loose.observe(4, 0, 0.05)
    loose.admit_request("a", 9)
    loose.observe(4, 60, 0.19)  # 3.8x: within a bound looser than the goal
    assert loose.stall_credit == pytest.approx(0.08)
    assert loose.long_ratio == 4.0


def test_idle_engine_drops_the_banked_credit():
    """A busy period spends only what it earned: going idle drops a positive credit and keeps a debt."""
    import pytest

    b = PrefillBudget(itl_ratio=2.0, min_tokens=8, max_tokens=512, stall_fraction=0.01)
    b.observe(8, 0, 0.05)
    for i in range(20):
        b.admit_request(f"r{i}", 101)
    assert b.stall_credit == pytest.approx(16.0)  # the cap
    b.end_busy_period()
    assert b.stall_credit == 0.0 and not b.can_stall(1)
    b.finish_request("r0", 1)  # its grant went with the busy period: nothing is taken back twice
    assert b.stall_credit == 0.0
    b.observe(8, 128, 0.50)  # a long step beside 8 decodes: a debt of 8
    assert b.stall_credit == pytest.approx(-8.0)
    b.end_busy_period()
    assert b.stall_credit == 0.0  # the next busy period starts from 0 either way


def test_bound_refers_to_the_batch_after_admission():
    """While prompts wait, the bound multiplies the decode step of the batch they will join, not that of
    the few decodes left running; the charge for a long step uses the same reference."""
    import pytest

    buckets = (16, 32, 64)
    b = PrefillBudget(itl_ratio=2.5, min_tokens=8, max_tokens=512, stall_fraction=0.01)
    b.observe(4, 0, 0.045)
    b.observe(8, 0, 0.057)
    b.observe(4, 28, 0.140, step_bucket=32)  # 3.1x the 4-decode step, 2.5x the 8-decode one
    assert b.reference_seconds(4) == pytest.approx(0.045)
    assert b.reference_seconds(4, batch_size=8) == pytest.approx(0.057)
    assert b.step_tokens(4, 20, buckets) == 16  # against its own decode step, 32 is over
    assert b.step_tokens(4, 20, buckets, batch_size=8) == 32  # against the batch it will be: within
    b.stall_credit = 4.0
    b.observe(4, 28, 0.160, step_bucket=32, batch_size=8)  # 2.8x the 8-decode step: not a long ITL
    assert b.stall_credit == pytest.approx(4.0)
    b.observe(4, 28, 0.160, step_bucket=32)  # 3.6x its own: charged
    assert b.stall_credit == pytest.approx(0.0)


def test_stall_credit_pays_for_few_long_steps():
    """The stall allowance: each queued request grants stall_fraction of a credit per ITL it may have,
    each decode token of a step measured over 3x its decode step spends one; a whole chunk is allowed
    only while the credit covers every running decode, so at most ~stall_fraction of the ITLs wait long."""
    import pytest

    b = PrefillBudget(itl_ratio=2.0, min_tokens=8, max_tokens=512, stall_fraction=0.01)
    assert not b.can_stall(4)  # nothing granted yet
    b.observe(4, 0, 0.05)
    b.admit_request("a", 397)  # 396 ITLs
    assert b.stall_credit == pytest.approx(3.96)
    assert not b.can_stall(4) and b.can_stall(3)
    b.admit_request("b", 5)
    assert b.can_stall(4)  # 400 ITLs: 4 may be long
    assert not b.can_stall(0)  # no decode runs: nothing to allow (the budget is the chunk anyway)
    b.observe(4, 128, 0.50)  # a whole chunk, 10x the decode step: 4 long ITLs spent
    assert b.stall_credit == pytest.approx(0.0)
    assert not b.can_stall(1)
    for _ in range(100):
        b.observe(4, 30, 0.09)  # decode tokens earn nothing: their requests brought their credit
        b.observe(4, 0, 0.05)
    assert b.stall_credit == pytest.approx(0.0)
    for i in range(100):
        b.admit_request(f"q{i}", 1001)
    assert b.stall_credit == pytest.approx(16.0)  # capped: a deep queue banks no burst of stalls
    # ten long steps in a row: only the first four were allowed, and the credit shows the debt
    allowed = 0
    for _ in range(10):
        if b.can_stall(4):
            allowed += 1
            b.observe(4, 128, 0.50)
    assert allowed == 4
    off = PrefillBudget(itl_ratio=2.0, min_tokens=8, max_tokens=512)
    unbounded = PrefillBudget(itl_ratio=0.0, min_tokens=8, max_tokens=512, stall_fraction=0.01)
    for budget in (off, unbounded):
        budget.observe(4, 0, 0.05)
        budget.admit_request("a", 10_001)
        assert budget.stall_credit == 0.0 and not budget.can_stall(1)
    b.stall_credit = 16.0
    assert not b.can_stall(2)  # no decode step of 2 (or fewer) measured: no bound known yet
    b.observe(2, 128, 0.50)  # a chunk step beside it is charged as long
    assert b.stall_credit == pytest.approx(16.0 - 2)  # (the credit was at its cap)
    with pytest.raises(ValueError, match="stall_fraction"):
        PrefillBudget(2.0, 8, 512, stall_fraction=1.0)


def test_scheduler_takes_a_whole_chunk_on_stall_credit(tiny_model_dir):
    """With credit for every running decode, the step prefills the whole waiting prompt beside the
    decodes instead of a budget-sized chunk; without it, the budget holds."""
    from jaxserve.engine.engine import Engine

    eng = Engine(model_path=tiny_model_dir, max_total_tokens=4096, max_running_requests=16, chunked_prefill_size=128,
                 context_length=512, disable_precompile=True, prefill_decode_itl_ratio=3.0, min_prefill_budget=4)
    for i in range(3):
        eng.add_request(list(range(10 + i, 40 + i)), {"max_new_tokens": 50})
    while len(eng.scheduler.running) < 3:
        eng.step()
    eng.add_request(list(range(100, 190)), {"max_new_tokens": 4})  # 90 prompt tokens
    sched = eng.scheduler
    budget = sched.prefill_budget = PrefillBudget(3.0, 4, 128, stall_fraction=0.01)
    budget.observe(3, 0, 0.05)
    budget.observe(0, 100, 0.5)  # 5 ms per prompt token: (3 - 1) x 50 / 5 = 20 tokens
    budget.stall_credit = 2.9  # short of the 3 running decodes
    batch = sched.schedule()
    assert sorted(batch.extend_lens) == [1, 1, 1, 13]  # the smallest bucket (16) first
    _run(eng, batch)
    budget.stall_credit = 3.0
    batch = sched.schedule()
    assert sorted(batch.extend_lens) == [1, 1, 1, 90 - 13]  # the rest of the prompt in one step


def test_scheduler_caps_prefill_beside_decodes(tiny_model_dir):
    """A prompt that arrives while requests decode is prefilled in budget-sized chunks, mixed with
    the decodes; its chunks grow when the measured decode step gets longer."""
    from jaxserve.engine.engine import Engine

    eng = Engine(model_path=tiny_model_dir, max_total_tokens=4096, max_running_requests=16, chunked_prefill_size=128,
                 context_length=512, disable_precompile=True, prefill_decode_itl_ratio=3.0, min_prefill_budget=4)
    assert eng.args.enable_mixed_chunk  # the CPU default
    for i in range(3):
        eng.add_request(list(range(10 + i, 40 + i)), {"max_new_tokens": 50})
    while len(eng.scheduler.running) < 3:
        eng.step()
    eng.add_request(list(range(100, 400)), {"max_new_tokens": 4})
    sched = eng.scheduler
    sched.prefill_budget = type(sched.prefill_budget)(3.0, 4, 128)  # forget the real step times
    batch = sched.schedule()
    assert batch.extend_lens == [1, 1, 1]  # decode cost of this batch unknown: a decode-only step
    _run(eng, batch)
    sched.prefill_budget.observe(3, 0, 0.05)
    sched.prefill_budget.observe(0, 100, 0.5)  # 5 ms per prompt token: (3 - 1) x 50 / 5 = 20 tokens
    sched.prefill_budget.observe(3, 13, 0.08, step_bucket=16)  # the smallest bucket, measured within
    batch = sched.schedule()
    assert sorted(batch.extend_lens) == [1, 1, 1, 29]  # 3 + 20 tokens filled up to the 32-token bucket
    _run(eng, batch)
    sched.prefill_budget.observe(3, 29, 0.12, step_bucket=32)
    for _ in range(20):  # slower decode steps (the median reaches 100 ms) absorb larger chunks
        sched.prefill_budget.observe(3, 0, 0.1)
    batch = sched.schedule()
    assert sorted(batch.extend_lens)[-1] == 61  # 3 + ~42 tokens: the 64 bucket


def test_scheduler_ends_the_busy_period_when_idle(tiny_model_dir):
    """The engine drops the banked stall credit once nothing is left to run, not while requests run."""
    from jaxserve.engine.engine import Engine

    eng = Engine(model_path=tiny_model_dir, max_total_tokens=4096, chunked_prefill_size=128, context_length=512,
                 disable_precompile=True, prefill_decode_itl_ratio=3.0, prefill_decode_stall_fraction=0.01)
    budget = eng.scheduler.prefill_budget
    eng.add_request(list(range(10, 40)), {"max_new_tokens": 6})
    eng.step()
    budget.stall_credit = 5.0
    eng.step()  # a decode step: the request still runs, the credit is kept
    assert budget.stall_credit == 5.0
    while eng.has_unfinished():
        eng.step()
    eng.step()  # nothing to run
    assert budget.stall_credit == 0.0


def _run(eng, batch):
    """Run a batch the test scheduled by hand through the engine's own launch and output path."""
    launched = eng.processor.advance(eng._launch(batch))
    eng.processor.process(launched, jax.device_get(launched.sampled))


def test_enable_mixed_chunk_is_tri_state():
    """SGLang's `--enable-mixed-chunk` still turns mixed chunks on; `--no-enable-mixed-chunk` turns the
    CPU default off; unset is the platform default (on for CPU, off elsewhere as in SGLang)."""
    import pytest

    from jaxserve.server_args import ServerArgs

    assert ServerArgs.from_cli([]).enable_mixed_chunk is None
    assert ServerArgs.from_cli([]).resolved("cpu").enable_mixed_chunk is True
    assert ServerArgs.from_cli([]).resolved("gpu").enable_mixed_chunk is False
    assert ServerArgs.from_cli(["--enable-mixed-chunk"]).resolved("gpu").enable_mixed_chunk is True
    assert ServerArgs.from_cli(["--no-enable-mixed-chunk"]).resolved("cpu").enable_mixed_chunk is False
    with pytest.raises(SystemExit):
        ServerArgs.from_cli(["--disable-mixed-chunk"])  # the old switch is gone, not silently ignored


def test_stall_fraction_flag_is_validated():
    """`--prefill-decode-stall-fraction` is a share in [0, 1): anything else is refused by name."""
    import dataclasses

    import pytest

    from jaxserve.server_args import ServerArgs

    args = ServerArgs.from_cli([])
    assert args.prefill_decode_stall_fraction == 0.01
    assert ServerArgs.from_cli(["--prefill-decode-stall-fraction", "0"]).prefill_decode_stall_fraction == 0
    for bad in (1.0, -0.1, 1.5):
        with pytest.raises(ValueError, match="--prefill-decode-stall-fraction"):
            dataclasses.replace(args, prefill_decode_stall_fraction=bad).validate()
    with pytest.raises(SystemExit):  # the CLI refuses it too, before anything starts
        ServerArgs.from_cli(["--prefill-decode-stall-fraction", "1"])
