"""DFlash block drafter, and Domino (DFlash with its GRU logit correction, an option of the
same module): config, module and losses, proposer, export formats."""

from .config import DFlashConfig, DominoConfig
from .model import DFlashDraft, DominoDraft, GRUCorrection, sample_anchors, slot_weights
from .proposer import DFlashProposer

__all__ = [
    "DFlashConfig",
    "DFlashDraft",
    "DFlashProposer",
    "DominoConfig",
    "DominoDraft",
    "GRUCorrection",
    "sample_anchors",
    "slot_weights",
]
