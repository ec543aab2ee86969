"""Medusa's proposer for the shared decoder: all heads once, then a static candidate tree."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import torch

from ..base import BatchedProposer, DecodeState, Proposal, Proposer

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
            self.tree_nodes = len(tree)
        self.feature_layers = (-1,)
        self.draft_calls = 0
        self.last_step_seconds: float | None = None

    def batched(self) -> BatchedMedusa | None:
        return BatchedMedusa(self) if type(self) is MedusaProposer else None

    @torch.no_grad()
    def propose(self, state: DecodeState, gamma: int) -> Proposal:
        t0 = time.perf_counter()
        if state.features is None or gamma < 1:
            return Proposal([], [])
        h = state.features[-1, 0]  # the target's state where it predicted the pending token
        depth = self._depth(gamma)
        tops = self._tops(h, depth)
        self.draft_calls += 1
        self.last_step_seconds = (time.perf_counter() - t0) / max(1, depth)
        return self._proposal(tops, gamma)

    def _depth(self, gamma: int) -> int:
        """Heads read for a proposal of at most ``gamma`` levels."""
        if self.tree is None:
            return min(gamma, self.heads.cfg.num_heads)
        return max((len(p) for p in self.tree if len(p) <= gamma), default=0)

    def _tops(self, h: torch.Tensor, depth: int) -> list:
        """Each head's top candidates on hidden states (..., H): [head][...][rank] token ids
        (top 1 for a chain, as many as the tree's widest level asks for a tree)."""
        if self.tree is None:  # a chain: each head's argmax
            return [
                self.heads.head_logits(d, h).argmax(-1)[..., None].tolist() for d in range(depth)
            ]
        width = max(max(p) for p in self.tree) + 1
        return [self.heads.head_logits(d, h).topk(width).indices.tolist() for d in range(depth)]

    def _proposal(self, tops: list, gamma: int) -> Proposal:
        if self.tree is None:
            return Proposal.chain([tops[k][0] for k in range(min(gamma, len(tops)))])
        tree = [p for p in self.tree if len(p) <= gamma]
        index = {p: i for i, p in enumerate(tree)}
        tokens = [tops[len(p) - 1][p[-1]] for p in tree]
        parents = [index[p[:-1]] if len(p) > 1 else -1 for p in tree]
        return Proposal(tokens, parents)


class BatchedMedusa(BatchedProposer):
    """Medusa for every row of the batched decoder at once: each head reads every row's last
    hidden state in one forward (the heads' LM projections, most of Medusa's drafting cost,
    become one matrix product for the batch); each row then takes its own chain or tree.
    Stateless: nothing to join, select or roll back."""

    def __init__(self, single: MedusaProposer):
        self.single = single
        self.draft_calls = 0
        self.last_step_seconds = None

    def join(self, states: list[DecodeState]) -> None:
        pass

    def select(self, keep: list[int]) -> None:
        pass

    def rollback(self, states: list[DecodeState], accepted: list[int]) -> None:
        pass

    @torch.no_grad()
    def propose(self, states: list[DecodeState], gammas: list[int]) -> list[Proposal]:
        t0 = time.perf_counter()
        live = [
            b
            for b, (s, g) in enumerate(zip(states, gammas, strict=True))
            if g and s.features is not None
        ]
        out = [Proposal([], []) for _ in states]
        if not live:
            self.last_step_seconds = None
            return out
        depth = max(self.single._depth(gammas[b]) for b in live)
        h = torch.stack([states[b].features[-1, 0] for b in live])
        tops = self.single._tops(h, depth)  # [head][row][rank]
        for i, b in enumerate(live):
            out[b] = self.single._proposal([t[i] for t in tops], gammas[b])
        self.draft_calls += 1
        self.last_step_seconds = (time.perf_counter() - t0) / max(1, depth)
        return out
