"""What decoding costs on this machine, measured before a run: the target's forwards
(``StepCostModel``, fitted to timed verifications and refitted on a run's own) and the
drafter's reading of new sequences and its draft step (``drafting_cost``). The goodput policy
(``policies.GoodputPolicy``) prices its choices with them; timing itself is ``timing.py``'s.
"""

from __future__ import annotations

import math
import time
from collections import deque
from typing import TYPE_CHECKING

import torch

from models.base import DecodeState, Proposer
from models.target import GenRequest

from .batch_runner import RaggedRunner
from .stats import depths
from .timing import sync

if TYPE_CHECKING:
    from .batch import BatchDecoder


class StepCostModel:
    """Seconds of a target forward over ``rows`` rows of ``k`` tokens each after a cache of
    ``length`` columns: t = c0 + c_row * rows + c_tok * rows * (k - 1) + c_wide * rows * [k > 1]
    + c_ctx * rows * k * length / 1000, the five coefficients (>= 0) fitted by least squares to
    forwards timed on this machine (``calibrate``, shaped as the decoder's: an explicit
    attention mask and positions) and to the real iterations' forwards (``observe``, refitted
    every ``refit`` observations over the last ``window``). A row's first token, its further
    ones, and a price per row for verifying more than one at all are told apart: on the AMX
    Xeon (the embedded target, 200 columns) a row cost 0.7 ms at 1 token; its second token
    1.2 ms more, the next 0.45 ms and each after ~0.3 ms (2 tokens a row: +13% at 4 rows, +40% at
    16). A line through tokens alone (``c_row = c_tok``, ``c_wide = 0``: what this model was)
    priced a 1-token draft at 16 rows at half its cost."""

    def __init__(self, refit: int = 16, window: int = 256):
        # (rows, rows * (k - 1), rows * [k > 1], rows * k * length / 1000, seconds)
        self.samples: list[tuple[float, ...]] = []
        self.live: deque = deque(maxlen=window)
        self.coef = (0.0, 0.0, 0.0, 0.0, 0.0)
        self.refit, self.pending = refit, 0
        #: the fit's relative error, reported beside it: root mean square of (predicted -
        #: measured) / measured over the forwards it was fitted to
        self.rel_error = 0.0
        #: the coefficients' covariance (least squares: residual variance x (A^T A)^-1 over the
        #: coefficients the fit kept), for the standard error of a predicted difference
        self.cov = torch.zeros(5, 5, dtype=torch.float64)
        #: the drafter's reading of sequences (its prefill of prompts, its catch-up): seconds
        #: per token and seconds per reading whatever its length, where measured
        #: (``BatchDecoder``'s calibration); not a forward's
        self.read_s_per_token: float | None = None
        self.read_s_fixed: float = 0.0
        #: seconds of one draft step, likewise measured before the run (None: not measured)
        self.draft_step_s: float | None = None

    @classmethod
    def linear(cls, c0: float, per_token: float, per_token_per_1k: float = 0.0) -> StepCostModel:
        """A model priced by tokens alone: c0 + per_token * rows * k + per_token_per_1k *
        rows * k * length / 1000."""
        cost = cls()
        cost.coef = (c0, per_token, per_token, 0.0, per_token_per_1k)
        return cost

    @staticmethod
    def _x(rows: int, k: int, length: int) -> tuple[float, float, float, float]:
        return (
            float(rows),
            float(rows * (k - 1)),
            float(rows if k > 1 else 0),
            rows * k * length / 1000.0,
        )

    def predict(self, rows: int, k: int, length: int) -> float:
        c0, c_row, c_tok, c_wide, c_ctx = self.coef
        return (
            c0
            + rows * (c_row + c_tok * (k - 1) + (c_wide if k > 1 else 0.0))
            + c_ctx * rows * k * length / 1000.0
        )

    def extra_sd(self, rows: int, k: int, length: int) -> float:
        """Standard error of the predicted extra seconds of verifying k tokens per row instead
        of one (same rows and cache): what the fit knows of verification's price, apart from
        the slow and fast spells that move every forward alike."""
        x1, x = self._x(rows, 1, length), self._x(rows, k, length)
        d = [0.0, *(b - a for a, b in zip(x1, x, strict=True))]
        # on the host in Python: a choice asks this for every length, each iteration, and a
        # 5 x 5 product in torch is a handful of dispatched ops each time
        c = self.cov.tolist()
        v = sum(d[i] * c[i][j] * d[j] for i in range(5) if d[i] for j in range(5) if d[j])
        return math.sqrt(max(v, 0.0))

    def observe(self, rows: int, k: int, length: int, seconds: float) -> None:
        self.live.append((*self._x(rows, k, length), seconds))
        self.pending += 1
        if self.pending >= self.refit:
            self.fit()

    def fit(self) -> None:
        data = self.samples + list(self.live)
        self.pending = 0
        if len(data) < 3:
            return
        a = torch.tensor([[1.0, *x] for *x, _ in data], dtype=torch.float64)
        y = torch.tensor([s for *_, s in data], dtype=torch.float64)
        # non-negative least squares: drop a negative coefficient and refit (a column the
        # data cannot tell from the others, as rows verifying more than one token where every
        # forward verified one, is dropped: lstsq's minimum-norm answer gives it 0)
        active = [0, 1, 2, 3, 4]
        if bool((a[:, 1] == a[0, 1]).all()):  # one row count seen (batch 1): rows are c0
            active.remove(1)
        while active:
            sol = torch.linalg.lstsq(a[:, active], y[:, None], driver="gelsd").solution[:, 0]
            if (sol >= 0).all():
                break
            active.pop(int(sol.argmin()))
        coef = [0.0] * 5
        for i, v in zip(active, sol.tolist() if active else [], strict=False):
            coef[i] = float(v)
        self.coef = tuple(coef)
        pred = a @ torch.tensor(coef, dtype=torch.float64)
        self.rel_error = float(((pred - y) / y.clamp_min(1e-9)).square().mean().sqrt())
        self.cov = torch.zeros(5, 5, dtype=torch.float64)
        if active and len(data) > len(active):
            sigma2 = float((pred - y).square().sum()) / (len(data) - len(active))
            sub = a[:, active]
            inv = torch.linalg.pinv(sub.T @ sub) * sigma2
            idx = torch.tensor(active)
            self.cov[idx[:, None], idx[None, :]] = inv

    @classmethod
    def for_proposer(cls, runner, proposer: Proposer, gamma: int, batch_size: int) -> StepCostModel:
        """A model calibrated for ``proposer`` at ``batch_size`` on ``runner`` (the batched
        decoder's ``BatchRunner``: its own forward, transformers' or the static cache's):
        forwards of 1 and ``batch_size`` rows, of up to the most tokens one verification feeds
        it (a tree's whole size, not its depth; else gamma + 1), after caches of 128 and 512
        columns."""
        k_top = (proposer.tree_nodes or proposer.tree_depth or gamma) + 1
        cost = cls()
        cost.calibrate(
            runner,
            rows=sorted({1, batch_size}),
            ks=sorted({1, 2, max(1, k_top // 2), k_top}),
            lengths=[128, 512],
        )
        return cost

    def calibrate(self, runner, rows: list[int], ks: list[int], lengths: list[int], reps: int = 3):
        """Time the runner's verifications of every (rows, k, length) on random tokens
        (``BatchRunner.verify_costs``) and fit."""
        for r in rows:
            for n in lengths:
                med = runner.verify_costs(r, ks, n, reps)
                for k in ks:
                    self.samples.append((*self._x(r, k, n), med[k]))
        self.fit()


# -- the drafter's costs ----------------------------------------------------------------------


@torch.no_grad()
def drafting_cost(
    dec: BatchDecoder, rows: int = 2, tokens: int = 96, short: int = 16
) -> tuple[float, float, float | None]:
    """The drafter's reading of sequences it has not seen (a batched drafter's join, a
    row-by-row proposer's start) priced as seconds per reading plus seconds per token, and
    one draft step's seconds (None: not measured), timed on random prompts after an
    untimed reading and draft: one row of ``short`` tokens and ``rows`` rows of ``tokens``
    (two points of the line). The goodput policy prices its first drafts and probes with
    them before the run has measured its own (a draft step priced at nothing made the
    first choice a draft, whatever drafting costs here). Both parts matter: on a CPU a
    reading costs by its tokens (the head's matrix work), on a GPU by the call (an eager
    head forward's launches: 190 tokens took 8.2 ms on an H100, 1,200 cost about as much;
    priced by the token alone, 16 unread prompts looked like 52 ms and goodput at B = 16
    never probed, docs/benchmarks.md)."""
    g = torch.Generator().manual_seed(1)
    vocab = dec.target.config.vocab_size
    rows = min(rows, dec.batch_size)  # what a batched drafter on fixed shapes holds
    reqs = [
        GenRequest(("calibration", i), torch.randint(0, vocab, (tokens,), generator=g).tolist())
        for i in range(rows)
    ]
    # the target's features on transformers' forward (the drafter's cost is what is timed,
    # and ``rows`` may be more than the batch's static cache holds)
    ragged = RaggedRunner(
        dec.target, dec.layers, dec.prefill_waste, dec.template.reads_prefill_cache
    )
    _, feats, views = ragged.admit([r.prompt[:-1] for r in reqs])

    def states(n_rows: int, n: int) -> list[DecodeState]:
        return [
            DecodeState(
                ids=list(r.prompt[:n]),
                features=None if f is None else f[: n - 1],
                sampling=dec.sampling,
                generator=torch.Generator(device=dec.device).manual_seed(0),
                device=dec.device,
                prefill_cache=v if n == tokens else None,
            )
            for r, f, v in list(zip(reqs, feats, views, strict=True))[:n_rows]
        ]

    def reading(sts: list[DecodeState]):
        sync(dec.device)
        t = time.perf_counter()
        bp = dec._drafter()
        props = []
        if bp is not None:
            bp.join(sts)
        else:
            props = [dec.template.fresh() for _ in sts]
            for p, st in zip(props, sts, strict=True):
                p.start(st)
        sync(dec.device)
        return time.perf_counter() - t, bp, props

    step = None
    for _ in range(2):  # a warm-up, then the timed readings and draft
        t_short, _, _ = reading(states(1, short))
        full = states(rows, tokens)
        t_long, bp, props = reading(full)
        step = time_draft(dec, bp, props, full)
    n_short, n_long = short - 1, rows * (tokens - 1)
    per = (t_long - t_short) / (n_long - n_short)
    if per <= 0:  # the longer reading timed no dearer (noise): priced by its tokens alone
        return 0.0, t_long / n_long, step
    return max(0.0, t_short - per * n_short), per, step


def time_draft(
    dec: BatchDecoder, bp, props: list[Proposer], states: list[DecodeState]
) -> float | None:
    """Seconds of one draft step of a ``gamma``-deep draft for ``states`` (one step for
    all of them with the batched drafter ``bp``, else one row's, averaged over the rows),
    as the run measures it."""
    if bp is not None:
        t = time.perf_counter()
        drafted = bp.propose(states, [dec.gamma] * len(states))
        sync(dec.device)
        if bp.last_step_seconds is not None:
            return bp.last_step_seconds
        steps = max((max(depths(d), default=0) for d in drafted), default=0)
        return (time.perf_counter() - t) / steps if steps else None
    times = []
    for p, st in zip(props, states, strict=True):
        t = time.perf_counter()
        d = p.propose(st, dec.gamma)
        sync(dec.device)
        steps = 1 if dec.template.parallel else max(depths(d), default=0)
        if p.measures_steps and p.last_step_seconds is not None:
            times.append(p.last_step_seconds)
        elif steps:
            times.append((time.perf_counter() - t) / steps)
    return sum(times) / len(times) if times else None
