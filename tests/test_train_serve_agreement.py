"""Training and serving agree, for every registered method: at every iteration of a greedy
decoding run, the tokens the decode-time proposer drafts are the argmax of what the
training-time forward predicts for those positions, the predictions the method's training loss
and validation metrics are computed on.

This is the toolkit's promise that the acceptance a draft shows in training is the acceptance
it shows when decoding. A head whose training sees one thing and whose proposer reads another
(a mask that lets training see the future, a feature offset by one position, a norm applied on
one side only, another token fed) trains well, validates well and drafts worse, while decoding
stays lossless and nothing fails. Heads here have randomly perturbed ("lively") weights, so
that their predictions are neither the target's nor constant and a disagreement cannot hide
behind a degenerate argmax.

The proposer is driven as the decoder drives it: started on a two-token prompt, then asked,
verified against, rolled back and caught up, with iterations that accept nothing, all or part
of its draft and iterations that skip drafting. Chains are compared past their first token
wherever training computes them: EAGLE's unrolled steps (training-time test), Medusa's heads,
the MLP speculator's stages, a block drafter's slots, P-EAGLE's depths, Falcon's second
forward, a draft LM's next tokens. Training reads the data's tokens where decoding reads the
drafted ones, so each comparison runs training on the committed tokens followed by the draft's
own (teacher forcing on the draft's chain is what drafting computes) and then more tokens (a
training pass that read ahead would read them), right-padded in a batch beside a longer
sequence, as training batches are. A method registered in ``models.METHODS`` without an entry
in ``CASES`` fails with a message saying so."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import pytest
import torch

from models import METHODS
from models.base import DecodeSettings, DecodeState
from models.sampling import Sampling

TINY4 = {"name": "tiny_random", "device": "cpu", "dtype": "float32", "tiny_layers": 4}
#: each decoding iteration: how many of its drafted tokens the target accepts (None: all),
#: then how many tokens are committed one iteration at a time without drafting
SCHEDULE = [(0, 0), (None, 0), (1, 0), (0, 4), (None, 0), (0, 0), (2, 0)]
LATER = 3  # tokens after the draft in the training sequence


def fresh_target():
    """A 4-layer tiny target (EAGLE-3 fuses three distinct layers), loaded afresh (a Medusa-2
    draft puts its adapter into the target it is built for), with its own random LM head: with
    the tied one, heads that read the target's LM head repeat a token whatever the context."""
    from models.target import TargetConfig, load_target

    t = load_target(TargetConfig(**TINY4))
    w = t.model.lm_head.weight
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        t.model.lm_head.weight = torch.nn.Parameter(torch.randn(w.shape, generator=g) * 3.0)
    return t


@pytest.fixture(scope="module")
def target4():
    return fresh_target()


def lively(method, scale: float, seed: int = 0, sharpen: float = 3.0):
    """Every trainable parameter moved by N(0, scale^2): zero-initialised parts (Medusa's
    residual blocks, a LoRA adapter's B, Domino's correction, DSpark's Markov projection) come
    alive and no head merely copies the target's LM head. Then each attention's queries are
    scaled by ``sharpen``: a fresh layer's attention is nearly uniform, so which keys and
    positions a query reads would hardly change its output; a trained one's is peaked.
    Returns the method in eval mode."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in method.parameters():
            if p.requires_grad:
                p.add_(torch.randn(p.shape, generator=g) * scale)
        for m in method.modules():
            # Qwen3 layers norm their queries: the norm's scale then, else the projection's
            q = getattr(m, "q_norm", None) or getattr(m, "q_proj", None)
            if q is not None and getattr(q, "weight", None) is not None and q.weight.requires_grad:
                q.weight.mul_(sharpen)
    return method.eval()


def choose_vocab(method, size: int = 64) -> None:
    """A draft vocabulary (``d2t``/``t2d``) that is not the identity: the tokens of a fixed
    random count, so that draft ids and target ids differ and a comparison that forgot the
    mapping would fail. The token stream (ids 20..249) is mostly outside it, as real text is
    partly outside a reduced vocabulary."""
    from models.eagle import draft_vocab

    V = method.t2d.numel()
    counts = torch.randint(0, 1000, (V,), generator=torch.Generator().manual_seed(7))
    d2t, t2d = draft_vocab(counts, size)
    method.d2t.copy_(d2t)
    method.t2d.copy_(t2d)
    lm = getattr(method, "lm_head", None)
    if lm is not None:  # as init_from_data: the draft head starts from the target's rows
        with torch.no_grad():
            lm.weight.copy_(method.target.lm_head.weight[torch.arange(size) + d2t].float())


@dataclass
class Iteration:
    ids: list[int]  # the committed tokens when the proposer was asked (the last one pending)
    drafted: list[int]


def decode(method, target, settings=None, gamma: int = 3, seed: int = 1) -> list[Iteration]:
    """The proposer's greedy drafts over a decoding run that follows ``SCHEDULE``. The target's
    side is played by a random token stream: a rejected draft token is replaced by another
    token, as the target's own token replaces it."""
    g = torch.Generator().manual_seed(seed)

    def token(other: int | None = None) -> int:
        while True:
            x = int(torch.randint(20, 250, (), generator=g))
            if x != other:
                return x

    prop = method.proposer(settings)
    layers = tuple(prop.feature_layers)
    ids = [token(), token()]
    state = DecodeState(list(ids), None, Sampling(), None, target.device)

    def commit(new: list[int]) -> None:
        ids.extend(new)
        state.ids = list(ids)
        if layers:  # the target's features of every fed position (all but the pending token)
            t = torch.tensor([ids])
            state.features = target.features(t, torch.ones_like(t), layers)[0, :-1]

    commit([])
    prop.start(state)
    out = []
    for accept, skip in SCHEDULE:
        p = prop.propose(state, gamma)
        out.append(Iteration(list(ids), p.tokens))
        path = first_path(p)  # what the target accepts of a tree: one path down it
        a = len(path) if accept is None else min(accept, len(path))
        commit(path[:a] + [token(path[a] if a < len(path) else None)])
        prop.rollback(state, a)
        for _ in range(skip):
            commit([token()])
            prop.rollback(state, 0)
    return out


def first_path(p) -> list[int]:
    """The tokens down a proposal's first root-to-leaf path (a chain's tokens)."""
    out, node = [], -1
    while (node := next((i for i, par in enumerate(p.parents) if par == node), None)) is not None:
        out.append(p.tokens[node])
    return out


def training_batch(target, layers, it: Iteration, seed: int = 2) -> dict[str, torch.Tensor]:
    """Row 0: the iteration's committed tokens, its draft and ``LATER`` more tokens,
    right-padded beside a longer row 1, with the target's features of both (as a training
    batch holds them)."""
    g = torch.Generator().manual_seed(seed)
    row = it.ids + it.drafted + torch.randint(20, 250, (LATER,), generator=g).tolist()
    other = torch.randint(20, 250, (len(row) + 5,), generator=g).tolist()
    T = len(other)
    ids = torch.full((2, T), target.pad_token_id, dtype=torch.long)
    ids[0, : len(row)], ids[1] = torch.tensor(row), torch.tensor(other)
    attn = torch.zeros_like(ids)
    attn[0, : len(row)], attn[1] = 1, 1
    batch = {"input_ids": ids, "attention_mask": attn, "loss_mask": attn.clone()}
    if layers:
        batch["features"] = target.features(ids, attn, tuple(layers))
    return batch


def check(method, target, predict: Callable, settings=None, gamma: int = 3) -> list[Iteration]:
    """At every iteration, the draft is ``predict(method, batch, n, k)``: training's tokens
    for row 0 of ``training_batch``, whose first n tokens are the committed ones, for the k
    drafted positions after them. Returns the iterations."""
    its = decode(method, target, settings, gamma)
    tokens = [t for it in its for t in it.drafted]
    assert len(set(tokens)) > 3, f"a degenerate draft, nothing to compare: {tokens}"
    for i, it in enumerate(its):
        batch = training_batch(target, method.feature_layers, it)
        with torch.no_grad():
            want = predict(method, batch, len(it.ids), len(it.drafted))
        assert it.drafted == want, (
            f"iteration {i} (after {len(it.ids)} tokens): the proposer drafted {it.drafted}, "
            f"training predicts {want}"
        )
    return its


def in_target_ids(method, js: torch.Tensor) -> list[int]:
    """Draft-vocabulary ids (...) as target ids."""
    return (js + method.d2t[js]).tolist()


# ---------------------------------------------------------------------------------------------
# EAGLE family: the unrolled steps (training-time test) at start s = n - 2, the pair
# (f_{n-2}, x_{n-1}) of the pending token; step j predicts x_{s+j+1}


def eagle1_predict(head, batch, n, k):
    # EAGLE-1 trains on features with uniform noise, a regulariser of training only:
    # validation and decoding read the clean features, and so does the comparison
    f = batch["features"][:, :, 0]
    outs = head.unroll(f, batch["input_ids"], batch["attention_mask"], k)
    return [int(head.logits(o[0, n - 2]).argmax()) for o in outs]


def eagle3_predict(head, batch, n, k):
    # each step's argmax as the training loss computes it (``steps_loss``: fused with the
    # draft LM head, or HASS's per-step logits)
    f = batch["features"]
    outs = head.unroll(head.initial_hidden(f), batch["input_ids"], batch["attention_mask"], k)
    teacher = torch.full((1, head.lm_head.out_features), 1.0 / head.lm_head.out_features)
    rows = torch.zeros(1, dtype=torch.long)
    _, _, args = head.steps_loss(
        [o[0, n - 2][None] for o in outs], teacher, [rows] * k, [1.0] * k, {}
    )
    return in_target_ids(head, torch.cat(args))


def case_eagle1(target4):
    from models.eagle import Eagle1Config, EagleHead

    head = lively(EagleHead(target4, Eagle1Config()), 0.1)
    check(head, target4, eagle1_predict, DecodeSettings(tree="chain"))


def eagle3_configs(cls, **kw):
    """The reference layout, and the speculators / EAGLE 3.1 one (every norm option on)."""
    base = {"draft_vocab_size": 64, "fuse_layers": [1, 2, 3], "ttt_steps": 3, **kw}
    norms = ("norm_before_fc", "norm_before_residual", "norm_output", "fc_norm")
    return [cls(**base), cls(**base, **dict.fromkeys(norms, True))]


def check_eagle3(cls, cfg, target) -> None:
    head = cls(target, cfg)
    choose_vocab(head)
    check(lively(head, 0.2), target, eagle3_predict, DecodeSettings(tree="chain"), cfg.ttt_steps)


def case_eagle3(target4):
    from models.eagle import Eagle3Config, Eagle3Head

    for cfg in eagle3_configs(Eagle3Config):
        check_eagle3(Eagle3Head, cfg, target4)


def case_hass(target4):
    from models.hass import HassHead
    from models.hass.config import HassConfig

    for cfg in eagle3_configs(HassConfig, topk=4):
        check_eagle3(HassHead, cfg, target4)


def case_peagle(target4):
    """All K depths come from one decode forward; training runs them as the unroll's depths,
    each reading the mask inputs. Depth sampling thins only which rows the loss reads."""
    from models.peagle import PEagleConfig, PEagleHead

    cfg = PEagleConfig(draft_vocab_size=64, fuse_layers=[1, 2, 3], mask_token_id=5, ttt_steps=3)
    check_eagle3(PEagleHead, cfg, target4)


# ---------------------------------------------------------------------------------------------
# Medusa: head k on the state at t = n - 2 (where the target predicted the pending token)
# predicts x_{t+k+2}


def medusa_predict(heads, batch, n, k):
    h, _ = heads.hidden(batch, teacher=False)
    return [int(heads.head_logits(i, h[0, n - 2]).argmax()) for i in range(k)]


def check_medusa(heads, target) -> None:
    K = heads.cfg.num_heads
    check(heads, target, medusa_predict, DecodeSettings(tree="chain"), K)
    # the candidate tree's rank-0 path is the same chain
    tree = heads.proposer(DecodeSettings(tree="static")).tree
    chain = [tree.index((0,) * d) for d in range(1, K + 1) if (0,) * d in tree]
    assert chain, tree
    for it in decode(heads, target, DecodeSettings(tree="static"), K):
        batch = training_batch(target, heads.feature_layers, it)
        with torch.no_grad():
            want = medusa_predict(heads, batch, len(it.ids), len(chain))
        assert [it.drafted[i] for i in chain] == want, len(it.ids)


def case_medusa1(target4):
    from models.medusa import MedusaHeads
    from models.medusa.config import Medusa1Config

    check_medusa(
        lively(MedusaHeads(target4, Medusa1Config(num_heads=3, tree_nodes=6)), 0.1), target4
    )


def case_medusa2(target4):
    """The heads read the adapted backbone's state in training, the adapted verifier's features
    when decoding (the adapter goes into the target: a target of its own)."""
    from models.medusa import Medusa2Heads
    from models.medusa.config import Medusa2Config

    target = fresh_target()
    cfg = Medusa2Config(num_heads=3, tree_nodes=6, lora_r=4)
    check_medusa(lively(Medusa2Heads(target, cfg), 0.1), target)


# ---------------------------------------------------------------------------------------------
# DistillSpec: the student's next-token logits, position t predicting x_{t+1}


def distillspec_predict(student, batch, n, k):
    h = student.student_hidden(batch["input_ids"], batch["attention_mask"])
    return student.student_logits(h[0, n - 1 : n - 1 + k]).argmax(-1).tolist()


def case_distillspec(target4):
    from models.distillspec import DistillSpecStudent
    from models.distillspec.config import DistillSpecConfig

    student = lively(DistillSpecStudent(target4, DistillSpecConfig(num_layers=1)), 0.05)
    check(student, target4, distillspec_predict)


# ---------------------------------------------------------------------------------------------
# MLP speculator: stage i at t = n - 2 reads x_{t+i+1} and predicts x_{t+i+2}


def mlp_speculator_predict(m, batch, n, k):
    _, states = m._states(batch)
    return [int(m.stage_logits(i, states[i][0, n - 2]).argmax()) for i in range(k)]


def case_mlp_speculator(target4):
    from models.mlp_speculator import MLPSpeculator
    from models.mlp_speculator.config import MLPSpeculatorConfig

    m = lively(MLPSpeculator(target4, MLPSpeculatorConfig(n_predict=3)), 0.05)
    check(m, target4, mlp_speculator_predict)


# ---------------------------------------------------------------------------------------------
# Block drafters: the block anchored at the pending token's position n - 1, slot k predicting
# x_{n-1+k}; a sequential draft's slot k reads the block's tokens before it, as the training
# forward gives them (``prefix_states`` of the tokens at anchor .. anchor + k - 1)


def blocks_predict(d, batch, n, k):
    ids = batch["input_ids"]
    anchors = torch.tensor([[n - 1], [n - 1]])
    h = d.run_blocks(batch["features"], ids, batch["attention_mask"], anchors)[0, 0]
    st = d.prefix_states(ids[0, n - 1 : n - 1 + k])
    z = [d.slot_logits(h[j], None if st is None else st[j - 1], j) for j in range(1, k + 1)]
    return in_target_ids(d, torch.stack(z).argmax(-1))


def check_blocks(draft, target, sequential: str | None = None) -> None:
    """``sequential``: the part through which a slot reads the tokens before it, moved further
    than the rest, so that those tokens change the slots' argmax (else the backbone's logits
    decide alone, and a slot reading the wrong token would go unseen); checked: somewhere the
    draft is not the backbone's argmax alone."""
    choose_vocab(draft)
    lively(draft, 0.1)
    if sequential is not None:
        lively(getattr(draft, sequential), 3.0, seed=1)
    its = check(draft.eval(), target, blocks_predict, gamma=draft.cfg.block_size - 1)
    if sequential is not None:
        moved = 0
        for it in its:
            batch, n = training_batch(target, draft.feature_layers, it), len(it.ids)
            with torch.no_grad():
                h = draft.run_blocks(
                    batch["features"],
                    batch["input_ids"],
                    batch["attention_mask"],
                    torch.tensor([[n - 1], [n - 1]]),
                )
                alone = in_target_ids(draft, draft.draft_logits(h[0, 0, 1:]).argmax(-1))
            moved += sum(a != b for a, b in zip(alone, it.drafted, strict=True))
        assert moved, "the tokens before a slot never change its argmax: nothing compared"


def block_config(cls, **kw):
    return cls(
        draft_vocab_size=64, mask_token_id=5, block_size=4, num_layers=1, fuse_layers=[1, 3], **kw
    )


def case_dflash(target4):
    from models.dflash import DFlashDraft
    from models.dflash.config import DFlashConfig

    check_blocks(DFlashDraft(target4, block_config(DFlashConfig)), target4)


def case_domino(target4):
    from models.dflash import DominoDraft
    from models.dflash.config import DominoConfig

    cfg = block_config(DominoConfig, gru_hidden=16, correction_dim=8)
    check_blocks(DominoDraft(target4, cfg), target4, "correction")


def case_dspark(target4):
    from models.dspark import DSparkDraft
    from models.dspark.config import DSparkConfig

    cfg = block_config(DSparkConfig, markov_rank=8)
    check_blocks(DSparkDraft(target4, cfg), target4, "markov_head")


# ---------------------------------------------------------------------------------------------
# Falcon: forward 1 is pass 1's block ending at e = n - 2 (the last committed input), forward
# 2 is pass 2's next block, which reads forward 1's predictions


def falcon_predict(head, batch, n, k):
    # pass 1's feature noise and pass 2's glancing (data revealed in place of predictions)
    # are training's curriculum, off in validation and in decoding: off here too
    f, ids = batch["features"][:, :, 0], batch["input_ids"]
    e, c = n - 2, head.cfg.k
    if e < c - 1:
        # no block of k committed positions ends at e: the slot that would predict x_n lies
        # before position 0, so training predicts nothing there (and validation scores no
        # such start): the proposer has nothing trained to draft
        return []
    o1, o2, _ = head.passes(f, ids, batch["attention_mask"], (e + 1) % c, 0.0, 0.0)
    both = torch.cat([o1[0, e - c + 1 : e + 1], o2[0, e + 1 : e + c + 1]])
    return head.argmax(both).tolist()[:k]


def case_falcon(target4):
    from models.falcon import FalconConfig, FalconHead

    head = lively(FalconHead(target4, FalconConfig(k=2)), 0.3)
    check(head, target4, falcon_predict, gamma=4)


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


@pytest.mark.parametrize("name", sorted(METHODS))
def test_the_proposer_drafts_what_training_predicts(name, target4):
    """The decode-time proposer's greedy draft, iteration after iteration, is the argmax of the
    training-time prediction for each drafted position (see the module docstring)."""
    assert name in CASES, (
        f"method {name!r} is registered but has no case in the train/serve agreement test "
        "(tests/test_train_serve_agreement.py)"
    )
    torch.manual_seed(0)  # the heads' initial weights
    CASES[name](target4)


def test_a_soft_capped_student_distils_the_distribution_it_drafts_from():
    """DistillSpec's divergence and its ``accept_T1`` metric read the student's distribution
    as training computes it; decoding samples from the student's own forward, which
    soft-caps its logits (Gemma-2's ``final_logit_softcapping``). The argmax is the same
    either way (the cap is monotone), so the contract test above cannot see a difference:
    here the q the proposer hands the verifier at T = 1 is the softmax of training's logits,
    with logits well past the cap, as a trained Gemma's are."""
    from conftest import family_target

    from models.distillspec import DistillSpecStudent
    from models.distillspec.config import DistillSpecConfig

    target = family_target("gemma2")
    torch.manual_seed(0)
    student = DistillSpecStudent(target, DistillSpecConfig(num_layers=1)).eval()
    cap = student._lm().config.final_logit_softcapping
    with torch.no_grad():
        student._lm().get_output_embeddings().weight.mul_(200.0)
    ids = torch.randint(3, 200, (1, 12), generator=torch.Generator().manual_seed(0))
    state = DecodeState(ids[0].tolist(), None, Sampling(1.0), torch.Generator(), ids.device)
    prop = student.proposer()
    prop.start(state)
    q = prop.propose(state, 2).q
    with torch.no_grad():
        z = student.student_logits(student.student_hidden(ids, torch.ones_like(ids))[0, -1])
    assert z.abs().max() > 0.9 * cap  # the cap is reached: an uncapped z would be far past it
    torch.testing.assert_close(q[0], z.softmax(-1), atol=1e-5, rtol=1e-4)
