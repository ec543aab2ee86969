"""EAGLE-1 and EAGLE-3 config: the one place its defaults live (``conf/method/eagle1.yaml, eagle3.yaml`` only selects it)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class Eagle1Config:
    name: str = "eagle1"
    w_reg: float = 1.0  # SmoothL1 on features
    w_cls: float = 0.1  # soft cross-entropy against the target's distribution
    noise: float = 0.2  # uniform feature noise, U(-noise/2, noise/2) per element
    val_positions: int = 5  # draft positions rolled out on the head's own features at validation
    lm_head_chunk: int = 2048  # rows per LM-head chunk (bounds memory for large vocabularies)
    loss: str = "ce"  # token term against the target: ce | tvd (models/losses.py)
    # The reference EAGLE-1 (and vLLM/SGLang's loaders) drop the decoder layer's input norm:
    # FC output goes straight into attention. True keeps the target layer's own input norm.
    input_norm: bool = False


@dataclass
class Eagle3Config:
    name: str = "eagle3"
    # target hidden-state indices fused by FC(3H -> H); None: [2, L // 2, L - 3] (the paper's)
    fuse_layers: list[int] | None = None
    ttt_steps: int = 7  # training-time test: steps the head is unrolled on its own outputs
    step_decay: float = 0.8  # loss weight of unrolled step i (0-based) is step_decay ** i
    # reduced draft vocabulary; None: a quarter of the target's (the reference's ratio, 32k of
    # Llama-3's 128k), rounded to a multiple of 1024, within [1024, 32768]
    draft_vocab_size: int | None = None
    val_positions: int = 5
    lm_head_chunk: int = 2048
    loss: str = "ce"  # per unrolled step, against the target: ce | tvd (models/losses.py)
    # Layout variants of vLLM's speculators trainer (its CLI defaults are all True), so its
    # checkpoints load and decode exactly; False everywhere is the EAGLE-3 reference layout.
    norm_before_fc: bool = False  # an RMSNorm (``input_norm``) over the 3H concatenation
    norm_before_residual: bool = False  # the residual stream is hidden_norm(h), not h
    norm_output: bool = False  # the next step (and the LM head) read norm(h)
    # EAGLE 3.1 ("attention drift"; SpecForge's EAGLE3.1 recipe, vLLM's and speculators'
    # ``fc_norm``): an RMSNorm per fused layer (``fc_norm.{0,1,2}``) before FC, so no layer's
    # scale dominates the fused state. ``method=eagle3_1`` sets it with ``norm_output``.
    fc_norm: bool = False
