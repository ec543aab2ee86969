"""A draft LM on the decoders' static path (``compile=true``, and ``auto`` wherever the target
runs it): the lean forward (``models/lean.py``) over a static KV cache instead of transformers'
forward over a ``DynamicCache``, for every draft model whose family the lean forward computes
(``lean_support``): DistillSpec students, ``truncate:N`` and HF draft models.

Eager (``graphs='off'``: a CPU), each step is one lean forward at its exact shape and the
tokens are chosen on the host exactly as ``DraftLMProposer`` chooses them, from the same random
stream: the lean forward is transformers' arithmetic in transformers' order, so both paths draft
the same tokens. Where graphs run (``cuda``; ``emulate``: the same buffers and shapes run
eagerly, for tests), a whole proposal is one function of fixed shapes: the catch-up on the
newly committed tokens (padded to ``WIDTH``), then the drafted tokens, each chosen on the device
(the argmax, or at T > 0 a draw by the inverse CDF at a uniform drawn from the decoder's
generator before the replay, its distribution q handed to the verifier, so verification stays
exact). It is captured once per proposal length and read back once, as EAGLE's static chain is
(``models/eagle/static.py``). A stop rule or acceptance signals (DISCO, traces) decide token by
token on the host: such proposals take the eager steps on the same cache.
"""

from __future__ import annotations

import functools
import time

import torch
from torch import nn

from ..base import DecodeState, Proposal
from ..lean import Captured, LeanDecoder, round_up
from ..sampling import greedy_tokens, inverse_cdf, warp
from .proposer import DraftLMProposer, _fit_vocab

#: committed tokens a captured proposal feeds before drafting: the token that replaced a
#: rejected draft, or the last drafted token and the bonus token after a proposal accepted whole
#: (more only after the decoder skipped drafting; those are fed eagerly first)
WIDTH = 2


class StaticDraftLM(DraftLMProposer):
    """``DraftLMProposer`` on the lean forward over a static cache (see the module docstring).
    ``gamma_max``: the longest proposal captured; ``graphs``: ``off`` (eager, exact shapes),
    ``cuda`` (captured) or ``emulate``; ``max_len``: cache columns allocated up front (grown by
    ``reserve``)."""

    name = "draft_lm-static"

    def __init__(
        self,
        model: nn.Module,
        vocab_size: int | None = None,
        method: object = None,
        gamma_max: int = 1,
        graphs: str = "off",
        max_len: int = 2048,
    ):
        super().__init__(model, vocab_size, method)
        if gamma_max < 1:
            raise ValueError(f"gamma={gamma_max}: a static draft LM drafts at least one token")
        self.gamma_max, self.graphs = gamma_max, graphs
        self.capture_seconds = 0.0
        self.held = 0  # cache columns written in order: the committed tokens, then drafts
        self._alloc(max_len)

    # -- buffers and graphs ------------------------------------------------------------

    def _alloc(self, max_len: int) -> None:
        self.lean = LeanDecoder(
            self.model,
            round_up(max_len + WIDTH + self.gamma_max),
            fixed_shapes=self.graphs != "off",
        )
        dev = self.lean.device
        self.x_buf = torch.zeros(1, WIDTH, dtype=torch.long, device=dev)
        self.done_t = torch.zeros((), dtype=torch.long, device=dev)  # committed columns
        self.last_t = torch.zeros((), dtype=torch.long, device=dev)  # real catch-up tokens - 1
        self.u_buf = torch.zeros(self.gamma_max, dtype=torch.float64, device=dev)
        self.rows = torch.arange(WIDTH, device=dev)
        self.cols = torch.arange(self.lean.max_len, device=dev)
        self._graphs: dict[tuple[int, object], Captured] = {}
        self._pool = None
        self.held = 0

    @property
    def capacity(self) -> int:
        """Tokens a sequence may hold (the last columns stay free for capturing)."""
        return self.lean.max_len - WIDTH - self.gamma_max

    def reserve(self, total: int) -> None:
        if total > self.capacity:
            self._alloc(max(total, 2 * self.capacity))

    def fresh(self) -> StaticDraftLM:
        """Another proposer of the same draft with its own cache and graphs."""
        return StaticDraftLM(
            self.model, self.vocab_size, self.method, self.gamma_max, self.graphs, self.capacity
        )

    def _mask(self, query_cols: torch.Tensor, span: int) -> torch.Tensor:
        """(1, 1, Q, span): each query sees the columns up to its own (stale entries past it,
        left by padding or by rejected drafts, are never seen)."""
        return (self.cols[None, :span] <= query_cols[:, None])[None, None]

    def _choose(self, logits: torch.Tensor, sampling, u: torch.Tensor):
        """The next token after logits (1, V') on the device, and q over the target's
        vocabulary (1, V) at T > 0 (None when greedy)."""
        logits = _fit_vocab(logits, self.vocab_size)
        if sampling.greedy:
            return greedy_tokens(logits), None
        q = warp(logits, sampling)
        return inverse_cdf(q, u), q

    def _draft(self, gamma: int, sampling) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The whole proposal on the static buffers: feed ``x_buf`` (rows past ``last_t`` are
        padding) after ``done_t`` committed columns, then draft ``gamma`` tokens. Returns the
        tokens (gamma,) and, at T > 0, q (gamma, V)."""
        lean, span = self.lean, self.lean.max_len
        cols = self.done_t + self.rows
        logits, _ = lean.forward(
            self.x_buf, cols[None], cols, self._mask(cols, span), last=self.done_t + self.last_t
        )
        logits = logits[0].index_select(0, self.last_t.view(1))  # (1, V'): the pending token
        col = self.done_t + self.last_t + 1  # where the first drafted token is fed
        toks, qs = [], []
        for i in range(gamma):
            x, q = self._choose(logits, sampling, self.u_buf[i : i + 1])
            toks.append(x[0])
            if q is not None:
                qs.append(q[0])
            if i < gamma - 1:
                c = (col + i).view(1)
                mask = self._mask(c, span)
                logits = lean.forward(x.view(1, 1), c.view(1, 1), c, mask, last=c[0])[0][0]
        return torch.stack(toks), torch.stack(qs) if qs else None

    def _graph(self, gamma: int, sampling) -> Captured:
        """The proposal of ``gamma`` tokens under ``sampling``; on first use for a sampling
        setting every length up to ``gamma_max`` is captured at once (the longest first, the
        rest sharing its memory pool), writing at the last columns, which no sequence uses."""
        key = (gamma, None if sampling.greedy else sampling)  # the argmax: one function
        if key not in self._graphs:
            self.done_t.fill_(self.capacity)
            self.last_t.fill_(WIDTH - 1)
            for g in range(self.gamma_max, 0, -1):
                fn = functools.partial(self._draft, g, sampling)
                cap = Captured(fn, self.graphs != "cuda", self._pool)
                self._pool = cap.pool
                self._graphs[(g, key[1])] = cap
                self.capture_seconds += cap.seconds
        return self._graphs[key]

    # -- the proposer contract ---------------------------------------------------------

    def start(self, state: DecodeState) -> None:
        self.held = self.fed = 0
        self.last_step_seconds = None
        self.reserve(len(state.ids))
        if len(state.ids) > 1:  # the prompt's prefill: no logits read
            self._step(state.ids[:-1], state.device, logits=False)
            self.fed = len(state.ids) - 1

    @torch.no_grad()
    def _step(self, tokens: list[int], device: torch.device, logits: bool = True):
        """Feed ``tokens`` after the ``held`` columns at their exact shape; the next-token logits
        over the target's vocabulary (V,), or None without ``logits``."""
        self.draft_calls += 1
        base, n = self.held, len(tokens)
        if base + n > self.capacity:
            raise ValueError(
                f"draft LM: a sequence of {base + n} tokens is past its static cache's "
                f"{self.capacity} (reserve() before decoding)"
            )
        dev = self.lean.device
        cols = torch.arange(base, base + n, device=dev)
        out, _ = self.lean.forward(
            torch.tensor([tokens], device=dev),
            cols[None],
            cols,
            self._mask(cols, base + n),
            logits=logits,
            last_only=True,
        )
        self.held = base + n
        return None if out is None else _fit_vocab(out[0, -1], self.vocab_size)

    def _fixed(self, state: DecodeState, gamma: int) -> bool:
        """Whether this proposal is the captured one (else the eager steps)."""
        return not (
            self.graphs == "off"
            or state.signals
            or state.stop is not None
            or not 1 <= gamma <= self.gamma_max
            or len(state.ids) <= self.fed
        )

    @torch.no_grad()
    def propose(self, state: DecodeState, gamma: int) -> Proposal:
        # ``held == fed`` here: ``start`` and ``rollback`` leave only committed tokens cached
        if not self._fixed(state, gamma):
            return super().propose(state, gamma)  # the eager steps, on this cache
        t = time.perf_counter()
        n = len(state.ids)
        if n - self.fed > WIDTH:  # the draft sat idle: feed the older tokens first
            self._step(state.ids[self.fed : n - WIDTH], state.device, logits=False)
            self.fed = n - WIDTH
        graph = self._graph(gamma, state.sampling)  # captured before its inputs are set
        m = n - self.fed
        ids = torch.zeros(WIDTH, dtype=torch.long)
        ids[:m] = torch.tensor(state.ids[self.fed :])
        self.x_buf.copy_(ids[None].to(self.x_buf.device, non_blocking=True))
        self.done_t.fill_(self.fed)
        self.last_t.fill_(m - 1)
        if not state.sampling.greedy:
            self.u_buf[:gamma] = torch.rand(
                gamma, generator=state.generator, dtype=torch.float64, device=state.device
            )
        toks, q = graph()
        self.fed, self.held = n, n + gamma - 1
        self.draft_calls += gamma
        prop = Proposal.chain(toks.tolist(), None if q is None else q.clone())  # one read
        self.last_step_seconds = (time.perf_counter() - t) / gamma
        return prop

    def rollback(self, state: DecodeState, n_accepted: int) -> None:
        # the accepted drafts' entries are valid; the rest sit past ``fed`` and no later query
        # sees them (every mask stops at the query's own column)
        self.fed = self.held = min(self.held, self.fed + n_accepted)
