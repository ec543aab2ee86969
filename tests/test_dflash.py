"""DFlash: the block attention against a dense masked reference, decoding against training
(the proposer drafts what the trained pass computes), exact sampling, the parallel cost model,
and one-line errors. The contract test (tests/test_methods.py) trains, decodes losslessly at
T = 0 and exports it like every other method."""

from __future__ import annotations

import math

import conftest
import pytest
import torch
from conftest import assert_first_two_tokens_follow_the_target

from models.base import DecodeState, DraftError
from models.blocks import block_attention
from models.dflash import DFlashConfig, DFlashDraft, sample_anchors, slot_weights
from models.sampling import Sampling


@pytest.fixture(scope="module")
def small_vocab_target():
    return conftest.small_vocab_target(4)


def lively(draft: DFlashDraft, seed: int = 0) -> DFlashDraft:
    """Random non-trivial weights (a fresh layer's o_proj/down_proj are not zero, but make
    sure every parameter matters)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in draft.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.1)
    return draft.eval()


def test_block_attention_equals_a_dense_masked_attention():
    """Each block reads the context keys it is allowed and its own block, nothing else."""
    g = torch.Generator().manual_seed(0)
    B, h, kvh, A, S, T, D = 2, 4, 2, 3, 4, 7, 8
    q = torch.randn(B, h, A, S, D, generator=g)
    kc, vc = torch.randn(B, kvh, T, D, generator=g), torch.randn(B, kvh, T, D, generator=g)
    kb, vb = torch.randn(B, kvh, A, S, D, generator=g), torch.randn(B, kvh, A, S, D, generator=g)
    allowed = torch.rand(B, A, T, generator=g) > 0.4
    allowed[..., 0] = True
    out = block_attention(q, kc, vc, kb, vb, allowed, 0.3)
    # dense: keys = context, then every block's slots; mask = allowed context + own block
    K = torch.cat([kc, kb.flatten(2, 3)], 2).repeat_interleave(h // kvh, 1)
    V = torch.cat([vc, vb.flatten(2, 3)], 2).repeat_interleave(h // kvh, 1)
    Q = q.flatten(2, 3)
    own = torch.zeros(A * S, A * S, dtype=torch.bool)
    for a in range(A):
        own[a * S : (a + 1) * S, a * S : (a + 1) * S] = True
    m = torch.cat([allowed.repeat_interleave(S, 1), own.expand(B, -1, -1)], -1)[:, None]
    ref = torch.nn.functional.scaled_dot_product_attention(Q, K, V, attn_mask=m, scale=0.3)
    assert torch.allclose(out.flatten(2, 3), ref, atol=1e-5)


def test_anchors_are_distinct_sorted_and_allowed():
    ok = torch.zeros(3, 20, dtype=torch.bool)
    ok[0, 5:15] = True
    ok[1, [2, 9]] = True
    a, v = sample_anchors(ok, 6, torch.Generator().manual_seed(1))
    assert a.shape == (3, 6)
    for r in range(3):
        got = a[r][v[r]].tolist()
        assert got == sorted(set(got)) and all(ok[r, i] for i in got)
    assert v.sum(1).tolist() == [6, 2, 0]


def test_slot_weights_decay_from_one():
    w = slot_weights(8, 4.0)
    assert w.shape == (7,) and w[0] == 1.0
    assert torch.allclose(w[1:] / w[:-1], torch.full((6,), math.exp(-0.25)))


def test_the_proposer_drafts_what_training_computes(tiny_target):
    """The decoder's incremental context (keys/values appended per iteration) gives the same
    slot logits as the training pass with a block anchored at the pending token."""
    d = lively(
        DFlashDraft(
            tiny_target,
            DFlashConfig(draft_vocab_size=64, mask_token_id=5, block_size=5, fuse_layers=[1, 2]),
        )
    )
    ids = torch.randint(20, 250, (1, 30), generator=torch.Generator().manual_seed(2))
    feats = tiny_target.features(ids, torch.ones_like(ids), d.feature_layers)
    prop = d.proposer()
    n0 = 12
    state = DecodeState(ids[0, :n0].tolist(), feats[0, : n0 - 1], Sampling(), None, ids.device)
    prop.start(state)
    for n in (n0, n0 + 3, n0 + 4):  # the context grows between iterations
        state.ids = ids[0, :n].tolist()
        state.features = feats[0, : n - 1]
        got = prop.propose(state, 4).tokens
        with torch.no_grad():
            h = d.run_blocks(
                feats[:, :n], ids[:, :n], torch.ones_like(ids[:, :n]), torch.tensor([[n - 1]])
            )
            j = d.draft_logits(h[0, 0, 1:]).argmax(-1)
        assert got == (j + d.d2t[j]).tolist()
    assert prop.draft_calls == 3


#: one warped setting: what T = 1 checks, plus a temperature and a top-k that zero some of q's
#: tokens (the unwarped law at T = 1 is checked on each decoding path: test_decoder.py, test_eagle3.py)
@pytest.mark.parametrize("s", [Sampling(0.9, top_k=8)], ids=["T0.9-k8"])
def test_sampled_dflash_chain_follows_the_target(small_vocab_target, s):
    """Chi-square on the first two tokens (false-alarm rate 1e-3) of sampled DFlash blocks
    whose draft vocabulary (6 of 10 tokens) leaves out tokens the target samples."""
    from decoding.decoder import SpeculativeDecoder

    d = DFlashDraft(
        small_vocab_target,
        DFlashConfig(draft_vocab_size=6, mask_token_id=9, block_size=4, fuse_layers=[1, 3]),
    )
    lively(d, 3)
    dec = SpeculativeDecoder(small_vocab_target, d.proposer(), s, gamma=3, adaptive=False, seed=5)
    assert_first_two_tokens_follow_the_target(small_vocab_target, dec, [1, 2, 3], s, gen=3)
    assert 0.02 < dec.stats.alpha < 0.98


def test_a_parallel_drafter_pays_one_forward_for_any_gamma():
    from decoding.policies import GammaController
    from decoding.stats import predicted_speedup

    seq = GammaController(4, True, [1.0, 1.1, 1.2, 1.3, 1.4])
    par = GammaController(4, True, [1.0, 1.1, 1.2, 1.3, 1.4], parallel=True)
    for c in (seq, par):
        c.t_draft = 0.3
        c.counts[None] = [7.0, 10.0]  # alpha 0.7
    assert seq.draft_cost(4) == pytest.approx(1.2) and par.draft_cost(4) == pytest.approx(0.3)
    assert par.draft_cost(0) == 0.0
    assert par.choose(4) == 4 and seq.choose(4) < 4  # cheap long blocks only when parallel
    a = 0.7
    assert predicted_speedup(a, {4: 10}, 0.3, parallel=True) == pytest.approx(
        (1 - a**5) / (1 - a) / 1.3
    )


def test_settings_that_cannot_work_fail_in_one_line(tiny_target):
    with pytest.raises(DraftError, match="block_size=1"):
        DFlashDraft(tiny_target, DFlashConfig(block_size=1, mask_token_id=5))
    with pytest.raises(DraftError, match="no spare token id.*method.mask_token_id"):
        DFlashDraft(tiny_target, DFlashConfig())
    with pytest.raises(DraftError, match="method.mask_token_id=999"):
        DFlashDraft(tiny_target, DFlashConfig(mask_token_id=999))
    with pytest.raises(DraftError, match="targets"):
        DFlashDraft(tiny_target, DFlashConfig(mask_token_id=5, targets="argmax"))
    d = DFlashDraft(tiny_target, DFlashConfig(mask_token_id=5))
    with pytest.raises(ValueError, match="tree='dynamic'"):
        from models.base import DecodeSettings

        d.proposer(DecodeSettings(tree="dynamic"))


def test_hard_and_soft_targets_both_learn(small_vocab_target):
    """A few optimizer steps on one batch lower the loss under either target kind (a sharp
    target, so the soft loss is not held up by the teacher's own entropy)."""
    t = small_vocab_target
    ids = torch.randint(0, 9, (2, 24), generator=torch.Generator().manual_seed(4))
    attn, lm = torch.ones_like(ids), torch.ones_like(ids)
    for kind in ("soft", "hard"):
        torch.manual_seed(0)
        d = DFlashDraft(
            t,
            DFlashConfig(
                mask_token_id=9,
                draft_vocab_size=10,
                block_size=4,
                targets=kind,
                fuse_layers=[1, 3],
            ),
        )
        batch = {
            "input_ids": ids,
            "attention_mask": attn,
            "loss_mask": lm,
            "features": t.features(ids, attn, d.feature_layers),
        }
        opt = torch.optim.AdamW(d.parameters(), lr=3e-3)
        losses = []
        for _ in range(15):
            torch.manual_seed(1)  # the same anchors each step
            out = d(batch)
            opt.zero_grad()
            out.loss.backward()
            opt.step()
            losses.append(float(out.loss))
        assert losses[-1] < 0.8 * losses[0], (kind, losses)
