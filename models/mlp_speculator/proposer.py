"""The MLP speculator's proposer for the shared decoder: its stages in sequence, each fed the
token the previous one chose (a chain of up to ``n_predict`` tokens)."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import torch

from ..base import DecodeState, Proposal, Proposer
from ..sampling import sample, warp

if TYPE_CHECKING:
    from .model import MLPSpeculator


class MLPSpeculatorProposer(Proposer):
    """Stage 0 reads the target's state where it predicted the pending token and that token;
    stage i reads stage i - 1's state and the token stage i - 1 chose. At T = 0 each stage
    takes its argmax; at T > 0 it samples from its warped distribution and hands the
    distributions to the verifier (exact speculative sampling)."""

    name = "mlp_speculator"
    measures_steps = True
    feature_layers = (-1,)

    def __init__(self, model: MLPSpeculator):
        self.model = self.method = model.eval()

    @torch.no_grad()
    def propose(self, state: DecodeState, gamma: int) -> Proposal:
        m = self.model
        n = min(gamma, m.cfg.n_predict)
        if state.features is None or n < 1:
            self.last_step_seconds = None
            return Proposal([], [])
        t0 = time.perf_counter()
        h = m.input_state(state.features[-1:, 0])  # (1, H)
        tok = torch.tensor([state.ids[-1]], device=state.device)
        tokens: list[int] = []
        qs: list[torch.Tensor] = []
        for i in range(n):
            h = m.stage(i, h, tok)
            logits = m.stage_logits(i, h)[0]
            if state.sampling.greedy:
                x = int(logits.argmax())
            else:
                q = warp(logits, state.sampling)
                x = sample(q, state.generator)
                qs.append(q)
            tokens.append(x)
            tok = torch.tensor([x], device=state.device)
        self.draft_calls += 1
        self.last_step_seconds = (time.perf_counter() - t0) / n
        return Proposal.chain(tokens, torch.stack(qs) if qs else None)
