"""P-EAGLE: the parallel slots read the mask inputs and nothing they have not seen, the decoder
drafts what training computes, sampling stays exact, and one-line errors. The contract test
(tests/test_methods.py) trains, decodes losslessly at T = 0 and exports it."""

from __future__ import annotations

import conftest
import pytest
import torch
from conftest import assert_first_two_tokens_follow_the_target

from models.base import DecodeSettings, DecodeState, DraftError
from models.peagle import PEagleConfig, PEagleHead
from models.sampling import Sampling


def lively(head, seed=0):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in head.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.05)
    return head.eval()


def test_the_proposer_drafts_what_training_computes(tiny_target):
    """One decode forward over [new pairs, K - 1 mask slots] gives the tokens of the trained
    unroll's depths 1..K at the pending position, iteration after iteration."""
    h = lively(
        PEagleHead(
            tiny_target,
            PEagleConfig(draft_vocab_size=64, fuse_layers=[0, 1, 2], mask_token_id=5, ttt_steps=4),
        )
    )
    ids = torch.randint(20, 250, (1, 32), generator=torch.Generator().manual_seed(1))
    feats = tiny_target.features(ids, torch.ones_like(ids), h.feature_layers)
    prop = h.proposer()
    state = DecodeState(ids[0, :10].tolist(), feats[0, :9], Sampling(), None, ids.device)
    prop.start(state)
    for n in (10, 13, 14):
        state.ids, state.features = ids[0, :n].tolist(), feats[0, : n - 1]
        got = prop.propose(state, 4).tokens
        prop.rollback(state, 0)
        with torch.no_grad():
            outs = h.unroll(
                h.initial_hidden(feats[:, :n]), ids[:, :n], torch.ones_like(ids[:, :n]), 4
            )
        # depth j at start s = n - 2 predicts x_{n + j - 1}
        want = [int(h.top_tokens(o[0, n - 2][None], 1)[1][0, 0]) for o in outs]
        assert got == want, n
    assert prop.draft_calls == 1 + 3  # the prompt's pairs at start, then one per iteration


def test_deeper_slots_do_not_see_the_tokens_they_predict(tiny_target):
    """Changing the data's tokens after start s + 1 leaves every depth's output at start s
    unchanged (they read mask inputs, not the teacher's tokens)."""
    h = lively(
        PEagleHead(
            tiny_target,
            PEagleConfig(draft_vocab_size=64, fuse_layers=[0, 1, 2], mask_token_id=5, ttt_steps=3),
        )
    )
    ids = torch.randint(20, 250, (1, 16), generator=torch.Generator().manual_seed(2))
    feats = h.initial_hidden(tiny_target.features(ids, torch.ones_like(ids), h.feature_layers))
    other = ids.clone()
    other[0, 8:] = 7
    with torch.no_grad():
        a = h.unroll(feats, ids, torch.ones_like(ids), 3)
        b = h.unroll(feats, other, torch.ones_like(ids), 3)
    for x, y in zip(a, b, strict=True):
        assert torch.allclose(x[0, :7], y[0, :7], atol=1e-6)  # start 6 reads x_7 at most


def test_depth_sampling_keeps_the_share_asked_for(tiny_target):
    h = PEagleHead(
        tiny_target,
        PEagleConfig(draft_vocab_size=64, fuse_layers=[0, 1, 2], mask_token_id=5, ttt_steps=4),
    )
    masks = [torch.ones(64, 500, dtype=torch.bool) for _ in range(4)]
    torch.manual_seed(0)
    kept = [float(m.float().mean()) for m in h.train_masks(masks)]
    assert kept[0] == 1.0
    for d, share in enumerate(kept[1:], start=1):
        assert abs(share - max(0.8**d, 0.2)) < 0.02


@pytest.fixture(scope="module")
def small_vocab_target():
    return conftest.small_vocab_target(4)


def test_sampled_peagle_chain_follows_the_target(small_vocab_target):
    """Chi-square on the first two tokens (false-alarm rate 1e-3); the draft vocabulary (6 of
    10) leaves out tokens the target samples."""
    from decoding.decoder import SpeculativeDecoder

    h = PEagleHead(
        small_vocab_target,
        PEagleConfig(draft_vocab_size=6, fuse_layers=[0, 1, 2], mask_token_id=9, ttt_steps=3),
    )
    with torch.no_grad():
        h.lm_head.weight.mul_(0.01)
    s = Sampling(0.9, top_k=8)
    dec = SpeculativeDecoder(
        small_vocab_target, h.eval().proposer(), s, gamma=3, adaptive=False, seed=7
    )
    assert_first_two_tokens_follow_the_target(small_vocab_target, dec, [1, 2, 3], s, gen=3)
    assert 0.02 < dec.stats.alpha < 0.98


def test_settings_that_cannot_work_fail_in_one_line(tiny_target):
    kw = {"draft_vocab_size": 64, "fuse_layers": [0, 1, 2]}
    with pytest.raises(DraftError, match="ttt_steps=1"):
        PEagleHead(tiny_target, PEagleConfig(**kw, ttt_steps=1, mask_token_id=5))
    with pytest.raises(DraftError, match="no spare token id.*method.mask_token_id"):
        PEagleHead(tiny_target, PEagleConfig(**kw))
    with pytest.raises(DraftError, match="depth_keep"):
        PEagleHead(tiny_target, PEagleConfig(**kw, mask_token_id=5, depth_keep=0.0))
    h = PEagleHead(tiny_target, PEagleConfig(**kw, mask_token_id=5))
    with pytest.raises(ValueError, match="tree='dynamic'"):
        h.proposer(DecodeSettings(tree="dynamic"))
