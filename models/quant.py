"""Weight-only int8 for a draft at decode time.

A draft step at batch size 1 reads every weight once for a handful of rows, so on a CPU it runs
at memory speed: the shipped EAGLE-3 head's ~9M weights take 0.8 ms per step in bf16 once the
target's forward has pushed them out of the caches, and int8 weights (per-output-channel scales,
torch's ``_weight_int8pack_mm`` kernel) halve the bytes and take 0.4 ms (docs/benchmarks.md).
Only the draft is quantized, never the target, so speculative decoding stays exactly as lossless
as before: the draft's probabilities move slightly and verification corrects for whatever the
draft proposes. Training never sees these modules.
"""

from __future__ import annotations

import torch
from torch import nn

#: draft_weights values: auto (int8 where it is known to be faster: a bf16 draft on a CPU),
#: int8 (wherever the kernel runs), full (the draft's own dtype)
MODES = ("auto", "int8", "full")


def check_mode(mode: str) -> None:
    """``ValueError`` naming a ``draft_weights`` value that is not one of ``MODES``."""
    if mode not in MODES:
        raise ValueError(f"draft_weights={mode!r}: use one of {', '.join(MODES)}")


class Int8Linear(nn.Module):
    """``nn.Linear`` with int8 weights (N, K) and one scale per output row:
    y = (x @ q.T) * scale + bias, computed by ``torch._weight_int8pack_mm`` in x's dtype."""

    def __init__(self, qweight: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None):
        super().__init__()
        self.out_features, self.in_features = qweight.shape
        self.register_buffer("qweight", qweight)
        self.register_buffer("scales", scales)
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)

    @property
    def dtype(self) -> torch.dtype:
        """The dtype inputs are computed in (that of the layer it replaced)."""
        return self.scales.dtype

    @classmethod
    def from_linear(cls, linear: nn.Linear) -> Int8Linear:
        w = linear.weight.detach().float()
        scales = (w.abs().amax(dim=1) / 127.0).clamp_min(1e-12)
        q = torch.round(w / scales[:, None]).clamp(-127, 127).to(torch.int8)
        bias = None if linear.bias is None else linear.bias.detach().clone()
        return cls(q.contiguous(), scales.to(linear.weight.dtype), bias)

    def dequantized(self) -> torch.Tensor:
        """The weight this layer multiplies by, (N, K) in its dtype."""
        return (self.qweight.float() * self.scales.float()[:, None]).to(self.dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x2 = x.reshape(-1, self.in_features).to(self.dtype).contiguous()
        y = torch._weight_int8pack_mm(x2, self.qweight, self.scales)
        if self.bias is not None:
            y = y + self.bias
        return y.view(*shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, int8 weights"


def input_dtype(layer: nn.Module) -> torch.dtype:
    """The dtype a linear layer computes in, int8 (``Int8Linear``) or not: what to cast its
    input to."""
    return layer.dtype if isinstance(layer, Int8Linear) else layer.weight.dtype


def _kernel_ok(in_features: int, dtype: torch.dtype, device: torch.device) -> bool:
    """Whether torch's int8 kernel handles this shape: CPU only, and in reduced precision the
    reduction length must be a multiple of 16 (torch 2.13's bf16 kernel crashes or returns wrong
    values otherwise; measured here)."""
    if device.type != "cpu" or not hasattr(torch, "_weight_int8pack_mm"):
        return False
    if dtype not in (torch.float32, torch.bfloat16, torch.float16):
        return False
    return dtype == torch.float32 or in_features % 16 == 0


def _agrees(layer: Int8Linear) -> bool:
    """A probe: the kernel's output against the dequantized weight's (catches a kernel that
    computes something else on this machine)."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, layer.in_features, generator=g).to(layer.dtype)
    ref = x.float() @ layer.dequantized().float().T
    if layer.bias is not None:
        ref = ref + layer.bias.float()
    got = layer(x).float()
    return bool((got - ref).abs().max() <= 0.02 * ref.abs().max() + 1e-3)


def int8_linear(linear: nn.Linear, mode: str) -> Int8Linear | None:
    """An ``Int8Linear`` copy of ``linear`` where ``mode`` asks for one and the kernel runs here
    (and agrees with the dequantized weight), else None."""
    check_mode(mode)
    dtype, device = linear.weight.dtype, linear.weight.device
    if mode == "full" or (mode == "auto" and (device.type != "cpu" or dtype == torch.float32)):
        return None
    if not _kernel_ok(linear.in_features, dtype, device):
        return None
    q = Int8Linear.from_linear(linear)
    return q if _agrees(q) else None


def quantize_linears(module: nn.Module, mode: str = "auto") -> int:
    """Replace every ``nn.Linear`` inside ``module`` (in place) by an ``Int8Linear`` where
    ``mode`` asks for it and the kernel runs here; returns how many were replaced (0: the module
    is unchanged). ``auto`` quantizes a bf16/fp16 module on a CPU; ``int8`` any CPU module
    (float32 too: 4x fewer bytes); ``full`` nothing. Modules held outside ``module``'s
    submodules (an EAGLE head's frozen target) are never touched."""
    check_mode(mode)
    replaced = 0
    for child in list(module.modules()):
        for attr, sub in list(child.named_children()):
            if type(sub) is nn.Linear and (q := int8_linear(sub, mode)) is not None:
                setattr(child, attr, q)
                replaced += 1
    return replaced
