"""P-EAGLE config: the one place its defaults live (``conf/method/peagle.yaml`` only selects it)."""

from __future__ import annotations

from dataclasses import dataclass

from ..eagle.config import Eagle3Config


@dataclass
class PEagleConfig(Eagle3Config):
    name: str = "peagle"
    # Tokens drafted per forward (the paper's K, speculators' num_depths): slot 0 reads the
    # real token and features, slots 1..K-1 the mask token's embedding and ``mask_hidden``.
    # Training runs the K depths with the decode-time attention (causal within the group).
    ttt_steps: int = 5
    step_decay: float = 1.0  # every depth weighted alike; depth sampling thins deep ones
    # Depth sampling (the paper's COD): depth d >= 1 is trained on a random share
    # max(depth_keep ** d, depth_keep_min) of its positions.
    depth_keep: float = 0.8
    depth_keep_min: float = 0.2
    # the token whose (frozen) target embedding the unseen slots read; None: a spare embedding
    # row past the tokenizer's vocabulary (an error names the key where the target has none)
    mask_token_id: int | None = None
