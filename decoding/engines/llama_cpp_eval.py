"""``specdraft-eval engine=llama.cpp``: the same benches, settings and report as the built-in
decoder, with llama.cpp's ``llama-server`` doing the decoding.

Two servers run on loopback for the whole evaluation: the target alone (plain decoding) and the
target with the draft (speculative decoding); every prompt goes to both, interleaved, after a
warm-up. Figures come from the engine itself: tokens/s from its ``timings`` (generation only,
the prompt's prefill excluded, as in the built-in decoder), acceptance from its draft counters
(``draft_n``, ``draft_n_accepted``) and, per verification step, from its log (``accepted a/n
draft tokens``), which gives alpha per position with the built-in decoder's conventions
(``decoding.eval.CONVENTION``). At T = 0 every output is compared with the engine's own plain
greedy output, a divergence classified as a near-tie from the plain server's top-2 log-probs at
that point (asked again, outside the timings).

The draft (``llama_cpp_drafts``): llama.cpp's n-gram speculation, a head exported to GGUF
on the fly, a draft language model converted by llama.cpp's own converter, or a GGUF as it
is; ``gamma`` is the draft length. A DFlash-family block in llama.cpp has ``n_max + 1`` tokens: ``gamma`` is held to the trained
block's ``block_size - 1`` (a smaller gamma runs a shorter block than the draft was trained on,
and says so).

Predicted speedup: from the engine's own costs, measured apart from the evaluation (the
target's forward over k tokens with ``llama-bench``; the draft's cost per iteration and per
drafted token fitted on a calibration prompt at every chain length up to ``plan_max``) and the acceptance measured
here. ``plan=true`` picks n_max from those costs and a calibration run's acceptance before
evaluating. The ceiling is what a draft that is always right would give at those costs.

``engine_compare=true`` (the default): at T = 0, with a model draft and ``p_min=0``, the
built-in decoder then runs the same prompts with the draft the GGUF was written from, and the
report puts its acceptance beside llama.cpp's (``base.ours_beside``, as for vLLM).
"""

from __future__ import annotations

import math
from typing import Any

from omegaconf import DictConfig, OmegaConf

from conf.cli import StopSignals
from data.chat import prompt_ids
from models.target import load_target, target_gguf

from ..report import CONVENTION
from ..sample_check import check_run
from ..settings import EvalError, bench_questions, check_context, sampling_of, stop_ids
from .base import (
    EngineError,
    EngineStats,
    context_needed,
    engine_flag,
    lossless_note,
    ours_beside,
    run_bench,
    where_and_when,
)
from .llama_cpp import (
    BUILD,
    LlamaServer,
    bench_forward_ms,
    check_feature_target,
    converted_target,
    gguf_architecture,
    resolve_repack,
)
from .llama_cpp_drafts import draft_gguf


class CostModel:
    """The engine's costs on this machine, in ms: the target's forward over k tokens (from
    llama-bench), scaled so that k = 1 is the plain server's measured ms per token; the draft's
    fixed cost per drafting iteration ``c0`` and its cost per drafted token ``cd``."""

    def __init__(self, forward_ms: dict[int, float], plain_ms: float, c0: float, cd: float):
        self.forward_ms, self.plain_ms, self.c0, self.cd = forward_ms, plain_ms, c0, cd

    def verify(self, k: int) -> float:
        """ms of a target forward over k tokens, in the server."""
        ks = sorted(self.forward_ms)
        if k in self.forward_ms:
            v = self.forward_ms[k]
        elif k > ks[-1]:  # linear beyond the largest measured size
            a, b = ks[-2], ks[-1]
            v = self.forward_ms[b] + (k - b) * (self.forward_ms[b] - self.forward_ms[a]) / (b - a)
        else:
            lo = max(x for x in ks if x < k)
            hi = min(x for x in ks if x > k)
            w = (k - lo) / (hi - lo)
            v = (1 - w) * self.forward_ms[lo] + w * self.forward_ms[hi]
        return v * self.plain_ms / self.forward_ms[1]

    def iteration(self, drafted: int, draft_steps: int | None = None) -> float:
        """ms of one iteration that verifies ``drafted`` tokens; ``draft_steps``: the draft's
        forwards (default ``drafted``; one more when a confidence stop ended the chain: the
        step whose token fell below p_min ran too)."""
        steps = drafted if draft_steps is None else draft_steps
        return self.verify(drafted + 1) + self.c0 + steps * self.cd

    def predicted_speedup(
        self, steps: list[tuple[int, int]], plain_steps: int, n_max: int = 0, p_min: float = 0.0
    ) -> float:
        """Speedup the costs predict for these verification steps (accepted, drafted) and
        forwards without a draft (each still pays the draft's fixed cost ``c0``). With
        ``p_min`` > 0 a chain shorter than ``n_max`` ran one draft step more than it drafted,
        and a forward without a draft ran one."""
        extra = 1 if p_min > 0 else 0
        tokens = sum(a + 1 for a, _ in steps) + plain_steps
        ms = sum(self.iteration(d, d + (extra if d < n_max else 0)) for _, d in steps)
        ms += plain_steps * (self.plain_ms + self.c0 + extra * self.cd)
        return (tokens / ms) * self.plain_ms if ms else float("nan")

    def expected_speedup(self, alphas: list[float], n: int) -> float:
        """A chain of n with conditional acceptance ``alphas`` per position, p_min 0."""
        tokens, run = 1.0, 1.0
        for k in range(n):
            run *= alphas[k] if k < len(alphas) and alphas[k] is not None else 0.0
            tokens += run
        return tokens * self.plain_ms / self.iteration(n)

    def ceiling(self, n_max: int = 8) -> tuple[float, int]:
        """(speedup, n) of a draft that is always right, at the best chain length <= n_max."""
        return max(((n + 1) * self.plain_ms / self.iteration(n), n) for n in range(1, n_max + 1))

    def as_dict(self) -> dict[str, Any]:
        return {
            "plain_ms_per_token": self.plain_ms,
            "target_forward_ms_by_tokens": {
                str(k): self.verify(k) for k in sorted(self.forward_ms)
            },
            "draft_ms_per_iteration": self.c0,
            "draft_ms_per_drafted_token": self.cd,
            "draft_step_over_target_step": (self.c0 + self.cd) / self.plain_ms,
        }


def window_note(target, tgt_gguf, reach: int) -> str | None:
    """What to say where the target attends within a window in every layer (Mistral's shape),
    its requests reach past it, and llama.cpp computes it as its ``llama`` architecture,
    which has no window (target and draft read the whole context there; transformers, vLLM and
    the built-in decoder read the window)."""
    window = target.draft_window
    if not window or reach <= window or gguf_architecture(tgt_gguf) != "llama":
        return None
    return (
        f"note: the target attends within {window} tokens in every layer; llama.cpp b{BUILD} "
        f"computes it (architecture 'llama') without that window, target and draft alike: "
        f"past {window} tokens (these requests reach {reach}) its outputs and acceptance can "
        "differ from the target's own"
    )


def context_size(cfg: DictConfig, tok, questions: list[dict]) -> int:
    """The context each server holds: what the longest request reaches, at least llama.cpp's
    default 4096 (which a long bench prompt and its answer can pass: the server refuses the
    request)."""
    longest = max(cfg.max_new_tokens, cfg.calibration_tokens, cfg.warmup_tokens)
    return max(4096, context_needed(cfg, tok, questions, longest))


def evaluate(cfg: DictConfig, log=print) -> dict[str, Any]:

    if cfg.max_new_tokens < 1:
        raise EvalError(f"max_new_tokens={cfg.max_new_tokens}: must be >= 1")
    if not 0.0 <= cfg.p_min <= 1.0:
        raise EvalError(f"p_min={cfg.p_min}: must be in [0, 1]")
    if cfg.gamma < 1:
        raise EvalError(f"gamma={cfg.gamma}: the engine's n_max, must be >= 1")
    if cfg.tree not in ("auto", "chain"):
        raise EvalError(f"tree={cfg.tree}: llama.cpp drafts chains (use tree=auto or chain)")
    target = load_target(OmegaConf.to_object(cfg.target))
    tok = target.tokenizer
    questions = bench_questions(cfg)
    check_context(cfg, target, questions)  # a question past the context: before any conversion
    # the target's GGUF: given, the embedded target's own, or converted once by llama.cpp
    tgt_gguf = target_gguf(target, cfg.target_gguf) or converted_target(target, log)
    spec_type, draft, desc, block = draft_gguf(cfg, target, log, tgt_gguf)
    check_feature_target(tgt_gguf, spec_type)  # before any server starts
    note = window_note(target, tgt_gguf, context_needed(cfg, tok, questions, cfg.max_new_tokens))
    if note:
        log(note)
    repack = resolve_repack(cfg.engine_repack, tgt_gguf, log)
    threads = cfg.engine_threads or None
    stop = stop_ids(cfg, tok, target)  # ignore_eos was refused before: EOS ends a reply
    greedy = cfg.temperature == 0
    sampling = {"temperature": cfg.temperature, "top_k": cfg.sample_top_k, "top_p": cfg.top_p}
    n_max, p_min = int(cfg.gamma), float(cfg.p_min)
    if block is not None:  # a DFlash block in llama.cpp is [last token, mask x n_max]
        if n_max != block - 1:
            log(
                f"gamma={n_max}: llama.cpp runs a DFlash-family block of n_max + 1 tokens; "
                f"n_max = {block - 1} runs the block of {block} the draft was trained on"
                + (" (clamped)" if n_max > block - 1 else " (a shorter block than trained)")
            )
        n_max = min(n_max, block - 1)
    warm = prompt_ids(tok, [{"role": "user", "content": questions[0]["turns"][0]}])
    ctx = context_size(cfg, tok, questions)

    def spec_server(n: int, p: float | None = None) -> LlamaServer:
        return LlamaServer(
            tgt_gguf,
            draft,
            spec_type=spec_type,
            n_max=n,
            p_min=p_min if p is None else p,
            threads=threads,
            ngram=cfg.ngram_max,
            repack=repack,
            ctx_size=ctx,
        )

    with LlamaServer(tgt_gguf, threads=threads, repack=repack, ctx_size=ctx) as plain:
        plain.complete(warm, cfg.warmup_tokens, **sampling, seed=cfg.seed)
        costs = plan = None
        if cfg.predict or cfg.plan:
            costs, plan = _calibrate(
                cfg, plain, spec_server, tgt_gguf, warm, plain.threads, log, repack, n_max, block
            )
            if cfg.plan:
                n_max = plan["n_max"] if block is None else min(plan["n_max"], block - 1)
                log(f"plan: n_max={n_max} (predicted {plan['predicted_speedup']:.2f}x)")
        with spec_server(n_max) as spec:
            spec.complete(warm, cfg.warmup_tokens, **sampling, seed=cfg.seed)
            run = run_bench(plain, spec, questions, cfg, tok, stop, "llama.cpp")
    if not run.finished:
        raise EngineError(run.error)
    pooled, divergences = run.pooled, run.divergences
    report = pooled.row()
    near = sum(bool(d["near_tie"]) for d in divergences)
    note = lossless_note(run, greedy, cfg.engine_tie_tolerance, "llama.cpp's own sampling")
    pred = (
        costs.predicted_speedup(pooled.steps, pooled.plain_steps, n_max, p_min)
        if costs
        else float("nan")
    )
    # the ceiling over the chain lengths whose forward was measured, not extrapolated
    ceiling = costs.ceiling(max(costs.forward_ms) - 1) if costs else (float("nan"), 0)
    report.update(
        {
            "engine": f"llama.cpp b{BUILD} (llama-server)",
            "predicted_speedup": pred,
            "predicted_vs_measured": pred / report["speedup"] if costs else float("nan"),
            "ceiling_speedup": ceiling[0],
            "ceiling_n_max": ceiling[1],
            "costs": costs.as_dict() if costs else None,
            "plan": plan,
            "draft_cost_ratio": (costs.c0 + costs.cd) / costs.plain_ms if costs else float("nan"),
            "lossless": (near == len(divergences)) if greedy else None,
            "divergences": len(divergences) if greedy else None,
            "near_tie_divergences": near if greedy else None,
            "divergence_details": divergences,
            "lossless_note": note,
            "acceptance": "greedy" if greedy else "llama.cpp sampling",
            "verifier_changed": None,
            "convention": CONVENTION
            + " In llama.cpp: tokens/s from its timings ((predicted_n - 1) / predicted_ms, the "
            "first token being the prompt's forward's, as llama.cpp counts); alpha per "
            "position from its per-step 'accepted a/n draft tokens' log; draft_acceptance_rate "
            "from draft_n_accepted / draft_n.",
            "per_category": {c: s.row() for c, s in sorted(run.per_category.items())},
            "settings": {
                **OmegaConf.to_container(cfg, resolve=True),
                "n_max": n_max,
                "spec_type": spec_type,
                "draft_description": f"{desc}; llama.cpp {spec_type}, n_max {n_max}, p_min {p_min}",
                "target_identity": target.identity,
                "target_gguf": str(tgt_gguf),
                "draft_gguf": str(draft) if draft else None,
                "engine_threads": plain.threads,
                "engine_repack_used": repack,
                **where_and_when(),
            },
            "outputs": run.outputs,
        }
    )
    if not greedy:
        report["sample_check"] = check_run(target, run.samples, sampling_of(cfg), log)
    why_not = _no_comparison(cfg, greedy, p_min)
    if run.stopped is not None:  # a stop: report what the engine finished, now
        why_not = "the run was stopped"
    if cfg.engine_compare and why_not is None:
        ours = ours_beside(cfg, str(cfg.draft), "greedy", pooled, log, n_max, run.outputs)
        if StopSignals.requested() is None:
            report["ours"] = ours
            report["engine_flag"] = engine_flag(ours, pooled)
        else:  # on fewer prompts than the engine's: no comparison
            report["ours_left_out"] = "the run was stopped"
    elif cfg.engine_compare:
        report["ours_left_out"] = why_not
        log(f"the built-in decoder's comparison is left out: {why_not}")
    return report


def _no_comparison(cfg, greedy: bool, p_min: float) -> str | None:
    """Why the built-in decoder cannot run what the engine ran (None: it can): the same draft
    as a fixed chain at T = 0."""
    d = str(cfg.draft)
    if not greedy:
        return "at T > 0 llama.cpp samples by its own rule"
    if d in ("ngram", "pld"):
        return "llama.cpp's n-gram lookup is its own"
    if p_min > 0:
        return f"p_min={p_min}: llama.cpp's confidence stop is not a fixed chain"
    if d.endswith(".gguf"):
        return "a GGUF draft: the built-in decoder reads the draft it was written from"
    return None


def nonnegative_fit(A, y) -> tuple[float, float]:
    """Least squares ``A @ (c0, cd) ~ y`` with both costs >= 0: where the free fit makes one
    negative, it is 0 and the other is fitted alone (clamping the free fit instead would keep
    a value chosen beside a negative partner)."""
    import numpy as np

    sol = np.linalg.lstsq(A, y, rcond=None)[0]
    if (sol >= 0).all():
        return float(sol[0]), float(sol[1])
    best = None
    for j in (0, 1):
        col = A[:, j]
        v = max(0.0, float(col @ y / (col @ col))) if col @ col else 0.0
        err = float(((y - v * col) ** 2).sum())
        if best is None or err < best[0]:
            best = (err, j, v)
    _, j, v = best
    return (v, 0.0) if j == 0 else (0.0, v)


def _calibrate(cfg, plain, spec_server, tgt_gguf, prompt, threads, log, repack, n_max, block):
    """The engine's costs, measured on a calibration prompt apart from the evaluation's runs:
    the plain server's ms per token; the target's forward over k tokens (llama-bench); the
    draft's cost per iteration and per draft forward, fitted (least squares) to speculative
    runs at p_min 0 and every n_max from 1 to ``plan_max`` (and ``gamma``; a server each: the
    drafter reads its length at start); and the acceptance per position at ``plan_max`` (for
    the plan). ``n_max``: the chain length the evaluation runs (``gamma``, held to a DFlash
    block's ``block - 1``, which also bounds ``plan_max``)."""
    n = cfg.calibration_tokens
    sampling = {"temperature": cfg.temperature, "top_k": cfg.sample_top_k, "top_p": cfg.top_p}
    ar = plain.complete(prompt, n, **sampling, seed=cfg.seed)
    plain_ms = ar.predicted_ms / max(1, int(ar.timings.get("timed_n") or 1))  # per forward
    top = int(cfg.plan_max) if block is None else min(int(cfg.plan_max), block - 1)
    longest = max(top, n_max)
    log(f"calibrating: the target's forward over 1..{longest + 1} tokens (llama-bench)")
    fwd = bench_forward_ms(tgt_gguf, list(range(1, longest + 2)), threads, repack=repack)
    rows = []
    alphas = None
    # at p_min 0: every iteration drafts the whole chain, so the draft's forwards are known
    # and the two costs separate across chain lengths (a confidence stop would blur them)
    for nm in range(1, longest + 1):
        with spec_server(nm, 0.0) as srv:
            srv.complete(prompt, cfg.warmup_tokens, **sampling, seed=cfg.seed)
            c = srv.complete(prompt, n, **sampling, seed=cfg.seed)
        st = EngineStats()
        st.add(c, ar)
        rows.append((st, c))
        if nm == top:
            alphas = st.alpha_per_position()
    log(f"calibrated on {len(rows)} chain lengths")
    # ms left for the draft once the target's forwards are paid: c0 per forward + cd per token
    base = CostModel(fwd, plain_ms, 0.0, 0.0)
    import numpy as np

    A, y = [], []
    for st, c in rows:
        verify = sum(base.verify(d + 1) for _, d in st.steps) + st.plain_steps * plain_ms
        A.append([st.target_calls, sum(d for _, d in st.steps)])
        y.append(c.predicted_ms - verify)
    c0, cd = nonnegative_fit(np.array(A, float), np.array(y, float))
    costs = CostModel(fwd, plain_ms, c0, cd)
    alphas = [a if a is not None else 0.0 for a in (alphas or [])]
    options = {k: costs.expected_speedup(alphas, k) for k in range(1, top + 1)}
    best = max(options, key=options.get)
    plan = {
        "n_max": best,
        "predicted_speedup": options[best],
        "predicted_by_n_max": {str(k): v for k, v in options.items()},
        "calibration_alpha_per_position": alphas,
        "note": "at the configured p_min; the draft's acceptance per position from a calibration run at "
        f"n_max {top}; costs measured in the engine",
    }
    if math.isnan(options[best]):
        plan["n_max"] = n_max
    return costs, plan
