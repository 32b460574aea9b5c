"""Speculative decoding from n-gram drafts: drafts, acceptance, policy and counters."""

from jaxserve.speculative.acceptance import num_accepted
from jaxserve.speculative.decoder import (
    NgramSpeculator,
    SpeculativeConfig,
    SpeculativeStats,
    constrain_draft,
    constrain_drafts,
)
from jaxserve.speculative.ngram import ngram_draft
from jaxserve.speculative.ngram_store import NgramStore
from jaxserve.speculative.policy import DraftPolicy, DraftState, StepCosts

__all__ = ["DraftPolicy", "DraftState", "NgramSpeculator", "NgramStore", "StepCosts", "SpeculativeConfig", "SpeculativeStats", "constrain_draft", "constrain_drafts", "ngram_draft", "num_accepted"]
