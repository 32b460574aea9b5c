"""Batched sampling: penalties, grammar bitmask, temperature, top-k / top-p / min-p, logprobs.

`sample` is a pure function of device arrays: the model runner jits it with `SamplerFlags` static and
calls it once per step on the logits [S, V] of the step's sequences. `build_sampling_batch` builds its
inputs on the host (numpy, padded to the sequence bucket S) from each request's `SamplingParams`.

The order of the logit transforms follows vLLM and SGLang: penalties (repetition, then frequency and
presence) -> logit bias (OpenAI's `logit_bias`, a padded sparse add) -> bitmask (disallowed tokens get -inf) -> temperature -> top-k -> top-p (over the top-k
renormalised probabilities, as vLLM and Hugging Face do) -> min-p (relative to the largest probability)
-> draw. Rows with temperature 0 take the argmax of the penalised, masked logits.

Two choices keep this cheap on CPU, where XLA's sort costs ~50 ms per 49k-token row:
- Top-k and top-p find their cut-off with a bisection over the float32 bit patterns of the weights
  `exp(logit - max)` (31 masked counts / sums per row) instead of sorting. The kept set is exact up to
  ties: tokens whose weight equals the cut-off are all kept.
- The draw inverts the CDF with one uniform number per row (as FlashInfer's samplers do) over block
  sums, instead of one Gumbel number per token. Randomness is per row: the key is
  `fold_in(fold_in(key(0), seed), step)`, so a seeded request draws the same tokens alone, in any
  batch, at any row and in any bucket S.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Bool, Float, Int32, UInt32

from jaxserve.core.sampling_params import MAX_LOGIT_BIAS_ENTRIES, SamplingParams

# SGLang treats temperatures below this as greedy (`_SAMPLING_EPS` in its sampling_params.py).
SAMPLING_EPS = 1e-6
FLOAT32_MAX = float(np.finfo(np.float32).max)
# Block length of the two-level inverse-CDF draw: V / CDF_BLOCK block sums, then one block.
CDF_BLOCK = 256
MIN_HISTORY_LEN = 16


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SamplingBatch:
    """Per-sequence sampling inputs of one step (S = sequence bucket; padding rows are greedy, unfiltered).

    Fields:
        temperature: [S] 0 means greedy (argmax).
        top_p: [S] 1 disables. top_k: [S] V disables (the builder maps -1 to V). min_p: [S] 0 disables.
        frequency_penalty, presence_penalty: [S] subtracted per occurrence / once, over output tokens.
        repetition_penalty: [S] 1 disables; divides positive and multiplies negative logits of every
            token seen in the prompt or the output.
        seed: [S] uint32 per-request seed. step: [S] index of the token being sampled (0 = first output).
        bitmask: [S, W] int32, W = ceil(V / 32) (or 1 when `use_bitmask` is off): bit `v % 32` of word
            `v // 32` set means token v is allowed; -1 words allow everything.
        token_history: [S, H] prompt + output token ids for the penalties, padded with -1 (H = 1 when
            `use_penalties` is off).
        history_is_output: [S, H] True where the history token is a generated token.
        logprob_token_ids: [S, L] token ids whose logprobs are returned (SGLang's `token_ids_logprob`),
            padded with 0 (L = 1 when `num_logprob_token_ids` is 0).
        logit_bias_ids, logit_bias_values: [S, B] token ids and the biases added to their logits,
            padded with (0, 0.0); B = MAX_LOGIT_BIAS_ENTRIES (300) when `use_logit_bias`, else 1.
    """

    temperature: Float[Array, " S"]
    top_p: Float[Array, " S"]
    top_k: Int32[Array, " S"]
    min_p: Float[Array, " S"]
    frequency_penalty: Float[Array, " S"]
    presence_penalty: Float[Array, " S"]
    repetition_penalty: Float[Array, " S"]
    seed: UInt32[Array, " S"]
    step: Int32[Array, " S"]
    bitmask: Int32[Array, "S W"]
    token_history: Int32[Array, "S H"]
    history_is_output: Bool[Array, "S H"]
    logprob_token_ids: Int32[Array, "S L"]
    logit_bias_ids: Int32[Array, "S B"]
    logit_bias_values: Float[Array, "S B"]


@dataclasses.dataclass(frozen=True)
class SamplerFlags:
    """Static switches of `sample` (hashable: a static jit argument). Each skips work when off.

    Fields:
        all_greedy: every row is greedy: no randomness and no filters, only argmax.
        use_top_k / use_top_p: some row has top_k < V / top_p < 1 (a bisection per filter).
        use_penalties: some row has a frequency, presence or repetition penalty.
        use_bitmask: some row is constrained (grammar, min_new_tokens); else `bitmask` is ignored.
        use_logit_bias: some row has a logit_bias; else the bias arrays are ignored.
        return_logprob: compute the chosen tokens' logprobs.
        num_top_logprobs: also return the N most likely tokens per row (needs `return_logprob`).
        num_logprob_token_ids: also return the logprobs of `logprob_token_ids` (its width L; needs
            `return_logprob`).

    Min-p needs no flag: it is one comparison, applied whenever some row samples.

    Raises:
        ValueError: num_top_logprobs < 0, or > 0 without return_logprob.
    """

    all_greedy: bool = True
    use_top_k: bool = False
    use_top_p: bool = False
    use_penalties: bool = False
    use_bitmask: bool = False
    use_logit_bias: bool = False
    return_logprob: bool = False
    num_top_logprobs: int = 0
    num_logprob_token_ids: int = 0

    def __post_init__(self) -> None:
        if self.num_top_logprobs < 0:
            raise ValueError(f"num_top_logprobs must be >= 0, got {self.num_top_logprobs}")
        if self.num_top_logprobs > 0 and not self.return_logprob:
            raise ValueError("num_top_logprobs > 0 needs return_logprob=True")
        if self.num_logprob_token_ids < 0 or (self.num_logprob_token_ids > 0 and not self.return_logprob):
            raise ValueError(f"num_logprob_token_ids must be >= 0 and needs return_logprob, got {self.num_logprob_token_ids}")


class SampleOutput(NamedTuple):
    """What `sample` returns (K = `num_top_logprobs`).

    Fields:
        next_tokens: [S] sampled token ids.
        logprobs: [S] log-softmax of the RAW logits (before penalties, bitmask and temperature, as
            SGLang returns by default) at `next_tokens`; zeros when `return_logprob` is off.
        top_ids: [S, K] the K most likely tokens under the same raw distribution, most likely first.
        top_logprobs: [S, K] their logprobs.
        token_ids_logprobs: [S, L] logprobs of `batch.logprob_token_ids` (L = `num_logprob_token_ids`).
    """

    next_tokens: Int32[Array, " S"]
    logprobs: Float[Array, " S"]
    top_ids: Int32[Array, "S K"]
    top_logprobs: Float[Array, "S K"]
    token_ids_logprobs: Float[Array, "S L"]


def sample(logits: Float[Array, "S V"], batch: SamplingBatch, flags: SamplerFlags) -> SampleOutput:
    """Pick one token per row. Pure; jit it with `flags` static.

    Args:
        logits: [S, V] next-token logits (any float dtype; computed in float32).
        batch: the step's `SamplingBatch` (device arrays of bucket S).
        flags: which stages run.

    Returns:
        `SampleOutput`. A row whose bitmask allows no token falls back to its argmax (token 0 when every
        logit is -inf).
    """
    logits = logits.astype(jnp.float32)
    x = logits
    if flags.use_penalties:
        x = apply_penalties(x, batch)
    if flags.use_logit_bias:
        x = apply_logit_bias(x, batch.logit_bias_ids, batch.logit_bias_values)
    if flags.use_bitmask:
        x = jnp.where(unpack_bitmask(batch.bitmask, x.shape[1]), x, -jnp.inf)
    greedy_tokens = first_argmax(x)
    if flags.all_greedy:
        next_tokens = greedy_tokens
    else:
        next_tokens = _sample_rows(x, batch, flags, greedy_tokens)
    return _logprob_outputs(logits, next_tokens, batch.logprob_token_ids, flags)


def first_argmax(x: Float[Array, "S V"]) -> Int32[Array, " S"]:
    """`jnp.argmax(x, axis=-1)` exactly (the first maximum; the first NaN where a row has one), as a max
    and a min over an index iota. XLA:CPU runs argmax as one (value, index) reduction that it does
    not vectorize: over SmolLM2's 49,152-token vocabulary it took 0.29 ms for 1 row, 1.86 ms for 16
    and 7.2 ms for 64, this 0.07, 0.41 and 2.4 ms (D-18)."""
    vocab_size = x.shape[-1]
    row_max = jnp.max(x, axis=-1, keepdims=True)  # XLA:CPU's vectorized max may skip a NaN
    iota = jax.lax.broadcasted_iota(jnp.int32, x.shape, x.ndim - 1)
    # NaNs rank below every maximum (index - V < 0), so the first NaN wins where a row has one
    first = jnp.min(jnp.where(jnp.isnan(x), iota - vocab_size, jnp.where(x == row_max, iota, vocab_size)), axis=-1)
    return jnp.where(first < 0, first + vocab_size, first)


def apply_penalties(logits: Float[Array, "S V"], batch: SamplingBatch) -> Float[Array, "S V"]:
    """Repetition (prompt + output), then frequency and presence (output only) penalties, as vLLM.

    Repetition penalty r: a seen token's logit l becomes l / r if l > 0 else l * r (CTRL paper,
    arXiv:1909.05858). Frequency f and presence p: l - f * count - p * (count > 0).
    """
    num_seqs, vocab_size = logits.shape
    history = batch.token_history
    valid = history >= 0
    ids = jnp.where(valid, history, vocab_size)  # -1 would wrap to V - 1; V is dropped by the scatters
    rows = jnp.arange(num_seqs)[:, None]
    # a bool [S, V] (a quarter of a float32 one): each [S, V] temporary is 8 MiB at S = 8 over a
    # 262,144-token vocabulary, and 32 MiB of them made glibc map the sampler's buffer afresh each call
    seen = jnp.zeros((num_seqs, vocab_size), bool).at[rows, ids].set(True, mode="drop")
    output_counts = jnp.zeros((num_seqs, vocab_size), jnp.float32).at[rows, ids].add(
        batch.history_is_output.astype(jnp.float32), mode="drop")

    rep = batch.repetition_penalty[:, None]
    logits = jnp.where(seen, jnp.where(logits > 0, logits / rep, logits * rep), logits)
    logits = logits - batch.frequency_penalty[:, None] * output_counts
    return logits - batch.presence_penalty[:, None] * (output_counts > 0)


def apply_logit_bias(
    logits: Float[Array, "S V"], ids: Int32[Array, "S B"], values: Float[Array, "S B"]
) -> Float[Array, "S V"]:
    """logits[s, ids[s, b]] += values[s, b]: OpenAI's logit_bias as one fixed-size scatter-add, so any
    request's bias (up to B entries; padding adds 0.0 to token 0) runs in the same compiled sampler."""
    rows = jnp.arange(logits.shape[0])[:, None]
    return logits.at[rows, ids].add(values)


def unpack_bitmask(bitmask: Int32[Array, "S W"], vocab_size: int) -> Bool[Array, "S V"]:
    """[S, ceil(V/32)] int32 words -> [S, V] bool: token v is allowed iff bit v % 32 of word v // 32 is set."""
    shifts = jnp.arange(32, dtype=jnp.int32)
    bits = (bitmask[:, :, None] >> shifts) & 1  # arithmetic shift is fine: only bit 0 is kept
    return bits.reshape(bitmask.shape[0], -1)[:, :vocab_size].astype(bool)


def _sample_rows(
    x: Float[Array, "S V"], batch: SamplingBatch, flags: SamplerFlags, greedy_tokens: Int32[Array, " S"]
) -> Int32[Array, " S"]:
    is_greedy = batch.temperature <= 0
    temperature = jnp.where(is_greedy, 1.0, batch.temperature)
    scaled = x / temperature[:, None]
    row_max = jnp.max(scaled, axis=-1, keepdims=True)
    row_max = jnp.where(jnp.isfinite(row_max), row_max, 0.0)
    # Unnormalised probabilities in [0, 1]; the largest is exactly 1, masked tokens exactly 0.
    weights = jnp.exp(scaled - row_max)
    if flags.use_top_k:
        weights = _top_k_filter(weights, batch.top_k)
    if flags.use_top_p:
        weights = _top_p_filter(weights, batch.top_p)
    # min-p keeps p >= min_p * p_max; p_max is weight 1 (top-k/top-p always keep the top token).
    weights = jnp.where(weights >= batch.min_p[:, None], weights, 0.0)

    uniform = jax.vmap(lambda k: jax.random.uniform(k, (), jnp.float32))(row_keys(batch.seed, batch.step))
    sampled, has_mass = _inverse_cdf(weights, uniform)
    return jnp.where(is_greedy | ~has_mass, greedy_tokens, sampled)


def row_keys(seed: UInt32[Array, " S"], step: Int32[Array, " S"]) -> Array:
    """[S] typed PRNG keys `fold_in(fold_in(key(0), seed), step)`: a row's randomness depends only on
    its own seed and step, never on the batch around it."""
    base = jax.random.key(0)
    return jax.vmap(lambda s, t: jax.random.fold_in(jax.random.fold_in(base, s), t))(seed, step)


def _bisect_threshold(num_seqs: int, predicate) -> Float[Array, " S"]:
    """Largest float32 t in [0, 1] with predicate(t) true, given predicate(0) is true and predicate is
    monotone (true up to some point, false after). Bisects over bit patterns, which order like the
    values for non-negative floats, so the answer is exact after 31 halvings of [0, bits(1.0) + 1)."""
    lo = jnp.zeros((num_seqs,), jnp.int32)
    hi = jnp.full((num_seqs,), 0x3F800001, jnp.int32)

    def body(_, carry):
        lo, hi = carry
        mid = lo + (hi - lo) // 2
        ok = predicate(jax.lax.bitcast_convert_type(mid, jnp.float32)[:, None])
        return jnp.where(ok, mid, lo), jnp.where(ok, hi, mid)

    lo, _ = jax.lax.fori_loop(0, 31, body, (lo, hi))
    return jax.lax.bitcast_convert_type(lo, jnp.float32)


def _top_k_filter(weights: Float[Array, "S V"], top_k: Int32[Array, " S"]) -> Float[Array, "S V"]:
    """Zero all but the top_k largest weights of each row (ties with the k-th are kept)."""
    kth = _bisect_threshold(weights.shape[0], lambda t: jnp.sum(weights >= t, axis=-1) >= top_k)
    return jnp.where(weights >= kth[:, None], weights, 0.0)


def _top_p_filter(weights: Float[Array, "S V"], top_p: Float[Array, " S"]) -> Float[Array, "S V"]:
    """Keep the smallest set of most likely tokens whose probability mass reaches top_p (nucleus
    sampling, arXiv:1904.09751); the mass is over the current (e.g. top-k filtered) weights."""
    target = top_p * jnp.sum(weights, axis=-1)
    cut = _bisect_threshold(
        weights.shape[0], lambda t: jnp.sum(jnp.where(weights >= t, weights, 0.0), axis=-1) >= target
    )
    keep = (weights >= cut[:, None]) | (top_p >= 1.0)[:, None]
    return jnp.where(keep, weights, 0.0)


def _inverse_cdf(
    weights: Float[Array, "S V"], uniform: Float[Array, " S"]
) -> tuple[Int32[Array, " S"], Bool[Array, " S"]]:
    """Draw token i with probability weights[i] / sum(weights) by inverting the CDF at `uniform`.

    Two levels (block sums, then one block) instead of a full [S, V] cumsum. Only a token with positive
    weight is ever returned. Also returns whether the row has any mass.
    """
    num_seqs, vocab_size = weights.shape
    num_blocks = -(-vocab_size // CDF_BLOCK)
    padded = jnp.pad(weights, ((0, 0), (0, num_blocks * CDF_BLOCK - vocab_size)))
    blocks = padded.reshape(num_seqs, num_blocks, CDF_BLOCK)

    block_sums = jnp.sum(blocks, axis=-1)  # [S, NB]
    block_cdf = jnp.cumsum(block_sums, axis=-1)
    total = block_cdf[:, -1]
    target = uniform * total
    block_idx = _first_above(block_cdf, target, block_sums > 0)
    below = jnp.take_along_axis(block_cdf - block_sums, block_idx[:, None], axis=-1)[:, 0]

    block = jnp.take_along_axis(blocks, block_idx[:, None, None], axis=1)[:, 0]  # [S, B]
    inner_idx = _first_above(jnp.cumsum(block, axis=-1), target - below, block > 0)
    return block_idx * CDF_BLOCK + inner_idx, total > 0


def _first_above(
    cdf: Float[Array, "S N"], target: Float[Array, " S"], positive: Bool[Array, "S N"]
) -> Int32[Array, " S"]:
    """First index whose cdf exceeds target, clamped to the indices with positive mass: rounding can
    put target before the first or past the last of them (0 if the row has no mass)."""
    n = cdf.shape[1]
    idx = jnp.sum(cdf <= target[:, None], axis=-1).astype(jnp.int32)
    first_positive = jnp.argmax(positive, axis=-1).astype(jnp.int32)
    last_positive = n - 1 - jnp.argmax(positive[:, ::-1], axis=-1).astype(jnp.int32)
    return jnp.clip(idx, first_positive, last_positive)


def _logprob_outputs(
    logits: Float[Array, "S V"], next_tokens: Int32[Array, " S"], token_ids: Int32[Array, "S L"], flags: SamplerFlags
) -> SampleOutput:
    num_seqs = logits.shape[0]
    k = flags.num_top_logprobs
    if not flags.return_logprob:
        return SampleOutput(
            next_tokens,
            jnp.zeros((num_seqs,), jnp.float32),
            jnp.zeros((num_seqs, 0), jnp.int32),
            jnp.zeros((num_seqs, 0), jnp.float32),
            jnp.zeros((num_seqs, 0), jnp.float32),
        )
    # log-softmax at the few ids asked for, never over the whole [S, V] row: the same operations as
    # `jax.nn.log_softmax` ((x - max) - log(sum(exp(x - max)))), one fewer [S, V] buffer; with it,
    # a 262,144-token vocabulary at S = 8 pushed the sampler's temporaries to 32 MiB, glibc's mmap
    # threshold, and each call then page-faulted them in afresh (benchmarks/model/bench_sampler.py)
    row_max = jnp.max(logits, axis=-1, keepdims=True)
    log_sum = jnp.log(jnp.sum(jnp.exp(logits - row_max), axis=-1, keepdims=True))

    def log_softmax_at(ids: Int32[Array, "S N"]) -> Float[Array, "S N"]:
        return (jnp.take_along_axis(logits, ids, axis=-1) - row_max) - log_sum

    chosen = log_softmax_at(next_tokens[:, None])[:, 0]
    if k > 0:
        # the k largest logits are the k largest logprobs (a shift per row); among logprobs that round
        # to the same value the larger logit comes first
        _, top_ids = jax.lax.top_k(logits, k)
        top_ids = top_ids.astype(jnp.int32)
        top_logprobs = log_softmax_at(top_ids)
    else:
        top_logprobs, top_ids = jnp.zeros((num_seqs, 0), jnp.float32), jnp.zeros((num_seqs, 0), jnp.int32)
    if flags.num_logprob_token_ids > 0:
        picked = log_softmax_at(token_ids)
    else:
        picked = jnp.zeros((num_seqs, 0), jnp.float32)
    return SampleOutput(next_tokens, chosen, top_ids, top_logprobs, picked)


def bitmask_width(vocab_size: int) -> int:
    """Number of int32 words of a bitmask row: ceil(vocab_size / 32)."""
    return -(-vocab_size // 32)


def build_sampling_batch(
    params: Sequence[SamplingParams],
    seeds: Sequence[int],
    steps: Sequence[int],
    histories: Sequence[tuple[Sequence[int], int]] | None,
    bitmask: np.ndarray | None,
    num_seqs: int,
    vocab_size: int,
    *,
    eos_token_ids: Sequence[int] = (),
    return_logprob: bool = False,
    num_top_logprobs: int = 0,
    logprob_token_ids: Sequence[Sequence[int]] | None = None,
) -> tuple[SamplingBatch, SamplerFlags]:
    """Build the host-side (numpy) `SamplingBatch` of one step and its `SamplerFlags`.

    Rows [len(params), num_seqs) are padding: greedy, unfiltered, unconstrained.

    Args:
        params: one `SamplingParams` per real row.
        seeds: per-request seeds (any int; reduced mod 2**32).
        steps: per-request index of the token being sampled (= tokens generated so far).
        histories: per request (prompt + output token ids, number of prompt tokens); read only when
            some row has a penalty, and then required. H = next power of two of the longest, >= 16.
        bitmask: int32 [>= len(params), ceil(V/32)] grammar bitmask (rows of unconstrained requests
            all -1), or None. Copied, never modified.
        num_seqs: the bucket S (>= len(params)).
        vocab_size: V, the width of the logits.
        eos_token_ids: banned, with each request's `stop_token_ids`, while `step < min_new_tokens`
            (EOS only unless `ignore_eos`), as vLLM's and SGLang's min-tokens processors do.
        return_logprob / num_top_logprobs: copied into the flags (num_top_logprobs > 0 implies
            return_logprob).
        logprob_token_ids: per real row, the token ids whose logprobs to return (ids in [0, V)), or
            None. L = the next power of two >= 8 of the longest, so few widths compile; implies
            return_logprob when some row has ids.

    Returns:
        (batch with numpy leaves, which the compiled sampler takes as arguments; flags).

    Raises:
        ValueError: mismatched lengths, num_seqs too small, a penalty without histories, or a bitmask
            of the wrong shape.
    """
    n = len(params)
    if not (len(seeds) == len(steps) == n):
        raise ValueError(f"params, seeds and steps must have one entry per request: {n}, {len(seeds)}, {len(steps)}")
    if num_seqs < n:
        raise ValueError(f"num_seqs={num_seqs} is smaller than the number of requests {n}")
    width = bitmask_width(vocab_size)

    temperature = np.zeros(num_seqs, np.float32)
    top_p = np.ones(num_seqs, np.float32)
    top_k = np.full(num_seqs, vocab_size, np.int32)
    min_p = np.zeros(num_seqs, np.float32)
    frequency = np.zeros(num_seqs, np.float32)
    presence = np.zeros(num_seqs, np.float32)
    repetition = np.ones(num_seqs, np.float32)
    seed = np.zeros(num_seqs, np.uint32)
    step = np.zeros(num_seqs, np.int32)
    for i, (p, s, t) in enumerate(zip(params, seeds, steps)):
        greedy = p.temperature < SAMPLING_EPS or p.top_k == 1
        # a temperature past float32's range (1e308 is valid JSON) samples as the largest float32 does:
        # uniformly over the allowed tokens; cast, it would be inf, and a masked -inf logit / inf is NaN
        temperature[i] = 0.0 if greedy else min(p.temperature, FLOAT32_MAX)
        if not greedy:
            top_p[i] = p.top_p
            top_k[i] = vocab_size if p.top_k == -1 else min(p.top_k, vocab_size)
            min_p[i] = p.min_p
        frequency[i] = p.frequency_penalty
        presence[i] = p.presence_penalty
        repetition[i] = p.repetition_penalty
        seed[i] = int(s) % (1 << 32)
        step[i] = t

    use_penalties = bool(np.any(frequency != 0) or np.any(presence != 0) or np.any(repetition != 1))
    bias_ids, bias_values = _build_logit_bias(params, num_seqs)
    token_history, history_is_output = _build_history(histories, n, num_seqs, use_penalties)

    bans = [_min_new_tokens_ban(p, t, eos_token_ids) for p, t in zip(params, steps)]
    use_bitmask = bitmask is not None or any(bans)
    if use_bitmask:
        full_mask = np.full((num_seqs, width), -1, np.int32)
        if bitmask is not None:
            if bitmask.ndim != 2 or bitmask.shape[0] < n or bitmask.shape[1] != width:
                raise ValueError(f"bitmask must be [>= {n}, {width}], got {bitmask.shape}")
            full_mask[:n] = bitmask[:n]
        words = full_mask.view(np.uint32)
        for i, banned in enumerate(bans):
            for token in banned:
                if 0 <= token < vocab_size:
                    words[i, token // 32] &= ~np.uint32(1 << (token % 32))
    else:
        full_mask = np.full((num_seqs, 1), -1, np.int32)

    num_picked = max((len(ids) for ids in logprob_token_ids or ()), default=0)
    width_picked = 0 if num_picked == 0 else max(8, 1 << (num_picked - 1).bit_length())
    picked_ids = np.zeros((num_seqs, max(width_picked, 1)), np.int32)
    for i, ids in enumerate(logprob_token_ids or ()):
        picked_ids[i, : len(ids)] = ids

    greedy_rows = temperature[:n] == 0
    flags = SamplerFlags(
        all_greedy=bool(np.all(greedy_rows)),
        use_top_k=bool(np.any(top_k[:n] < vocab_size)),
        use_top_p=bool(np.any(top_p[:n] < 1)),
        use_penalties=use_penalties,
        use_bitmask=use_bitmask,
        use_logit_bias=bias_ids.shape[1] > 1,
        return_logprob=return_logprob or num_top_logprobs > 0 or width_picked > 0,
        num_top_logprobs=num_top_logprobs,
        num_logprob_token_ids=width_picked,
    )
    batch = SamplingBatch(
        temperature=temperature,
        top_p=top_p,
        top_k=top_k,
        min_p=min_p,
        frequency_penalty=frequency,
        presence_penalty=presence,
        repetition_penalty=repetition,
        seed=seed,
        step=step,
        bitmask=full_mask,
        token_history=token_history,
        history_is_output=history_is_output,
        logprob_token_ids=picked_ids,
        logit_bias_ids=bias_ids,
        logit_bias_values=bias_values,
    )
    return batch, flags


def _build_logit_bias(params: Sequence[SamplingParams], num_seqs: int) -> tuple[np.ndarray, np.ndarray]:
    """[S, B] (ids, values) padded with (0, 0.0); B = MAX_LOGIT_BIAS_ENTRIES if any row has a bias, else 1
    (one width, so a bias never needs a compile of its own)."""
    if not any(p.logit_bias for p in params):
        return np.zeros((num_seqs, 1), np.int32), np.zeros((num_seqs, 1), np.float32)
    ids = np.zeros((num_seqs, MAX_LOGIT_BIAS_ENTRIES), np.int32)
    values = np.zeros((num_seqs, MAX_LOGIT_BIAS_ENTRIES), np.float32)
    for i, p in enumerate(params):
        for j, (token, bias) in enumerate(p.logit_bias or ()):
            ids[i, j], values[i, j] = token, bias
    return ids, values


def _build_history(
    histories: Sequence[tuple[Sequence[int], int]] | None, n: int, num_seqs: int, use_penalties: bool
) -> tuple[np.ndarray, np.ndarray]:
    if not use_penalties:
        return np.full((num_seqs, 1), -1, np.int32), np.zeros((num_seqs, 1), bool)
    if histories is None or len(histories) != n:
        raise ValueError("penalties need one (token ids, num_prompt) history per request")
    longest = max((len(ids) for ids, _ in histories), default=0)
    length = max(MIN_HISTORY_LEN, 1 << max(0, longest - 1).bit_length())
    token_history = np.full((num_seqs, length), -1, np.int32)
    is_output = np.zeros((num_seqs, length), bool)
    for i, (ids, num_prompt) in enumerate(histories):
        token_history[i, : len(ids)] = ids
        is_output[i, num_prompt : len(ids)] = True
    return token_history, is_output


def _min_new_tokens_ban(params: SamplingParams, step: int, eos_token_ids: Sequence[int]) -> tuple[int, ...]:
    """Tokens that would end the request, banned while fewer than min_new_tokens have been generated."""
    if step >= params.min_new_tokens:
        return ()
    eos = () if params.ignore_eos else tuple(eos_token_ids)
    return tuple(params.stop_token_ids) + eos
