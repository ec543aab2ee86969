"""A lean forward for decoder-only targets over a static KV cache: the decoder's fixed-shape path.

transformers' forward dispatches thousands of small ops from Python per call (module calls, mask
builders, a ``DynamicCache`` that concatenates every layer's keys and values on every call). On a
GPU that host work, not the matrix work, sets the step time of a small target, and a CUDA graph
cannot capture it (shapes and addresses change from call to call). This module and its layer
functions (``lean_layers.py``) are the one exception to "don't fork HF modeling files" that
STYLE.md allows: the decoder of the families in ``ARCHS`` (Llama, Mistral, Qwen2/2.5, Qwen3,
SmolLM, Gemma-1/2/3, OLMo-2, Phi-3, Qwen3-MoE, Mixtral) in gpt-fast's shape, one layer for all
of them with what differs as data (where the RMSNorms sit and how they scale, per-head or
per-projection q/k norms, fused projections, the MLP's activation, routed experts, attention
soft-capping; here: sliding-window layers, one RoPE table per layer type, LongRoPE's two),
reading the HF module's own weights (no copy, nothing converted), over a cache preallocated once:

- ``StaticKV``: keys and values of every layer in one buffer (layers, 2, B, kv_heads, max_len,
  head_dim); a forward writes its tokens at cache columns given as a tensor, so the same call
  (and the same CUDA graph) serves every step; rollback is a length for a chain and one gather
  over all layers for a tree's accepted path (EAGLE's copy of the accepted entries).
- ``LeanDecoder.forward``: explicit position ids and a boolean mask (True = attend) for the
  query rows; logits and the hidden states at the drafter's feature indices in one pass. A
  sliding-window layer sees the masked columns whose key position is within its window of the
  query's (``key_positions``), transformers' rule.

Its logits equal transformers' within rounding (tests/test_compiled.py); every other
architecture keeps transformers' own forward (``lean_support`` says why in one line).
"""

from __future__ import annotations

import inspect
import math

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from .lean_layers import (
    ACTS,
    ARCHS,
    STATIC_ROPE,
    attend,
    eps_of,
    layer_weights,
    mlp_activation,
    out_mlp,
    qkv,
    rms,
    rope_types,
)
from .ragged import compaction, window_layers


def lean_support(model: nn.Module) -> str | None:
    """None when ``LeanDecoder`` computes this HF causal LM exactly; else why not, in one line."""
    cfg = model.config
    kind = getattr(cfg, "model_type", "?")
    if kind not in ARCHS:
        return f"model_type {kind!r}: the lean forward computes {', '.join(ARCHS)}"
    dec = model.get_decoder() if hasattr(model, "get_decoder") else None
    if dec is None or not hasattr(dec, "layers") or not hasattr(dec, "norm"):
        return "no decoder with .layers and .norm"
    if type(model.get_output_embeddings()) is not nn.Linear:
        return "its LM head is not a plain linear layer"
    if mlp_activation(model) not in ACTS.values():
        names = ", ".join(sorted(set(ACTS.values())))
        return f"MLP activation {mlp_activation(model)!r} (the lean forward computes {names})"
    for rope in sorted(rope_types(cfg)):
        if rope not in STATIC_ROPE:
            return f"rope_type {rope!r} changes with the sequence length"
    if "longrope" in rope_types(cfg) and len(rope_types(cfg)) > 1:
        return "LongRoPE on some layer types only"
    return None


class StaticKV:
    """Keys and values of every layer, preallocated: (layers, 2, B, kv_heads, max_len, head_dim).

    Columns [0, length) hold the committed tokens of each row; a forward writes its tokens at
    the columns it is given. Nothing here reads ``length``: the decoder keeps it and passes
    masks, so rolling a chain back is only a smaller length next time."""

    def __init__(self, layers, batch, kv_heads, max_len, head_dim, dtype, device):
        self.kv = torch.zeros(
            layers, 2, batch, kv_heads, max_len, head_dim, dtype=dtype, device=device
        )

    def move(self, base: int, keep: torch.Tensor) -> None:
        """Row 0: entries ``base + keep[i]`` move to ``base + i`` (every layer, keys and values,
        in one gather; ``index_select`` copies before writing, so overlaps are safe)."""
        n = keep.numel()
        src = self.kv[:, :, 0].index_select(3, keep + base)
        self.kv[:, :, 0, :, base : base + n] = src


class CacheFull(ValueError):
    """A static cache has no room for what a forward writes; the message says how much."""


#: row buckets a static batch pads to (and the batch size itself)
ROW_BUCKETS = (1, 2, 4, 8, 16, 32, 64)


def row_buckets(batch_size: int) -> tuple[int, ...]:
    return tuple(b for b in ROW_BUCKETS if b < batch_size) + (batch_size,)


class RaggedColumns:
    """B rows sharing the columns of a static KV buffer ``kv`` (layers, 2, B, heads, max_len,
    head_dim), each attending to its own (``valid`` (B, max_len) on the device): the batched
    decoder's "holes" on a static cache. The active rows are the first ``rows``; the frontier
    is where the next forward writes for every row; host-side counts of each row's valid
    columns, so nothing here reads the device. Used by the target's static batch runner and
    the batched EAGLE chain on fixed shapes. ``batch``: the rows it may hold (the buffer's
    by default; rows past it are another's, e.g. the runner's prefill scratch rows)."""

    def __init__(
        self,
        kv: torch.Tensor,
        capacity: int,
        holes: float = 0.5,
        slack: int = 64,
        batch: int | None = None,
    ):
        self.kv, self.capacity, self.holes, self.slack = kv, capacity, holes, slack
        self.batch = batch or kv.shape[2]
        self.valid = torch.zeros(self.batch, kv.shape[4], dtype=torch.bool, device=kv.device)
        self.reset()

    def reset(self) -> None:
        self.frontier, self.counts = 0, []
        self.valid.zero_()

    @property
    def rows(self) -> int:
        return len(self.counts)

    def room(self, n: int) -> None:
        """Room for n more columns after the frontier: the holes compacted away if needed."""
        if self.frontier + n <= self.capacity:
            return
        self.compact()
        if self.frontier + n > self.capacity:
            raise CacheFull(
                f"static cache: rows of {self.frontier} tokens plus {n} new ones are past its "
                f"{self.capacity} columns (reserve room for the longest prompt plus "
                "max_new_tokens before decoding)"
            )

    def place(self, k: int, n: int) -> tuple[slice, int]:
        """Room for k new rows of n columns each (left-padded prompts), right-aligned to the
        frontier (which moves right for n past it: holes for the others). Returns their rows
        and first column; ``fill`` then marks what they hold."""
        if self.rows + k > self.batch:
            raise CacheFull(f"{self.rows} rows + {k} new: past the batch of {self.batch}")
        self.room(max(0, n - self.frontier))
        c0 = max(0, self.frontier - n)
        rows = slice(self.rows, self.rows + k)
        self.valid[rows] = False
        return rows, c0

    def fill(self, rows: slice, c0: int, real: torch.Tensor) -> None:
        """Rows ``rows`` now also hold columns c0.. where ``real`` (k, n) says (new rows from
        ``place``, or a block written after the frontier for running ones)."""
        n = real.shape[1]
        self.valid[rows, c0 : c0 + n] |= real.to(self.valid.device, non_blocking=True)
        for j, c in enumerate(real.sum(1).tolist()):
            if rows.start + j < len(self.counts):
                self.counts[rows.start + j] += c
            else:
                self.counts.append(c)
        self.frontier = max(self.frontier, c0 + n)

    def keep(self, start: int, n: int, keeps: list[list[int]]) -> None:
        """After a forward that wrote n columns at ``start`` for every row: row b keeps the
        columns start + k for k in ``keeps[b]``, the rest are holes (the frontier drops back
        to after the last one kept)."""
        R = self.rows
        flat = [b * n + k for b, ks in enumerate(keeps) for k in ks]  # one write, not R
        host = torch.zeros(R * n, dtype=torch.bool)
        host[flat] = True
        last = 0
        for b, ks in enumerate(keeps):
            if ks:
                last = max(last, max(ks) + 1)
            self.counts[b] += len(ks)
        self.valid[:R, start : start + n] = host.view(R, n).to(self.valid.device, non_blocking=True)
        self.frontier = start + last

    def retire(self, keep: list[int]) -> None:
        """Only the rows at ``keep`` stay, in that order: slot i takes row ``keep[i]`` (the
        active rows stay the first ones). Only the rows that change slot are copied (the
        decoder fills freed slots from the end, ``decoding.batch.retire_order``)."""
        R, k = self.rows, len(keep)
        moved = [i for i in range(k) if keep[i] != i]
        L, kv = self.frontier, self.kv
        if moved:  # gathered before written: a row may move into a slot another leaves
            dst = torch.tensor(moved, device=kv.device)
            src = torch.tensor([keep[i] for i in moved], device=kv.device)
            kv[:, :, :, :, :L].index_copy_(2, dst, kv[:, :, :, :, :L].index_select(2, src))
            self.valid[:, :L].index_copy_(0, dst, self.valid[:, :L].index_select(0, src))
        self.valid[k:R] = False
        self.counts = [self.counts[b] for b in keep]
        if not keep:
            self.frontier = 0

    def tidy(self) -> None:
        """Compact when more than ``holes`` of the columns (and over ``slack``) are holes."""
        if not self.rows:
            return
        gap = self.frontier - max(self.counts)
        if gap > self.slack and gap > self.holes * self.frontier:
            self.compact()

    @torch.no_grad()
    def compact(self) -> None:
        """Gather each row's valid columns to the left end, in order, right-aligned to the row
        with the most (the others left-padded with masked columns), as ``models.ragged.compact``
        does for transformers' cache; the frontier becomes that row's count."""
        R, L = self.rows, self.frontier
        m = max(self.counts, default=0)
        if not R or m == L:
            return
        idx, new_valid = compaction(self.valid[:R, :L], m)
        for layer in self.kv:  # (2, B, heads, max_len, D): a layer at a time, little extra memory
            src = layer[:, :R, :, :L]
            g = idx[None, :, None, :, None].expand(2, R, src.shape[2], m, src.shape[4])
            layer[:, :R, :, :m] = src.gather(3, g)
        self.valid[:R, :m] = new_valid
        self.valid[:R, m:L] = False
        self.frontier = m


class LeanDecoder:
    """The forward of an HF causal LM of a family in ``ARCHS`` (``lean_support(model)`` is
    None) over a ``StaticKV``. Holds references to the model's own parameters."""

    def __init__(
        self,
        model: nn.Module,
        max_len: int,
        batch: int = 1,
        fuse: bool = False,
        fixed_shapes: bool = False,
    ):
        why = lean_support(model)
        if why is not None:
            raise ValueError(f"lean forward: {why}")
        cfg = model.config
        dec = model.get_decoder()
        self.model, self.cfg = model, cfg
        self.arch = ARCHS[cfg.model_type]
        self.act = mlp_activation(model)
        self.embed = dec.embed_tokens.weight
        # Gemma: the embeddings scaled by sqrt(H) in the model's dtype (a buffer of the module)
        self.embed_scale = getattr(dec.embed_tokens, "embed_scale", None)
        self.layers = list(dec.layers)
        self.n_heads = cfg.num_attention_heads
        self.n_kv = getattr(cfg, "num_key_value_heads", None) or self.n_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // self.n_heads
        self.weights = [layer_weights(layer, self.arch) for layer in self.layers]
        # fuse: each layer's two stretches around attention compiled by torch.compile (inductor
        # fuses RMSNorm, RoPE, SiLU-and-multiply and the residual adds into a few kernels; one
        # compiled function serves every layer, whose tensors it takes as arguments). Off: the
        # same ops one by one, transformers' order (bit-exact). dynamic=None: the first width
        # compiles for its shape, a second one for any (prefills of any length and every
        # verification width share two compilations)
        self.fuse = fuse
        # routed experts: computed on fixed shapes where the forward is captured as a graph or
        # compiled (``fixed_shapes``, ``fuse``), else as transformers does, the experts a token
        # chose read in place (``experts``)
        self.fixed_experts = fixed_shapes or fuse
        self._qkv = torch.compile(qkv, fullgraph=True) if fuse else qkv
        self._out_mlp = torch.compile(out_mlp, fullgraph=True) if fuse else out_mlp
        self.norm_w, self.norm_eps = dec.norm.weight, eps_of(dec.norm)
        self.lm_head = model.get_output_embeddings()
        self.final_softcap = getattr(cfg, "final_logit_softcapping", None)
        attn = self.layers[0].self_attn
        # Gemma: query_pre_attn_scalar ** -0.5, read from the module as its forward does
        self.scaling = getattr(attn, "scaling", None) or self.head_dim**-0.5
        self.attn_softcap = getattr(attn, "attn_logit_softcapping", None)  # Gemma-2
        self.window, sliding = window_layers(cfg)
        self.sliding = [bool(s) for s in sliding] or [False] * len(self.layers)
        w = self.embed
        self.dtype, self.device = w.dtype, w.device
        self.max_len = max_len
        self.cache = StaticKV(
            len(self.layers), batch, self.n_kv, max_len, self.head_dim, w.dtype, w.device
        )
        # cos / sin of every position, as the model's rotary module computes them for a
        # forward (same float32 angles, cast to the compute dtype): a table lookup per call.
        # Gemma-3: one table per layer type (its sliding layers' RoPE has another base)
        pos = torch.arange(max_len, device=w.device)[None]
        probe = torch.zeros((), dtype=w.dtype, device=w.device)
        per_type = "layer_type" in inspect.signature(dec.rotary_emb.forward).parameters
        types = list(getattr(cfg, "layer_types", None) or []) if per_type else []
        self.tables: dict[str | None, tuple[torch.Tensor, torch.Tensor]] = {}
        for t in sorted(set(types)) if types else [None]:
            cos, sin = dec.rotary_emb(probe, pos, t) if t else dec.rotary_emb(probe, pos)
            self.tables[t] = (cos[0], sin[0])  # (max_len, rotary dims)
        self.layer_table = types or [None] * len(self.layers)
        # LongRoPE (Phi-3): transformers rotates a forward's tokens with the short factors while
        # its last position is within original_max_position_embeddings, else with the long
        # ones (keys already cached keep theirs). Both tables, chosen per forward on the device
        self.short_rope, self.long_after = None, None
        if rope_types(cfg) == {"longrope"} and not types:
            orig = int(cfg.rope_parameters["original_max_position_embeddings"])
            short = dec.rotary_emb(probe, torch.arange(min(max_len, orig), device=w.device)[None])
            span = torch.arange(max(max_len, orig + 1), device=w.device)[None]
            long = dec.rotary_emb(probe, span)
            self.tables[None] = (long[0][0, :max_len], long[1][0, :max_len])
            self.short_rope, self.long_after = (short[0][0], short[1][0]), orig

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    @property
    def windowed(self) -> bool:
        """Some layers attend within a window: a forward needs its key positions."""
        return self.window is not None

    @torch.no_grad()
    def forward(
        self,
        ids: torch.Tensor,
        positions: torch.Tensor,
        columns: torch.Tensor,
        mask: torch.Tensor,
        features: tuple[int, ...] = (),
        logits: bool = True,
        rows: slice | None = None,
        kpos: torch.Tensor | None = None,
        last: torch.Tensor | None = None,
        last_only: bool = False,
    ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """One forward of W tokens per row.

        ids, positions: (B, W) token ids and their position ids; columns: (W,) the cache columns
        the tokens are written to (the same for every row); mask: (B, 1, W, K) bool, True =
        attend, over cache columns [0, K) (K <= max_len; the tokens' own columns included).
        features: hidden-state indices (0: the embeddings, j: after layer j, num_layers: after
        the final norm). ``rows``: the cache rows these B rows are (a slice of the cache's batch;
        None: all of them). ``kpos`` (B, K): the position of the key at each column, read by
        sliding-window layers only (``key_positions``; None: the committed columns hold
        positions 0, 1, ... in order, a single sequence's cache). ``last`` (0-dim): the largest
        position of a real token, where padding tokens sit past them (LongRoPE reads it; None:
        the largest of ``positions``). Returns logits (B, W, V) in the model's dtype (None
        unless ``logits``; ``last_only``: (B, 1, V), the last token's, the LM head computed for
        it alone) and the features (B, W, len(features), H) (None if none asked)."""
        B, W = ids.shape
        K = mask.shape[-1]
        x = F.embedding(ids, self.embed)
        if self.embed_scale is not None:
            x = x * self.embed_scale.to(x.dtype)
        want = {j: None for j in features}
        if 0 in want:
            want[0] = x
        ropes = {
            t: (cos[positions][:, None], sin[positions][:, None])  # (B, 1, W, rotary dims)
            for t, (cos, sin) in self.tables.items()
        }
        if self.short_rope is not None:  # LongRoPE: the short factors while the forward fits
            fits = (positions.max() if last is None else last) < self.long_after
            at = positions.clamp(max=self.long_after - 1)
            (cos_l, sin_l), (cos_s, sin_s) = ropes[None], self.short_rope
            ropes[None] = (
                torch.where(fits, cos_s[at][:, None], cos_l),
                torch.where(fits, sin_s[at][:, None], sin_l),
            )
        g = self.n_heads // self.n_kv
        near = None
        if self.windowed:
            if kpos is None:
                kpos = key_positions(positions, columns, K)
            near = mask & ((positions[:, :, None] - kpos[:, None, :K]) < self.window)[:, None]
        # grouped-query attention without copying keys: each kv head's g query heads become
        # g * W query rows, group-major (transformers' pack_gqa); the mask repeats per group
        if g > 1:
            mask = mask.expand(B, 1, W, K).repeat(1, 1, g, 1)
            near = None if near is None else near.expand(B, 1, W, K).repeat(1, 1, g, 1)
        kv = self.cache.kv
        n = self.num_layers
        a = self.arch
        for i, w in enumerate(self.weights):
            cos, sin = ropes[self.layer_table[i]]
            q, k, v = self._qkv(
                x, cos, sin, self.head_dim, self.n_heads, self.n_kv, a.norm, a.qk_norm, *w[:12]
            )
            kc, vc = (kv[i, 0], kv[i, 1]) if rows is None else (kv[i, 0, rows], kv[i, 1, rows])
            kc.index_copy_(2, columns, k)
            vc.index_copy_(2, columns, v)
            qg = q.reshape(B, self.n_kv, g * W, self.head_dim)
            o = attend(
                qg,
                kc[:, :, :K],
                vc[:, :, :K],
                near if self.sliding[i] else mask,
                self.scaling,
                self.attn_softcap,
            )
            # reshape, not view: CUDA's attention kernels may hand back (B, g*W, kv, D) strides
            o = o.reshape(B, self.n_heads, W, self.head_dim).transpose(1, 2).reshape(B, W, -1)
            x = self._out_mlp(x, o, self.act, a.norm, self.fixed_experts, *w[12:])
            if i + 1 in want and i + 1 < n:
                want[i + 1] = x
        x = rms(x, self.norm_w, self.norm_eps, a.norm)
        if n in want:
            want[n] = x
        out = None
        if logits:
            x = x[:, -1:].contiguous() if last_only else x  # contiguous: one product, no copy
            out = F.linear(x, self.lm_head.weight, self.lm_head.bias)
            if self.final_softcap is not None:  # Gemma-2: logits soft-capped, as HF returns them
                out = torch.tanh(out / self.final_softcap) * self.final_softcap
        feats = torch.stack([want[j] for j in features], dim=2) if features else None
        return out, feats


def key_positions(
    positions: torch.Tensor,
    columns: torch.Tensor,
    K: int,
    committed: torch.Tensor | None = None,
) -> torch.Tensor:
    """(B, K) the position of the key at each of cache columns [0, K) for a forward writing
    ``positions`` (B, W) at ``columns`` (W,): the committed columns hold positions 0, 1, ... in
    order (a single sequence), or, with ``committed`` (B, >= K) bool (a batch's ragged rows),
    each row's count of committed columns before them. Only sliding-window layers read it,
    through the ``mask`` they already satisfy, so what a masked column holds does not matter."""
    B = positions.shape[0]
    if committed is None:
        base = torch.arange(K, device=positions.device).expand(B, K)
    else:
        base = committed[:, :K].long().cumsum(1) - 1
    return base.index_copy(1, columns, positions)


def visible_columns(
    base: torch.Tensor,
    anc: torch.Tensor,
    width: int,
    columns: int,
    committed: torch.Tensor | None = None,
) -> torch.Tensor:
    """The boolean attention mask (B, 1, W, K) of a forward of W tokens written at cache columns
    base..base+W-1: every query sees the committed columns [0, base) (``committed`` (B, >= K)
    bool: only those it marks, a batch's ragged rows) and, among this forward's own columns,
    those ``anc`` (B, W, W) marks (its ancestors and itself); nothing at or after base + W
    (stale entries of earlier drafts). ``base``: a 0-dim integer tensor, so a captured graph
    builds the mask from device memory."""
    B = anc.shape[0]
    rel = torch.arange(columns, device=anc.device) - base  # (K,)
    own = (rel >= 0) & (rel < width)
    idx = rel.clamp(0, width - 1).expand(B, width, columns)
    tree = torch.gather(anc, 2, idx) & own
    before = rel < 0
    if committed is not None:
        before = before & committed[:, :columns]
        return (before[:, None] | tree)[:, None]
    return (before | tree)[:, None]


def pad_width(n: int, widths: tuple[int, ...]) -> int:
    """The smallest of ``widths`` (sorted) that holds n tokens."""
    for w in widths:
        if w >= n:
            return w
    raise ValueError(f"a forward of {n} tokens: wider than the widest captured ({widths[-1]})")


def round_up(n: int, to: int = 256) -> int:
    return int(math.ceil(n / to) * to)


class CaptureError(RuntimeError):
    """A function meant for a CUDA graph does what a graph cannot hold."""


_aten = torch.ops.aten
#: ops a CUDA graph cannot capture (they wait for the device, or their output's shape depends
#: on the data), with what usually calls them
_UNCAPTURABLE = {
    _aten._local_scalar_dense.default: "reads a device value on the host (.item(), int(t), "
    "`if t:`, or indexing with a 0-dim tensor: t[j] where j is a tensor)",
    _aten.nonzero.default: "has a data-dependent shape (nonzero, boolean-mask indexing)",
    _aten.masked_select.default: "has a data-dependent shape (masked_select)",
    _aten.lift_fresh.default: "builds a tensor from host data (torch.tensor(...)): a graph "
    "would replay the value it saw at capture",
}


class _GraphDiscipline(TorchDispatchMode):
    """Raises CaptureError at the first op a CUDA graph cannot hold. Run around the emulated
    graph functions (``Captured(emulate=True)``), so a CPU test catches what would break (or
    silently freeze) a capture on a GPU."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        why = _UNCAPTURABLE.get(func)
        if why is None and func in (_aten.index.Tensor, _aten.index_put.default):
            if any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in args[1]):
                why = _UNCAPTURABLE[_aten.nonzero.default]
        if why is not None:
            raise CaptureError(f"{func}: {why}; a CUDA graph cannot hold it")
        return func(*args, **(kwargs or {}))


class Captured:
    """``fn`` (no arguments: it reads static input buffers and returns tensors) captured once
    as a CUDA graph and replayed, or with ``emulate`` run eagerly on each call under a check
    that it does nothing a graph cannot hold (``_GraphDiscipline``: the same discipline, on a
    CPU, for tests). Captures after two warm-up runs on a side stream (cuBLAS workspaces, the
    allocator), into ``pool`` when given so that several graphs share memory. ``seconds``:
    what warm-up and capture took (0 when emulating).

    Emulating, the check runs on the first ``CHECKED_FIRST`` calls (the runs a capture makes)
    and then on one call in ``CHECK_EVERY``, drawn from a fixed seed: the dispatch mode makes
    a small model's forward ~2.5x slower (on a 2-layer test model, 34 ms a decoded request
    against 14 without it), and a path that reaches an op no graph holds is seldom taken
    once: a test decoding hundreds of requests still checks dozens of calls of every width."""

    CHECKED_FIRST = 3
    CHECK_EVERY = 8

    def __init__(self, fn, emulate: bool, pool=None, check: bool = True):
        import random
        import time

        self.fn, self.graph, self.pool, self.out = fn, None, pool, None
        self.check = check  # False where fn runs torch.compile'd code (no dispatch mode there)
        self.calls, self.checked = 0, 0
        self._draw = random.Random(0x9A7).randrange
        t = time.perf_counter()
        if not emulate:
            self._capture()
        self.seconds = 0.0 if emulate else time.perf_counter() - t

    @torch.no_grad()  # whoever builds it: a graph must not record autograd's bookkeeping
    def _capture(self) -> None:
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            for _ in range(2):
                self.fn()
        torch.cuda.current_stream().wait_stream(s)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph, pool=self.pool):
            self.out = self.fn()
        self.pool = self.graph.pool()
        torch.cuda.synchronize()

    def __call__(self):
        """The outputs (overwritten by the next replay: copy what must outlive it)."""
        if self.graph is None:
            self.calls += 1
            if not self.check or (
                self.calls > self.CHECKED_FIRST and self._draw(self.CHECK_EVERY) != 0
            ):
                return self.fn()
            self.checked += 1
            with _GraphDiscipline():
                return self.fn()
        self.graph.replay()
        return self.out
