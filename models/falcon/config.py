"""Falcon config: the one place its defaults live (``conf/method/falcon.yaml`` only selects it)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class FalconConfig:
    name: str = "falcon"
    #: tokens per draft forward (semi-autoregressive; the paper's k = 2)
    k: int = 2
    lstm_layers: int = 2
    w_reg: float = 1.0  # SmoothL1 on predicted features
    w_cls: float = 0.1  # the token term: kl_share * KL(target || draft) + (1 - kl_share) * CE
    kl_share: float = 0.9
    noise: float = 0.2  # uniform feature noise U(-noise/2, noise/2) (the paper's U(-0.1, 0.1))
    #: CSGD's glancing ratio at the start of training: lambda = glance * (1 - progress); the
    #: glanced pass reveals round(lambda * mismatches) of a block's inputs from the data
    glance: float = 0.4
    val_positions: int = 4
    lm_head_chunk: int = 2048
