"""DFlash config: the one place its defaults live (``conf/method/dflash.yaml`` only selects it)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class DFlashConfig:
    name: str = "dflash"
    #: draft decoder layers (the target's architecture); the paper's heads have 5, 2 keeps a CPU
    #: training step near an EAGLE-3 step's cost on a 135M target
    num_layers: int = 2
    #: the draft layers' architecture: qwen3 (Qwen3 decoder layers with the target's sizes, as
    #: every DFlash head and speculators/vLLM's DFlash loaders have them, whatever the
    #: target) or target (Llama decoder layers with the target's sizes; no engine loads that)
    layer_arch: str = "qwen3"
    #: slots per block: [last accepted token, mask x (block_size - 1)]; one forward drafts
    #: block_size - 1 tokens (speculators' default 8, the released heads 16)
    block_size: int = 8
    #: target hidden-state indices fused by fc(N*H -> H) (transformers ``hidden_states``
    #: indices, 0 = the embeddings); None: 5 spaced uniformly from 1 to L - 3 (the paper's)
    fuse_layers: list[int] | None = None
    #: the token whose (frozen) target embedding fills the unseen slots; None: a spare embedding
    #: row past the tokenizer's vocabulary (an error names the key where the target has none)
    mask_token_id: int | None = None
    #: random anchors (block starts) per sequence and training step (the paper's 512: every
    #: assistant position of a 512-token sequence)
    anchors: int = 64
    #: slot k (1-based) is weighted exp(-(k - 1) / decay): early slots decide acceptance
    decay: float = 4.0
    #: soft: cross-entropy against the target's distribution (restricted to the draft
    #: vocabulary); hard: against the target's argmax (speculators' DFlash default)
    targets: str = "soft"
    #: the frozen target LM head's rows the draft scores (the most frequent assistant tokens of
    #: the training split); None: a quarter of the target's vocabulary, as EAGLE-3's
    draft_vocab_size: int | None = None
    val_positions: int = 5
    lm_head_chunk: int = 2048
