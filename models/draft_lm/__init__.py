"""Any causal LM with the target's tokenizer as a drafter (DistillSpec students, ``truncate:N``,
any HF draft model): loading one and proposing with it (``proposer.py``: transformers' forward,
batch 1 and every row of a batch at once), and the same drafting on the decoders' static path
(``static.py``: the lean forward over a static cache, a whole proposal captured as one CUDA
graph where graphs run)."""

from .proposer import (
    BatchedDraftLM,
    DraftLMProposer,
    chain_from,
    load_same_vocabulary_lm,
)

__all__ = ["BatchedDraftLM", "DraftLMProposer", "chain_from", "load_same_vocabulary_lm"]
