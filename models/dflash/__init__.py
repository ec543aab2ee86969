"""DFlash block drafter: config, module and losses, proposer, export formats."""

from .config import DFlashConfig
from .model import DFlashDraft, sample_anchors, slot_weights
from .proposer import DFlashProposer

__all__ = [
    "DFlashConfig",
    "DFlashDraft",
    "DFlashProposer",
    "sample_anchors",
    "slot_weights",
]
