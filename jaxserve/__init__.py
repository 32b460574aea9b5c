"""jaxserve: an LLM serving engine in pure JAX/XLA (RadixAttention, paged KV, Pallas kernels).

The package's face, for research code:

    from jaxserve import Engine, EngineLoop, SamplingParams, ServerArgs

    engine = Engine(model_path="default", max_total_tokens=8192)
    engine.generate("The capital of France is", SamplingParams(max_new_tokens=8, temperature=0))

The names are imported on first use, so `python -m jaxserve.launch --help` answers before JAX loads.
"""

import importlib

__version__ = "0.1.0"

_EXPORTS = {
    "Engine": "jaxserve.engine.engine",
    "EngineLoop": "jaxserve.engine.engine_loop",
    "SamplingParams": "jaxserve.core.sampling_params",
    "ServerArgs": "jaxserve.server_args",
}
__all__ = list(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'jaxserve' has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)


def __dir__() -> list[str]:
    return sorted([*globals(), *_EXPORTS])
