"""Python's garbage collector and the server's pauses (D-44).

A full (generation 2) collection walks every tracked object and holds the GIL while it does: on the
default server's start-up heap (about 815k objects: JAX, the tokenizer, the compiled executables' Python
side) one took 0.40 s on the 2-core machine, so /health and /get_load could wait that long for no reason
the engine knows of. `freeze_gc` moves everything alive after start-up into the permanent generation,
which collections skip (`gc.freeze`; the same heap then collected in under 1 ms); the server calls it
once it is ready, as SGLang freezes after its warm-up, and `/freeze_gc` does it again on demand (after
a few warm-up requests, say). `--gc-threshold` sets the collection thresholds and
`--gc-warning-threshold-secs` logs every collection longer than that, as SGLang's flags of those names.
"""

from __future__ import annotations

import gc
import logging
import time
from typing import Callable, Sequence

logger = logging.getLogger(__name__)


def freeze_gc(context: str, gc_threshold: Sequence[int] | None = None) -> int:
    """Move every object alive now into the permanent generation (`gc.freeze`), first setting
    `gc_threshold` (1 to 3 ints, `gc.set_threshold`) when given. Returns the permanent generation's
    size (objects) after it; logs both."""
    if gc_threshold:
        gc.set_threshold(*gc_threshold)
    before = gc.get_freeze_count()
    gc.freeze()
    frozen = gc.get_freeze_count()
    logger.info("%s: froze %d objects out of garbage collection (%d frozen in all), thresholds %s",
                context, frozen - before, frozen, gc.get_threshold())
    return frozen


def warn_on_long_gc(threshold_s: float) -> Callable[[str, dict], None]:
    """Log a warning for every collection of this process longer than `threshold_s` seconds, with its
    generation, its duration and how many objects each generation and the frozen one hold. Returns the
    callback it added to `gc.callbacks`."""
    started: dict[int, float] = {}

    def on_gc(phase: str, info: dict) -> None:
        generation = info.get("generation", -1)
        if phase == "start":
            started[generation] = time.perf_counter()
            return
        duration = time.perf_counter() - started.pop(generation, time.perf_counter())
        if duration > threshold_s:
            tracked = [len(gc.get_objects(g)) for g in range(3)]
            logger.warning(
                "long garbage collection: generation %d took %.3f s (objects per generation %s, %d frozen); "
                "/freeze_gc after a few warm-up requests shortens it", generation, duration, tracked, gc.get_freeze_count(),
            )

    gc.callbacks.append(on_gc)
    return on_gc
