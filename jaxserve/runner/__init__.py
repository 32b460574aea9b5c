"""The model runner (the only jit boundary: forward, sampling, page copies) and its shape buckets.

On import it sets XLA:CPU's scheduler for the step programs (`xla_cpu`, D-49), which must happen before jax
creates its CPU backend.
"""

from jaxserve.runner.xla_cpu import configure_scheduler

configure_scheduler()
