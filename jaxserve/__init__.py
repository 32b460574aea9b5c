"""jaxserve: an LLM serving engine in pure JAX/XLA (RadixAttention, paged KV, Pallas kernels)."""

__version__ = "0.1.0"
