"""Proposers that are not trained methods: n-gram prompt lookup and a draft causal LM (a small
HF model, or ``truncate:N`` made of the target's own first N layers). EAGLE's proposer lives
with its method in ``models/eagle.py``. All follow one interface:

    feature_layers: tuple[int, ...]       target hidden states it needs (none here)
    start(state)                          a new sequence begins
    propose(state, gamma) -> Proposal     draft gamma tokens after state.ids
    rollback(state, n_accepted)           state.ids now holds the committed tokens; cut caches
    draft_calls: int                      forwards run so far
"""

from __future__ import annotations

import time

import torch
from transformers import DynamicCache

from models.base import DecodeState, Proposal, crop_cache
from models.sampling import sample, warp


class NGramProposer:
    """Prompt lookup decoding (Saxena 2023): find the most recent earlier occurrence of the
    last n tokens (n from ``max_ngram`` down to ``min_ngram``) and propose what followed it.
    Deterministic, so at T > 0 its proposal is a point mass (the decoder handles that exactly).
    Proposals carry the matched length n as their bucket, so the decoder learns how often each
    kind of match is accepted and verifies only the ones that pay.
    """

    name = "ngram"
    feature_layers: tuple[int, ...] = ()
    draft_calls = 0
    free = True  # no model: the decoder looks first, then decides how much to verify

    def __init__(self, max_ngram: int = 3, min_ngram: int = 1):
        self.max_ngram, self.min_ngram = max_ngram, min_ngram

    def start(self, state: DecodeState) -> None:
        pass

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

    def rollback(self, state: DecodeState, n_accepted: int) -> None:
        pass


class DraftLMProposer:
    """A causal LM with the target's tokenizer, drafting autoregressively with its own KV cache
    (standard speculative sampling). At T > 0 it samples from its warped distribution and
    hands the distributions to the verifier; at T = 0 it drafts argmax tokens."""

    name = "draft_lm"
    feature_layers: tuple[int, ...] = ()

    def __init__(self, model: torch.nn.Module, vocab_size: int | None = None):
        self.model = model.eval()
        # Same tokenizer, but embedding matrices are often padded to different sizes: compare
        # distributions over the target's vocabulary.
        self.vocab_size = vocab_size
        self.draft_calls = 0
        self.cache: DynamicCache | None = None
        self.fed = 0  # committed tokens held by the draft's cache
        self.last_step_seconds: float | None = None

    def start(self, state: DecodeState) -> None:
        self.cache = DynamicCache(config=self.model.config)
        self.fed = 0
        self.last_step_seconds = None
        if len(state.ids) > 1:  # prefill the prompt now, so drafting times only draft steps
            self._step(state.ids[:-1], state.device)
            self.fed = len(state.ids) - 1

    @torch.no_grad()
    def _step(self, tokens: list[int], device: torch.device) -> torch.Tensor:
        self.draft_calls += 1
        ids = torch.tensor([tokens], device=device)
        logits = self.model(
            input_ids=ids, past_key_values=self.cache, use_cache=True, logits_to_keep=1
        ).logits[0, -1]
        v = self.vocab_size
        if v is not None and logits.shape[-1] != v:
            if logits.shape[-1] > v:
                logits = logits[:v]
            else:
                logits = torch.cat(
                    [logits, logits.new_full((v - logits.shape[-1],), float("-inf"))]
                )
        return logits

    def propose(self, state: DecodeState, gamma: int) -> Proposal:
        # Time the steps that feed a few tokens; a long catch-up (after the decoder skipped
        # drafting for a while) is not what one more draft token costs.
        times: list[float] = []
        n_feed = len(state.ids) - self.fed
        t = time.perf_counter()
        logits = self._step(state.ids[self.fed :], state.device)
        if n_feed <= 2 or gamma == 1 and n_feed <= 4:
            times.append(time.perf_counter() - t)
        self.fed = len(state.ids)
        tokens: list[int] = []
        qs: list[torch.Tensor] = []
        for i in range(gamma):
            if state.sampling.greedy:
                x = int(logits.argmax())
            else:
                q = warp(logits, state.sampling)
                x = sample(q, state.generator)
                qs.append(q)
            tokens.append(x)
            if i < gamma - 1:
                t = time.perf_counter()
                logits = self._step([x], state.device)
                times.append(time.perf_counter() - t)
        self.last_step_seconds = sum(times) / len(times) if times else None
        return Proposal.chain(tokens, torch.stack(qs) if qs else None)

    def rollback(self, state: DecodeState, n_accepted: int) -> None:
        # The cache holds the old committed tokens plus the drafted tokens fed after them; the
        # accepted ones are still valid.
        held = self.cache.get_seq_length()
        keep = min(held, self.fed + n_accepted)
        crop_cache(self.cache, keep)
        self.fed = keep
