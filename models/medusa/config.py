"""Medusa-1 and Medusa-2 config: the one place its defaults live (``conf/method/medusa1.yaml, medusa2.yaml`` only selects it)."""

from __future__ import annotations

from dataclasses import dataclass, field

from ..base import LORA_TARGETS


@dataclass
class Medusa1Config:
    name: str = "medusa1"
    num_heads: int = 4  # K: head k predicts the token k + 2 positions ahead
    num_layers: int = 1  # residual blocks per head
    head_decay: float = 0.8  # loss weight of head k (0-based) is head_decay ** k
    soft_labels: bool = False  # learn the target's distribution instead of the data's tokens
    loss: str = "ce"  # ce | tvd (models/losses.py); with hard labels tvd is 1 - q(label)
    top_k: int = 10  # ranks whose accuracy validation measures (what the tree can choose from)
    tree_nodes: int = 64  # node budget of the static candidate tree built after training
    lm_head_chunk: int = 2048  # rows per LM-head chunk at validation


@dataclass
class Medusa2Config(Medusa1Config):
    name: str = "medusa2"
    soft_labels: bool = True  # self-distillation: heads learn the original model's distribution
    lora_r: int = 16
    lora_alpha: int = 32
    lora_dropout: float = 0.05
    lora_target_modules: list[str] = field(default_factory=lambda: list(LORA_TARGETS))
    head_lr_ratio: float = 4.0  # the heads' lr as a multiple of optim.lr (the adapter's)
    backbone_weight: float = 0.2  # weight of KL(original || adapted) on the backbone's tokens
    backbone_warmup: int = 200  # training micro-batches over which that weight rises (sine)
