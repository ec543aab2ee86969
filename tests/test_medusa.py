"""Medusa-1/-2 heads, the candidate tree, typical acceptance, decoding and training end to end."""

from __future__ import annotations

import copy
import itertools
import json
import math
import shutil

import pytest
import torch
from conftest import compose, run_module, tiny_overrides
from hypothesis import given, settings
from hypothesis import strategies as st

from decoding.decoder import NoDraft, SpeculativeDecoder
from decoding.verify import typical_threshold, verify_typical
from models.base import DecodeSettings
from models.medusa import (
    Medusa1Config,
    Medusa2Config,
    Medusa2Heads,
    MedusaHeads,
    build_tree,
    expected_length,
    head_masks,
    warmup_factor,
)
from models.sampling import Sampling
from models.target import TargetConfig, load_target

PROMPT = [257, 72, 101, 108, 108, 111, 32, 72, 101, 108, 108, 111, 32, 119, 111, 114]


def batch_for(target, heads, B=2, T=20, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 256, (B, T), generator=g)
    attn = torch.ones(B, T, dtype=torch.long)
    attn[1, T - 4 :] = 0
    lm = attn.clone()
    lm[:, :3] = 0
    b = {"input_ids": ids, "attention_mask": attn, "loss_mask": lm}
    if heads.feature_layers:
        b["features"] = target.features(ids, attn, heads.feature_layers)
    return b


# -- pure functions ----------------------------------------------------------------------------


def test_head_masks_point_at_assistant_tokens_k_plus_2_ahead():
    lm = torch.tensor([[0, 0, 1, 1, 1, 1, 0]])
    attn = torch.tensor([[1, 1, 1, 1, 1, 1, 0]])
    m = head_masks(lm, attn, 2)
    # labels at t+2 (t+3) in the reply 2..5, read from a state t whose next token x_{t+1} is
    # the reply's: t = 0 would draft the reply's first token, which the prefill chooses
    assert m[0][0].nonzero().flatten().tolist() == [1, 2, 3]
    assert m[1][0].nonzero().flatten().tolist() == [1, 2]


def test_warmup_is_a_sine_quarter_wave():
    assert warmup_factor(0, 100) == 0.0 and warmup_factor(100, 100) == 1.0
    assert warmup_factor(50, 100) == pytest.approx(math.sin(math.pi / 4))
    assert warmup_factor(7, 0) == 1.0


@settings(max_examples=40, deadline=None)
@given(
    acc=st.lists(
        st.lists(st.floats(0.0, 1.0), min_size=3, max_size=3).map(
            lambda r: sorted(r, reverse=True)
        ),
        min_size=1,
        max_size=3,
    ),
    nodes=st.integers(1, 8),
)
def test_tree_is_ancestor_closed_and_optimal(acc, nodes):
    tree = build_tree(acc, nodes)
    assert len(tree) == min(nodes, sum(3**d for d in range(1, len(acc) + 1)))
    assert len(set(tree)) == len(tree)
    seen = set()
    for p in tree:  # parents come first
        assert len(p) == 1 or p[:-1] in seen
        seen.add(p)
    # brute force: no ancestor-closed set of the same size has a larger expected length
    all_paths = [p for d in range(1, len(acc) + 1) for p in itertools.product(range(3), repeat=d)]
    if len(all_paths) <= 12:
        best = max(
            expected_length(acc, list(c))
            for c in itertools.combinations(all_paths, len(tree))
            if all(len(p) == 1 or p[:-1] in c for p in c)
        )
        assert expected_length(acc, tree) == pytest.approx(best)


def test_typical_acceptance_follows_the_threshold_and_reports_tvd():
    # vocabulary of 4; root distribution peaked on 1, after node 0 peaked on 2
    # rows: after the root, after node 0, after node 1, after node 2
    u = [0.25, 0.25, 0.25, 0.25]
    p = torch.tensor([[0.05, 0.85, 0.05, 0.05], [0.1, 0.1, 0.7, 0.1], u, u])
    thr = typical_threshold(p, 0.09, 0.3)
    assert thr[2] == pytest.approx(min(0.09, 0.3 * math.exp(-math.log(4))))
    g = torch.Generator().manual_seed(0)
    # nodes: 0 = token 1 at the root, 1 = token 3 at the root, 2 = token 2 after node 0
    v, tvd = verify_typical([1, 3, 2], [-1, -1, 0], p, 0.09, 0.3, g)
    assert v.path == [0, 2]  # the longest accepted path
    assert tvd[:2] == pytest.approx([1 - 0.85, 1 - 0.7]) and tvd[2] == 0.0
    v, tvd = verify_typical([0], [-1], p, 0.09, 0.3, g)  # p(0) = 0.05 < threshold
    assert v.path == [] and tvd == [0.0]


# -- the heads ---------------------------------------------------------------------------------


def test_fresh_heads_equal_the_target_head_and_train(tiny_target):
    heads = MedusaHeads(tiny_target, Medusa1Config(num_heads=3))
    h = torch.randn(5, tiny_target.hidden_size)
    assert torch.allclose(heads.head_logits(2, h), heads.target_logits(h), atol=1e-5)
    before = copy.deepcopy(dict(heads.named_parameters()))
    target_before = {k: v.clone() for k, v in tiny_target.model.state_dict().items()}
    opt = torch.optim.AdamW(heads.parameters(), lr=1e-2)
    out = heads(batch_for(tiny_target, heads))
    assert {"loss_head1", "loss_head3", "acc_head2"} <= set(out.metrics)
    out.loss.backward()
    opt.step()
    for k, v in heads.named_parameters():
        assert not torch.equal(v, before[k]), f"{k} did not move"
    for k, v in tiny_target.model.state_dict().items():
        assert torch.equal(v, target_before[k]), f"target {k} moved"


def test_head_decay_weights_the_heads(tiny_target):
    heads = MedusaHeads(tiny_target, Medusa1Config(num_heads=3, head_decay=0.5))
    out = heads(batch_for(tiny_target, heads))
    m = {k: (v[0] / v[1]).item() for k, v in out.metrics.items() if k.startswith("loss_head")}
    expect = m["loss_head1"] + 0.5 * m["loss_head2"] + 0.25 * m["loss_head3"]
    assert out.loss.item() == pytest.approx(expect, rel=1e-5)


def test_validation_counts_ranks_and_builds_the_tree(tiny_target, tmp_path):
    heads = MedusaHeads(tiny_target, Medusa1Config(num_heads=2, top_k=4, tree_nodes=6))
    out = heads.evaluate(batch_for(tiny_target, heads))
    top1 = out["top1_head1"][0] / out["top1_head1"][1]
    top4 = out["top4_head1"][0] / out["top4_head1"][1]
    assert 0 <= top1 <= top4 <= 1
    acc = heads.rank_accuracy()
    assert len(acc) == 2 and len(acc[0]) == 4 and acc[0][0] == pytest.approx(float(top1))
    heads.save_draft(tmp_path / "d")
    cfg = json.loads((tmp_path / "d" / "config.json").read_text())
    assert len(cfg["tree"]) == 6
    assert sum(cfg["rank_accuracy"], []) == pytest.approx(sum(acc, []))
    loaded = MedusaHeads.load_draft(tmp_path / "d", tiny_target)
    assert loaded.tree == [tuple(p) for p in cfg["tree"]]
    h = torch.randn(3, tiny_target.hidden_size)
    assert torch.equal(loaded.head_logits(1, h), heads.head_logits(1, h))


# -- decoding ----------------------------------------------------------------------------------


def trained_like(target, n=4):
    """Heads that actually predict something: perturbed, so top-k ranks vary."""
    torch.manual_seed(0)
    heads = MedusaHeads(target, Medusa1Config(num_heads=n, top_k=4, tree_nodes=12)).eval()
    with torch.no_grad():
        for p in heads.parameters():
            p.add_(torch.randn_like(p) * 0.02)
    return heads


@pytest.mark.parametrize("tree", ["static", "chain"])
def test_greedy_medusa_decoding_is_lossless(tiny_target, tree):
    ref = SpeculativeDecoder(tiny_target, NoDraft(), Sampling(), calibrate=False).generate(
        PROMPT, 40
    )
    heads = trained_like(tiny_target)
    prop = heads.proposer(DecodeSettings(tree=tree))
    dec = SpeculativeDecoder(
        tiny_target, prop, Sampling(), gamma=prop.tree_depth or 3, adaptive=False
    )
    assert dec.generate(PROMPT, 40) == ref
    if tree == "static":  # every iteration but the last (one token left: nothing drafted)
        assert dec.stats.tree_iterations >= dec.stats.target_calls - 1
    else:
        assert dec.stats.tree_iterations == 0


def test_typical_acceptance_moves_the_distribution_and_says_by_how_much(tiny_target):
    heads = trained_like(tiny_target)
    s = Sampling(1.0)
    exact = SpeculativeDecoder(tiny_target, heads.proposer(), s, gamma=4, adaptive=False)
    typ = SpeculativeDecoder(
        tiny_target, heads.proposer(), s, gamma=4, adaptive=False, acceptance="typical"
    )
    for dec in (exact, typ):
        for seed in range(4):
            dec.generator.manual_seed(seed)
            dec.generate(PROMPT, 24)
    assert exact.stats.tvd_tokens == 0
    assert typ.stats.tvd_tokens == typ.stats.new_tokens > 0
    assert 0.0 <= typ.stats.mean_tvd <= 1.0


# -- Medusa-2 ----------------------------------------------------------------------------------


@pytest.fixture
def fresh_tiny():
    """Medusa-2 injects an adapter into the target: never share that target."""
    return load_target(TargetConfig(name="tiny_random", device="cpu", dtype="float32"))


def test_medusa2_trains_adapter_and_heads_and_keeps_the_original(fresh_tiny, tmp_path):
    target = fresh_tiny
    ids = torch.tensor([PROMPT])
    with torch.no_grad():
        orig = target.model(input_ids=ids).logits.clone()
    m2 = Medusa2Heads(
        target, Medusa2Config(num_heads=2, lora_r=4, backbone_warmup=0, backbone_weight=1.0)
    )
    trainable = {k for k, p in m2.named_parameters() if p.requires_grad}
    assert any("lora_" in k for k in trainable) and any(k.startswith("heads.") for k in trainable)
    assert not any("lora_" not in k and k.startswith("backbone.") for k in trainable)
    groups = m2.param_groups(1e-3)
    assert groups[0]["lr"] == pytest.approx(4e-3) and groups[1]["lr"] == 1e-3
    opt = torch.optim.AdamW(groups, lr=1e-3)
    b = batch_for(target, m2)
    for _ in range(3):
        out = m2(b)
        assert "loss_backbone" in out.metrics
        opt.zero_grad()
        out.loss.backward()
        opt.step()
    m2.eval()  # LoRA dropout off
    with torch.no_grad():
        adapted = target.model(input_ids=ids).logits
        with m2.original():
            assert torch.allclose(target.model(input_ids=ids).logits, orig, atol=1e-5)
    assert not torch.allclose(adapted, orig, atol=1e-5)  # the adapter moved the verifier
    m2.save_draft(tmp_path / "d")
    assert (tmp_path / "d" / "adapter" / "adapter_config.json").exists()
    other = load_target(TargetConfig(name="tiny_random", device="cpu", dtype="float32"))
    back = Medusa2Heads.load_draft(tmp_path / "d", other)
    with torch.no_grad():
        assert torch.allclose(other.model(input_ids=ids).logits, adapted, atol=1e-5)
    assert "LoRA adapter" in back.changes_target()
    # export: the heads need the adapted model as their base, written beside them
    from models.export import ExportError, export

    with pytest.raises(ExportError, match="--merge"):
        export(m2, "medusa", tmp_path / "x", log=lambda *_: None)
    said = []
    export(m2, "medusa", tmp_path / "m", dtype="float32", merge=True, log=said.append)
    cfg = json.loads((tmp_path / "m" / "config.json").read_text())
    base = str((tmp_path / "m" / "base").resolve())
    assert cfg["base_model_name_or_path"] == base
    # served on the merged base, not on the target the adapter changed
    assert f"vllm serve {base} " in said[-1]
    assert f"(serve with `{base}`)" in (tmp_path / "m" / "README.md").read_text()
    from flow.serve import serve_hint

    assert "--format medusa-vllm --merge" in serve_hint("medusa2", tmp_path / "run")
    from transformers import AutoModelForCausalLM

    merged = AutoModelForCausalLM.from_pretrained(str(tmp_path / "m" / "base")).eval()
    with torch.no_grad():
        assert torch.allclose(merged(input_ids=ids).logits, adapted, atol=1e-4)
    # evaluated against its merged base (it was: the target the adapter changed, silently),
    # which is the target it was made for, wherever the export is moved
    from omegaconf import OmegaConf

    from decoding.eval import EvalConfig
    from decoding.settings import apply_saved_target
    from models.export import made_for, made_for_note

    shutil.move(tmp_path / "m", tmp_path / "moved")
    cfg = OmegaConf.structured(EvalConfig(draft=str(tmp_path / "moved")))
    line = apply_saved_target(cfg, set())
    assert cfg.target.name == "hf" and cfg.target.path == str((tmp_path / "moved/base").resolve())
    assert "made for" in line
    base = load_target(OmegaConf.to_object(cfg.target))
    assert made_for_note(made_for(tmp_path / "moved"), base) is None
    assert "made for target base:" in made_for_note(made_for(tmp_path / "moved"), target)


# -- end to end --------------------------------------------------------------------------------


@pytest.mark.parametrize("method", ["medusa1", "medusa2"])
def test_train_then_eval(data_file, tmp_path, method):
    from trainer.train import run

    out = tmp_path / "run"
    extra = {"train.max_steps": 3, "method.num_heads": 2}
    if method == "medusa2":
        extra.update({"method.lora_r": 4})
    s = run(compose(tiny_overrides(data_file, out, method=method, **extra)))
    assert s["step"] == 3 and "top1_head1" in s["val"]
    cfg = json.loads((out / "final" / "config.json").read_text())
    assert cfg["tree"] and cfg["specdraft"]["method"] == method
    rep = tmp_path / "r.json"
    args = ["target=tiny_random", f"draft={out}", "num_prompts=2", "max_new_tokens=16"]
    r = run_module("decoding.eval", [*args, f"report={rep}"], 300)
    assert r.returncode == 0, r.stderr[-3000:]
    report = json.loads(rep.read_text())
    assert report["lossless"] is True and "static tree" in report["settings"]["draft_description"]
    if method == "medusa2":
        assert "LoRA adapter" in report["verifier_changed"]
        assert report["against_original"]["tokens"] > 0
    else:
        assert report["verifier_changed"] is None
    r = run_module(
        "decoding.eval", [*args, "temperature=1", "acceptance=typical", f"report={rep}"], 300
    )
    assert r.returncode == 0, r.stderr[-3000:]
    report = json.loads(rep.read_text())
    assert report["lossless"] is False and "NOT lossless" in report["lossless_note"]
    assert report["mean_tvd"] is not None
