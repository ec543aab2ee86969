"""The model families people train drafts for, as tiny random configs (architecture only).

``target=tiny_random target.family=<name>`` builds one of these with the byte-level tokenizer of
``models/tiny.py``: a few layers, small widths, weights that depend only on the seed. Each entry
keeps what makes its family break trainers and engines in its own way (per-head q/k norms,
experts and routers, embedding scaling and logit soft-capping, sliding-window layers, fused
projections, attention sinks, latent attention, post-norm layers), so the whole matrix of
families x methods runs on a CPU in seconds. Nothing here is a modeling file: transformers
builds each family from its own config class.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

#: the window of the sliding-window layers: short, so a test's prompts cross it
WINDOW = 24


@dataclass(frozen=True)
class Family:
    model_type: str  # transformers' model_type (AutoConfig.for_model)
    what: str  # what is particular about it, one line for the docs
    extra: dict[str, Any] = field(default_factory=dict)  # config fields beyond the shape
    moe: bool = False
    sliding: bool = False  # some or all layers attend within a window
    tied: bool = True  # input embedding and LM head share one matrix


def _alternating(n: int, every: int = 2) -> list[str]:
    """Layer types with a full-attention layer every ``every`` layers, sliding ones between."""
    return ["full_attention" if (i + 1) % every == 0 else "sliding_attention" for i in range(n)]


FAMILIES: dict[str, Family] = {
    "llama": Family("llama", "Llama-2 shape (SmolLM2): the reference", {}),
    "llama3": Family(
        "llama",
        "Llama-3: llama3 RoPE scaling, untied LM head",
        {
            "rope_parameters": {
                "rope_type": "llama3",
                "rope_theta": 500000.0,
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 1024,
            }
        },
        tied=False,
    ),
    "qwen2": Family("qwen2", "Qwen2.5: biases on q/k/v", {}),
    "qwen3": Family("qwen3", "Qwen3: per-head q/k RMS norms", {}),
    "qwen3_moe": Family(
        "qwen3_moe",
        "Qwen3-MoE: routed experts in every layer, q/k norms",
        {"num_experts": 4, "num_experts_per_tok": 2, "norm_topk_prob": True},
        moe=True,
        tied=False,
    ),
    "mixtral": Family(
        "mixtral",
        "Mixtral: routed experts, untied head",
        {"num_local_experts": 4, "num_experts_per_tok": 2},
        moe=True,
        tied=False,
    ),
    "mistral": Family(
        "mistral", "Mistral: sliding-window attention in every layer", {}, sliding=True
    ),
    "gemma2": Family(
        "gemma2",
        "Gemma-2: embedding scaled by sqrt(H), logit soft-capping, alternating windows",
        {"final_logit_softcapping": 30.0, "attn_logit_softcapping": 50.0},
        sliding=True,
    ),
    "gemma3": Family(
        "gemma3_text",
        "Gemma-3: scaled embedding, q/k norms, 5 sliding layers to 1 full, two RoPEs",
        {},
        sliding=True,
    ),
    "phi3": Family("phi3", "Phi-3: fused qkv and gate/up projections", {}, tied=False),
    "gpt_oss": Family(
        "gpt_oss",
        "GPT-OSS: attention sinks, alternating windows, routed experts, YaRN",
        {"num_local_experts": 4, "num_experts_per_tok": 2},
        moe=True,
        sliding=True,
        tied=False,
    ),
    "deepseek_v3": Family(
        "deepseek_v3",
        "DeepSeek-V3: multi-head latent attention, shared and routed experts",
        {
            "n_routed_experts": 4,
            "n_shared_experts": 1,
            "num_experts_per_tok": 2,
            "n_group": 1,
            "topk_group": 1,
            "first_k_dense_replace": 1,
            "q_lora_rank": 48,
            # DeepSeek-V3's own router (engines build its score-correction bias from these)
            "topk_method": "noaux_tc",
            "scoring_func": "sigmoid",
            "routed_scaling_factor": 2.5,
        },
        moe=True,
        tied=False,
    ),
    "olmo2": Family("olmo2", "OLMo-2: norms after attention and MLP, q/k norms", {}),
}


def family_names() -> str:
    return ", ".join(FAMILIES)


def family_config(
    name: str,
    vocab_size: int,
    hidden_size: int,
    num_layers: int,
    head_dim: int,
    special_ids: dict[str, int],
):
    """The transformers config of a tiny ``name`` target. ``KeyError`` names the families."""
    from transformers import AutoConfig

    if name not in FAMILIES:
        raise KeyError(f"target.family={name!r}: not a known family ({family_names()})")
    fam = FAMILIES[name]
    heads = hidden_size // head_dim
    kw: dict[str, Any] = {
        "vocab_size": vocab_size,
        "hidden_size": hidden_size,
        "intermediate_size": hidden_size * 2,
        "num_hidden_layers": num_layers,
        "num_attention_heads": heads,
        "num_key_value_heads": max(1, heads // 2),
        "head_dim": head_dim,
        "max_position_embeddings": 4096,
        "tie_word_embeddings": fam.tied,
        **special_ids,
    }
    if fam.moe:
        kw["moe_intermediate_size"] = hidden_size
    if fam.sliding:
        kw["sliding_window"] = WINDOW
        if name == "gemma2":
            kw["layer_types"] = _alternating(num_layers)
            kw["query_pre_attn_scalar"] = head_dim
        elif name == "gemma3":
            kw["layer_types"] = _alternating(num_layers, every=6 if num_layers >= 6 else 2)
            kw["query_pre_attn_scalar"] = head_dim
        elif name == "gpt_oss":
            kw["layer_types"] = _alternating(num_layers)
    if name == "deepseek_v3":  # latent attention: every head reads the shared latent
        kw["num_key_value_heads"] = heads
        kw.pop("head_dim")
        # DeepSeek-V3's proportions (512 + 64 latent at head_dim 64: vLLM's MLA kernels' width)
        kw.update(
            kv_lora_rank=8 * head_dim,
            qk_nope_head_dim=head_dim,
            qk_rope_head_dim=head_dim,
            v_head_dim=head_dim,
        )
    if name == "qwen2":
        kw.pop("head_dim")  # Qwen2's width is hidden_size // heads
    kw.update(fam.extra)
    config = AutoConfig.for_model(fam.model_type, **kw)
    config._attn_implementation = "eager" if name in ("gemma2", "gpt_oss") else "sdpa"
    return config
