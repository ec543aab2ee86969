"""P-EAGLE's proposer: one head forward over the newly committed pairs and K - 1 mask slots."""

from __future__ import annotations

import time

import torch

from ..base import DecodeState, Proposal, crop_cache
from ..eagle.proposer import EagleProposer
from ..sampling import sample, warp


class PEagleProposer(EagleProposer):
    """Like EAGLE's chain proposer, the head keeps a KV cache over committed (feature, next
    token) pairs; each iteration feeds the pairs committed since, then K - 1 mask slots at the
    next positions, causal, in the same forward. The last pair's output is draft token 1, mask
    slot i's is token i + 1. The mask slots' cache entries are dropped at once: they are never
    read again."""

    name = "peagle"
    parallel = True
    gives_signals = False

    @torch.no_grad()
    def propose(self, state: DecodeState, gamma: int) -> Proposal:
        head, dev = self.head, state.device
        k = min(gamma, head.cfg.ttt_steps)
        if self._no_context(state) or k < 1:
            self.last_step_seconds = None
            return Proposal([], [])
        t0 = time.perf_counter()
        n = len(state.ids)
        q_pairs = n - 1 - self.done
        h = head.initial_hidden(state.features[self.done : n - 1])
        emb = head._embed(torch.tensor(state.ids[self.done + 1 : n], device=dev))
        if k > 1:
            hm, em = head.mask_inputs(k - 1)
            h, emb = torch.cat([h, hm.to(h.dtype)]), torch.cat([emb, em.to(emb.dtype)])
        q = q_pairs + k - 1
        pos = torch.arange(self.done, self.done + q, device=dev)[None]
        keys = torch.arange(self.done + q, device=dev)
        mask = (keys[None, :] <= pos[0, :, None])[None, None]
        out = head.step(h[None], emb[None], pos, mask, self.cache)[0, q_pairs - 1 :]  # (k, H)
        self.done = n - 1
        crop_cache(self.cache, self.done)
        self.draft_calls += 1
        if state.sampling.greedy:
            tokens = head.top_tokens(out, 1)[1][:, 0].tolist()
            qs = None
        else:
            logits, offset = head.own_logits(out)
            q_own = warp(logits, state.sampling)
            js = [sample(q_own[i], state.generator) for i in range(k)]
            tokens = [j + (int(offset[j]) if offset is not None else 0) for j in js]
            qs = head.to_target_vocab(q_own)
        self.last_step_seconds = time.perf_counter() - t0
        return Proposal.chain(tokens, qs)
