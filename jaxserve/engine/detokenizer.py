"""Incremental detokenization of one request: UTF-8 safe text deltas, stop strings, finish reasons.

The engine makes one `IncrementalDetokenizer` per request and feeds it every sampled token. Each call
returns the text that may be streamed now and whether the request is finished.

Text is produced the way vLLM's `detokenize_incrementally` and SGLang's DetokenizerManager do it: decode
a small window of tokens (a few already-printed "prefix" tokens plus the unprinted ones) and print the
part past the prefix's text, holding it back while it ends with U+FFFD (a character whose bytes are
still arriving). The window restarts after every print, so the work per token is O(window), not
O(length). The window starts with the prompt's last tokens, so a tokenizer that drops a leading space
at the start of a decode (SentencePiece) still prints the first output token's space.

Finish rules (checked in this order on every token; SGLang's names and shapes of finish reasons):
1. A stop token (`stop_token_ids`, or an EOS id unless `ignore_eos`): `finish_stop(id)`.
   Its text is dropped, as SGLang's `trim_matched_stop` does, unless `no_stop_trim` (then it is decoded
   like any token, so a special token still vanishes under `skip_special_tokens`).
2. A stop string in the text: `finish_stop("the string")`. The text is cut where the
   earliest stop string starts, unless `no_stop_trim` (then everything decoded so far is kept, as
   SGLang does). A stop string may span tokens; text that could be the start of a stop string is held
   back until it no longer can match or the request finishes. A `stop_regex` match works the same
   way (`finish_stop("<the pattern>")`, SGLang's FINISHED_MATCHED_REGEX): text from
   the start of a partial match (the `regex` package's `partial=True`: the text so far could still
   grow into a match) is held back, so streamed text is never retracted. A pattern such as `a.*b`
   therefore holds back everything after an `a` until the `b` or the end.
3. `max_new_tokens` reached: `finish_length(max_new_tokens)`.
Rules 1 and 2 apply only once `min_new_tokens` tokens exist (the sampler also bans stop tokens
before that). SGLang checks the length first; stop-first (vLLM's order) reports "stop" and trims the
text when the last allowed token completes a stop string or is EOS.

Decoding uses `clean_up_tokenization_spaces=False`: the clean-up rewrites text around punctuation
depending on what follows, which no incremental decoder can stream consistently.
"""

from __future__ import annotations

from typing import Any, NamedTuple, Sequence

import regex

from jaxserve.core.request import FinishReason, finish_abort, finish_length, finish_stop
from jaxserve.core.sampling_params import SamplingParams

# A stop_regex search runs on the engine's thread once per token; a pattern that backtracks
# catastrophically ("(a|aa)+c" over "aaaa...") took tens of seconds per search and stalled every request.
# Each search is bounded by this (the `regex` package's timeout); one over it ends its own request with
# an abort naming the pattern (status 400: the pattern, not the server, is at fault).
STOP_REGEX_SEARCH_TIMEOUT_S = 0.05


REPLACEMENT_CHAR = "\ufffd"
# Prompt tokens decoded ahead of the output (SGLang's INIT_INCREMENTAL_DETOKENIZATION_OFFSET).
NUM_CONTEXT_TOKENS = 5
# Unprinted tokens after which a window that keeps ending in U+FFFD (invalid bytes, not a character
# still arriving) prints the part that later bytes can no longer change.
MAX_PENDING_TOKENS = 4
# A UTF-8 decoder settles a character once 3 more bytes follow it (sequences are at most 4 bytes).
_SETTLE_CHARS = 3
_MAX_SETTLE_TRIES = 4


class DetokenizeResult(NamedTuple):
    """Result of one `append`: text to stream now, and whether (and why) the request finished."""

    text_delta: str
    finished: bool
    finish_reason: FinishReason | None


class IncrementalDetokenizer:
    """Turns one request's output tokens into streamed text and decides when it stops (host side).

    Invariant: the concatenation of all `text_delta`s equals `text`. For a byte-level BPE tokenizer it
    also equals `tokenizer.decode(output_ids, skip_special_tokens=..., clean_up_tokenization_spaces=False)`
    with the stop token or stop string trimmed as described in the module docstring.

    Args:
        tokenizer: a transformers tokenizer (only `decode` is used).
        prompt_ids: the prompt's token ids (its last few give the decode context).
        params: the request's sampling parameters (stop, stop_token_ids, ignore_eos, min/max_new_tokens,
            stop_regex, skip_special_tokens, spaces_between_special_tokens, no_stop_trim).
        eos_token_ids: the model's EOS ids; they stop the request unless `params.ignore_eos`.

    A request with `max_new_tokens == 0` is finished from the start (see `finish_without_tokens`).
    """

    def __init__(
        self, tokenizer: Any, prompt_ids: Sequence[int], params: SamplingParams, eos_token_ids: Sequence[int]
    ):
        self._tokenizer = tokenizer
        self._params = params
        eos = () if params.ignore_eos else tuple(eos_token_ids)
        self._stop_token_ids = frozenset(map(int, params.stop_token_ids + eos))
        self._stops = tuple(params.stop)
        self._max_stop_len = max((len(s) for s in self._stops), default=0)
        self._stop_regexes = tuple((p, regex.compile(p)) for p in params.stop_regex)
        # fast tokenizers ignore the flag; pass it only when it differs from decode's default
        self._decode_kwargs = {} if params.spaces_between_special_tokens else {"spaces_between_special_tokens": False}

        # Tokens [0, read_offset) of the window are printed context; [read_offset, end) are not yet.
        self._window = [int(t) for t in list(prompt_ids)[-NUM_CONTEXT_TOKENS:]]
        self._read_offset = len(self._window)
        self._prefix_text = self._decode(self._window)
        self._held = ""  # decoded text not yet streamed because it may be the start of a stop string
        self._pieces: list[str] = []
        self._text_cache: str | None = ""
        self._num_tokens = 0
        self._finish_reason = finish_length(0) if params.max_new_tokens == 0 else None

    @staticmethod
    def finish_without_tokens(params: SamplingParams) -> DetokenizeResult | None:
        """The result of a request that must not generate any token (`max_new_tokens == 0`), else None."""
        if params.max_new_tokens == 0:
            return DetokenizeResult("", True, finish_length(0))
        return None

    @property
    def text(self) -> str:
        """The output text streamed so far (the final, trimmed text once finished)."""
        if self._text_cache is None:
            self._text_cache = "".join(self._pieces)
        return self._text_cache

    @property
    def num_tokens(self) -> int:
        """Output tokens appended so far (including a stop token)."""
        return self._num_tokens

    @property
    def finished(self) -> bool:
        return self._finish_reason is not None

    @property
    def finish_reason(self) -> FinishReason | None:
        return self._finish_reason

    def append(self, token_id: int) -> DetokenizeResult:
        """Add one sampled token; return the text that can be streamed now and the finish state.

        Raises:
            RuntimeError: the request is already finished.
        """
        if self.finished:
            raise RuntimeError(f"append after the request finished ({self._finish_reason})")
        token_id = int(token_id)
        params = self._params
        self._num_tokens += 1
        can_stop = self._num_tokens >= params.min_new_tokens

        if can_stop and token_id in self._stop_token_ids:
            if params.no_stop_trim:
                self._window.append(token_id)
            printed, _ = self._decode_step(flush=True)
            return self._finish(self._held + printed, finish_stop(token_id))

        self._window.append(token_id)
        at_length = self._num_tokens >= params.max_new_tokens
        printed, unsettled = self._decode_step(flush=at_length)
        text = self._held + printed
        if can_stop and (self._stops or self._stop_regexes):
            # Also search the unsettled tail (it may end in U+FFFD) so a stop string is caught on the
            # token that completes it, as SGLang's tail check does.
            candidate = text + unsettled
            match = self._find_stop(candidate, len(self._held))
            try:
                regex_match = self._find_stop_regex(candidate)
            except StopRegexTimeout as e:
                return self._finish(text, finish_abort(str(e), status_code=400))
            if regex_match is not None and (match is None or regex_match[0] < match[0]):
                match = regex_match
            if match is not None:
                start, stop = match
                return self._finish(candidate if params.no_stop_trim else candidate[:start], finish_stop(stop))
        if at_length:
            return self._finish(text, finish_length(params.max_new_tokens))

        try:
            hold = max(self._stop_prefix_len(text), self._regex_prefix_len(text))
        except StopRegexTimeout as e:
            return self._finish(text, finish_abort(str(e), status_code=400))
        self._held = text[len(text) - hold :]
        return self._emit(text[: len(text) - hold], None)

    def finish(self, finish_reason: FinishReason) -> DetokenizeResult:
        """Finish now for a reason found outside (abort, grammar end): print everything held back.

        Raises:
            RuntimeError: the request is already finished.
        """
        if self.finished:
            raise RuntimeError(f"finish after the request finished ({self._finish_reason})")
        printed, _ = self._decode_step(flush=True)
        return self._finish(self._held + printed, finish_reason)

    def _decode(self, ids: Sequence[int]) -> str:
        return self._tokenizer.decode(
            ids, skip_special_tokens=self._params.skip_special_tokens, clean_up_tokenization_spaces=False,
            **self._decode_kwargs,
        )

    def _decode_step(self, flush: bool) -> tuple[str, str]:
        """Decode the window. Returns (text printable now, text decoded but not settled yet).

        `flush` settles everything, U+FFFD included (the request is finishing)."""
        full = self._decode(self._window)
        new = full[len(self._prefix_text) :]
        if flush or (new and not new.endswith(REPLACEMENT_CHAR)) or full == self._prefix_text:
            self._advance(len(self._window))
            return new, ""
        if len(self._window) - self._read_offset >= MAX_PENDING_TOKENS:
            settled = self._settle_prefix(full)
            if settled is not None:
                return settled
        return "", new

    def _settle_prefix(self, full: str) -> tuple[str, str] | None:
        """Print what later tokens can no longer change when the window keeps ending in U+FFFD.

        Invalid bytes (not a character still arriving) would otherwise hold the window open forever.
        Looks for the largest k such that the decode of window[:k] is a prefix of the full decode
        followed by at least `_SETTLE_CHARS` more characters, hence >= 3 more bytes, after which every
        character before the cut is final. Returns (settled text, unsettled rest), or None if no such k
        turns up within a few tries.
        """
        end = len(self._window)
        for k in range(end - 1, max(self._read_offset, end - 1 - _MAX_SETTLE_TRIES), -1):
            head = self._decode(self._window[:k])
            if (
                len(head) >= len(self._prefix_text)
                and len(full) - len(head) >= _SETTLE_CHARS
                and full.startswith(head)
            ):
                settled = head[len(self._prefix_text) :]
                self._advance(k)
                return settled, full[len(head) :]
        return None

    def _advance(self, end: int) -> None:
        """Mark window[:end] printed. The next window keeps the previously unprinted tokens up to `end`
        as its prefix (vLLM's prefix_offset moves to the old read_offset)."""
        old_read = self._read_offset
        self._window = self._window[old_read:]
        self._read_offset = end - old_read
        self._prefix_text = self._decode(self._window[: self._read_offset])

    def _find_stop(self, text: str, new_from: int) -> tuple[int, str] | None:
        """Earliest stop string in `text` that ends past `new_from` (older text was searched before)."""
        best: tuple[int, str] | None = None
        for stop in self._stops:
            start = text.find(stop, max(0, new_from - len(stop) + 1))
            if start != -1 and (best is None or start < best[0]):
                best = (start, stop)
        return best

    def _find_stop_regex(self, text: str) -> tuple[int, str] | None:
        """Earliest complete stop_regex match in `text` (held-back and new text only: any earlier
        start of a match was held back, see `_regex_prefix_len`): (start, pattern)."""
        best: tuple[int, str] | None = None
        for pattern, compiled in self._stop_regexes:
            m = _bounded_search(pattern, compiled, text, partial=False)
            if m is not None and (best is None or m.start() < best[0]):
                best = (m.start(), pattern)
        return best

    def _regex_prefix_len(self, text: str) -> int:
        """Length of the suffix of `text` from the earliest partial stop_regex match on."""
        starts = [m.start() for p, c in self._stop_regexes if (m := _bounded_search(p, c, text, partial=True)) is not None]
        return len(text) - min(starts) if starts else 0

    def _stop_prefix_len(self, text: str) -> int:
        """Length of the longest suffix of `text` that is a proper prefix of some stop string."""
        for length in range(min(len(text), self._max_stop_len - 1), 0, -1):
            suffix = text[-length:]
            if any(stop.startswith(suffix) for stop in self._stops):
                return length
        return 0

    def _finish(self, text: str, finish_reason: FinishReason) -> DetokenizeResult:
        self._finish_reason = finish_reason
        self._held = ""
        return self._emit(text, finish_reason)

    def _emit(self, text: str, finish_reason: FinishReason | None) -> DetokenizeResult:
        if text:
            self._pieces.append(text)
            self._text_cache = None
        return DetokenizeResult(text, finish_reason is not None, finish_reason)


class StopRegexTimeout(Exception):
    """A stop_regex search took over `STOP_REGEX_SEARCH_TIMEOUT_S` (the message names the pattern)."""


def _bounded_search(pattern: str, compiled: Any, text: str, partial: bool):
    """`compiled.search(text)` within `STOP_REGEX_SEARCH_TIMEOUT_S`; StopRegexTimeout past it."""
    try:
        return compiled.search(text, partial=partial, timeout=STOP_REGEX_SEARCH_TIMEOUT_S)
    except TimeoutError:
        raise StopRegexTimeout(
            f"stop_regex {pattern!r} took over {STOP_REGEX_SEARCH_TIMEOUT_S * 1000:g} ms to search "
            f"{len(text)} characters of output (it backtracks catastrophically); the request is stopped") from None
