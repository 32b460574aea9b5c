"""The raw bytes of single tokens, for logprobs' `bytes` fields and token strings.

A token of a byte-level BPE (GPT-2, SmolLM2) or byte-fallback (SentencePiece: Llama, Gemma) vocabulary
can hold part of a UTF-8 character; decoding it alone gives U+FFFD, whose bytes (239, 191, 189) say
nothing. llguidance's tokenizer keeps every token's bytes (built from the tokenizer's own vocabulary and
decoder, ~0.25 s for SmolLM2's 49k tokens), so a client can rebuild the characters from them.
"""

from __future__ import annotations

import functools
import logging
from typing import Any

logger = logging.getLogger(__name__)


class TokenBytes:
    """Bytes and display strings of single tokens of one tokenizer (thread-safe: read-only after init).

    Args:
        tokenizer: a transformers fast tokenizer.

    Raises:
        ValueError: a tokenizer llguidance cannot wrap (slow tokenizers); use `token_bytes_of`, which
            then falls back to each token's decoded text.
    """

    def __init__(self, tokenizer: Any):
        import llguidance.hf

        self._tokenizer = tokenizer
        self._ll_tokenizer = llguidance.hf.from_tokenizer(tokenizer)

    def bytes(self, token_id: int) -> bytes:
        """The token's bytes; its decoded text's UTF-8 for special tokens and ids past the vocabulary."""
        if 0 <= token_id < self._ll_tokenizer.vocab_size and not self._ll_tokenizer.is_special_token(token_id):
            return self._ll_tokenizer.decode_bytes([token_id])
        return self._tokenizer.decode([token_id]).encode()

    def text(self, token_id: int) -> str:
        """The token as a string: its text when its bytes are whole UTF-8, else OpenAI's fallback
        "bytes:" followed by the bytes with every invalid one escaped ("bytes: \\xf0\\x9f\\x98")."""
        raw = self.bytes(token_id)
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            return "bytes:" + raw.decode("utf-8", "backslashreplace")


class _DecodedTokenBytes(TokenBytes):
    """The fallback for tokenizers llguidance cannot wrap: each token's decoded text."""

    def __init__(self, tokenizer: Any):
        self._tokenizer = tokenizer

    def bytes(self, token_id: int) -> bytes:
        return self._tokenizer.decode([token_id]).encode()


@functools.lru_cache(maxsize=4)
def token_bytes_of(tokenizer: Any) -> TokenBytes:
    """The (cached) `TokenBytes` of a tokenizer; each token's decoded text where llguidance cannot wrap it."""
    try:
        return TokenBytes(tokenizer)
    except Exception as e:  # slow or custom tokenizers: the decoded text is the best there is
        logger.warning("logprobs' token bytes are each token's decoded text: llguidance cannot read the "
                       "tokenizer's vocabulary (%s: %s)", type(e).__name__, e)
        return _DecodedTokenBytes(tokenizer)
