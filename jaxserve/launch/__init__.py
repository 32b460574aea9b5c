"""Start-up: the CLI, the server launch, data parallel behind sglang-router."""
