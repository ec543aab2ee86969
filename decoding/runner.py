"""The target side of the decoder: its KV cache and the forwards over it.

The decoder (``decoding/decoder.py``) runs one loop for every proposer; what a forward of the
target costs, and how its cache is cut back to the accepted path, is this module's. Two runners
behind one contract (``TargetRunner``):

- ``HFRunner``: transformers' own forward over a ``DynamicCache`` (any architecture; the
  reference path, ``compile=false``).
- ``StaticRunner``: the lean forward (``models/lean.py``) over a static cache,
  every verification padded to a fixed width, and on CUDA each width captured once as a CUDA
  graph, so a step is one graph replay instead of thousands of Python-dispatched ops
  (``compile=true``; gpt-fast's and SGLang's shape). On a CPU it runs eager at exact widths
  (compiling was measured no faster there: docs/benchmarks.md).

A forward feeds the last committed token and the proposal (a chain, or a tree with its
ancestor mask) after the ``length`` committed cache entries; ``commit`` keeps the accepted
path's entries (a length for a chain, a gather for a tree) and drops the rest.
"""

from __future__ import annotations

import abc

import torch
from transformers import DynamicCache

from models.base import Proposal, SideBranch, cache_kw, crop_cache, rollback_cache
from models.lean import Captured, LeanDecoder, lean_support, pad_width, round_up, visible_columns
from models.ragged import layer_masks, on, window_layers
from models.target import Target

#: compile= values: the static path (graphs where the device has them), transformers' path, or
#: whichever is measured faster on the device (``choose_runner``); ``emulate``: the static path
#: with the CUDA-graph path's fixed widths and static buffers run eagerly (tests on a CPU)
#: ``fused``: the static path with each layer's elementwise stretches compiled by torch.compile
#: (fewer, fused kernels inside each graph; compile time at first use)
COMPILE_MODES = ("auto", "true", "false", "emulate", "fused")


class RunnerError(ValueError):
    """A setting the target runner cannot honour; the message names it."""


class Layout:
    """One verification forward's tokens: the root (last committed token), the proposal's nodes
    and a proposer's side branch. ``depth[i]``: position after the root; ``anc`` (n, n) bool:
    token i attends to token j of this forward (None: a chain, plain causal)."""

    def __init__(self, root: int, prop: Proposal, side: SideBranch | None = None):
        self.tokens = [root] + list(prop.tokens)
        if prop.is_chain and side is None:
            self.depth, self.anc = list(range(len(self.tokens))), None
            return
        n = len(prop)
        m = len(side.tokens) if side is not None else 0
        anc = torch.zeros(n + 1 + m, n + 1 + m, dtype=torch.bool)
        anc[: n + 1, : n + 1] = torch.tensor(prop.ancestors())
        depth = [0] * (n + 1)
        for i, par in enumerate(prop.parents):
            depth[i + 1] = depth[par + 1] + 1
        if m:
            if side.allowed.shape != (m, m) or min(side.offsets) < 1:
                raise ValueError(
                    f"side branch of {m} tokens: allowed must be ({m}, {m}) and offsets >= 1"
                )
            anc[n + 1 :, 0] = True
            anc[n + 1 :, n + 1 :] = side.allowed | torch.eye(m, dtype=torch.bool)
            depth += list(side.offsets)
            self.tokens += list(side.tokens)
        self.depth, self.anc = depth, anc

    def __len__(self) -> int:
        return len(self.tokens)


class TargetRunner(abc.ABC):
    """A target's cache and forwards for one sequence (batch 1).

    ``length``: committed entries in the cache. ``forward`` writes its tokens after them and
    returns logits (n, V) and features (n, L, H) (None without feature layers), valid until the
    next forward; ``commit`` then keeps some of them."""

    #: what ran, for the report: transformers | static | static+cuda-graphs
    kind: str = "?"
    #: seconds spent capturing graphs (0 where none are captured)
    capture_seconds: float = 0.0
    length: int = 0

    def __init__(self, target: Target, layers: tuple[int, ...]):
        self.target, self.layers = target, tuple(layers)
        self.device = target.device

    @abc.abstractmethod
    def reset(self) -> None:
        """An empty cache for a new sequence."""

    @abc.abstractmethod
    def forward(self, lay: Layout) -> tuple[torch.Tensor, torch.Tensor | None]: ...

    @abc.abstractmethod
    def commit(self, keep: list[int]) -> None:
        """Keep this forward's entries ``keep`` (indices into its tokens, in order) after the
        committed ones; drop the rest."""

    def prefill(self, tokens: list[int]) -> torch.Tensor | None:
        """Feed and commit ``tokens`` after a reset; their features (T, L, H) or None."""
        self.reset()
        _, feats = self.forward(Layout(tokens[0], Proposal.chain(tokens[1:])))
        self.commit(list(range(len(tokens))))
        return feats

    def reserve(self, total: int) -> None:  # noqa: B027 (a no-op default)
        """Room for sequences of ``total`` tokens (a static cache allocates it now)."""

    def prefill_cache(self):
        """The transformers cache after the prompt's prefill, for a proposer that copies it
        (``Proposer.reads_prefill_cache``); None where there is none."""
        return None


class HFRunner(TargetRunner):
    """transformers' forward over a ``DynamicCache``: every architecture, the reference path."""

    kind = "transformers"

    def __init__(self, target: Target, layers: tuple[int, ...]):
        super().__init__(target, layers)
        self.cache = rollback_cache(target.config)
        self.length = 0
        self.windows = window_layers(target.config)  # for a tree's explicit mask

    def reset(self) -> None:
        self.cache = rollback_cache(self.target.config)
        self.length = 0

    @torch.no_grad()
    def _run(self, tokens: list[int], **extra):
        ids = torch.tensor([tokens], device=self.device)
        out, feats = self.target.forward_features(
            self.layers,
            input_ids=ids,
            use_cache=True,
            **cache_kw(self.target.model, self.cache),
            **extra,
        )
        return out.logits[0], None if feats is None else feats[0]

    def forward(self, lay: Layout):
        if lay.anc is None:
            return self._run(lay.tokens)
        base = self.length
        n = len(lay)
        allowed = torch.cat([torch.ones(n, base, dtype=torch.bool), lay.anc], dim=1)
        pos = torch.tensor([[base + d for d in lay.depth]])
        kpos = torch.cat([torch.arange(base), pos[0]])[None]
        mask = layer_masks(self.windows, allowed[None], pos, kpos, self.target.dtype)
        return self._run(
            lay.tokens, attention_mask=on(mask, self.device), position_ids=pos.to(self.device)
        )

    def commit(self, keep: list[int]) -> None:
        keep_cache_positions(self.cache, self.length, keep)
        self.length += len(keep)

    def prefill_cache(self):
        return self.cache


def keep_cache_positions(cache: DynamicCache, start: int, keep: list[int]) -> None:
    """Keep entries [0, start) plus, in order, entries ``start + k`` for k in ``keep``."""
    if keep == list(range(len(keep))):
        crop_cache(cache, start + len(keep))
        return
    idx = None
    for layer in cache.layers:
        for name in ("keys", "values"):
            t = getattr(layer, name)
            if idx is None:  # one host-to-device copy, not one per layer
                idx = torch.tensor([start + k for k in keep], device=t.device)
            # the kept entries move down in place (index_select copies them first, so the
            # overlap is safe): no copy of the whole context per layer and iteration
            t[..., start : start + len(keep), :] = t.index_select(-2, idx)
    crop_cache(cache, start + len(keep))


class _Graph:
    """One verification width W, fixed shapes: static input buffers (token ids, depths, the
    ancestor mask, the committed length) and the forward over the whole static cache. On CUDA
    the forward is captured once as a CUDA graph and replayed; ``emulate`` (tests on a CPU)
    runs the same function on the same buffers eagerly, so the discipline a graph needs
    (inputs only through the buffers, fixed shapes) is what the tests exercise."""

    def __init__(
        self, lean: LeanDecoder, width: int, layers, emulate: bool, pool=None, logits: bool = True
    ):
        dev = lean.device
        self.width, self.lean, self.layers, self.logits = width, lean, layers, logits
        self.ids = torch.zeros(1, width, dtype=torch.long, device=dev)
        self.depth = torch.zeros(1, width, dtype=torch.long, device=dev)
        self.base = torch.zeros((), dtype=torch.long, device=dev)
        self.last = torch.zeros((), dtype=torch.long, device=dev)  # the last real position
        self.anc = torch.tril(torch.ones(1, width, width, dtype=torch.bool, device=dev))
        self.chain_anc = self.anc.clone()
        self.steps = torch.arange(width, device=dev)
        # warm-up and capture write at the last W columns, which no sequence uses (the
        # runner keeps them free), so capturing never touches a committed entry
        self.base.fill_(lean.max_len - width)
        self.captured = Captured(self._run, emulate, pool, check=not lean.fuse)

    def _run(self):
        cols = self.base + self.steps
        mask = visible_columns(self.base, self.anc, self.width, self.lean.max_len)
        return self.lean.forward(
            self.ids,
            self.base + self.depth,
            cols,
            mask,
            self.layers,
            logits=self.logits,
            last=self.last,
        )

    def __call__(self, base: int, lay: Layout):
        n = len(lay)
        host = torch.zeros(2, self.width, dtype=torch.long)
        host[0, :n] = torch.tensor(lay.tokens)
        host[1, :n] = torch.tensor(lay.depth)
        host[1, n:] = torch.arange(n, self.width)  # padding: positions past the real tokens
        self.base.fill_(base)
        if self.lean.short_rope is not None:  # LongRoPE reads it
            self.last.fill_(base + max(lay.depth))
        dev = self.ids.device
        both = host.to(dev, non_blocking=True)
        self.ids.copy_(both[0:1])
        self.depth.copy_(both[1:2])
        if lay.anc is None:
            self.anc.copy_(self.chain_anc)  # a chain (padding after it sees what precedes it)
        else:
            a = torch.eye(self.width, dtype=torch.bool)  # padding sees only itself
            a[:n, :n] = lay.anc
            self.anc.copy_(a[None].to(dev, non_blocking=True))
        logits, feats = self.captured()
        # the graph's outputs are overwritten by the next replay: hand out copies of the rows
        # that are real (a few KB on the device)
        return (
            None if logits is None else logits[0, :n].clone(),
            None if feats is None else feats[0, :n].clone(),
        )


#: prompt lengths a prefill is padded to where graphs run (widths past the widest verification
#: and within the cache); a longer prompt is prefilled eagerly at its own length
PREFILL_WIDTHS = (32, 64, 128, 256, 512, 1024, 2048)


class StaticRunner(TargetRunner):
    """The lean forward over a static cache (``models/lean.py``).

    ``graphs``: capture each verification width as a CUDA graph (CUDA only), ``emulate`` (the
    graph path's fixed shapes and static buffers, run eagerly: for tests on a CPU) or ``off``
    (eager at exact shapes: a CPU). ``widths``: the verification widths to pad to (the decoder
    passes 1 and its widest forward). ``max_len``: cache columns allocated up front (grown, and
    the graphs captured again, if a sequence needs more). ``fuse``: the fixed widths run the
    lean forward's torch.compile'd layer functions (``LeanDecoder(fuse=True)``). Where graphs
    run, a prompt's prefill is padded to one of ``PREFILL_WIDTHS`` and replayed as a graph too
    (features only: a prefill's logits are never read); on a GPU an eager prefill of the
    embedded target cost 68 ms against 4 ms a graph step (docs/benchmarks.md)."""

    def __init__(
        self,
        target: Target,
        layers: tuple[int, ...],
        widths: tuple[int, ...] = (1,),
        graphs: str = "off",
        max_len: int = 2048,
        fuse: bool = False,
    ):
        super().__init__(target, layers)
        check_static(target, graphs)
        self.graphs = graphs
        # hidden-state indices as the lean forward counts them (0..num_layers, no negatives)
        self.states = tuple(target.layer_index(i) for i in self.layers)
        self.widths = tuple(sorted(set(int(w) for w in widths)))
        self.fuse = fuse
        self.kind = ("static+cuda-graphs" if graphs == "cuda" else "static") + (
            "+fused" if fuse else ""
        )
        self.capture_seconds = 0.0
        self._alloc(max_len)
        self.length = 0

    def _alloc(self, max_len: int) -> None:
        self.lean = LeanDecoder(
            self.target.model,
            round_up(max_len + self.widths[-1]),
            fuse=self.fuse,
            fixed_shapes=self.graphs != "off",
        )
        self._graphs: dict[int, _Graph] = {}
        self._prefills: dict[int, _Graph] = {}
        if self.graphs == "off":
            return
        emulate, pool = self.graphs == "emulate", None

        def capture(w: int, logits: bool) -> _Graph:
            nonlocal pool  # every graph shares the first (widest) one's memory pool
            g = _Graph(self.lean, w, self.states, emulate, pool, logits)
            pool = g.captured.pool
            self.capture_seconds += g.captured.seconds
            return g

        cap = self.lean.max_len - self.widths[-1]
        for w in reversed([w for w in PREFILL_WIDTHS if self.widths[-1] < w <= cap]):
            self._prefills[w] = capture(w, logits=False)  # a prefill reads features only
        for w in reversed(self.widths):
            self._graphs[w] = capture(w, logits=True)

    @property
    def capacity(self) -> int:
        """Tokens a sequence may hold (the last widest-width columns stay free for capture)."""
        return self.lean.max_len - self.widths[-1]

    def reserve(self, total: int) -> None:
        if total > self.capacity:
            self._alloc(max(total, 2 * self.capacity))

    def reset(self) -> None:
        self.length = 0

    @torch.no_grad()
    def prefill(self, tokens: list[int]) -> torch.Tensor | None:
        n = len(tokens)
        fits = [w for w in self._prefills if w >= n]
        if not fits or n <= self.widths[-1]:
            return super().prefill(tokens)
        self.reset()
        _, feats = self._prefills[min(fits)](0, Layout(tokens[0], Proposal.chain(tokens[1:])))
        self.commit(list(range(n)))
        return feats

    @torch.no_grad()
    def forward(self, lay: Layout):
        n = len(lay)
        base = self.length
        if base + n > self.capacity:
            if base:
                raise RunnerError(
                    f"sequence of {base + n} tokens: past the static cache's {self.capacity} "
                    "(call reserve() before decoding)"
                )
            self.reserve(n)
        if self._graphs and n <= self.widths[-1]:
            return self._graphs[pad_width(n, self.widths)](base, lay)
        # a prefill, or eager decoding: exact shapes, attention over the used columns only
        dev = self.lean.device
        ids = torch.tensor([lay.tokens], device=dev)
        pos = torch.tensor([[base + d for d in lay.depth]], device=dev)
        cols = torch.arange(base, base + n, device=dev)
        anc = lay.anc if lay.anc is not None else torch.tril(torch.ones(n, n, dtype=torch.bool))
        mask = visible_columns(torch.tensor(base), anc[None], n, base + n).to(dev)
        logits, feats = self.lean.forward(ids, pos, cols, mask, self.states)
        return logits[0], None if feats is None else feats[0]

    def commit(self, keep: list[int]) -> None:
        if keep != list(range(len(keep))):
            self.lean.cache.move(self.length, torch.tensor(keep, device=self.lean.device))
        self.length += len(keep)


def check_static(target: Target, graphs: str) -> None:
    """``RunnerError`` where a static runner cannot run ``target`` with ``graphs`` (off, cuda
    or emulate)."""
    why = lean_support(target.model)
    if why is not None:
        raise RunnerError(f"compile=true: target {target.identity}: {why}")
    if graphs not in ("off", "cuda", "emulate"):
        raise RunnerError(f"graphs={graphs!r}: use off, cuda or emulate")
    if graphs == "cuda" and target.device.type != "cuda":
        raise RunnerError(f"CUDA graphs need a CUDA target; this one is on {target.device}")


def static_unsupported(target: Target, proposer) -> str | None:
    """Why the static path cannot decode with this target and proposer (None: it can)."""
    why = lean_support(target.model)
    if why is not None:
        return f"target: {why}"
    if proposer.reads_prefill_cache:
        return f"{type(proposer).__name__} copies transformers' prefill cache"
    if target.sharded:
        return "a sharded target"
    return None


def compile_mode(mode) -> str:
    """``compile=`` as one of ``COMPILE_MODES`` (Hydra hands ``true``/``false`` over as
    booleans); ``RunnerError`` naming the value otherwise."""
    m = str(mode).lower()
    if m not in COMPILE_MODES:
        raise RunnerError(f"compile={mode!r}: use auto, true, false or fused")
    return m


def static_path(mode: str, target: Target, proposer) -> tuple[str, bool] | None:
    """What ``compile=mode`` runs, at batch 1 and batch B alike: the static path's graphs
    (``cuda`` on CUDA, ``off`` (eager at exact shapes) on a CPU, ``emulate``) and whether its
    layers are fused, or None for transformers' path. ``auto``: the static path wherever it can
    run; ``true`` / ``fused`` / ``emulate``: that, or a ``RunnerError`` saying why not."""
    mode = compile_mode(mode)
    if mode == "false":
        return None
    why = static_unsupported(target, proposer)
    if why is not None:
        if mode != "auto":
            raise RunnerError(f"compile={mode}: {why}; use compile=auto or false")
        return None
    if mode == "emulate":
        return "emulate", False
    return ("cuda" if target.device.type == "cuda" else "off"), mode == "fused"


def choose_runner(
    mode: str,
    target: Target,
    proposer,
    layers: tuple[int, ...],
    widths: tuple[int, ...],
    max_len: int = 2048,
) -> TargetRunner:
    """The runner ``compile=mode`` asks for. ``auto``: the static path wherever it can run
    (on CUDA with graphs; on a CPU eager, measured 8-18% cheaper a forward than transformers'
    for the embedded target on the AMX Xeon, docs/benchmarks.md), else transformers'.
    ``true`` / ``fused`` / ``emulate``: that static path, or a ``RunnerError`` saying why not.
    ``false``: transformers' (``static_path``)."""
    path = static_path(mode, target, proposer)
    if path is None:
        return HFRunner(target, layers)
    graphs, fuse = path
    return StaticRunner(target, layers, widths, graphs, max_len, fuse=fuse)
