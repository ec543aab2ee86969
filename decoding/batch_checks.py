"""What the batched decoder (``batch.py``) serves: one-line errors (``BatchError``) for a
proposer, a target or an evaluator setting it cannot, raised where the setting enters."""

from __future__ import annotations

from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer, DynamicSlidingWindowLayer

from models.base import Proposer
from models.target import Target


class BatchError(ValueError):
    """Settings the batched decoder cannot serve; the message says which and why."""


def side_branch_refusal(proposer: Proposer) -> str:
    return (
        f"draft {proposer.name}: adds a side branch to each verification forward "
        "(lookahead's Jacobi window), which the batched decoder does not carry; use "
        "batch_size=1 for it"
    )


def check_batchable(target: Target, proposer: Proposer) -> None:
    """``BatchError`` for a proposer or target the batched decoder cannot serve."""
    if type(proposer).side_branch is not Proposer.side_branch:
        raise BatchError(side_branch_refusal(proposer))
    odd = {
        type(x).__name__
        for x in DynamicCache(config=target.config).layers
        if type(x) not in (DynamicLayer, DynamicSlidingWindowLayer)
    }
    if odd:
        raise BatchError(
            f"target {target.identity}: batch_size > 1 needs attention cache layers (full or "
            f"sliding-window); this model has {', '.join(sorted(odd))}; use batch_size=1"
        )


def check_batch_settings(cfg, target: Target, proposer: Proposer) -> None:
    """One-line errors for evaluator settings the batched decoder does not serve."""
    check_batchable(target, proposer)
    if cfg.acceptance != "exact":
        raise BatchError(f"acceptance={cfg.acceptance} with batch_size > 1: only exact")
    if cfg.lenience != 1.0:
        raise BatchError(f"lenience={cfg.lenience} with batch_size > 1: only exact (1)")
    if cfg.stop == "disco" or cfg.traces:
        raise BatchError("stop=disco / traces with batch_size > 1: use batch_size=1")
    if cfg.turns != 1:
        raise BatchError(
            f"turns={cfg.turns} with batch_size > 1: later turns wait on earlier answers; "
            "use turns=1"
        )
    if cfg.compare_hf:
        raise BatchError(
            "compare_hf with batch_size > 1: transformers' assisted generation decodes one sequence"
        )
