"""P-EAGLE: an EAGLE-3 head drafting K tokens per forward (config, module, proposer, export)."""

from .config import PEagleConfig
from .model import PEagleHead
from .proposer import PEagleProposer

__all__ = ["PEagleConfig", "PEagleHead", "PEagleProposer"]
