"""EAGLE draft heads (EAGLE-1, EAGLE-3) and EAGLE-2 dynamic draft trees: config, module and
losses, proposer, export formats."""

from .config import Eagle1Config, Eagle3Config
from .model import (
    Eagle3Head,
    EagleHead,
    assistant_token_counts,
    draft_vocab,
    feature_regression_loss,
    position_mask,
)
from .proposer import EagleProposer, EagleTreeProposer

__all__ = [
    "Eagle1Config",
    "Eagle3Config",
    "Eagle3Head",
    "EagleHead",
    "EagleProposer",
    "EagleTreeProposer",
    "assistant_token_counts",
    "draft_vocab",
    "feature_regression_loss",
    "position_mask",
]
