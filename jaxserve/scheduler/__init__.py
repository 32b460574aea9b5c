"""Scheduling: the waiting and running queues, the schedule policy, the prefill adder and budget, the cache manager (radix tree <-> pages)."""
