"""HASS config: the one place its defaults live (``conf/method/hass.yaml`` only selects it)."""

from __future__ import annotations

from dataclasses import dataclass

from ..eagle.config import Eagle3Config


@dataclass
class HassConfig(Eagle3Config):
    name: str = "hass"
    # Harmonized context alignment: the head is trained over this many draft steps on its own
    # states, with the decode-time attention pattern (EAGLE-3's training-time test).
    ttt_steps: int = 3
    # Harmonized objective distillation: + topk_weight x (soft CE over the target's top-k
    # tokens) at every step, beside the method's own loss (method.loss: ce | tvd).
    topk: int = 10
    topk_weight: float = 1.0
