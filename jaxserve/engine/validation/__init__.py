"""Checks a request passes before it reaches the scheduler, each run once per request (validator.py):
field types (field_types.py), the seed's range (seed.py), logprob_start_len (logprob_start.py), the KV
pool's bound (pool_limits.py), the size bounds of ids, stop strings, metadata and tools (size_limits.py), with the errors they raise (errors.py), which the server turns into its
400 in one place (server/errors.py). Value ranges of the sampling fields are `SamplingParams.validate`."""
