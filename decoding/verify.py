"""Pure functions of speculative verification: accepting a draft tree against the target's
(warped) distributions.

Exactness (Leviathan et al. 2023; Chen et al. 2023): a drafted token x drawn from q is accepted
with probability min(1, p(x)/q(x)); on rejection the next token is drawn from the residual
norm(max(0, p - q)); when every drafted token is accepted a bonus token is drawn from p. The
output then has exactly the target's distribution p, whatever q is. Temperature, top-k and top-p
are applied to both p and q before the test ("standardised sampling"), so the output follows
the *warped* target distribution, as plain sampling with those settings would.

A tree is verified by walking from the root: the children of the current node are tried in order
(recursive rejection sampling); after each rejected child the target distribution becomes the
residual of that child's draft distribution, and the next child is tested against it. With one
child per node (a chain) this is the standard algorithm above.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from models.base import Proposal
from models.sampling import Sampling, greedy_tokens, inverse_cdf, sample, warp


def residual(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """norm(max(0, p - q)): what the target still owes after a rejection, (..., V) -> (..., V)
    with no read of the device. Where p <= q everywhere (only possible when p == q, where
    rejection has probability 0), p."""
    r = (p - q).clamp_min(0.0)
    total = r.sum(-1, keepdim=True)
    return torch.where(total > 0, r / total, p)


@dataclass
class Verdict:
    path: list[int]  # accepted draft node indices, root to deepest
    token: int  # the token emitted after the path (correction or bonus)


def children_of(parents: list[int], n: int) -> list[list[int]]:
    """children[i + 1] = child node indices of node i (children[0]: of the root), in order."""
    kids: list[list[int]] = [[] for _ in range(n + 1)]
    for i, par in enumerate(parents):
        kids[par + 1].append(i)
    return kids


def verify_greedy(tokens: list[int], parents: list[int], target_argmax: list[int]) -> Verdict:
    """T = 0: follow the child whose token is the target's argmax; emit the argmax where none is.
    target_argmax[i + 1] is the target's choice after node i ([0]: after the root)."""
    if not tokens:  # nothing drafted (plain decoding): the target's choice
        return Verdict([], target_argmax[0])
    kids = children_of(parents, len(tokens))
    path: list[int] = []
    cur = -1
    while True:
        want = target_argmax[cur + 1]
        nxt = next((c for c in kids[cur + 1] if tokens[c] == want), None)
        if nxt is None:
            return Verdict(path, want)
        path.append(nxt)
        cur = nxt


def verify_greedy_lenient(
    tokens: list[int], parents: list[int], logits: torch.Tensor, lenience: float
) -> tuple[Verdict, int]:
    """T = 0 with lenience l in (0, 1), NOT exact: a drafted token x is accepted when the
    target's p(x) >= l * max p (the first such child, in draft order); the token after the
    accepted path is the target's argmax. logits: (N + 1, V) ([0]: after the root). Also
    returns how many accepted tokens are not the target's argmax (what plain greedy decoding
    would have emitted there)."""
    kids = children_of(parents, len(tokens))
    p = logits.float().softmax(-1)
    top = p.max(-1)
    path: list[int] = []
    off = 0
    cur = -1
    while True:
        row = cur + 1
        nxt = next((c for c in kids[row] if p[row, tokens[c]] >= lenience * top.values[row]), None)
        if nxt is None:
            return Verdict(path, int(top.indices[row])), off
        off += int(tokens[nxt] != int(top.indices[row]))
        path.append(nxt)
        cur = nxt


def lenient_tvd(p: torch.Tensor, q: torch.Tensor, lenience: float) -> float:
    """Total variation distance from p of what one lenient step emits: a draft x ~ q accepted
    with probability min(1, p(x) / (l q(x))), else a token from norm(max(0, p - q)). Emitted:
    e = min(q, p / l) + (1 - sum min(q, p / l)) * norm(max(0, p - q)); returns 1/2 |e - p|_1
    (0 at l = 1, where e = p)."""
    acc = torch.minimum(q, p / lenience)
    e = acc + (1.0 - acc.sum()).clamp_min(0.0) * residual(p, q)
    return float(0.5 * (e - p).abs().sum())


def verify_sampled(
    tokens: list[int],
    parents: list[int],
    p: torch.Tensor,
    q: torch.Tensor | None,
    generator: torch.Generator | None,
    lenience: float = 1.0,
) -> Verdict:
    """T > 0: recursive rejection sampling over the tree.

    p: (N + 1, V) warped target distributions ([0]: after the root, [i + 1]: after node i).
    q: (N, V) the warped draft distribution each node's token was drawn from, or None for a
    deterministic proposer (a point mass on the proposed token).
    lenience: l in (0, 1]; a drafted x is accepted with probability min(1, p(x) / (l q(x))).
    l = 1 is exact speculative sampling; l < 1 accepts more and is NOT exact (``lenient_tvd``
    measures how far one step's output moves from p).
    """
    kids = children_of(parents, len(tokens))
    path: list[int] = []
    cur = -1
    while True:
        dist = p[cur + 1]
        moved = False
        for c in kids[cur + 1]:
            x = tokens[c]
            qc = q[c] if q is not None else one_hot(x, dist)
            # q(x) = 0 means x could not have been drawn from q (no proposer does this); never
            # let it emit a token the target gives probability 0
            ratio = dist[x] / (lenience * qc[x]) if qc[x] > 0 else (dist[x] > 0).float()
            u = torch.rand((), generator=generator, device=dist.device)
            if u < ratio:
                path.append(c)
                cur = c
                moved = True
                break
            dist = residual(dist, qc)
        if not moved:
            return Verdict(path, sample(dist, generator))


def one_hot(x: int, like: torch.Tensor) -> torch.Tensor:
    e = torch.zeros_like(like)
    e[x] = 1.0
    return e


def typical_threshold(p: torch.Tensor, epsilon: float, delta: float) -> torch.Tensor:
    """Medusa's typical-acceptance threshold min(epsilon, delta * exp(-H(p))) per row of
    p (..., V) -> (...)."""
    logp = p.clamp_min(1e-30).log()
    entropy = -(p * logp).sum(-1)
    return torch.minimum(torch.full_like(entropy, epsilon), delta * torch.exp(-entropy))


def verify_typical(
    tokens: list[int],
    parents: list[int],
    p: torch.Tensor,
    epsilon: float,
    delta: float,
    generator: torch.Generator | None,
) -> tuple[Verdict, list[float]]:
    """Typical acceptance (Cai et al. 2024), NOT distribution-preserving: a drafted token x
    after node i is accepted when p_i(x) > min(epsilon, delta * exp(-H(p_i))). The longest
    path of accepted nodes wins (ties: the earlier node); the token after it is sampled from p.

    p: (N + 1, V) warped target distributions ([0]: after the root). Also returns, for every
    emitted token, its total variation distance from what plain sampling would have emitted
    there: an accepted draft token is a point mass where plain sampling draws from p, so
    TVD = 1 - p(x); the sampled last token has TVD 0.
    """
    n = len(tokens)
    thr = typical_threshold(p, epsilon, delta)  # (N + 1,)
    ok = [False] * n
    depth = [0] * n
    best = -1
    for i, par in enumerate(parents):  # parents come before children
        prev_ok = par < 0 or ok[par]
        ok[i] = prev_ok and bool(p[par + 1, tokens[i]] > thr[par + 1])
        depth[i] = 1 if par < 0 else depth[par] + 1
        if ok[i] and (best < 0 or depth[i] > depth[best]):
            best = i
    path: list[int] = []
    node = best
    while node >= 0:
        path.append(node)
        node = parents[node]
    path.reverse()
    tvd = [1.0 - float(p[(parents[i] + 1), tokens[i]]) for i in path]
    end = path[-1] + 1 if path else 0
    token = sample(p[end], generator)
    return Verdict(path, token), tvd + [0.0]


def verify_block(
    tokens: list[int],
    p: torch.Tensor,
    q: torch.Tensor | None,
    generator: torch.Generator | None,
) -> Verdict:
    """T > 0, a chain: block verification (Sun et al. 2024, arXiv 2403.10444), exact like
    token-by-token rejection sampling and never accepting less in expectation; vLLM's
    ``rejection_sample_method="block"``.

    p: (N + 1, V) warped target distributions ([0]: after the root); q: (N, V) the draft
    distribution each token was drawn from, or None for point masses (argmax drafts). With
    the running ratio r_0 = 1, r_i = min(1, r_{i-1} p_{i-1}(x_i) / q_{i-1}(x_i)), position
    i < N passes with probability h_i = m_i / (m_i + 1 - r_i), where m_i = sum_x max(0,
    r_i p_i(x) - q_i(x)) is the residual mass after it, and position N with h_N = r_N. Each
    position draws its own uniform; the accepted length tau is the last position that passed
    (0 if none), and the next token is drawn from norm(max(0, r_tau p_tau - q_tau)) (from
    p_N after the whole chain).
    """
    n = len(tokens)
    qs = (
        q
        if q is not None
        else torch.zeros_like(p[:n]).scatter_(1, torch.tensor(tokens)[:, None].to(p.device), 1.0)
    )
    r = [1.0]
    for i, x in enumerate(tokens):
        qx = float(qs[i, x])
        ratio = float(p[i, x]) / qx if qx > 0 else float(p[i, x] > 0)
        r.append(min(1.0, r[-1] * ratio))
    tau = 0
    for i in range(1, n + 1):
        if i < n:
            mass = float((r[i] * p[i] - qs[i]).clamp_min(0.0).sum())
            denom = mass + 1.0 - r[i]
            h = mass / denom if denom > 0 else 1.0
        else:
            h = r[n]
        u = float(torch.rand((), generator=generator, device=p.device))
        if u <= h:
            tau = i
    if tau == n:
        return Verdict(list(range(n)), sample(p[n], generator))
    return Verdict(list(range(tau)), sample(block_residual(r[tau], p[tau], qs[tau]), generator))


def block_residual(r: float, p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """What block verification draws from after accepting a prefix with running ratio r:
    max(0, r p - q) (V,), unnormalised; p where that is empty (only where r p == q, where a
    rejection has probability 0)."""
    left = (r * p - q).clamp_min(0.0)
    return left if float(left.sum()) > 0 else p


@dataclass(frozen=True)
class AcceptRule:
    """How a verification's drafted tokens are accepted, for both decoders (batch 1 and B):
    ``sampling`` (T = 0: greedy; else exact rejection sampling), ``lenience`` < 1 (NOT exact:
    ``verify_greedy_lenient`` / ``verify_sampled``'s l), ``acceptance="typical"`` (at
    T > 0, Medusa's, NOT exact) with its (epsilon, delta) and ``acceptance="block"`` (at
    T > 0, chains: block verification, exact). ``draft``: how drafts are proposed at T > 0,
    ``sample`` (from q, tested with q) or ``greedy`` (the draft's argmax, tested as a point
    mass: exact too; vLLM's default and its only rule for reduced-vocabulary heads)."""

    sampling: Sampling
    lenience: float = 1.0
    acceptance: str = "exact"
    typical: tuple[float, float] = (0.09, 0.3)
    draft: str = "sample"
    #: at T > 0, a step with nothing drafted draws its token by ``torch.multinomial`` (an
    #: exponential race) instead of the inverse CDF: both exact, but rounding that moves with
    #: a batch's composition moves an inverse-CDF draw to a neighbouring token far more often,
    #: and a resumed regeneration must write the same file (``flow/regenerate.py``)
    race: bool = False


@dataclass
class Accepted:
    """A verification's outcome for one sequence: the ``verdict``, for each emitted token its
    TVD from the target's own distribution where the rule is not exact (else None), and at
    T = 0 with lenience the accepted tokens that are not the target's argmax."""

    verdict: Verdict
    tvd: list[float] | None = None
    off_argmax: int = 0


def accept(
    rule: AcceptRule,
    prop: Proposal,
    logits: torch.Tensor,
    generator: torch.Generator | None,
    argmax: list[int] | None = None,
) -> Accepted:
    """The acceptance step of one sequence: ``prop`` against the target's ``logits`` after the
    last committed token and after each node ((N + 1, V)); ``argmax``: at T = 0, the target's
    choices there when the caller read them already (the batched decoder reads a whole
    batch's at once), else they are read here: the iteration's one read of the device."""
    s = rule.sampling
    if s.greedy and rule.lenience < 1.0:
        verdict, off = verify_greedy_lenient(prop.tokens, prop.parents, logits, rule.lenience)
        return Accepted(verdict, None, off)
    if s.greedy:
        arg = argmax if argmax is not None else greedy_tokens(logits).tolist()
        return Accepted(verify_greedy(prop.tokens, prop.parents, arg))
    p = warp(logits, s)
    if rule.race and not prop.tokens:
        return Accepted(Verdict([], int(torch.multinomial(p[0], 1, generator=generator))))
    if rule.lenience < 1.0:
        verdict = verify_sampled(prop.tokens, prop.parents, p, prop.q, generator, rule.lenience)
        return Accepted(verdict, lenient_chain_tvd(prop, p, len(verdict.path), rule.lenience))
    if rule.acceptance == "typical":
        verdict, tvd = verify_typical(prop.tokens, prop.parents, p, *rule.typical, generator)
        return Accepted(verdict, tvd)
    if rule.acceptance == "block" and prop.tokens:
        if not prop.is_chain:
            raise ValueError("acceptance=block verifies chains (tree=chain)")
        return Accepted(verify_block(prop.tokens, p, prop.q, generator))
    return Accepted(verify_sampled(prop.tokens, prop.parents, p, prop.q, generator))


def accept_rows(
    rule: AcceptRule,
    props: list[Proposal],
    logits: torch.Tensor,
    generators: list[torch.Generator | None],
    on_device: bool = False,
) -> list[Accepted]:
    """The acceptance step of every row of a batch (``accept``'s for each): ``logits``
    (R, W, V), row b's first len(props[b]) + 1 positions its own. At T = 0 one read of the
    device gives every row's argmax. At T > 0 under the exact rule, ``on_device`` makes every
    row's tests and draws on the device with one read (``sampled_on_device``); else each row
    accepts on its own, which on a GPU reads the device at every test and draw."""
    pairs = list(enumerate(zip(props, generators, strict=True)))
    if rule.sampling.greedy and rule.lenience == 1.0:  # ``accept``'s greedy case, per row
        arg = greedy_tokens(logits).tolist()
        return [Accepted(verify_greedy(p.tokens, p.parents, arg[b])) for b, (p, _) in pairs]
    if on_device and samples_on_device(rule, props):
        return sampled_on_device(rule.sampling, props, logits, generators)
    return [accept(rule, p, logits[b, : len(p) + 1], g) for b, (p, g) in pairs]


def samples_on_device(rule: AcceptRule, props: list[Proposal]) -> bool:
    """Whether ``sampled_on_device`` takes these rows: T > 0 under the exact rule (no
    lenience, typical acceptance or exponential race), and every proposal deterministic
    (point masses: any tree) or a chain."""
    return (
        not rule.sampling.greedy
        and rule.lenience == 1.0
        and rule.acceptance == "exact"
        and not rule.race
        and all(p.q is None or p.is_chain for p in props)
    )


def sampled_on_device(
    s: Sampling,
    props: list[Proposal],
    logits: torch.Tensor,
    generators: list[torch.Generator | None],
) -> list[Accepted]:
    """Exact rejection sampling (``verify_sampled``'s law) of R rows with one read of the
    device. Each row draws its uniforms from its own stream, as many as its own proposal asks
    (what it samples does not depend on the rows beside it).

    Deterministic proposals (every q None: point masses, so any tree): recursive rejection at a
    node accepts its child c with the probability the target gives c's token once the earlier
    siblings' tokens are removed, and after the last child draws from what remains. In law
    that is one draw y from the target at the node, then the child whose token is y, or y
    emitted where no child has it. So every node draws once, all at once on the device, and
    the host walks the draws as a greedy walk follows argmaxes (``verify_greedy``).
    Chains with draft distributions: ``chains_sampled``. Each row by its own kind's rule: a
    batch that holds both kinds is accepted as two (two reads)."""
    R, dev = len(props), logits.device
    # an empty proposal is accepted alike by both rules: a draw from p at its one uniform
    masses = [b for b, pr in enumerate(props) if pr.q is None and len(pr)]
    dists = [b for b, pr in enumerate(props) if pr.q is not None]
    walk = not dists
    if masses and dists:
        out: list[Accepted] = [None] * R  # type: ignore[list-item]
        for group in (masses, [b for b in range(R) if b not in masses]):
            got = sampled_on_device(
                s,
                [props[b] for b in group],
                logits.index_select(0, torch.tensor(group, device=dev)),
                [generators[b] for b in group],
            )
            for b, a in zip(group, got, strict=True):
                out[b] = a
        return out
    lens = [len(p) for p in props]
    W = max(lens) + 1
    p = warp(logits[:, :W], s)
    draws = [
        torch.rand(n + 1, generator=g, dtype=torch.float64, device=dev)
        for n, g in zip(lens, generators, strict=True)
    ]
    u = torch.cat(draws) if R > 1 else draws[0]
    starts = [0]  # where each row's uniforms begin in ``u``
    for n in lens[:-1]:
        starts.append(starts[-1] + n + 1)
    if walk:  # point masses: a draw at every node, then the walk
        if R == 1:
            flat = p[0]
        else:
            sel = [b * W + i for b, n in enumerate(lens) for i in range(n + 1)]
            flat = p.reshape(R * W, -1).index_select(0, torch.tensor(sel, device=dev))
        ys = inverse_cdf(flat, u).tolist()  # the one read
        return [
            Accepted(verify_greedy(pr.tokens, pr.parents, ys[a : a + n + 1]))
            for pr, n, a in zip(props, lens, starts, strict=True)
        ]
    G = W - 1
    # one copy to the device: the tokens (R, G), the lengths, and where each row's uniforms
    # sit in ``u`` (a test per drafted token, then the draw; padding reads the row's first)
    flat_ints = [t for pr, n in zip(props, lens, strict=True) for t in pr.tokens + [0] * (G - n)]
    flat_ints += lens
    flat_ints += [
        a + i if i < n else a for a, n in zip(starts, lens, strict=True) for i in range(G)
    ]
    flat_ints += [a + n for a, n in zip(starts, lens, strict=True)]
    ints = torch.tensor(flat_ints, device=dev)
    tokens = ints[: R * G].view(R, G)
    lengths = ints[R * G : R * G + R] if min(lens) < G else None
    pick = u.index_select(0, ints[R * G + R :])
    if R == 1:
        q = props[0].q[None].to(p.dtype)
    else:
        q = p.new_zeros(R, G, p.shape[-1])
        for b in dists:
            q[b, : lens[b]] = props[b].q
    n_acc, tok = chains_sampled(p, q, tokens, lengths, pick[: R * G].view(R, G), pick[R * G :])
    got = torch.stack([n_acc, tok]).tolist()  # the one read
    return [Accepted(Verdict(list(range(k)), t)) for k, t in zip(*got, strict=True)]


def chains_sampled(
    p: torch.Tensor,
    q: torch.Tensor,
    tokens: torch.Tensor,
    lengths: torch.Tensor | None,
    u_test: torch.Tensor,
    u_draw: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``verify_sampled`` for R chains at once, on the device with no read of it.

    p: (R, G + 1, V) the warped target distributions; q: (R, G, V) those the drafted tokens
    (R, G) were drawn from (a one-hot row for a point mass); lengths (R,): each row's drafted
    tokens, the positions past it padding (None: no row is padded); u_test (R, G): the
    uniform that tests each position; u_draw (R,): the uniform of the emitted token's draw.
    Position i is accepted with probability min(1, p(x) / q(x)) (where q(x) = 0: only if
    p(x) > 0, as ``verify_sampled``) while every earlier one was; the emitted token is drawn
    from the residual norm(max(0, p - q)) at the first rejected position (p itself where
    nothing is left), or from p after the last drafted token. Returns the accepted counts and
    the emitted tokens, (R,) each."""
    R, G = tokens.shape
    rows = torch.arange(R, device=p.device)
    if not G:
        return torch.zeros(R, dtype=torch.long, device=p.device), inverse_cdf(p[:, 0], u_draw)
    px = p[:, :G].gather(-1, tokens[..., None])[..., 0]
    qx = q.gather(-1, tokens[..., None])[..., 0]
    ok = u_test * qx < px  # u < p(x) / q(x); where q(x) = 0, p(x) > 0
    if lengths is not None:
        ok &= torch.arange(G, device=p.device) < lengths[:, None]
    n = ok.long().cumprod(-1).sum(-1)
    pn = p[rows, n]
    qn = q[rows, n.clamp(max=G - 1)]
    rejected = n < (lengths if lengths is not None else G)
    w = torch.where(rejected[:, None], residual(pn, qn), pn)
    return n, inverse_cdf(w, u_draw)


def lenient_chain_tvd(prop: Proposal, p: torch.Tensor, accepted: int, lenience: float):
    """Per emitted token of a lenient chain step: the TVD from p of the distribution that
    emitted it (``lenient_tvd`` at each tested position; 0 for the bonus token after a fully
    accepted chain, which is drawn from p)."""
    out = []
    for k in range(min(accepted + 1, len(prop))):  # tested: the accepted ones + the rejected
        q = prop.q[k] if prop.q is not None else one_hot(prop.tokens[k], p[k])
        out.append(lenient_tvd(p[k], q, lenience))
    return out + [0.0] * (accepted + 1 - len(out))


def until_stop(tokens: list[int], stop_ids) -> list[int]:
    """``tokens`` up to and including the first stop token (all of them if none)."""
    for j, tok in enumerate(tokens):
        if tok in stop_ids:
            return tokens[: j + 1]
    return tokens
