"""The overlap schedule: which decode steps may be launched before the previous one's tokens are read.

SGLang overlaps its CPU scheduling with the GPU's forward the same way (on by default there; here on
by default except on CPU, where it measured no faster: D-28 in docs/decisions.md). Without it a decode
step is: build the batch, dispatch, wait for the device, read the tokens, detokenize and check stops,
and only then build the next batch, so the host's part of every step adds to the inter-token latency.
With it, `Engine.step` launches a decode batch's followup step (`Engine._launch_followup`) before it
reads the batch's tokens, and the next call reads the followup's tokens after launching its own
followup: the host's work of one step runs while the device computes the next.

The followup's input tokens are the step before's sampled tokens, still on the device: a decode bucket
has one token per sequence row, so `SampleOutput.next_tokens` [S] is the next step's `input_ids` as is
(`ModelRunner.forward(..., input_ids=...)`). A request that finishes on the token read after the launch
(EOS, a stop string) ran one row too many: that row's token is dropped (`OutputProcessor.advance`), and
the page it wrote was freed (or left to the radix tree past the cached key) when the request finished;
device programs run in dispatch order, so no later step sees that write before its own.

Only steps whose next input needs nothing from the host are followed: no grammar (the next bitmask
follows the token), no penalties (the token counts), no request at its last token of max_new_tokens
(its next step would be past it), no step that is to verify drafts, one process on one device (the
input is a device array of the single-device step). Greedy and seeded outputs are the same with and
without the overlap (tests/engine/test_overlap_schedule.py).
"""

from __future__ import annotations

from typing import Sequence

from jaxserve.core.request import Req


def can_follow(reqs: Sequence[Req]) -> bool:
    """Every request decodes again after the step in flight, with an input the device has: no grammar,
    no penalty, and at least two tokens left to generate (the one in flight and the next)."""
    for r in reqs:
        p = r.sampling_params
        if r.grammar is not None or p.frequency_penalty or p.presence_penalty or p.repetition_penalty != 1:
            return False
        if r.remaining_new_tokens() < 2:
            return False
    return bool(reqs)
