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
    #: the loss of each slot against the target (models/losses.py): ce | tvd | lk_alpha |
    #: lk_lambda (each slot weighted by ``decay``), or dpace (D-PACE: each slot weighted by the
    #: acceptance length still to earn from it, ``decay`` unused)
    loss: str = "ce"
    #: Domino's logit correction (arXiv 2605.29707): none, or gru: a GRU over the target
    #: embeddings of the block's tokens so far (slot 0 = the last accepted token, then the
    #: drafted ones) and an MLP of [slot state; GRU state] adding logits over the draft
    #: vocabulary, so a slot reads the tokens drafted before it
    correction: str = "none"
    #: the GRU's width and the MLP's inner width (Domino's 1024 and 256 at hidden size 4096)
    gru_hidden: int = 256
    correction_dim: int = 128
    #: the first slot (1-based) the correction applies to: Domino leaves slot 1 (its
    #: ``pure_draft_prefix_len`` 1) to the backbone alone
    corrected_from: int = 2
    val_positions: int = 5
    lm_head_chunk: int = 2048


@dataclass
class DominoConfig(DFlashConfig):
    """Domino: DFlash with its GRU logit correction (``method=domino`` selects this)."""

    name: str = "domino"
    correction: str = "gru"
