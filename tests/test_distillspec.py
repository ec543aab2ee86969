"""DistillSpec: divergences (property tests), students, on-policy data, training and decoding."""

from __future__ import annotations

import json
import math

import pytest
import torch
from conftest import compose, run_module, tiny_overrides
from hypothesis import given, settings
from hypothesis import strategies as st

from decoding.decoder import NoDraft, SpeculativeDecoder
from models.base import DraftError
from models.distillspec import (
    DistillSpecConfig,
    DistillSpecStudent,
    acceptance_rate,
    divergence,
    next_token_rows,
)
from models.sampling import Sampling

logits = st.integers(2, 12).flatmap(
    lambda v: st.tuples(
        st.lists(st.floats(-6, 6), min_size=v, max_size=v),
        st.lists(st.floats(-6, 6), min_size=v, max_size=v),
    )
)


@settings(max_examples=80, deadline=None)
@given(pair=logits, kind=st.sampled_from(["fkl", "rkl", "jsd", "tvd"]), beta=st.floats(0.05, 0.95))
def test_divergences_are_nonnegative_and_zero_only_at_equality(pair, kind, beta):
    s, t = (torch.tensor([x]) for x in pair)
    d = divergence(s, t, kind, beta)
    assert d.shape == (1,) and d.item() >= -1e-6
    assert divergence(t, t, kind, beta).item() == pytest.approx(0.0, abs=1e-5)


@settings(max_examples=60, deadline=None)
@given(pair=logits)
def test_divergence_identities(pair):
    s, t = (torch.tensor([x]) for x in pair)
    p, q = t.softmax(-1), s.softmax(-1)
    # KL by hand
    assert divergence(s, t, "fkl").item() == pytest.approx(
        (p * (p / q).log()).sum().item(), abs=1e-4
    )
    assert divergence(s, t, "rkl").item() == pytest.approx(
        (q * (q / p).log()).sum().item(), abs=1e-4
    )
    # JSD endpoints are the two KLs; the symmetric JSD is symmetric and bounded by log 2
    assert divergence(s, t, "jsd", 0.0).item() == pytest.approx(divergence(s, t, "fkl").item())
    assert divergence(s, t, "jsd", 1.0).item() == pytest.approx(divergence(s, t, "rkl").item())
    j = divergence(s, t, "jsd", 0.5).item()
    assert j == pytest.approx(divergence(t, s, "jsd", 0.5).item(), abs=1e-5)
    assert j <= math.log(2) + 1e-6
    # acceptance = 1 - TVD (Leviathan et al.: beta = sum min(p, q))
    assert acceptance_rate(s, t).item() == pytest.approx(
        1 - divergence(s, t, "tvd").item(), abs=1e-5
    )


def test_temperature_flattens_both():
    s, t = torch.tensor([[4.0, 0.0, 0.0]]), torch.tensor([[0.0, 4.0, 0.0]])
    assert divergence(s, t, "fkl", temperature=4.0) < divergence(s, t, "fkl", temperature=1.0)


def test_rows_are_reply_positions_that_predict_assistant_tokens():
    """A reply's first token is the prefill's (never drafted): rows start at it."""
    lm = torch.tensor([[0, 0, 1, 1, 0], [0, 1, 1, 0, 0]])
    attn = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0]])
    b, t = next_token_rows(lm, attn)
    assert list(zip(b.tolist(), t.tolist(), strict=True)) == [(0, 2), (1, 1)]


def batch(target, T=24, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 256, (2, T), generator=g)
    attn = torch.ones(2, T, dtype=torch.long)
    attn[1, -5:] = 0
    lm = attn.clone()
    lm[:, :6] = 0
    feats = target.features(ids, attn, (-1,))
    return {"input_ids": ids, "attention_mask": attn, "loss_mask": lm, "features": feats}


@pytest.mark.parametrize("kind", ["fkl", "rkl", "jsd", "tvd"])
def test_student_trains_towards_the_target(tiny_target, kind):
    torch.manual_seed(0)
    m = DistillSpecStudent(tiny_target, DistillSpecConfig(num_layers=1, divergence=kind, chunk=7))
    before = {k: v.clone() for k, v in tiny_target.model.state_dict().items()}
    opt = torch.optim.AdamW([p for p in m.parameters() if p.requires_grad], lr=3e-3)
    b = batch(tiny_target)
    first = None
    for _ in range(25):
        out = m(b)
        first = first if first is not None else out.loss.item()
        opt.zero_grad()
        out.loss.backward()
        opt.step()
    assert out.loss.item() < 0.7 * first
    m.eval()
    ev = m.evaluate(b)
    assert 0 < ev["accept_T1"][0] / ev["accept_T1"][1] <= 1
    for k, v in tiny_target.model.state_dict().items():
        assert torch.equal(v, before[k]), f"target {k} moved"


def test_chunking_does_not_change_the_loss_or_gradient(tiny_target):
    b = batch(tiny_target)
    grads = []
    for chunk in (5, 10_000):
        torch.manual_seed(0)
        m = DistillSpecStudent(tiny_target, DistillSpecConfig(num_layers=1, chunk=chunk))
        m.train()
        loss = m(b).loss
        loss.backward()
        grads.append((loss.item(), m.student.lm_head.weight.grad.clone()))
    # the loss is a small KL (~3e-3), a difference of near-equal log-probabilities: chunked
    # matrix products move it by float32 noise (~4e-9 here), not by a row dropped or counted
    # twice (~1e-4 and more)
    assert grads[0][0] == pytest.approx(grads[1][0], rel=1e-5, abs=1e-8)
    assert torch.allclose(grads[0][1], grads[1][1], atol=1e-6)


def test_lora_student_trains_only_the_adapter(tiny_target):
    m = DistillSpecStudent(tiny_target, DistillSpecConfig(num_layers=1, lora=True, lora_r=4))
    names = [k for k, p in m.named_parameters() if p.requires_grad]
    assert names and all("lora_" in k for k in names)


def test_on_policy_fraction_is_exact_and_replies_are_the_students(tiny_target):
    m = DistillSpecStudent(
        tiny_target,
        DistillSpecConfig(num_layers=1, on_policy=0.25, gen_max_new_tokens=6, gen_temperature=0),
    )
    seen = []
    for _ in range(8):
        seen.append(m.on_policy_now())
        m.micro_batches += 1
    assert sum(seen) == 2
    b = batch(tiny_target)
    new = m.student_replies(b)
    for i in range(2):
        first = int(b["loss_mask"][i].nonzero()[0])
        assert torch.equal(new["input_ids"][i, :first], b["input_ids"][i, :first])  # prompt kept
        reply = new["input_ids"][i][new["loss_mask"][i].bool()]
        assert 1 <= len(reply) <= 6
        # greedy: the reply starts with the student's own argmax continuation
        with torch.no_grad():
            nxt = m.student(input_ids=b["input_ids"][i : i + 1, :first]).logits[0, -1].argmax()
        assert int(reply[0]) == int(nxt)
    assert new["features"].shape[:2] == new["input_ids"].shape


def test_student_with_another_tokenizer_is_refused(tiny_target, tmp_path):
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    from models.tiny import build_tiny_tokenizer

    tok = build_tiny_tokenizer()
    tok.add_tokens(["<extra>"])
    other = tmp_path / "other"
    cfg = LlamaConfig(
        vocab_size=len(tok),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
    )
    LlamaForCausalLM(cfg).save_pretrained(str(other))
    tok.save_pretrained(str(other))
    assert isinstance(tok, PreTrainedTokenizerFast)
    with pytest.raises(DraftError, match="differs from the target's at id 259"):
        DistillSpecStudent(tiny_target, DistillSpecConfig(student=str(other)))


def test_save_load_and_lossless_drafting(tiny_target, tmp_path):
    torch.manual_seed(0)
    m = DistillSpecStudent(tiny_target, DistillSpecConfig(num_layers=1, lora=True, lora_r=4))
    with torch.no_grad():
        for k, p in m.named_parameters():
            if "lora_B" in k:
                p.add_(torch.randn_like(p) * 0.1)
    m.save_draft(tmp_path / "d")
    back = DistillSpecStudent.load_draft(tmp_path / "d", tiny_target)
    ids = torch.tensor([[257, 72, 101, 108, 108, 111]])
    with torch.no_grad():
        assert torch.allclose(
            m.merged()(input_ids=ids).logits, back.student(input_ids=ids).logits, atol=1e-5
        )
    prompt = [257, 72, 101, 108, 108, 111, 32, 119, 111]
    ref = SpeculativeDecoder(tiny_target, NoDraft(), Sampling(), calibrate=False).generate(
        prompt, 30
    )
    dec = SpeculativeDecoder(tiny_target, back.proposer(), Sampling(), gamma=3, adaptive=False)
    assert dec.generate(prompt, 30) == ref


def test_train_then_eval(data_file, tmp_path):
    from trainer.train import run

    out = tmp_path / "run"
    extra = {
        "train.max_steps": 4,
        "method.num_layers": 1,
        "method.on_policy": 0.5,
        "method.gen_max_new_tokens": 8,
        "method.divergence": "tvd",
    }
    s = run(compose(tiny_overrides(data_file, out, method="distillspec", **extra)))
    assert s["step"] == 4 and "accept_T1" in s["val"] and "accept_T0" in s["val"]
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert any(r.get("on_policy", 0) > 0 for r in rows)
    assert (out / "final" / "student" / "config.json").exists()
    rep = tmp_path / "r.json"
    r = run_module(
        "decoding.eval",
        [
            "target=tiny_random",
            f"draft={out}",
            "num_prompts=2",
            "max_new_tokens=16",
            f"report={rep}",
        ],
        300,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    assert json.loads(rep.read_text())["lossless"] is True


@pytest.mark.parametrize("extra", [32, -16])
def test_a_student_of_another_embedding_size_trains_on_the_shared_ids(tiny_target, extra):
    """The same tokenizer with embedding matrices padded to other sizes (Qwen2.5-0.5B's 151,936
    rows for 7B's 152,064) crashed the divergence on mismatched shapes. A larger student is
    trained on the target's ids (its padded rows cut: the loss is the unpadded student's), a
    smaller one on the ids it has; the proposer drafts over the same ids."""
    from models.draft_lm.proposer import _fit_vocab

    torch.manual_seed(0)
    m = DistillSpecStudent(tiny_target, DistillSpecConfig(num_layers=1))
    V = tiny_target.config.vocab_size
    b = batch(tiny_target)
    if extra < 0:  # a student without the target's last ids: none may occur in its input
        b["input_ids"] = b["input_ids"].clamp(max=V + extra - 1)
    m.eval()
    same = m(b).loss.item()
    m.student.resize_token_embeddings(V + extra)
    out = m(b)
    assert math.isfinite(out.loss.item())
    if extra > 0:
        assert out.loss.item() == pytest.approx(same, rel=1e-6)
    ev = m.evaluate(b)
    assert 0 < ev["accept_T1"][0] / ev["accept_T1"][1] <= 1
    h = torch.randn(3, tiny_target.config.hidden_size)
    q = _fit_vocab(m.student_logits(h), V).softmax(-1)  # what the proposer hands the verifier
    assert q.shape[-1] == V and torch.allclose(q[:, : V + min(extra, 0)].sum(-1), torch.ones(3))
    if extra > 0:  # on-policy replies: the padded ids, however likely, are never written
        with torch.no_grad():
            m.student.lm_head.weight[V:] = 50 * h[0]
        m.cfg.gen_max_new_tokens, m.cfg.gen_temperature = 4, 0.0
        new = m.student_replies(b)
        assert int(new["input_ids"].max()) < V
