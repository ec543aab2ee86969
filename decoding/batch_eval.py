"""``specdraft-eval batch_size=B`` / ``batch_sizes=[1,4,16]``: the serving regime.

For each batch size B (and each policy asked for) it decodes the same prompts with plain
decoding at batch B and with speculative decoding at batch B (``decoding/batch.py``), both with
continuous batching, and reports total tokens/s, per-request tokens/s, their speedups, tau and
alpha as at batch 1. At T = 0 every output is compared with the *batch-1* plain greedy output of
its prompt (decoded once, with its logits, so that a divergence is classified as a near-tie or
real as today).
"""

from __future__ import annotations

import dataclasses
import math
import sys
from typing import Any

import torch
from tqdm.auto import tqdm

from data.chat import prompt_ids
from models.target import GenRequest

from .batch import BatchDecoder
from .batch_checks import BatchError, check_batch_settings
from .costs import StepCostModel
from .decoder import NoDraft, SpeculativeDecoder
from .policies import POLICIES
from .report import BATCH_CONVENTION, CONVENTION, NEAR_TIE_TOLERANCE, classify_divergence
from .runner import compile_mode
from .sample_check import checked, score
from .stats import BatchStats, acceptance_where


def policies_of(cfg) -> list[str]:
    """The policies to run: ``batch_policies`` if given, else the one ``stop``/``adaptive``
    name (goodput / adaptive / fixed)."""
    if cfg.batch_policies:
        bad = [p for p in cfg.batch_policies if p not in POLICIES]
        if bad:
            raise BatchError(
                f"batch_policies={list(cfg.batch_policies)}: {bad[0]!r} is not one "
                f"of {', '.join(POLICIES)}"
            )
        return list(cfg.batch_policies)
    if cfg.stop == "goodput":
        return ["goodput"]
    if cfg.stop == "confidence":  # the draft's confidence head sizes each row's chain
        return ["fixed"]
    return ["adaptive" if cfg.adaptive else "fixed"]


def batch_sizes_of(cfg) -> list[int]:
    key = "batch_sizes" if cfg.batch_sizes else "batch_size"
    sizes = list(cfg.batch_sizes) if cfg.batch_sizes else [cfg.batch_size]
    for b in sizes:
        if not isinstance(b, int) or isinstance(b, bool) or b < 1:
            shown = list(cfg.batch_sizes) if cfg.batch_sizes else b
            raise BatchError(f"{key}={shown}: {b!r} is not an integer >= 1")
    return sizes


def request_budgets(cfg, n: int) -> list[int | None]:
    """Each request's max_new_tokens: None (the run's) for ``request_lengths=equal``; for
    ``mixed``, drawn per prompt uniformly from [max_new_tokens / 4, max_new_tokens] by a
    generator seeded with ``seed``, so every configuration and repeat gets the same lengths."""
    if cfg.request_lengths == "equal":
        return [None] * n
    if cfg.request_lengths != "mixed":
        raise BatchError(f"request_lengths={cfg.request_lengths!r}: use equal or mixed")
    hi = cfg.max_new_tokens
    lo = max(1, hi // 4)
    g = torch.Generator().manual_seed(cfg.seed * 7_919 + 17)
    return torch.randint(lo, hi + 1, (n,), generator=g).tolist()


def request_rates_of(cfg) -> list[float | None]:
    """The arrival rates to sweep, requests per second (``request_rates``); [None] where none
    is given: every request waiting from the start (a saturated server)."""
    rates = list(cfg.request_rates or [])
    for r in rates:
        if isinstance(r, bool) or not isinstance(r, int | float) or not (0 < r < math.inf):
            raise BatchError(
                f"request_rates={rates}: {r!r} is not a rate; requests per second, > 0 "
                "(leave request_rates empty for every request waiting from the start)"
            )
    return [float(r) for r in rates] or [None]


def arrival_times(n: int, rate: float, seed: int) -> list[float]:
    """A Poisson arrival process at ``rate`` requests per second (vLLM's benchmark_serving
    ``--request-rate``): the first request at 0, then exponential gaps of mean 1 / rate, drawn
    by a generator seeded with ``seed``: every configuration, policy and repeat meets the same
    schedule."""
    g = torch.Generator().manual_seed(seed * 7_919 + 29)
    gaps = torch.empty(max(0, n - 1), dtype=torch.float64).exponential_(rate, generator=g)
    return [0.0, *torch.cumsum(gaps, 0).tolist()][:n]


def arrive(requests: list[GenRequest], rate: float | None, seed: int) -> list[GenRequest]:
    """The requests, arriving at ``rate`` (None: all waiting from the start)."""
    if rate is None:
        return requests
    times = arrival_times(len(requests), rate, seed)
    return [dataclasses.replace(r, arrival=t) for r, t in zip(requests, times, strict=True)]


def wants_batch(cfg) -> bool:
    return (
        bool(cfg.batch_sizes)
        or cfg.batch_size != 1
        or cfg.stop == "goodput"
        or bool(cfg.batch_policies)
        or bool(cfg.request_rates)
    )


def _row(stats, plain, b: int, policy: str) -> dict[str, Any]:
    s = stats.rows
    drafted = sum(s.drafted.values())
    accepted = sum(s.accepted.values())
    iters = s.target_calls
    tps, ptps = stats.tokens_per_second, plain.tokens_per_second
    rtps, prtps = stats.request_tokens_per_second, plain.request_tokens_per_second
    other = s.t_total - s.t_target - s.t_draft - s.t_prefill
    decode, plain_decode = s.t_total - s.t_prefill, plain.rows.t_total - plain.rows.t_prefill
    lat, plain_lat = stats.latency_summary(), plain.latency_summary()
    return {
        "batch_size": b,
        "policy": policy,
        "tokens_per_second": tps,
        "plain_tokens_per_second": ptps,
        "speedup": tps / ptps if ptps else float("nan"),
        # the same new tokens, timed after the prefills (the drafter's reading of newcomers
        # counts as prefill): what speculation changes where long prompts dominate the wall
        "decode_speedup": (s.new_tokens / decode) / (plain.rows.new_tokens / plain_decode)
        if decode > 0 and plain_decode > 0 and plain.rows.new_tokens
        else float("nan"),
        "request_tokens_per_second": rtps,
        "plain_request_tokens_per_second": prtps,
        "request_speedup": rtps / prtps if prtps else float("nan"),
        # plain's mean end-to-end latency over speculation's (> 1: requests finish sooner)
        "latency_speedup": plain_lat["latency"]["mean"] / lat["latency"]["mean"]
        if lat["latency"]["mean"] > 0
        else float("nan"),
        "tau": s.tau,
        "alpha": s.alpha,
        "alpha_per_position": s.alpha_per_position(),
        "draft_acceptance_rate": accepted / drafted if drafted else float("nan"),
        "mean_gamma": sum(g * n for g, n in s.gamma_used.items()) / iters if iters else 0.0,
        "gamma_used": {str(k): v for k, v in sorted(s.gamma_used.items())},
        "batch_gamma": {str(k): v for k, v in sorted(stats.batch_gamma.items())},
        "forwards": stats.forwards,
        "plain_forwards": plain.forwards,
        "mean_rows_per_forward": stats.row_slots / stats.forwards if stats.forwards else 0.0,
        "plain_mean_rows_per_forward": plain.row_slots / plain.forwards if plain.forwards else 0.0,
        "prefills": stats.prefills,
        "probes": stats.probes,
        "drain_forwards": stats.drain_forwards,
        "plain_prefills": plain.prefills,
        # query tokens fed that were padding (rows with shorter proposals than the longest)
        "padding_fraction": 1 - (iters + drafted) / stats.verified_tokens
        if stats.verified_tokens
        else 0.0,
        # cache columns attended that hold nothing for the row (left padding, rejected drafts)
        "hole_fraction": 1 - stats.valid_columns / stats.cache_columns
        if stats.cache_columns
        else 0.0,
        "new_tokens": s.new_tokens,
        # per request, from its arrival: time to first token, time per output token after the
        # first, end-to-end latency (mean, p50, p90, p99 seconds)
        "latency": lat,
        "plain_latency": plain_lat,
        "idle_s": stats.idle,
        "time_s": {
            "total": s.t_total,
            "target_forward": s.t_target,
            "draft": s.t_draft,
            "prefill": s.t_prefill,
            "other": other,
        },
        "plain_time_s": {
            "total": plain.rows.t_total,
            "target_forward": plain.rows.t_target,
            "prefill": plain.rows.t_prefill,
        },
    }


def pooled(stats: list) -> BatchStats:
    """Several runs of one configuration as one: counters and seconds added."""
    out = BatchStats()
    for s in stats:
        out.rows.merge(s.rows)
        out.forwards += s.forwards
        out.prefills += s.prefills
        out.probes += s.probes
        out.drain_forwards += s.drain_forwards
        out.row_slots += s.row_slots
        out.verified_tokens += s.verified_tokens
        out.batch_gamma.update(s.batch_gamma)
        out.wall += s.wall
        out.requests.extend(s.requests)
        out.latencies.extend(s.latencies)
        out.idle += s.idle
        out.cache_columns += s.cache_columns
        out.valid_columns += s.valid_columns
    return out


def evaluate_batched(
    cfg, target, proposer, draft_desc: str, questions, sampling, stop: set[int]
) -> dict[str, Any]:
    """The batch sweep's report (see the module docstring)."""

    check_batch_settings(cfg, target, proposer)
    sizes, policies = batch_sizes_of(cfg), policies_of(cfg)
    tok = target.tokenizer
    prompts = [prompt_ids(tok, [{"role": "user", "content": q["turns"][0]}]) for q in questions]
    budgets = request_budgets(cfg, len(prompts))
    requests = [
        GenRequest(i, p, seed=cfg.seed * 100_003 + i, max_new_tokens=n)
        for i, (p, n) in enumerate(zip(prompts, budgets, strict=True))
    ]
    admit = cfg.batch_admit
    if not isinstance(admit, int) or admit < 1:
        raise BatchError(f"batch_admit={admit}: a number of free slots, >= 1")
    for b in sizes:
        if admit > b:
            where = f"batch_sizes={sizes}" if cfg.batch_sizes else f"batch_size={b}"
            raise BatchError(f"batch_admit={admit}: larger than the batch of {b} ({where})")
    # warm-up: first-call costs stay out of the timings
    for pr in (NoDraft(), proposer):
        BatchDecoder(
            target, pr, sampling, 2, gamma=cfg.gamma, calibrate=False, compile=cfg.compile
        ).run(requests[:2], cfg.warmup_tokens, stop)
    reference = logits = None
    if sampling.greedy:
        # the batch-1 reference on the batched decoder's forward (transformers', or the lean
        # one over a static cache), so a parted row is told apart by the rounding of one code
        # path, not two
        ref_dec = SpeculativeDecoder(
            target, NoDraft(), sampling, gamma=0, record_logits=True, compile=cfg.compile
        )
        reference, logits = {}, {}
        for r in tqdm(requests, desc="batch-1 reference", dynamic_ncols=True, file=sys.stderr):
            reference[r.key] = ref_dec.generate(r.prompt, r.budget(cfg.max_new_tokens), stop)
            logits[r.key] = ref_dec.last_logits
    tolerance = NEAR_TIE_TOLERANCE.get(target.dtype, 0.5)
    rows, detail = [], []
    if cfg.batch_repeats < 1:
        raise BatchError(f"batch_repeats={cfg.batch_repeats}: must be >= 1")
    rates = request_rates_of(cfg)
    sweep = _Sweep(
        cfg, target, proposer, sampling, stop, policies, reference, logits, tolerance, detail
    )
    for b in sizes:
        cost = None  # one cost model per batch size, shared by the policies that use it
        if "goodput" in policies:
            cost = StepCostModel.for_proposer(sweep.runner(b, proposer), proposer, cfg.gamma, b)
        if cfg.batch_warmup:
            # the device meets this batch's shapes in an untimed plain run first: else the
            # first timed run (plain's) pays for them alone (EvalConfig.batch_warmup)
            sweep.decoder("plain", b, None).run(requests, cfg.max_new_tokens, stop)
        for rate in rates:
            rows.extend(_sweep_point(sweep, b, rate, cost, arrive(requests, rate, cfg.seed)))
    greedy = sampling.greedy
    lossless = all(r["lossless"] for r in rows) if greedy else None
    if greedy:
        n_div = sum(r["divergences"] for r in rows)
        near = sum(r["near_tie_divergences"] for r in rows)
        note = (
            f"every row compared with its prompt's batch-1 plain greedy output: "
            f"{len(rows) * len(requests) - n_div}/{len(rows) * len(requests)} identical"
            + (
                f"; {n_div} parted, {near} at a near-tie (logit gap <= {tolerance})"
                if n_div
                else ""
            )
        )
    else:
        flagged = [r for r in rows if r["sample_check"]["flag"]]
        note = (
            "T > 0: outputs are samples, each request with its own random stream, scored by the "
            "target (decoding/sample_check.py): "
            + (
                f"{len(flagged)} of {len(rows)} rows FLAGGED"
                if flagged
                else "every row's samples consistent with the target's distribution"
            )
        )
    return {
        "batch": rows,
        "lossless": lossless,
        "lossless_note": note,
        "divergence_details": detail,
        "convention": CONVENTION + " " + BATCH_CONVENTION,
        "num_requests": len(requests),
        # the requests' own lengths (fewest, most) where they differ
        "request_tokens": [min(budgets), max(budgets)]
        if budgets and budgets[0] is not None
        else None,
        "draft_description": draft_desc,
        # which target forward ran (one runner per batch size, plain and drafting apart)
        "decoder": {
            "runner": sorted({r.kind for r in sweep.runners.values()}),
            "compile": compile_mode(cfg.compile),
            "capture_seconds": sum(r.capture_seconds for r in sweep.runners.values())
            + sum(d.capture_seconds for d in sweep.drafters.values() if d is not None),
        },
    }


@dataclasses.dataclass
class _Sweep:
    """What every point of a sweep shares; ``detail`` collects the divergences found."""

    cfg: Any
    target: Any
    proposer: Any
    sampling: Any
    stop: set[int]
    policies: list[str]
    reference: dict | None  # T = 0: each request's batch-1 plain greedy output
    logits: dict | None  # ... and its logits, to classify a divergence
    tolerance: float
    detail: list
    # one runner (static cache, graphs) per (batch size, plain or drafting), built once, and
    # the drafter on fixed shapes where graphs run, per batch size
    runners: dict = dataclasses.field(default_factory=dict)
    drafters: dict = dataclasses.field(default_factory=dict)

    def runner(self, b: int, proposer):
        """The target runner decoders of batch size ``b`` with ``proposer`` share (plain
        decoding reads no features, so it has its own)."""
        key = (b, isinstance(proposer, NoDraft))
        if key not in self.runners:
            gamma = 0 if key[1] else self.cfg.gamma
            dec = BatchDecoder(
                self.target,
                proposer,
                self.sampling,
                b,
                gamma=gamma,
                calibrate=False,
                compile=self.cfg.compile,
            )
            self.runners[key], self.drafters[key] = dec.runner, dec.fixed_drafter
        return self.runners[key]

    def decoder(self, name: str, b: int, cost) -> BatchDecoder:
        """A decoder for policy ``name`` (``plain``: no draft) at batch size ``b``."""
        if name == "plain":
            pr, gamma, name = NoDraft(), 0, "fixed"
        else:
            pr, gamma = self.proposer, self.cfg.gamma
        return BatchDecoder(
            self.target,
            pr,
            self.sampling,
            b,
            gamma=gamma,
            policy=name,
            cost=cost,
            admit=self.cfg.batch_admit,
            runner=self.runner(b, pr),
            drafter=self.drafters[(b, isinstance(pr, NoDraft))],
        )


def _sweep_point(
    sw: _Sweep, b: int, rate: float | None, cost, requests: list[GenRequest]
) -> list[dict[str, Any]]:
    """One batch size at one arrival rate (None: every request waiting from the start): plain
    decoding and each policy on the same requests, ``batch_repeats`` times; a report row per
    policy (divergences from the batch-1 reference appended to ``sw.detail``)."""

    cfg, sampling, stop = sw.cfg, sw.sampling, sw.stop
    policies, reference, logits, tolerance = sw.policies, sw.reference, sw.logits, sw.tolerance
    bar = tqdm(
        total=len(requests) * (1 + len(policies)) * cfg.batch_repeats,
        desc=f"batch {b}" + ("" if rate is None else f", {rate:g} requests/s"),
        dynamic_ncols=True,
        file=sys.stderr,
    )
    out_rows = []
    names = ["plain", *policies]
    runs: dict[str, list] = {n: [] for n in names}
    outs: dict[str, dict] = {}
    for rep in range(cfg.batch_repeats):
        for name in names if rep % 2 == 0 else names[::-1]:
            dec = sw.decoder(name, b, cost)
            outs[name] = dec.run(requests, cfg.max_new_tokens, stop, progress=bar.update)
            runs[name].append(dec.stats)
    plain = pooled(runs["plain"])
    plain_out = outs["plain"]
    if not sampling.greedy:
        # T > 0: the last repeat's samples of each side scored by the target, as an engine's
        # are (decoding/sample_check.py); plain decoding at the same batch is the control
        plain_check = score(sw.target, _samples(requests, plain_out), sampling).row()
    for policy in policies:
        out = outs[policy]
        row = _row(pooled(runs[policy]), plain, b, policy)
        row["repeats"] = cfg.batch_repeats
        row["acceptance"] = acceptance_where(pooled(runs[policy]).rows, sampling)
        row["request_rate"] = rate
        if sampling.greedy:
            divs = []
            plain_divs = 0
            for r in requests:
                d = classify_divergence(reference[r.key], out[r.key], logits[r.key], tolerance)
                if d is not None:
                    divs.append({"request": r.key, **d})
                plain_divs += reference[r.key] != plain_out[r.key]
            near = sum(d["near_tie"] for d in divs)
            row.update(
                lossless=near == len(divs),
                divergences=len(divs),
                near_tie_divergences=near,
                plain_batch_vs_batch1_differ=plain_divs,
            )
            sw.detail.extend(
                {"batch_size": b, "request_rate": rate, "policy": policy, **d} for d in divs
            )
        else:
            spec_check = score(sw.target, _samples(requests, out), sampling).row()
            row.update(lossless=None, sample_check=checked(spec_check, plain_check))
        if policy == "goodput":
            row["cost_model"] = {
                "c0_s": cost.coef[0],
                "per_row_s": cost.coef[1],  # a row's first token
                "per_further_token_s": cost.coef[2],  # each token of a row after its first
                "per_wide_row_s": cost.coef[3],  # a row verifying more than one token
                "per_token_per_1k_columns_s": cost.coef[4],
                "relative_error": cost.rel_error,
                # the drafter's reading (a join's prefill), calibrated before the runs
                "read_ms_per_token": None
                if cost.read_s_per_token is None
                else cost.read_s_per_token * 1e3,
                "read_ms_fixed": cost.read_s_fixed * 1e3,  # ... and per reading
                # one draft step, timed likewise (the policy's price before its first draft)
                "draft_step_ms": None if cost.draft_step_s is None else cost.draft_step_s * 1e3,
            }
        out_rows.append(row)
    bar.close()
    return out_rows


def _samples(requests: list[GenRequest], outs: dict) -> list[tuple[list[int], list[int]]]:
    """(prompt ids, output ids) of each request, for ``sample_check.score``."""
    return [(r.prompt, outs[r.key]) for r in requests]
