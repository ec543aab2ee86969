"""HASS (Zhang et al. 2024, "Learning Harmonized Representations for Speculative Sampling",
arXiv 2408.15766) on an EAGLE-3-style head.

Two harmonisations of training with decoding:

- **objective**: a tree drafter ranks candidates and the verifier accepts the likely ones, so
  besides the soft cross-entropy over the whole (draft) vocabulary each step learns the
  target's top-k tokens with extra weight: ``topk_weight * -sum_{x in top-k(p)} p(x) log q(x)``
  (``models.losses.top_k_distillation``);
- **context**: at decode time draft step j attends to the draft's own states from steps < j,
  not to the target's features; training unrolls the head over ``ttt_steps`` steps with that
  attention pattern (the same machinery as EAGLE-3's training-time test).

Everything else (fused features, draft vocabulary, proposers, export formats) is EAGLE-3's:
a HASS head exports to the EAGLE-3 layouts and serves wherever EAGLE-3 does.
"""

from __future__ import annotations

import torch

from ..base import DraftError, metric
from ..eagle.model import Eagle3Head
from ..losses import top_k_distillation
from .config import HassConfig


class HassHead(Eagle3Head):
    config_class = HassConfig

    def __init__(self, target, cfg: HassConfig):
        if cfg.topk < 1 or cfg.topk_weight < 0:
            raise DraftError(
                f"method.topk={cfg.topk}, method.topk_weight={cfg.topk_weight}: need topk >= 1 "
                "and topk_weight >= 0"
            )
        super().__init__(target, cfg)

    fused_step_ce = False  # the top-k term reads the step's logits

    def logits_loss(
        self, d_logits: torch.Tensor, t_prob: torch.Tensor, metrics: dict, n: int
    ) -> torch.Tensor:
        base = super().logits_loss(d_logits, t_prob, metrics, n)
        topk = top_k_distillation(d_logits, t_prob, self.cfg.topk)
        key = "loss_topk"
        m = metric(topk.detach() * n, n)
        metrics[key] = metrics[key] + m if key in metrics else m
        return base + self.cfg.topk_weight * topk
