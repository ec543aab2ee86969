"""Sampling primitives shared by proposers and the decoder: decoding settings and the warped
distributions that both the draft and the target are sampled/verified under."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Sampling:
    """Decoding settings. temperature == 0 means greedy (argmax) decoding and verification."""

    temperature: float = 0.0
    top_k: int = 0  # 0: off
    top_p: float = 1.0  # 1.0: off

    def __post_init__(self):
        # out-of-range settings would end in NaN distributions deep in the decoder
        if not self.temperature >= 0:
            raise ValueError(f"temperature={self.temperature}: must be >= 0")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p={self.top_p}: must be in (0, 1]")
        if not self.top_k >= 0:
            raise ValueError(f"top_k={self.top_k}: must be >= 0 (0: off)")

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0.0


def warp(logits: torch.Tensor, s: Sampling) -> torch.Tensor:
    """Logits (..., V) -> sampling probabilities (..., V) in float32 under temperature, top-k and
    top-p (smallest set of most likely tokens with mass >= top_p). Not for greedy settings."""
    x = logits.float() / s.temperature
    if s.top_k and s.top_k < x.shape[-1]:
        kth = torch.topk(x, s.top_k, dim=-1).values[..., -1:]
        x = x.masked_fill(x < kth, float("-inf"))
    if s.top_p < 1.0:
        sorted_x, idx = torch.sort(x, dim=-1, descending=True)
        probs = sorted_x.softmax(-1)
        # drop a token when the mass strictly before it already reaches top_p
        drop_sorted = probs.cumsum(-1) - probs >= s.top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, idx, drop_sorted)
        x = x.masked_fill(drop, float("-inf"))
    return x.softmax(-1)


def greedy_tokens(logits: torch.Tensor) -> torch.Tensor:
    """Argmax over the last dim (..., V) -> (...), ties to the lowest id as ``argmax``. Reads
    bf16/fp16 logits as float32 first: the same answer (the conversion is exact), but on a CPU
    torch's reduced-precision argmax is ~3x slower than the conversion and a float32 argmax
    together (0.80 vs 0.29 ms for 9 x 49,152 bf16 logits on a 2-core AMD EPYC, docs/benchmarks.md): a
    verification's argmax was 3% of a speculative iteration."""
    return logits.float().argmax(-1)


def sample(p: torch.Tensor, generator: torch.Generator | None) -> int:
    """One draw from the distribution ``p`` (V,): non-negative weights with a positive total
    (normalised or not, as ``torch.multinomial`` takes them), by the inverse of its cumulative
    distribution at one uniform draw from ``generator``: the first index whose cumulative
    weight exceeds u * total, so a token of weight 0 is never drawn.

    The same law as ``torch.multinomial(p, 1)``, but 17x cheaper on a CPU (0.05 against
    0.87 ms for a 49,152-token distribution on the AMX Xeon, docs/benchmarks.md), where one
    draw per row and per drafted token was a third of a batched plain step at T = 1. The
    cumulative sum is taken in float64, so rounding moves no token's probability by more than
    ~1e-16 (float32 over 49,152 terms would move it by up to ~1e-4 relative).

    Where p itself moves by rounding (a batch of other rows, other padding), an inverse-CDF draw
    moves to a neighbouring token more often than torch.multinomial's exponential race does:
    data generation, whose resumed run must write the same file, keeps torch.multinomial
    (``decoding.verify.AcceptRule.race``, ``models.target.generate_many``)."""
    c = p.cumsum(-1, dtype=torch.float64)
    u = torch.rand((), generator=generator, dtype=torch.float64, device=p.device)
    i = int(torch.searchsorted(c, (u * c[-1]).reshape(1), right=True))
    if i < p.shape[-1]:
        return i
    # u * total rounded up to the total itself (u within 2^-53 of 1), or no usable mass
    total = float(c[-1])
    if not (total > 0 and math.isfinite(total)):
        raise ValueError(
            f"cannot sample from a distribution whose total weight is {total} "
            f"({p.shape[-1]} entries): the warped probabilities are all zero or not finite"
        )
    return int(torch.nonzero(p > 0)[-1])


def inverse_cdf(p: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """``sample`` for each row of p (R, V) at its own uniform u (R,) in [0, 1), on p's device
    with no read of it: the first index whose cumulative weight (float64) exceeds u * total,
    never past the row's last token of positive weight (where u * total rounds up to the
    total). A row with no usable mass is the caller's to rule out (``sample`` raises)."""
    c = p.cumsum(-1, dtype=torch.float64)
    total = c[:, -1:].contiguous()
    i = torch.searchsorted(c, u[:, None] * total, right=True)
    # where u * total rounded up to the total, i is past the end: the first index at which the
    # cumulative weight reaches the total instead, a token of positive weight
    return torch.minimum(i, torch.searchsorted(c, total))[:, 0]
