"""The speculative decoder: one loop for every proposer.

Invariant between iterations: the target's KV cache holds every committed token but the last;
the last committed token is fed together with the draft in the next verification forward. So
each iteration is exactly one target forward (plain decoding: one token fed, gamma = 0), and
tau = emitted tokens / verification forwards is 1 for plain decoding. The prompt's prefill is a
separate forward, not counted in tau (and timed separately).

After verification the target cache is cut back to the accepted path (a crop for a chain; for a
tree the accepted nodes' entries are moved into place first) and the proposer rolls back its
own caches; nothing is recomputed from scratch. The target's cache and forwards are a runner's
(``runner.py``: transformers' dynamic cache, or a static one at fixed widths, captured as CUDA
graphs on a GPU); how much to draft is a policy's (``policies.py``).
"""

from __future__ import annotations

import math
import time
from collections import Counter
from dataclasses import dataclass, field

import torch

from models.base import DecodeState, Proposal, Proposer
from models.sampling import Sampling
from models.target import Target

from .policies import GammaController, TreeController
from .runner import Layout, RunnerError, StaticRunner, TargetRunner, choose_runner
from .timing import interleaved_medians, sync
from .verify import AcceptRule, Verdict, accept, until_stop


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
    t_draft_start: float = 0.0  # the part of t_prefill that is the drafter's start
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
            "t_draft_start",
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


class NoDraft(Proposer):
    """Plain autoregressive decoding through the same loop (gamma is always 0)."""

    name = "none"

    def propose(self, state: DecodeState, gamma: int) -> Proposal:
        return Proposal([], [])


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
        says which ran), ``fused`` the first with each layer's elementwise ops compiled by
        torch.compile. ``max_len``: the static cache's columns allocated up front."""
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
        # keep, for the last generate() call, the target's logits row that decided each new
        # token (``last_logits``): how a divergence between two decodings is classified
        self.record_logits = record_logits
        self.last_logits: list[torch.Tensor] | None = None
        self.target, self.proposer, self.sampling = target, proposer, sampling
        # how drafted tokens are accepted (``verify.accept``, the batched decoder's too)
        self.rule = AcceptRule(sampling, lenience, acceptance, (typical_epsilon, typical_delta))
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

        def setup(n: int):
            runner.prefill(ctx)
            return lambda: runner.forward(Layout(ctx[0], Proposal.chain(ctx[1:n])))

        med = interleaved_medians(sizes, setup, self.device, reps)
        runner.reset()
        return [med[n] for n in sizes]

    # -- generation ---------------------------------------------------------------------

    @torch.no_grad()
    def generate(
        self,
        prompt: list[int],
        max_new_tokens: int,
        stop_ids: set[int] | frozenset[int] = frozenset(),
    ) -> list[int]:
        """Up to ``max_new_tokens`` new tokens after ``prompt`` (ending at a stop token). The
        loop is the algorithm: draft, verify, accept; admitting the prompt and retiring the
        sequence around it; every clock and counter is booked in ``_book``."""
        if not prompt:
            raise ValueError("empty prompt")
        seq = self._admit(prompt, max_new_tokens, frozenset(stop_ids))
        while len(seq.new) < max_new_tokens:
            draft = self._draft(seq.state, max_new_tokens - len(seq.new) - 1)
            check = self._verify(seq.state, draft)
            emitted = self._accept(seq, draft, check)
            self._book(seq.stats, draft, check)
            if emitted[-1] in seq.stop_ids:
                break
        return self._retire(seq, max_new_tokens)

    # -- the phases ---------------------------------------------------------------------

    def _admit(self, prompt: list[int], max_new_tokens: int, stop_ids: frozenset) -> _Sequence:
        """A new sequence: the prompt's prefill (all but its last token) on the target, then
        the proposer's start (a draft model prefills there too); both timed as prefill."""
        st = Stats()
        runner = self.runner
        # static caches sized before the clock starts (a CUDA graph captured again costs
        # seconds; ``runner.capture_seconds`` reports it)
        runner.reserve(len(prompt) + max_new_tokens + 1)
        self.proposer.reserve(len(prompt) + max_new_tokens + 1)
        t_start = time.perf_counter()
        runner.reset()
        feats = None
        if len(prompt) > 1:
            t = time.perf_counter()
            feats = runner.prefill(prompt[:-1])
            sync(self.device)
            st.t_prefill += time.perf_counter() - t
            st.prefill_calls += 1
        seq = _Sequence(
            state=DecodeState(
                ids=list(prompt),
                features=None,
                sampling=self.sampling,
                generator=self.generator,
                device=self.device,
                signals=self.stop_rule is not None or self.traces is not None,
                stop=self.stop_rule,
                prefill_cache=runner.prefill_cache() if len(prompt) > 1 else None,
            ),
            stats=st,
            stop_ids=stop_ids,
            t_start=t_start,
            calls0=self.proposer.draft_calls,
        )
        if feats is not None:
            seq.add_features(feats)
        t = time.perf_counter()
        self.proposer.start(seq.state)
        seq.state.prefill_cache = None
        sync(self.device)
        st.t_draft_start += time.perf_counter() - t
        st.t_prefill += time.perf_counter() - t
        return seq

    def _draft(self, state: DecodeState, limit: int) -> _Draft:
        """This iteration's proposal: sized by the controller before drafting, or for a
        proposer that costs nothing (a lookup) drafted first and then cut to what the
        controller verifies (it knows the proposal's confidence bucket); plus a proposer's
        side branch (lookahead's Jacobi window) in iterations that draft."""
        ctl = self.controller
        t = time.perf_counter()
        if self.proposer.free and self.gamma and limit > 0:
            prop = self.proposer.propose(state, min(self.gamma, limit))
            drafted = len(prop)
            g = ctl.choose(drafted, prop.bucket) if drafted else 0
            prop = prop.truncated(g)
        else:
            g = ctl.choose(limit)
            prop = self.proposer.propose(state, g) if g > 0 else Proposal([], [])
            drafted = len(prop)
        side = self.proposer.side_branch(state) if (g > 0 or drafted) else None
        sync(self.device)
        return _Draft(prop, side, drafted, time.perf_counter() - t)

    def _verify(self, state: DecodeState, d: _Draft) -> _Check:
        """One target forward over the last committed token, the proposal and any side branch,
        and the acceptance rule on its logits: greedy, exact rejection sampling, typical, or
        lenient."""
        prop = d.prop
        t = time.perf_counter()
        logits, f_new = self.runner.forward(Layout(state.ids[-1], prop, d.side))
        side_logits = None
        if d.side is not None:
            n_main = len(prop) + 1
            logits, side_logits = logits[:n_main], logits[n_main:]
            f_new = f_new[:n_main] if f_new is not None else None
        a = accept(self.rule, prop, logits, self.generator)  # the acceptance both decoders use
        sync(self.device)
        return _Check(
            a.verdict, logits, f_new, side_logits, a.tvd, a.off_argmax, time.perf_counter() - t
        )

    def _accept(self, seq: _Sequence, d: _Draft, c: _Check) -> list[int]:
        """Commit the accepted path and the token after it (up to a stop token): the target's
        cache keeps their entries, the proposer its state, the sequence their features."""
        path = c.verdict.path
        keep = [0] + [i + 1 for i in path]
        self.runner.commit(keep)
        if self.layers:
            seq.add_features(c.f_new[keep] if len(keep) < len(c.f_new) else c.f_new)
        emitted = [d.prop.tokens[i] for i in path] + [c.verdict.token]
        if self.record_logits:  # the target rows that decided each emitted token
            seq.step_logits.extend(c.logits[keep].float().cpu())
        emitted = until_stop(emitted, seq.stop_ids)
        seq.state.ids.extend(emitted)
        seq.new.extend(emitted)
        if c.tvd is not None:
            seq.stats.tvd_sum += sum(c.tvd[: len(emitted)])
            seq.stats.tvd_tokens += len(emitted)
        self.proposer.rollback(seq.state, len(path))
        if d.side is not None:
            self.proposer.side_logits(seq.state, c.side_logits)
        return emitted

    def _book(self, st: Stats, d: _Draft, c: _Check) -> None:
        """The iteration's counters and clocks, and what the controller learns from it."""
        prop, path = d.prop, c.verdict.path
        st.off_argmax += c.off_argmax
        if self.traces is not None and prop.signals is not None and len(prop):
            self.traces.append(
                {
                    "signals": [[round(v, 6) for v in r] for r in prop.signals.tolist()],
                    "accepted": len(path),
                    "drafted": len(prop),
                }
            )
        tested = count_iteration(st, prop, path)
        st.t_target += c.seconds
        st.t_draft += d.seconds
        # Per-step draft cost: the proposer's own measure of its steps when it has one (it
        # leaves out catching up on tokens committed while it was idle), else the drafting time
        # over the tokens drafted.
        if self.proposer.measures_steps:
            step = self.proposer.last_step_seconds  # None: nothing clean to measure
        else:
            step = d.seconds / d.drafted if d.drafted else None
        if step is not None and len(prop):
            st.step_seconds_sum += step
            st.step_samples += 1
        # an iteration that carried a side branch cost more than a plain step even when the
        # proposal was empty: the tree controller must not book it as plain decoding
        g_used = len(prop) if d.side is None else max(1, len(prop))
        self.controller.update(
            g_used, tested, len(path), step, c.seconds, prop.bucket, t_draft=d.seconds
        )

    def _retire(self, seq: _Sequence, max_new_tokens: int) -> list[int]:
        st = seq.stats
        new = seq.new[:max_new_tokens]
        st.new_tokens = len(new)
        st.draft_calls = self.proposer.draft_calls - seq.calls0
        st.t_total = time.perf_counter() - seq.t_start
        self.stats.merge(st)
        self.last = st
        self.last_logits = seq.step_logits[: len(new)] if self.record_logits else None
        return new


@dataclass
class _Draft:
    """What ``_draft`` proposed: the proposal, a side branch, tokens drafted (before the
    controller's cut, for a free proposer) and the seconds drafting took."""

    prop: Proposal
    side: object | None
    drafted: int
    seconds: float


@dataclass
class _Check:
    """What ``_verify`` found: the verdict, the target's logits and features over the
    proposal, its logits over a side branch, per-token TVD of a lossy rule, accepted tokens off
    the argmax (lenience at T = 0) and the seconds the forward and the rule took."""

    verdict: Verdict
    logits: torch.Tensor
    f_new: torch.Tensor | None
    side_logits: torch.Tensor | None
    tvd: list[float] | None
    off_argmax: int
    seconds: float


@dataclass
class _Sequence:
    """One sequence in flight: what the proposer reads (``state``), its new tokens, the target
    rows that chose them (``record_logits``), its counters, and the features of every fed
    position (``_Features``; ``state.features`` views it)."""

    state: DecodeState
    stats: Stats
    stop_ids: frozenset
    t_start: float
    calls0: int
    new: list[int] = field(default_factory=list)
    step_logits: list[torch.Tensor] = field(default_factory=list)
    features: _Features | None = None

    def add_features(self, rows: torch.Tensor) -> None:
        if self.features is None:
            self.features = _Features(rows)
        else:
            self.features.append(rows)
        self.state.features = self.features.view


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
    st.tree_iterations += 0 if prop.is_chain else 1
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


def _depths(p: Proposal) -> list[int]:
    d: list[int] = []
    for par in p.parents:
        d.append(1 if par < 0 else d[par] + 1)
    return d


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
