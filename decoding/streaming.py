"""``draft=streaming``: MagicDec-style self-speculation (Chen et al. 2024, arXiv 2408.11049).

The target drafts for itself while reading only a StreamingLLM cache (Xiao et al. 2023): the
first ``sinks`` positions (attention sinks) and the most recent ``window``; the full-cache target
verifies. No training, no second model: what drafting saves is the attention over the evicted
middle of a long context, so it pays where the KV cache, not the weights, is the cost (long
contexts, large batches, memory-bound devices).

The draft cache starts from the target's own prefill (``DecodeState.prefill_cache``: the batch-1
decoder hands over its cache, the batched decoder a view of the row's columns of the batch's
prefill), copying only the sinks and the window; tokens decoded since (the batched decoder starts
a row's draft when the row first drafts) are fed then. Without one the draft prefills the prompt
itself, counted as prefill. Keys keep the rotary positions they were computed at, and new
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

from models.base import (
    DecodeState,
    Proposal,
    Proposer,
    cache_kw,
    crop_cache,
    keep_last,
    rollback_cache,
)
from models.draft_lm import BatchedDraftLM, chain_from
from models.target import Target


def kept_columns(n: int, sinks: int, window: int) -> list[int]:
    """Cache columns kept out of ``n``: the sinks and the last ``window``."""
    if n <= sinks + window:
        return list(range(n))
    return list(range(sinks)) + list(range(n - window, n))


class StreamingDraft(Proposer):
    name = "streaming"
    measures_steps = True
    gives_signals = True
    reads_prefill_cache = True

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
        self.cache = rollback_cache(self.model.config)
        self.fed = self.cols = self.evicted = 0
        self.last_step_seconds = None
        n = len(state.ids) - 1
        pc = state.prefill_cache
        m = pc.get_seq_length() if pc is not None else 0
        if 0 < m <= n:  # the target's prefill of ids[:m]: copy its sinks and window
            keep = torch.tensor(self._keep(m))
            for i, layer in enumerate(pc.layers):
                k = layer.keys.index_select(-2, keep.to(layer.keys.device))
                v = layer.values.index_select(-2, keep.to(layer.values.device))
                self.cache.update(k, v, i)
            self.fed, self.cols = m, len(keep)
            self.evicted = m - len(keep)
        if self.fed < n:  # what the prefill did not cover
            self._feed(state.ids[self.fed : n], self.fed, state.device)
            self.fed = n
            self.cols = self.cache.get_seq_length()
            self._evict(force=True)

    def batched(self) -> BatchedStreamingDraft | None:
        return BatchedStreamingDraft(self.target, self.sinks, self.window, self.slack)

    def _keep(self, n: int) -> list[int]:
        return kept_columns(n, self.sinks, self.window)

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
            **cache_kw(self.model, self.cache),
            use_cache=True,
            logits_to_keep=keep_last(len(tokens), device),
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
        fed = self.fed
        prop = chain_from(
            state, gamma, logits, lambda x, i: self._feed([x], fed + i, state.device), times
        )
        self.last_step_seconds = sum(times) / len(times) if times else None
        return prop

    def rollback(self, state: DecodeState, n_accepted: int) -> None:
        held = self.cache.get_seq_length()
        keep = min(held, self.cols + n_accepted)
        crop_cache(self.cache, keep)
        self.fed += keep - self.cols
        self.cols = keep


class BatchedStreamingDraft(BatchedDraftLM):
    """``StreamingDraft`` for every row of the batched decoder in one target forward per step
    (MagicDec's setting: a batch of long contexts). The rows share one ragged cache
    (``models/ragged.py``) in which eviction is masking: a row keeps its first ``sinks`` and
    its last ``window`` committed columns, evicted when it holds ``slack`` more, before it
    drafts, as the batch-1 draft does (whose proposals these are, tests/test_batch.py);
    ``tidy`` frees the holes. A row starts from its columns of the batch's prefill
    (``DecodeState.prefill_cache``), copying only the sinks and the window."""

    def __init__(self, target: Target, sinks: int, window: int, slack: int):
        super().__init__(target.model)
        self.target, self.sinks, self.window, self.slack = target, sinks, window, slack

    def _evict_rows(self, valid: torch.Tensor, limit: int) -> None:
        """Mask the middle of every row holding more than ``limit`` columns (in place)."""
        for b in range(valid.shape[0]):
            cols = valid[b].nonzero()[:, 0]
            if len(cols) > limit:
                valid[b, cols[self.sinks : len(cols) - self.window]] = False

    def _evict(self, states: list[DecodeState]) -> None:
        self._evict_rows(self.valid, self.sinks + self.window + self.slack)

    def _start_rows(self, states: list[DecodeState]):
        from models.ragged import new_cache

        dev = states[0].device
        R = len(states)
        ms, keeps = [], []
        for s in states:
            pc, n = s.prefill_cache, len(s.ids) - 1
            m = pc.get_seq_length() if pc is not None else 0
            m = m if 0 < m <= n else 0
            ms.append(m)
            keeps.append(kept_columns(m, self.sinks, self.window))
        width = max(len(k) for k in keeps)
        cache = new_cache(self.model.config)
        valid = torch.zeros(R, width, dtype=torch.bool, device=dev)
        if width:  # each row's sinks and window of its prefill, right-aligned
            layers = next(s.prefill_cache for s, m in zip(states, ms, strict=True) if m).layers
            for i, ref in enumerate(layers):
                shape = (R, ref.keys.shape[1], width, ref.keys.shape[-1])
                k = ref.keys.new_zeros(shape)
                v = ref.values.new_zeros(shape)
                for b, (s, keep) in enumerate(zip(states, keeps, strict=True)):
                    if keep:
                        src = s.prefill_cache.layers[i]
                        idx = torch.tensor(keep, device=src.keys.device)
                        k[b, :, width - len(keep) :] = src.keys[0].index_select(-2, idx)
                        v[b, :, width - len(keep) :] = src.values[0].index_select(-2, idx)
                cache.update(k, v, i)
            for b, keep in enumerate(keeps):
                valid[b, width - len(keep) :] = True
        feeds = [s.ids[m : len(s.ids) - 1] for s, m in zip(states, ms, strict=True)]
        if any(feeds):  # what the prefill did not cover, then the window as the batch-1 start
            _, valid = self._forward(cache, valid, feeds, ms, dev)
            self._evict_rows(valid, self.sinks + self.window)
        return cache, valid, [len(s.ids) - 1 for s in states]
