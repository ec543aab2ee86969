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
from ..ragged import causal_mask, causal_window, column_positions, within_window
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

    def fixed_shape(self, gamma: int, graphs: str) -> Proposer | None:
        """Chains on the static path where graphs are captured (``static.py``; ``emulate``:
        tests). Eager on a CPU this proposer stays: a device read per token costs nothing
        there, and the fixed-shape chain measured 5-8% slower a proposal (7.0 against 6.4 ms
        for 3 tokens, the shipped head on the AMX Xeon; ``scripts/bench_compiled.py --parts
        draft``). Trees: ``EagleTreeProposer.fixed_shape``."""
        if type(self) is not EagleProposer or gamma < 1 or graphs == "off":
            return None
        from .static import StaticEagleChain

        return StaticEagleChain(self.head, gamma, graphs)

    def batched_fixed_shape(self, batch_size: int, gamma: int, graphs: str):
        """Chains for the batched decoder's static path where graphs run
        (``static.StaticBatchedEagleChain``); None elsewhere."""
        if type(self) is not EagleProposer or gamma < 1 or graphs == "off":
            return None
        from .static import StaticBatchedEagleChain

        return StaticBatchedEagleChain(self.head, batch_size, gamma, graphs)

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
        mask, window = None, head.target.draft_window
        if (self.done > 0 and q_len > 1) or (window is not None and upto > window):
            mask = causal_window(pos[0], torch.arange(upto, device=dev), window)[None, None]
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
                mask = window_columns(n - 1 + i, n + i, head.target.draft_window, dev)
                h = head.step(h, head._embed(torch.tensor([[x]], device=dev)), p, mask, self.cache)
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
        self.tree_nodes = total_tokens

    def fixed_shape(self, gamma: int, graphs: str) -> Proposer | None:
        """The whole tree as one function of fixed shapes where graphs are captured
        (``static.StaticEagleTree``: every level computed, the frontier chosen on the device,
        one host read a proposal); eager on a CPU, as the chain."""
        if type(self) is not EagleTreeProposer or graphs == "off" or gamma != self.depth:
            return None
        from .static import StaticEagleTree

        min_prob = math.exp(self.log_min) if self.log_min > float("-inf") else 0.0
        return StaticEagleTree(
            self.head, self.depth, self.top_k, self.total_tokens, min_prob, graphs
        )

    def batched_fixed_shape(self, batch_size: int, gamma: int, graphs: str):
        """Trees for the batched decoder's static path where graphs run
        (``static.StaticBatchedEagleTree``: one function per row bucket, each row's depth an
        input); None elsewhere."""
        if type(self) is not EagleTreeProposer or graphs == "off" or gamma != self.depth:
            return None
        from .static import StaticBatchedEagleTree

        min_prob = math.exp(self.log_min) if self.log_min > float("-inf") else 0.0
        return StaticBatchedEagleTree(
            self.head, batch_size, self.depth, self.top_k, self.total_tokens, min_prob, graphs
        )

    def batched(self) -> BatchedEagleTree | None:
        """Trees for every row of the batched decoder, one head forward per level."""
        if type(self) is not EagleTreeProposer:
            return None
        return BatchedEagleTree(self.head, self.depth, self.top_k, self.total_tokens, self.log_min)

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
        tree, window = _Tree(h), head.target.draft_window
        logp, ids = head.top_tokens(h[None], self.top_k)  # one LM-head product per level
        level = tree.add_children([-1], logp.tolist(), ids.tolist(), 1)
        levels = 1
        for d in range(1, depth):
            frontier = tree.frontier(level, self.top_k, self.log_min)
            if not frontier:
                break  # no node here is likely enough to be accepted to be worth a step
            levels += 1
            q = len(frontier)
            # keys: committed pairs, earlier tree entries, these queries; a query sees the
            # committed context, its own ancestors and itself
            mask = torch.zeros(q, self.done + len(tree.col) + q, dtype=torch.bool, device=dev)
            mask[:, : self.done] = committed_columns(n - 2 + d, self.done, window, dev)
            for r, v in enumerate(frontier):
                tree.col[v] = self.done + len(tree.col)
                mask[r, tree.ancestor_columns(v)] = True
            pos = torch.full((1, q), n - 2 + d, device=dev)
            emb = head._embed(torch.tensor([[tree.tokens[v] for v in frontier]], device=dev))
            out = head.step(tree.inputs(frontier)[None], emb, pos, mask[None, None], self.cache)
            self.draft_calls += 1
            logp, ids = head.top_tokens(out[0], self.top_k)
            level = tree.expand(frontier, out[0], logp.tolist(), ids.tolist(), d + 1)
        self.last_step_seconds = (time.perf_counter() - t0) / levels
        proposal, self.last_scores = tree.proposal(self.total_tokens, self.log_min)
        return proposal


def window_columns(qpos: int, columns: int, window: int | None, device) -> torch.Tensor | None:
    """The mask (1, 1, 1, columns) of one query at position ``qpos`` over a draft cache whose
    columns are their positions (a chain's), within the target's ``draft_window``; None where
    it sees every column (no window, or all of them within it)."""
    if window is None or qpos < window:
        return None
    return within_window(
        torch.tensor([qpos], device=device), torch.arange(columns, device=device), window
    )[None, None]


def committed_columns(qpos: int, done: int, window: int | None, device) -> torch.Tensor | bool:
    """Which of the ``done`` committed columns (their positions) a query at ``qpos`` sees:
    all (True) without a window."""
    if window is None:
        return True
    return torch.arange(done, device=device) > qpos - window


class _Tree:
    """One EAGLE-2 draft tree as it grows: its nodes (token, parent, cumulative log-probability,
    depth), the head's output after feeding each fed node, and the draft cache column each fed
    node occupies. Shared by the batch-1 proposer and the batched one, so both grow and cut a
    tree by the same rules."""

    def __init__(self, root_hidden: torch.Tensor):
        self.root = root_hidden  # (H,): the head's output that predicts the first level
        self.tokens: list[int] = []
        self.parents: list[int] = []
        self.scores: list[float] = []
        self.depths: list[int] = []
        self.out: dict[int, torch.Tensor] = {}  # node -> head output after feeding it
        self.col: dict[int, int] = {}  # fed node -> its column in the draft's cache

    def add_children(self, nodes: list[int], logp: list, ids: list, d: int) -> list[int]:
        """The draft's top-k children (log-probabilities ``logp`` and tokens ``ids``, one row
        per node) of every node in ``nodes`` (-1: the root); returns the new nodes."""
        new = []
        for parent, lps, toks in zip(nodes, logp, ids, strict=True):
            base = self.scores[parent] if parent >= 0 else 0.0
            for lp, tok in zip(lps, toks, strict=True):
                if lp == float("-inf"):
                    break
                self.tokens.append(tok)
                self.parents.append(parent)
                self.scores.append(base + lp)
                self.depths.append(d)
                new.append(len(self.tokens) - 1)
        return new

    def expand(self, fed: list[int], out: torch.Tensor, logp: list, ids: list, d: int):
        """After feeding ``fed`` (the head's outputs ``out``, one row per node): their
        children at depth ``d``."""
        for r, v in enumerate(fed):
            self.out[v] = out[r]
        return self.add_children(fed, logp, ids, d)

    def frontier(self, level: list[int], top_k: int, log_min: float) -> list[int]:
        """The ``top_k`` nodes of ``level`` to feed next by cumulative score; none when even
        the best is below ``log_min`` (not likely enough to be accepted to be worth a step)."""
        best = sorted(level, key=lambda i: -self.scores[i])[:top_k]
        return best if best and self.scores[best[0]] >= log_min else []

    def inputs(self, frontier: list[int]) -> torch.Tensor:
        """(len(frontier), H): each node's parent's head output (the root's for level 1)."""
        return torch.stack(
            [self.root if self.parents[v] < 0 else self.out[self.parents[v]] for v in frontier]
        )

    def ancestor_columns(self, v: int) -> list[int]:
        """The cache columns of ``v`` and its fed ancestors: what its query attends to in the
        tree besides the committed context."""
        cols = []
        while v >= 0:
            if v in self.col:
                cols.append(self.col[v])
            v = self.parents[v]
        return cols

    def proposal(self, total_tokens: int, log_min: float) -> tuple[Proposal, list[float]]:
        """The tree to verify: the best ``total_tokens`` nodes by score (at least the best
        one), a parent before its children. A child never scores above its parent, so both
        cuts keep the tree ancestor-closed. Returns it and the kept nodes' scores."""
        s = self.scores
        order = sorted(range(len(self.tokens)), key=lambda i: (-s[i], self.depths[i], i))
        keep = [v for v in order[:total_tokens] if s[v] >= log_min] or order[:1]
        keep.sort(key=lambda i: (self.depths[i], -s[i], i))
        index = {v: j for j, v in enumerate(keep)}
        p = self.parents
        return (
            Proposal(
                [self.tokens[v] for v in keep], [index[p[v]] if p[v] >= 0 else -1 for v in keep]
            ),
            [s[v] for v in keep],
        )


def pair_block(states: list[DecodeState], firsts: list[int], ups: list[int], n: int):
    """Each row's committed pairs (f_t, x_{t+1}) for t = firsts[b]..ups[b]-1, right-aligned in
    n slots (left-padded): the tokens, positions and ``real`` marks (host, (k, n); padding at
    position 0) and each row's feature rows (None where it has no pair to feed)."""
    toks, pos, real = [], [], []  # built as lists, three tensors at the end (not 4 a row)
    feats: list[torch.Tensor | None] = []
    for st, u, d in zip(states, ups, firsts, strict=True):
        m = max(0, u - d)
        toks.append([0] * (n - m) + st.ids[d + 1 : u + 1])
        pos.append([0] * (n - m) + list(range(d, u)))
        real.append([False] * (n - m) + [True] * m)
        feats.append(st.features[d:u] if m else None)
    return (
        torch.tensor(toks, dtype=torch.long).view(len(ups), n),
        torch.tensor(pos, dtype=torch.long).view(len(ups), n),
        torch.tensor(real, dtype=torch.bool).view(len(ups), n),
        feats,
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
    def _feed(self, states, rows: list[int], upto: list[int], cache, valid, tail: int = 0):
        """Feed each row's committed pairs (f_t, x_{t+1}) for t = done..upto-1, left-padded to
        the longest (at least one query: a row with nothing to feed gets a masked one), then
        ``tail`` mask slots at the row's next positions (P-EAGLE's: ``head.mask_inputs``),
        causal, in the same forward. Returns the head output at each row's last pair and its
        tail slots (R, 1 + tail, H) and the new ``valid``."""
        head, dev = self.head, states[0].device
        n = max(1, max(u - self.done[r] for r, u in zip(rows, upto, strict=True))) + tail
        R = len(rows)
        h0 = torch.zeros(R, n, head.target.hidden_size, dtype=head._compute_dtype(), device=dev)
        end = n - tail  # pairs end here, tail slots follow
        toks, pos, real, fs = pair_block(states, [self.done[r] for r in rows], upto, end)
        for i, f in enumerate(fs):
            if f is not None:
                h0[i, end - len(f) : end] = head.initial_hidden(f)
        if tail:
            hm, _ = head.mask_inputs(tail)
            h0[:, end:] = hm.to(h0.dtype)
            toks = torch.cat([toks, torch.full((R, tail), head.cfg.mask_token_id)], dim=1)
            pos = torch.cat([pos, torch.tensor(upto)[:, None] + torch.arange(tail)], dim=1)
            real = torch.cat([real, torch.ones(R, tail, dtype=torch.bool)], dim=1)
        allowed = causal_mask(valid, real)
        window = head.target.draft_window
        if window is not None:
            kpos = torch.cat([column_positions(valid.cpu()), pos], dim=1)
            allowed &= within_window(pos, kpos, window)
        emb = head._embed(toks.to(dev))
        h = head.step(h0, emb, pos.to(dev), allowed[:, None].to(dev), cache)
        self.draft_calls += 1
        for r, u in zip(rows, upto, strict=True):
            self.done[r] = max(self.done[r], u)
        return h[:, end - 1 :], torch.cat([valid, real.to(valid.device)], dim=1)

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
        self.cache, self.valid = join_rows(self.cache, self.valid, cache, valid)

    def select(self, keep: list[int]) -> None:
        from ..ragged import keep_rows

        self.done = [self.done[i] for i in keep]
        self.cache, self.valid = keep_rows(self.cache, self.valid, keep)
        if not keep:
            self.draft_start = None

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
        h = h[:, 0]
        if small:  # a long catch-up is not what one more draft step costs
            times.append(time.perf_counter() - t)
        self.draft_start = self.valid.shape[1]
        tokens: list[list[int]] = [[] for _ in range(R)]
        qs: list[list[torch.Tensor]] = [[] for _ in range(R)]
        sampling, window = states[0].sampling, head.target.draft_window
        for i in range(top):
            t = time.perf_counter()
            if sampling.greedy:
                xs = head.top_tokens(h, 1)[1][:, 0].tolist()
            else:
                # as the batch-1 proposer: sampled over the draft's own vocabulary, each row
                # from its own random stream, q laid out over the target's vocabulary
                logits, offset = head.own_logits(h)
                q_own = warp(logits, sampling)
                q_all = head.to_target_vocab(q_own)  # every row's at once
                xs = [0] * R
                for b in range(R):
                    if i < gammas[b]:
                        j = sample(q_own[b], states[b].generator)
                        xs[b] = j + (int(offset[j]) if offset is not None else 0)
                        qs[b].append(q_all[b])
            for b in range(R):
                if i < gammas[b]:
                    tokens[b].append(xs[b])
            if i < top - 1:
                pos = torch.tensor([[len(s.ids) - 1 + i] for s in states], device=dev)
                allowed = torch.cat(
                    [self.valid[:, None, :].cpu(), torch.ones(R, 1, 1, dtype=torch.bool)], dim=2
                )
                if window is not None:  # the drafted columns are valid: positions in order
                    kpos = column_positions(allowed[:, 0])
                    allowed &= within_window(pos.cpu(), kpos, window)
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


class BatchedEagleTree(BatchedEagleChain):
    """EAGLE-2 dynamic trees for every row of the batched decoder: one head forward per tree
    level for all rows, each row growing its own tree by the batch-1 rules (``_Tree``).

    Each level appends as many columns to every row of the shared head cache as the widest
    frontier has nodes; a row's queries see its committed columns, their own fed ancestors and
    themselves (a row with a narrower or no frontier pads with queries that see only
    themselves). A row's tree stops where its batch-1 tree would (its depth, ``min_prob``);
    the others go on. After verification the tree columns are masked out, as the chain's
    drafted ones, and the accepted path is fed with its real features at the next catch-up.
    Its proposals are the batch-1 proposer's (tests/test_batch.py)."""

    def __init__(self, head: EagleHead, depth: int, top_k: int, total_tokens: int, log_min: float):
        super().__init__(head)
        self.depth, self.top_k, self.total_tokens, self.log_min = (
            depth,
            top_k,
            total_tokens,
            log_min,
        )
        self.last_scores: list[list[float]] = []

    @torch.no_grad()
    def propose(self, states: list[DecodeState], gammas: list[int]) -> list[Proposal]:
        head, dev = self.head, states[0].device
        depths = [min(self.depth, g) for g in gammas]
        R = len(states)
        if max(depths, default=0) < 1 or any(s.features is None or len(s.ids) < 2 for s in states):
            self.last_step_seconds = None
            return [Proposal([], []) for _ in states]
        t0 = time.perf_counter()
        h, self.valid = self._feed(
            states, list(range(R)), [len(s.ids) - 1 for s in states], self.cache, self.valid
        )
        h = h[:, 0]
        self.draft_start = start = self.valid.shape[1]
        committed = self.valid.cpu()
        window, kpos = head.target.draft_window, column_positions(committed)
        active = [b for b in range(R) if depths[b] >= 1]
        trees: dict[int, _Tree] = {b: _Tree(h[b]) for b in active}
        logp, ids = head.top_tokens(h[active], self.top_k)  # one LM-head product per level
        level = {
            b: trees[b].add_children([-1], [lp], [ix], 1)
            for b, lp, ix in zip(active, logp.tolist(), ids.tolist(), strict=True)
        }
        levels = 1
        for d in range(1, max(depths)):
            fronts = {
                b: f
                for b in active
                if d < depths[b] and (f := trees[b].frontier(level[b], self.top_k, self.log_min))
            }
            if not fronts:
                break
            levels += 1
            q, length = max(len(f) for f in fronts.values()), self.valid.shape[1]
            hidden = h.new_zeros(R, q, h.shape[-1])
            toks = torch.zeros(R, q, dtype=torch.long)
            pos = torch.zeros(R, q, dtype=torch.long)
            allowed = torch.zeros(R, q, length + q, dtype=torch.bool)
            allowed[:, torch.arange(q), length + torch.arange(q)] = True  # itself
            for b, f in fronts.items():
                t = trees[b]
                hidden[b, : len(f)] = t.inputs(f)
                toks[b, : len(f)] = torch.tensor([t.tokens[v] for v in f])
                pos[b, : len(f)] = len(states[b].ids) - 2 + d
                allowed[b, : len(f), :start] = committed[b]
                if window is not None:
                    allowed[b, : len(f), :start] &= kpos[b] > len(states[b].ids) - 2 + d - window
                for r, v in enumerate(f):
                    t.col[v] = length + r
                    allowed[b, r, t.ancestor_columns(v)] = True
            out = head.step(
                hidden, head._embed(toks.to(dev)), pos.to(dev), allowed[:, None].to(dev), self.cache
            )
            self.valid = torch.cat([self.valid, self.valid.new_zeros(R, q)], dim=1)
            self.draft_calls += 1
            bs = list(fronts)
            flat = torch.cat([out[b, : len(fronts[b])] for b in bs])
            logp, ids = head.top_tokens(flat, self.top_k)
            logp, ids, i = logp.tolist(), ids.tolist(), 0
            for b in bs:
                n = len(fronts[b])
                level[b] = trees[b].expand(
                    fronts[b], out[b, :n], logp[i : i + n], ids[i : i + n], d + 1
                )
                i += n
        # one level for the whole batch: one head forward and one LM head over every frontier
        self.last_step_seconds = (time.perf_counter() - t0) / levels
        out_props, self.last_scores = [], []
        for b in range(R):
            p, s = (
                trees[b].proposal(self.total_tokens, self.log_min)
                if b in trees
                else (Proposal([], []), [])
            )
            out_props.append(p)
            self.last_scores.append(s)
        return out_props
