"""P-EAGLE's proposer: one head forward over the newly committed pairs and K - 1 mask slots."""

from __future__ import annotations

import time

import torch

from ..base import DecodeState, Proposal, crop_cache
from ..eagle.proposer import BatchedEagleChain, EagleProposer
from ..ragged import causal_window
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

    def batched(self) -> BatchedPEagle:
        return BatchedPEagle(self.head)

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
        keys = torch.arange(self.done + q, device=dev)  # the cache's columns: its positions
        mask = causal_window(pos[0], keys, head.target.draft_window)[None, None]
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


class BatchedPEagle(BatchedEagleChain):
    """P-EAGLE for every row of the batched decoder: one head forward per iteration for the
    whole batch, each row's newly committed pairs (left-padded) followed by the same K - 1
    mask slots at the row's next positions. The slots' cache columns are masked out after
    verification (the batch-1 proposer crops them). Row b takes the first min(gamma_b, K)
    tokens: a slot never sees later ones, so that is what the batch-1 proposer drafts."""

    @torch.no_grad()
    def propose(self, states: list[DecodeState], gammas: list[int]) -> list[Proposal]:
        head = self.head
        K = head.cfg.ttt_steps
        ks = [min(g, K) for g in gammas]
        top = max(ks, default=0)
        if top == 0 or any(s.features is None or len(s.ids) < 2 for s in states):
            self.last_step_seconds = None
            return [Proposal([], []) for _ in states]
        R = len(states)
        t0 = time.perf_counter()
        upto = [len(s.ids) - 1 for s in states]
        small = max(u - d for u, d in zip(upto, self.done, strict=True)) <= 8
        out, self.valid = self._feed(
            states, list(range(R)), upto, self.cache, self.valid, tail=top - 1
        )  # (R, top, H)
        self.draft_start = self.valid.shape[1] - (top - 1)
        sampling = states[0].sampling
        if sampling.greedy:
            ids = head.top_tokens(out.reshape(R * top, -1), 1)[1][:, 0].view(R, top).tolist()
            props = [Proposal.chain(ids[b][: ks[b]]) for b in range(R)]
        else:
            logits, offset = head.own_logits(out)
            q_own = warp(logits, sampling)  # (R, top, V_draft)
            props = []
            for b in range(R):
                js = [sample(q_own[b, i], states[b].generator) for i in range(ks[b])]
                tokens = [j + (int(offset[j]) if offset is not None else 0) for j in js]
                qs = head.to_target_vocab(q_own[b, : ks[b]]) if js else None
                props.append(Proposal.chain(tokens, qs))
        # one forward drafts every row's tokens; a long catch-up is not what it costs
        self.last_step_seconds = time.perf_counter() - t0 if small else None
        return props
