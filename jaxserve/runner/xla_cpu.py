"""XLA:CPU's scheduler for the step programs, set before JAX starts its CPU backend.

XLA:CPU orders a program's operations with its concurrency-optimized scheduler by default: independent
operations may then run at once on the intra-op thread pool, and their buffers stay alive together. In a
step program that keeps a layer group's float32 temporaries (the dequantized weights of `--quantization gguf`
above the kernel's token bound, each projection's activations) alive at once, so they no longer fit in cache:
a group of 5 SmolLM2 layers at 32 tokens held 71 MB of temporaries against 7 MB with XLA's memory-minimizing
order. With it off, the default model's decode steps took 0.92-0.99x the time, `--quantization gguf` prefill
0.95x and float32 prefill 1.03x (within noise), and XLA's own dequantization (no kernel) 0.1-0.7x (D-49).

The flag is a process-wide debug option (`XLA_FLAGS`), read once when the CPU backend starts; XLA ignores it
as a per-program compile option. So `jaxserve.runner` sets it on import, unless `XLA_FLAGS` names it already
(the user's choice wins). It takes effect when jaxserve is imported before JAX starts its CPU backend, as the
server and the `Engine` do; other backends ignore it.
"""

from __future__ import annotations

import os
from typing import MutableMapping

SCHEDULER_FLAG = "xla_cpu_enable_concurrency_optimized_scheduler"


def configure_scheduler(environ: MutableMapping[str, str] | None = None) -> bool:
    """Append `--xla_cpu_enable_concurrency_optimized_scheduler=false` to `environ["XLA_FLAGS"]` (default
    `os.environ`) unless the flag is named there already. Returns whether it was appended."""
    environ = os.environ if environ is None else environ
    flags = environ.get("XLA_FLAGS", "")
    if SCHEDULER_FLAG in flags:
        return False
    environ["XLA_FLAGS"] = f"{flags} --{SCHEDULER_FLAG}=false".strip()
    return True
