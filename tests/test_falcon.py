"""Falcon: the relaxed-causal blocks read nothing after their block, the decoder drafts what
training computes (chain), the tree verifies exactly, CSGD's glancing follows its schedule,
and one-line errors. The contract test (tests/test_methods.py) trains it, decodes losslessly at
T = 0 (chain) and reloads it."""

from __future__ import annotations

import pytest
import torch
from conftest import assert_first_two_tokens_follow_the_target

from models.base import DecodeSettings, DecodeState, DraftError
from models.falcon import FalconConfig, FalconHead
from models.sampling import Sampling


def lively(head, seed=0):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in head.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.05)
    return head.eval()


def test_a_block_reads_nothing_after_it(tiny_target):
    """Pass 1's output at t changes only with inputs up to the end of t's block."""
    h = lively(FalconHead(tiny_target, FalconConfig(k=2)))
    ids = torch.randint(20, 250, (1, 17), generator=torch.Generator().manual_seed(0))
    f = tiny_target.features(ids, torch.ones_like(ids), h.feature_layers)[:, :, 0]
    other = ids.clone()
    other[0, 10:] = 7  # inputs from position 9 on ((f_9, x_10)) change
    with torch.no_grad():
        a = h.passes(f, ids, torch.ones_like(ids), 1, 0.0, 0.0)[0]
        b = h.passes(f, other, torch.ones_like(ids), 1, 0.0, 0.0)[0]
    # off = 1: blocks start at odd positions: [.., 7-8], [9-10]: positions <= 8 unchanged
    assert torch.allclose(a[0, :9], b[0, :9], atol=1e-6)
    assert not torch.allclose(a[0, 9], b[0, 9])


def test_the_chain_proposer_drafts_what_training_computes(tiny_target):
    """Forward 1 equals pass 1 at the block ending at the last committed position, forward 2
    equals pass 2 without glancing (the next block reading forward 1's predictions)."""
    h = lively(FalconHead(tiny_target, FalconConfig(k=2)))
    ids = torch.randint(20, 250, (1, 30), generator=torch.Generator().manual_seed(1))
    f = tiny_target.features(ids, torch.ones_like(ids), h.feature_layers)
    prop = h.proposer()
    state = DecodeState(ids[0, :9].tolist(), f[0, :8], Sampling(), None, ids.device)
    prop.start(state)
    for n in (9, 12, 13):
        state.ids, state.features = ids[0, :n].tolist(), f[0, : n - 1]
        got = prop.propose(state, 4).tokens
        e = n - 2  # the last committed input position; blocks end there when (e + 1) = off
        off = (e + 1) % 2
        # a whole sequence whose first n tokens are these, long enough for the next block
        with torch.no_grad():
            o1, o2, _ = h.passes(
                f[:, : n + 2, 0], ids[:, : n + 2], torch.ones_like(ids[:, : n + 2]), off, 0.0, 0.0
            )
            want = h.argmax(o1[0, e - 1 : e + 1]).tolist() + h.argmax(o2[0, e + 1 : e + 3]).tolist()
        assert got == want, n


def test_falcon_tree_is_exact_at_t1():
    """Chi-square on the first two tokens (false-alarm rate 1e-3) through Falcon's tree."""
    from conftest import small_vocab_target

    from decoding.decoder import SpeculativeDecoder

    target = small_vocab_target()
    h = lively(FalconHead(target, FalconConfig(k=2, lstm_layers=1)), 3)
    prop = h.proposer(DecodeSettings(tree="dynamic", depth=2, top_k=2, total_tokens=6))
    s = Sampling(1.0)
    dec = SpeculativeDecoder(target, prop, s, gamma=prop.tree_depth, adaptive=False, seed=3)
    assert_first_two_tokens_follow_the_target(target, dec, [1, 2, 3], s, gen=3, n=1500)
    assert dec.stats.tree_iterations > 0


def test_greedy_tree_output_is_the_targets(tiny_target):
    from decoding.decoder import NoDraft, SpeculativeDecoder

    h = lively(FalconHead(tiny_target, FalconConfig(k=2, lstm_layers=1)), 4)
    prompt = list(range(40, 60))
    ref = SpeculativeDecoder(tiny_target, NoDraft(), Sampling(), calibrate=False).generate(
        prompt, 20
    )
    prop = h.proposer(DecodeSettings(tree="dynamic", depth=3, top_k=3, total_tokens=10))
    dec = SpeculativeDecoder(tiny_target, prop, Sampling(), gamma=prop.tree_depth, adaptive=False)
    assert dec.generate(prompt, 20) == ref


def test_the_tree_drafts_no_deeper_than_gamma(tiny_target):
    """Near the end of a reply the decoder asks for fewer levels than the tree's depth; a
    forward drafts k levels at once, and the levels past gamma are dropped (their ancestors
    kept), as a chain's tokens past gamma are."""
    h = lively(FalconHead(tiny_target, FalconConfig(k=2, lstm_layers=1)), 5)
    prop = h.proposer(DecodeSettings(tree="dynamic", depth=3, top_k=2, total_tokens=12))
    ids = torch.randint(20, 250, (1, 12), generator=torch.Generator().manual_seed(2))
    f = tiny_target.features(ids, torch.ones_like(ids), h.feature_layers)
    for gamma in (1, 3, 5, 6):
        state = DecodeState(ids[0].tolist(), f[0, :11], Sampling(), None, ids.device)
        prop.start(state)
        p = prop.propose(state, gamma)
        depth = []
        for parent in p.parents:
            depth.append(1 if parent < 0 else depth[parent] + 1)
        assert p.tokens and max(depth) <= gamma, (gamma, depth)
        assert all(parent < i for i, parent in enumerate(p.parents))


def test_glancing_fades_with_progress(tiny_target):
    h = FalconHead(tiny_target, FalconConfig(glance=0.4))
    h.set_progress(0.0)
    assert h._lam == pytest.approx(0.4)
    h.set_progress(0.75)
    assert h._lam == pytest.approx(0.1)
    h.set_progress(2.0)
    assert h._lam == 0.0


def test_both_passes_learn(tiny_target):
    ids = torch.randint(20, 250, (2, 24), generator=torch.Generator().manual_seed(4))
    attn, lm = torch.ones_like(ids), torch.ones_like(ids)
    torch.manual_seed(0)
    h = FalconHead(tiny_target, FalconConfig(lstm_layers=1, noise=0.0))
    batch = {
        "input_ids": ids,
        "attention_mask": attn,
        "loss_mask": lm,
        "features": tiny_target.features(ids, attn, h.feature_layers),
    }
    opt = torch.optim.AdamW(h.parameters(), lr=3e-3)
    first = last = None
    for _ in range(15):
        torch.manual_seed(1)
        out = h(batch)
        opt.zero_grad()
        out.loss.backward()
        opt.step()
        m = {k: float(v[0] / v[1]) for k, v in out.metrics.items() if v[1] > 0}
        first = first or m
        last = m
    for tag in ("1", "2"):
        assert last[f"loss_reg{tag}"] < 0.8 * first[f"loss_reg{tag}"], (tag, first, last)


def test_settings_that_cannot_work_fail_in_one_line(tiny_target):
    with pytest.raises(DraftError, match="method.k=0"):
        FalconHead(tiny_target, FalconConfig(k=0))
    with pytest.raises(DraftError, match="glance"):
        FalconHead(tiny_target, FalconConfig(glance=1.5))
    with pytest.raises(ValueError, match="tree='static'"):
        FalconHead(tiny_target, FalconConfig()).proposer(DecodeSettings(tree="static"))
