"""The contract every serving engine keeps, and what the evaluator does with any of them.

An engine takes token-id prompts and sampling settings and gives back the new tokens, its own
acceptance counters and its own timings (``Completion``). ``specdraft-eval engine=<name>`` runs
two of them, the target alone and the target with the draft, over the same prompts,
interleaved, after a warm-up (``run_bench``); pools their counters (``EngineStats``); compares
every T = 0 output with the plain engine's, a divergence classified as a near-tie from the
plain engine's own top log-probs at that point (``Engine.top_logprobs``); and writes the same
report as the built-in decoder. An engine is one module of this package with an
``evaluate(cfg, log) -> report`` function, named in ``ENGINES`` (``__init__.py``).
"""

from __future__ import annotations

import math
import os
import platform
import sys
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from tqdm.auto import tqdm

from conf.cli import Stopped, StopSignals
from data.chat import prompt_ids


def cached_export(path: Path, head, fmt: str, log, suffix: str = "", **opts: Any) -> Path:
    """The folder where the trained draft at ``path`` (loaded as ``head``) is exported to
    ``fmt`` for an engine: once, checked and re-imported by ``specdraft-export``'s pipeline,
    then cached under ``engine-drafts``, keyed by the draft's folder and its weights' names,
    sizes and times (a retrained draft is exported again) and by the code that writes the
    layouts (``export_code_digest``: an export an older specdraft wrote, before a layout was
    fixed, is not served again)."""
    from models.export import export

    out = engine_draft_dir(path, suffix, salt=export_code_digest())
    if not (out / "config.json").is_file():
        log(f"exporting {path} (--format {fmt}) for the engine: {out}")
        export(head, fmt, out, force=True, log=log, **opts)
    return out


def export_code_digest() -> str:
    """A digest of the code that writes every export layout (``models/export.py``,
    ``models/gguf.py`` and each method's ``export.py`` and ``gguf.py``): it changes with any
    change to a layout."""
    import hashlib

    import models

    root = Path(models.__file__).parent
    h = hashlib.sha256()
    for pattern in ("export.py", "gguf.py", "*/export.py", "*/gguf.py"):
        for f in sorted(root.glob(pattern)):
            h.update(f.relative_to(root).as_posix().encode() + b"\0" + f.read_bytes())
    return h.hexdigest()


def engine_draft_dir(
    path: Path, suffix: str = "", area: str = "engine-drafts", salt: str = ""
) -> Path:
    """The cache folder (under ``area``) for what an engine serves of the model at ``path``
    (a trained draft; a target, in ``engine-targets``), keyed by the folder, its weights'
    names, sizes and times (a retrained draft gets a new one) and ``salt``."""
    import hashlib

    h = hashlib.sha256(salt.encode())
    for f in sorted(path.rglob("*.safetensors"))[:4]:
        st = f.stat()
        h.update(f"{f.name}:{st.st_size}:{st.st_mtime_ns}".encode())
    return cache_root() / area / f"{path.resolve().name}-{h.hexdigest()[:10]}{suffix}"


def default_threads(threads: int | None = None) -> int:
    """The threads an engine computes with: ``threads`` where given (``engine_threads``), else
    this process's ``OMP_NUM_THREADS`` where set, else every core. One rule for every engine:
    an engine run beside other work that was told to keep to one thread (a test worker, a job
    sharing its machine) keeps to it too, rather than spinning threads against that work."""
    if threads:
        return int(threads)
    return int(os.environ.get("OMP_NUM_THREADS") or os.cpu_count() or 1)


class EngineError(RuntimeError):
    """The engine is missing, would not start, or failed; the message says which and what to
    do."""


def cache_root() -> Path:
    return Path(os.environ.get("SPECDRAFT_CACHE", "~/.cache/specdraft")).expanduser()


@dataclass
class Completion:
    """One request's result: the new token ids and the engine's own counters.

    ``timings``: ``predicted_n`` (tokens generated), ``predicted_ms`` (the time they took,
    the prompt's prefill excluded), ``timed_n`` (the tokens that time covers, when not all of
    them: vLLM times from the first token to the last), ``draft_n`` / ``draft_n_accepted``."""

    tokens: list[int]
    timings: dict[str, Any]
    # per verification step of a speculative request: (accepted, drafted)
    steps: list[tuple[int, int]] = field(default_factory=list)

    @property
    def predicted_ms(self) -> float:
        return float(self.timings.get("predicted_ms") or 0.0)

    @property
    def drafted(self) -> int:
        return int(self.timings.get("draft_n") or 0)

    @property
    def accepted(self) -> int:
        return int(self.timings.get("draft_n_accepted") or 0)


class Engine(Protocol):
    """One model (and, for the speculative side, its draft) served by an engine."""

    def complete(
        self,
        prompt: list[int],
        n_predict: int,
        temperature: float = 0.0,
        seed: int = 0,
        top_k: int = 0,
        top_p: float = 1.0,
    ) -> Completion:
        """Decode up to ``n_predict`` tokens after ``prompt`` (token ids, fed as they are)."""
        ...

    def top_logprobs(self, prompt: list[int], k: int) -> dict[int, float]:
        """The model's top-``k`` next-token log-probs after ``prompt`` (outside any timing)."""
        ...


def steps_from_positions(drafts: int, gamma: int, accepted_per_pos: list[int]) -> list:
    """(accepted, drafted) per verification from an engine's pooled counters: ``drafts``
    verifications of ``gamma`` tokens each and, per position k, how many accepted it (a
    position is accepted only after every earlier one, so the counts give the histogram)."""
    acc = list(accepted_per_pos[:gamma]) + [0] * max(0, gamma - len(accepted_per_pos))
    bounds = [drafts] + acc
    steps = []
    for a in range(gamma + 1):
        nxt = bounds[a + 1] if a < gamma else 0
        steps += [(a, gamma)] * max(0, bounds[a] - nxt)
    return steps


def context_needed(cfg, tok, questions: list[dict], longest: int) -> int:
    """The tokens a request can reach: every turn fed with the answers before it, each answer
    up to ``longest`` tokens, and a margin (an engine's context, or vLLM's max_model_len)."""
    room = max(
        len(prompt_ids(tok, [{"role": "user", "content": t}]))
        for q in questions
        for t in q["turns"][: cfg.turns]
    )
    return cfg.turns * (room + longest) + 64


class EngineStats:
    """Pooled counters of speculative requests in the engine (and of the matching plain ones)."""

    def __init__(self) -> None:
        self.tokens = self.ar_tokens = 0
        self.timed = self.ar_timed = 0
        self.ms = self.ar_ms = 0.0
        self.drafted = self.accepted = 0
        self.steps: list[tuple[int, int]] = []  # (accepted, drafted) per verification
        self.plain_steps = 0  # target forwards of the speculative run that verified no draft
        self.requests = 0

    def add(self, spec: Completion, ar: Completion) -> None:
        self.requests += 1
        n = int(spec.timings.get("predicted_n") or len(spec.tokens))
        n_ar = int(ar.timings.get("predicted_n") or len(ar.tokens))
        self.tokens += n
        self.ar_tokens += n_ar
        # a request whose time covers no token (one token, from the prompt's forward) adds
        # neither tokens nor time to the rate
        timed = int(spec.timings.get("timed_n", n))
        ar_timed = int(ar.timings.get("timed_n", n_ar))
        if timed > 0:
            self.timed += timed
            self.ms += spec.predicted_ms
        if ar_timed > 0:
            self.ar_timed += ar_timed
            self.ar_ms += ar.predicted_ms
        self.drafted += spec.drafted
        self.accepted += spec.accepted
        self.steps += spec.steps
        # the first token comes from the prompt's forward; every other forward emits a + 1
        self.plain_steps += max(0, (n - 1) - sum(a + 1 for a, _ in spec.steps))

    @property
    def target_calls(self) -> int:
        return len(self.steps) + self.plain_steps

    def alpha_per_position(self) -> list[float | None]:
        depth = max((d for _, d in self.steps), default=0)
        out = []
        for k in range(1, depth + 1):
            tested = sum(1 for a, d in self.steps if d >= k and a >= k - 1)
            acc = sum(1 for a, _ in self.steps if a >= k)
            out.append(acc / tested if tested else None)
        return out

    def row(self) -> dict[str, Any]:
        tested = sum(min(d, a + 1) for a, d in self.steps)
        acc = sum(a for a, _ in self.steps)
        tps = 1000 * self.timed / self.ms if self.ms else float("nan")
        ar_tps = 1000 * self.ar_timed / self.ar_ms if self.ar_ms else float("nan")
        calls = self.target_calls
        return {
            # the first token of a request comes from the prompt's forward, not a verification
            "tau": (self.tokens - self.requests) / calls if calls else float("nan"),
            "alpha": acc / tested if tested else float("nan"),
            "alpha_per_position": self.alpha_per_position(),
            "draft_acceptance_rate": self.accepted / self.drafted if self.drafted else float("nan"),
            "tokens_per_second": tps,
            "ar_tokens_per_second": ar_tps,
            "speedup": tps / ar_tps if ar_tps else float("nan"),
            "target_calls": calls,
            "drafting_iterations": len(self.steps),
            "drafted": self.drafted,
            "accepted": self.accepted,
            "new_tokens": self.tokens,
            "ar_new_tokens": self.ar_tokens,
            "gamma_used": {str(k): v for k, v in sorted(Counter(d for _, d in self.steps).items())},
            "accept_length_hist": {
                str(k): v for k, v in sorted(Counter(a for a, _ in self.steps).items())
            },
            "tree_iterations": 0,
            "time_s": {
                "total": self.ms / 1000,
                "ar_total": self.ar_ms / 1000,
                "other_fraction": None,
            },
        }


@dataclass
class BenchRun:
    """What ``run_bench`` measured: pooled and per-category counters, every output, and the
    T = 0 comparison with the plain engine."""

    pooled: EngineStats
    per_category: dict[str, EngineStats]
    outputs: list[dict[str, Any]]
    divergences: list[dict[str, Any]]
    compared: int
    finished: bool = True  # False: the engine failed and the run stopped early
    error: str | None = None
    stopped: int | None = None  # the signal that ended it after the prompts in ``outputs``
    # T > 0: (prompt ids, sampled ids) of every turn, plain ("ar") and speculative ("spec"),
    # for decoding.sample_check
    samples: dict[str, list[tuple[list[int], list[int]]]] = field(
        default_factory=lambda: {"ar": [], "spec": []}
    )


def near_tie(plain: Engine, prompt, a, b, pos, tolerance) -> tuple[float | None, bool]:
    """Log-prob gap at the first divergence, from the plain engine's top log-probs there."""
    lp = plain.top_logprobs(list(prompt) + list(a[:pos]), 8)
    if b[pos] not in lp or a[pos] not in lp:
        return None, False
    gap = lp[a[pos]] - lp[b[pos]]
    return gap, abs(gap) <= tolerance


def run_bench(
    plain: Engine,
    spec: Engine,
    questions: list[dict[str, Any]],
    cfg,
    tok,
    stop: set[int],
    desc: str,
) -> BenchRun:
    """Every prompt (and turn) to both engines, interleaved: plain first, then speculative,
    each turn's history its own engine's answers. An ``EngineError`` part way stops the run
    with what finished kept (``finished`` False, ``error`` the engine's last line); a stop asked
    for by a signal (``StopSignals``) ends it between prompts (``stopped``)."""
    sampling = {"temperature": cfg.temperature, "top_k": cfg.sample_top_k, "top_p": cfg.top_p}
    greedy = cfg.temperature == 0
    run = BenchRun(EngineStats(), {}, [], [], 0)
    for q in tqdm(questions, desc=f"prompts ({desc})", dynamic_ncols=True, file=sys.stderr):
        run.stopped = StopSignals.requested()
        if run.stopped is not None:
            break
        hist = {"ar": [], "spec": []}
        rec = {"question_id": q["question_id"], "category": q["category"], "turns": []}
        try:
            for turn in q["turns"][: cfg.turns]:
                prompts, outs = {}, {}
                for name, eng in (("ar", plain), ("spec", spec)):
                    msgs = hist[name] + [{"role": "user", "content": turn}]
                    prompts[name] = prompt_ids(tok, msgs)
                    outs[name] = eng.complete(
                        prompts[name], cfg.max_new_tokens, **sampling, seed=cfg.seed
                    )
                    text = tok.decode([t for t in outs[name].tokens if t not in stop])
                    hist[name] = msgs + [{"role": "assistant", "content": text}]
                for s in (run.pooled, run.per_category.setdefault(q["category"], EngineStats())):
                    s.add(outs["spec"], outs["ar"])
                a, b = outs["ar"].tokens, outs["spec"].tokens
                if not greedy:
                    for name in ("ar", "spec"):
                        run.samples[name].append((prompts[name], list(outs[name].tokens)))
                div = None
                if greedy and prompts["ar"] == prompts["spec"]:
                    run.compared += 1
                    if a != b:
                        pos = next((i for i in range(min(len(a), len(b))) if a[i] != b[i]), None)
                        gap, near = (None, False)
                        if pos is not None:
                            gap, near = near_tie(
                                plain, prompts["ar"], a, b, pos, cfg.engine_tie_tolerance
                            )
                        div = {"position": pos, "logit_gap": gap, "near_tie": near}
                        run.divergences.append({"question_id": q["question_id"], **div})
                rec["turns"].append(
                    {
                        "spec_tokens": len(b),
                        "ar_tokens": len(a),
                        "identical": a == b,
                        "divergence": div,
                        "text": tok.decode(b),
                        "engine_timings": outs["spec"].timings,
                    }
                )
        except EngineError as e:
            run.finished, run.error = False, str(e)
            if rec["turns"]:
                run.outputs.append(rec)
            break
        run.outputs.append(rec)
    if run.stopped is not None and not run.outputs:
        raise Stopped(run.stopped)  # nothing to report
    return run


def lossless_note(run: BenchRun, greedy: bool, tolerance: float, sampler: str) -> str:
    near = sum(bool(d["near_tie"]) for d in run.divergences)
    if not greedy:
        return f"T > 0: {sampler}; outputs are samples, not compared"
    n, d = run.compared, len(run.divergences)
    return f"{n - d}/{n} outputs identical to the engine's plain greedy decoding" + (
        f"; {d} parted, {near} at a near-tie (log-prob gap <= {tolerance}), {d - near} real"
        if d
        else ""
    )


def where_and_when() -> dict[str, str]:
    """A report's record of the machine it was measured on and the time: ``machine`` (the
    architecture), ``cpu`` (``cpu_name``) and ``date`` (UTC, ISO 8601)."""
    from datetime import datetime, timezone

    return {
        "machine": platform.machine(),
        "cpu": cpu_name(),
        "date": datetime.now(timezone.utc).isoformat(),
    }


def cpu_name() -> str:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor()
    info: dict[str, str] = {}
    for line in text.splitlines():
        if ":" in line:
            k, v = (s.strip() for s in line.split(":", 1))
            info.setdefault(k, v)
    flags = set(info.get("flags", "").split())
    bf16 = "bf16" if flags & {"avx512_bf16", "amx_bf16"} else "no bf16"
    return (
        f"{info.get('model name', '?')} (family {info.get('cpu family', '?')} model "
        f"{info.get('model', '?')}, {bf16})"
    )


def ours_beside(
    cfg,
    readback: str | None,
    rule: str,
    pooled: EngineStats,
    log,
    n_max: int,
    engine_outputs: list | None = None,
) -> dict:
    """The built-in decoder on the same prompts and settings, with the same draft (``readback``:
    the export the engine loaded, read back, or the draft it was written from), a fixed chain
    of the ``n_max`` tokens the engine drafted, under the rule it ran: its acceptance per
    position beside the engine's (``specdraft-eval engine_compare=true``). At T = 0, with the
    engine's ``engine_outputs``: in how many replies the two decoded the same text (where they
    part, at a near-tie, their acceptance is counted over different text)."""
    from omegaconf import OmegaConf

    from ..eval import evaluate as evaluate_ours  # the evaluator imports this module

    ours = OmegaConf.merge(
        cfg,
        {
            "engine": "torch",
            "draft": readback or "ngram",
            "gamma": n_max,
            "tree": "chain",
            "adaptive": False,
            "draft_weights": "full",  # the weights the engine serves (int8 moves acceptance)
            "engine_compare": False,
            "draft_sampling": "greedy" if rule in ("greedy_draft", "block") else "sample",
            "acceptance": "block" if rule == "block" else "exact",
            "lenience": 1.0,  # the engines' rules are exact (refused before they run)
            "stop": "gamma",
            "traces": None,
        },
    )
    log("the built-in decoder on the same prompts and settings, for comparison")
    r = evaluate_ours(ours)
    theirs = pooled.alpha_per_position()
    mine = r["alpha_per_position"] or []
    return {
        "tau": r["tau"],
        "alpha": r["alpha"],
        "alpha_per_position": mine,
        "difference_per_position": [
            (t - m) if t is not None and m is not None else None
            for t, m in zip(theirs, mine, strict=False)
        ],
        "tokens_per_second": r["tokens_per_second"],
        "ar_tokens_per_second": r["ar_tokens_per_second"],
        "speedup": r["speedup"],
        "lossless": r["lossless"],
        "decoder": r.get("decoder"),
        "draft_sampling": r.get("draft_sampling"),
        "acceptance": r["acceptance"],
        "same_text": same_text(engine_outputs, r.get("outputs"))
        if float(cfg.temperature) == 0
        else None,
    }


def same_text(theirs: list | None, mine: list | None) -> list[int] | None:
    """[replies whose speculative tokens are the same in both reports, replies compared]."""
    if not theirs or not mine:
        return None
    pairs = [
        (a.get("spec_tokens"), b.get("spec_tokens"))
        for p, q in zip(theirs, mine, strict=False)
        for a, b in zip(p.get("turns") or [], q.get("turns") or [], strict=False)
    ]
    return [sum(a == b for a, b in pairs), len(pairs)] if pairs else None


def same_text_note(same: list[int] | None) -> str:
    """How much of the engine-minus-ours comparison is over the same text (T = 0)."""
    if not same:
        return ""
    k, n = same
    if k == n:
        return f" (the same text in all {n} replies)"
    return (
        f" (the same text in {k} of {n} replies; the others parted, at a near-tie or not, and "
        "their acceptance is counted over other text: fp32 keeps the texts alike)"
    )


def engine_flag(ours: dict, pooled: EngineStats) -> str | None:
    """A line where the engine accepts far less than the built-in decoder predicts under the
    engine's own rule at some draft position (more than 4 standard errors of the engine's own
    tests there and 0.05 below), else None: an acceptance that low is the engine's, not the
    draft's."""
    theirs = pooled.alpha_per_position()
    mine = ours.get("alpha_per_position") or []
    for k, (t, m) in enumerate(zip(theirs, mine, strict=False)):
        if t is None or m is None:
            continue
        n = sum(1 for a, d in pooled.steps if d > k and a >= k)  # the engine's tests there
        se = math.sqrt(max(m * (1 - m), 1e-6) / max(n, 1))
        if m - t > max(0.05, 4 * se):
            return (
                f"the engine accepts {t:.2f} at draft position {k + 1} where the built-in "
                f"decoder predicts {m:.2f} under the same rule ({n} tests): the engine's "
                "sampler or its own computation of the target, not the draft (docs/serving.md: "
                "the sample check, and vLLM's CPU build's repaired defect)"
            )
    return None
