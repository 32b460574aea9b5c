"""Quantized weights: block formats kept compressed in memory (formats.py) and the matmul that reads them
(cpu_kernel.py: a C++ kernel through jax.ffi on CPU, an XLA path elsewhere)."""
