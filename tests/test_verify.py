"""Exactness of speculative verification as pure functions: the output distribution equals the
(warped) target distribution for chains and trees, and the test notices a wrong residual."""

from __future__ import annotations

import itertools

import pytest
import torch
from conftest import TEST_DEVICE
from scipy.stats import chisquare

import decoding.verify as verify
from models.sampling import Sampling, greedy_tokens, sample, warp

#: the device of the batch-at-once acceptance's tests (``on_the_device``): cuda in
#: scripts/gpu_check.sh, else the CPU
DEV = TEST_DEVICE

V = 6
ALPHA_TEST = 1e-3  # false-alarm rate of each chi-square test (seeds are fixed: deterministic)


def _tables(seed: int):
    g = torch.Generator().manual_seed(seed)
    p1 = torch.randn(V, generator=g) * 1.5  # target logits for token 1
    p2 = torch.randn(V, V, generator=g) * 1.5  # target logits for token 2 given token 1
    q1 = torch.randn(V, generator=g) * 1.5  # draft logits
    q2 = torch.randn(V, V, generator=g) * 1.5
    return p1, p2, q1, q2


def _simulate(n: int, s: Sampling, seed: int, width: int = 1) -> torch.Tensor:
    """Counts (V, V) of the first two emitted tokens over ``n`` speculative runs with a depth-2
    draft; ``width`` > 1 drafts that many i.i.d. candidates at the root (a tree)."""
    p1, p2, q1, q2 = _tables(0)
    P1, P2, Q1, Q2 = warp(p1, s), warp(p2, s), warp(q1, s), warp(q2, s)
    g = torch.Generator().manual_seed(seed)
    counts = torch.zeros(V, V)
    for _ in range(n):
        roots = [int(torch.multinomial(Q1, 1, generator=g)) for _ in range(width)]
        tokens, parents, q = [], [], []
        for r in roots:  # each root candidate gets one child drawn from q2(.|r)
            tokens += [r, int(torch.multinomial(Q2[r], 1, generator=g))]
            parents += [-1, len(tokens) - 2]
            q += [Q1, Q2[r]]
        # target distributions: after root, then after each node
        rows = [P1]
        for i, t in enumerate(tokens):
            # after a depth-1 node: token 2's distribution; after depth 2: token 3's (not
            # examined here, any distribution will do)
            rows.append(P2[t] if parents[i] == -1 else P1)
        v = verify.verify_sampled(tokens, parents, torch.stack(rows), torch.stack(q), g)
        emitted = [tokens[i] for i in v.path] + [v.token]
        if len(emitted) < 2:  # rejected at depth 1: the second token comes from p2(.|x1)
            emitted.append(int(torch.multinomial(P2[emitted[0]], 1, generator=g)))
        counts[emitted[0], emitted[1]] += 1
    return counts


def _expected(s: Sampling) -> torch.Tensor:
    p1, p2, _, _ = _tables(0)
    return warp(p1, s)[:, None] * warp(p2, s)


def _pvalue(counts: torch.Tensor, probs: torch.Tensor) -> float:
    n = counts.sum()
    exp = (probs * n).flatten()
    obs = counts.flatten()
    keep = exp >= 5  # merge sparse cells into one, as chi-square needs
    o = torch.cat([obs[keep], obs[~keep].sum()[None]])
    e = torch.cat([exp[keep], exp[~keep].sum()[None]])
    if e[-1] == 0:
        o, e = o[:-1], e[:-1]
    assert (o[e == 0] == 0).all(), "tokens outside the target's support were emitted"
    return float(chisquare(o[e > 0].numpy(), e[e > 0].numpy()).pvalue)


SETTINGS = [Sampling(1.0), Sampling(0.7, top_k=4), Sampling(1.0, top_p=0.8)]


@pytest.mark.parametrize("s", SETTINGS, ids=["T1", "T0.7-topk4", "T1-topp0.8"])
def test_chain_output_follows_target(s):
    counts = _simulate(6000, s, seed=1)
    assert _pvalue(counts, _expected(s)) > ALPHA_TEST


def test_tree_with_two_root_candidates_follows_target():
    counts = _simulate(6000, Sampling(1.0), seed=2, width=2)
    assert _pvalue(counts, _expected(Sampling(1.0))) > ALPHA_TEST


def test_test_detects_plain_p_instead_of_residual(monkeypatch):
    monkeypatch.setattr(verify, "residual", lambda p, q: p)
    counts = _simulate(6000, Sampling(1.0), seed=1)
    assert _pvalue(counts, _expected(Sampling(1.0))) < ALPHA_TEST


def test_greedy_verification_follows_argmax_through_a_tree():
    # root children: 5 (wrong), 3 (right); node 3's children: 1 (right)
    tokens, parents = [5, 3, 1, 2], [-1, -1, 1, 0]
    argmax = [3, 0, 1, 4, 0]  # after root: 3; after node1 (tok 3): 1; after node2 (tok 1): 4
    v = verify.verify_greedy(tokens, parents, argmax)
    assert v.path == [1, 2] and v.token == 4


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_greedy_tokens_is_argmax_with_its_ties(dtype):
    """The decoder's argmax reads reduced-precision logits as float32 (faster on a CPU): the
    same token as argmax in the logits' own dtype, ties included (lowest id)."""
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(64, 4096, generator=g) * 4).to(dtype)
    x[:8, 100] = x[:8, 200] = x[:8].max() + 1  # planted ties: both ids hold the row's maximum
    x[8:16] = 0  # all-equal rows
    got = greedy_tokens(x)
    assert got.tolist() == x.argmax(-1).tolist()
    assert got[:8].tolist() == [100] * 8 and got[8:16].tolist() == [0] * 8
    assert greedy_tokens(x[3]).item() == 100  # one row


def test_warp_top_k_and_top_p():
    logits = torch.tensor([3.0, 2.0, 1.0, 0.0])
    p = warp(logits, Sampling(1.0, top_k=2))
    assert (p[2:] == 0).all() and torch.isclose(p.sum(), torch.tensor(1.0))
    full = logits.softmax(-1)
    p = warp(logits, Sampling(1.0, top_p=float(full[0]) + 1e-3))  # needs the top two
    assert (p[:2] > 0).all() and (p[2:] == 0).all()
    for k, t in itertools.product([0, 3], [0.5, 2.0]):
        assert torch.isclose(warp(logits, Sampling(t, top_k=k)).sum(), torch.tensor(1.0))


@pytest.mark.parametrize("scale", [1.0, 7.5])  # normalised weights, and weights that are not
def test_sample_draws_the_given_distribution_and_never_a_zero_weight(scale):
    """``sample`` (the inverse CDF that replaced torch.multinomial) draws p: chi-square over
    the tokens of positive weight, and never a token of weight 0 (at either end or between)."""
    g = torch.Generator().manual_seed(0)
    p = torch.randn(40, generator=g).softmax(-1)
    p[[0, 7, 8, 39]] = 0.0
    p = p / p.sum() * scale
    n = 20_000
    counts = torch.bincount(torch.tensor([sample(p, g) for _ in range(n)]), minlength=40)
    assert counts[p == 0].sum() == 0
    pos = p > 0
    w = p[pos].double()
    expected = w / w.sum() * n
    assert chisquare(counts[pos].double(), expected).pvalue > ALPHA_TEST


def test_the_sampler_test_notices_an_off_by_one_draw():
    """The test above can fail: a sampler that reads u as 1 - u for a skewed p would pass the
    zero-weight check, but not the chi-square (here checked against an off-by-one draw)."""
    g = torch.Generator().manual_seed(1)
    p = torch.tensor([0.7, 0.2, 0.1])
    n = 20_000
    draws = torch.tensor([sample(p, g) for _ in range(n)])
    shifted = (draws + 1) % 3  # what an off-by-one search would return
    want = p.double() / p.double().sum() * n
    ok = chisquare(torch.bincount(draws, minlength=3).double(), want).pvalue
    bad = chisquare(torch.bincount(shifted, minlength=3).double(), want).pvalue
    assert ok > ALPHA_TEST and bad < ALPHA_TEST


@pytest.mark.parametrize(
    "p", [[0.0, 0.0, 0.0], [float("nan"), 1.0, 0.0], [1.0, float("inf")]], ids=str
)
def test_sample_refuses_a_distribution_with_no_usable_mass(p):
    with pytest.raises(ValueError, match="total weight"):
        sample(torch.tensor(p), torch.Generator().manual_seed(0))


@pytest.mark.parametrize("u, want", [(1.0, 1), (0.0, 1)])
def test_sample_at_either_end_of_the_unit_interval_draws_a_token_of_weight(monkeypatch, u, want):
    """u * total may round up to the total itself: the draw is then the last token of positive
    weight, not an index past the end; and u = 0 draws the first token of positive weight, not
    a token of weight 0 before it."""
    p = torch.tensor([0.0, 0.25, 0.75, 0.0]) if u == 0.0 else torch.tensor([0.25, 0.75, 0.0, 0.0])
    monkeypatch.setattr(torch, "rand", lambda *a, **k: torch.tensor(u, dtype=torch.float64))
    assert sample(p, None) == want


def test_inverse_cdf_is_sample_for_every_row_at_its_own_uniform(monkeypatch):
    """The device's draw (no read): each row at its u is what ``sample`` draws at that u,
    including u = 0 over leading zero weights and u * total rounding up to the total over
    trailing ones (the last token of positive weight, not an index past the end)."""
    from models.sampling import inverse_cdf

    g = torch.Generator().manual_seed(4)
    p = torch.randn(64, 40, generator=g).softmax(-1)
    p[:, [0, 1, 7, 38, 39]] = 0.0
    p[5] = 0.0
    p[5, 9] = 2.5  # one token of weight, unnormalised
    u = torch.rand(64, generator=g, dtype=torch.float64)
    u[0], u[1] = 0.0, 1.0 - 2**-60  # rounds up to the total
    got = inverse_cdf(p, u).tolist()
    assert got[0] == 2 and got[1] == 37 and got[5] == 9
    for row, ur, want in zip(p, u, got, strict=True):  # sample's draw at this row's u
        monkeypatch.setattr(torch, "rand", lambda *a, _u=ur, **k: _u.clone())
        assert sample(row, None) == want


def test_a_token_the_draft_could_not_have_drawn_is_never_emitted_where_p_is_zero():
    """q(x) = 0 for a drafted x is an inconsistent proposal (no proposer makes one); it must not
    be accepted with probability 1, least of all where the target gives x probability 0."""
    p = torch.tensor([[0.0, 0.5, 0.5], [1 / 3, 1 / 3, 1 / 3]])
    q = torch.tensor([[0.0, 1.0, 0.0]])
    g = torch.Generator().manual_seed(0)
    emitted = [verify.verify_sampled([0], [-1], p, q, g) for _ in range(2000)]
    assert all(v.path == [] and v.token != 0 for v in emitted)


# -- lenience (lossy, measured) -----------------------------------------------------------------


def _one_step_lenient(n: int, lenience: float, seed: int) -> tuple[torch.Tensor, int]:
    """Counts of the first emitted token over ``n`` one-token lenient chains, and how many of
    the drafted tokens were accepted."""
    p1, _, q1, _ = _tables(0)
    P, Q = warp(p1, Sampling(1.0)), warp(q1, Sampling(1.0))
    g = torch.Generator().manual_seed(seed)
    counts, acc = torch.zeros(V), 0
    rows = torch.stack([P, P])  # after the root; after the drafted token (bonus, unused here)
    for _ in range(n):
        x = int(torch.multinomial(Q, 1, generator=g))
        v = verify.verify_sampled([x], [-1], rows, Q[None], g, lenience=lenience)
        acc += len(v.path)
        counts[x if v.path else v.token] += 1
    return counts, acc


@pytest.mark.parametrize("lenience", [1.0, 0.5])
def test_lenient_step_emits_the_stated_distribution(lenience):
    """A drafted x ~ q is accepted with probability min(1, p(x) / (l q(x))); the emitted
    token follows min(q, p / l) + (1 - sum min(q, p / l)) norm(max(0, p - q)) (= p at l = 1),
    and acceptance is sum_x min(q, p / l)."""
    p1, _, q1, _ = _tables(0)
    P, Q = warp(p1, Sampling(1.0)), warp(q1, Sampling(1.0))
    a = torch.minimum(Q, P / lenience)
    e = a + (1 - a.sum()) * verify.residual(P, Q)
    n = 8000
    counts, acc = _one_step_lenient(n, lenience, seed=3)
    assert _pvalue(counts[None], e[None]) > ALPHA_TEST
    assert abs(acc / n - float(a.sum())) < 4 * (0.25 / n) ** 0.5  # 4 binomial SEs
    tvd = verify.lenient_tvd(P, Q, lenience)
    assert tvd == pytest.approx(float(0.5 * (e - P).abs().sum()), abs=1e-6)
    if lenience == 1.0:
        assert tvd < 1e-6
    else:  # it accepts more often than exact sampling, and moves the output
        assert float(a.sum()) > float(torch.minimum(Q, P).sum()) and tvd > 0.01


def test_lenient_step_at_half_is_not_the_target():
    """The statistical test can tell a lenient step from the target's own distribution."""
    p1, _, _, _ = _tables(0)
    counts, _ = _one_step_lenient(8000, 0.5, seed=3)
    assert _pvalue(counts[None], warp(p1, Sampling(1.0))[None]) < ALPHA_TEST


def test_lenient_greedy_accepts_within_the_factor_of_the_top_token():
    # after the root: probabilities ~ [0.5, 0.3, 0.2]; token 1 is within 0.5 x top, token 2 not
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.2], [0.1, 0.1, 0.8], [0.6, 0.3, 0.1]]))
    v, off = verify.verify_greedy_lenient([1, 2], [-1, 0], logits, 0.5)
    assert v.path == [0, 1] and v.token == 0 and off == 1  # token 1 is off the argmax; 2 is it
    v, off = verify.verify_greedy_lenient([2, 2], [-1, 0], logits, 0.5)
    assert v.path == [] and v.token == 0 and off == 0  # 0.2 < 0.25: rejected, argmax emitted
    v, off = verify.verify_greedy_lenient([1, 2], [-1, 0], logits, 0.7)
    assert v.path == [] and v.token == 0  # 0.3 < 0.35


@pytest.mark.parametrize("seed", range(20))
def test_ancestor_rows_are_each_nodes_path_to_the_root(seed):
    """``Proposal.ancestors`` (the attention mask inside a tree verification, built from lists):
    row i + 1 marks exactly node i, its parent, its parent's parent ... and the root; a chain's
    is lower-triangular."""
    from models.base import Proposal

    g = torch.Generator().manual_seed(seed)
    n = int(torch.randint(0, 40, (), generator=g))
    parents = [int(torch.randint(-1, i, (), generator=g)) for i in range(n)]  # parent < node
    rows = Proposal(list(range(n)), parents).ancestors()
    assert len(rows) == n + 1 and all(len(r) == n + 1 for r in rows)
    assert rows[0] == [True] + [False] * n
    for i in range(n):
        want, v = {0}, i
        while v >= 0:
            want.add(v + 1)
            v = parents[v]
        assert {j for j, x in enumerate(rows[i + 1]) if x} == want
    chain = torch.tensor(Proposal.chain(list(range(n))).ancestors())
    assert torch.equal(chain, torch.tril(torch.ones(n + 1, n + 1, dtype=torch.bool)))


def test_accept_is_each_rule_the_decoders_apply():
    """``accept``, the one acceptance step of both decoders: greedy follows the argmax (read
    here or handed in), lenience at T = 0 takes a token within its factor of the top one and
    counts it off the argmax, exact sampling is ``verify_sampled``'s, typical reports a TVD."""
    from models.base import Proposal

    logits = torch.tensor([[0.0, 5.0, 4.9, -1.0], [6.0, 0.0, 0.0, 0.0], [0.0, 0.0, 0.0, 9.0]])
    chain = Proposal.chain([2, 0])
    greedy = verify.AcceptRule(Sampling())
    got = verify.accept(greedy, chain, logits, None)
    assert (got.verdict.path, got.verdict.token, got.tvd) == ([], 1, None)
    handed = verify.accept(greedy, chain, logits, None, argmax=[2, 0, 3])  # the caller's read
    assert (handed.verdict.path, handed.verdict.token) == ([0, 1], 3)
    lenient = verify.accept(verify.AcceptRule(Sampling(), lenience=0.5), chain, logits, None)
    assert (lenient.verdict.path, lenient.verdict.token, lenient.off_argmax) == ([0, 1], 3, 1)
    s = Sampling(temperature=1.0)
    a = verify.accept(verify.AcceptRule(s), chain, logits, torch.Generator().manual_seed(3))
    b = verify.verify_sampled(
        chain.tokens, chain.parents, warp(logits, s), None, torch.Generator().manual_seed(3)
    )
    assert (a.verdict.path, a.verdict.token, a.tvd) == (b.path, b.token, None)
    typ = verify.accept(
        verify.AcceptRule(s, acceptance="typical"), chain, logits, torch.Generator().manual_seed(3)
    )
    assert typ.tvd is not None and len(typ.tvd) == len(typ.verdict.path) + 1


# -- a batch's rejection sampling on the device, one read (``sampled_on_device``) --------------


def _simulate_on_device(n: int, s: Sampling, seed: int, tree: bool = False) -> torch.Tensor:
    """``_simulate``'s counts, with ``n`` rows accepted at once by ``sampled_on_device`` on
    the test device: each a depth-2 chain drawn from q, or (``tree``) a deterministic tree (q
    None) whose root has q1's two likeliest tokens as children, each with its likeliest child
    under q2."""
    from models.base import Proposal

    p1, p2, q1, q2 = _tables(0)
    P1, P2, Q1, Q2 = warp(p1, s), warp(p2, s), warp(q1, s), warp(q2, s)
    g = torch.Generator().manual_seed(seed)
    props, rows = [], []
    for _ in range(n):
        if tree:
            a, b = Q1.topk(2).indices.tolist()
            tokens, parents = [a, int(Q2[a].argmax()), b, int(Q2[b].argmax())], [-1, 0, -1, 2]
            props.append(Proposal(tokens, parents))
        else:
            x1 = int(torch.multinomial(Q1, 1, generator=g))
            tokens, parents = [x1, int(torch.multinomial(Q2[x1], 1, generator=g))], [-1, 0]
            props.append(Proposal.chain(tokens, torch.stack([Q1, Q2[x1]]).to(DEV)))
        after = [P2[t] if parents[i] == -1 else P1 for i, t in enumerate(tokens)]
        rows.append(torch.stack([P1, *after]))
    # log p warped at T = 1 is p again (the settings' warping is in P already)
    gens = [torch.Generator(DEV).manual_seed(seed * 100_000 + i) for i in range(n)]
    got = verify.sampled_on_device(Sampling(1.0), props, torch.stack(rows).log().to(DEV), gens)
    counts = torch.zeros(V, V)
    for prop, a in zip(props, got, strict=True):
        emitted = [prop.tokens[i] for i in a.verdict.path] + [a.verdict.token]
        if len(emitted) < 2:  # rejected at depth 1: the second token comes from p2(.|x1)
            emitted.append(int(torch.multinomial(P2[emitted[0]], 1, generator=g)))
        counts[emitted[0], emitted[1]] += 1
    return counts


@pytest.mark.parametrize("s", SETTINGS, ids=["T1", "T0.7-topk4", "T1-topp0.8"])
def test_chains_sampled_on_the_device_follow_the_target(s):
    counts = _simulate_on_device(6000, s, seed=1)
    assert _pvalue(counts, _expected(s)) > ALPHA_TEST


@pytest.mark.parametrize("s", [Sampling(1.0), Sampling(1.0, top_p=0.8)], ids=["T1", "T1-topp0.8"])
def test_deterministic_trees_sampled_on_the_device_follow_the_target(s):
    """One draw per node, then the walk over the draws: the law of recursive rejection over
    point masses (a node's two children tried in turn, then the remainder)."""
    counts = _simulate_on_device(6000, s, seed=2, tree=True)
    assert _pvalue(counts, _expected(s)) > ALPHA_TEST


def test_the_device_test_notices_plain_p_instead_of_residual(monkeypatch):
    monkeypatch.setattr(verify, "residual", lambda p, q: p)
    counts = _simulate_on_device(6000, Sampling(1.0), seed=1)
    assert _pvalue(counts, _expected(Sampling(1.0))) < ALPHA_TEST


def _rows(seed: int, trees: bool = False):
    """Five rows of mixed lengths (0 to 3) and kinds: chains with q and a chain of point
    masses, or (``trees``) point masses only: trees, a chain and an empty proposal."""
    from models.base import Proposal

    g = torch.Generator().manual_seed(seed)
    W, Vb = 4, 12
    logits = (torch.randn(5, W, Vb, generator=g) * 2).to(DEV)
    q = (torch.randn(3, Vb, generator=g) * 2).softmax(-1).to(DEV)
    if trees:
        props = [
            Proposal([3, 1, 4], [-1, -1, 0]),
            Proposal.chain([]),
            Proposal([2, 6], [-1, -1]),
            Proposal.chain([5, 9]),
            Proposal([7, 8, 0], [-1, 0, 0]),
        ]
    else:
        props = [
            Proposal.chain([3, 1, 4], q),
            Proposal.chain([]),
            Proposal.chain([2], q[:1]),
            Proposal.chain([5, 9]),  # point masses
            Proposal.chain([7, 7, 0], q),
        ]
    return props, logits


def _streams(seed: int) -> list[torch.Generator]:
    return [torch.Generator(DEV).manual_seed(seed * 10 + b) for b in range(5)]


@pytest.mark.parametrize("trees", [False, True], ids=["chains", "trees"])
def test_a_rows_draws_on_the_device_do_not_depend_on_the_rows_beside_it(trees):
    """Each row draws from its own stream as many uniforms as its own proposal asks: accepted
    alone or in a batch of rows of other lengths, a row accepts the same."""
    s = Sampling(1.0)
    paths = set()
    for seed in range(20):
        props, logits = _rows(seed, trees)
        together = verify.sampled_on_device(s, props, logits, _streams(seed))
        for b, prop in enumerate(props):
            alone = verify.sampled_on_device(
                s, [prop], logits[b : b + 1, : len(prop) + 1], _streams(seed)[b : b + 1]
            )[0]
            got = (alone.verdict.path, alone.verdict.token)
            assert got == (together[b].verdict.path, together[b].verdict.token)
            path = alone.verdict.path  # a path from the root, within the proposal
            assert all(prop.parents[j] == (path[i - 1] if i else -1) for i, j in enumerate(path))
            paths.add(len(path))
    assert {0, 1} <= paths  # rows both rejected and accepted


def test_a_token_the_draft_could_not_have_drawn_is_never_emitted_on_the_device():
    """``verify_sampled``'s rule for q(x) = 0: x is never accepted where the target gives it 0."""
    from models.base import Proposal

    p = torch.tensor([[0.0, 0.5, 0.5], [1 / 3, 1 / 3, 1 / 3]], device=DEV)
    prop = Proposal.chain([0], torch.tensor([[0.0, 1.0, 0.0]], device=DEV))
    n = 2000
    gens = [torch.Generator(DEV).manual_seed(i) for i in range(n)]
    got = verify.sampled_on_device(Sampling(1.0), [prop] * n, p.log().expand(n, 2, 3), gens)
    assert all(a.verdict.path == [] and a.verdict.token != 0 for a in got)


def test_accept_rows_on_the_host_or_on_the_device_is_accept_for_every_row():
    """The batch's acceptance: at T = 0 one argmax read for all rows; at T > 0 on the host,
    each row ``accept``'s with its own stream; on the device only under the exact rule (a
    lenient or typical rule, or the exponential race, stays on the host)."""
    props, logits = _rows(7)

    def outcome(got):
        return [(a.verdict.path, a.verdict.token, a.tvd) for a in got]

    for rule in [
        verify.AcceptRule(Sampling()),
        verify.AcceptRule(Sampling(1.0)),
        verify.AcceptRule(Sampling(1.0), lenience=0.5),
        verify.AcceptRule(Sampling(1.0), acceptance="typical"),
        verify.AcceptRule(Sampling(1.0), race=True),
    ]:
        each = [
            verify.accept(rule, p, logits[b, : len(p) + 1], g)
            for b, (p, g) in enumerate(zip(props, _streams(7), strict=True))
        ]
        assert outcome(verify.accept_rows(rule, props, logits, _streams(7))) == outcome(each)
        on_device = verify.accept_rows(rule, props, logits, _streams(7), on_device=True)
        exact = not rule.sampling.greedy and rule == verify.AcceptRule(Sampling(1.0))
        assert verify.samples_on_device(rule, props) == exact
        if not exact:
            assert outcome(on_device) == outcome(each)
        else:
            assert outcome(on_device) == outcome(
                verify.sampled_on_device(rule.sampling, props, logits, _streams(7))
            )


def _simulate_block(n: int, s: Sampling, seed: int, greedy_drafts: bool, depth: int = 2):
    """Counts (V, V) of the first two emitted tokens over ``n`` block verifications of a chain
    of ``depth`` drafted tokens (argmax drafts as point masses, or drafts sampled from q), and
    the mean accepted length."""
    p1, p2, q1, q2 = _tables(0)
    P1, P2, Q1, Q2 = warp(p1, s), warp(p2, s), warp(q1, s), warp(q2, s)
    g = torch.Generator().manual_seed(seed)
    counts, accepted = torch.zeros(V, V), 0
    for _ in range(n):
        tokens, qs, rows = [], [], [P1]
        for i in range(depth):
            dist = Q1 if i == 0 else Q2[tokens[-1]]
            tokens.append(
                int(dist.argmax())
                if greedy_drafts
                else int(torch.multinomial(dist, 1, generator=g))
            )
            qs.append(dist)
            rows.append(P2[tokens[0]] if i == 0 else P1)  # after depth 2+: any distribution
        q = None if greedy_drafts else torch.stack(qs)
        v = verify.verify_block(tokens, torch.stack(rows), q, g)
        assert v.path == list(range(len(v.path)))
        accepted += len(v.path)
        emitted = [tokens[i] for i in v.path] + [v.token]
        if len(emitted) < 2:
            emitted.append(int(torch.multinomial(P2[emitted[0]], 1, generator=g)))
        counts[emitted[0], emitted[1]] += 1
    return counts, accepted / n


@pytest.mark.parametrize("greedy_drafts", [True, False], ids=["argmax_drafts", "sampled_drafts"])
@pytest.mark.parametrize("depth", [2, 3])
def test_block_verification_follows_the_target(greedy_drafts, depth):
    """Block verification (vLLM's rejection_sample_method="block") is exact: the first two
    emitted tokens follow p1 x p2, with argmax drafts (point masses) and with sampled ones."""
    s = Sampling(1.0)
    counts, _ = _simulate_block(6000, s, seed=depth, greedy_drafts=greedy_drafts, depth=depth)
    p1, p2, _, _ = _tables(0)
    expected = (warp(p1, s)[:, None] * warp(p2, s)).flatten() * counts.sum()
    assert chisquare(counts.flatten().numpy(), expected.numpy()).pvalue > ALPHA_TEST


def test_block_verification_accepts_at_least_as_much_as_token_by_token():
    """In expectation block verification accepts no fewer tokens than token-by-token
    rejection sampling of the same drafts (Sun et al.'s guarantee), here on argmax drafts."""
    s = Sampling(1.0)
    _, block = _simulate_block(6000, s, seed=11, greedy_drafts=True, depth=3)
    p1, p2, q1, q2 = _tables(0)
    P1, P2, Q1, Q2 = warp(p1, s), warp(p2, s), warp(q1, s), warp(q2, s)
    g = torch.Generator().manual_seed(12)
    total = 0
    for _ in range(6000):
        t1 = int(Q1.argmax())
        t2 = int(Q2[t1].argmax())
        t3 = int(Q2[t2].argmax())
        rows = torch.stack([P1, P2[t1], P1, P1])
        total += len(verify.verify_sampled([t1, t2, t3], [-1, 0, 1], rows, None, g).path)
    tokenwise = total / 6000
    assert block >= tokenwise - 0.03, (block, tokenwise)


def test_the_block_test_notices_a_correction_drawn_from_p(monkeypatch):
    """A block rule whose token after a rejection comes from the target's p instead of
    norm(max(0, r_tau p - q)) is not exact, and the chi-square test above fails on it."""
    monkeypatch.setattr(verify, "block_residual", lambda r, p, q: p)
    s = Sampling(1.0)
    counts, _ = _simulate_block(6000, s, seed=2, greedy_drafts=True, depth=2)
    p1, p2, _, _ = _tables(0)
    expected = (warp(p1, s)[:, None] * warp(p2, s)).flatten() * counts.sum()
    assert chisquare(counts.flatten().numpy(), expected.numpy()).pvalue < ALPHA_TEST
