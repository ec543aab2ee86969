"""``draft=streaming``: MagicDec-style self-speculation (Chen et al. 2024, arXiv 2408.11049).

The target drafts for itself while reading only a StreamingLLM cache (Xiao et al. 2023): the
first ``sinks`` positions (attention sinks) and the most recent ``window``; the full-cache target
verifies. No training, no second model: what drafting saves is the attention over the evicted
middle of a long context, so it pays where the KV cache, not the weights, is the cost (long
contexts, large batches, memory-bound devices).

The draft cache starts from the target's own prefill (``DecodeState.prefill_cache``, the batch-1
decoder hands it over; the batched decoder does not, and the draft then prefills the prompt
itself, counted as prefill). Keys keep the rotary positions they were computed at, and new
tokens are fed at their real positions (StreamingLLM re-numbers positions inside the cache to
reach past the model's trained length; MagicDec's contexts are within it, and so are ours).
Evicting copies the kept columns, so it happens in steps of ``slack`` columns, between
iterations, never in the middle of a draft. A window at least as long as the context is not an
error: the draft then reads the full cache, i.e. plain self-drafting (it accepts everything
at T = 0 and costs a target step per drafted token).
"""

from __future__ import annotations

import time

import torch
from transformers import DynamicCache

from models.base import DecodeState, Proposal, Proposer, crop_cache, draft_signals
from models.sampling import greedy_tokens, sample, warp
from models.target import Target


class StreamingDraft(Proposer):
    name = "streaming"
    measures_steps = True
    gives_signals = True

    def __init__(self, target: Target, sinks: int = 4, window: int = 256, slack: int = 64):
        if sinks < 0:
            raise ValueError(f"stream_sinks={sinks}: must be >= 0")
        if window < 1:
            raise ValueError(f"stream_window={window}: must be >= 1")
        if slack < 1:
            raise ValueError(f"slack={slack}: must be >= 1")
        self.target, self.model = target, target.model
        self.sinks, self.window, self.slack = sinks, window, slack
        self.draft_calls = 0
        self.cache: DynamicCache | None = None
        self.fed = 0  # committed tokens the draft has read (its next position)
        self.cols = 0  # cache columns holding committed tokens
        self.evicted = 0  # columns dropped so far (this sequence)

    def describe(self) -> str:
        return f"streaming self-draft (sinks {self.sinks}, window {self.window})"

    def start(self, state: DecodeState) -> None:
        self.cache = DynamicCache(config=self.model.config)
        self.fed = self.cols = self.evicted = 0
        self.last_step_seconds = None
        n = len(state.ids) - 1
        pc = state.prefill_cache
        if pc is not None and n > 0 and pc.get_seq_length() == n:
            keep = self._keep(n)
            for i, layer in enumerate(pc.layers):
                k, v = layer.keys[..., keep, :], layer.values[..., keep, :]
                self.cache.update(k.clone(), v.clone(), i)
            self.fed, self.cols = n, len(keep)
            self.evicted = n - len(keep)
        elif n > 0:
            self._feed(state.ids[:-1], 0, state.device)
            self.fed = n
            self.cols = self.cache.get_seq_length()
            self._evict(force=True)

    def _keep(self, n: int) -> list[int]:
        """Cache columns kept out of ``n``: the sinks and the last ``window``."""
        if n <= self.sinks + self.window:
            return list(range(n))
        return list(range(self.sinks)) + list(range(n - self.window, n))

    def _evict(self, force: bool = False) -> None:
        n = self.cache.get_seq_length()
        if n <= self.sinks + self.window + (0 if force else self.slack):
            return
        keep = torch.tensor(self._keep(n))
        for layer in self.cache.layers:
            layer.keys = layer.keys.index_select(-2, keep.to(layer.keys.device))
            layer.values = layer.values.index_select(-2, keep.to(layer.values.device))
        self.evicted += n - len(keep)
        self.cols = len(keep)

    @torch.no_grad()
    def _feed(self, tokens: list[int], position: int, device) -> torch.Tensor:
        self.draft_calls += 1
        ids = torch.tensor([tokens], device=device)
        pos = torch.arange(position, position + len(tokens), device=device)[None]
        return self.model(
            input_ids=ids,
            position_ids=pos,
            past_key_values=self.cache,
            use_cache=True,
            logits_to_keep=1,
        ).logits[0, -1]

    @torch.no_grad()
    def propose(self, state: DecodeState, gamma: int) -> Proposal:
        self._evict()
        times: list[float] = []
        n_feed = len(state.ids) - self.fed
        t = time.perf_counter()
        logits = self._feed(state.ids[self.fed :], self.fed, state.device)
        if n_feed <= 2:
            times.append(time.perf_counter() - t)
        self.fed = len(state.ids)
        self.cols = self.cache.get_seq_length()
        tokens, qs, sigs = [], [], []
        for i in range(gamma):
            if state.sampling.greedy:
                x = int(greedy_tokens(logits))
            else:
                q = warp(logits, state.sampling)
                x = sample(q, state.generator)
                qs.append(q)
            tokens.append(x)
            if state.signals:
                sigs.append(draft_signals(logits, x, i + 1))
                if state.stop is not None and state.stop(sigs[-1]):
                    break
            if i < gamma - 1:
                t = time.perf_counter()
                logits = self._feed([x], self.fed + i, state.device)
                times.append(time.perf_counter() - t)
        self.last_step_seconds = sum(times) / len(times) if times else None
        return Proposal.chain(
            tokens, torch.stack(qs) if qs else None, signals=torch.stack(sigs) if sigs else None
        )

    def rollback(self, state: DecodeState, n_accepted: int) -> None:
        held = self.cache.get_seq_length()
        keep = min(held, self.cols + n_accepted)
        crop_cache(self.cache, keep)
        self.fed += keep - self.cols
        self.cols = keep
