"""EAGLE drafting on fixed shapes: the decoders' static path (``compile=true``). Chains and
EAGLE-2 trees, at batch 1 (``StaticEagleChain``, ``StaticEagleTree``) and for every row of the
batched decoder (``StaticBatchedEagleChain``, ``StaticBatchedEagleTree``).

The eager proposer (``proposer.py``) feeds the head through a ``DynamicCache`` that grows and
is cropped every iteration and reads each drafted token back to the host before drafting the
next (a device sync per token). Here the head's keys and values live in a preallocated buffer
(``StaticDraftKV``, behind the one method transformers' attention calls on a cache), a
drafting iteration is one function of fixed shapes (the catch-up on the newly committed pairs,
padded to gamma_max + 1 rows, then gamma draft steps, each token chosen on the device) and one
host read at its end; on CUDA that function is captured as a CUDA graph per gamma, so a whole
proposal is one replay (SGLang's captured multi-step draft). The head's own ``step`` computes
every step, so EAGLE-1, EAGLE-3 and HASS heads draft the same tokens on both paths (up to the
rounding of a padded matmul). T > 0 samples each token by the inverse CDF at a uniform drawn
from the decoder's generator before the replay, so the proposal's q is the law it was drawn
from: verification stays exact.
"""

from __future__ import annotations

import functools
import math
import time
from typing import TYPE_CHECKING

import torch

from ..base import BatchedProposer, DecodeState, Proposal
from ..lean import Captured, RaggedColumns, key_positions, round_up, row_buckets, visible_columns
from ..ragged import causal_mask, causal_window, within_window
from ..sampling import inverse_cdf, warp
from .proposer import EagleProposer, EagleTreeProposer, _Tree, pair_block

if TYPE_CHECKING:
    from .model import EagleHead


class StaticDraftKV:
    """The draft layer's keys and values in a preallocated (1, kv_heads, max_len, head_dim)
    buffer. transformers' attention calls ``update`` with the new keys and values; they are
    written at ``columns`` (a device tensor set before each step) and the first ``span``
    columns are returned to attend over (the step's mask says which of them each query sees).
    Allocated on the first update, when the head's shapes are known."""

    def __init__(self, max_len: int):
        self.max_len = max_len
        self.k: torch.Tensor | None = None
        self.v: torch.Tensor | None = None
        self.columns: torch.Tensor | None = None
        self.span = max_len
        # with ``columns`` None, a step appends after ``length`` entries and attends to all of
        # them (a DynamicCache's behaviour: the eager proposer's token-by-token drafting)
        self.length = 0

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        if self.k is None:
            B, h, _, d = key_states.shape
            shape = (B, h, self.max_len, d)
            self.k = key_states.new_zeros(shape)
            self.v = value_states.new_zeros(shape)
        if self.columns is None:
            q = key_states.shape[2]
            end = self.length + q
            self.k[:, :, self.length : end] = key_states
            self.v[:, :, self.length : end] = value_states
            self.length = end
            return self.k[:, :, :end], self.v[:, :, :end]
        self.k.index_copy_(2, self.columns, key_states)
        self.v.index_copy_(2, self.columns, value_states)
        return self.k[:, :, : self.span], self.v[:, :, : self.span]


class StaticEagleChain(EagleProposer):
    """An EAGLE head's chain on fixed shapes (see the module docstring). ``graphs``: ``cuda``
    (captured), ``emulate`` (the same buffers and shapes run eagerly: tests) or ``off`` (eager
    at fixed shapes). Chains only; with a stop rule or signals asked for it drafts as the
    eager proposer does (those decide token by token on the host)."""

    name = "eagle-static"

    def __init__(self, head: EagleHead, gamma_max: int, graphs: str = "off", max_len: int = 2048):
        super().__init__(head)
        if gamma_max < 1:
            raise ValueError(f"gamma={gamma_max}: a static chain drafts at least one token")
        self.gamma_max, self.graphs = gamma_max, graphs
        self.width = gamma_max + 1  # committed pairs fed per iteration (accepted + 1)
        self.capture_seconds = 0.0
        self._alloc(max_len)

    # -- buffers and graphs ------------------------------------------------------------

    def _extra(self, gamma: int) -> int:
        """Draft-cache columns a proposal of ``gamma`` writes past the committed pairs."""
        return gamma

    def _alloc(self, max_len: int) -> None:
        head = self.head
        dev = head.target.device
        self.kv = StaticDraftKV(round_up(max_len + self.width + self._extra(self.gamma_max)))
        L = len(self.feature_layers)
        H = head.target.hidden_size
        dtype = head.target.dtype
        self.f_buf = torch.zeros(self.width, L, H, dtype=dtype, device=dev)
        self.x_buf = torch.zeros(1, self.width, dtype=torch.long, device=dev)
        self.done_t = torch.zeros((), dtype=torch.long, device=dev)
        self.last_t = torch.zeros((), dtype=torch.long, device=dev)  # real pairs - 1
        self.u_buf = torch.zeros(self.gamma_max, dtype=torch.float64, device=dev)
        self.rows = torch.arange(self.width, device=dev)
        self.cols = torch.arange(self.kv.max_len, device=dev)
        self._graphs: dict[tuple[int, object], Captured] = {}
        self._span = self.kv.max_len
        self._pool = None
        self.cache = self.kv  # what EagleProposer's eager catch-up writes through

    def reserve(self, total: int) -> None:
        if total + self.width + self._extra(self.gamma_max) > self.kv.max_len:
            self._alloc(max(total, 2 * self.kv.max_len))

    def _lengths(self) -> range | tuple[int, ...]:
        """The proposal lengths captured together at first use, the longest first."""
        return range(self.gamma_max, 0, -1)

    def _graph(self, gamma: int, sampling) -> Captured:
        """The proposal function for ``gamma`` tokens under ``sampling``. On first use for a
        sampling setting, every length of ``_lengths`` is captured at once (an adaptive
        controller then never pays a capture inside a timed run)."""
        if self.deterministic:
            sampling = None  # the draft's top choices: the same function at every temperature
        if (gamma, sampling) not in self._graphs:
            # warm-up and capture write at the last columns, which no sequence reaches
            self.done_t.fill_(self.kv.max_len - self.width - self._extra(self.gamma_max))
            self.last_t.fill_(self.width - 1)
            for g in self._lengths():  # the longest first: the rest share its pool
                fn = functools.partial(self._draft, g, sampling)
                cap = Captured(fn, self.graphs != "cuda", self._pool)
                self._pool = cap.pool
                self._graphs[(g, sampling)] = cap
                self.capture_seconds += cap.seconds
        return self._graphs[(gamma, sampling)]

    def _mask(self, query_cols: torch.Tensor) -> torch.Tensor:
        """(1, 1, Q, span): each query sees the columns up to its own (stale entries past
        it, left by padding or by an earlier draft, are never seen), within the target's
        ``draft_window`` (a column's position is its number)."""
        window = self.head.target.draft_window
        return causal_window(query_cols, self.cols[: self.kv.span], window)[None, None]

    def _draft(self, gamma: int, sampling) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The whole proposal on the static buffers: catch up on the committed pairs in
        ``f_buf``/``x_buf`` (rows past ``last_t`` are padding), then ``gamma`` draft tokens.
        Returns the tokens (gamma,) and, at T > 0, q over the target vocabulary (gamma, V)."""
        head, kv = self.head, self.kv
        # a graph attends over every column (masked past the used ones); eager, over the used
        # ones only (``_span``, set by ``propose``): over all 2,304 columns a proposal of 3
        # cost the shipped head 12.6 ms on the AMX Xeon, over the used ones 10.4
        kv.span = self._span if self.graphs == "off" else kv.max_len
        pos = self.done_t + self.rows
        kv.columns = pos
        h0 = head.initial_hidden(self.f_buf)[None]
        h = head.step(h0, head._embed(self.x_buf), pos[None], self._mask(pos), kv)
        h = h.index_select(1, self.last_t.view(1))  # (1, 1, H): predicts the pending token
        col = self.done_t + self.last_t + 1  # where the first drafted token is fed
        toks, qs = [], []
        for i in range(gamma):
            x, q = _draft_tokens(head, h[0], sampling, self.u_buf[i : i + 1])
            x = x[0]
            if q is not None:
                qs.append(q[0])
            toks.append(x)
            if i < gamma - 1:
                c = (col + i).view(1)
                kv.columns = c
                h = head.step(h, head._embed(x.view(1, 1)), c.view(1, 1), self._mask(c), kv)
        return torch.stack(toks), torch.stack(qs) if qs else None

    # -- the proposer contract ---------------------------------------------------------

    def start(self, state: DecodeState) -> None:
        self.reset()
        self.cache = self.kv
        self.reserve(len(state.ids))
        if len(state.ids) > 2:
            self._catch_up(state, upto=len(state.ids) - 2)

    def reset(self) -> None:
        self.done = 0
        self.last_step_seconds = None

    @torch.no_grad()
    def _catch_up(self, state: DecodeState, upto: int) -> torch.Tensor:
        """Eager catch-up at exact shapes (the prompt, or pairs beyond one graph's width)."""
        kv = self.kv
        kv.columns = torch.arange(self.done, upto, device=state.device)
        kv.span = upto
        self.reserve(upto)
        keys = torch.arange(upto, device=state.device)
        mask = causal_window(kv.columns, keys, self.head.target.draft_window)[None, None]
        head = self.head
        emb = head._embed(torch.tensor([state.ids[self.done + 1 : upto + 1]], device=state.device))
        h0 = head.initial_hidden(state.features[self.done : upto])
        h = head.step(h0[None], emb, kv.columns[None], mask, kv)
        self.done = upto
        kv.columns, kv.length = None, upto  # later eager steps append after the pairs
        self.draft_calls += 1
        return h

    def _fixed(self, state: DecodeState, gamma: int) -> bool:
        """Whether this proposal runs on the fixed shapes (else the eager proposer's way)."""
        return not (state.signals or state.stop is not None or gamma > self.gamma_max)

    @torch.no_grad()
    def propose(self, state: DecodeState, gamma: int) -> Proposal:
        if not self._fixed(state, gamma):
            return self._eager_propose(state, gamma)
        n = len(state.ids)
        if self._no_context(state) or gamma < 1:
            self.last_step_seconds = None
            return Proposal([], [])
        t = time.perf_counter()
        upto = n - 1
        if upto - self.done > self.width:  # the head sat idle: feed the older pairs first
            self._catch_up(state, upto - self.width)
        g = self._graph_length(gamma)  # the graph that drafts it (a tree: its full depth)
        graph = self._graph(g, state.sampling)  # captured before its inputs are set
        m = upto - self.done  # 1..width committed pairs to feed
        self.f_buf[:m] = state.features[self.done : upto]
        ids = torch.zeros(self.width, dtype=torch.long)
        ids[:m] = torch.tensor(state.ids[self.done + 1 : upto + 1])
        self.x_buf.copy_(ids[None].to(self.x_buf.device, non_blocking=True))
        self.done_t.fill_(self.done)
        self.last_t.fill_(m - 1)
        self._span = self.done + self.width + self._extra(g)
        if not state.sampling.greedy and not self.deterministic:
            self.u_buf[:gamma] = torch.rand(
                gamma, generator=state.generator, dtype=torch.float64, device=state.device
            )
        out = graph()
        self.done = upto
        self.draft_calls += g
        prop = self._proposal(out)  # the iteration's one read of the device
        self.last_step_seconds = (time.perf_counter() - t) / g
        return prop

    def _graph_length(self, gamma: int) -> int:
        """The length of the captured proposal that drafts ``gamma`` tokens (a chain has one
        per length)."""
        return gamma

    #: a proposal's tokens are the draft's top choices, never sampled (an EAGLE-2 tree)
    deterministic = False

    def _proposal(self, out) -> Proposal:
        toks, q = out
        return Proposal.chain(toks.tolist(), q.clone() if q is not None else None)

    #: the eager proposer whose ``propose`` drafts what the fixed shapes do not
    _eager = EagleProposer

    def _eager_propose(self, state: DecodeState, gamma: int) -> Proposal:
        """The eager proposer's draft (token-by-token host decisions) on the static cache."""
        self.kv.columns, self.kv.length = None, self.done
        return self._eager.propose(self, state, gamma)

    def rollback(self, state: DecodeState, n_accepted: int) -> None:
        """Nothing to cut: drafted entries sit past ``done`` and no later query sees them."""


def _draft_tokens(head: EagleHead, h: torch.Tensor, sampling, u: torch.Tensor):
    """The next draft token after each row of h (R, H), on the device: the draft's argmax, or
    at T > 0 a draw by the inverse CDF at u (R,) from the warped draft distribution, with that
    distribution q over the target vocabulary (R, V) (None when greedy)."""
    if sampling.greedy:
        return head.top_tokens(h, 1)[1][:, 0], None
    logits, offset = head.own_logits(h)
    q_own = warp(logits, sampling)
    j = inverse_cdf(q_own, u)
    # index_select, not offset[j]: an index tensor read on the host breaks a graph's capture
    x = j + offset.index_select(0, j) if offset is not None else j
    return x, head.to_target_vocab(q_own)


class StaticEagleTree(StaticEagleChain):
    """EAGLE-2's dynamic tree (``EagleTreeProposer``'s rules) on fixed shapes: the catch-up,
    then ``depth - 1`` levels of ``top_k`` frontier nodes fed in one head step each, the
    frontier chosen on the device (the ``top_k`` best-scoring nodes of the level), and one host
    read at the end of every node's token, parent and score, from which the host keeps the
    ``total_tokens`` best as the eager tree does (``_Tree.proposal``). Every level is computed
    in full: ``min_prob``'s early stop only spares compute, and a node below it is never kept
    (a child never scores above its parent), so the kept tree is the eager one (up to the
    order of exact ties and the rounding of float32 sums of log-probabilities). On CUDA the
    whole tree is one graph replay (SGLang's captured draft loop)."""

    name = "eagle-tree-static"
    gives_signals = False
    deterministic = True

    def __init__(
        self,
        head: EagleHead,
        depth: int,
        top_k: int,
        total_tokens: int,
        min_prob: float = 0.0,
        graphs: str = "off",
        max_len: int = 2048,
    ):
        self.top_k = top_k
        super().__init__(head, depth, graphs, max_len)
        self.depth, self.total_tokens = depth, total_tokens
        self.log_min = math.log(min_prob) if min_prob > 0 else float("-inf")
        self.tree_depth, self.tree_nodes = depth, total_tokens
        self.last_scores: list[float] = []

    def _extra(self, gamma: int) -> int:
        return (gamma - 1) * self.top_k  # the fed frontier nodes of levels 1..depth-1

    def _alloc(self, max_len: int) -> None:
        super()._alloc(max_len)
        # the deepest level a proposal keeps: the graph always grows every level, and the
        # nodes below this one score -inf before the best are chosen (a shallower tree, near
        # a reply's budget, is then the same graph: drafted the eager way it took ~60 host
        # reads, and on a GPU a tree proposal averaged 4.85 ms, docs/benchmarks.md, 2026-11-27/28)
        self.cap_t = torch.zeros((), dtype=torch.long, device=self.f_buf.device)
        self.level = tree_levels(self.top_k, self.gamma_max, self.f_buf.device)

    def _fixed(self, state: DecodeState, gamma: int) -> bool:
        return 1 <= gamma <= self.depth  # a shallower tree: the same graph, cut (``cap_t``)

    def _lengths(self) -> tuple[int, ...]:
        return (self.depth,)  # one graph, for the full depth

    def _graph_length(self, gamma: int) -> int:
        self.cap_t.fill_(gamma)
        return self.depth

    def _draft(self, depth: int, sampling) -> torch.Tensor:
        """The tree on the static buffers; returns (4, total_tokens) float64 for its best
        nodes: each one's number (level by level), token, parent's number (-1 for the first
        level) and cumulative log-probability."""
        head, kv, K = self.head, self.kv, self.top_k
        window = head.target.draft_window
        kv.span = self._span if self.graphs == "off" else kv.max_len
        pos = self.done_t + self.rows
        kv.columns = pos
        h0 = head.initial_hidden(self.f_buf)[None]
        h = head.step(h0, head._embed(self.x_buf), pos[None], self._mask(pos), kv)
        root = h.index_select(1, self.last_t.view(1))[0]  # (1, H): predicts the first level
        base = self.done_t + self.last_t + 1  # the first fed tree node's column and position
        cols = self.cols[: kv.span]
        logp, ids = head.top_tokens(root, K)
        scores, tokens = [logp[0].float()], [ids[0]]
        parents = [torch.full_like(ids[0], -1)]
        level_s, level_t, offset = scores[0], tokens[0], 0  # the newest level's candidates
        slots = torch.arange(K, device=root.device)
        amask = out = None
        for d in range(1, depth):
            f_s, f_i = level_s.topk(K)  # the frontier: the level's K best
            f_tok = level_t.index_select(0, f_i)
            if d == 1:
                inp = root.expand(K, root.shape[-1])
                prev = None
            else:
                prev = f_i // K  # the frontier node's parent: a fed node of the last level
                inp = out.index_select(0, prev)
            own = base + (d - 1) * K + slots  # the frontier's draft-cache columns
            seen = cols[None, :] == own[:, None]
            seen = (
                seen | (cols < base)[None, :]
                if prev is None
                else seen | amask.index_select(0, prev)
            )
            if window is not None:  # the committed columns within this level's window
                seen = seen & ((cols >= base) | (cols > base + d - 1 - window))[None, :]
            kv.columns = own
            p = (base + d - 1).expand(1, K)
            out = head.step(inp[None], head._embed(f_tok[None]), p, seen[None, None], kv)[0]
            amask = seen
            lp, ci = head.top_tokens(out, K)  # (K, K): each frontier node's children
            level_s = (f_s[:, None] + lp.float()).reshape(-1)
            level_t = ci.reshape(-1)
            f_gid = offset + f_i  # global numbers of the frontier nodes
            offset += K if d == 1 else K * K
            scores.append(level_s)
            tokens.append(level_t)
            parents.append(f_gid[:, None].expand(K, K).reshape(-1))
        # the best ``total_tokens`` nodes by score, ties by number (so by depth, then order:
        # the eager tree's key), chosen here: the host reads those, not every node. A kept
        # node's parent is kept too (a child never scores above its parent, and a tie sorts
        # the parent, numbered first, before it)
        sc = torch.cat(scores)
        sc = torch.where(self.level <= self.cap_t, sc, float("-inf"))  # levels past the cap
        best = torch.sort(sc, descending=True, stable=True).indices[: self.total_tokens]
        return torch.stack(
            [
                best.double(),
                torch.cat(tokens).index_select(0, best).double(),
                torch.cat(parents).index_select(0, best).double(),
                sc.index_select(0, best).double(),
            ]
        )

    def _proposal(self, out: torch.Tensor) -> Proposal:
        prop, self.last_scores = best_nodes_tree(
            out.tolist(), self.top_k, self.total_tokens, self.log_min
        )
        return prop

    _eager = EagleTreeProposer


def best_nodes_tree(
    rows: list[list[float]], top_k: int, total_tokens: int, log_min: float
) -> tuple[Proposal, list[float]]:
    """The tree from a fixed-shape tree's one read: ``rows`` holds the best nodes' numbers
    (level by level: ``top_k`` at the first, ``top_k``^2 at each next), tokens, parents'
    numbers and scores, kept by the eager tree's rules (``_Tree.proposal``: ``min_prob``, a
    parent before its children). Returns the proposal and the kept nodes' scores."""
    K = top_k
    tree = _Tree(None)
    keep = {}  # device node -> host node (nodes of -inf score and their subtrees dropped)
    for v, t, p, s in sorted(zip(*rows, strict=True)):  # by number: parents first
        v, p = int(v), int(p)
        if s == float("-inf") or (p >= 0 and p not in keep):
            continue
        keep[v] = len(tree.tokens)
        tree.tokens.append(int(t))
        tree.parents.append(keep[p] if p >= 0 else -1)
        tree.scores.append(s)
        tree.depths.append(1 if v < K else 2 + (v - K) // (K * K))
    return tree.proposal(total_tokens, log_min)


def tree_levels(top_k: int, depth: int, device) -> torch.Tensor:
    """The level (1-based) of every node of a fixed-shape tree, in its numbering."""
    K = top_k
    return torch.cat(
        [torch.ones(K, dtype=torch.long)]
        + [torch.full((K * K,), d + 1, dtype=torch.long) for d in range(1, depth)]
    ).to(device)


class _BatchDraftKV:
    """The head's keys and values for B rows in one static buffer (1, 2, B, kv_heads, max_len,
    head_dim), the layout ``RaggedColumns`` keeps: transformers' attention calls ``update``;
    the new keys go to rows ``rows`` at ``columns`` (device tensors, the same for every row)
    and the first ``span`` columns of those rows are attended over (the step's mask says which
    each query sees)."""

    def __init__(self, kv: torch.Tensor):
        self.kv, self.rows, self.columns, self.span = kv, slice(None), None, kv.shape[4]

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        k, v = self.kv[0, 0, self.rows], self.kv[0, 1, self.rows]
        k.index_copy_(2, self.columns, key_states)
        v.index_copy_(2, self.columns, value_states)
        return k[:, :, : self.span], v[:, :, : self.span]


class StaticBatchedEagleChain(BatchedProposer):
    """EAGLE chains for every row of the batched decoder on fixed shapes: the batched form of
    ``StaticEagleChain`` (``BatchedEagleChain``'s proposals, drafted as one function per row
    bucket and chain length, captured as a CUDA graph on CUDA).

    The head's cache is a static buffer of ``batch_size`` rows sharing columns, each row
    attending to its own (``RaggedColumns``, as the target's static batch cache). A proposal
    feeds every row's newly committed pairs (1 to gamma + 1 of them, left-padded to gamma + 1)
    as one block of columns after the frontier, then drafts gamma tokens for all rows, one
    head step each, in the columns after the block; the block's real pairs stay, the drafted
    columns are written over by the next block. One host read a proposal (the tokens). At
    T > 0 each row's tokens are drawn by the inverse CDF at uniforms from its own generator,
    drawn before the replay, so each proposal's q is the law it was drawn from."""

    def __init__(
        self, head: EagleHead, batch_size: int, gamma_max: int, graphs: str, max_len: int = 2048
    ):
        if gamma_max < 1:
            raise ValueError(f"gamma={gamma_max}: a static chain drafts at least one token")
        self.head, self.batch_size, self.gamma_max, self.graphs = (
            head,
            batch_size,
            gamma_max,
            graphs,
        )
        self.width = gamma_max + 1
        self.buckets = row_buckets(batch_size)
        self.draft_calls = 0
        self.last_step_seconds = None
        self.capture_seconds = 0.0
        self._prepared: set = set()  # the samplings whose graphs ``prepare`` captured
        self._alloc(max_len)

    def _alloc(self, max_len: int) -> None:
        head = self.head
        attn = (getattr(head, "midlayer", None) or head.layer).self_attn
        cfg = attn.config
        kv_heads = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
        dev, dtype, B = head.target.device, head._compute_dtype(), self.batch_size
        extra = self._extra(self.gamma_max)
        L = round_up(max_len + self.width + extra)
        kv = torch.zeros(1, 2, B, kv_heads, L, attn.head_dim, dtype=dtype, device=dev)
        self.kv = _BatchDraftKV(kv)
        self.cols = RaggedColumns(kv, L - self.width - extra)
        self.done: list[int] = []
        W, nL, H = self.width, len(head.feature_layers), head.target.hidden_size
        self.f_buf = torch.zeros(B, W, nL, H, dtype=head.target.dtype, device=dev)
        self.x_buf = torch.zeros(B, W, dtype=torch.long, device=dev)
        self.p_buf = torch.zeros(B, W, dtype=torch.long, device=dev)
        self.real = torch.zeros(B, W, dtype=torch.bool, device=dev)
        self.base = torch.zeros((), dtype=torch.long, device=dev)
        self.u_buf = torch.zeros(B, self.gamma_max, dtype=torch.float64, device=dev)
        self.all_cols = torch.arange(L, device=dev)
        self.slots = torch.arange(W, device=dev)
        self._graphs: dict = {}
        self._pool = None

    def reset(self) -> None:
        self.cols.reset()
        self.done = []
        self.last_step_seconds = None

    def _extra(self, gamma: int) -> int:
        """Columns a proposal of ``gamma`` writes after its block of committed pairs."""
        return gamma

    def reserve(self, total: int) -> None:
        if total + self.width + self._extra(self.gamma_max) > self.cols.capacity:
            if self.cols.rows:
                raise ValueError("reserve() with rows in the draft cache: call it before a run")
            self.capture_seconds = 0.0
            self._alloc(max(total, 2 * self.cols.capacity))
            for sampling in self._prepared:  # captured again now, not inside a timed run
                self.prepare(sampling)

    # -- the fixed-shape function --------------------------------------------------------

    def prepare(self, sampling) -> None:
        """Capture the function of every row bucket and chain length for ``sampling`` now
        (before anything is timed: a capture inside a timed run would count in it)."""
        self._prepared.add(sampling)
        for b in self.buckets:
            for g in self._lengths():
                self._graph(b, g, sampling)

    def _lengths(self) -> range | tuple[int, ...]:
        """The proposal lengths captured per row bucket."""
        return range(1, self.gamma_max + 1)

    def _graph(self, bucket: int, gamma: int, sampling) -> Captured:
        key = (bucket, gamma, sampling)
        if key not in self._graphs:
            # warm-up and capture write at the last columns, which no row reaches
            self.base.fill_(self.kv.kv.shape[4] - self.width - self._extra(self.gamma_max))
            cap = Captured(
                functools.partial(self._draft, bucket, gamma, sampling),
                self.graphs != "cuda",
                self._pool,
            )
            self._pool = cap.pool
            self._graphs[key] = cap
            self.capture_seconds += cap.seconds
        return self._graphs[key]

    def _feed_block(self, bucket: int):
        """Feed the block of committed pairs (``f_buf``, ``x_buf``, ``p_buf``; ``real`` marks
        them, left-padded) at columns base.. for the first ``bucket`` rows. Returns the head's
        output after each row's last pair (bucket, H), what every draft query of a row sees of
        the committed context (bucket, span), each column's place relative to the block
        (span,) and, where the target gives drafts a window (``draft_window``), the position of
        the key each column holds (bucket, span; None without one)."""
        head, kv, W = self.head, self.kv, self.width
        span = kv.kv.shape[4]
        kv.rows, kv.span = slice(0, bucket), span
        rel = self.all_cols - self.base  # (span,)
        in_block = (rel >= 0) & (rel < W)
        real = self.real[:bucket]
        key_real = real.gather(1, rel.clamp(0, W - 1).expand(bucket, span)) & in_block
        before = self.cols.valid[:bucket] & (rel < 0)
        causal = rel[None, :] <= self.slots[:, None]  # (W, span): a query sees keys up to its own
        own = rel[None, :] == self.slots[:, None]  # padding queries see themselves
        mask = before[:, None, :] | (key_real[:, None, :] & causal[None])
        kv.columns = self.base + self.slots
        kpos, window = None, head.target.draft_window
        if window is not None:
            pos = self.p_buf[:bucket]
            kpos = key_positions(pos, kv.columns, span, self.cols.valid[:bucket])
            mask &= within_window(pos, kpos, window)
        mask |= own[None]
        h0 = head.initial_hidden(self.f_buf[:bucket])
        emb = head._embed(self.x_buf[:bucket])
        h = head.step(h0, emb, self.p_buf[:bucket], mask[:, None], kv)[:, -1]  # (bucket, H)
        return h, before | key_real, rel, kpos

    def _draft(self, bucket: int, gamma: int, sampling):
        """The block of committed pairs (``_feed_block``), then ``gamma`` draft steps for the
        first ``bucket`` rows. Returns the tokens (bucket, gamma) and, at T > 0, q (bucket,
        gamma, V)."""
        head, kv, W = self.head, self.kv, self.width
        h, seen, rel, kpos = self._feed_block(bucket)
        pos = self.p_buf[:bucket, -1] + 1  # the pending token's position
        window = head.target.draft_window
        toks, qs = [], []
        for i in range(gamma):
            x, q = _draft_tokens(head, h, sampling, self.u_buf[:bucket, i])
            if q is not None:
                qs.append(q)
            toks.append(x)
            if i < gamma - 1:
                c = self.base + W + i
                kv.columns = c.view(1)
                context = seen
                if window is not None:
                    context = seen & within_window((pos + i)[:, None], kpos, window)[:, 0]
                m = context | ((rel >= W) & (rel <= W + i))[None]
                step = head.step(
                    h[:, None], head._embed(x[:, None]), (pos + i)[:, None], m[:, None, None], kv
                )
                h = step[:, -1]
        return torch.stack(toks, 1), torch.stack(qs, 1) if qs else None

    # -- the batched proposer contract -----------------------------------------------------

    @torch.no_grad()
    def _feed_eager(self, states, rows: slice, ups: list[int], c0: int | None = None) -> None:
        """Feed each row's committed pairs done..upto-1 at exact shapes (left-padded), at
        columns c0.. (None: after the frontier): a newcomer's prompt, or pairs older than one
        block."""
        head, dev = self.head, self.head.target.device
        firsts = [
            self.done[rows.start + j] if rows.start + j < len(self.done) else 0
            for j in range(len(ups))
        ]
        n = max(1, max(u - d for u, d in zip(ups, firsts, strict=True)))
        k = len(ups)
        toks, pos, real, fs = pair_block(states, firsts, ups, n)
        h0 = torch.zeros(k, n, head.target.hidden_size, dtype=head._compute_dtype(), device=dev)
        for j, f in enumerate(fs):
            if f is not None:
                h0[j, n - len(f) :] = head.initial_hidden(f)
        if c0 is None:
            self.cols.room(n)
            c0 = self.cols.frontier
        inner = causal_mask(torch.zeros(k, 0, dtype=torch.bool), real)
        mask = visible_columns(
            torch.tensor(c0, device=dev), inner.to(dev), n, c0 + n, self.cols.valid[rows]
        )
        kv = self.kv
        kv.rows, kv.span, kv.columns = rows, c0 + n, torch.arange(c0, c0 + n, device=dev)
        pos = pos.to(dev)
        if head.target.draft_window is not None:
            kpos = key_positions(pos, kv.columns, c0 + n, self.cols.valid[rows])
            mask = mask & within_window(pos, kpos, head.target.draft_window)[:, None]
        head.step(h0, head._embed(toks.to(dev)), pos, mask, kv)
        self.cols.fill(rows, c0, real)
        for j, u in enumerate(ups):
            if rows.start + j < len(self.done):
                self.done[rows.start + j] = max(self.done[rows.start + j], u)
        self.draft_calls += 1

    def _place_features(self, bucket: int, fs: list[torch.Tensor | None]) -> None:
        """Each row's features right-aligned in its ``width`` slots of ``f_buf`` (zeros
        elsewhere): one concatenation and one indexed copy, not a copy a row (16 launches
        at B = 16 on a GPU)."""
        W, buf = self.width, self.f_buf[:bucket]
        buf.zero_()
        got = [(b, f) for b, f in enumerate(fs) if f is not None]
        if not got:
            return
        idx = [b * W + W - len(f) + j for b, f in got for j in range(len(f))]
        flat = buf.view(bucket * W, *buf.shape[2:])
        dst = torch.tensor(idx).to(buf.device, non_blocking=True)
        flat.index_copy_(0, dst, torch.cat([f for _, f in got]).to(buf.dtype))

    def join(self, states: list[DecodeState]) -> None:
        """The newcomers' prompt pairs but the last (as the batch-1 proposer's ``start``), in
        new rows right-aligned to the frontier."""
        ups = [max(0, len(s.ids) - 2) if s.features is not None else 0 for s in states]
        rows, c0 = self.cols.place(len(states), max(1, max(ups)))
        self.done.extend([0] * len(states))
        self._feed_eager(states, rows, ups, c0)

    def select(self, keep: list[int]) -> None:
        self.cols.retire(keep)
        self.done = [self.done[i] for i in keep]

    def rollback(self, states: list[DecodeState], accepted: list[int]) -> None:
        """Nothing to cut: the drafted columns were never marked valid."""
        self.cols.tidy()

    @torch.no_grad()
    def propose(self, states: list[DecodeState], gammas: list[int]) -> list[Proposal]:
        top = max(gammas, default=0)
        if top == 0 or any(s.features is None or len(s.ids) < 2 for s in states):
            self.last_step_seconds = None
            return [Proposal([], []) for _ in states]
        if top > self.gamma_max:
            raise ValueError(f"gamma={top}: past the static chain's {self.gamma_max}")
        t = time.perf_counter()
        R, dev = len(states), self.head.target.device
        sampling = states[0].sampling
        bucket, graph, ups, real = self._inputs(states, top, sampling)
        if not sampling.greedy:
            for b, st in enumerate(states):
                self.u_buf[b, : gammas[b]] = torch.rand(
                    gammas[b], generator=st.generator, dtype=torch.float64, device=dev
                )
        toks, q = graph()
        tokens = toks[:R].tolist()  # the proposal's one read of the device
        self._committed(R, ups, real, top)
        self.last_step_seconds = (time.perf_counter() - t) / top
        return [
            Proposal.chain(tokens[b][: gammas[b]], None if q is None else q[b, : gammas[b]].clone())
            for b in range(R)
        ]

    def _inputs(self, states: list[DecodeState], length: int, sampling):
        """Before a replay: rows that sat idle catch up eagerly, the graph of the row bucket
        and ``length`` is captured if new, and the block of committed pairs is placed in its
        input buffers. Returns the bucket, the graph, each row's committed length and the
        block's ``real`` marks (host, (bucket, width))."""
        R, W, dev = len(states), self.width, self.head.target.device
        ups = [len(s.ids) - 1 for s in states]
        if any(u - d > W for u, d in zip(ups, self.done, strict=True)):
            # rows that sat idle: their older pairs first, eagerly, up to a block before the end
            older = [max(d, u - W) for u, d in zip(ups, self.done, strict=True)]
            self._feed_eager(states, slice(0, R), older)
        bucket = next(b for b in self.buckets if b >= R)
        graph = self._graph(bucket, length, sampling)  # captured before its inputs are set
        self.cols.room(W + self._extra(length))
        toks, pos, real, fs = pair_block(states, self.done, ups, W)
        self._place_features(bucket, fs)
        # rows past R in the bucket: padding (no pair; each query sees only itself)
        real = torch.cat([real, real.new_zeros(bucket - R, W)])
        ids = torch.zeros(2, bucket, W, dtype=torch.long)
        ids[0, :R], ids[1, :R] = toks, pos
        both = ids.to(dev, non_blocking=True)
        self.x_buf[:bucket].copy_(both[0])
        self.p_buf[:bucket].copy_(both[1])
        self.real[:bucket].copy_(real.to(dev, non_blocking=True))
        self.base.fill_(self.cols.frontier)
        return bucket, graph, ups, real

    def _committed(self, R: int, ups: list[int], real: torch.Tensor, steps: int) -> None:
        """After a replay: the block's real pairs stay in the head's cache (the drafted
        columns are written over by the next block)."""
        self.cols.fill(slice(0, R), self.cols.frontier, real[:R])
        self.done = list(ups)
        self.draft_calls += steps


class StaticBatchedEagleTree(StaticBatchedEagleChain):
    """EAGLE-2 dynamic trees for every row of the batched decoder on fixed shapes: the batched
    form of ``StaticEagleTree`` (``BatchedEagleTree``'s trees, drafted as one function per row
    bucket, captured as a CUDA graph on CUDA).

    The block of committed pairs is fed as the chain's (``_feed_block``); then ``depth - 1``
    levels, each one head step for every row at once: a row's ``top_k`` best nodes of its
    newest level (chosen on the device), in ``top_k`` columns shared by the rows after the
    block, each query seeing its row's committed context, its own ancestors and itself. A
    row's depth (0 to ``depth``: a row near its budget drafts less) is an input of the graph
    (``cap``): the nodes below it score -inf before each row's ``total_tokens`` best are
    chosen, so one graph per bucket serves every mix of depths. One host read a proposal: the
    best nodes of every row, kept on the host by the eager tree's rules (``best_nodes_tree``).
    Every level is computed in full, as the batch-1 tree on fixed shapes: the trees are the
    eager ones (tests/test_batch.py)."""

    def __init__(
        self,
        head: EagleHead,
        batch_size: int,
        depth: int,
        top_k: int,
        total_tokens: int,
        min_prob: float = 0.0,
        graphs: str = "off",
        max_len: int = 2048,
    ):
        self.top_k, self.depth, self.total_tokens = top_k, depth, total_tokens
        self.log_min = math.log(min_prob) if min_prob > 0 else float("-inf")
        super().__init__(head, batch_size, depth, graphs, max_len)
        self.last_scores: list[list[float]] = []

    def _extra(self, gamma: int) -> int:
        return (gamma - 1) * self.top_k  # the fed frontier nodes of levels 1..depth-1

    def _alloc(self, max_len: int) -> None:
        super()._alloc(max_len)
        dev = self.f_buf.device
        self.cap = torch.zeros(self.batch_size, dtype=torch.long, device=dev)
        self.level = tree_levels(self.top_k, self.depth, dev)

    def _lengths(self) -> tuple[int, ...]:
        return (self.depth,)  # one graph per row bucket: each row's depth is ``cap``

    def prepare(self, sampling) -> None:
        super().prepare(None)  # the draft's top choices: one function at every temperature

    def _draft(self, bucket: int, depth: int, sampling) -> torch.Tensor:
        """The block, then the trees of the first ``bucket`` rows; returns (4, bucket,
        total_tokens) float64: each row's best nodes' numbers, tokens, parents' numbers (-1
        for the first level) and cumulative log-probabilities (-inf: not kept)."""
        head, kv, W, K = self.head, self.kv, self.width, self.top_k
        root, seen, rel, kpos = self._feed_block(bucket)  # (bucket, H): predicts the first level
        window = head.target.draft_window
        H, span = root.shape[-1], rel.shape[0]
        pos0 = self.p_buf[:bucket, -1]  # the last pair's position: level d is at pos0 + d
        slots = torch.arange(K, device=root.device)
        logp, ids = head.top_tokens(root, K)  # (bucket, K)
        scores, tokens = [logp.float()], [ids]
        parents = [torch.full_like(ids, -1)]
        level_s, level_t, offset = scores[0], tokens[0], 0
        amask = out = None
        for d in range(1, depth):
            f_s, f_i = level_s.topk(K, dim=-1)  # each row's frontier: its level's K best
            f_tok = level_t.gather(1, f_i)
            own = W + (d - 1) * K + slots  # the frontier's columns, relative to the block
            itself = (rel[None, :] == own[:, None])[None]  # (1, K, span)
            if d == 1:
                inp = root[:, None].expand(bucket, K, H)
                m = seen[:, None, :] | itself
            else:
                prev = f_i // K  # the frontier node's parent: a fed node of the last level
                inp = out.gather(1, prev[..., None].expand(bucket, K, H))
                m = amask.gather(1, prev[..., None].expand(bucket, K, span)) | itself
            if window is not None:  # the committed columns within this level's window
                near = within_window((pos0 + d)[:, None], kpos, window)  # (bucket, 1, span)
                m = m & (near | (rel >= W)[None, None])
            kv.columns = self.base + own
            p = (pos0 + d)[:, None].expand(bucket, K)
            out = head.step(inp, head._embed(f_tok), p, m[:, None], kv)  # (bucket, K, H)
            amask = m
            lp, ci = head.top_tokens(out.reshape(bucket * K, H), K)  # each node's children
            level_s = (f_s[:, :, None] + lp.float().view(bucket, K, K)).reshape(bucket, K * K)
            level_t = ci.view(bucket, K * K)
            f_gid = offset + f_i  # global numbers of the frontier nodes
            offset += K if d == 1 else K * K
            scores.append(level_s)
            tokens.append(level_t)
            parents.append(f_gid[:, :, None].expand(bucket, K, K).reshape(bucket, K * K))
        sc = torch.cat(scores, 1)
        sc = torch.where(self.level[None] <= self.cap[:bucket, None], sc, float("-inf"))
        best = torch.sort(sc, dim=1, descending=True, stable=True).indices[:, : self.total_tokens]
        return torch.stack(
            [
                best.double(),
                torch.cat(tokens, 1).gather(1, best).double(),
                torch.cat(parents, 1).gather(1, best).double(),
                sc.gather(1, best).double(),
            ]
        )

    @torch.no_grad()
    def propose(self, states: list[DecodeState], gammas: list[int]) -> list[Proposal]:
        depths = [max(0, min(self.depth, g)) for g in gammas]
        if max(depths, default=0) == 0 or any(s.features is None or len(s.ids) < 2 for s in states):
            self.last_step_seconds = None
            return [Proposal([], []) for _ in states]
        t = time.perf_counter()
        R = len(states)
        bucket, graph, ups, real = self._inputs(states, self.depth, None)
        caps = torch.zeros(bucket, dtype=torch.long)
        caps[:R] = torch.tensor(depths)
        self.cap[:bucket].copy_(caps.to(self.cap.device, non_blocking=True))
        out = graph()[:, :R].tolist()  # the proposal's one read of the device
        self._committed(R, ups, real, self.depth)
        self.last_step_seconds = (time.perf_counter() - t) / self.depth
        props, self.last_scores = [], []
        for b in range(R):
            p, s = best_nodes_tree(
                [out[k][b] for k in range(4)], self.top_k, self.total_tokens, self.log_min
            )
            props.append(p)
            self.last_scores.append(s)
        return props
