"""Falcon: a semi-autoregressive feature-level drafter with CSGD training (config, module,
proposers; no serving engine reads Falcon heads, so it has no export layout)."""

from .config import FalconConfig
from .model import FalconHead
from .proposer import FalconProposer, FalconTreeProposer

__all__ = ["FalconConfig", "FalconHead", "FalconProposer", "FalconTreeProposer"]
