"""Weight-only int8 draft layers (models/quant.py) and the loader's ``draft_weights`` setting."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from models.quant import Int8Linear, quantize_linears


def _linear(k, n, dtype, bias=True, seed=0):
    torch.manual_seed(seed)
    return nn.Linear(k, n, bias=bias).to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bias", [True, False])
def test_int8_linear_computes_what_the_linear_does(dtype, bias):
    lin = _linear(96, 40, dtype, bias)
    q = Int8Linear.from_linear(lin)
    x = torch.randn(2, 5, 96).to(dtype)  # leading dims are kept
    got, ref = q(x).float(), lin(x).float()
    assert got.shape == ref.shape == (2, 5, 40)
    # per-row int8 keeps ~2 significant digits: relative error well under 2%
    assert (got - ref).abs().max() <= 0.02 * ref.abs().max()
    # and exactly what its own dequantized weight gives (up to the dtype's rounding)
    b = None if q.bias is None else q.bias.float()
    deq = torch.nn.functional.linear(x.float(), q.dequantized().float(), b)
    tol = 1e-4 if dtype == torch.float32 else 0.02
    assert (got - deq.float()).abs().max() <= tol * deq.abs().max()
    assert q.qweight.dtype == torch.int8 and q.dtype == dtype


def test_a_row_of_zeros_quantizes_to_zeros():
    lin = _linear(32, 4, torch.float32, bias=False)
    with torch.no_grad():
        lin.weight[1] = 0
    q = Int8Linear.from_linear(lin)
    assert torch.isfinite(q.scales).all()
    assert (q(torch.randn(3, 32))[:, 1] == 0).all()


def test_auto_quantizes_reduced_precision_modules_on_a_cpu_only():
    def model(dtype):
        return nn.Sequential(_linear(64, 32, dtype), nn.ReLU(), _linear(32, 16, dtype)).eval()

    m = model(torch.float32)
    assert quantize_linears(m, "auto") == 0  # fp32: left for exact reference runs
    assert all(type(x) is nn.Linear for x in (m[0], m[2]))
    assert quantize_linears(m, "full") == 0
    m = model(torch.bfloat16)
    x = torch.randn(4, 64).to(torch.bfloat16)
    ref = m(x).float()
    assert quantize_linears(m, "auto") == 2
    assert all(isinstance(x, Int8Linear) for x in (m[0], m[2]))
    assert (m(x).float() - ref).abs().max() <= 0.05 * ref.abs().max()
    assert quantize_linears(model(torch.float32), "int8") == 2  # asked for: fp32 too


def test_a_width_the_bf16_kernel_cannot_take_stays_a_linear():
    """torch's bf16 int8 kernel needs a reduction length that is a multiple of 16 (24 crashes
    the process, 8 returns wrong values): such layers are left as they are."""
    m = nn.Sequential(_linear(24, 16, torch.bfloat16), _linear(16, 8, torch.bfloat16))
    assert quantize_linears(m, "int8") == 1
    assert type(m[0]) is nn.Linear and isinstance(m[1], Int8Linear)


def test_an_unknown_mode_is_named():
    with pytest.raises(ValueError, match="draft_weights='int4'"):
        quantize_linears(nn.Linear(16, 16), "int4")


def test_the_loader_quantizes_eagle_heads_and_names_what_it_cannot(tiny_target):
    from decoding.drafts import _head_proposer
    from models.base import DecodeSettings, DraftError
    from models.eagle import Eagle1Config, Eagle3Config, Eagle3Head, EagleHead
    from models.medusa import Medusa1Config, MedusaHeads

    head = Eagle3Head(tiny_target, Eagle3Config(draft_vocab_size=64))
    prop, desc = _head_proposer(head, DecodeSettings(tree="chain", draft_weights="int8"), "e3")
    assert "int8 weights (9 layers)" in desc  # fc, q k v o, gate up down, lm_head
    assert isinstance(prop.head.lm_head, Int8Linear)
    # EAGLE-1 drafts through the target's LM head: the draft gets an int8 copy, the target
    # keeps its own (verification reads the original)
    head = EagleHead(tiny_target, Eagle1Config())
    _, desc = _head_proposer(head, DecodeSettings(tree="chain", draft_weights="int8"), "e1")
    assert "int8 weights (9 layers)" in desc  # fc, q k v o, gate up down + the LM head copy
    assert isinstance(head.__dict__["_draft_lm_head"], Int8Linear)
    assert type(tiny_target.lm_head) is nn.Linear
    head = Eagle3Head(tiny_target, Eagle3Config(draft_vocab_size=64))
    _, desc = _head_proposer(head, DecodeSettings(tree="chain"), "e3")  # auto, fp32 target
    assert "int8" not in desc
    with pytest.raises(DraftError, match="draft_weights='int4'"):
        _head_proposer(head, DecodeSettings(draft_weights="int4"), "e3")
    medusa = MedusaHeads(tiny_target, Medusa1Config(num_heads=2))
    with pytest.raises(DraftError, match="draft_weights=int8.*use draft_weights=full"):
        _head_proposer(medusa, DecodeSettings(draft_weights="int8"), "medusa")
    _head_proposer(medusa, DecodeSettings(), "medusa")  # auto: quietly as loaded
