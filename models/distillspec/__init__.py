"""DistillSpec: a small draft LM distilled towards the target (config, module and losses; it
proposes through the generic ``models.draft_lm.DraftLMProposer``)."""

from .config import DistillSpecConfig
from .model import (
    DistillSpecStudent,
    acceptance_rate,
    divergence,
    make_student,
    next_token_rows,
)

__all__ = [
    "DistillSpecConfig",
    "DistillSpecStudent",
    "acceptance_rate",
    "divergence",
    "make_student",
    "next_token_rows",
]
