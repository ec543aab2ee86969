"""Proposers that are no trained method: n-gram prompt lookup here; a draft causal LM (a small
HF model, ``truncate:N`` made of the target's own first N layers, a DistillSpec student) is
``models.draft_lm.DraftLMProposer``; EAGLE's and Medusa's proposers live in their method
folders. All implement the one decode-time contract, ``models.base.Proposer``."""

from __future__ import annotations

from models.base import DecodeState, Proposal, Proposer
from models.draft_lm import DraftLMProposer  # noqa: F401  (re-exported: one import place)


class NGramProposer(Proposer):
    """Prompt lookup decoding (Saxena 2023): find the most recent earlier occurrence of the
    last n tokens (n from ``max_ngram`` down to ``min_ngram``) and propose what followed it.
    Deterministic, so at T > 0 its proposal is a point mass (the decoder handles that exactly).
    Proposals carry the matched length n as their bucket, so the decoder learns how often each
    kind of match is accepted and verifies only the ones that pay.
    """

    name = "ngram"
    free = True  # no model: the decoder looks first, then decides how much to verify

    def __init__(self, max_ngram: int = 3, min_ngram: int = 1):
        self.max_ngram, self.min_ngram = max_ngram, min_ngram

    def propose(self, state: DecodeState, gamma: int) -> Proposal:
        ids = state.ids
        n_ids = len(ids)
        for n in range(min(self.max_ngram, n_ids - 1), self.min_ngram - 1, -1):
            tail = ids[n_ids - n :]
            # scan backwards: the most recent match predicts best
            for start in range(n_ids - n - 1, -1, -1):
                if ids[start : start + n] == tail:
                    follow = ids[start + n : start + n + gamma]
                    if follow:
                        # the match length is the proposal's confidence: a 3-gram match is
                        # accepted far more often than a 1-gram one
                        return Proposal.chain(follow, bucket=f"ngram{n}")
        return Proposal([], [])
