"""Speculative decoding from n-gram drafts (issue 20): drafts, acceptance, policy and counters."""

from jaxserve.engine.speculative.acceptance import num_accepted
from jaxserve.engine.speculative.decoder import (
    NgramSpeculator,
    SpeculativeConfig,
    SpeculativeStats,
    constrain_draft,
    constrain_drafts,
)
from jaxserve.engine.speculative.ngram import ngram_draft
from jaxserve.engine.speculative.ngram_store import NgramStore
from jaxserve.engine.speculative.policy import DraftPolicy, DraftState, StepCosts

__all__ = ["DraftPolicy", "DraftState", "NgramSpeculator", "NgramStore", "StepCosts", "SpeculativeConfig", "SpeculativeStats", "constrain_draft", "constrain_drafts", "ngram_draft", "num_accepted"]
