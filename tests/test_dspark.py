"""DSpark: the Markov head makes each slot read the token drafted before it (in decoding as in
training and validation), an untrained one drafts as its DFlash backbone, sampled blocks follow
the target exactly, the batched decoder drafts what batch 1 does, the confidence head trains,
and bad settings are one-line errors. The contract test (tests/test_methods.py) trains, decodes
losslessly at T = 0 and reloads it like every other method; tests/test_families.py runs it on
every model family."""

from __future__ import annotations

import conftest
import pytest
import torch
from conftest import assert_first_two_tokens_follow_the_target
from test_dflash import lively

from models.base import DecodeSettings, DecodeState, DraftError
from models.dflash import DFlashConfig, DFlashDraft
from models.dspark import DSparkConfig, DSparkDraft
from models.sampling import Sampling

SMALL = dict(draft_vocab_size=64, mask_token_id=5, block_size=5, fuse_layers=[1, 2], markov_rank=8)


@pytest.fixture(scope="module")
def small_vocab_target():
    return conftest.small_vocab_target(4)


def _state(target, n=14, seed=2):
    ids = torch.randint(20, 250, (1, 30), generator=torch.Generator().manual_seed(seed))
    feats = target.features(ids, torch.ones_like(ids), (1, 2, -1))
    return (
        ids,
        feats,
        DecodeState(ids[0, :n].tolist(), feats[0, : n - 1], Sampling(), None, ids.device),
    )


def test_each_slot_reads_the_token_drafted_before_it(tiny_target):
    """The proposer's block equals the training pass's states with slot i scored from the
    token chosen at slot i - 1 (the anchor's for slot 1), one slot after another; with the
    Markov bias large, that differs from scoring the slots independently."""
    d = lively(DSparkDraft(tiny_target, DSparkConfig(**SMALL)), 1)
    with torch.no_grad():
        d.markov_head.markov_w2.weight.mul_(400.0)  # the bias dominates the backbone's logits
    ids, feats, state = _state(tiny_target)
    prop = d.proposer()
    prop.start(state)
    got = prop.propose(state, 4).tokens
    n = len(state.ids)
    with torch.no_grad():
        h = d.run_blocks(
            feats[:, :n], ids[:, :n], torch.ones_like(ids[:, :n]), torch.tensor([[n - 1]])
        )
        prev, want = ids[0, n - 1 : n], []
        for i in range(1, 5):
            j = d.slot_logits(h[0, :, i], d.prefix_states(prev), i).argmax(-1)
            prev = j + d.d2t[j]
            want.append(int(prev))
        independent = d.draft_logits(h[0, 0, 1:]).argmax(-1)
    assert got == want
    assert got != (independent + d.d2t[independent]).tolist()


def test_an_untrained_markov_head_drafts_as_its_dflash_backbone(tiny_target):
    """markov_w2 starts at zero: a fresh DSpark proposes what a DFlash draft with the same
    backbone weights proposes."""
    cfg = {k: v for k, v in SMALL.items() if k != "markov_rank"}
    ds = lively(DSparkDraft(tiny_target, DSparkConfig(**SMALL)), 4)
    with torch.no_grad():
        ds.markov_head.markov_w2.weight.zero_()
    df = DFlashDraft(tiny_target, DFlashConfig(**cfg)).eval()
    df.load_state_dict({k: v for k, v in ds.state_dict().items() if k in df.state_dict()})
    for d in (ds, df):
        _, _, state = _state(tiny_target, seed=7)
        p = d.proposer()
        p.start(state)
        d.got = p.propose(state, 4).tokens
    assert ds.got == df.got


@pytest.mark.parametrize(
    "s,threshold",
    # warped (what T = 1 checks and more: test_dflash.py), and T = 1 with the confidence schedule
    [(Sampling(0.9, top_k=8), None), (Sampling(1.0), 0.3)],
    ids=["T0.9-k8", "T1-confidence-stop"],
)
def test_sampled_dspark_blocks_follow_the_target(small_vocab_target, s, threshold):
    """Chi-square on the first two tokens (false-alarm rate 1e-3): slot 2 is drawn from a
    distribution that depends on slot 1's draw, and the verifier is handed exactly that one;
    with the confidence schedule on, whether slot i is proposed depends on the draws before it,
    and the output is still the target's."""
    from decoding.decoder import SpeculativeDecoder

    d = DSparkDraft(
        small_vocab_target,
        DSparkConfig(
            draft_vocab_size=6, mask_token_id=9, block_size=4, fuse_layers=[1, 3], markov_rank=4
        ),
    )
    lively(d, 3)
    with torch.no_grad():
        d.markov_head.markov_w2.weight.normal_(0, 3.0)
        if threshold is not None:  # estimates that vary with the previous token
            g = torch.Generator().manual_seed(11)
            d.confidence.weight.copy_(torch.randn(d.confidence.weight.shape, generator=g) * 0.3)
            d.confidence.bias.fill_(1.0)  # around 0.7 a slot: 1 to 3 slots proposed
    d.confidence_stop(threshold)
    dec = SpeculativeDecoder(small_vocab_target, d.proposer(), s, gamma=3, adaptive=False, seed=5)
    assert_first_two_tokens_follow_the_target(small_vocab_target, dec, [1, 2, 3], s, gen=3)
    assert 0.02 < dec.stats.alpha < 0.98
    if threshold is not None:  # the schedule varied the chain's length
        assert len([g for g, n in dec.stats.gamma_used.items() if n]) >= 2


def test_the_batched_decoder_drafts_what_batch_one_does(tiny_target):
    from decoding.batch import BatchDecoder
    from decoding.decoder import SpeculativeDecoder
    from models.target import GenRequest

    d = lively(DSparkDraft(tiny_target, DSparkConfig(**SMALL)), 2)
    with torch.no_grad():
        d.markov_head.markov_w2.weight.mul_(50.0)
    prompts = [list(range(40, 60)), list(range(70, 76)), list(range(30, 61))]
    one = SpeculativeDecoder(
        tiny_target, d.proposer(DecodeSettings()), Sampling(), gamma=4, adaptive=False
    )
    ref = [one.generate(p, 24) for p in prompts]
    bdec = BatchDecoder(
        tiny_target, d.proposer(), Sampling(), batch_size=3, gamma=4, compile="false"
    )
    out = bdec.run([GenRequest(i, p) for i, p in enumerate(prompts)], 24)
    assert [out[i] for i in range(3)] == ref


def test_the_confidence_head_learns_which_slots_the_target_accepts(small_vocab_target):
    """Trained on random anchors, the confidence head's cross-entropy falls and it calls most
    slots right; the drafted tokens' agreement with the target rises as for DFlash."""
    from models.target import Target  # noqa: F401  (the fixture's type)

    t = small_vocab_target
    d = DSparkDraft(
        t,
        DSparkConfig(
            draft_vocab_size=10,
            mask_token_id=9,
            block_size=4,
            fuse_layers=[1, 3],
            markov_rank=4,
            anchors=16,
        ),
    )
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 9, (4, 48), generator=g)
    attn = torch.ones_like(ids)
    with torch.no_grad():
        greedy = t.model.generate(ids[:, :8], max_new_tokens=40, do_sample=False, pad_token_id=0)
    ids = greedy[:, :48]
    feats = t.features(ids, attn, d.feature_layers)
    batch = {"features": feats, "input_ids": ids, "attention_mask": attn, "loss_mask": attn}
    opt = torch.optim.AdamW(d.parameters(), lr=3e-3)
    first = None
    torch.manual_seed(0)
    for _ in range(80):
        out = d(batch)
        opt.zero_grad()
        out.loss.backward()
        opt.step()
        conf = out.metrics["loss_conf"]
        first = first if first is not None else float(conf[0] / conf[1])
    last = out.metrics["loss_conf"]
    assert float(last[0] / last[1]) < first
    called = out.metrics["conf_acc"]
    assert float(called[0] / called[1]) > 0.7


def test_bad_settings_are_one_line_errors(tiny_target):
    with pytest.raises(DraftError, match="method.markov_rank=0: must be >= 1"):
        DSparkDraft(tiny_target, DSparkConfig(**{**SMALL, "markov_rank": 0}))
    with pytest.raises(DraftError, match="method.confidence_weight=-1"):
        DSparkDraft(tiny_target, DSparkConfig(**{**SMALL, "confidence_weight": -1.0}))


def test_the_confidence_schedule_proposes_the_slots_it_trusts(tiny_target):
    """stop=confidence: a block's slots are proposed while the running product of the
    confidence head's estimates stays >= the threshold, a leading run of the block drafted
    without it; a threshold above the first slot's estimate proposes nothing."""
    import math

    d = lively(DSparkDraft(tiny_target, DSparkConfig(**SMALL)), 1)
    with torch.no_grad():  # every slot's estimate 0.6: running products .6 .36 .216 .13
        d.confidence.weight.zero_()
        d.confidence.bias.fill_(math.log(0.6 / 0.4))

    def proposal(threshold):
        d.confidence_stop(threshold)
        _, _, state = _state(tiny_target)
        p = d.proposer()
        p.start(state)
        return p.propose(state, 4).tokens

    full = proposal(None)
    assert len(full) == 4
    assert proposal(0.2) == full[:3]
    assert proposal(0.5) == full[:1]
    assert proposal(0.7) == []
    d.confidence_stop(None)


def test_decoding_with_the_confidence_schedule_is_lossless(tiny_target):
    """The schedule reads only the draft's own outputs: greedy speculative decoding with it
    is the target's greedy output, at batch 1 and in the batched decoder."""
    from decoding.batch import BatchDecoder
    from decoding.decoder import SpeculativeDecoder
    from models.target import GenRequest

    d = lively(DSparkDraft(tiny_target, DSparkConfig(**SMALL)), 5)
    d.confidence_stop(0.3)
    prompts = [list(range(40, 60)), list(range(70, 76))]
    plain = SpeculativeDecoder(tiny_target, d.proposer(), Sampling(), gamma=0, adaptive=False)
    ref = [plain.generate(p, 20) for p in prompts]
    one = SpeculativeDecoder(tiny_target, d.proposer(), Sampling(), gamma=4, adaptive=False)
    assert [one.generate(p, 20) for p in prompts] == ref
    bdec = BatchDecoder(
        tiny_target, d.proposer(), Sampling(), batch_size=2, gamma=4, compile="false"
    )
    out = bdec.run([GenRequest(i, p) for i, p in enumerate(prompts)], 20)
    assert [out[i] for i in range(2)] == ref
    d.confidence_stop(None)


def test_stop_confidence_needs_a_confidence_head(tiny_target):
    from omegaconf import OmegaConf

    from decoding.eval import EvalError, confidence_stop

    cfg = OmegaConf.create({"draft": "runs/x", "confidence_threshold": 0.2})
    dflash = DFlashDraft(
        tiny_target, DFlashConfig(**{k: v for k, v in SMALL.items() if k != "markov_rank"})
    )
    with pytest.raises(EvalError, match="draft=runs/x has no confidence head"):
        confidence_stop(dflash.proposer(), cfg)
    headless = DSparkDraft(tiny_target, DSparkConfig(**SMALL, confidence_head=False))
    with pytest.raises(EvalError, match="without a confidence head"):
        confidence_stop(headless.proposer(), cfg)
    d = DSparkDraft(tiny_target, DSparkConfig(**SMALL))
    assert "confidence stop" in confidence_stop(d.proposer(), cfg)
    assert d.stop_threshold == 0.2
