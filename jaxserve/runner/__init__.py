"""The model runner (the only jit boundary: forward, sampling, page copies) and its shape buckets."""
