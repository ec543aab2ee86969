"""EAGLE-3 head (fusion, training-time test, draft vocabulary) and EAGLE-2 dynamic trees."""

from __future__ import annotations

import copy
import json

import conftest
import pytest
import torch
from conftest import (
    assert_first_two_tokens_follow_the_target,
    compose,
    run_module,
    tiny_overrides,
)
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import DynamicCache

from decoding.decoder import SpeculativeDecoder
from models.base import DecodeSettings
from models.eagle import (
    Eagle1Config,
    Eagle3Config,
    Eagle3Head,
    EagleHead,
    EagleTreeProposer,
    draft_vocab,
)
from models.sampling import Sampling


def make_head(target, **kw):
    torch.manual_seed(0)
    return Eagle3Head(target, Eagle3Config(**{"draft_vocab_size": 64, **kw}))


def make_batch(target, head, B=2, T=24, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 256, (B, T), generator=g)
    attn = torch.ones(B, T, dtype=torch.long)
    attn[1, T - 5 :] = 0
    lm = attn.clone()
    lm[:, :4] = 0
    feats = target.features(ids, attn, tuple(head.feature_layers))
    return {"input_ids": ids, "attention_mask": attn, "loss_mask": lm, "features": feats}


# -- draft vocabulary (pure) -------------------------------------------------------------------


@settings(max_examples=60, deadline=None)
@given(
    counts=st.lists(st.integers(0, 50), min_size=2, max_size=40),
    frac=st.floats(0.01, 1.0),
)
def test_draft_vocab_maps_the_most_frequent_tokens(counts, frac):
    c = torch.tensor(counts)
    size = max(1, int(len(counts) * frac))
    d2t, t2d = draft_vocab(c, size)
    target_ids = torch.arange(size) + d2t
    assert t2d.sum() == size and t2d[target_ids].all()
    assert (target_ids[1:] > target_ids[:-1]).all()  # ordered by target id, so t2d order works
    # nothing left out is more frequent than anything kept
    if size < len(counts):
        assert c[~t2d].max() <= c[t2d].min()


def counts_all_at_once(split, vocab_size: int) -> torch.Tensor:
    """The reference count: every assistant token id of the split in memory at once."""
    import numpy as np

    cols = split.with_format("arrow")[:]
    ids = np.asarray(cols.column("input_ids").combine_chunks().flatten())
    mask = np.asarray(cols.column("loss_mask").combine_chunks().flatten()).astype(bool)
    return torch.from_numpy(np.bincount(ids[mask], minlength=vocab_size)[:vocab_size])


def test_assistant_tokens_are_counted_in_a_stream():
    """The count reads the split a chunk of records at a time: the same counts (and the same
    draft vocabulary) as holding every token id at once, with a peak of Python-visible memory
    far below the split's token ids (the full ShareGPT split holds 22.7M assistant tokens)."""
    import tracemalloc

    import numpy as np
    from datasets import Dataset

    from models.eagle import assistant_token_counts

    rng = np.random.default_rng(0)
    n, T, V = 2000, 100, 259  # ids up to V + 9: ids past the vocabulary are not counted
    ds = Dataset.from_dict(
        {
            "input_ids": rng.integers(0, V + 10, (n, T)).tolist(),
            "loss_mask": (rng.random((n, T)) < 0.6).astype(int).tolist(),
        }
    ).shuffle(seed=0)  # an indices mapping, as a shuffled or selected split has
    want = counts_all_at_once(ds, V)
    tracemalloc.start()
    try:
        got = assistant_token_counts(ds, V, chunk_records=96)  # chunks across the boundary
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert got.dtype == torch.int64 and torch.equal(got, want)
    for size in (16, 64, V):
        assert all(
            torch.equal(a, b)
            for a, b in zip(draft_vocab(got, size), draft_vocab(want, size), strict=True)
        )
    assert peak < n * T, f"peak {peak} bytes for {n * T} tokens: the ids were held at once"


def test_init_from_data_chooses_frequent_assistant_tokens(tiny_target):
    from datasets import Dataset

    head = make_head(tiny_target, draft_vocab_size=4)
    ds = Dataset.from_dict(
        {
            "input_ids": [[9, 9, 9, 9, 5, 5, 5, 7, 7, 1], [3, 3, 3, 2, 8]],
            "loss_mask": [[1, 1, 1, 1, 1, 1, 1, 1, 1, 1], [0, 0, 0, 1, 1]],
        }
    )
    head.init_from_data(ds, log=lambda *_: None)
    chosen = (torch.arange(4) + head.d2t).tolist()
    assert chosen == [1, 5, 7, 9]  # 3 is frequent but not on assistant tokens; 1 wins the tie
    # the draft head starts from the target's rows for those tokens
    assert torch.equal(head.lm_head.weight, tiny_target.lm_head.weight[chosen].float())
    logits = head.vocab_logits(torch.randn(3, tiny_target.hidden_size))
    assert torch.isinf(logits[:, ~head.t2d]).all() and torch.isfinite(logits[:, head.t2d]).all()


# -- the head ----------------------------------------------------------------------------------


def test_default_fuse_layers_and_vocabulary_size(tiny_target):
    head = Eagle3Head(tiny_target, Eagle3Config())
    L, V = tiny_target.num_layers, tiny_target.config.vocab_size
    assert L == 2  # [2, L // 2, L - 3] clamped to 1..L, ascending, then the final state
    assert head.feature_layers == (1, 1, 2, -1)
    assert head.cfg.draft_vocab_size == min(V, 1024)
    # negative ids count from the end; the saved order is ascending (the engines' order)
    assert Eagle3Head(tiny_target, Eagle3Config(fuse_layers=[2, 0, -2])).cfg.fuse_layers == [
        0,
        1,
        2,
    ]
    with pytest.raises(Exception, match="out of range"):
        Eagle3Head(tiny_target, Eagle3Config(fuse_layers=[1, 2, 3]))
    with pytest.raises(Exception, match="fuses exactly three"):
        Eagle3Head(tiny_target, Eagle3Config(fuse_layers=[1, 2]))


@pytest.mark.parametrize(
    "layers,want",
    [(4, [1, 2, 3]), (5, [1, 2, 4]), (6, [1, 3, 5]), (8, [2, 4, 5]), (30, [2, 15, 27])],
)
def test_default_fused_layers_are_three_an_engine_takes(layers, want):
    """Wherever the target has >= 4 layers, the default is three distinct layers in 1..L-1
    (serving engines' rule), the reference's (2, L // 2, L - 3) where those qualify."""
    from models.eagle.model import default_fuse_layers

    assert default_fuse_layers(layers) == want
    assert len(set(want)) == 3 and all(1 <= i < layers for i in want)


def test_training_a_head_no_engine_takes_is_refused_at_the_start(data_file, tmp_path):
    """A 2-layer target cannot give three distinct fused layers: training stops before the
    first step, in one line naming the setting, and writes no checkpoint."""
    from trainer.train import ConfigError, run

    out = tmp_path / "run"
    with pytest.raises(ConfigError, match=r"method.fuse_layers=\[1, 1, 2\]: serving engines"):
        run(compose(tiny_overrides(data_file, out, method="eagle3")))
    assert not (out / "checkpoints").exists() and not (out / "final").exists()
    r = run(
        compose(
            tiny_overrides(
                data_file,
                out.parent / "ok",
                method="eagle3",
                **{"target.tiny_layers": 4, "train.max_steps": 1, "method.draft_vocab_size": 64},
            )
        )
    )
    assert (
        json.loads((out.parent / "ok" / "final" / "config.json").read_text())["method"][
            "fuse_layers"
        ]
        == [1, 2, 3]
        and r["step"] == 1
    )


def test_unroll_matches_sequential_decoding(tiny_target):
    head = make_head(tiny_target).eval()
    b = make_batch(tiny_target, head)
    with torch.no_grad():
        h0 = head.initial_hidden(b["features"])
        outs = head.unroll(h0, b["input_ids"], b["attention_mask"], steps=3)
        ids = b["input_ids"][:1]
        for s in (0, 6, 17):
            cache = DynamicCache()
            emb = head._embed(ids[:, 1 : s + 2])
            mask = None if s == 0 else torch.tril(torch.ones(s + 1, s + 1, dtype=torch.bool))
            h = head.step(
                h0[:1, : s + 1],
                emb,
                torch.arange(s + 1)[None],
                None if mask is None else mask[None, None],
                cache,
            )
            prev = h[:, -1:]
            assert torch.allclose(prev[0, 0], outs[0][0, s], atol=1e-5)
            for j in (2, 3):
                emb = head._embed(ids[:, s + j : s + j + 1])
                prev = head.step(prev, emb, torch.tensor([[s + j - 1]]), None, cache)
                assert torch.allclose(prev[0, 0], outs[j - 1][0, s], atol=1e-5), (s, j)


@pytest.mark.parametrize("bf16", [False, True])
def test_one_step_moves_every_draft_parameter_and_no_target_parameter(tiny_target, bf16):
    """Also under bf16 autocast (the default where the machine has bf16): the master weights
    stay float32 and every one of them moves."""
    head = make_head(tiny_target, ttt_steps=3)
    before = copy.deepcopy(dict(head.named_parameters()))
    before_target = {k: v.clone() for k, v in tiny_target.model.state_dict().items()}
    opt = torch.optim.AdamW(head.parameters(), lr=1e-2)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
        out = head(make_batch(tiny_target, head))
    assert out.loss.dtype == torch.float32
    assert {"loss_step1", "loss_step3", "acc_step2"} <= set(out.metrics)
    out.loss.backward()
    opt.step()
    for k, v in head.named_parameters():
        assert v.dtype == torch.float32, k
        assert not torch.equal(v, before[k]), f"draft parameter {k} did not move"
    for k, v in tiny_target.model.state_dict().items():
        assert torch.equal(v, before_target[k]), f"target parameter {k} moved"
    keys = set(head.state_dict())
    assert all(k.split(".")[0] in {"fc", "midlayer", "norm", "lm_head", "d2t", "t2d"} for k in keys)
    assert not any(k.startswith("embed") for k in keys)


def test_training_time_test_weights_later_steps_less(tiny_target):
    head = make_head(tiny_target, ttt_steps=3, step_decay=0.5)
    b = make_batch(tiny_target, head)
    out = head(b)
    m = {k: (v[0] / v[1]).item() for k, v in out.metrics.items() if k.startswith("loss_step")}
    expect = m["loss_step1"] + 0.5 * m["loss_step2"] + 0.25 * m["loss_step3"]
    assert out.loss.item() == pytest.approx(expect, rel=1e-5)


@pytest.mark.parametrize("norm_output", [False, True])
def test_fused_step_loss_equals_the_per_step_loss_over_the_logits(tiny_target, norm_output):
    """Training's fused LM head + soft CE over all unrolled steps at once gives the loss,
    metrics and gradients of scoring each step's logits on its own (the path HASS and the tvd
    loss take)."""
    head = make_head(tiny_target, ttt_steps=3, norm_output=norm_output)
    b = make_batch(tiny_target, head)
    grads, outs = [], []
    for fused in (True, False):
        head.fused_step_ce = fused
        head.zero_grad()
        out = head(b)
        out.loss.backward()
        outs.append(out)
        grads.append({k: v.grad.clone() for k, v in head.named_parameters()})
    del head.fused_step_ce  # back to the class's
    a, u = outs
    assert a.loss.item() == pytest.approx(u.loss.item(), rel=1e-5)
    assert a.metrics.keys() == u.metrics.keys()
    for k in a.metrics:
        assert torch.allclose(a.metrics[k].float(), u.metrics[k].float(), rtol=1e-5, atol=1e-6), k
    for k in grads[0]:
        assert torch.allclose(grads[0][k], grads[1][k], rtol=1e-4, atol=1e-6), k


def test_loss_decreases_when_fitting_one_batch(tiny_target):
    from models.eagle import position_mask

    head = make_head(tiny_target, ttt_steps=2)
    opt = torch.optim.AdamW(head.parameters(), lr=3e-3)
    b = make_batch(tiny_target, head)
    # soft CE = KL + H(target): only the KL part can go; measure progress above the entropy
    bound = 0.0
    for j, m in enumerate(position_mask(b["loss_mask"], b["attention_mask"], 2), start=1):
        t = head.target_logits(b["features"][:, j:, 3][m.nonzero(as_tuple=True)], True)
        bound += 0.8 ** (j - 1) * -(t.softmax(-1) * t.log_softmax(-1)).sum(-1).mean().item()
    first = None
    for _ in range(30):
        loss = head(b).loss
        first = first if first is not None else loss.item()
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert loss.item() - bound < 0.5 * (first - bound)


def test_save_load_round_trip_keeps_the_vocabulary(tiny_target, tmp_path):
    head = make_head(tiny_target).eval()
    head.d2t.copy_(torch.arange(64) * 2)  # target ids 0, 3, 6, ...
    head.t2d.zero_()
    head.t2d[torch.arange(64) * 3] = True
    head.save_draft(tmp_path / "d")
    loaded = Eagle3Head.load_draft(tmp_path / "d", tiny_target).eval()
    assert loaded.cfg == head.cfg
    assert torch.equal(loaded.d2t, head.d2t) and torch.equal(loaded.t2d, head.t2d)
    h = torch.randn(2, tiny_target.hidden_size)
    assert torch.equal(loaded.vocab_logits(h), head.vocab_logits(h))


# -- decoding: chain and dynamic tree ------------------------------------------------------------


PROMPT = [1, 72, 101, 108, 108, 111, 32, 119, 111, 114]


def ar_greedy(target, prompt, n):
    dec = SpeculativeDecoder(
        target, EagleHead(target, Eagle1Config()).proposer(), Sampling(), gamma=0
    )
    return dec.generate(prompt, n)


@pytest.mark.parametrize("weights", ["full", "int8"])
@pytest.mark.parametrize("kind", ["eagle1", "eagle3"])
@pytest.mark.parametrize("tree", [None, (3, 2, 5), (4, 4, 12), (4, 4, 12, 0.05)])
def test_greedy_output_equals_plain_greedy(tiny_target, kind, tree, weights):
    torch.manual_seed(1)
    head = EagleHead(tiny_target, Eagle1Config()) if kind == "eagle1" else make_head(tiny_target)
    head.eval()
    # int8 draft weights (models/quant.py) change what the draft proposes, never the output
    swapped = head.quantize_for_decoding(weights)
    assert (swapped > 0) == (weights == "int8")
    ref = ar_greedy(tiny_target, PROMPT, 40)
    if tree is None:
        prop = head.proposer()
    else:
        d, k, n, m = (*tree, 0.0)[:4]
        prop = head.proposer(
            DecodeSettings(tree="dynamic", depth=d, top_k=k, total_tokens=n, min_prob=m)
        )
    dec = SpeculativeDecoder(
        tiny_target, prop, Sampling(), gamma=tree[0] if tree else 3, adaptive=False
    )
    assert dec.generate(PROMPT, 40) == ref
    assert dec.generate(PROMPT[:4], 40) == ar_greedy(tiny_target, PROMPT[:4], 40)


def test_dynamic_tree_shape(tiny_target):
    head = make_head(tiny_target).eval()
    prop = EagleTreeProposer(head, depth=4, top_k=3, total_tokens=10)
    from models.base import DecodeState

    feats = tiny_target.features(
        torch.tensor([PROMPT[:-1]]), torch.ones(1, 9, dtype=torch.long), tuple(head.feature_layers)
    )[0]
    state = DecodeState(PROMPT, feats, Sampling(), None, torch.device("cpu"))
    prop.start(state)
    p = prop.propose(state, 4)
    assert len(p) == 10 and p.q is None
    depth = []
    for i, par in enumerate(p.parents):
        assert par < i  # parents first
        depth.append(1 if par < 0 else depth[par] + 1)
    assert max(depth) <= 4 and sum(d == 1 for d in depth) <= 3
    kids = {}
    for i, par in enumerate(p.parents):
        kids.setdefault(par, []).append(p.tokens[i])
    assert all(len(set(v)) == len(v) for v in kids.values())  # siblings differ
    prop.rollback(state, 0)
    assert prop.cache.get_seq_length() == len(PROMPT) - 1  # tree entries cut back


def test_dynamic_tree_min_prob_sizes_the_tree_by_confidence(tiny_target):
    """min_prob keeps only nodes the draft gives at least that cumulative probability (always
    the best one), stays ancestor-closed, and stops drafting at a level with no such node;
    min_prob=0 is EAGLE-2's fixed-size tree."""
    import math

    from models.base import DecodeState

    torch.manual_seed(0)
    head = make_head(tiny_target).eval()
    feats = tiny_target.features(
        torch.tensor([PROMPT[:-1]]), torch.ones(1, 9, dtype=torch.long), tuple(head.feature_layers)
    )[0]

    def propose(min_prob):
        prop = EagleTreeProposer(head, depth=4, top_k=3, total_tokens=12, min_prob=min_prob)
        state = DecodeState(list(PROMPT), feats, Sampling(), None, torch.device("cpu"))
        prop.start(state)
        calls = prop.draft_calls
        p = prop.propose(state, 4)
        return p, prop.last_scores, prop.draft_calls - calls

    full, full_scores, full_calls = propose(0.0)
    assert len(full) == 12 and full_calls == 4  # catch-up + 3 expansions
    probs = sorted((math.exp(s) for s in full_scores), reverse=True)
    # a threshold between the kept nodes' probabilities: exactly those above it stay
    for cut in (probs[2], probs[6]):
        th = cut * 0.999
        p, scores, calls = propose(th)
        assert len(p) == sum(x >= th for x in probs)
        assert all(math.exp(s) >= th for s in scores)
        assert all(par < i for i, par in enumerate(p.parents))  # every parent kept, first
        assert set(p.tokens) <= set(full.tokens)
    # nothing reaches it: the best node alone, and no level beyond the first is drafted
    p, scores, calls = propose(0.999999)
    assert len(p) == 1 and p.parents == [-1] and calls == 1
    assert math.isclose(scores[0], max(full_scores))
    with pytest.raises(ValueError, match="min_prob=1.5"):
        EagleTreeProposer(head, min_prob=1.5)


@pytest.fixture(scope="module")
def small_vocab_target():
    return conftest.small_vocab_target()


@pytest.mark.parametrize(
    "s,min_prob,sampling_where",
    [
        (Sampling(1.0), 0.0, False),
        (Sampling(1.0), 0.02, True),
        (Sampling(0.8, top_p=0.7), 0.0, True),
        (Sampling(0.8, top_p=0.7), 0.02, False),
    ],
    ids=[
        "T1-fixed-host",
        "T1-min_prob-device",
        "T0.8-p0.7-fixed-device",
        "T0.8-p0.7-min_prob-host",
    ],
    indirect=["sampling_where"],
)
def test_sampled_tree_output_follows_the_target(small_vocab_target, s, min_prob, sampling_where):
    """Chi-square on the first two tokens through a dynamic tree (false-alarm rate 1e-3), of
    a fixed size or sized by the draft's confidence (``min_prob``)."""
    target = small_vocab_target
    prompt = [1, 2, 3]
    torch.manual_seed(3)
    head = EagleHead(target, Eagle1Config()).eval()
    prop = head.proposer(
        DecodeSettings(tree="dynamic", depth=2, top_k=8, total_tokens=16, min_prob=min_prob)
    )
    dec = SpeculativeDecoder(target, prop, s, gamma=2, adaptive=False, seed=5)
    # 3 tokens, so the first iteration may draft two levels; the first two are scored
    assert_first_two_tokens_follow_the_target(target, dec, prompt, s, gen=3)
    # the tree is sometimes right, sometimes not: both branches of the test are exercised
    assert 0.02 < dec.stats.alpha < 0.98
    assert dec.stats.tree_iterations > 0
    sizes = [n for n in dec.stats.gamma_used if n]
    # a fixed tree holds at least the 8 first-level nodes; one sized by confidence fewer
    assert (min(sizes) < 8) == (min_prob > 0)


# -- end to end ----------------------------------------------------------------------------------


def test_train_eagle3_then_eval_chain_and_tree(data_file, tmp_path):
    from trainer.train import run

    out = tmp_path / "run"
    s = run(
        compose(
            tiny_overrides(
                data_file,
                out,
                method="eagle3",
                **{"train.max_steps": 3, "method.draft_vocab_size": 128, "target.tiny_layers": 4},
            )
        )
    )
    assert s["step"] == 3 and "top1_pos1" in s["val"]
    cfg = json.loads((out / "final" / "config.json").read_text())
    assert cfg["specdraft"]["method"] == "eagle3" and cfg["method"]["draft_vocab_size"] == 128
    for extra in (["tree=chain"], ["tree=dynamic", "depth=3", "top_k=2", "total_tokens=6"]):
        rep = tmp_path / "r.json"
        r = run_module(
            "decoding.eval",
            [
                "target=tiny_random",
                "target.tiny_layers=4",
                f"draft={out}",
                "num_prompts=2",
                "max_new_tokens=16",
                f"report={rep}",
                *extra,
            ],
            300,
        )
        assert r.returncode == 0, r.stderr[-3000:]
        report = json.loads(rep.read_text())
        assert report["lossless"] is True
        assert ("tree" in report["settings"]["draft_description"]) == (extra[0] == "tree=dynamic")
    r = run_module("decoding.eval", ["target=tiny_random", "draft=ngram", "tree=dynamic"])
    assert r.returncode == 2 and "needs a trained draft" in r.stderr


@pytest.mark.parametrize("kind", ["eagle1", "eagle3"])
def test_a_one_wide_tree_is_the_greedy_chain(tiny_target, kind):
    """top_k = 1 leaves one path: it must be exactly what chain drafting proposes."""
    from models.base import DecodeState

    torch.manual_seed(2)
    head = EagleHead(tiny_target, Eagle1Config()) if kind == "eagle1" else make_head(tiny_target)
    head.eval()
    with torch.no_grad():  # livelier than the init, so later tokens depend on earlier ones
        for p in head.parameters():
            p.add_(torch.randn_like(p) * 0.2)
    ids = torch.tensor([PROMPT[:-1]])
    feats = tiny_target.features(ids, torch.ones_like(ids), tuple(head.feature_layers))[0]
    props = []
    for prop in (
        head.proposer(),
        head.proposer(DecodeSettings(tree="dynamic", depth=5, top_k=1, total_tokens=5)),
    ):
        state = DecodeState(list(PROMPT), feats, Sampling(), None, torch.device("cpu"))
        prop.start(state)
        props.append(prop.propose(state, 5))
    chain, tree = props
    assert tree.parents == [-1, 0, 1, 2, 3]
    assert tree.tokens == chain.tokens


def test_signals_from_the_draft_vocabulary_leave_the_greedy_draft_unchanged(tiny_target):
    """With the decoder asking for signals (traces, DISCO), an EAGLE-3 chain drafts the same
    tokens, and its signals equal those over the whole target vocabulary."""
    from decoding.decoder import NoDraft, SpeculativeDecoder
    from models.base import draft_signals

    head = make_head(tiny_target)
    prompt = list(range(60, 90))
    runs = {}
    for signals in (False, True):
        traces = [] if signals else None
        dec = SpeculativeDecoder(
            tiny_target, head.proposer(), Sampling(), gamma=3, adaptive=False, traces=traces
        )
        runs[signals] = (dec.generate(prompt, 24), traces)
    assert runs[True][0] == runs[False][0]
    plain = SpeculativeDecoder(tiny_target, NoDraft(), Sampling(), calibrate=False)
    assert runs[True][0] == plain.generate(prompt, 24)
    assert all(len(r["signals"]) == r["drafted"] for r in runs[True][1])
    # signals over the draft's own vocabulary equal those over the target's (-inf elsewhere)
    h = torch.randn(5, tiny_target.hidden_size, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        own, offset = head.own_logits(h)
        full = head.vocab_logits(h)
    for row in range(5):
        j = int(own[row].argmax())
        x = j + int(offset[j])
        assert x == int(full[row].argmax())
        torch.testing.assert_close(
            draft_signals(own[row], j, 1), draft_signals(full[row], x, 1), atol=1e-5, rtol=1e-5
        )


@pytest.mark.parametrize(
    "s",
    [Sampling(1.0), Sampling(0.7, top_k=5), Sampling(0.9, top_p=0.8), Sampling(1.0, top_k=100)],
    ids=["T1", "T0.7-k5", "T0.9-p0.8", "k-beyond-draft-vocab"],
)
def test_sampling_over_the_draft_vocabulary_gives_the_same_q(tiny_target, s):
    """At T > 0 an EAGLE-3 chain warps and samples over its own vocabulary, then lays q out
    over the target's: the same distribution as warping the V-wide logits (-inf outside)."""
    head = make_head(tiny_target)  # draft vocabulary 64 of the tiny target's 256+
    h = torch.randn(6, tiny_target.hidden_size, generator=torch.Generator().manual_seed(2))
    from models.sampling import warp

    with torch.no_grad():
        own, _ = head.own_logits(h)
        old = warp(head.vocab_logits(h), s)
        new = head.to_target_vocab(warp(own, s))
    torch.testing.assert_close(new, old, atol=1e-6, rtol=1e-5)
    assert (new[:, ~head.t2d] == 0).all()


@pytest.mark.parametrize(
    "weights,sampling_where",
    [("full", False), ("int8", True)],
    ids=["full-host", "int8-device"],
    indirect=["sampling_where"],
)
def test_sampled_eagle3_chain_follows_the_target(small_vocab_target, weights, sampling_where):
    """Chi-square on the first two tokens of a sampled EAGLE-3 chain whose draft vocabulary
    (6 of 10 tokens) leaves out tokens the target samples: those come only from the
    residual, so a q laid out wrongly over the target's vocabulary fails here. With int8
    draft weights q is the quantized draft's own distribution, and the output still follows
    the target."""
    target = small_vocab_target
    head = Eagle3Head(target, Eagle3Config(draft_vocab_size=6)).eval()
    with torch.no_grad():  # a flat q over the 6 tokens, so drafts are sometimes accepted
        head.lm_head.weight.mul_(0.01)
    assert (head.quantize_for_decoding(weights) > 0) == (weights == "int8")
    s = Sampling(0.9, top_k=8)
    dec = SpeculativeDecoder(target, head.proposer(), s, gamma=2, adaptive=False, seed=7)
    assert_first_two_tokens_follow_the_target(target, dec, [1, 2, 3], s, gen=3)
    assert 0.02 < dec.stats.alpha < 0.98


def test_tree_sizes_reads_each_nodes_outcome_off_the_output():
    """scripts/tree_sizes.py: at T=0 a node was accepted exactly when its path is what the
    target emitted from the tree's position on (and every ancestor was accepted)."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
    from tree_sizes import node_outcomes

    full = [1, 2, 3, 10, 11, 12]  # the tree was drafted with 3 committed tokens: 10 comes next
    # nodes: 10 (ok), 20 (wrong), 11 under 10 (ok), 12 under 11 (ok), 11 under 20 (parent
    # rejected), 13 under 10 (wrong), 99 under 12 (past the output)
    rec = (3, [10, 20, 11, 12, 11, 13, 99], [-1, -1, 0, 2, 1, 0, 3], [-0.1] * 7)
    scores, depth, ok = node_outcomes(rec, full)
    assert depth.tolist() == [1, 1, 2, 3, 2, 2, 4]
    assert ok.tolist() == [True, False, True, True, False, False, False]


@pytest.mark.parametrize(
    "draft_sampling,acceptance",
    [("greedy", "exact"), ("greedy", "block"), ("sample", "block")],
    ids=["argmax_drafts", "argmax_drafts_block", "sampled_drafts_block"],
)
def test_eagle3_chain_under_an_engines_rule_follows_the_target(
    small_vocab_target, draft_sampling, acceptance
):
    """The rules serving engines run at T > 0 (vLLM: argmax drafts tested as point masses, its
    default; block verification) are exact in the built-in decoder too: chi-square on the
    first two tokens of an EAGLE-3 chain whose draft vocabulary leaves tokens out."""
    target = small_vocab_target
    torch.manual_seed(2)  # a head whose argmax the target's top 8 often hold
    head = Eagle3Head(target, Eagle3Config(draft_vocab_size=6)).eval()
    s = Sampling(0.9, top_k=8)
    dec = SpeculativeDecoder(
        target,
        head.proposer(),
        s,
        gamma=2,
        adaptive=False,
        seed=7,
        acceptance=acceptance,
        draft_sampling=draft_sampling,
    )
    assert_first_two_tokens_follow_the_target(target, dec, [1, 2, 3], s, gen=3)
    assert 0.02 < dec.stats.alpha < 0.98
