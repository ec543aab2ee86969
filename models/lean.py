"""A lean forward for Llama-family targets over a static KV cache: the decoder's fixed-shape path.

transformers' forward dispatches thousands of small ops from Python per call (module calls, mask
builders, a ``DynamicCache`` that concatenates every layer's keys and values on every call). On a
GPU that host work, not the matrix work, sets the step time of a small target, and a CUDA graph
cannot capture it (shapes and addresses change from call to call). This module is the one
exception to "don't fork HF modeling files" that STYLE.md allows: the Llama-family decoder
(Llama, Mistral, Qwen2/2.5, Qwen3, SmolLM) in gpt-fast's shape, reading the HF module's own
weights (no copy, nothing converted), over a cache preallocated once:

- ``StaticKV``: keys and values of every layer in one buffer (layers, 2, B, kv_heads, max_len,
  head_dim); a forward writes its tokens at cache columns given as a tensor, so the same call
  (and the same CUDA graph) serves every step; rollback is a length for a chain and one gather
  over all layers for a tree's accepted path (EAGLE's copy of the accepted entries).
- ``LeanLlama.forward``: explicit position ids and a boolean mask (True = attend) for the query
  rows; logits and the hidden states at the drafter's feature indices in one pass.

Its logits equal transformers' within rounding (tests/test_compiled.py); every other
architecture keeps transformers' own forward (``lean_support`` says why in one line).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from .ragged import compaction

#: model_type values whose decoder this module computes (the Llama layout: RMSNorm, RoPE,
#: grouped-query attention, a SiLU-gated MLP; Qwen3's per-head q/k norms; Qwen2's q/k/v biases)
LLAMA_FAMILY = ("llama", "mistral", "qwen2", "qwen3")
#: RoPE variants whose angles depend on the position alone (a table computed once is exact)
STATIC_ROPE = ("default", "llama3", "linear", "yarn", "longrope")


def lean_support(model: nn.Module, max_len: int | None = None) -> str | None:
    """None when ``LeanLlama`` computes this HF causal LM exactly; else why not, in one line."""
    cfg = model.config
    kind = getattr(cfg, "model_type", "?")
    if kind not in LLAMA_FAMILY:
        return f"model_type {kind!r} is not of the Llama family ({', '.join(LLAMA_FAMILY)})"
    if getattr(cfg, "hidden_act", "silu") != "silu":
        return f"hidden_act {cfg.hidden_act!r} (the lean forward computes silu)"
    rope = (getattr(cfg, "rope_parameters", None) or {}).get("rope_type", "default")
    if rope not in STATIC_ROPE:
        return f"rope_type {rope!r} changes with the sequence length"
    types = getattr(cfg, "layer_types", None) or []
    window = getattr(cfg, "sliding_window", None)
    if any(t != "full_attention" for t in types) or (
        window and getattr(cfg, "use_sliding_window", kind == "mistral")
    ):
        if max_len is None or not window or max_len > window:
            return "sliding-window attention layers (the lean forward attends to all columns)"
    dec = model.get_decoder() if hasattr(model, "get_decoder") else None
    if dec is None or not hasattr(dec, "layers") or not hasattr(dec, "norm"):
        return "no decoder with .layers and .norm"
    if type(model.get_output_embeddings()) is not nn.Linear:
        return "its LM head is not a plain linear layer"
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


class LeanLlama:
    """The forward of an HF Llama-family causal LM (``lean_support(model)`` is None) over a
    ``StaticKV``. Holds references to the model's own parameters."""

    def __init__(self, model: nn.Module, max_len: int, batch: int = 1, fuse: bool = False):
        why = lean_support(model, max_len)
        if why is not None:
            raise ValueError(f"lean forward: {why}")
        cfg = model.config
        dec = model.get_decoder()
        self.model, self.cfg = model, cfg
        self.embed = dec.embed_tokens.weight
        self.layers = list(dec.layers)
        self.weights = [_layer_weights(layer) for layer in self.layers]
        # fuse: each layer's two stretches around attention compiled by torch.compile (inductor
        # fuses RMSNorm, RoPE, SiLU-and-multiply and the residual adds into a few kernels; one
        # compiled function serves every layer, whose tensors it takes as arguments). Off: the
        # same ops one by one, transformers' order (bit-exact). dynamic=None: the first width
        # compiles for its shape, a second one for any (prefills of any length and every
        # verification width share two compilations)
        self.fuse = fuse
        self._qkv = torch.compile(_qkv, fullgraph=True) if fuse else _qkv
        self._out_mlp = torch.compile(_out_mlp, fullgraph=True) if fuse else _out_mlp
        self.norm_w, self.norm_eps = dec.norm.weight, _eps(dec.norm)
        self.lm_head = model.get_output_embeddings()
        self.n_heads = cfg.num_attention_heads
        self.n_kv = getattr(cfg, "num_key_value_heads", None) or self.n_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // self.n_heads
        self.scaling = self.head_dim**-0.5
        w = self.embed
        self.dtype, self.device = w.dtype, w.device
        self.max_len = max_len
        self.cache = StaticKV(
            len(self.layers), batch, self.n_kv, max_len, self.head_dim, w.dtype, w.device
        )
        # cos / sin of every position, as the model's rotary module computes them for a
        # forward (same float32 angles, cast to the compute dtype): a table lookup per call
        pos = torch.arange(max_len, device=w.device)[None]
        probe = torch.zeros((), dtype=w.dtype, device=w.device)
        cos, sin = dec.rotary_emb(probe, pos)
        self.cos, self.sin = cos[0], sin[0]  # (max_len, head_dim)

    @property
    def num_layers(self) -> int:
        return len(self.layers)

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
    ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """One forward of W tokens per row.

        ids, positions: (B, W) token ids and their position ids; columns: (W,) the cache columns
        the tokens are written to (the same for every row); mask: (B, 1, W, K) bool, True =
        attend, over cache columns [0, K) (K <= max_len; the tokens' own columns included).
        features: hidden-state indices (0: the embeddings, j: after layer j, num_layers: after
        the final norm). ``rows``: the cache rows these B rows are (a slice of the cache's batch;
        None: all of them). Returns logits (B, W, V) in the model's dtype (None unless
        ``logits``) and the features (B, W, len(features), H) (None if none asked)."""
        B, W = ids.shape
        K = mask.shape[-1]
        x = F.embedding(ids, self.embed)
        want = {j: None for j in features}
        if 0 in want:
            want[0] = x
        cos, sin = self.cos[positions][:, None], self.sin[positions][:, None]  # (B, 1, W, D)
        g = self.n_heads // self.n_kv
        # grouped-query attention without copying keys: each kv head's g query heads become
        # g * W query rows, group-major (transformers' pack_gqa); the mask repeats per group
        mask = mask.expand(B, 1, W, K).repeat(1, 1, g, 1) if g > 1 else mask
        kv = self.cache.kv
        n = self.num_layers
        for i, w in enumerate(self.weights):
            q, k, v = self._qkv(x, cos, sin, self.head_dim, *w[:11])
            kc, vc = (kv[i, 0], kv[i, 1]) if rows is None else (kv[i, 0, rows], kv[i, 1, rows])
            kc.index_copy_(2, columns, k)
            vc.index_copy_(2, columns, v)
            qg = q.reshape(B, self.n_kv, g * W, self.head_dim)
            o = F.scaled_dot_product_attention(
                qg, kc[:, :, :K], vc[:, :, :K], attn_mask=mask, scale=self.scaling
            )
            # reshape, not view: CUDA's attention kernels may hand back (B, g*W, kv, D) strides
            o = o.reshape(B, self.n_heads, W, self.head_dim).transpose(1, 2).reshape(B, W, -1)
            x = self._out_mlp(x, o, *w[11:])
            if i + 1 in want and i + 1 < n:
                want[i + 1] = x
        x = _rms_w(x, self.norm_w, self.norm_eps)
        if n in want:
            want[n] = x
        out = F.linear(x, self.lm_head.weight, self.lm_head.bias) if logits else None
        feats = torch.stack([want[j] for j in features], dim=2) if features else None
        return out, feats


def _eps(norm: nn.Module) -> float:
    return getattr(norm, "variance_epsilon", getattr(norm, "eps", 1e-6))


def _rms_w(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' LlamaRMSNorm, op for op: the variance in float32, the weight applied
    after casting back."""
    dtype = x.dtype
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return w * xf.to(dtype)


def _layer_weights(layer: nn.Module) -> tuple:
    """A decoder layer's tensors in the order ``_qkv`` and ``_out_mlp`` take them (11 + 10)."""
    a, m = layer.self_attn, layer.mlp
    qn, kn = getattr(a, "q_norm", None), getattr(a, "k_norm", None)  # Qwen3's per-head norms
    return (
        layer.input_layernorm.weight,
        _eps(layer.input_layernorm),
        a.q_proj.weight,
        a.q_proj.bias,
        a.k_proj.weight,
        a.k_proj.bias,
        a.v_proj.weight,
        a.v_proj.bias,
        None if qn is None else qn.weight,
        None if kn is None else kn.weight,
        1e-6 if qn is None else _eps(qn),
        a.o_proj.weight,
        a.o_proj.bias,
        layer.post_attention_layernorm.weight,
        _eps(layer.post_attention_layernorm),
        m.up_proj.weight,
        m.up_proj.bias,
        m.gate_proj.weight,
        m.gate_proj.bias,
        m.down_proj.weight,
        m.down_proj.bias,
    )


def _qkv(x, cos, sin, head_dim, ln, eps, wq, bq, wk, bk, wv, bv, qn, kn, qk_eps):
    """A layer up to attention: RMSNorm, the q/k/v projections, (Qwen3) q/k norms, RoPE.
    Returns q, k, v as (B, heads, W, head_dim)."""
    B, W = x.shape[:2]
    h = _rms_w(x, ln, eps)
    q = F.linear(h, wq, bq).view(B, W, -1, head_dim)
    k = F.linear(h, wk, bk).view(B, W, -1, head_dim)
    v = F.linear(h, wv, bv).view(B, W, -1, head_dim)
    if qn is not None:
        q, k = _rms_w(q, qn, qk_eps), _rms_w(k, kn, qk_eps)
    q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    return _rope(q, cos, sin), _rope(k, cos, sin), v


def _out_mlp(x, o, wo, bo, ln, eps, wu, bu, wg, bg, wd, bd):
    """A layer after attention: the output projection and residual, RMSNorm, the gated MLP
    and its residual."""
    x = x + F.linear(o, wo, bo)
    h = _rms_w(x, ln, eps)
    up = F.linear(h, wu, bu)
    gate = F.silu(F.linear(h, wg, bg))
    return x + F.linear(gate * up, wd, bd)


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rot = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rot * sin


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
