"""Property tests of the pure loss functions and the draft-position masks."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from models.eagle import feature_regression_loss, position_mask
from models.losses import (
    HEAD_LOSSES,
    acceptance_probs,
    dpace_weights,
    hard_label_loss,
    head_loss,
    linear_soft_cross_entropy,
    soft_cross_entropy,
    soft_cross_entropy_probs,
    top_k_distillation,
    total_variation_probs,
)

logit_rows = st.integers(1, 6).flatmap(
    lambda n: st.integers(2, 12).flatmap(
        lambda v: st.lists(st.floats(-8, 8), min_size=n * v, max_size=n * v).map(
            lambda xs: torch.tensor(xs, dtype=torch.float64).reshape(n, v)
        )
    )
)


@settings(max_examples=60, deadline=None)
@given(logit_rows, st.floats(-5, 5))
def test_soft_ce_equals_entropy_at_q_equals_p_and_is_shift_invariant(t, shift):
    p = t.softmax(-1)
    entropy = -(p * p.clamp_min(1e-300).log()).sum(-1).mean()
    assert torch.allclose(soft_cross_entropy(t, t).double(), entropy, atol=1e-5)
    assert torch.allclose(soft_cross_entropy(t + shift, t), soft_cross_entropy(t, t), atol=1e-5)


@settings(max_examples=60, deadline=None)
@given(logit_rows, st.data())
def test_soft_ce_is_minimised_at_the_teacher(t, data):
    noise = torch.tensor(
        data.draw(st.lists(st.floats(-3, 3), min_size=t.numel(), max_size=t.numel())), dtype=t.dtype
    ).reshape(t.shape)
    assert soft_cross_entropy(t + noise, t) >= soft_cross_entropy(t, t) - 1e-5
    s = t.clone().float().requires_grad_(True)
    soft_cross_entropy(s, t).backward()
    assert s.grad.abs().max() < 1e-5  # stationary point at q = p


@settings(max_examples=60, deadline=None)
@given(logit_rows, st.data())
def test_soft_ce_from_probabilities_equals_soft_ce_from_logits(t, data):
    """The fused form (teacher as probabilities) is the same loss, with the same gradient."""
    noise = torch.tensor(
        data.draw(st.lists(st.floats(-3, 3), min_size=t.numel(), max_size=t.numel())), dtype=t.dtype
    ).reshape(t.shape)
    a = (t + noise).float().requires_grad_(True)
    b = (t + noise).float().requires_grad_(True)
    la, lb = soft_cross_entropy(a, t), soft_cross_entropy_probs(b, t.softmax(-1))
    assert torch.allclose(la, lb, atol=1e-5)
    la.backward()
    lb.backward()
    assert torch.allclose(a.grad, b.grad, atol=1e-6)


@settings(max_examples=40, deadline=None)
@given(
    st.integers(1, 9),  # rows
    st.integers(2, 11),  # vocabulary
    st.integers(1, 5),  # chunk
    st.integers(0, 2**16),
    st.booleans(),  # row weights or the default mean
)
def test_linear_soft_ce_equals_the_unfused_loss_and_gradients(n, v, chunk, seed, weighted):
    """The fused LM head + soft CE is the head's product followed by the per-row soft CE
    against the gathered teacher rows: same weighted loss, per-row losses, argmax, and
    gradients for h and the weight, whatever the chunking."""
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(n, 4, generator=g, dtype=torch.float64)
    w = torch.randn(v, 4, generator=g, dtype=torch.float64)
    probs = torch.randn(n + 2, v, generator=g, dtype=torch.float64).softmax(-1)
    rows = torch.randint(0, n + 2, (n,), generator=g)
    r = torch.rand(n, generator=g, dtype=torch.float64) if weighted else torch.full((n,), 1 / n)
    h1, w1 = h.clone().requires_grad_(), w.clone().requires_grad_()
    loss, per_row, arg = linear_soft_cross_entropy(
        h1, w1, probs, rows, r if weighted else None, chunk
    )
    (3.0 * loss).backward()  # a scale other than 1 exercises backward's multiply
    h2, w2 = h.clone().requires_grad_(), w.clone().requires_grad_()
    z = h2 @ w2.T
    ref_rows = -(probs[rows] * z.log_softmax(-1)).sum(-1)
    ref = (ref_rows * r.to(ref_rows)).sum()
    (3.0 * ref).backward()
    # the fused function keeps float32 losses (as the loss it replaces): float32 tolerances
    assert torch.allclose(loss.double(), ref, rtol=1e-5, atol=1e-5)
    assert torch.allclose(per_row.double(), ref_rows.detach(), rtol=1e-5, atol=1e-5)
    assert torch.equal(arg, z.detach().argmax(-1))
    assert torch.allclose(h1.grad, h2.grad, rtol=1e-4, atol=1e-5)
    assert torch.allclose(w1.grad, w2.grad, rtol=1e-4, atol=1e-5)
    if not weighted:  # the default weights make it the mean: soft_cross_entropy_probs
        assert torch.allclose(loss.double(), soft_cross_entropy_probs(z, probs[rows]).double())
    # a frozen head: the gradient reaches h alone, the same as before
    h3 = h.clone().requires_grad_()
    loss, _, _ = linear_soft_cross_entropy(h3, w, probs, rows, r if weighted else None, chunk)
    (3.0 * loss).backward()
    assert torch.allclose(h3.grad, h2.grad, rtol=1e-4, atol=1e-5) and w.grad is None


def test_linear_soft_ce_under_autocast_runs_in_bf16_like_the_linear_it_replaces():
    """Under CPU autocast the fused function takes the bf16 path F.linear would: loss and
    gradients agree with autocast's own linear + cross-entropy to bf16 precision, the weight's
    gradient keeps the weight's dtype, and no row is lost to chunking."""
    g = torch.Generator().manual_seed(0)
    h = torch.randn(37, 16, generator=g)
    w = torch.randn(50, 16, generator=g) * 0.3
    probs = torch.randn(40, 50, generator=g).softmax(-1)
    rows = torch.randint(0, 40, (37,), generator=g)
    h1, w1 = h.clone().requires_grad_(), w.clone().requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss, per_row, arg = linear_soft_cross_entropy(h1, w1, probs, rows, chunk=8)
    loss.backward()
    h2, w2 = h.clone().requires_grad_(), w.clone().requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        z = torch.nn.functional.linear(h2, w2)
    ref = soft_cross_entropy_probs(z, probs[rows])
    ref.backward()
    assert per_row.shape == (37,) and arg.shape == (37,)
    assert w1.grad.dtype == torch.float32 and h1.grad.dtype == torch.float32
    assert abs(loss.item() - ref.item()) < 1e-2
    assert torch.allclose(h1.grad, h2.grad, atol=2e-3)
    assert torch.allclose(w1.grad, w2.grad, atol=2e-3)


def test_linear_soft_ce_gradients_survive_float16_loss_scaling():
    """With float16 states the gradients are computed before a GradScaler's scale reaches
    them: rows weighted ~1e-6 must not underflow to zero before the scale brings them back."""
    g = torch.Generator().manual_seed(1)
    h = torch.randn(16, 8, generator=g)
    w = torch.randn(30, 8, generator=g)
    probs = torch.randn(16, 30, generator=g).softmax(-1)
    rows = torch.arange(16)
    r = torch.full((16,), 1e-6)
    h1, w1 = h.half().requires_grad_(), w.clone().requires_grad_()
    loss, _, _ = linear_soft_cross_entropy(h1, w1, probs, rows, r)
    (loss * 2.0**16).backward()
    h2, w2 = h.half().float().requires_grad_(), w.clone().requires_grad_()
    ref = (-(probs * (h2 @ w2.T).log_softmax(-1)).sum(-1) * r).sum()
    (ref * 2.0**16).backward()
    assert h1.grad.dtype == torch.float16 and w1.grad.dtype == torch.float32
    assert torch.allclose(h1.grad.float(), h2.grad, rtol=2e-2, atol=1e-4)
    assert torch.allclose(w1.grad, w2.grad, rtol=2e-2, atol=1e-3)


def test_soft_ce_matches_hard_ce_for_one_hot_teacher():
    student = torch.randn(5, 9)
    labels = torch.randint(0, 9, (5,))
    teacher = torch.full((5, 9), -1e4).scatter(1, labels[:, None], 0.0)
    assert torch.allclose(
        soft_cross_entropy(student, teacher),
        torch.nn.functional.cross_entropy(student, labels),
        atol=1e-5,
    )


@settings(max_examples=60, deadline=None)
@given(logit_rows, st.data())
def test_tvd_is_one_minus_the_acceptance_rate_and_zero_only_at_the_teacher(t, data):
    """method.loss=tvd: 0.5 sum |p - q| = 1 - sum min(p, q) (speculative sampling's rejection
    probability at T = 1), in [0, 1], symmetric, 0 at q = p and positive elsewhere."""
    noise = torch.tensor(
        data.draw(st.lists(st.floats(-3, 3), min_size=t.numel(), max_size=t.numel())), dtype=t.dtype
    ).reshape(t.shape)
    s = t + noise
    p, q = t.softmax(-1), s.softmax(-1)
    tvd = total_variation_probs(s, p)
    assert torch.allclose(tvd.double(), 1 - torch.minimum(p, q).sum(-1).mean(), atol=1e-5)
    assert -1e-6 <= tvd <= 1 + 1e-6
    assert torch.allclose(tvd, total_variation_probs(t, q), atol=1e-5)
    assert total_variation_probs(t, p) < 1e-5
    if (p - q).abs().max() > 1e-3:
        assert tvd > 0


@settings(max_examples=60, deadline=None)
@given(logit_rows, st.data())
def test_top_k_distillation_is_soft_ce_on_the_teachers_top_k(t, data):
    """HASS's objective: all of soft CE at k = V, non-negative, growing with k, and blind to
    the teacher's mass outside its top k."""
    V = t.shape[-1]
    noise = torch.tensor(
        data.draw(st.lists(st.floats(-3, 3), min_size=t.numel(), max_size=t.numel())), dtype=t.dtype
    ).reshape(t.shape)
    s, p = (t + noise).float(), t.float().softmax(-1)
    full = soft_cross_entropy_probs(s, p)
    assert torch.allclose(top_k_distillation(s, p, V), full, atol=1e-5)
    assert torch.allclose(top_k_distillation(s, p, V + 7), full, atol=1e-5)
    k = data.draw(st.integers(1, V))
    part = top_k_distillation(s, p, k)
    assert 0 <= part <= full + 1e-5
    if k < V:
        assert part <= top_k_distillation(s, p, k + 1) + 1e-6
        # moving teacher mass among tokens outside the top k changes nothing
        idx = p.topk(k, dim=-1).indices
        inside = torch.zeros_like(p, dtype=torch.bool).scatter_(-1, idx, True)
        q = torch.where(
            inside, p, p.flip(-1) * 0 + p.masked_fill(inside, 0).sum(-1, keepdim=True) / (V - k)
        )
        assert torch.allclose(top_k_distillation(s, q, k), part, atol=1e-5) or not torch.equal(
            q.topk(k, dim=-1).indices.sort(-1).values, idx.sort(-1).values
        )


def test_hard_label_loss_is_head_loss_against_one_hot_rows():
    s, labels = torch.randn(5, 9), torch.randint(0, 9, (5,))
    one_hot = torch.zeros(5, 9).scatter(1, labels[:, None], 1.0)
    for kind in HEAD_LOSSES:
        assert torch.allclose(
            hard_label_loss(kind, s, labels), head_loss(kind, s, one_hot), atol=1e-5
        ), kind
    with pytest.raises(ValueError, match="method.loss='kl'"):
        hard_label_loss("kl", s, labels)


def test_head_loss_selects_and_names_a_bad_choice():
    s, t = torch.randn(4, 7), torch.randn(4, 7)
    p = t.softmax(-1)
    assert torch.equal(head_loss("ce", s, p), soft_cross_entropy_probs(s, p))
    assert torch.equal(head_loss("tvd", s, p), total_variation_probs(s, p))
    with pytest.raises(ValueError, match="method.loss='kl'"):
        head_loss("kl", s, p)


@settings(max_examples=40, deadline=None)
@given(logit_rows)
def test_feature_regression_zero_iff_equal_and_symmetric(x):
    y = x.flip(0)
    assert feature_regression_loss(x, x) == 0
    assert torch.allclose(feature_regression_loss(x, y), feature_regression_loss(y, x))
    # > 0 wherever the loss's terms are representable: it computes in float32, where half
    # the mean squared difference underflows to 0 for tiny features (1.4e-25 in a float64 x)
    d = x.float() - y.float()
    if (0.5 * d.square()).mean() > 0:
        assert feature_regression_loss(x, y) > 0


def test_feature_regression_empty_has_graph():
    x = torch.zeros(0, 4, requires_grad=True)
    loss = feature_regression_loss(x, torch.zeros(0, 4))
    loss.backward()
    assert loss.item() == 0.0


def test_position_mask_requires_every_read_and_predicted_token_be_assistant():
    # tokens:   0  1  2  3  4  5  (position 5 is padding)
    lm = torch.tensor([[0, 1, 1, 1, 1, 1]])
    attn = torch.tensor([[1, 1, 1, 1, 1, 0]])
    m1, m2 = position_mask(lm, attn, steps=2)
    # step 1 at start s reads x_{s+1}, predicts x_{s+2}: valid for s = 0, 1, 2 (x_5 is padding)
    assert m1.tolist() == [[True, True, True, False, False]]
    # step 2 at start s reads x_{s+1..s+2}, predicts x_{s+3}: s = 0, 1
    assert m2.tolist() == [[True, True, False, False, False]]


@settings(max_examples=60, deadline=None)
@given(logit_rows, st.data())
def test_lk_losses_are_zero_or_smallest_at_q_equals_p_and_weights_average_rows(t, data):
    p = t.softmax(-1)
    s = t + torch.tensor(
        data.draw(st.lists(st.floats(-3, 3), min_size=t.shape[1], max_size=t.shape[1])),
        dtype=t.dtype,
    )
    a = acceptance_probs(s, p)
    assert ((a >= -1e-6) & (a <= 1 + 1e-6)).all()
    # LK-alpha: -mean log a, zero exactly where the draft is the target
    assert torch.allclose(head_loss("lk_alpha", s, p), -a.clamp_min(1e-30).log().mean(), atol=1e-5)
    assert head_loss("lk_alpha", t, p) < 1e-5
    assert head_loss("lk_alpha", s, p) >= -1e-6
    # LK-lambda lies between its two terms, with the weight exp(-mean a)
    ce, tv = head_loss("ce", s, p), 1 - a.mean()
    lam = head_loss("lk_lambda", s, p)
    w = torch.exp(-a.mean())
    assert torch.allclose(lam, w * ce + (1 - w) * tv, atol=1e-5)
    assert min(ce, tv) - 1e-5 <= lam <= max(ce, tv) + 1e-5
    # uniform weights are the plain mean, for every loss
    n = t.shape[0]
    for kind in HEAD_LOSSES:
        assert torch.allclose(
            head_loss(kind, s, p, torch.full((n,), 1.0 / n)), head_loss(kind, s, p), atol=1e-5
        ), kind


def test_lk_alpha_pushes_hardest_on_the_row_that_accepts_least():
    p = torch.tensor([[0.9, 0.1], [0.9, 0.1]])
    s = torch.tensor([[2.0, 0.0], [-2.0, 0.0]], requires_grad=True)  # row 2 accepts less
    head_loss("lk_alpha", s, p).backward()
    g = s.grad.abs().sum(-1)
    assert g[1] > g[0]


accept_blocks = st.integers(1, 4).flatmap(
    lambda n: st.integers(1, 7).flatmap(
        lambda k: st.tuples(
            st.lists(st.floats(0, 1), min_size=n * k, max_size=n * k),
            st.lists(st.booleans(), min_size=n * k, max_size=n * k),
        ).map(
            lambda xs: (
                torch.tensor(xs[0], dtype=torch.float64).reshape(n, k),
                torch.tensor(xs[1]).reshape(n, k),
            )
        )
    )
)


@settings(max_examples=80, deadline=None)
@given(accept_blocks, st.floats(0, 1))
def test_dpace_weights_are_the_acceptance_length_still_to_earn(blocks, alpha):
    a, valid = blocks
    w = dpace_weights(a, valid, alpha)
    assert not w.requires_grad
    assert (w[~valid] == 0).all()
    # non-increasing along the block over its labelled positions: a later position can only
    # earn what the earlier ones let through
    for r in range(a.shape[0]):
        ws = w[r][valid[r]]
        assert (ws[1:] <= ws[:-1] + 1e-9).all()
    # alpha = 1: every labelled position counts fully, w_k = labelled positions from k on
    ones = dpace_weights(a, valid, 1.0)
    count = valid.double().flip(-1).cumsum(-1).flip(-1) * valid
    assert torch.allclose(ones, count)
    # alpha = 0: the derivatives of the expected accepted length sum_j prod_{i<=j} a_i
    # (unlabelled positions pass through) with respect to each log a_k
    la = a.clamp_min(1e-6).log().requires_grad_(True)
    s = torch.where(valid, la.exp(), torch.ones_like(la))
    (s.cumprod(-1) * valid).sum().backward()
    assert torch.allclose(dpace_weights(a.clamp_min(1e-6), valid, 0.0), la.grad * valid, atol=1e-9)


def test_dpace_refuses_a_smoothing_outside_0_1():
    with pytest.raises(ValueError, match="alpha=1.5"):
        dpace_weights(torch.ones(1, 2), torch.ones(1, 2, dtype=torch.bool), 1.5)


# ------------------------------------------------------ what a chain would accept (served_chain)


def _decode_by_hand(agree, valid, g):
    """A decoder's walk over one reply, written apart from ``served_chain``: the replies are
    the runs of scored starts; each iteration tests drafts until the first miss (or g, or the
    reply's end), emits the accepted ones and one more token, and starts again past them."""
    runs, cur = [], []
    for s, ok in enumerate(valid[0]):
        if ok:
            cur.append(s)
        elif cur:
            runs.append(cur)
            cur = []
    if cur:
        runs.append(cur)
    it = tok = tested = acc = 0
    for run in runs:
        s = run[0]
        while s <= run[-1]:
            n = 0
            for j in range(g):
                if not valid[j][s]:
                    break
                tested += 1
                if not agree[j][s]:
                    break
                n += 1
            it, tok, acc = it + 1, tok + n + 1, acc + n
            s += n + 1
    return it, tok, tested, acc


@settings(max_examples=200, deadline=None)
@given(
    st.integers(1, 4),
    st.lists(st.tuples(st.booleans(), st.booleans(), st.booleans(), st.booleans()), max_size=40),
    st.lists(st.booleans(), min_size=40, max_size=40),
)
def test_served_chain_walks_the_replies_as_a_decoder_does(g, cells, scored):
    from models.base import served_chain

    S = len(cells)
    valid1 = [scored[s] for s in range(S)]
    # position j is scored where position 1 is and the reply goes on for j more tokens
    valid = [[all(valid1[s : s + j + 1]) and s + j < S for s in range(S)] for j in range(4)]
    agree = [[cells[s][j] and valid[j][s] for s in range(S)] for j in range(4)]
    out = served_chain(
        [torch.tensor([a]) for a in agree], [torch.tensor([v]) for v in valid], gamma=g
    )
    it, tok, tested, acc = _decode_by_hand(agree, valid, min(g, 4))
    assert out[f"chain{g}_tau"].tolist() == [float(tok), float(it)]
    assert out[f"chain{g}_alpha"].tolist() == [float(acc), float(tested)]


def test_served_chain_at_the_extremes():
    from models.base import served_chain

    S, g = 40, 3
    valid = [torch.tensor([[s + j < S for s in range(S)]]) for j in range(g)]
    every = served_chain([v.clone() for v in valid], valid, g)
    none = served_chain([torch.zeros_like(v) for v in valid], valid, g)
    # all agree: g accepted an iteration (the reply's last starts fewer), tau ~ g + 1
    t, n = every["chain3_tau"].tolist()
    assert n == 10 and t == 40 and every["chain3_alpha"][0] == every["chain3_alpha"][1]
    # none: one token an iteration, every start visited, nothing accepted
    assert none["chain3_tau"].tolist() == [40.0, 40.0] and none["chain3_alpha"][0] == 0
