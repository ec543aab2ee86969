"""How much to draft: the decoders' policies, on the acceptance they track.

- ``GammaController`` (batch 1, chains): the gamma that maximises expected tokens per second
  from the running acceptance and the measured costs of drafting and verifying (Leviathan et
  al.), with probes once it stops drafting.
- ``TreeController`` (batch 1, trees verified whole): draft a tree only while trees are
  measured faster than plain decoding.
- ``GoodputPolicy`` (the batched decoder; SmartSpec, Liu et al. 2024): one speculation length
  for the whole batch, the one that maximises expected accepted tokens over the predicted step
  time (``costs.StepCostModel``), each request's acceptance tracked online (``_Acceptance``).

The decoders (``decoder.py``, ``batch.py``) ask them what to draft and tell them what happened;
nothing here runs a decoding loop.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .costs import StepCostModel


class GammaController:
    """Chooses how many draft tokens to verify each iteration.

    With ``adaptive`` off it always drafts ``gamma``. With it on, it picks the gamma in
    0..gamma_max that maximises expected tokens per second, E[tokens] / (gamma * t_draft +
    t_verify(gamma)), with E[tokens] = (1 - a^(g+1)) / (1 - a) (Leviathan et al.), a the running
    acceptance (exponentially decayed counts with a Beta(1, 1) prior), t_draft the measured time
    per draft step and t_verify(g) the measured time of a target forward over g + 1 tokens.

    Acceptance is tracked per *bucket*: a proposal may say how confident it is (an n-gram match
    of length n, say), and each bucket keeps its own rate. A draft with no skill drives gamma to
    0 (plain decoding); after ``probe_every`` such iterations it drafts one token to notice if
    acceptance has come back, and each probe that fails doubles the wait (up to ``max_probe``),
    so a useless draft costs almost nothing.
    """

    def __init__(
        self,
        gamma: int,
        adaptive: bool,
        t_verify: list[float],
        decay: float = 0.9,
        probe_every: int = 16,
        max_probe: int = 256,
        parallel: bool = False,
    ):
        self.gamma, self.adaptive, self.parallel = gamma, adaptive, parallel
        self.t_verify = list(t_verify)  # index k: forward over k + 1 tokens
        self.decay, self.probe_every, self.max_probe = decay, probe_every, max_probe
        self.counts: dict[str | None, list[float]] = {}  # bucket -> [accepted, tested]
        self.t_draft: float | None = None
        self.zero_streak: dict[str | None, int] = {}
        self.wait: dict[str | None, int] = {}
        self.probing = False

    def alpha(self, bucket: str | None = None) -> float:
        acc, tested = self.counts.get(bucket, (1.0, 2.0))  # prior mean 0.5
        return acc / tested

    @staticmethod
    def expected_tokens(alpha: float, g: int) -> float:
        if alpha >= 1.0 - 1e-9:
            return g + 1.0
        return (1.0 - alpha ** (g + 1)) / (1.0 - alpha)

    def draft_cost(self, g: int) -> float:
        """Seconds to draft ``g`` tokens: g steps, or one forward for a parallel drafter."""
        if g == 0:
            return 0.0
        return self.t_draft if self.parallel else g * self.t_draft

    def choose(self, limit: int, bucket: str | None = None) -> int:
        self.probing = False
        cap = max(0, min(self.gamma, limit))
        if not self.adaptive or cap == 0:
            return cap
        if self.t_draft is None:
            return min(cap, 2)  # measure the draft's cost first
        a = self.alpha(bucket)
        best = max(
            range(cap + 1),
            key=lambda g: self.expected_tokens(a, g) / (self.draft_cost(g) + self.t_verify[g]),
        )
        if best > 0:
            self.zero_streak[bucket] = 0
            return best
        streak = self.zero_streak.get(bucket, 0) + 1
        self.zero_streak[bucket] = streak
        if streak >= self.wait.get(bucket, self.probe_every):
            self.zero_streak[bucket] = 0
            self.probing = True
            return 1
        return 0

    def update(
        self,
        g: int,
        tested: int,
        accepted: int,
        step_seconds: float | None,
        t_verify: float,
        bucket: str | None = None,
        t_draft: float = 0.0,
    ) -> None:
        """After an iteration that verified ``g`` draft tokens. ``step_seconds``: the measured
        cost of one draft step this iteration (None: nothing measured); ``t_draft``: the
        iteration's whole drafting time (used by ``TreeController``)."""
        if g > 0:
            acc, n = self.counts.get(bucket, (1.0, 2.0))
            self.counts[bucket] = [acc * self.decay + accepted, n * self.decay + tested]
            if self.probing:
                w = self.wait.get(bucket, self.probe_every)
                self.wait[bucket] = self.probe_every if accepted else min(2 * w, self.max_probe)
        if step_seconds is not None:
            self.t_draft = (
                step_seconds if self.t_draft is None else 0.8 * self.t_draft + 0.2 * step_seconds
            )
        if g < len(self.t_verify):  # a tree may verify more nodes than gamma
            self.t_verify[g] = 0.8 * self.t_verify[g] + 0.2 * t_verify


class TreeController:
    """Whether to draft a tree this iteration (trees are verified whole: their size is the
    proposer's). With ``adaptive`` on it compares the measured rate of tree iterations
    (emitted tokens over drafting + verification seconds, decayed sums, once ``min_trees``
    trees are measured) with plain decoding's (one token per single-token verification) and
    drafts only while trees are the faster of the two; when they are not it probes with a tree
    now and then, waiting twice as long after each probe that does not pay, as
    ``GammaController`` does for chains. So a tree that costs more than it brings (a weak
    draft, or a device where verifying many tokens is expensive) leaves decoding near plain
    speed instead of below it."""

    def __init__(
        self,
        depth: int,
        adaptive: bool,
        t_plain: float,
        decay: float = 0.9,
        probe_every: int = 16,
        max_probe: int = 256,
        min_trees: int = 4,
    ):
        self.gamma, self.adaptive = depth, adaptive
        self.decay, self.probe_every, self.max_probe = decay, probe_every, max_probe
        self.t_plain = t_plain  # seconds of a one-token verification
        # decayed sums [tokens, seconds] of tree iterations (sums, not averages started at the
        # first iteration: that would weigh the first tree as ten, and one unlucky first tree,
        # say the warm-up's, then kept a good draft from drafting for the rest of a run)
        self.tree: list[float] | None = None
        self.seen, self.min_trees = 0, min_trees  # trees are drafted until min_trees are seen
        self.zero_streak, self.wait, self.probing = 0, probe_every, False

    def rates(self) -> tuple[float, float]:
        """(tree tokens per second, plain tokens per second)."""
        plain = 1.0 / self.t_plain if self.t_plain > 0 else float("inf")
        if self.tree is None or self.seen < self.min_trees:
            return float("inf"), plain  # too few trees measured to judge: draft one
        return self.tree[0] / max(self.tree[1], 1e-9), plain

    def choose(self, limit: int, bucket: str | None = None) -> int:
        self.probing = False
        cap = max(0, min(self.gamma, limit))
        if not self.adaptive or cap == 0:
            return cap
        tree, plain = self.rates()
        if tree >= plain:
            self.zero_streak = 0
            return cap
        self.zero_streak += 1
        if self.zero_streak >= self.wait:
            self.zero_streak, self.probing = 0, True
            return cap
        return 0

    def update(self, g, tested, accepted, step_seconds, t_verify, bucket=None, t_draft=0.0):
        if g == 0:
            self.t_plain = 0.8 * self.t_plain + 0.2 * t_verify
            return
        sample = [accepted + 1.0, t_draft + t_verify]
        if self.tree is None:
            self.tree = sample
        else:
            self.tree = [self.decay * a + b for a, b in zip(self.tree, sample, strict=True)]
        self.seen += 1
        if self.probing:
            tree, plain = self.rates()
            self.wait = self.probe_every if tree >= plain else min(2 * self.wait, self.max_probe)


POLICIES = ("fixed", "adaptive", "goodput")


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
        #: ... and seconds per reading whatever its length (an eager forward's launches)
        self.t_read_fixed: float = getattr(cost, "read_s_fixed", 0.0)
        self._unread = 0  # tokens the drafter had not read at the last choice
        self._plain_seconds: float | None = None  # predicted plain step of the last choice
        self.last_goodput: dict[int, float] = {}
        # a tree proposer: nodes per tree, measured; before any tree, its largest (a tree
        # priced at its depth would be priced at a third of its size: the first tree at 16
        # rows would look nearly free to verify)
        self.tree_nodes = float(tree_nodes or gamma)
        self.after_probe = False
        self.pool = _Acceptance(decay=0.98)  # every request's outcomes, pooled (slower decay)

    @property
    def seen(self) -> bool:
        """Whether the pool holds any outcome beyond its prior (a chain's tested tokens, a
        tree)."""
        return self.pool.tested > 2.0 or self.pool.tree_tokens is not None

    def saw_tree(self, nodes: int) -> None:
        self.tree_nodes = 0.8 * self.tree_nodes + 0.2 * nodes

    def draft_seconds(self, rows: int, g: int) -> float:
        t_step = self.t_step if self.t_step is not None else self.t_step_prior
        if g == 0 or t_step is None:
            return 0.0
        steps = 1 if self.parallel else (self.gamma if self.tree else g)
        return (1 if self.batched else rows) * steps * t_step

    def saw_reading(self, tokens: int, seconds: float) -> None:
        """The drafter read ``tokens`` tokens (a join, a row's start) in ``seconds``: the
        per-token price learns from what the reading cost beyond its fixed part."""
        if tokens > 0:
            per = max(0.0, seconds - self.t_read_fixed) / tokens
            self.t_read = per if self.t_read is None else 0.8 * self.t_read + 0.2 * per

    def reading_seconds(self, tokens: int) -> float:
        """The drafter's predicted seconds to read ``tokens`` unread tokens (0: none)."""
        if tokens <= 0:
            return 0.0
        return self.t_read_fixed + tokens * (self.t_read or 0.0)

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
            reading = self.reading_seconds(unread)
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
        # before the pool has seen any outcome the draft's skill on this workload is only a
        # prior: where the mean says drafting pays with its reading spread as a draft's is
        # (above), the first probe is due as any hopeful one. Its reading is paid once for
        # every later draft; waiting for the share of it kept an H100 at B = 16 plain for a
        # whole run, docs/benchmarks.md (the H100, 2026-11-27/28)
        if not self.seen and max(self.last_goodput[g] for g in options if g) > self.last_goodput[0]:
            hopeful = True
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
        extra = fixed + self.reading_seconds(unread)
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
                self.probe_fixed = max(0.0, extra - self.reading_seconds(self._unread))
