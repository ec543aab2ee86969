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


class LeanLlama:
    """The forward of an HF Llama-family causal LM (``lean_support(model)`` is None) over a
    ``StaticKV``. Holds references to the model's own parameters."""

    def __init__(self, model: nn.Module, max_len: int, batch: int = 1):
        why = lean_support(model, max_len)
        if why is not None:
            raise ValueError(f"lean forward: {why}")
        cfg = model.config
        dec = model.get_decoder()
        self.model, self.cfg = model, cfg
        self.embed = dec.embed_tokens.weight
        self.layers = list(dec.layers)
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
    ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """One forward of W tokens per row.

        ids, positions: (B, W) token ids and their position ids; columns: (W,) the cache columns
        the tokens are written to (the same for every row); mask: (B, 1, W, K) bool, True =
        attend, over cache columns [0, K) (K <= max_len; the tokens' own columns included).
        features: hidden-state indices (0: the embeddings, j: after layer j, num_layers: after
        the final norm). Returns logits (B, W, V) in the model's dtype (None unless ``logits``)
        and the features (B, W, len(features), H) (None if none asked)."""
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
        for i, layer in enumerate(self.layers):
            attn = layer.self_attn
            h = _rms(x, layer.input_layernorm)
            q = F.linear(h, attn.q_proj.weight, attn.q_proj.bias).view(B, W, -1, self.head_dim)
            k = F.linear(h, attn.k_proj.weight, attn.k_proj.bias).view(B, W, -1, self.head_dim)
            v = F.linear(h, attn.v_proj.weight, attn.v_proj.bias).view(B, W, -1, self.head_dim)
            if hasattr(attn, "q_norm"):  # Qwen3: RMSNorm over each head before RoPE
                q, k = _rms(q, attn.q_norm), _rms(k, attn.k_norm)
            q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
            q, k = _rope(q, cos, sin), _rope(k, cos, sin)
            kc, vc = kv[i, 0], kv[i, 1]
            kc.index_copy_(2, columns, k)
            vc.index_copy_(2, columns, v)
            qg = q.reshape(B, self.n_kv, g * W, self.head_dim)
            o = F.scaled_dot_product_attention(
                qg, kc[:, :, :K], vc[:, :, :K], attn_mask=mask, scale=self.scaling
            )
            o = o.view(B, self.n_heads, W, self.head_dim).transpose(1, 2).reshape(B, W, -1)
            x = x + F.linear(o, attn.o_proj.weight, attn.o_proj.bias)
            h = _rms(x, layer.post_attention_layernorm)
            mlp = layer.mlp
            up = F.linear(h, mlp.up_proj.weight, mlp.up_proj.bias)
            gate = F.silu(F.linear(h, mlp.gate_proj.weight, mlp.gate_proj.bias))
            x = x + F.linear(gate * up, mlp.down_proj.weight, mlp.down_proj.bias)
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


def _rms(x: torch.Tensor, norm: nn.Module) -> torch.Tensor:
    return _rms_w(x, norm.weight, _eps(norm))


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rot = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rot * sin


def visible_columns(
    base: torch.Tensor, anc: torch.Tensor, width: int, columns: int
) -> torch.Tensor:
    """The boolean attention mask (B, 1, W, K) of a forward of W tokens written at cache columns
    base..base+W-1: every query sees the committed columns [0, base) and, among this forward's
    own columns, those ``anc`` (B, W, W) marks (its ancestors and itself); nothing at or after
    base + W (stale entries of earlier drafts). ``base``: a 0-dim integer tensor, so a captured
    graph builds the mask from device memory."""
    B = anc.shape[0]
    rel = torch.arange(columns, device=anc.device) - base  # (K,)
    own = (rel >= 0) & (rel < width)
    idx = rel.clamp(0, width - 1).expand(B, width, columns)
    tree = torch.gather(anc, 2, idx) & own
    return ((rel < 0) | tree)[:, None]


def pad_width(n: int, widths: tuple[int, ...]) -> int:
    """The smallest of ``widths`` (sorted) that holds n tokens."""
    for w in widths:
        if w >= n:
            return w
    raise ValueError(f"a forward of {n} tokens: wider than the widest captured ({widths[-1]})")


def round_up(n: int, to: int = 256) -> int:
    return int(math.ceil(n / to) * to)


class Captured:
    """``fn`` (no arguments: it reads static input buffers and returns tensors) captured once
    as a CUDA graph and replayed, or with ``emulate`` run eagerly on each call (the same
    discipline, on a CPU: tests). Captures after two warm-up runs on a side stream (cuBLAS
    workspaces, the allocator), into ``pool`` when given so that several graphs share memory.
    ``seconds``: what warm-up and capture took (0 when emulating)."""

    def __init__(self, fn, emulate: bool, pool=None):
        import time

        self.fn, self.graph, self.pool = fn, None, pool
        t = time.perf_counter()
        if emulate:
            self.out = None
        else:
            s = torch.cuda.Stream()
            s.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(s):
                for _ in range(2):
                    fn()
            torch.cuda.current_stream().wait_stream(s)
            self.graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(self.graph, pool=pool):
                self.out = fn()
            self.pool = self.graph.pool()
            torch.cuda.synchronize()
        self.seconds = 0.0 if emulate else time.perf_counter() - t

    def __call__(self):
        """The outputs (overwritten by the next replay: copy what must outlive it)."""
        if self.graph is None:
            return self.fn()
        self.graph.replay()
        return self.out
