"""The overlap schedule: a decode step is launched before the previous one's sampled tokens are read.

SGLang overlaps its CPU scheduling with the GPU's forward the same way (on by default there; here on
by default except on CPU, where it measured no faster: docs/benchmarks.md, issue 20's thirteenth
pass). Without it a decode step is: build the batch, dispatch, wait for the device, read the tokens,
detokenize and check stops, and only then build the next batch,
so the host's part of every step adds to the inter-token latency. With it, `Engine.step` leaves a
decode step in flight (`InflightDecode`) and, at its next call, launches the following decode step
first and then reads and posts the tokens of the one in flight while the device computes.

The following step's input tokens are the step in flight's sampled tokens, still on the device: a decode
bucket has one token per sequence row, so `SampleOutput.next_tokens` [S] is the next step's `input_ids`
as is (`ModelRunner.forward(..., input_ids=...)`). A request that finishes on the token read after the
launch (EOS, a stop string) ran one row too many: that row's token is dropped, and the page it wrote
was freed (or left to the radix tree past the cached key) when the request finished; device programs
run in dispatch order, so no later step sees that write before its own.

Only steps whose next input needs nothing from the host are overlapped: no grammar (the next bitmask
follows the token), no penalties (the token counts), no request at its last token of max_new_tokens
(its next step would be past it), no step that is to verify drafts, one process on one device (the
input is a device array of the single-device step). Greedy and seeded outputs are the same with and
without the overlap (tests/engine/test_overlap_schedule.py).
"""

from __future__ import annotations

import dataclasses
import time
from typing import TYPE_CHECKING, Sequence

import jax

from jaxserve.runner import sampler as sampler_lib
from jaxserve.runner.model_runner import BatchEntry
from jaxserve.engine.outputs import StepOutput
from jaxserve.engine.request import Req
from jaxserve.scheduler.scheduler import ScheduleBatch

if TYPE_CHECKING:
    from jaxserve.engine.engine import Engine


@dataclasses.dataclass
class InflightDecode:
    """A decode step dispatched whose sampled tokens (device arrays) have not been read."""

    batch: ScheduleBatch
    sampled: sampler_lib.SampleOutput
    launched: float  # perf_counter seconds when its batch was built


def is_enabled(engine: "Engine") -> bool:
    """The overlap schedule applies to this engine: not turned off, one process on one device."""
    runner = engine.runner
    return not engine.args.disable_overlap_schedule and runner.mesh is None and runner.channel is None


def can_overlap(reqs: Sequence[Req]) -> bool:
    """Every request's next decode input can be taken from the device (see the module docstring)."""
    for r in reqs:
        p = r.sampling_params
        if r.grammar is not None or p.frequency_penalty or p.presence_penalty or p.repetition_penalty != 1:
            return False
    return bool(reqs)


def launch(engine: "Engine", batch: ScheduleBatch, started: float, after: InflightDecode | None = None) -> InflightDecode:
    """Dispatch the decode step of `batch` (forward and sampling) without reading its tokens. `after`:
    the step in flight whose tokens are this step's input (its requests, in the same order); without it
    the input is each request's last token."""
    if after is None:
        entries = batch.entries()
        input_ids = None
    else:  # the token ids are on the device: the entries carry a placeholder
        entries = [BatchEntry([0], r.kv_len, r.page_table) for r in batch.reqs]
        input_ids = after.sampled.next_tokens
    logits = engine.runner.forward(entries, input_ids=input_ids)
    # the row of a request's token after the one in flight: position len(output_ids) + 1
    rows = [(r, () if after is None else (0,)) for r in batch.reqs]
    sampling, flags = engine._sampling_rows(rows, None, logits.shape[0])
    return InflightDecode(batch, engine.runner.sample_async(logits, sampling, flags), started)


def complete(engine: "Engine", inflight: InflightDecode, last_done: float) -> tuple[list[StepOutput], InflightDecode | None]:
    """Account the step in flight, launch the next decode step when it can be (`schedule_followup`),
    then read and post the tokens of the step in flight. Returns its requests' progress and the step
    now in flight (None when the scheduler must choose the next batch). `last_done`: when the previous
    step's tokens were read (perf_counter seconds), the start of this step's share of the device time."""
    live = [r for r in inflight.batch.reqs if not r.is_finished]  # aborted while in flight: dropped
    if not live:
        return [], None
    batch = ScheduleBatch(live, [1] * len(live))
    engine.scheduler.advance(batch)
    nxt = None
    if len(live) == len(inflight.batch.reqs) and _wants_followup(engine, live):
        followup = engine.scheduler.schedule_followup(live)
        if followup is not None:
            nxt = launch(engine, followup, time.perf_counter(), after=inflight)
            engine.stats.num_overlapped_steps += 1
    sampled = jax.device_get(inflight.sampled)
    seconds = time.perf_counter() - max(inflight.launched, last_done)
    engine.scheduler.observe_step(batch, seconds)
    if engine.speculator is not None:
        engine.speculator.observe_decode(len(live), seconds)
    engine._count_step(True, inflight.launched)
    now, outputs = time.perf_counter(), []
    rows = {id(r): i for i, r in enumerate(inflight.batch.reqs)}
    for req in live:
        new_ids, delta = engine._emit_sampled(req, int(sampled.next_tokens[rows[id(req)]]), sampled, rows[id(req)], now)
        outputs.append(engine._output(req, new_ids, delta))
    if nxt is not None and all(r.is_finished for r in nxt.batch.reqs):
        nxt = None  # every row is past its request's end: nothing to read
    return outputs, nxt


def _wants_followup(engine: "Engine", reqs: list[Req]) -> bool:
    """The requests decode again after the step in flight, with inputs the device has."""
    if not is_enabled(engine) or not can_overlap(reqs):
        return False
    if any(r.remaining_new_tokens() < 2 for r in reqs):  # the token in flight is some request's last
        return False
    spec = engine.speculator
    return spec is None or not spec.should_speculate(reqs, True)
