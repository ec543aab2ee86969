"""Domino (DFlash with its GRU logit correction, ``method=domino``) and the losses a block
drafter can choose (``method.loss``): each slot from ``corrected_from`` on reads the tokens
drafted before it in its block (in decoding as in training and validation), slot 1 is the
backbone's alone, an untrained correction drafts as DFlash, sampled blocks follow the target
exactly, the batched decoder drafts what batch 1 does; D-PACE and the LK losses train a block
drafter, and D-PACE's loss is its weights times the slots' CE. The contract test
(tests/test_methods.py) trains, decodes losslessly at T = 0 and reloads it like every other
method; tests/test_families.py runs it on every model family."""

from __future__ import annotations

import conftest
import pytest
import torch
from conftest import assert_first_two_tokens_follow_the_target
from test_dflash import lively
from test_dspark import SMALL as DSPARK_SMALL
from test_dspark import _state

from models.base import DecodeSettings, DraftError
from models.dflash import DFlashConfig, DFlashDraft, DominoConfig, DominoDraft
from models.dspark import DSparkConfig, DSparkDraft
from models.losses import acceptance_probs, dpace_weights
from models.sampling import Sampling

SMALL = dict(
    draft_vocab_size=64,
    mask_token_id=5,
    block_size=5,
    fuse_layers=[1, 2],
    gru_hidden=16,
    correction_dim=8,
)


@pytest.fixture(scope="module")
def small_vocab_target():
    return conftest.small_vocab_target(4)


def _loud(d: DominoDraft, scale: float) -> DominoDraft:
    with torch.no_grad():
        d.correction.embed_proj[2].weight.normal_(0, scale)
    return d


def test_each_slot_reads_every_token_drafted_before_it(tiny_target):
    """The proposer's block equals the training pass's states with slot i scored from the GRU
    over slots 0..i-1's tokens, one slot after another; slot 1 is the backbone's argmax; with
    the correction loud, later slots differ from scoring them independently."""
    d = _loud(lively(DominoDraft(tiny_target, DominoConfig(**SMALL)), 1), 30.0)
    ids, feats, state = _state(tiny_target)
    prop = d.proposer()
    prop.start(state)
    got = prop.propose(state, 4).tokens
    n = len(state.ids)
    with torch.no_grad():
        h = d.run_blocks(
            feats[:, :n], ids[:, :n], torch.ones_like(ids[:, :n]), torch.tensor([[n - 1]])
        )
        toks, want = [int(ids[0, n - 1])], []
        for i in range(1, 5):
            g = d.correction.states(d.embed(torch.tensor([toks])))[0, -1]
            z = d.draft_logits(h[0, 0, i])
            if i >= 2:
                z = z + d.correction(d.norm(h[0, 0, i]), g)
            j = int(z.argmax())
            toks.append(j + int(d.d2t[j]))
            want.append(toks[-1])
        independent = d.draft_logits(h[0, 0, 1:]).argmax(-1)
    assert got == want
    assert got[0] == int(independent[0] + d.d2t[independent[0]])
    assert got != (independent + d.d2t[independent]).tolist()


def test_an_untrained_correction_drafts_as_its_dflash_backbone(tiny_target):
    """The correction's last projection starts at zero: a fresh Domino proposes what a DFlash
    draft with the same backbone weights proposes."""
    cfg = {k: v for k, v in SMALL.items() if k not in ("gru_hidden", "correction_dim")}
    dm = lively(DominoDraft(tiny_target, DominoConfig(**SMALL)), 4)
    with torch.no_grad():
        dm.correction.embed_proj[2].weight.zero_()
    df = DFlashDraft(tiny_target, DFlashConfig(**cfg)).eval()
    df.load_state_dict({k: v for k, v in dm.state_dict().items() if k in df.state_dict()})
    for d in (dm, df):
        _, _, state = _state(tiny_target, seed=7)
        p = d.proposer()
        p.start(state)
        d.got = p.propose(state, 4).tokens
    assert dm.got == df.got


#: one warped setting: what T = 1 checks, plus a temperature and a top-k that zero some of q's
#: tokens (the unwarped law at T = 1 is checked on each decoding path: test_decoder.py, test_eagle3.py)
@pytest.mark.parametrize("s", [Sampling(0.9, top_k=8)], ids=["T0.9-k8"])
def test_sampled_domino_blocks_follow_the_target(small_vocab_target, s):
    """Chi-square on the first two tokens (false-alarm rate 1e-3): slot 2's distribution
    depends on slot 1's draw through the GRU, and the verifier is handed exactly that one."""
    from decoding.decoder import SpeculativeDecoder

    d = DominoDraft(
        small_vocab_target,
        DominoConfig(
            draft_vocab_size=6,
            mask_token_id=9,
            block_size=4,
            fuse_layers=[1, 3],
            gru_hidden=8,
            correction_dim=8,
        ),
    )
    _loud(lively(d, 3), 3.0)
    dec = SpeculativeDecoder(small_vocab_target, d.proposer(), s, gamma=3, adaptive=False, seed=5)
    assert_first_two_tokens_follow_the_target(small_vocab_target, dec, [1, 2, 3], s, gen=3)
    assert 0.02 < dec.stats.alpha < 0.98


def test_the_batched_decoder_drafts_what_batch_one_does(tiny_target):
    from decoding.batch import BatchDecoder
    from decoding.decoder import SpeculativeDecoder
    from models.target import GenRequest

    d = _loud(lively(DominoDraft(tiny_target, DominoConfig(**SMALL)), 2), 10.0)
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


def _batch(t, d, seed=4):
    ids = torch.randint(0, 9, (2, 24), generator=torch.Generator().manual_seed(seed))
    attn = torch.ones_like(ids)
    return {
        "input_ids": ids,
        "attention_mask": attn,
        "loss_mask": attn,
        "features": t.features(ids, attn, d.feature_layers),
    }


@pytest.mark.parametrize(
    "cls,cfg,loss",
    [
        (DFlashDraft, DFlashConfig, "dpace"),
        (DFlashDraft, DFlashConfig, "lk_alpha"),
        (DFlashDraft, DFlashConfig, "lk_lambda"),
        (DFlashDraft, DFlashConfig, "tvd"),
        (DominoDraft, DominoConfig, "ce"),
        (DominoDraft, DominoConfig, "dpace"),
        (DSparkDraft, DSparkConfig, "lk_lambda"),
    ],
)
def test_every_block_loss_trains(small_vocab_target, cls, cfg, loss):
    """A few optimizer steps on one batch lower each loss by a fifth or more."""
    t = small_vocab_target
    extra = {"markov_rank": 4} if cls is DSparkDraft else {}
    if cls is DominoDraft:
        extra = {"gru_hidden": 8, "correction_dim": 8}
    torch.manual_seed(0)
    d = cls(
        t,
        cfg(
            mask_token_id=9,
            draft_vocab_size=10,
            block_size=4,
            targets="hard",
            fuse_layers=[1, 3],
            loss=loss,
            **extra,
        ),
    )
    batch = _batch(t, d)
    opt = torch.optim.AdamW(d.parameters(), lr=3e-3)
    ce = []
    for _ in range(25):
        torch.manual_seed(1)  # the same anchors each step
        out = d(batch)
        opt.zero_grad()
        out.loss.backward()
        opt.step()
        ce.append(float(out.loss.detach()))
    assert ce[-1] < 0.8 * ce[0], (loss, ce)


def test_the_dpace_loss_is_its_weights_times_the_slots_ce(small_vocab_target):
    """The training pass's D-PACE loss equals, block by block, sum_k w_k CE_k averaged over
    blocks, with w from ``dpace_weights`` of the slots' acceptance (recomputed here from the
    same states)."""
    t = small_vocab_target
    d = DFlashDraft(
        t,
        DFlashConfig(
            mask_token_id=9,
            draft_vocab_size=10,
            block_size=4,
            fuse_layers=[1, 3],
            loss="dpace",
            anchors=5,
        ),
    )
    lively(d, 0).train()
    batch = _batch(t, d, seed=3)
    torch.manual_seed(2)
    got = d(batch).loss
    from models.dflash.model import sample_anchors

    torch.manual_seed(2)
    pred_ok = d.predicts_reply(batch["loss_mask"], batch["attention_mask"])
    anchors, valid = sample_anchors(
        d.anchors_served(batch["loss_mask"], batch["attention_mask"]), 5
    )
    with torch.no_grad():
        h = d.run_blocks(batch["features"], batch["input_ids"], batch["attention_mask"], anchors)
        b, a, k, p = d._slot_rows(anchors, valid, pred_ok)
        z = d.draft_logits(h[b, a, k])
        tp = d.target_logits(batch["features"][b, p, -1], draft_only=True).softmax(-1)
        ce = -(tp * z.log_softmax(-1)).sum(-1)
        acc = acceptance_probs(z, tp)
    total, blocks = 0.0, 0
    for bb in range(2):
        for aa in range(anchors.shape[1]):
            m = (b == bb) & (a == aa)
            if not m.any():
                continue
            grid = torch.zeros(1, 3)
            ok = torch.zeros(1, 3, dtype=torch.bool)
            grid[0, k[m] - 1], ok[0, k[m] - 1] = acc[m], True
            w = dpace_weights(grid, ok)[0, k[m] - 1]
            total += float((w * ce[m]).sum())
            blocks += 1
    assert abs(float(got) - total / blocks) < 1e-4


def test_bad_settings_are_one_line_errors(tiny_target):
    with pytest.raises(DraftError, match="method.correction='lstm': use none"):
        DFlashDraft(tiny_target, DFlashConfig(**{**SMALL, "correction": "lstm"}))
    with pytest.raises(DraftError, match="method.gru_hidden=0"):
        DominoDraft(tiny_target, DominoConfig(**{**SMALL, "gru_hidden": 0}))
    with pytest.raises(DraftError, match="method.loss='kl': use one of ce, tvd, lk_alpha"):
        DFlashDraft(tiny_target, DFlashConfig(**{**SMALL, "loss": "kl"}))
    with pytest.raises(DraftError, match="method=domino"):
        DSparkDraft(tiny_target, DSparkConfig(**DSPARK_SMALL, correction="gru"))


@pytest.mark.parametrize("method", ["domino", "dspark"])
def test_int8_draft_weights_draft_a_block(tiny_target, method):
    """``draft_weights=int8`` (the default for a bf16 draft on a CPU) replaces every linear of
    the draft, the correction's and the Markov and confidence heads' too: the block still
    drafts, with the confidence schedule on where there is one."""
    if method == "domino":
        d = _loud(lively(DominoDraft(tiny_target, DominoConfig(**SMALL)), 1), 3.0)
    else:
        d = lively(DSparkDraft(tiny_target, DSparkConfig(**DSPARK_SMALL)), 1)
        d.confidence_stop(0.0)
    assert d.quantize_for_decoding("int8") > 0
    _, _, state = _state(tiny_target)
    p = d.proposer()
    p.start(state)
    assert len(p.propose(state, 4).tokens) == 4
