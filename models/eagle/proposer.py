"""EAGLE proposers for the shared decoder: a chain (EAGLE-1/3) and EAGLE-2's dynamic draft
tree, for either head."""

from __future__ import annotations

import math
import time
from typing import TYPE_CHECKING

import torch
from transformers import DynamicCache

from ..base import (
    BatchedProposer,
    DecodeState,
    Proposal,
    Proposer,
    crop_cache,
    draft_signals,
)
from ..ragged import causal_mask
from ..sampling import sample, warp

if TYPE_CHECKING:
    from .model import EagleHead


class EagleProposer(Proposer):
    """Chain drafting with an EAGLE head for the shared decoder.

    The head keeps its own KV cache over (feature, next token) pairs. Pairs for committed
    tokens use the target's real features (from the verification forwards); each drafted step
    feeds the head's own predicted feature with the token just drafted. After verification the
    drafted entries are cut and the next call catches up on the newly committed pairs in one
    pass, so nothing is recomputed.
    """

    name = "eagle"
    measures_steps = True
    gives_signals = True  # chains only: the tree proposer below turns it off

    def __init__(self, head: EagleHead):
        self.head = self.method = head.eval()
        self.feature_layers = tuple(head.feature_layers)
        self.draft_calls = 0
        self.cache: DynamicCache | None = None
        self.done = 0  # committed pairs held by the head's cache

    def batched(self) -> BatchedEagleChain | None:
        """The batched decoder's drafter: chains only (a subclass drafts otherwise)."""
        return BatchedEagleChain(self.head) if type(self) is EagleProposer else None

    def reset(self) -> None:
        """Forget every fed pair (an empty draft KV cache)."""
        self.cache = DynamicCache()
        self.done = 0
        self.last_step_seconds = None

    def start(self, state: DecodeState) -> None:
        self.reset()
        if len(state.ids) > 2:  # the prompt's pairs now, so drafting times only draft steps
            self._catch_up(state, upto=len(state.ids) - 2)

    def _choose(
        self, h: torch.Tensor, state: DecodeState, qs: list, sigs: list
    ) -> tuple[int, bool]:
        """The next draft token after state h (H,), and whether a stop rule ends the chain
        after it (its signals are appended to ``sigs`` when the decoder asked for them)."""
        if state.sampling.greedy and state.signals:
            # signals from the draft's own (reduced) vocabulary: the same probabilities as over
            # the target's, where every other token is -inf, at a quarter of the cost
            logits, offset = self.head.own_logits(h)
            j = int(logits.argmax())
            x = j + (int(offset[j]) if offset is not None else 0)
            s = draft_signals(logits, j, len(sigs) + 1)
        elif state.sampling.greedy:
            return int(self.head.top_tokens(h[None], 1)[1][0, 0]), False
        else:
            # sampled over the draft's own vocabulary (tokens outside it have probability 0,
            # so warping there gives the same q as over the target's), then q is laid out over
            # the target's vocabulary for verification
            logits, offset = self.head.own_logits(h)
            q_own = warp(logits, state.sampling)
            j = sample(q_own, state.generator)
            x = j + (int(offset[j]) if offset is not None else 0)
            qs.append(self.head.to_target_vocab(q_own))
            if not state.signals:
                return x, False
            s = draft_signals(logits, j, len(sigs) + 1)
        sigs.append(s)
        return x, state.stop is not None and state.stop(s)

    @torch.no_grad()
    def _catch_up(self, state: DecodeState, upto: int) -> torch.Tensor:
        """Feed committed pairs (f_t, x_{t+1}) for t = done..upto-1; returns the head's output
        (1, Q, H)."""
        head, dev = self.head, state.device
        q_len = upto - self.done
        pos = torch.arange(self.done, upto, device=dev)[None]
        emb = head._embed(torch.tensor([state.ids[self.done + 1 : upto + 1]], device=dev))
        mask = None
        if self.done > 0 and q_len > 1:
            keys = torch.arange(upto, device=dev)
            mask = (keys[None, :] <= pos[0, :, None])[None, None]
        h0 = head.initial_hidden(state.features[self.done : upto])  # fed positions only
        h = head.step(h0[None], emb, pos, mask, self.cache)
        self.done = upto
        self.draft_calls += 1
        return h

    @staticmethod
    def _no_context(state: DecodeState) -> bool:
        """A one-token prompt has had no target forward yet, so there is no feature to draft
        from: the first iteration is a plain step (it produces one)."""
        return state.features is None or len(state.ids) < 2

    @torch.no_grad()
    def propose(self, state: DecodeState, gamma: int) -> Proposal:
        head, dev = self.head, state.device
        n = len(state.ids)
        if self._no_context(state):
            self.last_step_seconds = None
            return Proposal([], [])
        times: list[float] = []
        t = time.perf_counter()
        big = n - 1 - self.done > 8
        h = self._catch_up(state, upto=n - 1)[:, -1:]  # predicts the pending token's feature
        if not big:  # a long catch-up is not what one more draft step costs
            times.append(time.perf_counter() - t)
        tokens: list[int] = []
        qs: list[torch.Tensor] = []
        sigs: list[torch.Tensor] = []
        for i in range(gamma):
            t = time.perf_counter()
            x, stop = self._choose(h[0, -1], state, qs, sigs)
            tokens.append(x)
            if i < gamma - 1 and not stop:
                p = torch.tensor([[n - 1 + i]], device=dev)
                h = head.step(h, head._embed(torch.tensor([[x]], device=dev)), p, None, self.cache)
                self.draft_calls += 1
            times.append(time.perf_counter() - t)
            if stop:
                break
        # each draft token costs one head step and one LM head; the catch-up step (when it
        # was short) stands for the step that produced the first token's feature
        self.last_step_seconds = sum(times) / len(tokens) if tokens else None
        return Proposal.chain(
            tokens, torch.stack(qs) if qs else None, signals=torch.stack(sigs) if sigs else None
        )

    def rollback(self, state: DecodeState, n_accepted: int) -> None:
        crop_cache(self.cache, self.done)


class EagleTreeProposer(EagleProposer):
    """EAGLE-2's context-aware dynamic draft tree, for either head.

    From the pending token, take the draft's ``top_k`` tokens; then ``depth - 1`` times feed the
    ``top_k`` newest nodes with the highest cumulative log-probability (the product of the
    draft's probabilities along the path, its confidence that the path is accepted) in one
    batched head step with tree attention, and give each its ``top_k`` children. Finally keep
    the ``total_tokens`` nodes of highest cumulative score (ancestor-closed, since a child never
    scores above its parent) as the tree to verify. Children are the draft's top-k, not samples,
    so the proposal is deterministic (q = None): the decoder verifies it with point-mass
    recursive rejection at T > 0, which keeps the target's distribution exactly.

    ``min_prob`` > 0 sizes the tree by the draft's confidence instead of to a fixed size (as in
    OPT-Tree, Wang et al. 2024): a node whose cumulative probability is below it is neither
    verified nor expanded, and drafting stops early at a level where no frontier node reaches
    it, so a confident iteration verifies a few tokens and an uncertain one more, up to
    ``total_tokens`` and ``depth``. The draft's best node is always kept. A node's cumulative
    probability estimates how likely it is to be accepted (the shipped head is calibrated to
    within a few points: docs/benchmarks.md), so ``min_prob`` is the acceptance chance below
    which one more verified token, or one more draft step, costs more than it is expected to
    return; on a CPU, where every verified token adds ~2% of a forward, that is a few percent.
    0 keeps EAGLE-2's fixed-size tree.
    """

    name = "eagle-tree"
    gives_signals = False

    def __init__(
        self,
        head: EagleHead,
        depth: int = 5,
        top_k: int = 8,
        total_tokens: int = 32,
        min_prob: float = 0.0,
    ):
        super().__init__(head)
        for key, v in (("depth", depth), ("top_k", top_k), ("total_tokens", total_tokens)):
            if v < 1:
                raise ValueError(f"{key}={v}: must be >= 1")
        if not 0.0 <= min_prob < 1.0:
            raise ValueError(f"min_prob={min_prob}: must be in [0, 1) (0: a fixed-size tree)")
        self.depth, self.top_k, self.total_tokens = depth, top_k, total_tokens
        self.log_min = math.log(min_prob) if min_prob > 0 else float("-inf")
        self.tree_depth = depth  # the decoder verifies the whole tree: no adaptive gamma

    @torch.no_grad()
    def propose(self, state: DecodeState, gamma: int) -> Proposal:
        head, dev = self.head, state.device
        depth = min(self.depth, gamma)
        if depth < 1 or self._no_context(state):
            self.last_step_seconds = None
            return Proposal([], [])
        n = len(state.ids)
        t0 = time.perf_counter()
        h = self._catch_up(state, upto=n - 1)[0, -1]  # predicts the pending token's successor
        tokens: list[int] = []
        parents: list[int] = []
        scores: list[float] = []
        depths: list[int] = []
        out_h: dict[int, torch.Tensor] = {}  # node -> head output after feeding it
        fed: list[int] = []  # nodes fed to the head's cache this call, in cache order

        def add_children(nodes: list[int], hidden: torch.Tensor, d: int) -> list[int]:
            """Children (the draft's top_k) of every node in ``nodes`` (-1: the root) at once:
            one LM-head product for the whole level. hidden: (len(nodes), H)."""
            logp, ids = head.top_tokens(hidden, self.top_k)
            new = []
            for parent, lps, toks in zip(nodes, logp.tolist(), ids.tolist(), strict=True):
                base = scores[parent] if parent >= 0 else 0.0
                for lp, tok in zip(lps, toks, strict=True):
                    if lp == float("-inf"):
                        break
                    tokens.append(tok)
                    parents.append(parent)
                    scores.append(base + lp)
                    depths.append(d)
                    new.append(len(tokens) - 1)
            return new

        level = add_children([-1], h[None], 1)
        levels = 1
        for d in range(1, depth):
            frontier = sorted(level, key=lambda i: -scores[i])[: self.top_k]
            if not frontier or scores[frontier[0]] < self.log_min:
                break  # no node here is likely enough to be accepted to be worth a step
            levels += 1
            q = len(frontier)
            hidden = torch.stack([h if parents[v] < 0 else out_h[parents[v]] for v in frontier])
            emb = head._embed(torch.tensor([[tokens[v] for v in frontier]], device=dev))
            # keys: committed pairs, earlier tree entries, these queries; a query sees the
            # committed context, its own ancestors and itself
            k_tree = fed + frontier
            mask = torch.zeros(q, self.done + len(k_tree), dtype=torch.bool, device=dev)
            mask[:, : self.done] = True
            col = {v: self.done + i for i, v in enumerate(k_tree)}
            for r, v in enumerate(frontier):
                a = v
                while a >= 0:
                    if a in col:
                        mask[r, col[a]] = True
                    a = parents[a]
            pos = torch.full((1, q), n - 2 + d, device=dev)
            out = head.step(hidden[None], emb, pos, mask[None, None], self.cache)[0]
            self.draft_calls += 1
            fed.extend(frontier)
            for r, v in enumerate(frontier):
                out_h[v] = out[r]
            level = add_children(frontier, out, d + 1)
        # rerank: best total_tokens by score; a parent sorts before its children
        # (a child never scores above its parent, so both cuts keep the tree ancestor-closed)
        order = sorted(range(len(tokens)), key=lambda i: (-scores[i], depths[i], i))
        keep = [v for v in order[: self.total_tokens] if scores[v] >= self.log_min] or order[:1]
        keep.sort(key=lambda i: (depths[i], -scores[i], i))
        index = {v: j for j, v in enumerate(keep)}
        self.last_step_seconds = (time.perf_counter() - t0) / levels
        #: the kept nodes' cumulative draft log-probabilities, in proposal order
        self.last_scores = [scores[v] for v in keep]
        return Proposal(
            [tokens[v] for v in keep],
            [index[parents[v]] if parents[v] >= 0 else -1 for v in keep],
        )


class BatchedEagleChain(BatchedProposer):
    """EAGLE chain drafting for every row of the batched decoder in one head forward per step.

    The head's KV cache is shared by the rows (``models/ragged.py``): committed pairs are fed
    with the target's real features, each row catching up on its own number of new pairs in
    one padded forward, and the drafted entries are masked out after verification (the batch-1
    proposer crops them): the next catch-up feeds the accepted tokens with their real features.
    Its proposals are the batch-1 proposer's (tests/test_batch.py)."""

    def __init__(self, head: EagleHead):
        self.head = head
        self.cache = None
        self.valid: torch.Tensor | None = None
        self.done: list[int] = []  # committed pairs each row's entries hold
        self.draft_start: int | None = None
        self.draft_calls = 0
        self.last_step_seconds = None

    @torch.no_grad()
    def _feed(self, states, rows: list[int], upto: list[int], cache, valid):
        """Feed each row's committed pairs (f_t, x_{t+1}) for t = done..upto-1, left-padded to
        the longest (at least one query: a row with nothing to feed gets a masked one).
        Returns the head output at each row's last query (R, H) and the new ``valid``."""
        head, dev = self.head, states[0].device
        n = max(1, max(u - self.done[r] for r, u in zip(rows, upto, strict=True)))
        R = len(rows)
        toks = torch.zeros(R, n, dtype=torch.long)
        pos = torch.zeros(R, n, dtype=torch.long)
        real = torch.zeros(R, n, dtype=torch.bool)
        h0 = None
        for i, (r, u) in enumerate(zip(rows, upto, strict=True)):
            st, d = states[i], self.done[r]
            if u <= d:
                continue
            f = head.initial_hidden(st.features[d:u])
            if h0 is None:
                h0 = f.new_zeros(R, n, f.shape[-1])
            h0[i, n - (u - d) :] = f
            toks[i, n - (u - d) :] = torch.tensor(st.ids[d + 1 : u + 1])
            pos[i, n - (u - d) :] = torch.arange(d, u)
            real[i, n - (u - d) :] = True
        if h0 is None:
            h0 = torch.zeros(R, n, head.target.hidden_size, dtype=head._compute_dtype(), device=dev)
        allowed = causal_mask(valid, real)
        emb = head._embed(toks.to(dev))
        h = head.step(h0, emb, pos.to(dev), allowed[:, None].to(dev), cache)
        self.draft_calls += 1
        for r, u in zip(rows, upto, strict=True):
            self.done[r] = max(self.done[r], u)
        return h[:, -1], torch.cat([valid, real.to(valid.device)], dim=1)

    def join(self, states: list[DecodeState]) -> None:
        from ..ragged import join_rows, new_cache

        cache = new_cache(None)
        valid = torch.zeros(len(states), 0, dtype=torch.bool, device=states[0].device)
        base = len(self.done)
        self.done.extend([0] * len(states))
        # the prompt's pairs but the last, as the batch-1 proposer's start: drafting then times
        # only draft steps
        upto = [max(0, len(s.ids) - 2) if s.features is not None else 0 for s in states]
        _, valid = self._feed(states, list(range(base, base + len(states))), upto, cache, valid)
        if self.cache is None:
            self.cache, self.valid = cache, valid
        else:
            self.cache, self.valid = join_rows(self.cache, self.valid, cache, valid)

    def select(self, keep: list[int]) -> None:
        self.done = [self.done[i] for i in keep]
        if not keep:
            self.cache = self.valid = self.draft_start = None
            return
        self.cache.batch_select_indices(torch.tensor(keep, device=self.valid.device))
        self.valid = self.valid[keep]

    @torch.no_grad()
    def propose(self, states: list[DecodeState], gammas: list[int]) -> list[Proposal]:
        head, dev = self.head, states[0].device
        top = max(gammas, default=0)
        if top == 0 or any(s.features is None or len(s.ids) < 2 for s in states):
            # a row with no target forward yet has no feature to draft from: a plain step
            self.last_step_seconds = None
            return [Proposal([], []) for _ in states]
        R = len(states)
        times: list[float] = []
        t = time.perf_counter()
        upto = [len(s.ids) - 1 for s in states]
        small = max(u - d for u, d in zip(upto, self.done, strict=True)) <= 8
        h, self.valid = self._feed(states, list(range(R)), upto, self.cache, self.valid)
        if small:  # a long catch-up is not what one more draft step costs
            times.append(time.perf_counter() - t)
        self.draft_start = self.valid.shape[1]
        tokens: list[list[int]] = [[] for _ in range(R)]
        qs: list[list[torch.Tensor]] = [[] for _ in range(R)]
        sampling = states[0].sampling
        for i in range(top):
            t = time.perf_counter()
            if sampling.greedy:
                xs = head.top_tokens(h, 1)[1][:, 0].tolist()
            else:
                # as the batch-1 proposer: sampled over the draft's own vocabulary, each row
                # from its own random stream, q laid out over the target's vocabulary
                logits, offset = head.own_logits(h)
                q_own = warp(logits, sampling)
                xs = [0] * R
                for b in range(R):
                    if i < gammas[b]:
                        j = sample(q_own[b], states[b].generator)
                        xs[b] = j + (int(offset[j]) if offset is not None else 0)
                        qs[b].append(head.to_target_vocab(q_own[b]))
            for b in range(R):
                if i < gammas[b]:
                    tokens[b].append(xs[b])
            if i < top - 1:
                pos = torch.tensor([[len(s.ids) - 1 + i] for s in states], device=dev)
                allowed = torch.cat(
                    [self.valid[:, None, :].cpu(), torch.ones(R, 1, 1, dtype=torch.bool)], dim=2
                )
                emb = head._embed(torch.tensor([[x] for x in xs], device=dev))
                h = head.step(h[:, None], emb, pos, allowed[:, None].to(dev), self.cache)[:, -1]
                self.valid = torch.cat([self.valid, self.valid.new_ones(R, 1)], dim=1)
                self.draft_calls += 1
            times.append(time.perf_counter() - t)
        # one step for the whole batch: one head forward and one LM head over the rows
        self.last_step_seconds = sum(times) / top
        return [Proposal.chain(tokens[b], torch.stack(qs[b]) if qs[b] else None) for b in range(R)]

    def rollback(self, states: list[DecodeState], accepted: list[int]) -> None:
        from ..ragged import tidy

        if self.valid is None:
            return
        if self.draft_start is not None:
            self.valid[:, self.draft_start :] = False  # fed again with real features
            self.draft_start = None
        self.valid = tidy(self.cache, self.valid)
