"""Lookahead decoding (Fu et al. 2024, "Break the Sequential Dependency of LLM Inference Using
Lookahead Decoding"): a training-free proposer that drafts from an n-gram pool which the
target itself fills through Jacobi iterations.

Each verification forward carries two branches in one attention mask:

- the **verification branch**: up to ``guesses`` (G) pooled n-grams that start with the last
  committed token, merged into a trie and verified as a tree by the shared decoder (so greedy
  decoding stays token-for-token the target's, and sampling stays exact: the candidates are
  deterministic, verified by point-mass recursive rejection);
- the **lookahead branch** (a ``SideBranch``): a 2D window of ``ngram - 1`` levels x ``window``
  (W) columns. Level l, column j sits ``l + 1 + j`` positions after the last committed token and
  sees the level-0 tokens of columns 0..j, the tokens of levels 1..l-1 in its own column, and
  itself: each column is a Jacobi trajectory. The target's greedy choice after the top level's
  column j becomes that column's new top level (the window moves one level up, dropping level
  0), and the column read from level 0 to that choice is an N-gram for the pool.

The pool is also seeded with the prompt's n-grams and fed with those of the committed output,
the prompt-lookup part of the reference implementation. The proposer costs no model call; its
whole price is the longer verification forward (``window * (ngram - 1)`` extra tokens plus the
trie), which is why it pays on hardware where a forward over many tokens costs little more than
over one.
"""

from __future__ import annotations

import random
from collections import OrderedDict

import torch

from models.base import DecodeState, Proposal, Proposer, SideBranch


class LookaheadProposer(Proposer):
    name = "lookahead"

    def __init__(self, window: int = 5, ngram: int = 4, guesses: int = 5, seed: int = 0):
        for key, v, lo in (("window", window, 1), ("ngram", ngram, 2), ("guesses", guesses, 1)):
            if v < lo:
                raise ValueError(f"lookahead {key}={v}: must be >= {lo}")
        self.window, self.ngram, self.guesses = window, ngram, guesses
        self.tree_depth = ngram - 1  # candidates are (N - 1)-token continuations
        # every iteration drafts: the pool fills from the window each drafting iteration
        # carries, so skipping iterations (an adaptive controller) starves it
        self.adaptive = False
        self.rng = random.Random(seed)
        self.pool: dict[int, OrderedDict[tuple[int, ...], None]] = {}
        self.levels: list[list[int]] = []
        self.seen = 0  # committed tokens whose n-grams are in the pool
        self._side: SideBranch | None = None
        self._allowed = self._window_mask()
        self._offsets = [lvl + 1 + j for lvl in range(ngram - 1) for j in range(window)]

    # -- the n-gram pool ------------------------------------------------------------------

    def _add(self, gram: list[int] | tuple[int, ...]) -> None:
        """Remember an N-gram under its first token; the newest ``guesses`` per key are kept."""
        key, rest = gram[0], tuple(gram[1:])
        bucket = self.pool.setdefault(key, OrderedDict())
        bucket.pop(rest, None)
        bucket[rest] = None
        while len(bucket) > self.guesses:
            bucket.popitem(last=False)

    def _add_committed(self, ids: list[int]) -> None:
        n = self.ngram
        for end in range(max(self.seen + 1, n), len(ids) + 1):
            self._add(ids[end - n : end])
        self.seen = len(ids)

    # -- the contract ---------------------------------------------------------------------

    def start(self, state: DecodeState) -> None:
        self.pool, self.seen = {}, 0
        self._add_committed(state.ids)
        # the window starts as tokens of the prompt, as in the reference implementation; the
        # first iterations' n-grams are noise that newer ones push out of the pool
        src = state.ids
        self.levels = [
            [src[self.rng.randrange(len(src))] for _ in range(self.window)]
            for _ in range(self.ngram - 1)
        ]

    def propose(self, state: DecodeState, gamma: int) -> Proposal:
        cands = self.pool.get(state.ids[-1])
        tokens: list[int] = []
        parents: list[int] = []
        if cands:
            children: dict[tuple[int, int], int] = {}  # (parent node, token) -> node
            for cont in reversed(cands):  # newest first
                par = -1
                for tok in cont[:gamma]:
                    node = children.get((par, tok))
                    if node is None:
                        node = len(tokens)
                        children[(par, tok)] = node
                        tokens.append(tok)
                        parents.append(par)
                    par = node
        return Proposal(tokens, parents)

    def side_branch(self, state: DecodeState) -> SideBranch:
        toks = [t for level in self.levels for t in level]
        self._side = SideBranch(toks, self._offsets, self._allowed)
        return self._side

    def side_logits(self, state: DecodeState, logits: torch.Tensor) -> None:
        w = self.window
        top = logits[-w:].argmax(-1).tolist()  # the top level's next tokens, column by column
        for j in range(w):
            self._add([level[j] for level in self.levels] + [top[j]])
        self.levels = self.levels[1:] + [top]

    def rollback(self, state: DecodeState, n_accepted: int) -> None:
        self._add_committed(state.ids)

    # -- the window's attention pattern ---------------------------------------------------

    def _window_mask(self) -> torch.Tensor:
        """(L*W, L*W) bool, row-major by level: (l, j) sees level 0 columns 0..j and levels
        1..l of column j (itself included)."""
        L, W = self.ngram - 1, self.window
        m = torch.zeros(L * W, L * W, dtype=torch.bool)
        for lvl in range(L):
            for j in range(W):
                r = lvl * W + j
                m[r, : j + 1] = True  # level 0, columns 0..j
                for k in range(1, lvl + 1):
                    m[r, k * W + j] = True
        return m
