"""Medusa's proposer for the shared decoder: all heads once, then a static candidate tree."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import torch

from ..base import DecodeState, Proposal, Proposer

if TYPE_CHECKING:
    from .model import MedusaHeads


class MedusaProposer(Proposer):
    """All heads once on the target's hidden state at the last verified position, then the
    candidate tree's nodes as a proposal (or a chain of each head's top-1). Deterministic
    (q = None): at T > 0 the decoder verifies it exactly by recursive rejection over point
    masses, or with typical acceptance when asked."""

    name = "medusa"
    measures_steps = True

    def __init__(self, heads: MedusaHeads, tree: list[tuple[int, ...]] | None):
        self.heads = self.method = heads.eval()
        self.tree = tree
        if tree is not None:  # verified whole every iteration: no adaptive gamma
            self.tree_depth = max(len(p) for p in tree)
        self.feature_layers = (-1,)
        self.draft_calls = 0
        self.last_step_seconds: float | None = None

    @torch.no_grad()
    def propose(self, state: DecodeState, gamma: int) -> Proposal:
        t0 = time.perf_counter()
        if state.features is None or gamma < 1:
            return Proposal([], [])
        h = state.features[-1, 0]  # the target's state where it predicted the pending token
        if self.tree is None:
            K = min(gamma, self.heads.cfg.num_heads)
            toks = [int(self.heads.head_logits(k, h).argmax()) for k in range(K)]
            self.draft_calls += 1
            self.last_step_seconds = (time.perf_counter() - t0) / max(1, K)
            return Proposal.chain(toks)
        tree = [p for p in self.tree if len(p) <= gamma]
        depth = max((len(p) for p in tree), default=0)
        R = max((max(p) for p in tree), default=0) + 1
        tops = [self.heads.head_logits(d, h).topk(R).indices.tolist() for d in range(depth)]
        index = {p: i for i, p in enumerate(tree)}
        tokens = [tops[len(p) - 1][p[-1]] for p in tree]
        parents = [index[p[:-1]] if len(p) > 1 else -1 for p in tree]
        self.draft_calls += 1
        self.last_step_seconds = (time.perf_counter() - t0) / max(1, depth)
        return Proposal(tokens, parents)
