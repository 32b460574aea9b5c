"""Checks a request passes before it reaches the scheduler (one package: field types, ranges, lengths)."""
