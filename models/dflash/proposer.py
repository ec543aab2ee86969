"""DFlash's proposer for the shared decoder: one draft forward per iteration drafts the whole
block, verified as a chain."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import torch

from ..base import BatchedProposer, DecodeState, Proposal, Proposer
from ..ragged import column_positions, join_rows, keep_rows, new_cache, tidy, within_window

if TYPE_CHECKING:
    from .model import DFlashDraft


class DFlashProposer(Proposer):
    """Keeps every draft layer's keys/values of the context (the fused target features of
    the committed positions; they never change, so nothing is rolled back) and runs the block
    ``[pending token, mask x (B-1)]`` at positions n-1..n+B-2 against them. Slot k's argmax (T = 0)
    or a sample from its warped distribution (T > 0, handed to the verifier as q) is draft
    token k. The block always has its trained length, whatever gamma asks for (a shorter block
    would change what its first slots see); the first gamma tokens are proposed."""

    name = "dflash"
    measures_steps = True
    parallel = True

    def __init__(self, draft: DFlashDraft):
        self.draft = self.method = draft.eval()
        self.name = draft.cfg.name  # dflash, or a method built on it (dspark)
        self.feature_layers = tuple(draft.feature_layers)
        self.draft_calls = 0
        self.kv: list[tuple[torch.Tensor, torch.Tensor]] | None = None
        self.done = 0  # context positions held in ``kv``

    def batched(self) -> BatchedDFlash:
        return BatchedDFlash(self.draft)

    def start(self, state: DecodeState) -> None:
        self.kv, self.done = None, 0
        self.last_step_seconds = None
        if state.features is not None:
            self._catch_up(state)

    @torch.no_grad()
    def _catch_up(self, state: DecodeState) -> None:
        """Add the context keys/values of positions done..len(features)-1."""
        n = state.features.shape[0]
        if n <= self.done:
            return
        d = self.draft
        ctx = d.context(state.features[self.done : n])[None]  # (1, m, H)
        pos = torch.arange(self.done, n, device=state.device)[None]
        new = d.context_kv(ctx, pos)
        self.kv = (
            new
            if self.kv is None
            else [
                (torch.cat([k0, k1], 2), torch.cat([v0, v1], 2))
                for (k0, v0), (k1, v1) in zip(self.kv, new, strict=True)
            ]
        )
        self.done = n

    @torch.no_grad()
    def propose(self, state: DecodeState, gamma: int) -> Proposal:
        d = self.draft
        S = d.cfg.block_size
        k = min(gamma, S - 1)
        if state.features is None or len(state.ids) < 2 or k < 1:
            self.last_step_seconds = None
            return Proposal([], [])
        t0 = time.perf_counter()
        self._catch_up(state)
        n = len(state.ids)
        dev = state.device
        tok = torch.full((1, 1, S), d.cfg.mask_token_id, device=dev)
        tok[0, 0, 0] = state.ids[-1]
        pos = torch.arange(n - 1, n - 1 + S, device=dev)[None, None]
        allowed, window = None, d.target.draft_window
        if window is not None and n - 1 + S > window:  # each slot within its window
            allowed = within_window(pos[0, 0], torch.arange(self.done, device=dev), window)
            allowed = allowed[None, None]  # (1, 1, S, T): the context's columns, in order
        h = d.blocks(d.embed(tok), pos, self.kv, allowed)
        prev = torch.tensor([state.ids[-1]], device=dev)
        ((tokens, q),) = d.pick(h[:, 0, 1 : k + 1], prev, [k], state.sampling, [state.generator])
        self.draft_calls += 1
        self.last_step_seconds = time.perf_counter() - t0
        return Proposal.chain(tokens, q)


class BatchedDFlash(BatchedProposer):
    """DFlash for every row of the batched decoder: the rows' context keys/values in one
    ragged cache (``models/ragged.py``: left-padded, ``valid`` marks each row's columns), each
    row catching up on its own newly committed positions in one padded pass, then one block
    forward for the whole batch. The context never changes, so nothing is rolled back. Its
    proposals are the batch-1 proposer's (tests/test_batch.py)."""

    def __init__(self, draft: DFlashDraft):
        self.draft = draft
        self.cache = None
        self.valid: torch.Tensor | None = None
        self.done: list[int] = []  # context positions each row's columns hold
        self.draft_calls = 0
        self.last_step_seconds = None

    @torch.no_grad()
    def _catch_up(self, states: list[DecodeState], rows: list[int], cache, valid):
        """Append each row's context keys/values of positions done..len(features)-1,
        left-padded to the longest (at least one column: a row with nothing gets a masked
        one). Returns the new ``valid``."""
        d, dev = self.draft, states[0].device
        upto = [0 if s.features is None else s.features.shape[0] for s in states]
        news = [u - self.done[r] for r, u in zip(rows, upto, strict=True)]
        m, R = max(1, max(news)), len(rows)
        feats = None
        real = torch.zeros(R, m, dtype=torch.bool)
        pos = torch.zeros(R, m, dtype=torch.long)
        for i, (r, u, k) in enumerate(zip(rows, upto, news, strict=True)):
            if k <= 0:
                continue
            f = states[i].features[u - k : u]
            if feats is None:
                feats = f.new_zeros(R, m, *f.shape[1:])
            feats[i, m - k :] = f
            pos[i, m - k :] = torch.arange(u - k, u)
            real[i, m - k :] = True
            self.done[r] = u
        if feats is None:  # nothing to read: one masked column
            n_f = len(d.feature_layers)
            feats = torch.zeros(R, m, n_f, d.target.hidden_size, device=dev)
        for i, (k, v) in enumerate(d.context_kv(d.context(feats), pos.to(dev))):
            cache.update(k, v, i)
        return torch.cat([valid, real.to(valid.device)], dim=1)

    def join(self, states: list[DecodeState]) -> None:
        cache = new_cache(None)
        valid = torch.zeros(len(states), 0, dtype=torch.bool, device=states[0].device)
        base = len(self.done)
        self.done.extend([0] * len(states))
        valid = self._catch_up(states, list(range(base, base + len(states))), cache, valid)
        self.cache, self.valid = join_rows(self.cache, self.valid, cache, valid)

    def select(self, keep: list[int]) -> None:
        self.done = [self.done[i] for i in keep]
        self.cache, self.valid = keep_rows(self.cache, self.valid, keep)

    @torch.no_grad()
    def propose(self, states: list[DecodeState], gammas: list[int]) -> list[Proposal]:
        d = self.draft
        S = d.cfg.block_size
        ks = [min(g, S - 1) for g in gammas]
        top = max(ks, default=0)
        if top == 0 or any(s.features is None or len(s.ids) < 2 for s in states):
            self.last_step_seconds = None
            return [Proposal([], []) for _ in states]
        t0 = time.perf_counter()
        R, dev = len(states), states[0].device
        news = [s.features.shape[0] - o for s, o in zip(states, self.done, strict=True)]
        if max(news) > 0:
            self.valid = self._catch_up(states, list(range(R)), self.cache, self.valid)
        tok = torch.full((R, 1, S), d.cfg.mask_token_id, device=dev)
        tok[:, 0, 0] = torch.tensor([s.ids[-1] for s in states], device=dev)
        start = torch.tensor([len(s.ids) - 1 for s in states], device=dev)
        pos = (start[:, None] + torch.arange(S, device=dev))[:, None]
        kv = [(layer.keys, layer.values) for layer in self.cache.layers]
        allowed = self.valid[:, None, :]
        if d.target.draft_window is not None:  # each slot within its window
            near = within_window(pos[:, 0], column_positions(self.valid), d.target.draft_window)
            allowed = allowed[:, :, None, :] & near[:, None]  # (R, 1, S, L)
        h = d.blocks(d.embed(tok), pos, kv, allowed)
        self.draft_calls += 1
        picked = d.pick(
            h[:, 0, 1 : top + 1],
            tok[:, 0, 0],
            ks,
            states[0].sampling,
            [s.generator for s in states],
        )
        props = [Proposal.chain(t, q) for t, q in picked]
        # one block forward drafts every row; a long catch-up is not what it costs
        self.last_step_seconds = time.perf_counter() - t0 if max(news) <= 8 else None
        return props

    def rollback(self, states: list[DecodeState], accepted: list[int]) -> None:
        if self.valid is not None:
            self.valid = tidy(self.cache, self.valid)  # columns of rows that left
