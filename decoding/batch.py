"""Batched speculative decoding: B requests in flight, each accepting its own number of tokens.

The batch-1 decoder (``decoder.py``) stays the exact reference; this one serves a queue of
requests the way a server does: up to ``batch_size`` rows decode together, a finished row leaves
at once and a waiting request takes its place (continuous batching: the newcomers are prefilled
in groups of similar lengths and joined to the running cache).

**Ragged acceptance without moving the cache ("holes").** The batch shares one KV cache of
shape (B, heads, L, d) and a boolean ``valid`` (B, L): the columns each row attends to. A
verification forward appends n = 1 + (largest proposal in the batch) columns to every row (a
row with a shorter proposal pads with masked tokens); afterwards each row keeps the columns of
its last committed token and of its accepted nodes and marks the rest invalid (``keep_columns``).
Keys already carry their rotary position, so a row's kept columns need be neither contiguous nor
in order: nothing is copied at rollback, a tree's accepted path included. Columns no row keeps
are cut at either end of the cache, and when holes make up most of it, it is compacted once
(each row's valid columns gathered to the right, ``compact``). Every forward gets an explicit 4D
mask and per-row position ids (tokens count real positions only), so padding and holes never
shift a row's positions.

**Drafting.** A proposer that has a batched form (``Proposer.batched``: EAGLE chains and
EAGLE-2 trees, P-EAGLE, DFlash, Falcon chains, Medusa, draft LMs, the streaming self-draft)
drafts for every row in one forward per step (a tree: per level; P-EAGLE and DFlash: one per
iteration), over a ragged cache of its own; it reads a newcomer's sequence when the batch next
drafts, so while a policy decodes plain, newcomers cost it nothing. Any other proposer (n-gram
and prompt lookup, which cost no forward; Falcon's tree) is copied per row
(``Proposer.fresh``: same weights, its own caches and state) and drafts at batch 1. Verification, the cost that grows with the batch, is one forward. How many tokens
each row drafts is decided per iteration by a *policy*:

- ``fixed``: gamma (or the proposer's tree) every iteration;
- ``adaptive``: today's batch-1 gamma controller, one per request, blind to the batch;
- ``goodput`` (SmartSpec, Liu et al. 2024): one length for the whole batch, the one that
  maximises goodput = expected accepted tokens of all rows / predicted iteration time, with each
  request's acceptance tracked online and the step time from ``StepCostModel`` (a linear model
  of a forward's seconds in tokens and tokens x cache length, fitted to forwards timed on this
  machine and refitted as iterations run).

Exactness is per row: at T = 0 a row's output is its batch-1 greedy output (up to near-ties of
a k-token vs 1-token forward); at T > 0 each request has its own random stream (seeded by
``GenRequest.seed``), so what it samples does not depend on which requests share its batch.
"""

from __future__ import annotations

import math
import time
from collections import Counter, deque
from dataclasses import dataclass, field
from types import SimpleNamespace

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from models.base import DecodeState, Proposal, Proposer, cache_kw
from models.ragged import (
    additive_mask,
    causal_mask,
    join_rows,
    keep_columns,
    keep_rows,
    left_padded,
    new_cache,
    prefill_in_groups,
    prefill_waste,
    tidy,
)
from models.sampling import Sampling, greedy_tokens, warp
from models.target import GenRequest, Target

from .decoder import (
    GammaController,
    Stats,
    _depths,
    _is_chain,
    _sync,
    count_iteration,
)
from .verify import verify_greedy, verify_sampled

POLICIES = ("fixed", "adaptive", "goodput")


class BatchError(ValueError):
    """Settings the batched decoder cannot serve; the message says which and why."""


# -- the cost model (SmartSpec) -----------------------------------------------------------------


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
        #: seconds per token of the drafter's reading of a sequence (its prefill of a prompt,
        #: its catch-up), where measured (``BatchDecoder``'s calibration); not a forward's
        self.read_s_per_token: float | None = None
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
        d = torch.tensor([0.0, *(b - a for a, b in zip(x1, x, strict=True))], dtype=torch.float64)
        return float((d @ self.cov @ d).clamp_min(0.0).sqrt())

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
    def for_proposer(
        cls, target: Target, proposer: Proposer, gamma: int, batch_size: int
    ) -> StepCostModel:
        """A model calibrated for ``proposer`` at ``batch_size``: forwards of 1 and
        ``batch_size`` rows, of up to the most tokens one verification feeds it (a tree's whole
        size, not its depth; else gamma + 1), after caches of 128 and 512 columns."""
        k_top = (proposer.tree_nodes or proposer.tree_depth or gamma) + 1
        cost = cls()
        cost.calibrate(
            target,
            rows=sorted({1, batch_size}),
            ks=sorted({1, 2, max(1, k_top // 2), k_top}),
            lengths=[128, 512],
        )
        return cost

    @torch.no_grad()
    def calibrate(
        self, target: Target, rows: list[int], ks: list[int], lengths: list[int], reps: int = 3
    ) -> None:
        """Time forwards of every (rows, k, length) on random tokens (median of ``reps`` after a
        warm-up; shapes taken in turn within each repetition) and fit."""
        from models.base import crop_cache

        g = torch.Generator().manual_seed(0)
        vocab, dev = target.config.vocab_size, target.device
        for r in rows:
            for n in lengths:
                cache = new_cache(target.config)
                ctx = torch.randint(0, vocab, (r, n), generator=g).to(dev)
                target.model(
                    input_ids=ctx, **cache_kw(target.model, cache), use_cache=True, logits_to_keep=1
                )
                runs: dict[int, list[float]] = {k: [] for k in ks}
                for _ in range(reps + 1):
                    for k in ks:
                        ids = torch.randint(0, vocab, (r, k), generator=g).to(dev)
                        # as the decoder calls it: an explicit mask (a row sees the cache and
                        # its own tokens causally) and positions (PyTorch's attention takes
                        # another path without a mask: 1 ms faster for 4 rows of 1 token)
                        allowed = torch.ones(r, k, n + k, dtype=torch.bool)
                        allowed[:, :, n:] = torch.ones(k, k, dtype=torch.bool).tril()
                        mask = additive_mask(allowed, target.dtype)[:, None].to(dev)
                        pos = torch.arange(n, n + k).expand(r, k).to(dev)
                        _sync(dev)
                        t = time.perf_counter()
                        target.model(
                            input_ids=ids,
                            attention_mask=mask,
                            position_ids=pos,
                            **cache_kw(target.model, cache),
                            use_cache=True,
                        )
                        _sync(dev)
                        runs[k].append(time.perf_counter() - t)
                        crop_cache(cache, n)
                for k, ts in runs.items():
                    med = sorted(ts[1:])[len(ts[1:]) // 2]
                    self.samples.append((*self._x(r, k, n), med))
        self.fit()


# -- acceptance tracking ------------------------------------------------------------------------


@dataclass
class _Acceptance:
    """A request's running acceptance: exponentially decayed counts with a Beta(1, 1) prior
    (as ``GammaController``); for trees, the decayed mean tokens emitted per tree iteration."""

    decay: float = 0.9
    acc: float = 1.0
    tested: float = 2.0
    tree_tokens: float | None = None

    tree_sq: float = 0.0  # decayed mean of the square of tokens per tree iteration
    tree_n: float = 0.0  # decayed count of tree iterations

    @property
    def alpha(self) -> float:
        return self.acc / self.tested

    @property
    def alpha_sd(self) -> float:
        """Standard deviation of a's Beta posterior (the decayed counts)."""
        x, y = max(self.acc, 1e-9), max(self.tested - self.acc, 1e-9)
        return math.sqrt(x * y / ((x + y) ** 2 * (x + y + 1.0)))

    def tokens(self, g: int, alpha_sd: float) -> tuple[float, float]:
        """Expected tokens a chain of ``g`` emits, E = 1 + a + ... + a^g, and the error
        ``alpha_sd`` in a makes in it (through dE/da)."""
        a = min(max(self.alpha, 0.0), 1.0)
        if g == 0:
            return 1.0, 0.0
        slope = sum(j * a ** (j - 1) for j in range(1, g + 1))
        return GammaController.expected_tokens(a, g), slope * alpha_sd

    def tree_estimate(self) -> tuple[float, float]:
        """Mean tokens per tree iteration and its standard error: the trees' decayed average
        shrunk towards a prior of 2 tokens (variance 1) worth 2 trees, as a chain's rate starts
        from Beta(1, 1), so that one tree, accepted or not, does not settle it (2 and 0 before
        any: the first tree measures)."""
        m0, v0, w0 = 2.0, 1.0, 2.0
        if self.tree_tokens is None:
            return m0, 0.0
        n = self.tree_n
        mean = (n * self.tree_tokens + w0 * m0) / (n + w0)
        var = (n * max(0.0, self.tree_sq - self.tree_tokens**2) + w0 * v0) / (n + w0)
        return mean, math.sqrt(var / (n + w0))

    def update(self, tested: int, accepted: int, tree: bool) -> None:
        if tree:  # the decayed average: each tree weighs decay^age, the first no more
            x = accepted + 1.0
            if self.tree_tokens is None:
                self.tree_tokens, self.tree_sq, self.tree_n = x, x * x, 0.0
            n = self.decay * self.tree_n
            self.tree_tokens = (n * self.tree_tokens + x) / (n + 1.0)
            self.tree_sq = (n * self.tree_sq + x * x) / (n + 1.0)
            self.tree_n = n + 1.0
        elif tested:
            self.acc = self.acc * self.decay + accepted
            self.tested = self.tested * self.decay + tested


class GoodputPolicy:
    """SmartSpec's choice: before each iteration, one speculation length g in 0..gamma for
    the whole batch, the one maximising sum_rows E[tokens | g] / (drafting(g) + forward(rows,
    g + 1, cache length)), E[tokens | g] = (1 - a^(g+1)) / (1 - a) with each request's own a.
    A tree proposer's choice is between its whole tree and none. Drafting costs what it was
    measured to cost per step (per row and step where the rows draft one after another), and
    a drafter that has not read the rows' sequences (newcomers' prompts, tokens decoded while
    it did not draft) reads them first: that reading, priced per token as measured, is spread
    over ``probe_every`` choices. A tree is priced at its largest size until trees are seen.

    Each length is scored by a lower confidence bound of its goodput, ``caution`` standard
    errors below: expected tokens minus their standard error over the predicted time plus the
    standard error of verification's predicted extra cost (from the cost fit's coefficients).
    A chain's tokens are uncertain through the draft's skill on this workload, shared by every
    request: the pooled rate's Beta posterior, its error moving all rows together (each row's
    own rate sets its expected tokens); a tree's likewise, through the standard error of the
    pooled mean tokens per tree (each row's own mean sets its expected tokens; before any tree
    was pooled, each row's own error). Plain
    decoding (g = 0) has neither, so drafting is chosen only where its gain clears what the
    estimates cannot tell apart: a predicted 1% gain from a handful of observations (batch 1
    on a CPU where verification costs ~1.4 steps) is declined, a 20% one (batch 4, where a
    drafted token per row is nearly free to verify) is not. When it chooses 0 for
    ``probe_every`` iterations in a row it drafts 1 to notice if acceptance came back, so a
    useful draft is not forgotten. While the plain expectation (no caution) says a probe pays,
    the drafter's whole reading of what it has not read included, a probe is expected to bring
    more tokens than the time it takes, and only how few outcomes were seen keeps the bound
    below plain: it probes every ``probe_every`` choices (a good draft's unlucky first trees at
    batch 1 kept it off for ~190 of ~500 iterations when such probes waited as any other).
    Otherwise, after a probe that changed nothing it waits twice as long, and always long
    enough that probes cost at most ``probe_share`` of the time: a probe's cost is its draft
    step and larger verification beyond the predicted plain step (what the last probe
    measured, before the first one what the cost model predicts: a whole tree for 16 rows is a
    dear probe) plus the drafter's reading of what it has not read yet (the prompts of the
    requests that joined since it last drafted and the tokens decoded since), priced per token
    as measured (``saw_reading``; before any reading, as calibrated before the run). The
    reading grows while the policy waits, so where keeping a drafter's reading current costs
    more than ``probe_share`` of a plain step (16 rows on a 2-core CPU), probes stop at
    ``max_wait`` iterations apart. A draft step is priced as the run measures it, and
    before its first draft as the decoder timed one before the run (the cost model's
    ``draft_step_s``); where neither is known, at 0: the first draft measures it, and a draft
    that does not pay even for free is never run to find out.

    While requests wait, a row that finishes sooner lets one in, and tokens a second is the
    aim. With none waiting (``choose``'s ``remaining``), the batch drains and its time is its
    last rows': tokens are then valued by the plain time they save (``drain_tokens``)."""

    def __init__(
        self,
        gamma: int,
        cost: StepCostModel,
        parallel: bool,
        tree: bool = False,
        batched: bool = False,
        probe_every: int = 16,
        max_probe: int = 256,
        probe_share: float = 0.01,
        caution: float = 1.0,
        max_wait: int = 1024,
        tree_nodes: int | None = None,
    ):
        self.gamma, self.cost, self.parallel, self.tree = gamma, cost, parallel, tree
        self.caution = caution
        self.batched = batched  # one draft step serves every row (a BatchedProposer)
        self.t_step: float | None = None  # seconds of one draft step of one row, measured
        #: ... as timed before the run, until the run measures one (None: not timed)
        self.t_step_prior: float | None = getattr(cost, "draft_step_s", None)
        self.probe_every, self.max_probe = probe_every, max_probe
        self.wait, self.streak, self.probing = probe_every, 0, False
        self.probe_share, self.max_wait = probe_share, max_wait
        #: the last probe's cost beyond the plain step, its reading aside (None: no probe yet)
        self.probe_fixed: float | None = None
        #: seconds per token of the drafter's reading (a join's, a catch-up's); None: unknown
        self.t_read: float | None = getattr(cost, "read_s_per_token", None)
        self._unread = 0  # tokens the drafter had not read at the last choice
        self._plain_seconds: float | None = None  # predicted plain step of the last choice
        self.last_goodput: dict[int, float] = {}
        # a tree proposer: nodes per tree, measured; before any tree, its largest (a tree
        # priced at its depth would be priced at a third of its size: the first tree at 16
        # rows would look nearly free to verify)
        self.tree_nodes = float(tree_nodes or gamma)
        self.after_probe = False
        self.pool = _Acceptance(decay=0.98)  # every request's outcomes, pooled (slower decay)

    def saw_tree(self, nodes: int) -> None:
        self.tree_nodes = 0.8 * self.tree_nodes + 0.2 * nodes

    def draft_seconds(self, rows: int, g: int) -> float:
        t_step = self.t_step if self.t_step is not None else self.t_step_prior
        if g == 0 or t_step is None:
            return 0.0
        steps = 1 if self.parallel else (self.gamma if self.tree else g)
        return (1 if self.batched else rows) * steps * t_step

    def saw_reading(self, tokens: int, seconds: float) -> None:
        """The drafter read ``tokens`` tokens (a join, a row's start) in ``seconds``."""
        if tokens > 0:
            per = seconds / tokens
            self.t_read = per if self.t_read is None else 0.8 * self.t_read + 0.2 * per

    def plain_time(
        self, remaining: list[float], length: int, steps: list[float] | None = None
    ) -> float:
        """Predicted seconds for plain decoding to finish rows with ``remaining`` tokens left
        each: one token a row a step, the batch shrinking as rows finish (each stretch of steps
        priced at its rows, after ``length`` cache columns; ``steps[m]``: a step of m rows, where
        the caller has them)."""
        left = sorted(x for x in remaining if x > 0)
        total = prev = 0.0
        for j, x in enumerate(left):
            m = len(left) - j
            total += (x - prev) * (steps[m] if steps else self.cost.predict(m, 1, length))
            prev = x
        return total

    def drain_tokens(
        self,
        advances: list[float],
        remaining: list[int],
        length: int,
        _memo: tuple[list[float], float] | None = None,
    ) -> float:
        """With no request waiting, what rows advancing by ``advances`` tokens is worth, in a
        plain step's tokens: the plain time it saves (``plain_time`` before less after) over a
        plain step of all the rows, times the rows. A plain step (every row advances 1) is
        worth the rows exactly; advancing rows that finish early anyway is worth only what the
        batch, shrinking sooner, saves; advancing the row that finishes last, all of it (on a
        host-bound GPU, where a step costs the same at any rows, that row's advance is all
        that counts). ``_memo``: the step prices by rows and the time before, as ``choose``
        computes them once for all its lengths."""
        steps, before = _memo or self._drain_memo(remaining, length)
        rows = len(remaining)
        if steps[rows] <= 0:  # no cost model: the batch's tokens, as with requests waiting
            return sum(min(a, r) for a, r in zip(advances, remaining, strict=True))
        after = [r - a for r, a in zip(remaining, advances, strict=True)]
        saved = before - self.plain_time(after, length, steps)
        return rows * saved / steps[rows]

    def _drain_memo(self, remaining: list[int], length: int) -> tuple[list[float], float]:
        steps = [0.0] + [self.cost.predict(m, 1, length) for m in range(1, len(remaining) + 1)]
        return steps, self.plain_time(remaining, length, steps)

    def choose(
        self,
        acc: list[_Acceptance],
        caps: list[int],
        length: int,
        unread: int = 0,
        remaining: list[int] | None = None,
    ) -> int:
        """The batch's speculation length; ``unread``: tokens of the rows' sequences the
        drafter has not read (what drafting now would make it read first). ``remaining``:
        where no request waits, each row's tokens still to come (its budget less what it has
        made). Then the batch's time is what it takes its last rows to finish, not its tokens
        a second: tokens are valued by the plain time they save (``drain_tokens``), each
        row's expected advance lowered by ``caution`` of its error for the bound (the pooled
        skill's error moves every row at once; a row's own, each alone, counted here as if
        together: cautious)."""
        self.probing = False
        self._unread = unread
        cap = max(caps, default=0)
        if cap == 0:
            return 0
        rows = len(acc)
        self._plain_seconds = self.cost.predict(rows, 1, length)
        options = [0, cap] if self.tree else list(range(cap + 1))
        best, best_gp = 0, -1.0
        z = self.caution
        probe_g = self._probe_length(cap)
        probe_gp = 0.0  # a probe's expected goodput, the whole reading it needs included
        # a chain's tokens are uncertain through the draft's skill on this workload, which
        # every request shares: the pooled rate's error, moving all rows together
        pooled_sd = self.pool.alpha_sd
        # a tree's: the pooled mean's standard error (None before any tree: each row's own)
        tree_sd = self.pool.tree_estimate()[1] if self.pool.tree_tokens is not None else None
        memo = self._drain_memo(remaining, length) if remaining is not None else None
        for g in options:
            tokens = var = 0.0
            shared = 0.0  # the pooled skill's error, common to every row
            ts: list[float] = []  # each row's expected tokens and its error
            sds: list[float] = []
            for a, c in zip(acc, caps, strict=True):
                gg = min(g, c)
                if self.tree and gg:
                    t, sd = a.tree_estimate()
                    if tree_sd is None:
                        var += sd * sd
                    else:
                        shared += tree_sd
                        sd = tree_sd
                else:
                    t, sd = a.tokens(gg, pooled_sd)
                    shared += sd
                tokens += t
                ts.append(t)
                sds.append(sd)
            var += shared * shared
            if remaining is not None:
                low_tokens = self.drain_tokens(
                    [max(1.0, t - z * sd) for t, sd in zip(ts, sds, strict=True)],
                    remaining,
                    length,
                    memo,
                )
                tokens = self.drain_tokens(ts, remaining, length, memo)
            else:
                low_tokens = tokens - z * math.sqrt(var)
            k = self._verified(g)
            sec = self.draft_seconds(rows, g) + self.cost.predict(rows, k, length)
            reading = unread * (self.t_read or 0.0)
            if g == probe_g:
                probe_gp = tokens / max(sec + reading, 1e-9)
            if g:  # the drafter reads what it has not yet, once: spread over the next choices
                sec += reading / self.probe_every
            self.last_goodput[g] = tokens / max(sec, 1e-9)
            low = low_tokens / max(sec + z * self.cost.extra_sd(rows, k, length), 1e-9)
            if low > best_gp:
                best, best_gp = g, low
        # the plain expectation (no caution) says a probe pays, the whole reading it needs
        # included: it is expected to bring more tokens than the time it takes, and what keeps
        # the bound below plain is only how few outcomes were seen, which probes add to
        hopeful = probe_gp > self.last_goodput[0]
        if self.after_probe:  # did the probe's news make drafting pay? if not, wait longer
            self.after_probe = False
            self.wait = (
                self.probe_every
                if best > 0
                else min(
                    max(2 * self.wait, self._budget_wait(rows, cap, length, 0)), self.max_probe
                )
            )
        if best > 0:
            self.streak = 0
            return best
        self.streak += 1
        wait = (
            self.probe_every
            if hopeful
            else max(self.wait, self._budget_wait(rows, cap, length, unread))
        )
        if self.streak >= wait:
            self.streak, self.probing = 0, True
            return probe_g
        return 0

    def _probe_length(self, cap: int) -> int:
        """What a probe drafts: a tree proposer's whole tree, else one token."""
        return cap if self.tree else min(cap, 1)

    def _verified(self, g: int) -> int:
        """Tokens a row verifies after drafting ``g``: its nodes (a tree's as measured) and
        the token before them."""
        return 1 + (round(self.tree_nodes) if (self.tree and g) else g)

    def _budget_wait(self, rows: int, cap: int, length: int, unread: int) -> int:
        """Iterations of plain steps for a probe's cost now (its step and verification, as
        the last probe measured or the cost model predicts, and the reading of ``unread``
        tokens) to be ``probe_share`` of the time; at most ``max_wait``."""
        if not self._plain_seconds:
            return 0
        if self.probe_fixed is not None:
            fixed = self.probe_fixed
        else:
            g = self._probe_length(cap)
            extra = self.cost.predict(rows, self._verified(g), length) + self.draft_seconds(rows, g)
            fixed = max(0.0, extra - self._plain_seconds)
        extra = fixed + unread * (self.t_read or 0.0)
        need = math.ceil(extra / (self.probe_share * self._plain_seconds))
        return min(need, self.max_wait)

    def new_request(self) -> _Acceptance:
        """A request's acceptance before it has drafted: the batch's pooled rate, worth two
        observations, and the pooled mean tokens per tree (the draft's skill on this workload
        is the best guess for a newcomer)."""
        acc = _Acceptance(acc=2.0 * self.pool.alpha, tested=2.0)
        if self.pool.tree_tokens is not None:
            acc.tree_tokens, acc.tree_sq, acc.tree_n = self.pool.tree_tokens, self.pool.tree_sq, 2.0
        return acc

    def saw_row_tree(self, accepted: int) -> None:
        """One row's tree iteration: ``accepted`` of its nodes on the accepted path (pooled)."""
        self.pool.update(0, accepted, tree=True)

    def update(
        self,
        step_seconds: float | None,
        tested: int = 0,
        accepted: int = 0,
        iteration_seconds: float | None = None,
    ) -> None:
        """After an iteration: one draft step's seconds (None: not measured), the batch's
        tested and accepted draft tokens (for the pooled rate), and the iteration's drafting
        plus verification seconds (a probe's cost)."""
        if step_seconds is not None:
            self.t_step = (
                step_seconds if self.t_step is None else 0.8 * self.t_step + 0.2 * step_seconds
            )
        if tested:
            self.pool.acc = self.pool.acc * 0.98 + accepted
            self.pool.tested = self.pool.tested * 0.98 + tested
        if self.probing:
            self.after_probe = True
            plain = self._plain_seconds
            if iteration_seconds is not None and plain:
                # what it cost beyond a plain step, less its reading (priced afresh each time:
                # it grows with the wait)
                extra = max(0.0, iteration_seconds - plain)
                self.probe_fixed = max(0.0, extra - self._unread * (self.t_read or 0.0))


# -- the decoder --------------------------------------------------------------------------------


class _RowCache:
    """One row's columns of the batch's prefill cache (left-padded: the row's prompt fills
    the last columns), as the ``DecodeState.prefill_cache`` a self-drafter copies from:
    views, no copy; the prefill's tensors are never written in place afterwards (the batch
    cache grows into new room or new tensors)."""

    def __init__(self, cache: DynamicCache, row: int, first: int):
        self.layers = [
            SimpleNamespace(
                keys=layer.keys[row : row + 1, :, first:, :],
                values=layer.values[row : row + 1, :, first:, :],
            )
            for layer in cache.layers
        ]

    def get_seq_length(self) -> int:
        return self.layers[0].keys.shape[-2] if self.layers else 0


@dataclass
class _Row:
    key: object
    prompt: list[int]
    state: DecodeState
    proposer: Proposer
    controller: object | None
    acc: _Acceptance
    new: list[int] = field(default_factory=list)
    t_admit: float = 0.0
    t_arrive: float = 0.0  # when the request arrived (the run's start + its ``arrival``)
    t_first: float | None = None  # when its first new token came out
    budget: int = 0  # the request's own max_new_tokens
    calls0: int = 0
    started: bool = False
    read: int = 0  # tokens of the sequence its drafter has read (0: none yet)
    fbuf: torch.Tensor | None = None  # room for the features, grown by doubling

    def append_features(self, new: torch.Tensor) -> None:
        """Add target features for newly committed positions. ``state.features`` is a view
        of a buffer that doubles when full: a copy of the whole history per iteration and
        row (what ``torch.cat`` does) churns enough memory at batch 16 to slow the target's
        forwards by ~15% on a CPU."""
        f = self.state.features
        n = 0 if f is None else f.shape[0]
        k = new.shape[0]
        if (
            self.fbuf is None
            or n + k > self.fbuf.shape[0]
            or (f is not None and f.data_ptr() != self.fbuf.data_ptr())
        ):
            buf = new.new_empty(max(2 * (n + k), 64), *new.shape[1:])
            if n:
                buf[:n] = f
            self.fbuf = buf
        self.fbuf[n : n + k] = new
        self.state.features = self.fbuf[: n + k]


@dataclass
class BatchStats:
    """A batched run: the per-row counters pooled in ``rows`` (tau, alpha... as at batch 1:
    ``rows.target_calls`` counts row-iterations), the batch's own in ``forwards`` and the
    seconds, and each request's tokens and latency (admission to last token)."""

    rows: Stats = field(default_factory=Stats)
    forwards: int = 0  # batched verification forwards
    prefills: int = 0
    probes: int = 0  # goodput's probes: drafting chosen to learn, not because it paid
    # forwards with no request waiting (the batch drains: goodput values the last rows' time)
    drain_forwards: int = 0
    row_slots: int = 0  # rows summed over forwards (occupancy = row_slots / forwards)
    verified_tokens: int = 0  # query tokens fed to verification forwards, padding included
    batch_gamma: Counter = field(default_factory=Counter)  # the longest proposal per forward
    wall: float = 0.0
    requests: list[tuple[int, float]] = field(default_factory=list)  # (tokens, seconds)
    # each request's (seconds from its arrival to its first new token, to its last, tokens):
    # time to first token and end-to-end latency, queueing for a slot included
    latencies: list[tuple[float, float, int]] = field(default_factory=list)
    idle: float = 0.0  # seconds with no request in the batch and the next yet to arrive
    cache_columns: int = 0  # summed over forwards: columns attended (holes and padding too)
    valid_columns: int = 0

    @property
    def tokens_per_second(self) -> float:
        return self.rows.new_tokens / self.wall if self.wall else float("nan")

    @property
    def request_tokens_per_second(self) -> float:
        """Mean over requests of tokens / (finish - admission)."""
        rs = [n / s for n, s in self.requests if s > 0]
        return sum(rs) / len(rs) if rs else float("nan")

    def latency_summary(self) -> dict[str, dict[str, float]]:
        """Over the requests, in seconds: time to first token (``ttft``: arrival to the first
        new token, waiting for a slot and the prefill included), time per output token after
        the first (``tpot``: (latency - ttft) / (tokens - 1), vLLM's benchmark_serving
        definition; requests of one token have none) and end-to-end ``latency``; each as
        mean, p50, p90 and p99 (linear interpolation between order statistics)."""

        def summary(xs: list[float]) -> dict[str, float]:
            if not xs:
                return {k: float("nan") for k in ("mean", "p50", "p90", "p99")}
            t = torch.tensor(xs, dtype=torch.float64)
            q = torch.quantile(t, torch.tensor([0.5, 0.9, 0.99], dtype=torch.float64)).tolist()
            return {"mean": float(t.mean()), "p50": q[0], "p90": q[1], "p99": q[2]}

        return {
            "ttft": summary([a for a, _, _ in self.latencies]),
            "tpot": summary([(e - a) / (n - 1) for a, e, n in self.latencies if n > 1]),
            "latency": summary([e for _, e, _ in self.latencies]),
        }


class BatchDecoder:
    """Continuous-batching speculative decoding of ``target`` with one proposer per row.

    ``proposer``: a template; each row gets ``proposer.fresh()``. ``policy``: fixed, adaptive or
    goodput (module docstring). ``run`` decodes a list of ``GenRequest`` and returns
    {key: new tokens}; ``stats`` holds the last run's ``BatchStats``."""

    def __init__(
        self,
        target: Target,
        proposer: Proposer,
        sampling: Sampling,
        batch_size: int,
        gamma: int = 4,
        policy: str = "fixed",
        calibrate: bool = True,
        cost: StepCostModel | None = None,
        admit: int = 1,
    ):
        if batch_size < 1:
            raise BatchError(f"batch_size={batch_size}: must be >= 1")
        if not 1 <= admit <= batch_size:
            raise BatchError(f"admit={admit}: must be between 1 and the batch size ({batch_size})")
        if gamma < 0:
            raise BatchError(f"gamma={gamma}: must be >= 0")
        if policy not in POLICIES:
            raise BatchError(f"policy {policy!r}: use one of {', '.join(POLICIES)}")
        check_batchable(target, proposer)
        self.target, self.template, self.sampling = target, proposer, sampling
        self.batch_size, self.policy = batch_size, policy
        # waiting requests join once this many slots are free (each join is a prefill forward,
        # grouped by length, and a copy of the running cache)
        self.admit = admit
        self.tree = proposer.tree_depth is not None
        self.gamma = proposer.tree_depth if self.tree else gamma
        self.device = target.device
        self.prefill_waste = prefill_waste(self.device)
        self.layers = tuple(proposer.feature_layers)
        self.t_verify1: list[float] | None = None
        if policy == "adaptive" and self.gamma and calibrate:
            from .decoder import SpeculativeDecoder

            # today's controller, as at batch 1: the batch-1 cost of each verification size,
            # on transformers' forward (the batched decoder's own)
            probe = SpeculativeDecoder(
                target,
                proposer,
                sampling,
                gamma=self.gamma,
                adaptive=False,
                calibrate=False,
                compile="false",
            )
            self.t_verify1 = probe.forward_costs(range(1, self.gamma + 2))
        self.cost = cost
        if policy == "goodput" and self.gamma:
            if self.cost is None:
                self.cost = (
                    StepCostModel.for_proposer(target, proposer, gamma, batch_size)
                    if calibrate
                    else StepCostModel()
                )
        # a drafter that drafts for all rows in one forward per step, where the proposer has one
        self.batched_drafting = proposer.batched() is not None
        self.bp = None
        if (
            policy == "goodput"
            and self.gamma
            and calibrate
            and not proposer.free
            and self.cost.read_s_per_token is None
        ):
            self.cost.read_s_per_token, self.cost.draft_step_s = self._drafting_cost()
        self.goodput = (
            GoodputPolicy(
                self.gamma,
                self.cost,
                proposer.parallel,
                tree=self.tree,
                batched=self.batched_drafting,
                tree_nodes=proposer.tree_nodes,
            )
            if policy == "goodput" and self.gamma
            else None
        )
        self.stats = BatchStats()

    # -- helpers -------------------------------------------------------------------------

    @torch.no_grad()
    def _drafting_cost(self, rows: int = 2, tokens: int = 96) -> tuple[float, float | None]:
        """Seconds per token of the drafter's reading of sequences it has not seen (a batched
        drafter's join, a row-by-row proposer's start) and seconds of one draft step (None:
        not measured), timed on ``rows`` random prompts of ``tokens`` tokens after an untimed
        reading and draft: the goodput policy prices its first drafts and probes with them
        before the run has measured its own (a draft step priced at nothing made the first
        choice a draft, whatever drafting costs here)."""
        g = torch.Generator().manual_seed(1)
        vocab = self.target.config.vocab_size
        reqs = [
            GenRequest(("calibration", i), torch.randint(0, vocab, (tokens,), generator=g).tolist())
            for i in range(rows)
        ]
        _, _, feats, views = self._prefill(reqs)
        seconds, step = 0.0, None
        for _ in range(2):  # a warm-up, then the timed reading and draft
            states = [
                DecodeState(
                    ids=list(r.prompt),
                    features=f,
                    sampling=self.sampling,
                    generator=torch.Generator(device=self.device).manual_seed(0),
                    device=self.device,
                    prefill_cache=v,
                )
                for r, f, v in zip(reqs, feats, views, strict=True)
            ]
            _sync(self.device)
            t = time.perf_counter()
            bp = self.template.batched()
            props = []
            if bp is not None:
                bp.join(states)
            else:
                props = [self.template.fresh() for _ in states]
                for p, st in zip(props, states, strict=True):
                    p.start(st)
            _sync(self.device)
            seconds = time.perf_counter() - t
            step = self._time_draft(bp, props, states)
        return seconds / (rows * (tokens - 1)), step

    def _time_draft(self, bp, props: list[Proposer], states: list[DecodeState]) -> float | None:
        """Seconds of one draft step of a ``gamma``-deep draft for ``states`` (one step for
        all of them with the batched drafter ``bp``, else one row's, averaged over the rows),
        as the run measures it."""
        if bp is not None:
            t = time.perf_counter()
            drafted = bp.propose(states, [self.gamma] * len(states))
            _sync(self.device)
            if bp.last_step_seconds is not None:
                return bp.last_step_seconds
            steps = max((max(_depths(d), default=0) for d in drafted), default=0)
            return (time.perf_counter() - t) / steps if steps else None
        times = []
        for p, st in zip(props, states, strict=True):
            t = time.perf_counter()
            d = p.propose(st, self.gamma)
            _sync(self.device)
            steps = 1 if self.template.parallel else max(_depths(d), default=0)
            if p.measures_steps and p.last_step_seconds is not None:
                times.append(p.last_step_seconds)
            elif steps:
                times.append((time.perf_counter() - t) / steps)
        return sum(times) / len(times) if times else None

    def _controller(self):
        if self.policy != "adaptive" or not self.gamma:
            return None
        t = self.t_verify1 or [1.0 + 0.01 * k for k in range(self.gamma + 1)]
        if self.tree:
            from .decoder import TreeController

            return TreeController(self.gamma, True, t[0])
        return GammaController(self.gamma, True, t, parallel=self.template.parallel)

    @torch.no_grad()
    def _prefill(self, reqs: list[GenRequest]):
        """Prefill the prompts but their last token, left-padded (one masked pad column for a
        one-token prompt), in groups of similar lengths (``prefill_groups``). Returns the
        cache and its ``valid`` (rows in the requests' order), each request's features and
        its rows of the prefill cache (for a drafter that copies them)."""
        fed_all = [r.prompt[:-1] for r in reqs]
        feats: list = [None] * len(reqs)
        views: list = [None] * len(reqs)

        def prefill(g: list[int]):
            fed = [fed_all[i] for i in g]
            ids, pos, real = left_padded(fed, [0] * len(fed))
            n = ids.shape[1]
            allowed = causal_mask(torch.zeros(len(fed), 0, dtype=torch.bool), real)
            cache = new_cache(self.target.config)
            _, h = self._forward(ids, pos, allowed, cache, logits_to_keep=1)
            for j, (i, f) in enumerate(zip(g, fed, strict=True)):
                if h is not None and f:
                    feats[i] = h[j, n - len(f) :]
                if f and self.template.reads_prefill_cache:
                    views[i] = _RowCache(cache, j, n - len(f))
            return cache, real.to(self.device)

        lengths = [len(f) for f in fed_all]
        cache, valid = prefill_in_groups(lengths, self.prefill_waste, prefill)
        return cache, valid, feats, views

    def _forward(self, ids, pos, allowed: torch.Tensor, cache, **kw):
        """The target over ``ids`` at positions ``pos`` with the boolean attention ``allowed``
        (R, n, columns), appending to ``cache``: its output and the drafter's features (R, n,
        layers, H), None where it reads none."""
        return self.target.forward_features(
            self.layers,
            input_ids=ids.to(self.device),
            attention_mask=additive_mask(allowed, self.target.dtype)[:, None].to(self.device),
            position_ids=pos.to(self.device),
            **cache_kw(self.target.model, cache),
            use_cache=True,
            **kw,
        )

    # -- the loop ------------------------------------------------------------------------

    @torch.no_grad()
    def run(
        self,
        requests: list[GenRequest],
        max_new_tokens: int,
        stop_ids: set[int] | frozenset[int] = frozenset(),
        progress=None,
    ) -> dict:
        """Decode every request; ``progress(n)`` is called with each finished request's token
        count (a progress bar's update)."""
        for r in requests:
            if not r.prompt:
                raise BatchError(f"request {r.key!r}: empty prompt")
        st = BatchStats()
        self.stats = st
        self.bp = self.template.batched()  # fresh for this run (None: row-by-row drafting)
        joined = 0  # rows[:joined] are the batched drafter's rows
        for r in requests:
            if not (r.arrival >= 0 and math.isfinite(r.arrival)):
                raise BatchError(f"request {r.key!r}: arrival={r.arrival} (seconds >= 0)")
        t0 = time.perf_counter()
        # in order of arrival (all at 0: the given order)
        queue = deque(sorted(requests, key=lambda r: r.arrival))
        rows: list[_Row] = []
        cache: DynamicCache | None = None
        valid: torch.Tensor | None = None
        done: dict = {}
        greedy = self.sampling.greedy
        B = self.batch_size
        while queue or rows:
            free = B - len(rows)
            now = time.perf_counter() - t0
            if not rows and queue[0].arrival > now:  # nothing to decode until the next arrives
                time.sleep(queue[0].arrival - now)
                st.idle += time.perf_counter() - t0 - now
                now = time.perf_counter() - t0
            arrived = 0  # the requests waiting now (the queue is in order of arrival)
            while arrived < len(queue) and queue[arrived].arrival <= now:
                arrived += 1
            if arrived and free and (not rows or free >= min(self.admit, arrived)):
                reqs = [queue.popleft() for _ in range(min(free, arrived))]
                t = time.perf_counter()
                c, v, feats, views = self._prefill(reqs)
                cache, valid = join_rows(cache, valid, c, v)
                _sync(self.device)
                st.rows.t_prefill += time.perf_counter() - t
                st.prefills += 1
                for r, f, view in zip(reqs, feats, views, strict=True):
                    gen = None
                    if not greedy:
                        gen = torch.Generator(device=self.device).manual_seed(int(r.seed))
                    state = DecodeState(
                        ids=list(r.prompt),
                        features=f,
                        sampling=self.sampling,
                        generator=gen,
                        device=self.device,
                        prefill_cache=view,
                    )
                    prop = self.template.fresh()
                    acc = self.goodput.new_request() if self.goodput else _Acceptance()
                    row = _Row(
                        r.key,
                        list(r.prompt),
                        state,
                        prop,
                        self._controller(),
                        acc,
                        t_admit=time.perf_counter(),
                        t_arrive=t0 + r.arrival,
                        budget=r.budget(max_new_tokens),
                        calls0=prop.draft_calls,
                    )
                    rows.append(row)  # its proposer starts when the row first drafts
                    # a batched drafter reads the newcomers' prompts when the batch next drafts
                # (``_join_drafter``): while the policy decodes plain, newcomers cost it nothing
            # -- how much each row drafts
            limits = [r.budget - len(r.new) - 1 for r in rows]
            length = valid.shape[1]
            props: list[Proposal] = []
            self._t_start = 0.0
            t = time.perf_counter()
            step_times: list[float] = []
            gs: list[int] | None = None  # per-row lengths for a drafter sized before drafting
            if self.goodput is not None:
                caps = [max(0, min(self.gamma, lim)) for lim in limits]
                if self.template.free:  # a lookup drafts first; the policy sizes it
                    found = [
                        self._propose(r, c) if c else Proposal([], [])
                        for r, c in zip(rows, caps, strict=True)
                    ]
                    caps = [min(c, len(p)) for c, p in zip(caps, found, strict=True)]
                unread = (
                    0
                    if self.template.free
                    else sum(max(0, len(r.state.ids) - 1 - r.read) for r in rows)
                )
                # no request waiting: the batch drains, its time set by its last rows
                remaining = [r.budget - len(r.new) for r in rows] if not queue else None
                g = self.goodput.choose([r.acc for r in rows], caps, length, unread, remaining)
                st.probes += self.goodput.probing
                if self.template.free:
                    props = [f.truncated(min(g, c)) for f, c in zip(found, caps, strict=True)]
                else:
                    gs = [min(g, c) if not self.tree else (c if g else 0) for c in caps]
            elif self.template.free:
                for r, lim in zip(rows, limits, strict=True):
                    cap = max(0, min(self.gamma, lim))
                    ctl = r.controller
                    p = self._propose(r, cap) if cap else Proposal([], [])
                    gg = ctl.choose(len(p), p.bucket) if (ctl and len(p)) else len(p)
                    props.append(p.truncated(gg))
            else:
                gs = []
                for r, lim in zip(rows, limits, strict=True):
                    cap = max(0, min(self.gamma, lim))
                    gs.append(r.controller.choose(cap) if r.controller else cap)
            if gs is not None and self.bp is not None:
                if max(gs, default=0):
                    joined = self._join_drafter(rows, joined)
                    props = self.bp.propose([r.state for r in rows], gs)
                    for r in rows:  # it caught every row up
                        r.read = len(r.state.ids) - 1
                    if self.bp.last_step_seconds is not None:
                        step_times.append(self.bp.last_step_seconds)
                else:
                    props = [Proposal([], []) for _ in rows]
            elif gs is not None:
                for r, gg in zip(rows, gs, strict=True):
                    props.append(self._propose(r, gg) if gg else Proposal([], []))
                    if gg:
                        r.read = len(r.state.ids) - 1
                    self._step_time(r, props[-1], step_times)
            _sync(self.device)
            t_draft = time.perf_counter() - t - self._t_start
            st.rows.t_prefill += self._t_start
            # -- one verification forward for the batch
            n = 1 + max(len(p) for p in props)
            R = len(rows)
            ids = torch.zeros(R, n, dtype=torch.long)
            pos = torch.zeros(R, n, dtype=torch.long)
            inner = torch.eye(n, dtype=torch.bool).repeat(R, 1, 1)
            for b, (r, p) in enumerate(zip(rows, props, strict=True)):
                base = len(r.state.ids) - 1
                ids[b, : len(p) + 1] = torch.tensor([r.state.ids[-1]] + p.tokens)
                depth = [0] + _depths(p)
                pos[b, : len(p) + 1] = torch.tensor(depth) + base
                pos[b, len(p) + 1 :] = base
                for i, par in enumerate(p.parents):
                    inner[b, i + 1] = inner[b, par + 1]
                    inner[b, i + 1, i + 1] = True
            allowed = torch.cat([valid[:, None, :].expand(R, n, length).cpu(), inner], dim=2)
            t = time.perf_counter()
            out, feats = self._forward(ids, pos, allowed, cache)
            logits = out.logits
            _sync(self.device)
            t_verify = time.perf_counter() - t
            st.cache_columns += R * length
            st.valid_columns += int(valid.sum())
            valid = torch.cat([valid, valid.new_zeros(R, n)], dim=1)
            # -- each row accepts its own
            arg = greedy_tokens(logits).tolist() if greedy else None
            keeps: list[list[int]] = []
            finished: list[int] = []
            it_tested = it_accepted = 0
            for b, (r, p) in enumerate(zip(rows, props, strict=True)):
                m = len(p) + 1
                if greedy:
                    verdict = verify_greedy(p.tokens, p.parents, arg[b][:m])
                else:
                    probs = warp(logits[b, :m], self.sampling)
                    verdict = verify_sampled(p.tokens, p.parents, probs, p.q, r.state.generator)
                path = verdict.path
                keeps.append([0] + [i + 1 for i in path])
                if feats is not None:
                    r.append_features(feats[b, keeps[-1]])
                emitted = [p.tokens[i] for i in path] + [verdict.token]
                for j, tok in enumerate(emitted):
                    if tok in stop_ids:
                        emitted = emitted[: j + 1]
                        break
                r.state.ids.extend(emitted)
                r.new.extend(emitted)
                if r.started and self.bp is None:
                    r.proposer.rollback(r.state, len(path))
                tested = count_iteration(st.rows, p, path)
                it_tested += tested
                it_accepted += len(path)
                # a tree proposer's every tree counts as one, a chain-shaped one too (a tree
                # sized by min_prob is a chain where the draft is sure: counting only the
                # branching ones would count its doubts alone)
                as_tree = bool(p.tokens) and (self.tree or not _is_chain(p))
                r.acc.update(tested, len(path), as_tree)
                if self.goodput is not None and as_tree:
                    self.goodput.saw_row_tree(len(path))
                if r.controller is not None:
                    step = (
                        self.bp.last_step_seconds
                        if self.bp is not None
                        else (
                            r.proposer.last_step_seconds
                            if r.proposer.measures_steps
                            else (t_draft / max(1, sum(len(q) for q in props)) if len(p) else None)
                        )
                    )
                    r.controller.update(
                        len(p), tested, len(path), step, t_verify, p.bucket, t_draft=t_draft / R
                    )
                if emitted[-1] in stop_ids or len(r.new) >= r.budget:
                    finished.append(b)
            keep_columns(valid, length, keeps)
            if self.goodput is not None:
                self.cost.observe(R, n, length, t_verify)
                clean = [s for s in step_times if s is not None]
                steps = sum(
                    (1 if self.template.parallel else max(_depths(p), default=0)) for p in props
                )
                if self.bp is not None:  # one step drafts for every row
                    steps = max((len(p) for p in props), default=0)
                if not clean and steps:  # a proposer without its own measure: time / steps
                    clean = [t_draft / steps]
                self.goodput.update(
                    sum(clean) / len(clean) if clean else None,
                    it_tested,
                    it_accepted,
                    # a probe also pays for the drafter reading the rows that joined since
                    # it last drafted (``_t_start``, counted as prefill in the report)
                    iteration_seconds=t_draft + t_verify + self._t_start,
                )
                if self.tree and n > 1:
                    self.goodput.saw_tree(n - 1)
            st.rows.t_target += t_verify
            st.rows.t_draft += t_draft
            st.forwards += 1
            st.drain_forwards += not queue
            st.row_slots += R
            st.verified_tokens += R * n
            st.batch_gamma[n - 1] += 1
            now = time.perf_counter()
            for r in rows:
                if r.t_first is None and r.new:
                    r.t_first = now
            if finished:
                for b in finished:
                    r = rows[b]
                    out_tokens = r.new[: r.budget]
                    done[r.key] = out_tokens
                    st.rows.new_tokens += len(out_tokens)
                    if self.bp is None:
                        st.rows.draft_calls += r.proposer.draft_calls - r.calls0
                    st.requests.append((len(out_tokens), now - r.t_admit))
                    st.latencies.append((r.t_first - r.t_arrive, now - r.t_arrive, len(out_tokens)))
                    if progress is not None:
                        progress(1)
                keep = [b for b in range(R) if b not in set(finished)]
                rows = [rows[b] for b in keep]
                if not rows:
                    cache = valid = None
                    if self.bp is not None:
                        self.bp.select([])
                        joined = 0
                    continue
                cache, valid = keep_rows(cache, valid, keep)
                if self.bp is not None:
                    kept = [b for b in keep if b < joined]
                    self.bp.select(kept)
                    joined = len(kept)
            if self.bp is not None:
                self.bp.rollback([r.state for r in rows[:joined]], [])
            valid = tidy(cache, valid)
        st.wall = time.perf_counter() - t0
        st.rows.t_total = st.wall
        if self.bp is not None:
            st.rows.draft_calls += self.bp.draft_calls
        return done

    def _join_drafter(self, rows: list[_Row], joined: int) -> int:
        """Let the batched drafter read the rows it has not seen (rows[joined:]) before the
        batch drafts: its prefill of their prompts and of what they decoded since, counted as
        prefill, as a row-by-row proposer's start (``_propose``). Returns the new count."""
        if joined < len(rows):
            t = time.perf_counter()
            self.bp.join([r.state for r in rows[joined:]])
            for r in rows[joined:]:
                r.state.prefill_cache = None  # read once: the batch's prefill can go
            dt = time.perf_counter() - t
            self._t_start += dt
            if self.goodput is not None:  # what reading costs, for pricing the next probe
                self.goodput.saw_reading(sum(len(r.state.ids) - 1 for r in rows[joined:]), dt)
        return len(rows)

    def _propose(self, r: _Row, g: int) -> Proposal:
        """Row ``r``'s proposal of ``g`` tokens. A row's proposer starts (reads the sequence
        so far: a draft model's or head's prefill) when the row first drafts, so rows that
        never draft (a policy that chose 0 all along) never pay for it; that time counts as
        prefill, not drafting."""
        if not r.started:
            t = time.perf_counter()
            r.proposer.start(r.state)
            r.state.prefill_cache = None
            r.started = True
            dt = time.perf_counter() - t
            self._t_start += dt
            if self.goodput is not None:
                self.goodput.saw_reading(len(r.state.ids) - 1, dt)
        return r.proposer.propose(r.state, g)

    @staticmethod
    def _step_time(row: _Row, p: Proposal, out: list) -> None:
        if len(p) and row.proposer.measures_steps:
            out.append(row.proposer.last_step_seconds)


def check_batchable(target: Target, proposer: Proposer) -> None:
    """``BatchError`` for a proposer or target the batched decoder cannot serve."""
    if type(proposer).side_branch is not Proposer.side_branch:
        raise BatchError(
            f"draft {proposer.name}: adds a side branch to each verification forward "
            "(lookahead's Jacobi window), which the batched decoder does not carry; use "
            "batch_size=1 for it"
        )
    if any(type(x) is not DynamicLayer for x in DynamicCache(config=target.config).layers):
        raise BatchError(
            f"target {target.identity}: batch_size > 1 needs full-attention cache layers "
            "(this model has sliding-window or other layers); use batch_size=1"
        )


def check_batch_settings(cfg, target: Target, proposer: Proposer) -> None:
    """One-line errors for evaluator settings the batched decoder does not serve."""
    check_batchable(target, proposer)
    if cfg.acceptance != "exact":
        raise BatchError(f"acceptance={cfg.acceptance} with batch_size > 1: only exact")
    if cfg.lenience != 1.0:
        raise BatchError(f"lenience={cfg.lenience} with batch_size > 1: only exact (1)")
    if cfg.stop == "disco" or cfg.traces:
        raise BatchError("stop=disco / traces with batch_size > 1: use batch_size=1")
    if cfg.turns != 1:
        raise BatchError(
            f"turns={cfg.turns} with batch_size > 1: later turns wait on earlier answers; "
            "use turns=1"
        )
    if cfg.compare_hf:
        raise BatchError(
            "compare_hf with batch_size > 1: transformers' assisted generation decodes one sequence"
        )


def _f(x, nd=2) -> str:
    return "n/a" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.{nd}f}"


def has_rates(rows: list[dict]) -> bool:
    """Whether a sweep's rows are at arrival rates (``request_rates``)."""
    return any(r.get("request_rate") is not None for r in rows)


def _rate(row: dict) -> str:
    """A sweep row's arrival rate as a table cell."""
    rate = row.get("request_rate")
    return "all at 0" if rate is None else f"{rate:g}"


def speedup_table(rows: list[dict]) -> str:
    """A Markdown table of a batch sweep (``decoding.eval`` rows); a column of arrival rates
    where the sweep has them."""
    rated = has_rates(rows)
    head = (
        "| batch | "
        + ("requests/s | " if rated else "")
        + "policy | plain tok/s | spec tok/s | speedup | after prefill | per-request "
        "tok/s (plain / spec) | rows per forward (plain / spec) | tau | alpha | mean gamma | "
        "lossless |\n"
        "|---|---|---|---|---|---|---|---|---|---|---|---|" + ("---|" if rated else "")
    )
    lines = [head]
    f = _f
    for r in rows:
        lines.append(
            f"| {r['batch_size']} | "
            + (f"{_rate(r)} | " if rated else "")
            + f"{r['policy']} | {f(r['plain_tokens_per_second'], 1)} | "
            f"{f(r['tokens_per_second'], 1)} | {f(r['speedup'])}x | "
            f"{f(r.get('decode_speedup'))}x | {f(r['plain_request_tokens_per_second'], 1)} / "
            f"{f(r['request_tokens_per_second'], 1)} | "
            f"{f(r.get('plain_mean_rows_per_forward'), 1)} / {f(r.get('mean_rows_per_forward'), 1)} | "
            f"{f(r['tau'])} | {f(r['alpha'])} | "
            f"{f(r['mean_gamma'])} | {r['lossless']} |"
        )
    return "\n".join(lines)


def latency_table(rows: list[dict]) -> str:
    """Per-request latency of a sweep with arrival rates (``decoding.eval`` rows), plain /
    speculative: mean and p99 end-to-end latency and time to first token, mean time per
    output token after the first, and plain's mean latency over speculation's."""
    lines = [
        "| batch | requests/s | policy | latency mean, s | latency p99, s | TTFT mean, s | "
        "TPOT mean, ms | latency speedup | mean gamma |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    f = _f
    for r in rows:
        p, s = r["plain_latency"], r["latency"]
        lines.append(
            f"| {r['batch_size']} | {_rate(r)} | "
            f"{r['policy']} | {f(p['latency']['mean'])} / {f(s['latency']['mean'])} | "
            f"{f(p['latency']['p99'])} / {f(s['latency']['p99'])} | "
            f"{f(p['ttft']['mean'])} / {f(s['ttft']['mean'])} | "
            f"{f(1e3 * p['tpot']['mean'], 1)} / {f(1e3 * s['tpot']['mean'], 1)} | "
            f"{f(r['latency_speedup'])}x | {f(r['mean_gamma'])} |"
        )
    return "\n".join(lines)
