"""The bound on sequences waiting for a batch slot (`--max-queued-requests`), with batch reservations.

A batch (prompts x n) is admitted whole or not at all: `reserve` takes room for all of it before any
prompt is submitted, and each submit then spends from that reservation. Submitting prompt by prompt
instead queued part of an oversized batch before its last prompt was refused, and for that moment
other clients' requests were refused too. SGLang's scheduler aborts a request beyond
`--max-queued-requests` the same way (one request at a time; it has no batch reservation).
"""

from __future__ import annotations

import dataclasses

# Default bound of the waiting queue: as many requests as the pool could hold at this many tokens
# each (a queue longer than that only adds latency), and never fewer than MIN_DEFAULT_MAX_QUEUED.
TOKENS_PER_QUEUED_REQUEST = 64
MIN_DEFAULT_MAX_QUEUED = 128


def default_max_queued_requests(kv_total_tokens: int) -> int:
    """The waiting-queue bound when --max-queued-requests is not given (requests): the KV pool's
    tokens / TOKENS_PER_QUEUED_REQUEST, at least MIN_DEFAULT_MAX_QUEUED."""
    return max(MIN_DEFAULT_MAX_QUEUED, kv_total_tokens // TOKENS_PER_QUEUED_REQUEST)


@dataclasses.dataclass
class QueueReservation:
    """Room held in the waiting queue for `num_left` more sequences of one batch (`EngineLoop.reserve`).

    Pass it to each `submit` of the batch; `EngineLoop.release` returns what is left unused."""

    num_left: int


class QueueAdmission:
    """Counts the room of the waiting queue: `max_queued_requests` sequences beyond the running slots
    (`max_running_requests`) the next schedule fills, of which `num_reserved` are held for batches
    being submitted. Not thread-safe: the engine loop calls it under its lock."""

    def __init__(self, max_queued_requests: int, max_running_requests: int):
        self.max_queued_requests = max_queued_requests
        self.max_running_requests = max_running_requests
        self.num_reserved = 0
        self.num_rejected = 0  # sequences' requests refused because the queue was full

    def can_ever_fit(self, num_sequences: int) -> bool:
        """Whether a batch fits an idle engine: its running slots plus the waiting queue."""
        return num_sequences <= self.max_queued_requests + self.max_running_requests

    def take(self, num_waiting: int, num_sequences: int, reservation: QueueReservation | None = None,
             num_free_slots: int = 0) -> bool:
        """Take room for `num_sequences` beside `num_waiting` sequences not running, from `reservation`
        when it holds that many. The bound counts what will still wait after the next schedule has
        filled `num_free_slots` running slots. False (a rejection, counted) when there is no room."""
        if reservation is not None and reservation.num_left >= num_sequences:
            reservation.num_left -= num_sequences
            self.num_reserved -= num_sequences
            return True
        if self.num_waiting_after(num_waiting + num_sequences, num_free_slots) > self.max_queued_requests:
            self.num_rejected += 1
            return False
        return True

    def num_waiting_after(self, num_waiting: int, num_free_slots: int) -> int:
        """Sequences left waiting once `num_free_slots` of `num_waiting` (plus those reserved) run."""
        return max(0, num_waiting + self.num_reserved - num_free_slots)

    def reserve(self, num_waiting: int, num_sequences: int, num_free_slots: int = 0) -> QueueReservation | None:
        """Hold room for a batch of `num_sequences`; None (a rejection, counted) when there is none."""
        if not self.take(num_waiting, num_sequences, num_free_slots=num_free_slots):
            return None
        self.num_reserved += num_sequences
        return QueueReservation(num_sequences)

    def release(self, reservation: QueueReservation) -> None:
        self.num_reserved -= reservation.num_left
        reservation.num_left = 0
