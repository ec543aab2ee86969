"""The lean forward's decoder layer (``models/lean.py``), one set of functions for every family
in ``ARCHS`` with what differs between them as data (``Arch``): the layer's tensors gathered
from the HF module (``layer_weights``), the stretch up to attention (``qkv``), attention with
Gemma-2's soft-capping (``attend``), and the stretch after it with the MLP or routed experts
(``out_mlp``, ``experts``). Each computes what transformers' modeling file of the family
computes, op for op where rounding depends on it (tests/test_compiled.py); ``qkv`` and
``out_mlp`` take tensors and constants only, so ``torch.compile`` serves every layer with one
compilation (``compile=fused``)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class Arch:
    """What a family's decoder layer computes beyond the Llama layout (RMSNorm before attention
    and before the MLP, RoPE, grouped-query attention, a gated MLP)."""

    #: RMSNorm's scale: "llama" (the weight after the cast back), "olmo" (the weight in float32,
    #: then the cast), "gemma" (1 + the weight, in float32)
    norm: str = "llama"
    #: where the norms sit: "pre" (on each block's input), "both" (Gemma-2/3: on its input and
    #: on its output before the residual add), "post" (OLMo-2: on its output only)
    sandwich: str = "pre"
    #: q/k norms: None, "head" (each head's vector: Qwen3, Gemma-3), "proj" (the whole
    #: projection: OLMo-2)
    qk_norm: str | None = None
    #: Phi-3: one q/k/v projection and one gate/up projection
    fused: bool = False
    #: routed experts (``MoE``): "model" (the routing weights cast to the model's dtype before
    #: they scale the experts' outputs: Qwen3-MoE), "float32" (kept in float32: Mixtral)
    moe: str | None = None


#: model_type -> its layer, for the families the lean forward computes
ARCHS = {
    "llama": Arch(),
    "mistral": Arch(),
    "qwen2": Arch(),
    "qwen3": Arch(qk_norm="head"),
    "gemma": Arch(norm="gemma"),
    "gemma2": Arch(norm="gemma", sandwich="both"),
    "gemma3_text": Arch(norm="gemma", sandwich="both", qk_norm="head"),
    "olmo2": Arch(norm="olmo", sandwich="post", qk_norm="proj"),
    "phi3": Arch(fused=True),
    "qwen3_moe": Arch(qk_norm="head", moe="model"),
    "mixtral": Arch(moe="float32"),
}
#: the MLP activations it computes: transformers' activation module's class -> its ACT2FN name
ACTS = {
    "SiLUActivation": "silu",
    "SiLU": "silu",
    "GELUTanh": "gelu_pytorch_tanh",
    "PytorchGELUTanh": "gelu_pytorch_tanh",
    "GELUActivation": "gelu",
}
#: RoPE variants a table computed once holds exactly (their angles depend on the position
#: alone; LongRoPE's on the position and on whether a forward ends past the original context,
#: two tables)
STATIC_ROPE = ("default", "llama3", "linear", "yarn", "longrope")


def rope_types(cfg) -> set[str]:
    p = getattr(cfg, "rope_parameters", None) or {}
    if p and all(isinstance(v, dict) for v in p.values()):  # Gemma-3: one RoPE per layer type
        return {v.get("rope_type", "default") for v in p.values()}
    return {p.get("rope_type", "default")}


def mlp_activation(model: nn.Module) -> str:
    """The MLP's activation as its module computes it (Gemma's configs carry two names, and
    which one a modeling file reads differs by family and by transformers version): the
    ACT2FN name, or the module's class name where it is not in ACTS."""
    dec = model.get_decoder() if hasattr(model, "get_decoder") else None
    mlp = getattr(getattr(dec, "layers", [None])[0], "mlp", None)
    mlp = getattr(mlp, "experts", mlp)
    fn = getattr(mlp, "act_fn", None) or getattr(mlp, "activation_fn", None)
    kind = type(fn).__name__
    return ACTS.get(kind, kind)


def attend(q, k, v, mask, scaling: float, softcap: float | None) -> torch.Tensor:
    """Attention of (B, kv, R, D) query rows over (B, kv, K, D) keys and values, ``mask``
    (B, 1, R, K) bool. With ``softcap`` (Gemma-2) the scores are soft-capped before the mask,
    as transformers' eager attention does (SDPA has no soft-capping)."""
    if softcap is None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scaling)
    s = torch.matmul(q, k.transpose(-1, -2)) * scaling
    s = torch.tanh(s / softcap) * softcap
    s = s.masked_fill(~mask, torch.finfo(s.dtype).min)
    p = F.softmax(s, dim=-1, dtype=torch.float32).to(q.dtype)
    return torch.matmul(p, v)


def eps_of(norm: nn.Module | None) -> float:
    if norm is None:
        return 1e-6
    return getattr(norm, "variance_epsilon", getattr(norm, "eps", 1e-6))


def rms(x: torch.Tensor, w: torch.Tensor | None, eps: float, kind: str) -> torch.Tensor:
    """transformers' RMSNorms, op for op: the variance in float32, then the weight applied
    after casting back (``llama``), in float32 before it (``olmo``), or as 1 + the weight in
    float32 (``gemma``). ``w`` None: no norm (the identity)."""
    if w is None:
        return x
    dtype = x.dtype
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    if kind == "gemma":
        return (xf * (1.0 + w.float())).to(dtype)
    if kind == "olmo":
        return (w * xf).to(dtype)
    return w * xf.to(dtype)


def _w(m: nn.Module | None) -> tuple:
    return (None, None) if m is None else (m.weight, getattr(m, "bias", None))


def layer_weights(layer: nn.Module, arch: Arch) -> tuple:
    """A decoder layer's tensors in the order ``qkv`` and ``out_mlp`` take them (12 + 18).
    Norms a family does not have are None (``rms`` skips them)."""
    a, m = layer.self_attn, layer.mlp
    if arch.sandwich == "both":  # Gemma-2/3
        attn_in, attn_out = layer.input_layernorm, layer.post_attention_layernorm
        mlp_in, mlp_out = layer.pre_feedforward_layernorm, layer.post_feedforward_layernorm
    elif arch.sandwich == "post":  # OLMo-2
        attn_in, attn_out = None, layer.post_attention_layernorm
        mlp_in, mlp_out = None, layer.post_feedforward_layernorm
    else:
        attn_in, attn_out = layer.input_layernorm, None
        mlp_in, mlp_out = layer.post_attention_layernorm, None
    qn = getattr(a, "q_norm", None) if arch.qk_norm else None
    kn = getattr(a, "k_norm", None) if arch.qk_norm else None
    if arch.fused:  # Phi-3: q/k/v in one projection (split after it), gate/up in another
        q, k, v = _w(a.qkv_proj), (None, None), (None, None)
    else:
        q, k, v = _w(a.q_proj), _w(a.k_proj), _w(a.v_proj)
    experts = getattr(m, "experts", None)
    if experts is not None:  # routed experts: gate/up (E, 2I, H) and down (E, H, I) stacked
        mlp = (experts.gate_up_proj, None, None, None, experts.down_proj, None)
        route = (m.gate.weight, m.gate.top_k, getattr(m.gate, "norm_topk_prob", True))
    elif arch.fused:
        mlp = (*_w(m.gate_up_proj), None, None, *_w(m.down_proj))
        route = (None, 0, False)
    else:
        mlp = (*_w(m.up_proj), *_w(m.gate_proj), *_w(m.down_proj))
        route = (None, 0, False)
    return (
        None if attn_in is None else attn_in.weight,
        eps_of(attn_in),
        *q,
        *k,
        *v,
        None if qn is None else qn.weight,
        None if kn is None else kn.weight,
        eps_of(qn),
        arch.fused,
        *_w(a.o_proj),
        None if attn_out is None else attn_out.weight,
        eps_of(attn_out),
        None if mlp_in is None else mlp_in.weight,
        eps_of(mlp_in),
        None if mlp_out is None else mlp_out.weight,
        eps_of(mlp_out),
        *mlp,
        *route,
        arch.moe,
    )


def qkv(x, cos, sin, head_dim, n_q, n_kv, norm, qk_norm, ln, eps, wq, bq, wk, bk, wv, bv, qn, kn, qk_eps, fused):  # fmt: skip
    """A layer up to attention: the input norm, the q/k/v projections (Phi-3: one, split),
    q/k norms (per head: Qwen3, Gemma-3; over the projection: OLMo-2), RoPE. Returns q, k, v
    as (B, heads, W, head_dim)."""
    B, W = x.shape[:2]
    h = rms(x, ln, eps, norm)
    if fused:
        qkv = F.linear(h, wq, bq)
        q, k, v = qkv.split((n_q * head_dim, n_kv * head_dim, n_kv * head_dim), dim=-1)
    else:
        q, k, v = F.linear(h, wq, bq), F.linear(h, wk, bk), F.linear(h, wv, bv)
    if qk_norm == "proj":
        q, k = rms(q, qn, qk_eps, norm), rms(k, kn, qk_eps, norm)
    q, k, v = (t.reshape(B, W, -1, head_dim) for t in (q, k, v))
    if qk_norm == "head":
        q, k = rms(q, qn, qk_eps, norm), rms(k, kn, qk_eps, norm)
    q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    return rope(q, cos, sin), rope(k, cos, sin), v


def out_mlp(x, o, act, norm, fixed, wo, bo, ln_ao, eps_ao, ln_mi, eps_mi, ln_mo, eps_mo, wu, bu, wg, bg, wd, bd, router, top_k, renorm, moe):  # fmt: skip
    """A layer after attention: the output projection (Gemma-2/3, OLMo-2: normed) and the
    residual, the MLP's input norm, the gated MLP (Phi-3: gate and up in one projection,
    split; ``router``: routed experts, ``experts``) (Gemma-2/3, OLMo-2: its output normed)
    and its residual."""
    x = x + rms(F.linear(o, wo, bo), ln_ao, eps_ao, norm)
    h = rms(x, ln_mi, eps_mi, norm)
    if router is not None:
        y = experts(h, router, top_k, renorm, moe == "model", wu, wd, act, fixed)
    else:
        if wg is None:
            gate, up = F.linear(h, wu, bu).chunk(2, dim=-1)
        else:
            up, gate = F.linear(h, wu, bu), F.linear(h, wg, bg)
        y = F.linear(_activate(gate, act) * up, wd, bd)
    return x + rms(y, ln_mo, eps_mo, norm)


def _activate(x: torch.Tensor, act: str) -> torch.Tensor:
    if act == "silu":
        return F.silu(x)
    return F.gelu(x, approximate="tanh" if act == "gelu_pytorch_tanh" else "none")


def experts(h, router, top_k: int, renorm: bool, cast: bool, gate_up, down, act: str, fixed: bool):  # fmt: skip
    """Routed experts, transformers' sums: each token's top-k experts by the router's softmax
    (renormalised over the k where the family does), their outputs scaled by the routing
    weights (cast to the model's dtype first where the family does) and added in increasing
    expert order.

    Not ``fixed``: transformers' loop, over the experts some token chose, each reading its
    weights in place (the host reads which were chosen: eager only). ``fixed`` (a CUDA graph,
    torch.compile): no device value read on the host. Where the N tokens choose fewer experts
    than there are (N k < E, a decoding step) the chosen experts' weights are gathered per
    token (a copy of what they read: about three times the bytes of reading them in place);
    else every expert runs over every token, weighted by 0 where it was not chosen (adding 0
    is exact), reading each expert once."""
    B, W, H = h.shape
    x = h.reshape(-1, H)
    logits = F.linear(x, router)
    top, idx = torch.topk(F.softmax(logits, dim=-1, dtype=torch.float), top_k, dim=-1)
    if renorm:
        top = top / top.sum(dim=-1, keepdim=True)
    if cast:
        top = top.to(logits.dtype)
    out = torch.zeros_like(x)
    E = router.shape[0]
    if not fixed:
        for e in torch.unique(idx).tolist():
            tok, slot = torch.where(idx == e)
            gate, up = F.linear(x[tok], gate_up[e]).chunk(2, dim=-1)
            y = F.linear(_activate(gate, act) * up, down[e])
            out.index_add_(0, tok, (y * top[tok, slot, None]).to(x.dtype))
    elif x.shape[0] * top_k < E:
        idx, order = idx.sort(dim=-1)
        top = top.gather(-1, order)
        gate, up = torch.matmul(gate_up[idx], x[:, None, :, None]).squeeze(-1).chunk(2, dim=-1)
        y = torch.matmul(down[idx], (_activate(gate, act) * up)[..., None]).squeeze(-1)
        y = (y * top[..., None]).to(x.dtype)  # (N, k, H)
        for j in range(top_k):
            out = out + y[:, j]
    else:
        weight = torch.zeros(x.shape[0], E, dtype=top.dtype, device=x.device)
        weight = weight.scatter(1, idx, top)
        for e in range(E):
            gate, up = F.linear(x, gate_up[e]).chunk(2, dim=-1)
            y = F.linear(_activate(gate, act) * up, down[e])
            out = out + (y * weight[:, e, None]).to(x.dtype)
    return out.reshape(B, W, H)


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE on the first cos.shape[-1] dims of each head (all of them but for a partial
    rotary factor, Phi-3's way), the rest passed through."""
    r = cos.shape[-1]
    if r < x.shape[-1]:
        return torch.cat((rope(x[..., :r], cos, sin), x[..., r:]), dim=-1)
    half = r // 2
    rot = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rot * sin
