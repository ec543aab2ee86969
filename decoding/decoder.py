"""The speculative decoder: one loop for every proposer.

Invariant between iterations: the target's KV cache holds every committed token but the last;
the last committed token is fed together with the draft in the next verification forward. So
each iteration is exactly one target forward (plain decoding: one token fed, gamma = 0), and
tau = emitted tokens / verification forwards is 1 for plain decoding. The prompt's prefill is a
separate forward, not counted in tau (and timed separately).

After verification the target cache is cut back to the accepted path (a crop for a chain; for a
tree the accepted nodes' entries are moved into place first) and the proposer rolls back its
own caches; nothing is recomputed from scratch.
"""

from __future__ import annotations

import math
import time
from collections import Counter
from dataclasses import dataclass, field

import torch

from models.base import DecodeState, Proposal, Proposer
from models.sampling import Sampling, greedy_tokens, warp
from models.target import Target

from .runner import Layout, RunnerError, StaticRunner, TargetRunner, choose_runner
from .runner import keep_cache_positions as keep_cache_positions  # re-exported for callers
from .verify import (
    lenient_tvd,
    one_hot,
    verify_greedy,
    verify_greedy_lenient,
    verify_sampled,
    verify_typical,
)


@dataclass
class Stats:
    """Counters over one or more generations. Position k (1-based) of a draft is *tested* when
    positions 1..k-1 were accepted and the draft reached depth k."""

    drafted: Counter = field(default_factory=Counter)  # draft nodes per depth
    tested: Counter = field(default_factory=Counter)
    accepted: Counter = field(default_factory=Counter)
    accept_len: Counter = field(default_factory=Counter)  # accepted tokens per drafting iteration
    gamma_used: Counter = field(default_factory=Counter)  # draft tokens per iteration
    target_calls: int = 0  # verification forwards (prefill excluded)
    prefill_calls: int = 0
    draft_calls: int = 0  # forwards of the draft model/head
    draft_steps: int = 0  # sequential draft steps: a proposal's depth, summed over iterations
    tree_iterations: int = 0  # iterations whose proposal was a tree (not a chain)
    new_tokens: int = 0
    t_target: float = 0.0  # seconds in verification forwards
    t_prefill: float = 0.0
    t_draft: float = 0.0
    t_total: float = 0.0  # wall time of generate(), prefill included
    # typical acceptance and lenience < 1 at T > 0: summed TVD between each emitted token's
    # distribution and the target's at that position, over ``tvd_tokens`` emitted tokens (0 for
    # exact decoding)
    tvd_sum: float = 0.0
    tvd_tokens: int = 0
    # lenience < 1 at T = 0: accepted draft tokens that are not the target's argmax
    off_argmax: int = 0
    # the proposer's own measure of one draft step (catching up on tokens committed while it
    # was idle left out), summed over the iterations that measured one
    step_seconds_sum: float = 0.0
    step_samples: int = 0

    @property
    def draft_step_seconds(self) -> float | None:
        return self.step_seconds_sum / self.step_samples if self.step_samples else None

    @property
    def mean_tvd(self) -> float:
        return self.tvd_sum / self.tvd_tokens if self.tvd_tokens else 0.0

    def merge(self, o: Stats) -> None:
        for k in ("drafted", "tested", "accepted", "accept_len", "gamma_used"):
            getattr(self, k).update(getattr(o, k))
        for k in (
            "target_calls",
            "prefill_calls",
            "draft_calls",
            "draft_steps",
            "tree_iterations",
            "new_tokens",
            "t_target",
            "t_prefill",
            "t_draft",
            "t_total",
            "tvd_sum",
            "tvd_tokens",
            "off_argmax",
            "step_seconds_sum",
            "step_samples",
        ):
            setattr(self, k, getattr(self, k) + getattr(o, k))

    @property
    def tau(self) -> float:
        return self.new_tokens / self.target_calls if self.target_calls else float("nan")

    @property
    def alpha(self) -> float:
        t = sum(self.tested.values())
        return sum(self.accepted.values()) / t if t else float("nan")

    def alpha_per_position(self) -> list[float]:
        depth = max(self.tested, default=0)
        return [
            self.accepted[k] / self.tested[k] if self.tested[k] else float("nan")
            for k in range(1, depth + 1)
        ]


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
    (emitted tokens over drafting + verification seconds, decayed averages) with plain
    decoding's (one token per single-token verification) and drafts only while trees are the
    faster of the two; when they are not it probes with a tree now and then, waiting twice as
    long after each probe that does not pay, as ``GammaController`` does for chains. So a tree
    that costs more than it brings (a weak draft, or a device where verifying many tokens is
    expensive) leaves decoding near plain speed instead of below it."""

    def __init__(
        self,
        depth: int,
        adaptive: bool,
        t_plain: float,
        decay: float = 0.9,
        probe_every: int = 16,
        max_probe: int = 256,
    ):
        self.gamma, self.adaptive = depth, adaptive
        self.decay, self.probe_every, self.max_probe = decay, probe_every, max_probe
        self.t_plain = t_plain  # seconds of a one-token verification
        self.tree: list[float] | None = None  # decayed [tokens, seconds] of tree iterations
        self.zero_streak, self.wait, self.probing = 0, probe_every, False

    def rates(self) -> tuple[float, float]:
        """(tree tokens per second, plain tokens per second)."""
        plain = 1.0 / self.t_plain if self.t_plain > 0 else float("inf")
        if self.tree is None:
            return float("inf"), plain  # nothing measured yet: try a tree first
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
            self.tree = [
                self.decay * a + (1 - self.decay) * b
                for a, b in zip(self.tree, sample, strict=True)
            ]
        if self.probing:
            tree, plain = self.rates()
            self.wait = self.probe_every if tree >= plain else min(2 * self.wait, self.max_probe)


class NoDraft(Proposer):
    """Plain autoregressive decoding through the same loop (gamma is always 0)."""

    name = "none"

    def propose(self, state: DecodeState, gamma: int) -> Proposal:
        return Proposal([], [])


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class SpeculativeDecoder:
    """Batch-size-1 speculative decoding of ``target`` with any proposer.

    ``generate`` returns the new tokens; ``stats`` accumulates counters over calls.
    """

    def __init__(
        self,
        target: Target,
        proposer,
        sampling: Sampling,
        gamma: int = 4,
        adaptive: bool = True,
        seed: int = 0,
        calibrate: bool = True,
        acceptance: str = "exact",
        typical_epsilon: float = 0.09,
        typical_delta: float = 0.3,
        record_logits: bool = False,
        lenience: float = 1.0,
        stop_rule=None,
        traces: list | None = None,
        compile: str = "auto",
        max_len: int = 2048,
    ):
        """``acceptance``: ``exact`` (speculative sampling: the output follows the target
        exactly) or ``typical`` (Medusa's typical acceptance at T > 0 with ``typical_epsilon``
        and ``typical_delta``: longer accepted runs, but the output distribution moves; the
        per-token TVD is measured in ``stats``). Greedy decoding (T = 0) is exact either way.

        ``lenience`` l in (0, 1]: 1 is exact; below 1 a drafted x is accepted with probability
        min(1, p(x) / (l q(x))) at T > 0 (chains only; the per-token TVD from the target is
        measured in ``stats``), and when p(x) >= l * max p at T = 0 (``stats.off_argmax``
        counts accepted tokens that are not the argmax). NOT lossless below 1.

        ``stop_rule``: a learned rule (DISCO, ``decoding.disco.DiscoStop``) that the proposer
        consults after each drafted token of a chain, stopping the draft early where it
        predicts a rejection; it decides only how many tokens are drafted, so the output
        distribution is the target's whatever it says. ``traces``: a list that receives, per
        drafting iteration, the draft's signals for each drafted token and how many were
        accepted (what the stop rule is trained on).

        ``compile``: the target's forward (``decoding/runner.py``): ``true`` the lean forward
        over a static cache at fixed widths (CUDA graphs on a GPU), ``false`` transformers'
        forward over its dynamic cache, ``auto`` the first wherever it runs (``self.runner.kind``
        says which ran). ``max_len``: the static cache's columns allocated up front."""
        if gamma < 0:
            raise ValueError(f"gamma={gamma}: must be >= 0")
        if acceptance not in ("exact", "typical"):
            raise ValueError(f"acceptance={acceptance!r}: use exact or typical")
        if not 0.0 < lenience <= 1.0:
            raise ValueError(f"lenience={lenience}: must be in (0, 1] (1: exact)")
        if lenience < 1.0 and acceptance == "typical":
            raise ValueError(
                f"lenience={lenience} with acceptance=typical: two lossy acceptance rules at "
                "once; use one"
            )
        if not isinstance(proposer, Proposer):
            raise TypeError(
                f"{type(proposer).__name__} is not a models.base.Proposer (the decoder's contract)"
            )
        tree = proposer.tree_depth is not None
        if (stop_rule is not None or traces is not None) and (not proposer.gives_signals or tree):
            what = "a learned stop rule" if stop_rule is not None else "acceptance traces"
            raise ValueError(
                f"{what} needs a drafter that reports its signals while drafting a chain "
                f"(EAGLE chains, draft LMs); {type(proposer).__name__}"
                f"{' (a tree)' if tree else ''} does not"
            )
        self.stop_rule, self.traces = stop_rule, traces
        if lenience < 1.0 and tree and not sampling.greedy:
            raise ValueError(
                f"lenience={lenience} at T > 0 is implemented for chains (its TVD is exact "
                "there); use tree=chain, or T = 0"
            )
        self.acceptance = acceptance
        self.lenience = lenience
        # keep, for the last generate() call, the target's logits row that decided each new
        # token (``last_logits``): how a divergence between two decodings is classified
        self.record_logits = record_logits
        self.last_logits: list[torch.Tensor] | None = None
        self.typical = (typical_epsilon, typical_delta)
        self.target, self.proposer, self.sampling = target, proposer, sampling
        self.device = target.device
        self.gamma = 0 if isinstance(proposer, NoDraft) else gamma
        # a proposer whose proposals gain from every drafting iteration (lookahead's pool) is
        # verified every iteration: a per-iteration controller would switch it off early
        adaptive = adaptive and proposer.adaptive
        self.adaptive = adaptive
        self.generator = torch.Generator(device=self.device).manual_seed(seed)
        self.layers = tuple(proposer.feature_layers)
        # the widest verification: a chain of gamma, a tree of its node budget (a proposer whose
        # trees have no fixed budget, or a side branch, runs wider forwards eagerly)
        widest = 1 + (proposer.tree_nodes or self.gamma) if self.gamma else 1
        try:
            self.runner: TargetRunner = choose_runner(
                compile, target, proposer, self.layers, (1, widest), max_len
            )
        except RunnerError as e:
            raise ValueError(str(e)) from None
        if isinstance(self.runner, StaticRunner):  # the drafter on fixed shapes too, if it can
            fast = proposer.fixed_shape(self.gamma, self.runner.graphs)
            if fast is not None:
                self.proposer = proposer = fast
        t_verify = (
            self._calibrate()
            if (calibrate and self.gamma and adaptive)
            else [1.0 + 0.01 * k for k in range(self.gamma + 1)]
        )
        if tree and self.gamma:
            self.controller = TreeController(self.gamma, adaptive, t_verify[0])
        else:
            self.controller = GammaController(
                self.gamma, adaptive, t_verify, parallel=proposer.parallel
            )
        self.stats = Stats()

    # -- target forwards ----------------------------------------------------------------

    def _calibrate(self, prefix: int = 256, reps: int = 5) -> list[float]:
        """Time target forwards over k + 1 tokens (k = 0..gamma) after a ``prefix``-token
        context. This is the real cost of each shape on this machine: where verifying 2-3
        tokens is slower than 5 (MKL's fp32 path for 2-3 rows on some CPUs), the controller
        sees it; in bf16 the table is flat (docs/benchmarks.md). Iterations keep refining it (a
        decayed average of measured verification times)."""
        return self.forward_costs(range(1, self.gamma + 2), prefix, reps)

    @torch.no_grad()
    def forward_costs(self, sizes, prefix: int = 256, reps: int = 5) -> list[float]:
        """Seconds of a target forward over each of ``sizes`` tokens after a ``prefix``-token
        context, in the target's own dtype: the median of ``reps`` after a warm-up, the sizes
        taken in turn within each repetition, so that a slow spell of the machine falls on
        every size alike instead of on one."""
        sizes = list(sizes)
        for n in sizes:
            if not 1 <= n <= prefix:
                raise ValueError(f"forward of {n} tokens: must be in [1, {prefix}]")
        vocab = self.target.config.vocab_size
        g = torch.Generator().manual_seed(0)
        ctx = torch.randint(0, vocab, (prefix,), generator=g).tolist()
        runner = self.runner
        runner.reserve(2 * prefix)
        runs: list[list[float]] = [[] for _ in sizes]
        for _ in range(reps + 1):
            for i, n in enumerate(sizes):
                runner.prefill(ctx)
                _sync(self.device)
                t = time.perf_counter()
                runner.forward(Layout(ctx[0], Proposal.chain(ctx[1:n])))
                _sync(self.device)
                runs[i].append(time.perf_counter() - t)
        runner.reset()
        return [sorted(r[1:])[len(r[1:]) // 2] for r in runs]

    # -- generation ---------------------------------------------------------------------

    @torch.no_grad()
    def generate(
        self,
        prompt: list[int],
        max_new_tokens: int,
        stop_ids: set[int] | frozenset[int] = frozenset(),
    ) -> list[int]:
        if not prompt:
            raise ValueError("empty prompt")
        st = Stats()
        runner = self.runner
        # a static cache sized before the clock starts (a CUDA graph captured again costs
        # seconds; ``runner.capture_seconds`` reports it)
        runner.reserve(len(prompt) + max_new_tokens + 1)
        self.proposer.reserve(len(prompt) + max_new_tokens + 1)
        t_start = time.perf_counter()
        runner.reset()
        feats = None
        if len(prompt) > 1:
            t = time.perf_counter()
            feats = runner.prefill(prompt[:-1])
            _sync(self.device)
            st.t_prefill += time.perf_counter() - t
            st.prefill_calls += 1
        features = _Features(feats) if feats is not None else None
        state = DecodeState(
            ids=list(prompt),
            features=feats,
            sampling=self.sampling,
            generator=self.generator,
            device=self.device,
            signals=self.stop_rule is not None or self.traces is not None,
            stop=self.stop_rule,
            prefill_cache=runner.prefill_cache() if len(prompt) > 1 else None,
        )
        calls0 = self.proposer.draft_calls
        t = time.perf_counter()
        if features is not None:
            state.features = features.view
        self.proposer.start(state)  # a draft model prefills the prompt here: counted as prefill
        state.prefill_cache = None
        _sync(self.device)
        st.t_prefill += time.perf_counter() - t
        new: list[int] = []
        step_logits: list[torch.Tensor] = []
        ctl = self.controller
        free = self.proposer.free
        while len(new) < max_new_tokens:
            limit = max_new_tokens - len(new) - 1
            t = time.perf_counter()
            if free and self.gamma and limit > 0:
                # A proposer that costs nothing (a lookup) drafts first; the controller then
                # decides how much of it to verify, knowing the proposal's confidence bucket.
                prop = self.proposer.propose(state, min(self.gamma, limit))
                drafted = len(prop)
                g = ctl.choose(drafted, prop.bucket) if drafted else 0
                prop = prop.truncated(g)
            else:
                g = ctl.choose(limit)
                prop = self.proposer.propose(state, g) if g > 0 else Proposal([], [])
                drafted = len(prop)
            # a proposer's own extra tokens in the same forward (lookahead's Jacobi window),
            # only in iterations that draft
            side = self.proposer.side_branch(state) if (g > 0 or drafted) else None
            _sync(self.device)
            t_draft = time.perf_counter() - t
            t = time.perf_counter()
            logits, f_new = runner.forward(Layout(state.ids[-1], prop, side))
            if side is not None:
                n_main = len(prop) + 1
                logits, side_logits = logits[:n_main], logits[n_main:]
                f_new = f_new[:n_main] if f_new is not None else None
            tvd = None
            if self.sampling.greedy and self.lenience < 1.0:
                verdict, off = verify_greedy_lenient(
                    prop.tokens, prop.parents, logits, self.lenience
                )
                st.off_argmax += off
            elif self.sampling.greedy:
                verdict = verify_greedy(prop.tokens, prop.parents, greedy_tokens(logits).tolist())
            elif self.lenience < 1.0:
                p = warp(logits, self.sampling)
                verdict = verify_sampled(
                    prop.tokens, prop.parents, p, prop.q, self.generator, self.lenience
                )
                tvd = _lenient_chain_tvd(prop, p, len(verdict.path), self.lenience)
            elif self.acceptance == "typical":
                verdict, tvd = verify_typical(
                    prop.tokens,
                    prop.parents,
                    warp(logits, self.sampling),
                    *self.typical,
                    self.generator,
                )
            else:
                verdict = verify_sampled(
                    prop.tokens, prop.parents, warp(logits, self.sampling), prop.q, self.generator
                )
            _sync(self.device)
            t_verify = time.perf_counter() - t
            path = verdict.path
            keep = [0] + [i + 1 for i in path]
            runner.commit(keep)
            if self.layers:
                sel = f_new[keep] if len(keep) < len(f_new) else f_new
                if features is None:
                    features = _Features(sel)
                else:
                    features.append(sel)
                state.features = features.view
            emitted = [prop.tokens[i] for i in path] + [verdict.token]
            if self.record_logits:  # the target rows that decided each emitted token
                step_logits.extend(logits[[0] + [i + 1 for i in path]].float().cpu())
            for j, tok in enumerate(emitted):
                if tok in stop_ids:
                    emitted = emitted[: j + 1]
                    break
            state.ids.extend(emitted)
            new.extend(emitted)
            if tvd is not None:
                st.tvd_sum += sum(tvd[: len(emitted)])
                st.tvd_tokens += len(emitted)
            self.proposer.rollback(state, len(path))
            if side is not None:
                self.proposer.side_logits(state, side_logits)
            if self.traces is not None and prop.signals is not None and len(prop):
                self.traces.append(
                    {
                        "signals": [[round(v, 6) for v in r] for r in prop.signals.tolist()],
                        "accepted": len(path),
                        "drafted": len(prop),
                    }
                )
            tested = count_iteration(st, prop, path)
            st.t_target += t_verify
            st.t_draft += t_draft
            # Per-step draft cost: the proposer's own measure of its steps when it has one
            # (it leaves out catching up on tokens committed while it was idle), else the
            # drafting time over the tokens drafted.
            if self.proposer.measures_steps:
                step = self.proposer.last_step_seconds  # None: nothing clean to measure
            else:
                step = t_draft / drafted if drafted else None
            if step is not None and len(prop):
                st.step_seconds_sum += step
                st.step_samples += 1
            # an iteration that carried a side branch cost more than a plain step even when the
            # proposal was empty: the tree controller must not book it as plain decoding
            g_used = len(prop) if side is None else max(1, len(prop))
            ctl.update(g_used, tested, len(path), step, t_verify, prop.bucket, t_draft=t_draft)
            if emitted[-1] in stop_ids:
                break
        new = new[:max_new_tokens]
        st.new_tokens = len(new)
        st.draft_calls = self.proposer.draft_calls - calls0
        st.t_total = time.perf_counter() - t_start
        self.stats.merge(st)
        self.last = st
        self.last_logits = step_logits[: len(new)] if self.record_logits else None
        return new


class _Features:
    """The target's features at every fed position, (n, L, H), appended in place: storage
    doubles when full, so a sequence costs O(n) copies instead of a concatenation of the whole
    history per iteration. ``view`` is what proposers read (rows never change once written)."""

    def __init__(self, first: torch.Tensor):
        self.buf = torch.empty((max(64, 2 * len(first)), *first.shape[1:]), **_like(first))
        self.buf[: len(first)] = first
        self.n = len(first)

    def append(self, rows: torch.Tensor) -> None:
        need = self.n + len(rows)
        if need > len(self.buf):
            grown = torch.empty((2 * need, *self.buf.shape[1:]), **_like(self.buf))
            grown[: self.n] = self.buf[: self.n]
            self.buf = grown
        self.buf[self.n : need] = rows
        self.n = need

    @property
    def view(self) -> torch.Tensor:
        return self.buf[: self.n]


def _like(t: torch.Tensor) -> dict:
    return {"dtype": t.dtype, "device": t.device}


def count_iteration(st: Stats, prop: Proposal, path: list[int]) -> int:
    """Book one verification of ``prop`` (accepted ``path``) in ``st``; returns how many draft
    positions it tested. Position k is tested when 1..k-1 were accepted and the accepted node
    at k-1 has children (for a chain: the draft reached depth k); a deeper branch elsewhere in a
    tree is not a test of the accepted path."""
    depth = _depths(prop)
    for d in depth:
        st.drafted[d] += 1
    st.draft_steps += max(depth, default=0)
    st.tree_iterations += 0 if _is_chain(prop) else 1
    parents_with_kids = set(prop.parents)
    tested = len(path) + (1 if (path[-1] if path else -1) in parents_with_kids else 0)
    for k in range(1, tested + 1):
        st.tested[k] += 1
        if k <= len(path):
            st.accepted[k] += 1
    if len(prop):
        st.accept_len[len(path)] += 1
    st.gamma_used[len(prop)] += 1  # what was drafted (a lookup may find nothing)
    st.target_calls += 1
    return tested


def _is_chain(p: Proposal) -> bool:
    return all(par == i - 1 for i, par in enumerate(p.parents))


def _depths(p: Proposal) -> list[int]:
    d: list[int] = []
    for par in p.parents:
        d.append(1 if par < 0 else d[par] + 1)
    return d


def _lenient_chain_tvd(prop: Proposal, p: torch.Tensor, accepted: int, lenience: float):
    """Per emitted token of a lenient chain step: the TVD from p of the distribution that
    emitted it (``lenient_tvd`` at each tested position; 0 for the bonus token after a fully
    accepted chain, which is drawn from p)."""
    out = []
    for k in range(min(accepted + 1, len(prop))):  # tested: the accepted ones + the rejected
        q = prop.q[k] if prop.q is not None else one_hot(prop.tokens[k], p[k])
        out.append(lenient_tvd(p[k], q, lenience))
    return out + [0.0] * (accepted + 1 - len(out))


def predicted_speedup(
    alpha: float, gamma_used: Counter | dict, c: float, parallel: bool = False
) -> float:
    """The paper's expected speedup, (1 - a^(g+1)) / ((1 - a)(g c + 1)) for a fixed gamma g;
    with several gammas used, expected tokens over expected cost summed over iterations. For a
    ``parallel`` drafter (one forward drafts every token) an iteration costs c + 1, c then
    being that forward over a target step."""
    if math.isnan(alpha) or not gamma_used:
        return float("nan")
    tokens = sum(n * GammaController.expected_tokens(alpha, g) for g, n in gamma_used.items())
    cost = sum(n * ((c if g else 0.0) if parallel else g * c) + n for g, n in gamma_used.items())
    return tokens / cost
