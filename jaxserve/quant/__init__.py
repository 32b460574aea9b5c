"""Quantized weights: block formats kept compressed in memory (formats.py) and the matmul that reads them
(cpu_kernel.py: a C++ kernel through jax.ffi on CPU, pallas_matmul.py's Pallas kernel on GPU, an XLA path
elsewhere)."""
