"""Accepting drafts: the longest prefix of a draft that the target model's own samples agree with.

Speculative sampling (Leviathan et al. 2023, "Fast Inference from Transformers via Speculative
Decoding"; Chen et al. 2023) accepts draft token d at a position with probability min(1, p(d) / q(d))
and, on a rejection, samples from the residual max(0, p - q) renormalised; the output then follows
the target distribution p exactly. An n-gram draft is deterministic: q is a point mass on d, so the
test accepts with probability p(d), and the residual is p with d removed, renormalised.

Drawing t ~ p with the request's own per-position randomness and accepting d iff t == d is that same
rule: P(accept) = p(d), and on a rejection t is a draw from p conditioned on t != d, which is the
residual. So verification samples every position with the ordinary sampler (its key
`fold_in(fold_in(key(0), seed), step)` depends on the output position only) and compares. Two
consequences: greedy requests (argmax) give exactly the tokens of plain decoding, and so do seeded
sampled requests, since position j draws with the same key whether or not it was speculated.
"""

from __future__ import annotations

from typing import Sequence


def num_accepted(draft: Sequence[int], target: Sequence[int]) -> int:
    """How many leading draft tokens the target samples confirm.

    Args:
        draft: the K draft tokens d_0..d_{K-1} proposed after the sequence's last token.
        target: the target's samples t_0..t_K at the K + 1 verified positions (t_j follows d_{j-1}).

    Returns:
        a in [0, K]: d_j == t_j for j < a. The step emits t_0..t_a (a accepted drafts + one more).

    Raises:
        ValueError: `target` is not one longer than `draft`.
    """
    if len(target) != len(draft) + 1:
        raise ValueError(f"need len(draft) + 1 target samples, got {len(target)} for {len(draft)} drafts")
    a = 0
    while a < len(draft) and int(draft[a]) == int(target[a]):
        a += 1
    return a
