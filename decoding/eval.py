"""``specdraft-eval``: acceptance and speed of a draft against its target.

    specdraft-eval draft=runs/x bench=mt_bench num_prompts=8 max_new_tokens=128 temperature=0

For every prompt it decodes with plain autoregressive decoding and with speculative decoding,
in the same process, interleaved (after a warm-up), and reports per category and overall: tau,
alpha, alpha per draft position, tokens/s of both, speedup, the paper's predicted speedup from
the measured alpha, gamma and draft cost, and (at T = 0) whether every output equals the
plain-decoding output.
"""

from __future__ import annotations

import json
import signal
import sys
import time
from collections import defaultdict
from dataclasses import fields
from typing import Any

import hydra
import torch
from hydra.core.config_store import ConfigStore
from omegaconf import DictConfig, OmegaConf
from tqdm.auto import tqdm

from conf.cli import Stopped, StopSignals, check_command_line, exit_code_of, home_expanded
from conf.sweep import SUMMARY, refused_line, sweep_job
from data.chat import prompt_ids
from data.conversations import DataError
from models.base import DecodeSettings, DraftError, ExportError
from models.target import TargetConfig, TargetError, load_target

from .batch_checks import BatchError
from .batch_eval import evaluate_batched, wants_batch
from .bench import BenchError
from .contention import OtherLoad
from .decoder import NoDraft, SpeculativeDecoder
from .disco import load_stop_rule, write_traces
from .drafts import (
    DECODE_KEYS,
    check_draft_folder,
    draft_model_of,
    load_proposer,
    machine_kind,
    saved_decode_settings,
)
from .engines.base import EngineError, where_and_when
from .report import (
    CONVENTION,
    NEAR_TIE_TOLERANCE,
    classify_divergence,
    json_safe,
    mark_stopped,
    plain_token_seconds,
    plot_batch_report,
    plot_report,
    print_batch_report,
    print_report,
    replaced_outputs,
    report_paths,
    stats_row,
)
from .runner import compile_mode
from .sample_check import check_run
from .settings import (
    BUILT_IN_ONLY,
    ENGINE_ONLY,
    EvalConfig,
    EvalError,
    apply_saved_target,
    bench_questions,
    check_context,
    check_engine_rules,
    sampling_of,
    stop_ids,
    validate,
)
from .stats import Stats, acceptance_where


def confidence_stop(proposer, cfg) -> str:
    """Turn on a draft's confidence schedule (``stop=confidence``); what the report says of it."""
    method = proposer.method
    use = getattr(method, "confidence_stop", None)
    if use is None:
        raise EvalError(
            f"stop=confidence: draft={cfg.draft} has no confidence head (DSpark drafts do)"
        )
    try:
        use(cfg.confidence_threshold)
    except DraftError as e:
        raise EvalError(f"stop=confidence: {e}") from None
    return f", confidence stop (running product >= {cfg.confidence_threshold})"


def _first_turns(questions: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The questions as a batch decodes them: their first turns only."""
    return [{**q, "turns": q["turns"][:1]} for q in questions]


def turns_note(cfg: DictConfig, questions: list[dict[str, Any]]) -> str | None:
    """A line where ``turns`` asks for more turns than any question has (each question is fed
    the turns it has), else None."""
    most = max((len(q["turns"]) for q in questions), default=0)
    if cfg.turns <= most:
        return None
    return (
        f"note: turns={cfg.turns}: bench={cfg.bench}'s questions have at most {most} "
        f"turn{'s' if most != 1 else ''}; each is fed the turns it has"
    )


def gpu_of(device: torch.device) -> dict[str, str]:
    """``{"gpu": its name}`` where the run was on a CUDA device, else nothing."""
    if device.type != "cuda":
        return {}
    return {"gpu": torch.cuda.get_device_name(device)}


def evaluate(cfg: DictConfig) -> dict[str, Any]:
    from .engines import ENGINES

    if cfg.engine != "torch" and cfg.engine not in ENGINES:
        raise EvalError(f"engine={cfg.engine!r}: use torch (built in), {' or '.join(ENGINES)}")
    validate(cfg)
    # a bad bench file is said before the target loads (read once: the engines read it again)
    questions = bench_questions(cfg)
    if cfg.engine != "torch":
        from .engines import evaluate_in_engine

        check_engine_rules(cfg)

        if wants_batch(cfg):
            raise EvalError(
                "batch_size / batch_sizes / request_rates / stop=goodput are measured in the "
                f"built-in decoder (engine=torch), not in engine={cfg.engine}"
            )
        if cfg.ignore_eos:
            raise EvalError("ignore_eos=true is for the built-in decoder (engine=torch)")
        return json_safe(evaluate_in_engine(cfg))
    target = load_target(OmegaConf.to_object(cfg.target))
    tok = target.tokenizer
    check_context(cfg, target, questions if not wants_batch(cfg) else _first_turns(questions))
    note = turns_note(cfg, questions)
    if note:
        print(note)
    tree = DecodeSettings(**{f.name: cfg[f.name] for f in fields(DecodeSettings)})
    la = (cfg.lookahead_window, cfg.lookahead_ngram, cfg.lookahead_guesses)
    proposer, draft_desc = load_proposer(
        cfg.draft,
        target,
        cfg.ngram_max,
        tree=tree,
        lookahead=la,
        streaming=(cfg.stream_sinks, cfg.stream_window),
    )
    if wants_batch(cfg):
        if cfg.draft_sampling != "sample" or cfg.acceptance == "block":
            raise EvalError(
                "draft_sampling=greedy and acceptance=block are measured at batch 1 "
                "(batch_size=1); the batched evaluation runs exact sampled drafts"
            )
        sampling = sampling_of(cfg)
        tok = target.tokenizer
        stop = stop_ids(cfg, tok, target)
        if cfg.stop == "confidence":
            draft_desc += confidence_stop(proposer, cfg)
        try:
            # no prompt boundary to stop at in a batch: a signal stops it at once
            with StopSignals(deferred=False):
                report = evaluate_batched(
                    cfg, target, proposer, draft_desc, questions, sampling, stop
                )
        except BatchError as e:
            raise EvalError(str(e)) from None
        method = proposer.method
        changed = method.changes_target() if method is not None else None
        # a verifier changed by the draft (Medusa-2's adapter): every output, plain ones and
        # the batch-1 reference included, follows the adapted model, as at batch 1
        report["verifier_changed"] = changed
        if changed:
            report["lossless_note"] += (
                "; against the adapted verifier, not the original target (batch_size=1 "
                "scores the outputs under the original: against_original)"
            )
        report["settings"] = {
            **OmegaConf.to_container(cfg, resolve=True),
            "draft_description": draft_desc,
            "target_identity": target.identity,
            "device": str(target.device),
            "dtype": str(target.dtype),
            "torch_threads": torch.get_num_threads(),
            **where_and_when(),
            **gpu_of(target.device),
        }
        return json_safe(report)
    if cfg.traces and cfg.adaptive:
        raise EvalError(
            "traces need every drafted position tested at a fixed gamma: add adaptive=false"
        )
    if cfg.traces and cfg.stop != "gamma":
        raise EvalError("traces are recorded with stop=gamma (a stop rule would censor them)")
    lossy = (
        f"lenience={cfg.lenience}"
        if cfg.lenience < 1
        else f"acceptance={cfg.acceptance}"
        if cfg.acceptance != "exact" and cfg.temperature > 0
        else None
    )
    if cfg.traces and lossy:
        raise EvalError(
            f"traces with {lossy}: a stop rule learns from them when exact verification accepts "
            "a draft; record them under acceptance=exact and lenience=1"
        )
    stop_rule = None
    if cfg.stop == "disco":
        stop_rule = load_stop_rule(cfg.disco, cfg.draft, proposer)
        draft_desc += f", DISCO stop ({stop_rule.describe()})"
    if cfg.stop == "confidence":
        draft_desc += confidence_stop(proposer, cfg)
    traces: list | None = [] if cfg.traces else None
    method = proposer.method  # the trained draft behind it, if any
    changed = method.changes_target() if method is not None else None
    sampling = sampling_of(cfg)
    try:
        ar = SpeculativeDecoder(
            target,
            NoDraft(),
            sampling,
            gamma=0,
            seed=cfg.seed,
            record_logits=sampling.greedy,
            compile=cfg.compile,
        )
    except ValueError as e:
        raise EvalError(str(e)) from None
    tolerance = NEAR_TIE_TOLERANCE.get(target.dtype, 0.5)
    # A tree is verified whole; with adaptive on, the decoder drafts one only while trees are
    # measured to be faster than plain decoding (chains: it sizes gamma).
    tree_depth = proposer.tree_depth
    try:
        spec = SpeculativeDecoder(
            target,
            proposer,
            sampling,
            gamma=tree_depth or cfg.gamma,
            # a learned stop rule replaces the gamma controller: it drafts up to gamma tokens
            adaptive=cfg.adaptive and stop_rule is None and cfg.stop != "confidence",
            seed=cfg.seed,
            acceptance=cfg.acceptance,
            draft_sampling=cfg.draft_sampling,
            typical_epsilon=cfg.typical_epsilon,
            typical_delta=cfg.typical_delta,
            lenience=cfg.lenience,
            stop_rule=stop_rule,
            traces=traces,
            compile=cfg.compile,
        )
    except ValueError as e:
        raise EvalError(f"draft={cfg.draft}: {e}") from None
    # the static caches sized for the longest prompt before anything is timed
    room = max(
        len(prompt_ids(tok, [{"role": "user", "content": t}]))
        for q in questions
        for t in q["turns"][: cfg.turns]
    )
    for dec in (ar, spec):
        dec.runner.reserve(cfg.turns * (room + cfg.max_new_tokens) + 64)
    typical = cfg.acceptance == "typical" and not sampling.greedy
    lenient = cfg.lenience < 1
    stop = stop_ids(cfg, tok, target)
    # warm-up: first-call costs (allocations, kernel selection) stay out of the timings
    w = prompt_ids(tok, [{"role": "user", "content": questions[0]["turns"][0]}])
    for dec in (ar, spec):
        dec.generate(w, cfg.warmup_tokens, stop)
        dec.stats = Stats()
    if traces is not None:
        traces.clear()
    per_cat: dict[str, dict[str, Stats]] = defaultdict(lambda: {"spec": Stats(), "ar": Stats()})
    outputs, n_turns, divergences, compared = [], 0, [], 0
    samples: dict[str, list] = {"ar": [], "spec": []}  # T > 0: for the sample check
    for q in tqdm(questions, desc="prompts", dynamic_ncols=True, file=sys.stderr):
        if StopSignals.requested() is not None:
            break  # a stop asked for by a signal: the report covers the prompts finished
        histories = {"ar": [], "spec": []}
        rec = {"question_id": q["question_id"], "category": q["category"], "turns": []}
        for turn in q["turns"][: cfg.turns]:
            outs, prompts = {}, {}
            for name, dec in (("ar", ar), ("spec", spec)):
                msgs = histories[name] + [{"role": "user", "content": turn}]
                prompts[name] = prompt_ids(tok, msgs)
                new = dec.generate(prompts[name], cfg.max_new_tokens, stop)
                per_cat[q["category"]][name].merge(dec.last)
                text = tok.decode([t for t in new if t not in stop])
                histories[name] = msgs + [{"role": "assistant", "content": text}]
                outs[name] = new
                if not sampling.greedy:
                    samples[name].append((prompts[name], list(new)))
            n_turns += 1
            same = outs["ar"] == outs["spec"]
            div = None
            # a later turn whose history already parted is not a new comparison
            if sampling.greedy and prompts["ar"] == prompts["spec"]:
                compared += 1
                div = classify_divergence(outs["ar"], outs["spec"], ar.last_logits, tolerance)
                if div is not None:
                    divergences.append(
                        {"question_id": q["question_id"], "turn": len(rec["turns"]) + 1, **div}
                    )
            rec["turns"].append(
                {
                    "ids": prompts["spec"] + outs["spec"],
                    "prompt_len": len(prompts["spec"]),
                    "spec_tokens": len(outs["spec"]),
                    "ar_tokens": len(outs["ar"]),
                    "identical": same,
                    "divergence": div,
                    "text": tok.decode(outs["spec"]),
                }
            )
        outputs.append(rec)
    if not outputs and StopSignals.requested() is not None:
        raise Stopped(StopSignals.requested())  # stopped before the first prompt finished

    ar_step = ar.stats.t_target / max(1, ar.stats.target_calls)
    # c: one draft step over one plain target step. The proposer's own per-step measure when it
    # has one (a draft that sat idle catches up on many tokens at once: that is not what one
    # more draft step costs), else drafting time over sequential draft steps (a tree level
    # counts once).
    per_step = spec.stats.draft_step_seconds
    steps = spec.stats.draft_steps
    if per_step is not None:
        c = per_step / ar_step
    else:
        c = (spec.stats.t_draft / steps) / ar_step if steps else 0.0
    par = spec.proposer.parallel
    report = stats_row(spec.stats, ar.stats, c, par)
    report["decoder"] = {
        "runner": spec.runner.kind,
        "plain_runner": ar.runner.kind,
        "compile": compile_mode(cfg.compile),
        "drafter": type(spec.proposer).__name__,
        # what the decoder ran, where it differs from the settings: a proposer that drafts
        # every iteration (lookahead) is not sized by the controller, nor a learned stop's;
        # plain decoding (draft=none) drafts nothing
        "adaptive": spec.adaptive,
        "gamma": spec.gamma,
        "capture_seconds": spec.runner.capture_seconds
        + ar.runner.capture_seconds
        + spec.proposer.capture_seconds,
        "plain_ms_per_step": 1e3 * ar_step,
        # the plain run's wall time a token after its prefill: the bound's plain step
        "plain_ms_per_token": 1e3 * plain_token_seconds(ar.stats),
        "acceptance": acceptance_where(spec.stats, sampling),
    }
    near = sum(d["near_tie"] for d in divergences)
    accepted = sum(spec.stats.accepted.values())
    if lenient and sampling.greedy:
        note = (
            f"NOT lossless: lenience {cfg.lenience} accepts a drafted token when the target "
            f"gives it >= {cfg.lenience} x its top probability; {spec.stats.off_argmax} of "
            f"{accepted} accepted tokens ({spec.stats.off_argmax / max(1, accepted):.1%}; "
            f"{spec.stats.off_argmax / max(1, spec.stats.new_tokens):.1%} of all emitted) were "
            f"not the target's argmax; {compared - len(divergences)}/{compared} outputs "
            "identical to plain decoding"
        )
    elif lenient:
        note = (
            f"NOT lossless: lenience {cfg.lenience} accepts x ~ q with probability "
            f"min(1, p(x) / ({cfg.lenience} q(x))); mean per-token TVD from the target's own "
            f"distribution {spec.stats.mean_tvd:.4f} over {spec.stats.tvd_tokens} emitted tokens"
        )
    elif sampling.greedy:
        note = f"{compared - len(divergences)}/{compared} outputs identical to plain decoding" + (
            f"; {len(divergences)} parted, {near} of them at a near-tie (logit gap <= "
            f"{tolerance} in {str(target.dtype).replace('torch.', '')}: rounding of a "
            f"k-token vs 1-token forward), {len(divergences) - near} real"
            if divergences
            else ""
        )
    elif typical:
        note = (
            f"NOT lossless: typical acceptance (epsilon {cfg.typical_epsilon}, delta "
            f"{cfg.typical_delta}) moves the output distribution; mean per-token TVD from the "
            f"target's own distribution {spec.stats.mean_tvd:.4f} over "
            f"{spec.stats.tvd_tokens} emitted tokens"
        )
    else:
        note = (
            "T > 0: outputs are samples; exactness is proven and tested statistically, "
            "not compared per output"
        )
    report.update(
        {
            "draft_cost_ratio": c,
            # T = 0: lossless when every divergence from plain decoding is a near-tie
            "lossless": False
            if lenient
            else ((near == len(divergences)) if sampling.greedy else (False if typical else None)),
            "lenience": cfg.lenience,
            # lenience < 1 at T = 0: accepted tokens that are not the target's argmax, per
            # emitted token
            "off_argmax_rate": spec.stats.off_argmax / max(1, spec.stats.new_tokens)
            if lenient and sampling.greedy
            else None,
            "divergences": len(divergences) if sampling.greedy else None,
            "near_tie_divergences": near if sampling.greedy else None,
            "near_tie_tolerance": {
                "logit_gap": tolerance,
                "dtype": str(target.dtype).replace("torch.", ""),
            }
            if sampling.greedy
            else None,
            "divergence_details": divergences,
            "lossless_note": note,
            "acceptance": "greedy" if sampling.greedy else cfg.acceptance,
            "draft_sampling": None if sampling.greedy else cfg.draft_sampling,
            "mean_tvd": spec.stats.mean_tvd
            if (typical or (lenient and not sampling.greedy))
            else None,
            "verifier_changed": changed,
            "convention": CONVENTION,
            "per_category": {
                cat: stats_row(s["spec"], s["ar"], c, par) for cat, s in sorted(per_cat.items())
            },
            "settings": {
                **OmegaConf.to_container(cfg, resolve=True),
                "draft_description": draft_desc,
                "target_identity": target.identity,
                "device": str(target.device),
                "dtype": str(target.dtype),
                "torch_threads": torch.get_num_threads(),
                **where_and_when(),
                **gpu_of(target.device),
            },
            "outputs": outputs,
        }
    )
    if not sampling.greedy:
        # the same audit as an engine's samples get (decoding/sample_check.py): exact rules
        # pass it, typical acceptance and lenience < 1 are meant to fail it
        report["sample_check"] = check_run(target, samples, sampling)
        if lenient or typical:  # what a pass means there: nothing, said beside it
            rule = f"lenience {cfg.lenience}" if lenient else "typical acceptance"
            report["sample_check"]["lossy_rule"] = rule
    if traces is not None:
        report["traces"] = write_traces(cfg.traces, traces, report, draft_desc)
    if changed and cfg.compare_original:
        report["against_original"] = _against_original(target, method, outputs, tok)
    for rec in outputs:  # the token ids were kept for the comparison above only
        for t in rec["turns"]:
            t.pop("ids"), t.pop("prompt_len")
    if cfg.compare_hf:
        done = questions[: len(outputs)]  # all of them but where a signal stopped the run
        report["hf_assisted"] = _hf_assisted(target, proposer, done, cfg, stop, report)
    return json_safe(report)


@torch.no_grad()
def _against_original(target, heads, outputs: list[dict], tok) -> dict[str, Any]:
    """How far a changed verifier (e.g. Medusa-2's adapted model) is from the original target
    on what it generated: teacher-forced on each speculative output (first turns), the mean
    TVD between the two next-token distributions and how often the original's greedy token
    is the one emitted."""
    tvd, agree, n = 0.0, 0, 0
    for rec in outputs:
        for turn in rec["turns"][:1]:
            ids = turn["ids"]
            if len(ids) < 2:
                continue
            x = torch.tensor([ids], device=target.device)
            p = target.model(input_ids=x).logits[0, turn["prompt_len"] - 1 : -1].float()
            with heads.original():
                q = target.model(input_ids=x).logits[0, turn["prompt_len"] - 1 : -1].float()
            emitted = x[0, turn["prompt_len"] :]
            tvd += 0.5 * (p.softmax(-1) - q.softmax(-1)).abs().sum(-1).sum().item()
            agree += int((q.argmax(-1) == emitted).sum())
            n += emitted.numel()
    return {
        "tokens": n,
        "mean_tvd_adapted_vs_original": tvd / n if n else None,
        "original_greedy_agreement": agree / n if n else None,
        "note": "teacher-forced on the speculative outputs (first turns): per-token total "
        "variation distance between the adapted verifier and the original target, and how "
        "often the original's argmax is the emitted token",
    }


def _hf_assisted(target, proposer, questions, cfg, stop, report) -> dict[str, Any]:
    """transformers' assisted generation with the same draft model and prompts (first turns)."""
    model = draft_model_of(proposer)
    if model is None:
        return {"skipped": "compare_hf needs a draft LM (an HF model or truncate:N)"}
    tok = target.tokenizer
    kw = {
        "max_new_tokens": cfg.max_new_tokens,
        "do_sample": cfg.temperature > 0,
        "assistant_model": model,
        "pad_token_id": tok.pad_token_id,
    }
    if stop:
        kw["eos_token_id"] = sorted(stop)
    else:  # ignore_eos: transformers has no such switch; a minimum length does the same
        kw["min_new_tokens"] = cfg.max_new_tokens
    if cfg.temperature > 0:
        # top_k 0 is off in transformers too; None would leave a model's generation_config
        # default (often 50) in place, a filter our decoder does not apply
        kw.update(temperature=cfg.temperature, top_k=cfg.sample_top_k, top_p=cfg.top_p)
    ours = SpeculativeDecoder(
        target,
        proposer,
        sampling_of(cfg),
        gamma=cfg.gamma,
        adaptive=cfg.adaptive,
        seed=cfg.seed,
        compile=cfg.compile,
    )
    n_hf = n_ours = 0
    t_hf = t_ours = 0.0
    for i, q in enumerate(questions):
        ids = prompt_ids(tok, [{"role": "user", "content": q["turns"][0]}])
        x = torch.tensor([ids], device=target.device)
        t = time.perf_counter()
        out = target.model.generate(x, attention_mask=torch.ones_like(x), **kw)
        dt = time.perf_counter() - t
        new = out.shape[1] - len(ids)
        t = time.perf_counter()
        mine = ours.generate(ids, cfg.max_new_tokens, stop)
        dt2 = time.perf_counter() - t
        if i == 0:
            continue  # warm-up
        n_hf, t_hf = n_hf + new, t_hf + dt
        n_ours, t_ours = n_ours + len(mine), t_ours + dt2
    hf_tps = n_hf / t_hf if t_hf else float("nan")
    ours_tps = n_ours / t_ours if t_ours else float("nan")
    return {
        "hf_tokens_per_second": hf_tps,
        "ours_tokens_per_second": ours_tps,
        "ours_over_hf": ours_tps / hf_tps if hf_tps else float("nan"),
        "prompts": max(0, len(questions) - 1),
        "hf_settings": {
            k: getattr(model.generation_config, k, None)
            for k in (
                "num_assistant_tokens",
                "num_assistant_tokens_schedule",
                "assistant_confidence_threshold",
            )
        }
        | {"note": "None: transformers' default"},
    }


ConfigStore.instance().store(name="eval_schema", node=EvalConfig)
ConfigStore.instance().store(group="target", name="target_schema", node=TargetConfig)

USER_ERRORS = (DataError, DraftError, TargetError, BenchError, EvalError, EngineError, ExportError)


def apply_saved_decode(cfg: DictConfig, given: set[str]) -> str | None:
    """Where the command line sets none of ``DECODE_KEYS``, take the draft's saved decode
    settings for this machine kind; returns a line saying what was taken, or None."""
    if cfg.engine != "torch" or given & set(DECODE_KEYS):
        return None
    from models.target import resolve_device

    kind = machine_kind(resolve_device(cfg.target.device))
    found = saved_decode_settings(str(cfg.draft), kind)
    if not found:
        return None
    shown = " ".join(f"{k}={v}" for k, v in found.items())
    if cfg.stop in ("disco", "confidence") and found.get("tree", "chain") != "chain":
        # measured for the gamma controller; a learned stop drafts chains
        return (
            f"decode settings saved with the draft for {kind} machines ({shown}) not taken: "
            f"stop={cfg.stop} drafts a chain of up to gamma={cfg.gamma}"
        )
    for k, v in found.items():
        cfg[k] = v
    return (
        f"decode settings saved with the draft for {kind} machines: {shown} (set any to override)"
    )


def dropped_settings(cfg: DictConfig, given: set[str]) -> list[str]:
    """A note for each setting typed on the command line that this run cannot use."""
    notes = []
    if "top_k" in given and cfg.tree != "dynamic":
        notes.append(
            f"note: top_k={cfg.top_k} is the dynamic tree's width (tree=dynamic), unused with "
            f"tree={cfg.tree}; sampling's top-k filter is sample_top_k"
        )
    for key in ("depth", "total_tokens", "min_prob"):
        if key in given and cfg.tree != "dynamic":
            notes.append(
                f"note: {key}={cfg[key]} sizes the dynamic tree (tree=dynamic), unused with "
                f"tree={cfg.tree}"
            )
    for key in ("tree_nodes", "tree_file"):
        if key in given and cfg.tree in ("chain", "dynamic"):
            notes.append(
                f"note: {key}={cfg[key]} builds a static candidate tree (a Medusa draft's, "
                f"tree=static or auto), unused with tree={cfg.tree}"
            )
    if "acceptance" in given and cfg.acceptance != "exact" and cfg.temperature == 0:
        notes.append(
            f"note: acceptance={cfg.acceptance} decides at T > 0 only; at temperature=0 a "
            "drafted token is accepted where it is the target's argmax, under every rule"
        )
    for key, engines in ENGINE_ONLY.items():
        if key in given and cfg.engine not in engines:
            notes.append(
                f"note: {key} is read by engine={' and engine='.join(engines)} only, unused "
                f"with engine={cfg.engine}"
            )
    if cfg.engine != "torch":
        for key in BUILT_IN_ONLY:
            if key in given and not any(n.startswith(f"note: {key}=") for n in notes):
                notes.append(
                    f"note: {key} is the built-in decoder's (engine=torch), unused with "
                    f"engine={cfg.engine}"
                )
    if not wants_batch(cfg):
        for key in BATCH_ONLY:
            if key in given:
                notes.append(
                    f"note: {key}={cfg[key]} is the serving regime's (batch_size > 1, "
                    "batch_sizes, batch_policies, request_rates or stop=goodput), unused at "
                    "batch_size=1"
                )
    elif "adaptive" in given and cfg.batch_policies:
        notes.append(
            f"note: adaptive={cfg.adaptive} is unused where batch_policies="
            f"{list(cfg.batch_policies)} names the policies (adaptive is one of them)"
        )
    if cfg.temperature == 0:
        for key, value, off in (
            ("top_p", cfg.top_p, 1.0),
            ("sample_top_k", cfg.sample_top_k, 0),
            ("draft_sampling", cfg.draft_sampling, "sample"),
        ):
            said = any(n.startswith(f"note: {key}") for n in notes)
            if key in given and value != off and not said:
                notes.append(
                    f"note: {key}={value} applies at temperature > 0 only; at temperature=0 "
                    "the target and the draft take their argmax"
                )
    if "tree" in given and cfg.tree == "chain" and str(cfg.draft) == "lookahead":
        notes.append(
            "note: draft=lookahead verifies its n-gram candidates as one tree (a trie) whatever "
            "tree= says; lookahead_guesses=1 verifies a single candidate"
        )
    return notes


#: the serving regime's own settings (decoding/batch_eval.py), which batch_size=1 never reads
BATCH_ONLY = ("batch_repeats", "batch_warmup", "batch_admit", "request_lengths")


@hydra.main(version_base="1.3", config_path="../conf", config_name="eval")
def _main(cfg: DictConfig) -> None:
    from hydra.core.hydra_config import HydraConfig

    given = {o.split("=")[0].lstrip("+~") for o in HydraConfig.get().overrides.task}
    notice = "stopping after this prompt, with a report on the prompts finished (again: at once)"
    job = sweep_job(cfg)  # -m: this job's folder, where its report and plot go
    try:
        check_draft_folder(str(cfg.draft))
        path, png = report_paths(cfg)
        for line in replaced_outputs(cfg):
            print(line)
        for line in (apply_saved_target(cfg, given), apply_saved_decode(cfg, given)):
            if line:
                print(line)
        for line in dropped_settings(cfg, given):
            print(line)
        with StopSignals(notice=notice) as sig, OtherLoad() as load:
            r = evaluate(cfg)
    except USER_ERRORS as e:
        if job is None:
            print(f"error: {e}", file=sys.stderr)
            sys.exit(2)
        # one job's value among others (gamma=0 in gamma=0,2,4): the other jobs still run,
        # and the sweep's summary says what refused this one
        print(f"error: {job}: {e}", file=sys.stderr)
        refused = {"reason": "refused", "error": str(e), "metrics": {}}
        (job / SUMMARY).write_text(json.dumps(refused, indent=1))
        _REFUSED.append(str(job))
        return
    except KeyboardInterrupt as e:  # before a prompt finished, a second signal, or a batch
        code = exit_code_of(e)
        print(f"\nstopped by {signal.Signals(code - 128).name}: no report written", file=sys.stderr)
        sys.exit(code)
    if sig.caught is not None:
        mark_stopped(r, sig.caught, len(bench_questions(cfg)))
    # what else ran on the machine meanwhile: timings beside another job are not its own
    r["other_load"] = load.summary()
    (print_batch_report if "batch" in r else print_report)(r)
    try:  # checked writable before the run; a full disk or a folder taken away since is not
        path.parent.mkdir(parents=True, exist_ok=True)
        png.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(r, indent=1))
        (plot_batch_report if "batch" in r else plot_report)(r, png)
    except OSError as e:
        where = e.filename or path
        print(
            f"error: could not write {where} ({e.strerror or e}); the run's figures are the "
            "table above",
            file=sys.stderr,
        )
        sys.exit(1)
    print(f"report: {path}   plot: {png}")
    if job is not None:  # the sweep summary's row
        metrics = {k: r[k] for k in SUMMARY_METRICS if isinstance(r.get(k), int | float | bool)}
        reason = "stopped" if sig.caught is not None or r.get("finished") is False else "finished"
        (job / SUMMARY).write_text(json.dumps({"reason": reason, "metrics": metrics}, indent=1))
    if r.get("finished") is False:
        print(f"error: the engine failed part way: {r.get('engine_error')}", file=sys.stderr)
        sys.exit(1)
    if sig.caught is not None:
        sys.exit(128 + sig.caught)


#: the report's figures a sweep's summary tabulates, one column each
SUMMARY_METRICS = (
    "tau",
    "alpha",
    "speedup",
    "tokens_per_second",
    "ar_tokens_per_second",
    "drafted_share",
    "lossless",
)
#: jobs of this command's sweep refused for their settings or inputs: the others still run
_REFUSED: list[str] = []


def main() -> None:
    _REFUSED.clear()
    sys.argv[1:] = home_expanded(sys.argv[1:])
    msg = check_command_line("eval", sys.argv[1:])
    if msg:
        print(f"error: {msg}", file=sys.stderr)
        sys.exit(2)
    _main()
    if _REFUSED:
        print(refused_line(_REFUSED), file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
