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
from models.sampling import Sampling, greedy_tokens, sample, warp


def residual(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """norm(max(0, p - q)): what the target still owes after a rejection. (V,) -> (V,).
    If p <= q everywhere (only possible when p == q, where rejection has probability 0), p."""
    r = (p - q).clamp_min(0.0)
    total = r.sum()
    return r / total if total > 0 else p


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


@dataclass(frozen=True)
class AcceptRule:
    """How a verification's drafted tokens are accepted, for both decoders (batch 1 and B):
    ``sampling`` (T = 0: greedy; else exact rejection sampling), ``lenience`` < 1 (NOT exact:
    ``verify_greedy_lenient`` / ``verify_sampled``'s l) and ``acceptance="typical"`` (at
    T > 0, Medusa's, NOT exact) with its (epsilon, delta)."""

    sampling: Sampling
    lenience: float = 1.0
    acceptance: str = "exact"
    typical: tuple[float, float] = (0.09, 0.3)
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
    return Accepted(verify_sampled(prop.tokens, prop.parents, p, prop.q, generator))


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
