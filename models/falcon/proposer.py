"""Falcon's proposers for the shared decoder: a chain of semi-autoregressive forwards (k tokens
each) and Falcon's tree."""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from ..base import BatchedProposer, DecodeState, Proposal, Proposer
from ..ragged import join_rows, keep_rows, left_padded, new_cache, tidy
from ..sampling import sample, warp

if TYPE_CHECKING:
    from .model import FalconHead, LSTMState


class FalconProposer(Proposer):
    """Keeps, for the committed (feature, next token) pairs, the LSTM's state after the last
    one, its outputs and the layer's keys/values. Forward 1 runs the block of the last k
    committed positions (reading the context before it) and predicts the features, hence the
    tokens, of the next k positions; each later forward feeds the previous forward's k
    predicted (feature, token) pairs as its block, continuing the LSTM from the committed state.
    Drafted entries are never cached, so nothing is rolled back."""

    name = "falcon"
    measures_steps = True
    feature_layers = (-1,)

    def __init__(self, head: FalconHead):
        self.head = self.method = head.eval()
        self.draft_calls = 0
        self.reset()

    def batched(self) -> BatchedFalcon | None:
        """The batched decoder's drafter: chains only (Falcon's tree drafts row by row)."""
        return BatchedFalcon(self.head) if type(self) is FalconProposer else None

    def reset(self) -> None:
        self.kv: tuple[torch.Tensor, torch.Tensor] | None = None  # (1, kvh, done, D) each
        self.xs: torch.Tensor | None = None  # (1, done, H) LSTM outputs
        self.state: LSTMState | None = None
        self.done = 0
        self.last_step_seconds = None

    def start(self, state: DecodeState) -> None:
        self.reset()
        if state.features is not None:
            self._catch_up(state)

    @torch.no_grad()
    def _catch_up(self, state: DecodeState) -> None:
        head = self.head
        n = state.features.shape[0]  # committed inputs: (f_t, x_{t+1}) for t < n
        if n <= self.done:
            return
        dev = state.device
        nxt = torch.tensor([state.ids[self.done + 1 : n + 1]], device=dev)
        xs, every = head.run_lstm(
            head.inputs(state.features[self.done : n, 0][None], nxt), self.state
        )
        self.state = [(h[:, -1], c[:, -1]) for h, c in every]
        k, v = head.context(xs, torch.arange(self.done, n, device=dev)[None])
        if self.kv is None:
            self.kv, self.xs = (k, v), xs
        else:
            self.kv = (torch.cat([self.kv[0], k], 2), torch.cat([self.kv[1], v], 2))
            self.xs = torch.cat([self.xs, xs], 1)
        self.done = n

    def _no_block(self, state: DecodeState) -> bool:
        """Nothing to draft from: fewer than k committed (feature, next token) pairs. Slot t
        of a block predicts f_{t+k}, so the slot that predicts the pending token's successor
        is the first of the block of the last k committed positions; with fewer, it would lie
        before position 0. Training never predicts from such a block (validation scores no
        such start), and a shorter block's outputs predict tokens past the ones it would be
        drafting for, so the first iterations are plain steps."""
        return state.features is None or len(state.ids) - 1 < self.head.cfg.k

    def _first_block(self) -> tuple[torch.Tensor, int]:
        """Forward 1: the block of the last k committed positions (``_no_block`` is False).
        Returns its outputs (k, H), the predicted features of positions done..done+k-1, and
        the block's first position."""
        head, e = self.head, self.done - 1
        s0 = e - head.cfg.k + 1
        xb = self.xs[:, s0 : e + 1][:, None]  # (1, 1, S, H)
        pos = torch.arange(s0, e + 1, device=xb.device)[None, None]
        kv = (self.kv[0][:, :, :s0], self.kv[1][:, :, :s0])
        return head.attend(xb, pos, kv, None)[0, 0], s0

    def _choose(self, feats: torch.Tensor, state: DecodeState):
        """Tokens after predicted features (m, H): argmax, or samples and their q."""
        logits = self.head.logits(feats)
        if state.sampling.greedy:
            return logits.argmax(-1).tolist(), None
        q = warp(logits, state.sampling)
        return [sample(q[i], state.generator) for i in range(len(q))], q

    def _advance(self, feats, tokens, lstm_state, start: int, kv_extra, allowed=None):
        """One later forward for A branches at once: their blocks of pairs (feats (A, m, H),
        tokens (A, m)) at positions start.., LSTM from ``lstm_state`` (per branch), reading the
        committed context plus ``kv_extra`` (keys/values of earlier draft blocks, appended
        after the committed ones; ``allowed`` (1, A, keys) picks a branch's). Returns outputs
        (A, m, H), the LSTM states after the block, and the block's keys/values."""
        head = self.head
        A, m, _ = feats.shape
        dev = feats.device
        xs, every = head.run_lstm(head.inputs(feats, tokens), lstm_state)
        pos = torch.arange(start, start + m, device=dev).expand(A, m)
        kb, vb = head.context(xs, pos)  # (A, kvh, m, D): this block's own keys, for later blocks
        k_ctx, v_ctx = self.kv
        if kv_extra is not None:
            k_ctx = torch.cat([k_ctx, kv_extra[0]], 2)
            v_ctx = torch.cat([v_ctx, kv_extra[1]], 2)
        out = head.attend(xs[None], pos[None], (k_ctx, v_ctx), allowed)[0]
        return out, [(h[:, -1], c[:, -1]) for h, c in every], (kb, vb)

    @torch.no_grad()
    def propose(self, state: DecodeState, gamma: int) -> Proposal:
        if self._no_block(state) or gamma < 1:
            self.last_step_seconds = None
            return Proposal([], [])
        t0 = time.perf_counter()
        self._catch_up(state)
        out, _ = self._first_block()
        tokens, q = self._choose(out, state)
        qs = [q] if q is not None else []
        feats, toks, lstm = out, tokens, self.state
        extra = None
        calls = 1
        while len(tokens) < gamma:
            start = self.done + len(tokens) - len(toks)
            out, lstm, (kb, vb) = self._advance(
                feats[None], torch.tensor([toks], device=state.device), lstm, start, extra
            )
            extra = (
                (kb, vb)
                if extra is None
                else (torch.cat([extra[0], kb], 2), torch.cat([extra[1], vb], 2))
            )
            feats = out[0]
            toks, q = self._choose(feats, state)
            tokens += toks
            if q is not None:
                qs.append(q)
            calls += 1
        self.draft_calls += calls
        tokens = tokens[:gamma]
        q = torch.cat(qs)[:gamma] if qs else None
        # one forward drafts k tokens: the decoder's cost model reads a per-token cost
        self.last_step_seconds = (time.perf_counter() - t0) / max(1, len(tokens))
        return Proposal.chain(tokens, q)


@dataclass
class _Branch:
    last: int  # the branch's last node
    feats: torch.Tensor  # (m, H) predicted features its block fed forward
    tokens: list[int]  # (m,) the tokens after them
    state: list  # LSTM state after the branch (per layer (h, c), each (H,))
    cols: list[int]  # columns of the draft keys it (and its ancestors) wrote


class FalconTreeProposer(FalconProposer):
    """Falcon's draft tree: ``depth`` forwards; at each, every frontier branch's block gives
    ``top_k`` children for its first slot, each followed by the argmax of the later slots (they
    come from the same forward, so siblings share them); the ``top_k`` branches of highest
    cumulative log-probability go on, batched in one forward with a mask over the draft keys
    of their ancestors. The ``total_tokens`` best nodes are verified (ancestor-closed: a
    node never scores above its parent). Deterministic (top-k), so q = None: the decoder
    verifies it with point-mass recursive rejection, exact at T > 0."""

    name = "falcon-tree"

    def __init__(self, head, depth: int = 3, top_k: int = 4, total_tokens: int = 16):
        super().__init__(head)
        for key, v in (("depth", depth), ("top_k", top_k), ("total_tokens", total_tokens)):
            if v < 1:
                raise ValueError(f"{key}={v}: must be >= 1")
        self.depth, self.top_k, self.total_tokens = depth, top_k, total_tokens
        self.tree_depth = depth * head.cfg.k
        self.tree_nodes = total_tokens

    @torch.no_grad()
    def propose(self, state: DecodeState, gamma: int) -> Proposal:
        head, dev = self.head, state.device
        if self._no_block(state) or gamma < 1:
            self.last_step_seconds = None
            return Proposal([], [])
        t0 = time.perf_counter()
        self._catch_up(state)
        depth = min(self.depth, math.ceil(gamma / head.cfg.k))
        tokens: list[int] = []
        parents: list[int] = []
        scores: list[float] = []
        depths: list[int] = []

        def children(parent: int, feats: torch.Tensor, base: float, d0: int):
            """Paths [c, argmax slot 2, ...] for the top_k c of slot 1 after ``parent``;
            returns (last node, tokens of the path) per path."""
            logp = head.logits(feats).log_softmax(-1)  # (m, V)
            top = logp[0].topk(min(self.top_k, logp.shape[-1]))
            rest_tok = logp[1:].argmax(-1).tolist()
            rest_lp = logp[1:].max(-1).values.tolist()
            paths = []
            for lp, c in zip(top.values.tolist(), top.indices.tolist(), strict=True):
                prev, s, toks = parent, base + lp, [c]
                tokens.append(c), parents.append(prev), scores.append(s), depths.append(d0)
                prev = len(tokens) - 1
                for j, (t, lpj) in enumerate(zip(rest_tok, rest_lp, strict=True), start=1):
                    s += lpj
                    tokens.append(t), parents.append(prev), scores.append(s)
                    depths.append(d0 + j)
                    prev = len(tokens) - 1
                    toks.append(t)
                paths.append((prev, toks))
            return paths

        out, _ = self._first_block()
        m = out.shape[0]
        branches = [
            _Branch(last, out, toks, self.state, []) for last, toks in children(-1, out, 0.0, 1)
        ]
        k_extra = v_extra = None
        n_extra = 0
        for level in range(1, depth):
            frontier = sorted(branches, key=lambda b: -scores[b.last])[: self.top_k]
            A = len(frontier)
            start = self.done + (level - 1) * m
            feats = torch.stack([b.feats for b in frontier])
            toks = torch.tensor([b.tokens for b in frontier], device=dev)
            lstm = [
                (
                    torch.stack([b.state[i][0].reshape(-1) for b in frontier]),
                    torch.stack([b.state[i][1].reshape(-1) for b in frontier]),
                )
                for i in range(len(head.lstm))
            ]
            allowed = None
            if n_extra:
                allowed = torch.zeros(1, A, self.done + n_extra, dtype=torch.bool, device=dev)
                allowed[..., : self.done] = True
                for r, b in enumerate(frontier):
                    allowed[0, r, [self.done + c for c in b.cols]] = True
            kv = (k_extra, v_extra) if n_extra else None
            out, states, (kb, vb) = self._advance(feats, toks, lstm, start, kv, allowed)
            new_cols = [[n_extra + r * m + j for j in range(m)] for r in range(A)]
            kb_flat = kb.permute(1, 0, 2, 3).reshape(1, kb.shape[1], A * m, -1)
            vb_flat = vb.permute(1, 0, 2, 3).reshape(1, vb.shape[1], A * m, -1)
            k_extra = kb_flat if k_extra is None else torch.cat([k_extra, kb_flat], 2)
            v_extra = vb_flat if v_extra is None else torch.cat([v_extra, vb_flat], 2)
            n_extra += A * m
            branches = []
            for r, b in enumerate(frontier):
                st = [(h[r], c[r]) for h, c in states]
                for last, ptoks in children(b.last, out[r], scores[b.last], level * m + 1):
                    branches.append(_Branch(last, out[r], ptoks, st, b.cols + new_cols[r]))
        self.draft_calls += depth
        # the last forward's block may reach past gamma (it drafts k levels at once): those
        # nodes are dropped, as a chain's tokens past gamma are (their ancestors stay)
        fits = [i for i in range(len(tokens)) if depths[i] <= gamma]
        order = sorted(fits, key=lambda i: (-scores[i], depths[i], i))
        keep = order[: self.total_tokens]
        keep.sort(key=lambda i: (depths[i], -scores[i], i))
        index = {v: j for j, v in enumerate(keep)}
        self.last_step_seconds = (time.perf_counter() - t0) / depth
        return Proposal(
            [tokens[v] for v in keep],
            [index[parents[v]] if parents[v] >= 0 else -1 for v in keep],
        )


class BatchedFalcon(BatchedProposer):
    """Falcon chains for every row of the batched decoder, one head forward per k tokens for
    the whole batch. Per row, as the batch-1 proposer: the LSTM's state after the committed
    pairs, the LSTM outputs of the last k committed positions (forward 1's block) and the
    layer's keys/values of the committed context, here in one ragged cache (left-padded,
    ``valid`` marks each row's columns; committed positions only, in order, never rolled
    back). Blocks are left-padded to k slots (a row's block is shorter while it has fewer
    than k committed positions; such a row drafts nothing, as ``FalconProposer._no_block``),
    padding masked as keys and skipped by the LSTM. Its proposals are the batch-1 proposer's
    (tests/test_batch.py)."""

    def __init__(self, head):
        self.head = head
        self.cache = None
        self.valid: torch.Tensor | None = None
        self.state: list | None = None  # per LSTM layer (h (R, H), c (R, H))
        self.tail: list[torch.Tensor] = []  # per row: LSTM outputs of its last <= k positions
        self.done: list[int] = []  # committed pairs each row's columns hold
        self.draft_calls = 0
        self.last_step_seconds = None

    @torch.no_grad()
    def _catch_up(self, states: list[DecodeState], rows: list[int], cache, valid):
        """Feed each row's committed pairs (f_t, x_{t+1}) for t = done..len(features)-1
        through the LSTM (from the row's state) and append their keys/values, left-padded to
        the longest (at least one column: a row with nothing gets a masked one). Returns the
        new ``valid``."""
        head, dev = self.head, states[0].device
        ups = [0 if s.features is None else s.features.shape[0] for s in states]
        news = [u - self.done[r] for r, u in zip(rows, ups, strict=True)]
        starts = [self.done[r] for r in rows]
        nxt, pos, real = left_padded(
            [s.ids[d + 1 : u + 1] for s, d, u in zip(states, starts, ups, strict=True)], starts
        )
        m = nxt.shape[1]
        feats = torch.zeros(len(rows), m, head.target.hidden_size, dtype=head._dtype(), device=dev)
        for i, (d, u, k) in enumerate(zip(starts, ups, news, strict=True)):
            if k > 0:
                feats[i, m - k :] = states[i].features[d:u, 0].to(feats.dtype)
        idx = torch.tensor(rows, device=dev)
        lstm = [(h[idx], c[idx]) for h, c in self.state]
        xs, every = head.run_lstm(head.inputs(feats, nxt.to(dev)), lstm, real.to(dev))
        for j, (h, c) in enumerate(every):
            self.state[j][0][idx] = h[:, -1].to(self.state[j][0].dtype)
            self.state[j][1][idx] = c[:, -1].to(self.state[j][1].dtype)
        k_new, v_new = head.context(xs, pos.to(dev))
        cache.update(k_new, v_new, 0)
        for i, (r, k) in enumerate(zip(rows, news, strict=True)):
            if k > 0:
                self.tail[r] = torch.cat([self.tail[r], xs[i, m - k :]])[-head.cfg.k :]
                self.done[r] = ups[i]
        return torch.cat([valid, real.to(valid.device)], dim=1)

    def join(self, states: list[DecodeState]) -> None:
        head, dev = self.head, states[0].device
        n, H = len(states), head.lstm[0].hidden_size
        zero = [(torch.zeros(n, H, device=dev), torch.zeros(n, H, device=dev)) for _ in head.lstm]
        self.state = (
            zero
            if self.state is None
            else [
                (torch.cat([h, h0.to(h.dtype)]), torch.cat([c, c0.to(c.dtype)]))
                for (h, c), (h0, c0) in zip(self.state, zero, strict=True)
            ]
        )
        base = len(self.done)
        self.done.extend([0] * n)
        self.tail.extend([torch.zeros(0, head.target.hidden_size, device=dev)] * n)
        cache = new_cache(None)
        valid = torch.zeros(n, 0, dtype=torch.bool, device=dev)
        valid = self._catch_up(states, list(range(base, base + n)), cache, valid)
        self.cache, self.valid = join_rows(self.cache, self.valid, cache, valid)

    def select(self, keep: list[int]) -> None:
        self.done = [self.done[i] for i in keep]
        self.tail = [self.tail[i] for i in keep]
        self.state = [(h[keep], c[keep]) for h, c in self.state] if keep else None
        self.cache, self.valid = keep_rows(self.cache, self.valid, keep)

    def _tokens(self, out, real, states, rows, qs):
        """Each listed row's tokens after its predicted features ``out`` (R, k, H) at its
        ``real`` slots: argmax, or samples from the row's stream (their q appended to
        ``qs[b]``), slot by slot as the batch-1 proposer draws them."""
        logits = self.head.logits(out[rows])  # (len(rows), k, V)
        toks: dict[int, list[int]] = {}
        for i, b in enumerate(rows):
            lg = logits[i][real[b]]
            if states[b].sampling.greedy:
                toks[b] = lg.argmax(-1).tolist()
            else:
                q = warp(lg, states[b].sampling)
                toks[b] = [sample(q[j], states[b].generator) for j in range(len(q))]
                qs[b].append(q)
        return toks

    @torch.no_grad()
    def propose(self, states: list[DecodeState], gammas: list[int]) -> list[Proposal]:
        head = self.head
        if max(gammas, default=0) < 1 or any(s.features is None or len(s.ids) < 2 for s in states):
            self.last_step_seconds = None
            return [Proposal([], []) for _ in states]
        t0 = time.perf_counter()
        R, dev, K = len(states), states[0].device, head.cfg.k
        news = [s.features.shape[0] - d for s, d in zip(states, self.done, strict=True)]
        if max(news) > 0:
            self.valid = self._catch_up(states, list(range(R)), self.cache, self.valid)
        # a row with fewer than k committed pairs drafts nothing (``FalconProposer._no_block``)
        gammas = [g if d >= K else 0 for g, d in zip(gammas, self.done, strict=True)]
        if max(gammas) < 1:
            self.last_step_seconds = None
            return [Proposal([], []) for _ in states]
        # forward 1: each row's block of its last <= k committed positions, reading the
        # committed context before it (only the rows with k of them take tokens)
        sizes = [len(t) for t in self.tail]  # slots per block, k once a row has k positions
        real = torch.zeros(R, K, dtype=torch.bool, device=dev)
        xb = torch.zeros(R, K, self.tail[0].shape[-1], dtype=self.tail[0].dtype, device=dev)
        pos = torch.zeros(R, K, dtype=torch.long, device=dev)
        for b, (t, s) in enumerate(zip(self.tail, sizes, strict=True)):
            xb[b, K - s :] = t
            pos[b, K - s :] = torch.arange(self.done[b] - s, self.done[b], device=dev)
            real[b, K - s :] = True
        after = self.valid.flip(1).cumsum(1).flip(1)  # valid columns at or after each one
        n_blk = torch.tensor(sizes, device=dev)[:, None]
        before = self.valid & (after > n_blk)  # the context before each row's block
        kv = (self.cache.layers[0].keys, self.cache.layers[0].values)
        out = head.attend(xb[:, None], pos[:, None], kv, before[:, None], real[:, None])[:, 0]
        calls = 1
        rows = [b for b in range(R) if gammas[b] >= 1]
        qs: list[list[torch.Tensor]] = [[] for _ in range(R)]
        toks = self._tokens(out, real, states, rows, qs)
        tokens = {b: list(toks[b]) for b in rows}
        # later forwards: each row's previous block of predicted (feature, token) pairs,
        # continuing the LSTM from the committed state, reading the committed context and
        # its own earlier draft blocks
        lstm = [(h.clone(), c.clone()) for h, c in self.state]
        k_ex = v_ex = ex_valid = None
        while True:
            rows = [b for b in rows if len(tokens[b]) < gammas[b]]
            if not rows:
                break
            nxt = torch.zeros(R, K, dtype=torch.long)
            bpos = torch.zeros(R, K, dtype=torch.long, device=dev)
            for b in rows:
                s = sizes[b]
                nxt[b, K - s :] = torch.tensor(toks[b])
                start = self.done[b] + len(tokens[b]) - s
                bpos[b, K - s :] = torch.arange(start, start + s, device=dev)
            xs, every = head.run_lstm(head.inputs(out, nxt.to(dev)), lstm, real)
            lstm = [(h[:, -1], c[:, -1]) for h, c in every]
            kb, vb = head.context(xs, bpos)
            ctx_k, ctx_v = kv
            allowed = self.valid
            if k_ex is not None:
                ctx_k, ctx_v = torch.cat([ctx_k, k_ex], 2), torch.cat([ctx_v, v_ex], 2)
                allowed = torch.cat([allowed, ex_valid], 1)
            out = head.attend(
                xs[:, None], bpos[:, None], (ctx_k, ctx_v), allowed[:, None], real[:, None]
            )[:, 0]
            k_ex = kb if k_ex is None else torch.cat([k_ex, kb], 2)
            v_ex = vb if v_ex is None else torch.cat([v_ex, vb], 2)
            ex_valid = real if ex_valid is None else torch.cat([ex_valid, real], 1)
            calls += 1
            toks = self._tokens(out, real, states, rows, qs)
            for b in rows:
                tokens[b] += toks[b]
        self.draft_calls += calls
        props = []
        for b in range(R):
            if gammas[b] < 1:
                props.append(Proposal([], []))
                continue
            q = torch.cat(qs[b])[: gammas[b]] if qs[b] else None
            props.append(Proposal.chain(tokens[b][: gammas[b]], q))
        n_tok = max(1, max(len(p) for p in props))
        # one forward drafts k tokens for every row: a per-token cost, as the batch-1 proposer
        self.last_step_seconds = (time.perf_counter() - t0) / n_tok if max(news) <= 8 else None
        return props

    def rollback(self, states: list[DecodeState], accepted: list[int]) -> None:
        if self.valid is not None:
            self.valid = tidy(self.cache, self.valid)  # columns of rows that left
