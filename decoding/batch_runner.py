"""The target side of the batched decoder: B rows' KV cache and the forwards over it.

``decoding/batch.py`` runs the continuous-batching loop (admit, draft, verify, accept, retire)
for every proposer; the cache the rows share, and how a forward reads it, is this module's. Two
runners behind one contract (``BatchRunner``), as ``runner.py`` has for batch 1:

- ``RaggedRunner``: transformers' forward over a ``DynamicCache`` of shape (B, heads, L, d) and a
  boolean ``valid`` (B, L) (``models/ragged.py``): any architecture with full-attention layers,
  the reference path (``compile=false``). The cache grows and shrinks with the batch.
- ``StaticBatchRunner``: the lean forward (``models/lean.py``) over one static
  cache of ``batch_size`` rows, allocated once. The active rows are the first R; a forward runs
  over a row bucket (1, 2, 4, ... up to the batch size; padding rows see only themselves) and a
  padded width, and on CUDA each (bucket, width) is captured once as a CUDA graph whose mask
  is built on the device from the ``valid`` buffer, so a verification is one graph replay.
  On a CPU it runs eager at exact shapes.

Ragged acceptance is the same in both ("holes", ``models/ragged.py``): a forward writes n
columns after the shared frontier for every row, each row keeps its accepted ones (``keep``)
and the rest become masked columns; keys carry their rotary position, so nothing moves at
rollback. Finished rows leave (``retire``: the static cache moves the rows after them up, so
the active rows stay the first R); a cache that is mostly holes is compacted (``tidy``).
"""

from __future__ import annotations

import abc
from types import SimpleNamespace

import torch
from transformers import DynamicCache

from models.base import Proposal, cache_kw, keep_last
from models.lean import (
    CacheFull,
    Captured,
    LeanDecoder,
    RaggedColumns,
    key_positions,
    round_up,
    row_buckets,
    visible_columns,
)
from models.ragged import (
    causal_mask,
    join_rows,
    keep_columns,
    keep_rows,
    layer_masks,
    left_padded,
    new_cache,
    on,
    prefill_groups,
    prefill_in_groups,
    tidy,
    window_layers,
)
from models.target import Target

from .runner import (
    PREFILL_WIDTHS,
    Layout,
    RunnerError,
    TargetRunner,
    check_static,
    static_path,
)
from .stats import depths
from .timing import interleaved_medians


class BatchRunner(abc.ABC):
    """B rows' cache and forwards. Rows are in the order the decoder holds them: ``admit``
    appends rows, ``retire`` keeps some in order.

    ``columns``: the cache columns a verification attends to (the rows' shared frontier, holes
    included); ``verify`` writes its n columns after them, ``keep`` then marks which of them
    each row keeps."""

    #: what ran, for the report: transformers | static | static+cuda-graphs (+fused)
    kind: str = "?"
    #: seconds spent capturing graphs (0 where none are captured)
    capture_seconds: float = 0.0

    def __init__(self, target: Target, layers: tuple[int, ...]):
        self.target, self.layers = target, tuple(layers)
        self.device = target.device

    @property
    @abc.abstractmethod
    def rows(self) -> int:
        """Rows in the cache."""

    @abc.abstractmethod
    def reset(self) -> None:
        """No rows (a new run)."""

    @property
    @abc.abstractmethod
    def columns(self) -> int: ...

    @abc.abstractmethod
    def valid_columns(self) -> int:
        """Columns the rows attend to, summed over rows (columns - holes, times rows)."""

    @abc.abstractmethod
    def admit(self, prompts: list[list[int]]) -> tuple[list[int], list, list]:
        """Prefill ``prompts`` (each a request's prompt but its last token) as new rows after
        the running ones. Returns (order, features, views) in the order the rows now hold them:
        ``order[j]`` the index into ``prompts`` of new row j; features (T, L, H) or None; a
        prefill-cache view for a drafter that copies it (``Proposer.reads_prefill_cache``) or
        None."""

    @abc.abstractmethod
    def verify(
        self, ids: torch.Tensor, pos: torch.Tensor, inner: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """One forward of n tokens per row after the cache: ids and positions (R, n) and
        ``inner`` (R, n, n) bool, which of this forward's tokens each token sees (a padding
        token only itself). Returns logits (R, n, V) and features (R, n, L, H) or None."""

    @abc.abstractmethod
    def keep(self, keeps: list[list[int]]) -> None:
        """After ``verify``: row b keeps that forward's tokens ``keeps[b]`` (indices, 0 the root
        first), the others become holes."""

    @abc.abstractmethod
    def retire(self, keep: list[int]) -> None:
        """Only the rows at ``keep`` stay, in that order."""

    def tidy(self) -> None:  # noqa: B027 (a no-op default)
        """Cut and compact holes where they make up most of the cache."""

    @torch.no_grad()
    def verify_costs(self, rows: int, ks, length: int, reps: int = 3) -> dict[int, float]:
        """Seconds of a verification of k tokens in each of ``rows`` rows after ``length``
        cache columns, for each k in ``ks``, on random tokens: the median of ``reps`` after a
        warm-up, the shapes taken in turn within each repetition (``interleaved_medians``).
        What the batched decoder's cost model is fitted to: this runner's own forward (graphs
        included where they run). Leaves the runner empty."""
        g = torch.Generator().manual_seed(0)
        vocab = self.target.config.vocab_size
        self.reset()
        self.admit([torch.randint(0, vocab, (length,), generator=g).tolist() for _ in range(rows)])
        pending = [False]

        def setup(k: int):
            if pending[0]:  # the last shape's columns out, untimed: ``length`` columns again
                self.keep([[] for _ in range(rows)])
                self.tidy()
            pending[0] = True
            ids = torch.randint(0, vocab, (rows, k), generator=g)
            pos = torch.arange(length, length + k).expand(rows, k)
            inner = torch.ones(k, k, dtype=torch.bool).tril().expand(rows, k, k)
            return lambda: self.verify(ids, pos, inner)

        med = interleaved_medians(list(ks), setup, self.device, reps)
        self.reset()
        return med

    def reserve(self, total: int) -> None:  # noqa: B027 (a no-op default)
        """Room for rows of ``total`` tokens each (a static cache allocates it now)."""

    #: whether ``verify_rows`` carries a proposer's side branch (lookahead's Jacobi window)
    carries_side_branches = False

    def inputs(self, seqs: list[list[int]], props: list[Proposal], sides: list):
        """The host's part of the decoder's verification (untimed: what a verification costs
        is the forward's, as ``verify_costs`` measures it): each row's last committed token
        and its proposal, padded to the longest (``verify_inputs``)."""
        if any(s is not None for s in sides):
            raise RunnerError(f"{type(self).__name__} does not carry side branches")
        return verify_inputs(seqs, props)

    def verify_rows(self, inputs):
        """The decoder's verification over ``inputs``: the logits (R, n, V), the features
        (R, n, L, H) or None, and each row's side-branch logits (None here: a runner that
        carries side branches says so)."""
        logits, feats = self.verify(*inputs)
        return logits, feats, None


def verify_inputs(
    seqs: list[list[int]], props: list[Proposal]
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One verification's host inputs for a batch: each row's last committed token and its
    proposal, padded to the longest (ids and positions (R, n); padding repeats the row's
    last position), and the rows' inner masks (R, n, n): a chain's is causal, a tree's each
    node's ancestors, padding sees itself. Built from lists in three tensors: a row-by-row
    build launched ~100 small tensor operations at B = 16 (part of the 1.45 ms of host work
    per iteration beside a 4.5 ms graph step on an H100, docs/benchmarks.md, 2026-11-27/28)."""
    n = 1 + max(len(p) for p in props)
    if n == 1:  # nothing drafted in any row (plain decoding, a data generator): one column
        return (
            torch.tensor([[seq[-1]] for seq in seqs]),
            torch.tensor([[len(seq) - 1] for seq in seqs]),
            torch.ones(len(seqs), 1, 1, dtype=torch.bool),
        )
    ids, pos, lens = [], [], []
    trees: list[tuple[int, Proposal]] = []
    for b, (seq, p) in enumerate(zip(seqs, props, strict=True)):
        base, m = len(seq) - 1, len(p) + 1
        pad = n - m
        ids.append([seq[-1], *p.tokens] + [0] * pad)
        if p.is_chain:
            pos.append(list(range(base, base + m)) + [base] * pad)
        else:
            pos.append([base] + [base + d for d in depths(p)] + [base] * pad)
            trees.append((b, p))
        lens.append(m)
    ar = torch.arange(n)
    real = ar[None, :] < torch.tensor(lens)[:, None]  # (R, n)
    causal = (ar[None, :] <= ar[:, None])[None] & real[:, None, :] & real[:, :, None]
    inner = causal | torch.eye(n, dtype=torch.bool)[None]
    for b, p in trees:  # a tree's rows: each node sees its ancestors
        m = len(p) + 1
        inner[b] = torch.eye(n, dtype=torch.bool)
        inner[b, :m, :m] = torch.tensor(p.ancestors())
    return torch.tensor(ids), torch.tensor(pos), inner


class SequenceRunner(BatchRunner):
    """One sequence's runner (``runner.TargetRunner``) behind the batch contract: the
    decoding loop at batch 1 (``decoder.SpeculativeDecoder``). A verification is its forward
    over a ``Layout`` (the proposal, and a side branch, which it carries), ``keep`` its commit
    (a tree's accepted entries moved into place: no holes), so batch 1 keeps its own cache,
    widths and graphs while the loop is the batched decoder's."""

    carries_side_branches = True

    def __init__(self, runner: TargetRunner):
        super().__init__(runner.target, runner.layers)
        self.one = runner
        self.kind = runner.kind
        self._rows = 0

    @property
    def capture_seconds(self) -> float:
        return self.one.capture_seconds

    @property
    def rows(self) -> int:
        return self._rows

    def reset(self) -> None:
        self.one.reset()
        self._rows = 0

    @property
    def columns(self) -> int:
        return self.one.length

    def valid_columns(self) -> int:
        return self.one.length * self._rows

    def reserve(self, total: int) -> None:
        self.one.reserve(total)

    def admit(self, prompts):
        if self._rows + len(prompts) > 1:
            raise RunnerError(f"{self._rows + len(prompts)} rows: a sequence runner holds one")
        (prompt,) = prompts
        if not prompt:  # a one-token prompt: nothing to prefill (``prefill`` resets itself)
            self.one.reset()
        feats = self.one.prefill(prompt) if prompt else None
        self._rows = 1
        return [0], [feats], [self.one.prefill_cache() if prompt else None]

    def verify(self, ids, pos, inner):
        raise RunnerError("a sequence runner verifies a Layout: use inputs and verify_rows")

    def inputs(self, seqs, props, sides):
        (seq,), (prop,), (side,) = seqs, props, sides
        return Layout(seq[-1], prop, side), len(prop) + 1, side

    def verify_rows(self, inputs):
        lay, n, side = inputs
        logits, feats = self.one.forward(lay)
        side_logits = None
        if side is not None:
            logits, side_logits = logits[:n], [logits[n:]]
            feats = feats[:n] if feats is not None else None
        return logits[None], None if feats is None else feats[None], side_logits

    def keep(self, keeps):
        (keep,) = keeps
        self.one.commit(keep)

    def retire(self, keep):
        self._rows = len(keep)


class _RowCache:
    """One row's columns of the batch's prefill cache (left-padded: the row's prompt fills
    the last columns), as the ``DecodeState.prefill_cache`` a self-drafter copies from:
    views, no copy; the prefill's tensors are never written in place afterwards (the batch
    cache grows into new room or new tensors)."""

    def __init__(self, cache: DynamicCache, row: int, first: int):
        self.layers = [
            SimpleNamespace(
                keys=layer.keys[row : row + 1, :, first:, :],
                values=layer.values[row : row + 1, :, first:, :],
            )
            for layer in cache.layers
        ]

    def get_seq_length(self) -> int:
        return self.layers[0].keys.shape[-2] if self.layers else 0


class RaggedRunner(BatchRunner):
    """transformers' forward over a ``DynamicCache`` and its ``valid`` columns."""

    kind = "transformers"

    def __init__(
        self, target: Target, layers: tuple[int, ...], waste: float, reads_prefill_cache: bool
    ):
        super().__init__(target, layers)
        self.waste, self.views = waste, reads_prefill_cache
        self.windows = window_layers(target.config)  # for every explicit mask
        self.reset()

    def reset(self) -> None:
        self.cache = self.valid = None
        self._start = 0

    @property
    def rows(self) -> int:
        return 0 if self.valid is None else self.valid.shape[0]

    @property
    def columns(self) -> int:
        return 0 if self.valid is None else self.valid.shape[1]

    def valid_columns(self) -> int:
        return 0 if self.valid is None else int(self.valid.sum())

    def _forward(self, ids, pos, allowed: torch.Tensor, cache, kpos=None, **kw):
        """``kpos`` (R, K): the position of every key column (the window's rule reads it;
        default: the new tokens' own, a prefill's)."""
        kpos = pos if kpos is None else kpos
        mask = layer_masks(self.windows, allowed, pos, kpos, self.target.dtype)
        return self.target.forward_features(
            self.layers,
            input_ids=ids.to(self.device),
            attention_mask=on(mask, self.device),
            position_ids=pos.to(self.device),
            **cache_kw(self.target.model, cache),
            use_cache=True,
            **kw,
        )

    @torch.no_grad()
    def admit(self, prompts):
        """Left-padded prefills in groups of similar lengths (``prefill_groups``; one masked
        pad column for an empty prompt), joined under the running rows."""
        feats: list = [None] * len(prompts)
        views: list = [None] * len(prompts)

        def prefill(g: list[int]):
            fed = [prompts[i] for i in g]
            ids, pos, real = left_padded(fed, [0] * len(fed))
            n = ids.shape[1]
            allowed = causal_mask(torch.zeros(len(fed), 0, dtype=torch.bool), real)
            cache = new_cache(self.target.config)
            _, h = self._forward(ids, pos, allowed, cache, logits_to_keep=keep_last(n, self.device))
            for j, (i, f) in enumerate(zip(g, fed, strict=True)):
                if h is not None and f:
                    feats[i] = h[j, n - len(f) :]
                if f and self.views:
                    views[i] = _RowCache(cache, j, n - len(f))
            return cache, real.to(self.device)

        c, v = prefill_in_groups([len(p) for p in prompts], self.waste, prefill)
        self.cache, self.valid = join_rows(self.cache, self.valid, c, v)
        return list(range(len(prompts))), feats, views

    @torch.no_grad()
    def verify(self, ids, pos, inner):
        R, n = ids.shape
        length = self.columns
        valid = self.valid.cpu()
        allowed = torch.cat([valid[:, None, :].expand(R, n, length), inner], dim=2)
        # a committed column's position: how many committed columns precede it in its row
        kpos = torch.cat([valid.long().cumsum(1) - 1, pos.cpu()], dim=1)
        out, feats = self._forward(ids, pos, allowed, self.cache, kpos=kpos)
        self._start = length
        self.valid = torch.cat([self.valid, self.valid.new_zeros(R, n)], dim=1)
        return out.logits, feats

    def keep(self, keeps):
        keep_columns(self.valid, self._start, keeps)

    def retire(self, keep):
        self.cache, self.valid = keep_rows(self.cache, self.valid, keep)

    def tidy(self):
        if self.cache is not None:
            self.valid = tidy(self.cache, self.valid)


class _GraphInputs:
    """The static inputs of a (row bucket, width) function: token ids, positions and the
    within-forward mask (a padding token sees only itself), loaded from the host in one copy
    each."""

    def __init__(self, lean: LeanDecoder, bucket: int, width: int, layers):
        dev = lean.device
        self.lean, self.bucket, self.width, self.layers = lean, bucket, width, layers
        self.ids = torch.zeros(bucket, width, dtype=torch.long, device=dev)
        self.pos = torch.zeros(bucket, width, dtype=torch.long, device=dev)
        self.anc = torch.eye(width, dtype=torch.bool, device=dev).repeat(bucket, 1, 1)

    def load(self, ids, pos, inner, at: int) -> None:
        """k rows' n tokens (ids, pos (k, n), inner (k, n, n)) at columns at..at+n-1 of the
        first k rows; everything else padding (position 0, seeing only itself)."""
        k, n = ids.shape
        host = torch.zeros(2, self.bucket, self.width, dtype=torch.long)
        host[0, :k, at : at + n] = ids
        host[1, :k, at : at + n] = pos
        anc = torch.eye(self.width, dtype=torch.bool).repeat(self.bucket, 1, 1)
        anc[:k, at : at + n, at : at + n] = inner
        dev = self.ids.device
        both = host.to(dev, non_blocking=True)
        self.ids.copy_(both[0])
        self.pos.copy_(both[1])
        self.anc.copy_(anc.to(dev, non_blocking=True))


class _BatchGraph(_GraphInputs):
    """One (row bucket, width) verification: the static inputs and the frontier, and the
    forward over the first ``bucket`` rows of the static cache, their committed columns read
    from the runner's ``valid`` buffer. Captured as a CUDA graph on CUDA, run eagerly under
    the graph discipline with ``emulate`` (``models.lean.Captured``)."""

    def __init__(self, lean: LeanDecoder, valid, bucket, width, layers, emulate, pool=None):
        super().__init__(lean, bucket, width, layers)
        self.valid = valid
        self.base = torch.zeros((), dtype=torch.long, device=lean.device)
        self.steps = torch.arange(width, device=lean.device)
        # warm-up and capture write at the last W columns, which no row uses (the runner keeps
        # them free)
        self.base.fill_(lean.max_len - width)
        self.captured = Captured(self._run, emulate, pool, check=not lean.fuse)

    def _run(self):
        valid, cols = self.valid[: self.bucket], self.base + self.steps
        mask = visible_columns(self.base, self.anc, self.width, self.lean.max_len, valid)
        kpos = None
        if self.lean.windowed:  # each row's key positions, for the sliding-window layers
            kpos = key_positions(self.pos, cols, self.lean.max_len, valid)
        return self.lean.forward(
            self.ids, self.pos, cols, mask, self.layers, rows=slice(0, self.bucket), kpos=kpos
        )

    def __call__(self, base: int, ids, pos, inner):
        R, n = ids.shape
        self.load(ids, pos, inner, 0)
        self.base.fill_(base)
        logits, feats = self.captured()
        # overwritten by the next replay: copies of the real rows and tokens
        return logits[:R, :n].clone(), None if feats is None else feats[:R, :n].clone()


class _PrefillGraph(_GraphInputs):
    """A prefill of up to ``bucket`` new rows of ``width`` tokens (left-padded) as one fixed
    shape: written to the runner's scratch rows (past its batch) at columns [0, width), each
    row seeing only its own prompt, features returned; the runner then copies the rows' K/V to
    their places. Captured as a CUDA graph on CUDA (``emulate``: run eagerly)."""

    def __init__(self, lean: LeanDecoder, first: int, bucket, width, layers, emulate, pool=None):
        super().__init__(lean, bucket, width, layers)
        self.first = first
        self.cols = torch.arange(width, device=lean.device)
        self.captured = Captured(self._run, emulate, pool, check=not lean.fuse)

    def _run(self):
        rows = slice(self.first, self.first + self.bucket)
        _, feats = self.lean.forward(
            self.ids, self.pos, self.cols, self.anc[:, None], self.layers, logits=False, rows=rows
        )
        return feats

    def __call__(self, ids, pos, inner):
        """ids, pos (k, n), inner (k, n, n), n <= width: placed at the right end (padding
        before them sees only itself). Returns the features of the k rows' n tokens."""
        k, n = ids.shape
        self.load(ids, pos, inner, self.width - n)
        feats = self.captured()
        return None if feats is None else feats[:k, self.width - n :].clone()


class StaticBatchRunner(BatchRunner):
    """The lean forward over a static cache of ``batch_size`` rows (module docstring).

    ``graphs``: ``cuda`` (CUDA graphs per row bucket and width), ``emulate`` (the same fixed
    shapes and buffers run eagerly, for tests on a CPU) or ``off`` (eager at exact shapes).
    ``widths``: the verification widths to pad to (the decoder passes 1, the powers of two
    and its widest). ``max_len``: columns per row allocated up front (``reserve`` grows it
    before a run). Host-side bookkeeping only (each row's kept-column count, the frontier), so
    a forward needs no read from the device. Where graphs run, newcomers are prefilled by a
    graph too (``_PrefillGraph``: up to a row bucket of prompts padded to one of
    ``PREFILL_WIDTHS``, in ``batch_size`` scratch rows after the batch's, then copied to
    their rows): on an H100 an eager forward of the embedded target costs ~24 ms against ~4 a
    graph step, and a serving run joins a request every few steps."""

    def __init__(
        self,
        target: Target,
        layers: tuple[int, ...],
        batch_size: int,
        widths: tuple[int, ...] = (1,),
        graphs: str = "off",
        max_len: int = 2048,
        fuse: bool = False,
        waste: float = 0.25,
        holes: float = 0.5,
        slack: int = 64,
    ):
        super().__init__(target, layers)
        check_static(target, graphs)
        self.graphs, self.fuse, self.waste = graphs, fuse, waste
        self.holes, self.slack = holes, slack
        self.batch_size = batch_size
        self.buckets = row_buckets(batch_size)
        self.widths = tuple(sorted(set(int(w) for w in widths)))
        self.states = tuple(target.layer_index(i) for i in self.layers)
        self.kind = ("static+cuda-graphs" if graphs == "cuda" else "static") + (
            "+fused" if fuse else ""
        )
        self._alloc(max_len)

    def _alloc(self, max_len: int) -> None:
        B = self.batch_size
        self.lean = LeanDecoder(
            self.target.model,
            round_up(max_len + self.widths[-1]),
            batch=B if self.graphs == "off" else 2 * B,  # graphs: B scratch rows to prefill in
            fuse=self.fuse,
            fixed_shapes=self.graphs != "off",
        )
        cap = self.lean.max_len - self.widths[-1]
        self.cols = RaggedColumns(self.lean.cache.kv, cap, self.holes, self.slack, batch=B)
        self.reset()
        self._graphs: dict[tuple[int, int], _BatchGraph] = {}
        self._prefills: dict[tuple[int, int], _PrefillGraph] = {}
        if self.graphs == "off":
            return
        emulate, pool = self.graphs == "emulate", None
        prefill_widths = [w for w in PREFILL_WIDTHS if w <= cap]
        for b in reversed(self.buckets):  # the largest first: the rest share its memory pool
            for w in reversed(prefill_widths):
                p = _PrefillGraph(self.lean, B, b, w, self.states, emulate, pool)
                pool = p.captured.pool
                self.capture_seconds += p.captured.seconds
                self._prefills[b, w] = p
        for b in reversed(self.buckets):
            for w in reversed(self.widths):
                g = _BatchGraph(self.lean, self.cols.valid, b, w, self.states, emulate, pool)
                pool = g.captured.pool
                self.capture_seconds += g.captured.seconds
                self._graphs[b, w] = g

    def reset(self) -> None:
        self.cols.reset()
        self._start, self._n = 0, 0

    @property
    def capacity(self) -> int:
        """Columns the rows may fill (the widest forward's last columns stay free for capture)."""
        return self.cols.capacity

    @property
    def rows(self) -> int:
        return self.cols.rows

    @property
    def columns(self) -> int:
        return self.cols.frontier

    def valid_columns(self) -> int:
        return sum(self.cols.counts)

    def reserve(self, total: int) -> None:
        if total + self.widths[-1] > self.capacity:
            if self.rows:
                raise RunnerError("reserve() with rows in the cache: call it before a run")
            self.capture_seconds = 0.0
            self._alloc(max(total + self.widths[-1], 2 * self.capacity))

    @torch.no_grad()
    def admit(self, prompts):
        """Prefills in groups of similar lengths (``prefill_groups``), each over its new rows
        only (the running rows' columns are not touched), left-padded and right-aligned to the
        frontier (``RaggedColumns.place``)."""
        groups = prefill_groups([len(p) for p in prompts], self.waste)
        feats: list = [None] * len(prompts)
        j = 0
        for g in groups:
            fed = [prompts[i] for i in g]
            ids, pos, real = left_padded(fed, [0] * len(fed))
            n = ids.shape[1]
            try:
                rows, c0 = self.cols.place(len(g), n)
            except CacheFull as e:
                raise RunnerError(str(e)) from None
            inner = causal_mask(torch.zeros(len(g), 0, dtype=torch.bool), real)
            fit = [(b, w) for (b, w) in self._prefills if b >= len(g) and w >= n]
            if fit:  # a graph in the scratch rows, then the K/V to the new rows' place
                pg = self._prefills[min(fit)]
                h = pg(ids, pos, inner)
                kv, w = self.lean.cache.kv, pg.width
                kv[:, :, rows, :, c0 : c0 + n] = kv[
                    :, :, pg.first : pg.first + len(g), :, w - n : w
                ]
            else:
                _, h = self._eager(ids, pos, inner, c0, rows, logits=False)
            self.cols.fill(rows, c0, real)
            for r, f in enumerate(fed):
                if h is not None and f:
                    feats[j + r] = h[r, n - len(f) :]
            j += len(g)
        return [i for g in groups for i in g], feats, [None] * len(prompts)

    @torch.no_grad()
    def verify(self, ids, pos, inner):
        R, n = ids.shape
        if R != self.rows:
            raise RunnerError(f"verify of {R} rows: the cache holds {self.rows}")
        graph = None
        if self._graphs and n <= self.widths[-1]:
            w = next(w for w in self.widths if w >= n)
            b = next(b for b in self.buckets if b >= R)
            graph = self._graphs[b, w]
        try:
            self.cols.room(graph.width if graph is not None else n)
        except CacheFull as e:
            raise RunnerError(str(e)) from None
        base = self.cols.frontier
        self._start, self._n = base, n
        if graph is not None:
            return graph(base, ids, pos, inner)
        return self._eager(ids, pos, inner, base, slice(0, R))

    def _eager(self, ids, pos, inner, base: int, rows: slice, logits: bool = True):
        """The lean forward at exact shapes: the cache ``rows``' n tokens written at columns
        base..base+n-1, each seeing its row's valid columns before them and ``inner``."""
        n, dev = ids.shape[1], self.lean.device
        valid, pos = self.cols.valid[rows], pos.to(dev)
        mask = visible_columns(torch.tensor(base, device=dev), inner.to(dev), n, base + n, valid)
        cols = torch.arange(base, base + n, device=dev)
        kpos = key_positions(pos, cols, base + n, valid) if self.lean.windowed else None
        return self.lean.forward(
            ids.to(dev), pos, cols, mask, self.states, logits=logits, rows=rows, kpos=kpos
        )

    def keep(self, keeps):
        self.cols.keep(self._start, self._n, keeps)

    def retire(self, keep):
        self.cols.retire(keep)

    def tidy(self):
        self.cols.tidy()


def batch_widths(widest: int) -> tuple[int, ...]:
    """Verification widths a static batch pads to: 1, the powers of two below ``widest``, and
    ``widest`` (a batch's width is 1 + its longest proposal, which the policies vary)."""
    ws = {1, widest}
    w = 2
    while w < widest:
        ws.add(w)
        w *= 2
    return tuple(sorted(ws))


def choose_batch_runner(
    mode: str,
    target: Target,
    proposer,
    layers: tuple[int, ...],
    batch_size: int,
    widest: int,
    waste: float,
    max_len: int = 2048,
) -> BatchRunner:
    """The batch runner ``compile=mode`` asks for: as ``runner.choose_runner`` does for batch 1
    (``runner.static_path``: ``auto`` the static path where it can run, graphs on CUDA;
    ``false`` transformers')."""
    path = static_path(mode, target, proposer)
    if path is None:
        return RaggedRunner(target, layers, waste, proposer.reads_prefill_cache)
    graphs, fuse = path
    return StaticBatchRunner(
        target, layers, batch_size, batch_widths(widest), graphs, max_len, fuse=fuse, waste=waste
    )
