"""Medusa heads (Medusa-1 on a frozen backbone, Medusa-2 with LoRA and self-distillation):
config, module and losses, proposer, export formats."""

from .config import Medusa1Config, Medusa2Config
from .model import (
    Medusa2Heads,
    MedusaHeads,
    build_tree,
    expected_length,
    head_masks,
    kl_divergence,
    read_tree_file,
    warmup_factor,
)
from .proposer import MedusaProposer

__all__ = [
    "Medusa1Config",
    "Medusa2Config",
    "Medusa2Heads",
    "MedusaHeads",
    "MedusaProposer",
    "build_tree",
    "expected_length",
    "head_masks",
    "kl_divergence",
    "read_tree_file",
    "warmup_factor",
]
