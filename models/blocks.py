"""A decoder layer run over blocks of positions that read a shared context: the attention
of the drafters that emit several tokens per forward (DFlash's draft layers, Falcon's
semi-autoregressive layer). The layer is the target's own class (its projections, norms and
MLP are called as modules); only its attention pattern is this file's."""

from __future__ import annotations

import torch
from torch import nn


def block_attention(
    q: torch.Tensor,
    k_ctx: torch.Tensor,
    v_ctx: torch.Tensor,
    k_blk: torch.Tensor,
    v_blk: torch.Tensor,
    ctx_allowed: torch.Tensor | None,
    scaling: float,
    blk_valid: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of A blocks of S slots over a shared context and their own block.

    q: (B, h, A, S, D); k_ctx, v_ctx: (B, kvh, T, D) the context's keys/values; k_blk, v_blk:
    (B, kvh, A, S, D) the blocks'; h a multiple of kvh (grouped-query attention, no key copy).
    ``ctx_allowed`` (B, A, T) bool: block a may read context key t, or (B, A, S, T): slot s of
    block a may (a sliding window, whose edge differs by slot), None: every key. Every
    slot reads every slot of its own block (bidirectional; ``blk_valid`` (B, A, S) bool: only
    the valid ones) and no other block. Scores are
    (A*S) x (T + S) per row, not (A*S) x (T + A*S). Returns (B, h, A, S, D)."""
    B, h, A, S, D = q.shape
    kvh = k_ctx.shape[1]
    g = h // kvh
    qg = (q * scaling).reshape(B, kvh, g, A, S, D)
    sc = torch.einsum("bkgasd,bktd->bkgast", qg, k_ctx)
    if ctx_allowed is not None:
        if ctx_allowed.dim() == 3:
            ctx_allowed = ctx_allowed[:, :, None, :]
        sc = sc.masked_fill(~ctx_allowed[:, None, None], float("-inf"))
    sb = torch.einsum("bkgasd,bkard->bkgasr", qg, k_blk)
    if blk_valid is not None:
        sb = sb.masked_fill(~blk_valid[:, None, None, :, None, :], float("-inf"))
    T = sc.shape[-1]
    p = torch.softmax(torch.cat([sc, sb], -1), -1, dtype=torch.float32).to(v_ctx.dtype)
    out = torch.einsum("bkgast,bktd->bkgasd", p[..., :T], v_ctx)
    out = out + torch.einsum("bkgasr,bkard->bkgasd", p[..., T:], v_blk)
    return out.reshape(B, h, A, S, D)


def heads(attn: nn.Module, x: torch.Tensor, proj: str, norm: str | None = None) -> torch.Tensor:
    """A projection split into heads, (..., H) -> (..., n, D), with the architecture's per-head
    norm when it has one (Qwen3's ``q_norm``/``k_norm``; Llama has none)."""
    y = getattr(attn, proj)(x)
    y = y.view(*x.shape[:-1], -1, attn.head_dim)
    n = getattr(attn, norm, None) if norm else None
    return n(y) if n is not None else y


def rope(rotary: nn.Module, x: torch.Tensor, pos: torch.Tensor):
    """cos, sin for positions ``pos`` (B, N) in x's dtype: (B, N, D) each."""
    cos, sin = rotary(x, pos)
    return cos.to(x.dtype), sin.to(x.dtype)


def context_kv(
    layer: nn.Module, ctx: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """A layer's keys and values of context states ctx (B, T, H) (already normed as the
    layer should read them), RoPE (cos, sin (B, T, D)) applied to the keys: (B, kvh, T, D)."""
    attn = layer.self_attn
    k = heads(attn, ctx, "k_proj", "k_norm").transpose(1, 2)
    v = heads(attn, ctx, "v_proj").transpose(1, 2)
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    k, _ = apply_rotary_pos_emb(k, k, cos, sin)
    return k, v


def layer_over_blocks(
    layer: nn.Module,
    x: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    kv: tuple[torch.Tensor, torch.Tensor],
    ctx_allowed: torch.Tensor | None,
    blk_valid: torch.Tensor | None = None,
) -> torch.Tensor:
    """One pre-norm decoder layer over A blocks of S slots: x (B, A, S, H), cos/sin
    (B, A, S, D) of their positions, ``kv`` the context's keys/values (B, kvh, T, D) as
    ``context_kv`` gives them, ``ctx_allowed`` (B, A, T) or (B, A, S, T) (None: all),
    ``blk_valid`` (B, A, S) the slots other slots may read (None: all). Returns (B, A, S,
    H)."""
    B, A, S, _ = x.shape
    attn = layer.self_attn
    xn = layer.input_layernorm(x)
    q = heads(attn, xn, "q_proj", "q_norm")  # (B, A, S, h, D)
    k = heads(attn, xn, "k_proj", "k_norm")
    v = heads(attn, xn, "v_proj")
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    q, k = apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=3)  # broadcast over heads
    o = block_attention(
        q.permute(0, 3, 1, 2, 4),
        kv[0],
        kv[1],
        k.permute(0, 3, 1, 2, 4),
        v.permute(0, 3, 1, 2, 4),
        ctx_allowed,
        attn.scaling,
        blk_valid,
    )
    x = x + attn.o_proj(o.permute(0, 2, 3, 1, 4).reshape(B, A, S, -1))
    return x + layer.mlp(layer.post_attention_layernorm(x))
