"""Sampling primitives shared by proposers and the decoder: decoding settings and the warped
distributions that both the draft and the target are sampled/verified under."""

from __future__ import annotations

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
    together (0.80 vs 0.29 ms for 9 x 49,152 bf16 logits on CPU-2, docs/benchmarks.md): a
    verification's argmax was 3% of a speculative iteration."""
    return logits.float().argmax(-1)


def sample(p: torch.Tensor, generator: torch.Generator | None) -> int:
    return int(torch.multinomial(p, 1, generator=generator))
