"""MLP speculator (Wertheimer et al. 2024): config, module and losses, proposer, export
format (``--format mlp_speculator``: vLLM's and TGI's ``MLPSpeculator``)."""

from .config import MLPSpeculatorConfig
from .model import MLPSpeculator, SpeculatorNorm
from .proposer import MLPSpeculatorProposer

__all__ = ["MLPSpeculator", "MLPSpeculatorConfig", "MLPSpeculatorProposer", "SpeculatorNorm"]
