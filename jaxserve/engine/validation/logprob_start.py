"""SGLang's rule for `logprob_start_len`, the first prompt position whose logprob is returned.

SGLang 0.5.23 (`Scheduler.handle_generate_request`): the field matters only when logprobs are asked
for; then -1 means no prompt positions, a value past the prompt's length is refused, and the
prompt's length itself gives no positions (`input_token_logprobs: []`). Values below -1 have no
meaning in SGLang and are refused here. The request's one check (check.py) calls it, on either path.
"""

from __future__ import annotations

from jaxserve.core.errors import RequestError


def is_checked(return_logprob: bool, top_logprobs_num: int) -> bool:
    """Whether `logprob_start_len` matters (and is checked): logprobs are asked for. SGLang ignores
    the field otherwise; jaxserve's `top_logprobs_num` > 0 asks for logprobs on its own."""
    return bool(return_logprob) or top_logprobs_num > 0


def check_logprob_start_len(logprob_start_len: int, num_prompt_tokens: int) -> None:
    """-1 (no prompt logprobs) or a prompt position 0..num_prompt_tokens (tokens).

    Raises:
        RequestError: field `logprob_start_len`: not an integer, below -1, or past the prompt (the
            message gives the prompt's length in tokens).
    """
    if not isinstance(logprob_start_len, int) or isinstance(logprob_start_len, bool):
        raise RequestError("logprob_start_len", f"logprob_start_len: must be an integer, got {logprob_start_len!r}")
    if logprob_start_len < -1:
        raise RequestError("logprob_start_len",
                           f"logprob_start_len: must be -1 (no prompt logprobs) or >= 0, got {logprob_start_len}")
    if logprob_start_len > num_prompt_tokens:
        raise RequestError(
            "logprob_start_len",
            f"logprob_start_len: {logprob_start_len} is past the end of the prompt, which has {num_prompt_tokens} "
            f"tokens (at most {num_prompt_tokens}; -1: no prompt logprobs)",
        )
