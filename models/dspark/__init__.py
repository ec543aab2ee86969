"""DSpark semi-autoregressive drafter: DFlash's parallel backbone, a Markov head, a confidence
head (config, module and losses; it proposes through DFlash's proposer)."""

from .config import DSparkConfig
from .model import DSparkDraft, MarkovHead

__all__ = ["DSparkConfig", "DSparkDraft", "MarkovHead"]
