"""MLP speculator config: the one place its defaults live (``conf/method/mlp_speculator.yaml``
only selects it)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class MLPSpeculatorConfig:
    name: str = "mlp_speculator"
    n_predict: int = 3  # stages: stage i predicts the token i + 2 positions past the features
    inner_dim: int = 0  # 0: the target's hidden size (then stages start from its embedding)
    # One set of weights for every stage after the first (the first projection reads the
    # target's state and stays separate), as IBM's released speculators do: at a 49k
    # vocabulary the untied stages would hold more parameters than SmolLM2 itself.
    tie_weights: bool = True
    scale_input: bool = True  # a parameter-free norm on the target's state, / sqrt(2)
    # Stage 1 of the paper trains on the data's tokens (False); stage 2 on the target's own
    # answers: train.init_from=<stage-1 run> on specdraft-prepare output. True: every stage
    # learns the target's distribution at its position instead (soft labels).
    soft_labels: bool = False
    loss: str = "ce"  # ce | tvd (models/losses.py); with hard labels tvd is 1 - q(label)
    stage_decay: float = 1.0  # loss weight of stage i is stage_decay ** i
    top_k_tokens_per_head: list[int] | None = None  # export metadata; None: [5, 4, 3, ...]
    n_candidates: int = 5  # export metadata (the engines' candidate count)
