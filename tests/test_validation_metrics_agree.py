"""Validation metrics count what the draft accepts at T = 0, for every registered method.

Training prints each method's ``evaluate`` agreement with the target's argmax by draft
position, and users read those numbers as the acceptance the draft shows when served
greedily. tests/test_train_serve_agreement.py checks that the proposer drafts the argmax of
the training forward; here ``evaluate``'s aggregation of those predictions is checked: on a
batch of two right-padded rows whose loss masks cover part of each row, every position
where serving drafts (its pending token a reply's: a request's first token is the
prefill's) is recomputed independently by driving the method's proposer on the prefix up to it
(the committed features as the decoder gives them) and comparing its draft with the target's
argmax on the same batch, and the metric's sum and count are both compared.

The replies in the batch are the target's own greedy continuation, so that within a reply
the data's next token is the target's argmax: a metric teacher-forced on the data then reads
at a position k > 1 what a greedy chain reads after its first k - 1 tokens were accepted, and
conditional metrics (``alpha_pos{k}``) are comparable with the proposer's chain. Unconditional
position k > 1 metrics whose forward reads the data's tokens before position k (EAGLE's
unrolled steps, the MLP speculator's stages) are not what a proposer reproduces where an
earlier position disagreed; they are left out (said where). Heads have lively weights, and
every vocabulary-sized output layer, the target's and the draft's, scores only a few tokens
(``concentrate``), so that agreement is neither 0 nor 1: a random head agrees with a random
target about once in 256 positions, and a miscounted agreement would still count 0. A method
registered in ``models.METHODS`` without an entry in ``CASES`` fails naming it."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from test_train_serve_agreement import (
    block_config,
    choose_vocab,
    eagle3_configs,
    first_path,
    fresh_target,
    lively,
)
from torch import nn

from models import METHODS
from models.base import SERVED_CHAIN, DecodeSettings, DecodeState
from models.sampling import Sampling

#: the tokens every argmax (the target's, every draft's) falls on (``concentrate``): pairs of
#: ids of the ``choose_vocab`` draft vocabulary, and one id outside it (then the target's
#: argmax is at times a token a reduced-vocabulary draft cannot draft). Which ids only decides
#: where random heads happen to agree: these make every case's agreement neither 0 nor all
#: (asserted by ``check``)
PAIRS = ((85, 124), (153, 210), (40, 165))
OUTSIDE = 100

#: each row's segments: (length, in the loss mask); a reply (True) is the target's greedy
#: continuation, anything else random tokens. Row 1 is the shorter one, right-padded.
ROWS = [
    [(3, False), (7, True), (3, False), (6, True)],
    [(4, False), (9, True)],
]


def concentrate(method):
    """Every vocabulary-sized output layer of the target and of ``method`` made to score only
    the few tokens of ``PAIRS`` and ``OUTSIDE``, so that random heads agree with a random
    target's argmax at some positions (1 in 256 otherwise: an agreement sum of 0 would let a
    miscounted agreement pass). Applied after ``lively``/``choose_vocab``; returns ``method``.

    The layers: the target's LM head (untied from its input embedding first, so the tokens the
    models read stay distinct), and every ``nn.Linear`` of the method whose outputs are the
    target's vocabulary (Medusa's heads, the MLP speculator's stages, the DistillSpec student's
    head) or the draft vocabulary of a ``d2t`` (EAGLE-3's head, Domino's correction, DSpark's
    Markov bias; DFlash reads the target's rows). All rows but these tokens' are zeroed, and
    the second id of each pair gets the negated row (and bias) of the first: every logits sum
    of such layers (DSpark's Markov bias, Domino's correction, a soft cap: odd functions) then
    has a pair whose logit is > 0 while the rest are 0, so the argmax is one of these tokens,
    never an exact tie between zeroed rows (whose order argmax and topk need not agree on).
    """
    target = method.target
    V = target.config.vocab_size
    d2t = getattr(method, "d2t", None)
    draft_ids = None
    if d2t is not None:
        draft_ids = {int(j) + int(d2t[j]): j for j in range(len(d2t))}
        assert all(t in draft_ids for p in PAIRS for t in p) and OUTSIDE not in draft_ids
    layers = {id(target.lm_head): (target.lm_head, "target")}
    for m in method.modules():
        if isinstance(m, nn.Linear) and m.out_features == V:
            layers.setdefault(id(m), (m, "target"))
        elif isinstance(m, nn.Linear) and d2t is not None and m.out_features == len(d2t):
            layers.setdefault(id(m), (m, "draft"))
    # an output layer tied to an input embedding gets a copy of its own
    embedded = [target.embed_tokens, *(m for m in method.modules() if isinstance(m, nn.Embedding))]
    shared = {e.weight.data_ptr() for e in embedded}
    for m, _ in layers.values():
        if m.weight.data_ptr() in shared:
            m.weight = nn.Parameter(m.weight.detach().clone(), m.weight.requires_grad)
    method.__dict__.pop("_lm_rows", None)  # DFlash's copy of the target's rows, if made
    with torch.no_grad():
        for m, vocab in layers.values():
            if vocab == "target":
                pairs, single = PAIRS, [OUTSIDE]
            else:
                pairs, single = [tuple(draft_ids[t] for t in p) for p in PAIRS], []
            keep = torch.zeros(m.out_features, dtype=torch.bool)
            keep[[i for p in pairs for i in p] + single] = True
            m.weight[~keep] = 0
            if m.bias is not None:
                m.bias[~keep] = 0
            # rows of one norm: no token wins on its row's length alone
            base = [p[0] for p in pairs] + single
            w = m.weight[base]
            m.weight[base] = w / w.norm(dim=-1, keepdim=True) * w.norm(dim=-1).mean()
            for a, b in pairs:
                m.weight[b] = -m.weight[a]
                if m.bias is not None:
                    m.bias[b] = -m.bias[a]
    return method


def target_argmax(target, ids: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
    """(B, T) the target's argmax after each position (its greedy next token)."""
    with torch.no_grad():
        return target.model(input_ids=ids, attention_mask=attn).logits.argmax(-1)


def greedy_batch(target, layers, seed: int = 3):
    """The two rows of ``ROWS``, right-padded, with the target's features, its argmax on the
    batch, and each row's length."""
    g = torch.Generator().manual_seed(seed)
    rows, masks = [], []
    for segments in ROWS:
        ids, lm = [], []
        for length, reply in segments:
            for _ in range(length):
                if reply:
                    t = torch.tensor([ids])
                    ids.append(int(target_argmax(target, t, torch.ones_like(t))[0, -1]))
                else:
                    ids.append(int(torch.randint(20, 250, (), generator=g)))
                lm.append(int(reply))
        rows.append(ids)
        masks.append(lm)
    T = max(map(len, rows))
    ids = torch.full((len(rows), T), target.pad_token_id, dtype=torch.long)
    attn, lm = torch.zeros_like(ids), torch.zeros_like(ids)
    for b, (r, m) in enumerate(zip(rows, masks, strict=True)):
        ids[b, : len(r)], attn[b, : len(r)], lm[b, : len(r)] = torch.tensor(r), 1, torch.tensor(m)
    batch = {"input_ids": ids, "attention_mask": attn, "loss_mask": lm}
    if layers:
        batch["features"] = target.features(ids, attn, tuple(layers))
    targ = target_argmax(target, ids, attn)
    # the recount drafts on each row alone, evaluate reads the padded batch: their forwards
    # differ by float noise (~1e-5 here), which a near tie in the target's logits would turn
    # into a flipped argmax rather than a miscount
    with torch.no_grad():
        top = target.model(input_ids=ids, attention_mask=attn).logits.topk(2, -1).values
    gap = (top[..., 0] - top[..., 1])[attn.bool()].min()
    assert gap > 1e-3, f"the target's argmax is a near tie (margin {gap:.2e}) somewhere"
    # within a reply the data's next token is the target's argmax
    nxt = lm[:, 1:].bool()
    assert torch.equal(ids[:, 1:][nxt], targ[:, :-1][nxt])
    return batch, targ, [len(r) for r in rows]


def drafts(method, batch, lengths, gamma: int, settings=None) -> dict[tuple[int, int], list]:
    """The proposer's greedy draft after the prefix of length n (its last token pending) of
    each row b, keyed (b, n), for every n from 2 up to the row's length."""
    target = method.target
    out = {}
    # the layers the proposer reads (Medusa-2's training forward runs the backbone itself and
    # reads no features; its proposer reads the adapted verifier's)
    layers = tuple(method.proposer(settings).feature_layers)
    for b, L in enumerate(lengths):
        row = batch["input_ids"][b, :L]
        feats = None
        if layers:
            t = row[None]
            feats = target.features(t, torch.ones_like(t), layers)[0]
        for n in range(2, L + 1):
            prop = method.proposer(settings)
            state = DecodeState(row[:n].tolist(), None, Sampling(), None, target.device)
            if layers:  # the features of every fed position (all but the pending token)
                state.features = feats[: n - 1]
            with torch.no_grad():
                prop.start(state)
                out[(b, n)] = first_path(prop.propose(state, gamma))
    return out


def recount(batch, targ, lengths, drafted, k: int, counted: Callable[..., bool]):
    """(top1 sum, count), (alpha sum, count) at draft position k: over the prefixes n where
    ``counted(ok_row, real_row, n, k)`` holds, whether the proposer's k-th token is the target's argmax
    at n + k - 2 (alpha: given that its tokens 1..k-1 were the target's too)."""
    ok = (batch["loss_mask"].bool() & batch["attention_mask"].bool()).tolist()
    real = batch["attention_mask"].bool().tolist()
    top1, alpha = [0, 0], [0, 0]
    for b, L in enumerate(lengths):
        for n in range(2, L + 1):
            # serving drafts once the pending token is a reply's (a request's first token is
            # the prefill's): every family's rule holds this, whatever else it asks
            if not ok[b][n - 1] or not counted(ok[b], real[b], n, k):
                continue
            d = drafted[(b, n)]
            agree = [
                i < len(d) and n + i - 1 < targ.shape[1] and d[i] == int(targ[b, n + i - 1])
                for i in range(k)
            ]
            top1[0] += agree[-1]
            top1[1] += 1
            if all(agree[:-1]):
                alpha[0] += agree[-1]
                alpha[1] += 1
    return top1, alpha


def served_walk(batch, targ, lengths, drafted, counted: Callable[..., bool], g: int):
    """A greedy decoder's walk through each reply with a chain of ``g`` of the proposer's
    drafts: from the reply's first token pending (the prefill's), each iteration tests drafts
    until the first miss, emits the accepted ones and the target's next token, and drafts
    again past them. (tokens, iterations), (accepted, tested): ``chain{g}_tau`` and
    ``chain{g}_alpha`` recounted by the proposer."""
    ok = (batch["loss_mask"].bool() & batch["attention_mask"].bool()).tolist()
    real = batch["attention_mask"].bool().tolist()
    tokens = iterations = accepted = tested = 0
    for b, L in enumerate(lengths):
        n = 2
        while n <= L:
            if not (ok[b][n - 1] and counted(ok[b], real[b], n, 1)):
                n += 1
                continue
            d, a = drafted[(b, n)], 0
            while a < g and counted(ok[b], real[b], n, a + 1):
                tested += 1
                if not (a < len(d) and d[a] == int(targ[b, n + a - 1])):
                    break
                a += 1
            tokens, iterations, accepted = tokens + a + 1, iterations + 1, accepted + a
            n += a + 1
    return [tokens, iterations], [accepted, tested]


def oks(ok_row: list[bool], positions) -> bool:
    return all(0 <= p < len(ok_row) and ok_row[p] for p in positions)


def assert_counts(got: torch.Tensor, want: list[int], name: str) -> None:
    s, c = got.tolist()
    assert (round(s), round(c)) == tuple(want), f"{name}: evaluate counts {s}/{c}, want {want}"


def check(method, gamma, counted, names, settings=None, positions=(1, 2)):
    """Compare ``evaluate``'s metrics ``names[k] = (top1 name or None, alpha name or None)``
    with the recount at each draft position k in ``positions``."""
    batch, targ, lengths = greedy_batch(method.target, method.feature_layers)
    with torch.no_grad():
        got = method.evaluate(batch)
    d = drafts(method, batch, lengths, gamma, settings)
    seen = []
    for k in positions:
        top1, alpha = recount(batch, targ, lengths, d, k, counted)
        top_name, alpha_name = names[k]
        if top_name is not None:
            assert_counts(got[top_name], top1, top_name)
            seen.append(top1)
        if alpha_name is not None:
            assert_counts(got[alpha_name], alpha, alpha_name)
            seen.append(alpha)
    # what a chain decoding the batch's replies would accept, where the method reports it
    g = SERVED_CHAIN
    if f"chain{g}_tau" in got and gamma >= g and names.get(g, (None, None))[1] is not None:
        tau, alpha = served_walk(batch, targ, lengths, d, counted, g)
        assert_counts(got[f"chain{g}_tau"], tau, f"chain{g}_tau")
        assert_counts(got[f"chain{g}_alpha"], alpha, f"chain{g}_alpha")
        SERVED.append(method.cfg.name)
    COMPARED.append(seen[0])


#: each ``check``'s first compared (agreements, count), for the test's guard over its seeds
COMPARED: list[list[int]] = []
#: the methods whose served chain was recounted (``served_walk``)
SERVED: list[str] = []
#: the seeds of the heads' weights each case is checked with: which positions agree, and so
#: which miscounts a case can show, depend on them
SEEDS = (0, 1, 2)


POS = {k: (f"top1_pos{k}", f"alpha_pos{k}") for k in (1, 2, 3, 4)}


# ---------------------------------------------------------------------------------------------
# EAGLE family: step j at start s = n - 2 reads x_{s+j} and predicts x_{s+j+1}, all of
# x_{s+1} .. x_{s+j+1} real assistant tokens. top1_pos{k>1} is teacher-forced on the data's
# tokens (unrolled on the data's x_{s+2}.. where the chain reads its own draft): left out


def eagle_counted(ok, real, n, k):
    return oks(ok, range(n - 1, n + k))


EAGLE_NAMES = {1: POS[1], 2: (None, POS[2][1]), 3: (None, POS[3][1])}


def case_eagle1(target):
    from models.eagle import Eagle1Config, EagleHead

    head = concentrate(lively(EagleHead(target, Eagle1Config()), 0.1))
    check(head, 3, eagle_counted, EAGLE_NAMES, DecodeSettings(tree="chain"), (1, 2, 3))


def check_eagle3(cls, cfg, target):
    head = cls(target, cfg)
    choose_vocab(head)
    head = concentrate(lively(head, 0.2))
    check(head, 3, eagle_counted, EAGLE_NAMES, DecodeSettings(tree="chain"), (1, 2, 3))


def case_eagle3(target):
    from models.eagle import Eagle3Config, Eagle3Head

    check_eagle3(Eagle3Head, eagle3_configs(Eagle3Config)[0], target)


def case_hass(target):
    from models.hass import HassHead
    from models.hass.config import HassConfig

    check_eagle3(HassHead, eagle3_configs(HassConfig, topk=4)[0], target)


def case_peagle(target):
    from models.peagle import PEagleConfig, PEagleHead

    cfg = PEagleConfig(draft_vocab_size=64, fuse_layers=[1, 2, 3], mask_token_id=5, ttt_steps=3)
    check_eagle3(PEagleHead, cfg, target)


# ---------------------------------------------------------------------------------------------
# Medusa: head k-1 at t = n - 2 predicts x_{t+k+1} (the target's argmax at t + k), counted
# where that token and the pending x_{t+1} are assistant tokens (serving drafts from a
# reply's first token on) and x_t .. x_{t+k+1} are real. Its heads all read the state at t,
# never the draft's tokens: every head is comparable, positionally


def medusa_counted(ok, real, n, k):
    return oks(ok, [n - 1, n + k - 1]) and oks(real, range(n - 2, n + k))


def check_medusa(heads):
    K = heads.cfg.num_heads
    names = {k: (f"top1_head{k}", None) for k in range(1, K + 1)}
    check(heads, K, medusa_counted, names, DecodeSettings(tree="chain"), range(1, K + 1))


def case_medusa1(target):
    from models.medusa import MedusaHeads
    from models.medusa.config import Medusa1Config

    heads = MedusaHeads(target, Medusa1Config(num_heads=3, tree_nodes=6))
    check_medusa(concentrate(lively(heads, 0.1)))


def case_medusa2(target):
    """The verifier is the adapted target: the greedy replies and the argmax are its own."""
    from models.medusa import Medusa2Heads
    from models.medusa.config import Medusa2Config

    cfg = Medusa2Config(num_heads=3, tree_nodes=6, lora_r=4)
    check_medusa(concentrate(lively(Medusa2Heads(fresh_target(), cfg), 0.1)))


# ---------------------------------------------------------------------------------------------
# DistillSpec: accept_T0 at t = n - 1 (x_t, the pending token, and x_{t+1} real assistant
# tokens): the student's greedy first token against the target's argmax at t


def case_distillspec(target):
    from models.distillspec import DistillSpecStudent
    from models.distillspec.config import DistillSpecConfig

    student = DistillSpecStudent(target, DistillSpecConfig(num_layers=1))
    student = concentrate(lively(student, 0.05))
    check(
        student, 1, lambda ok, real, n, k: oks(ok, [n - 1, n]), {1: ("accept_T0", None)}, None, (1,)
    )


# ---------------------------------------------------------------------------------------------
# MLP speculator: stage i-1 at t = n - 2 predicts x_{t+i+1} (head_masks), reading the data's
# x_{t+i} for i > 1: top1_stage{i>1} is left out. alpha_pos{i} counts the positions where
# stages 1..i are all scored (a reply's first tokens, seen from the prompt, are not
# rejections of a stage whose label is the prompt's)


def case_mlp_speculator(target):
    from models.mlp_speculator import MLPSpeculator
    from models.mlp_speculator.config import MLPSpeculatorConfig

    m = concentrate(lively(MLPSpeculator(target, MLPSpeculatorConfig(n_predict=3)), 0.05))
    K = m.cfg.n_predict
    check(m, K, medusa_counted, {1: ("top1_stage1", None)}, None, (1,))
    names = {k: (None, f"alpha_pos{k}") for k in range(1, K + 1)}

    def counted(ok, real, n, k):
        return all(medusa_counted(ok, real, n, j) for j in range(1, k + 1))

    check(m, K, counted, names, None, range(1, K + 1))


# ---------------------------------------------------------------------------------------------
# Block drafters: the block anchored at the pending token's position a = n - 1, slot k
# predicting x_{a+k} (the target's argmax at a + k - 1), counted where x_a, x_{a+1} and
# x_{a+k} are real assistant tokens; slots read the draft's own tokens before them: every
# position is comparable


def blocks_counted(ok, real, n, k):
    return oks(ok, [n - 1, n, n + k - 1])


def check_blocks(draft, sequential=None):
    choose_vocab(draft)
    lively(draft, 0.1)
    if sequential is not None:
        lively(getattr(draft, sequential), 3.0, seed=1)
    concentrate(draft)
    gamma = draft.cfg.block_size - 1
    check(draft.eval(), gamma, blocks_counted, POS, None, range(1, gamma + 1))


def case_dflash(target):
    from models.dflash import DFlashDraft
    from models.dflash.config import DFlashConfig

    check_blocks(DFlashDraft(target, block_config(DFlashConfig)))


def case_domino(target):
    from models.dflash import DominoDraft
    from models.dflash.config import DominoConfig

    cfg = block_config(DominoConfig, gru_hidden=16, correction_dim=8)
    check_blocks(DominoDraft(target, cfg), "correction")


def case_dspark(target):
    from models.dspark import DSparkDraft
    from models.dspark.config import DSparkConfig

    check_blocks(DSparkDraft(target, block_config(DSparkConfig, markov_rank=8)), "markov_head")


# ---------------------------------------------------------------------------------------------
# Falcon: a start e = n - 2 (the last committed input) with a whole block before it
# (e >= k - 1); draft j predicts x_{e+j+1}, counted where x_{e+1}, x_{e+2} and x_{e+j+1} are
# real assistant tokens; both passes read the draft's own predictions: every position is
# comparable


def case_falcon(target):
    from models.falcon import FalconConfig, FalconHead

    head = concentrate(lively(FalconHead(target, FalconConfig(k=2)), 0.3))
    c = head.cfg.k

    def counted(ok, real, n, j):
        return n - 2 >= c - 1 and oks(ok, [n - 1, n, n + j - 1])

    check(head, 2 * c, counted, POS, None, range(1, 2 * c + 1))


CASES = {
    "eagle1": case_eagle1,
    "eagle3": case_eagle3,
    "hass": case_hass,
    "medusa1": case_medusa1,
    "medusa2": case_medusa2,
    "distillspec": case_distillspec,
    "mlp_speculator": case_mlp_speculator,
    "dflash": case_dflash,
    "domino": case_domino,
    "dspark": case_dspark,
    "peagle": case_peagle,
    "falcon": case_falcon,
}


@pytest.fixture(scope="module")
def target4():
    return fresh_target()


@pytest.mark.parametrize("name", sorted(METHODS))
def test_validation_metrics_count_what_the_proposer_drafts(name, target4):
    """``evaluate``'s agreement counts, position by position, are the proposer's greedy
    drafts at every counted position compared with the target's argmax (module docstring)."""
    assert name in CASES, (
        f"method {name!r} is registered but has no case in the validation metric test "
        "(tests/test_validation_metrics_agree.py)"
    )
    COMPARED.clear()
    for seed in SEEDS:
        torch.manual_seed(seed)
        CASES[name](target4)
    agreed, count = (sum(c[i] for c in COMPARED) for i in (0, 1))
    assert 0 < agreed < count, f"degenerate agreement {agreed}/{count}: nothing compared"


def test_the_served_chain_is_recounted_for_the_methods_that_report_it(target4):
    """``chain3_tau`` / ``chain3_alpha`` (what decoding the validation text with a chain of 3
    would accept) match a decoder's walk over the proposer's drafts: checked above for every
    method reporting them; here, that those are the EAGLE family and the MLP speculator."""
    SERVED.clear()
    for name in ("eagle1", "eagle3", "hass", "mlp_speculator"):
        torch.manual_seed(0)
        CASES[name](target4)
    assert set(SERVED) >= {"eagle1", "eagle3", "hass", "mlp_speculator"}, SERVED


def test_distillspec_accept_T1_is_its_proposers_acceptance_at_T1():
    """``accept_T1``, DistillSpec's estimate of the acceptance at T = 1, is sum_x min(p, q)
    over the counted positions of ``accept_T0`` with q the distribution the proposer samples
    its first draft token from at T = 1 (as the decoder gets it) and p the target's there."""
    from models.distillspec import DistillSpecStudent
    from models.distillspec.config import DistillSpecConfig

    target = fresh_target()
    with torch.no_grad():  # softer distributions than the near point masses of its random head,
        target.lm_head.weight.mul_(0.1)  # so that sum_x min(p, q) is neither 0 nor 1
    torch.manual_seed(0)
    student = lively(DistillSpecStudent(target, DistillSpecConfig(num_layers=1)), 0.05)
    batch, _, lengths = greedy_batch(target, student.feature_layers)
    with torch.no_grad():
        got = student.evaluate(batch)["accept_T1"].tolist()
    ok = (batch["loss_mask"].bool() & batch["attention_mask"].bool()).tolist()
    total, count = 0.0, 0
    for b, L in enumerate(lengths):
        row = batch["input_ids"][b, :L]
        for n in range(2, L + 1):
            if not oks(ok[b], [n - 1, n]):
                continue
            state = DecodeState(row[:n].tolist(), None, Sampling(temperature=1.0), None, "cpu")
            prop = student.proposer(None)
            with torch.no_grad():
                prop.start(state)
                q = prop.propose(state, 1).q[0].float()
                p = target.model(input_ids=row[None, :n]).logits[0, -1].float().softmax(-1)
            total += float(torch.minimum(p, q[: p.shape[-1]]).sum())
            count += 1
    assert count == round(got[1]) and 0 < total < count
    assert got[0] == pytest.approx(total, rel=1e-4), f"accept_T1 {got[0]}, recounted {total}"
