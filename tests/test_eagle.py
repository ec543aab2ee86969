"""EAGLE-1 head: the unrolled attention pattern equals decoding, training touches only the
draft, checkpoints round-trip."""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import DynamicCache

from models.eagle import Eagle1Config, EagleHead


def make_batch(target, B=2, T=24, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 256, (B, T), generator=g)
    attn = torch.ones(B, T, dtype=torch.long)
    attn[1, T - 5 :] = 0  # right padding on the second row
    lm = attn.clone()
    lm[:, :4] = 0
    feats = target.features(ids, attn, (-1,))
    return {"input_ids": ids, "attention_mask": attn, "loss_mask": lm, "features": feats}


def _target(attn):
    from models.target import Target, TargetConfig
    from models.tiny import build_tiny_target

    model, tok = build_tiny_target(seed=0)
    model.set_attn_implementation(attn)
    return Target(model.eval(), tok, f"tiny-{attn}", TargetConfig(name="tiny_random"))


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_unroll_matches_sequential_decoding(attn):
    """The unrolled training pattern (every start at once) equals drafting one start at a time
    with masks, whatever the target's own attention implementation: the head's layer uses its
    own attention function, which reads a boolean mask as True = attend."""
    tiny_target = _target(attn)
    torch.manual_seed(0)
    head = EagleHead(tiny_target, Eagle1Config()).eval()
    b = make_batch(tiny_target)
    f = b["features"][:, :, 0]
    with torch.no_grad():
        outs = head.unroll(f, b["input_ids"], b["attention_mask"], steps=3)
        # Decoding-style reference for one start s on row 0: prefill positions 0..s with real
        # features, then feed each predicted feature with the next token, one at a time.
        ids = b["input_ids"][:1]
        for s in (0, 5, 17):
            cache = DynamicCache()
            pos = torch.arange(s + 1)[None]
            emb = head._embed(ids[:, 1 : s + 2])
            h = head.step(f[:1, : s + 1], emb, pos, None if s == 0 else _causal(s + 1), cache)
            prev = h[:, -1:]
            assert torch.allclose(prev[0, 0], outs[0][0, s], atol=1e-5)
            for j in (2, 3):
                emb = head._embed(ids[:, s + j : s + j + 1])
                prev = head.step(prev, emb, torch.tensor([[s + j - 1]]), None, cache)
                assert torch.allclose(prev[0, 0], outs[j - 1][0, s], atol=1e-5), (s, j)


def _causal(n):
    return torch.tril(torch.ones(n, n, dtype=torch.bool))[None, None]


def test_one_step_moves_every_draft_parameter_and_no_target_parameter(tiny_target):
    torch.manual_seed(0)
    head = EagleHead(tiny_target, Eagle1Config())
    before_draft = copy.deepcopy(head.state_dict())
    before_target = {k: v.clone() for k, v in tiny_target.model.state_dict().items()}
    opt = torch.optim.AdamW(head.parameters(), lr=1e-2)
    out = head(make_batch(tiny_target))
    out.loss.backward()
    opt.step()
    for k, v in head.state_dict().items():
        assert not torch.equal(v, before_draft[k]), f"draft parameter {k} did not move"
    for k, v in tiny_target.model.state_dict().items():
        assert torch.equal(v, before_target[k]), f"target parameter {k} moved"
    assert not any(p.requires_grad for p in tiny_target.model.parameters())
    # the target is not part of the draft's state (never saved or optimised with it)
    assert all(k.startswith(("fc.", "layer.")) for k in head.state_dict())


def test_fused_token_loss_equals_the_soft_ce_over_the_logits(tiny_target):
    """EAGLE-1's token term goes through the fused LM head + soft CE: the same loss, accuracy
    and gradients as the paper's formula written out over the frozen head's full logits."""
    from models.eagle import feature_regression_loss, position_mask
    from models.losses import soft_cross_entropy_probs

    torch.manual_seed(0)
    cfg = Eagle1Config(noise=0.0, w_cls=1.0)
    head = EagleHead(tiny_target, cfg)
    b = make_batch(tiny_target)
    out = head(b)
    out.loss.backward()
    fused = {k: v.grad.clone() for k, v in head.named_parameters()}
    head.zero_grad()
    f = b["features"][:, :, 0]
    (pred,) = head.unroll(f, b["input_ids"], b["attention_mask"], steps=1)
    mask = position_mask(b["loss_mask"], b["attention_mask"], steps=1)[0]
    rows = mask.nonzero(as_tuple=True)
    p_hat, f_next = pred[rows], f[:, 1:][rows]
    d_logits, t_logits = head.logits(p_hat), head.logits(f_next).detach()
    ref = cfg.w_reg * feature_regression_loss(p_hat, f_next) + cfg.w_cls * (
        soft_cross_entropy_probs(d_logits, t_logits.softmax(-1))
    )
    ref.backward()
    n = len(rows[0])
    acc = (d_logits.argmax(-1) == t_logits.argmax(-1)).float().sum()
    assert out.loss.item() == pytest.approx(ref.item(), rel=1e-5)
    assert out.metrics["acc"].tolist() == [acc.item(), n]
    for k, v in head.named_parameters():
        assert torch.allclose(fused[k], v.grad, rtol=1e-4, atol=1e-6), k
    assert all(p.grad is None for p in tiny_target.model.parameters())


def test_loss_decreases_when_fitting_one_batch(tiny_target):
    torch.manual_seed(0)
    head = EagleHead(tiny_target, Eagle1Config(noise=0.0))
    opt = torch.optim.AdamW(head.parameters(), lr=3e-3)
    b = make_batch(tiny_target)
    first = None
    for _ in range(30):
        loss = head(b).loss
        first = first if first is not None else loss.item()
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert loss.item() < 0.7 * first


def test_save_load_round_trip(tiny_target, tmp_path):
    torch.manual_seed(0)
    head = EagleHead(tiny_target, Eagle1Config(val_positions=3)).eval()
    b = make_batch(tiny_target)
    head.save_draft(tmp_path / "d")
    loaded = EagleHead.load_draft(tmp_path / "d", tiny_target).eval()
    assert loaded.cfg == head.cfg
    with torch.no_grad():
        a = head.unroll(b["features"][:, :, 0], b["input_ids"], b["attention_mask"], 2)
        c = loaded.unroll(b["features"][:, :, 0], b["input_ids"], b["attention_mask"], 2)
    assert all(torch.equal(x, y) for x, y in zip(a, c, strict=True))


def test_evaluate_reports_each_position(tiny_target):
    head = EagleHead(tiny_target, Eagle1Config(val_positions=4)).eval()
    m = head.evaluate(make_batch(tiny_target))
    for k in range(1, 5):
        s, n = m[f"top1_pos{k}"].tolist()
        assert 0 <= s <= n and n > 0
    # alpha at position 1 is plain top-1 agreement
    assert torch.equal(m["alpha_pos1"], m["top1_pos1"])


def test_reference_layout_has_no_input_norm_and_reads_embedding_first(tiny_target):
    head = EagleHead(tiny_target, Eagle1Config())
    assert not any("input_layernorm" in k for k in head.state_dict())
    H = tiny_target.hidden_size
    feats, emb = torch.randn(1, 1, H), torch.randn(1, 1, H)
    with torch.no_grad():
        head.fc.weight[:, H:] = 0.0  # only the first block: the embedding's
        a = head.step(feats, emb, torch.zeros(1, 1, dtype=torch.long), None)
        b = head.step(feats * 3, emb, torch.zeros(1, 1, dtype=torch.long), None)
    assert torch.allclose(a, b)


def test_drafts_saved_in_format_1_load_as_trained(tiny_target, tmp_path):
    """Before format 2, EAGLE-1 kept the layer's input norm and read [feature; embedding]."""
    import json

    from safetensors.torch import load_file, save_file

    torch.manual_seed(0)
    old = EagleHead(tiny_target, Eagle1Config(input_norm=True)).eval()
    old.save_draft(tmp_path / "d")
    cfg = json.loads((tmp_path / "d" / "config.json").read_text())
    del cfg["method"]["input_norm"]
    cfg["specdraft"]["format_version"] = 1
    (tmp_path / "d" / "config.json").write_text(json.dumps(cfg))
    w = load_file(str(tmp_path / "d" / "model.safetensors"))
    H = tiny_target.hidden_size
    w["fc.weight"] = torch.cat([w["fc.weight"][:, H:], w["fc.weight"][:, :H]], 1)  # old order
    save_file(w, str(tmp_path / "d" / "model.safetensors"))
    loaded = EagleHead.load_draft(tmp_path / "d", tiny_target).eval()
    assert loaded.cfg.input_norm is True
    x, e, pos = torch.randn(1, 3, H), torch.randn(1, 3, H), torch.arange(3)[None]
    with torch.no_grad():
        assert torch.allclose(loaded.step(x, e, pos, None), old.step(x, e, pos, None))
