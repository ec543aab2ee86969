"""Any causal LM with the target's tokenizer as a drafter: loading one (refused unless its
vocabulary is the target's) and proposing with it. Shared by DistillSpec students, ``truncate:N``
(the target's own first N layers) and any HF draft model."""

from __future__ import annotations

import time

import torch
from torch import nn
from transformers import DynamicCache

from .base import DecodeState, DraftError, Proposal, Proposer, crop_cache, draft_signals
from .sampling import greedy_tokens, sample, warp
from .target import Target, TargetError, check_same_vocabulary


def load_same_vocabulary_lm(path: str, target: Target, what: str) -> nn.Module:
    """An HF causal LM (folder or hub id) on the target's device and dtype, refused unless its
    tokenizer's vocabulary is the target's (named after ``what`` in errors)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    try:
        tok = AutoTokenizer.from_pretrained(path)
        model = AutoModelForCausalLM.from_pretrained(path, dtype=target.dtype)
    except OSError as e:
        raise DraftError(f"{what}: cannot load as an HF model ({str(e).splitlines()[0]})") from None
    try:
        check_same_vocabulary(target.tokenizer, tok, what)
    except TargetError as e:
        raise DraftError(str(e)) from None
    return model.to(target.device)


class DraftLMProposer(Proposer):
    """A causal LM with the target's tokenizer, drafting autoregressively with its own KV cache
    (standard speculative sampling). At T > 0 it samples from its warped distribution and
    hands the distributions to the verifier; at T = 0 it drafts argmax tokens. Used for
    DistillSpec students, ``truncate:N`` and any HF draft model."""

    name = "draft_lm"
    measures_steps = True
    gives_signals = True

    def __init__(
        self, model: torch.nn.Module, vocab_size: int | None = None, method: object = None
    ):
        self.model = model.eval()
        self.method = method  # a DistillSpec student (None: an HF draft or truncate:N)
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
        sigs: list[torch.Tensor] = []
        for i in range(gamma):
            if state.sampling.greedy:
                x = int(greedy_tokens(logits))
            else:
                q = warp(logits, state.sampling)
                x = sample(q, state.generator)
                qs.append(q)
            tokens.append(x)
            if state.signals:  # acceptance traces / a learned stop rule (DISCO)
                sigs.append(draft_signals(logits, x, i + 1))
                if state.stop is not None and state.stop(sigs[-1]):
                    break
            if i < gamma - 1:
                t = time.perf_counter()
                logits = self._step([x], state.device)
                times.append(time.perf_counter() - t)
        self.last_step_seconds = sum(times) / len(times) if times else None
        return Proposal.chain(
            tokens, torch.stack(qs) if qs else None, signals=torch.stack(sigs) if sigs else None
        )

    def rollback(self, state: DecodeState, n_accepted: int) -> None:
        # The cache holds the old committed tokens plus the drafted tokens fed after them; the
        # accepted ones are still valid.
        held = self.cache.get_seq_length()
        keep = min(held, self.fed + n_accepted)
        crop_cache(self.cache, keep)
        self.fed = keep
