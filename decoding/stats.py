"""What a decoding run counts: per-position acceptance, tau, the clocks of its phases
(``Stats``, pooled over iterations and requests, at batch 1 and batch B alike), the booking of
one verification (``count_iteration``), the speedup the paper's formula predicts from them, and
a batched run's own counters and each request's latency (``BatchStats``).
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass, field

import torch

from models.base import Proposal

from .policies import GammaController


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
    # of which a request's first: the prompt's prefill chooses it, as in vLLM, SGLang and
    # llama.cpp, and nothing is drafted for it (its forward is timed as prefill, at batch 1)
    first_tokens: int = 0
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
    # row-iterations at T > 0 whose rejection sampling ran on the device, with the batch's in
    # one read (``verify.sampled_on_device``); the rest at T > 0 ran row by row on the host
    sampled_on_device: int = 0

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
            "first_tokens",
            "t_target",
            "t_prefill",
            "t_draft_start",
            "t_draft",
            "t_total",
            "tvd_sum",
            "tvd_tokens",
            "off_argmax",
            "sampled_on_device",
            "step_seconds_sum",
            "step_samples",
        ):
            setattr(self, k, getattr(self, k) + getattr(o, k))

    @property
    def decoded_tokens(self) -> int:
        """The tokens verification forwards emitted: every new token but each request's first
        (the prefill's)."""
        return self.new_tokens - self.first_tokens

    @property
    def tau(self) -> float:
        """Tokens emitted per verification forward, as engines count it (vLLM's mean
        acceptance length): each request's first token, the prefill's, and its forward left
        out."""
        return self.decoded_tokens / self.target_calls if self.target_calls else float("nan")

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


def count_iteration(st: Stats, prop: Proposal, path: list[int], ended: bool = False) -> int:
    """Book one verification of ``prop`` (accepted ``path``) in ``st``; returns how many draft
    positions it tested. Position k is tested when 1..k-1 were accepted and the accepted node
    at k-1 has children (for a chain: the draft reached depth k); a deeper branch elsewhere in a
    tree is not a test of the accepted path. ``ended``: the request's budget ended at ``path``
    (a proposal drafted past it), so no position after it was tested."""
    if not prop.parents:  # nothing drafted: a plain step
        st.gamma_used[0] += 1
        st.target_calls += 1
        return 0
    depth = depths(prop)
    for d in depth:
        st.drafted[d] += 1
    st.draft_steps += max(depth, default=0)
    st.tree_iterations += 0 if prop.is_chain else 1
    parents_with_kids = set(prop.parents)
    tested = len(path) + (
        0 if ended else (1 if (path[-1] if path else -1) in parents_with_kids else 0)
    )
    for k in range(1, tested + 1):
        st.tested[k] += 1
        if k <= len(path):
            st.accepted[k] += 1
    if len(prop):
        st.accept_len[len(path)] += 1
    st.gamma_used[len(prop)] += 1  # what was drafted (a lookup may find nothing)
    st.target_calls += 1
    return tested


def depths(p: Proposal) -> list[int]:
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
    def host_seconds(self) -> float:
        """The run's seconds outside the target's forwards and prefills: the host's work
        between forwards (drafting included) and what a caller's hooks do in the loop."""
        return self.wall - self.rows.t_target - self.rows.t_prefill

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


def acceptance_where(stats: Stats, sampling) -> str:
    """Where a run's acceptance step ran, for its report: at T = 0 the argmaxes, read once an
    iteration; at T > 0 rejection sampling on the device with one read (a GPU) or row by row
    on the host (a CPU, a lossy rule, regeneration's race)."""
    if sampling.greedy:
        return "greedy, one read of the argmaxes an iteration"
    n, k = stats.target_calls, stats.sampled_on_device
    if n and k >= n:
        return "sampled on the device, one read an iteration"
    if not k:
        return "sampled row by row on the host"
    return f"sampled on the device in {k} of {n} row-iterations, else row by row on the host"
