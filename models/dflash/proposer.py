"""DFlash's proposer for the shared decoder: one draft forward per iteration drafts the whole
block, verified as a chain."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import torch

from ..base import DecodeState, Proposal, Proposer
from ..sampling import sample, warp

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
        self.feature_layers = tuple(draft.feature_layers)
        self.draft_calls = 0
        self.kv: list[tuple[torch.Tensor, torch.Tensor]] | None = None
        self.done = 0  # context positions held in ``kv``

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
        h = d.blocks(d.embed(tok), pos, self.kv, None)
        logits = d.draft_logits(h[0, 0, 1 : k + 1])  # (k, Vd)
        self.draft_calls += 1
        if state.sampling.greedy:
            j = logits.argmax(-1)
            tokens = (j + d.d2t[j]).tolist()
            q = None
        else:
            q_own = warp(logits, state.sampling)
            js = [sample(q_own[i], state.generator) for i in range(k)]
            tokens = [j + int(d.d2t[j]) for j in js]
            q = d.to_target_vocab(q_own)
        self.last_step_seconds = time.perf_counter() - t0
        return Proposal.chain(tokens, q)
