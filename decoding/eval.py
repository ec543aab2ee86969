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
import math
import platform
import sys
import time
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import hydra
import torch
from hydra.core.config_store import ConfigStore
from omegaconf import DictConfig, OmegaConf
from tqdm.auto import tqdm

from data.chat import prompt_ids
from data.conversations import DataError
from models.base import DecodeSettings, DraftError, ExportError
from models.quant import check_mode
from models.sampling import Sampling
from models.target import TargetConfig, TargetError, load_target

from .batch import BatchError
from .batch_eval import evaluate_batched, plot_batch_report, print_batch_report, wants_batch
from .bench import BenchError, load_bench
from .decoder import NoDraft, SpeculativeDecoder, Stats, predicted_speedup
from .disco import load_stop_rule, write_traces
from .drafts import (
    DECODE_KEYS,
    draft_model_of,
    load_proposer,
    machine_kind,
    saved_decode_settings,
)
from .llama_cpp import EngineError
from .runner import RunnerError, compile_mode

CONVENTION = (
    "tau = tokens emitted per target verification forward, counting the corrected/bonus token "
    "(plain decoding has tau = 1; the prompt's prefill forward is not counted). alpha = accepted "
    "draft tokens / tested draft tokens, a draft token at position k being tested when positions "
    "1..k-1 were accepted (the per-token acceptance probability of the speedup formula); "
    "alpha_per_position[k-1] = P(position k accepted | positions 1..k-1 accepted). "
    "draft_acceptance_rate = accepted / drafted tokens (vLLM's convention). tau and alpha pool "
    "all tokens of all prompts (not a mean of per-prompt means)."
)


@dataclass
class EvalConfig:
    target: TargetConfig = field(default_factory=TargetConfig)
    draft: str = "ngram"  # none | ngram | truncate:N | run dir | draft dir | HF model
    bench: str = "mt_bench"  # mt_bench | spec_bench | sharegpt_val | path to a .jsonl
    categories: list[str] | None = None  # keep only these categories
    num_prompts: int | None = 8  # questions (None: all)
    turns: int = 1  # turns per question fed (MT-bench has 2; later turns see earlier answers)
    max_new_tokens: int = 128
    temperature: float = 0.0
    sample_top_k: int = 0  # top-k sampling filter (0: off), applied to target and draft alike
    top_p: float = 1.0
    gamma: int = 4  # draft tokens per iteration (the maximum, with adaptive on)
    # the target's forward in the built-in decoder (decoding/runner.py): true = the lean
    # Llama-family forward over a static KV cache at fixed widths, captured as CUDA graphs on a
    # GPU (eager on a CPU); false = transformers' forward over its dynamic cache; auto = the
    # first wherever it runs (Llama, Mistral, Qwen2/3 targets; the report says which ran)
    compile: str = "auto"
    adaptive: bool = True
    # Trained drafts: auto (EAGLE: chain, Medusa: static), chain (gamma tokens), dynamic
    # (EAGLE-2 tree) or static (Medusa's candidate tree). Trees are verified whole (gamma is
    # unused); adaptive then decides per iteration whether drafting a tree pays.
    tree: str = "auto"
    depth: int = 5  # dynamic tree: draft steps
    top_k: int = 8  # dynamic tree: children per expanded node, and nodes expanded per step
    total_tokens: int = 32  # dynamic tree: nodes verified per target forward (at most)
    # dynamic tree: verify and expand only nodes the draft gives at least this cumulative
    # probability (the tree sizes itself by confidence; the best node is always verified). 0:
    # EAGLE-2's fixed-size tree. On a CPU ~0.03-0.05 (docs/benchmarks.md); lossless either way.
    min_prob: float = 0.0
    tree_nodes: int | None = None  # static tree: rebuild with this many nodes (None: saved)
    tree_file: str | None = None  # static tree: a JSON list of rank paths, e.g. [[0],[0,0]]
    # a trained draft's weights while decoding: auto (int8 for a bf16 EAGLE head on a CPU,
    # where it drafts ~2x faster; else as loaded), int8, or full. The target is never
    # quantized, so decoding stays lossless either way; acceptance moves slightly.
    draft_weights: str = "auto"
    # exact (lossless speculative sampling) | typical (Medusa's typical acceptance at T > 0:
    # not lossless; the report gives the mean per-token TVD from the target)
    acceptance: str = "exact"
    typical_epsilon: float = 0.09
    typical_delta: float = 0.3
    # lenience l in (0, 1] (1: exact). Below 1, NOT lossless: a drafted x is accepted with
    # probability min(1, p(x) / (l q(x))) at T > 0 (chains; the report gives the mean per-token
    # TVD from the target) and when p(x) >= l * max p at T = 0 (the report gives how often an
    # accepted token is not the target's argmax)
    lenience: float = 1.0
    # for drafts that change the verifier (Medusa-2's adapter): also score the outputs under the
    # original target (per-token TVD and greedy agreement, teacher-forced on the outputs)
    compare_original: bool = True
    ngram_max: int = 3
    # draft=lookahead: Jacobi window W, n-gram size N, candidates verified per forward G
    lookahead_window: int = 5
    lookahead_ngram: int = 4
    lookahead_guesses: int = 5
    # draft=streaming (MagicDec self-speculation): the target drafts over a StreamingLLM cache of
    # the first stream_sinks positions and the last stream_window ones
    stream_sinks: int = 4
    stream_window: int = 256
    # learned speculation length (DISCO): stop=gamma drafts what the gamma controller says;
    # stop=disco drafts up to gamma tokens and stops where the classifier at ``disco`` (default:
    # <draft folder>/disco) predicts a rejection
    # stop=goodput (SmartSpec): one speculation length per iteration for the whole batch, the
    # one that maximises expected accepted tokens / predicted step time (decoding/batch.py)
    stop: str = "gamma"
    disco: str | None = None
    # the serving regime (decoding/batch.py): B requests decoded together with continuous
    # batching, plain and speculative at the same B; batch_sizes sweeps (e.g. [1,4,16]) and
    # batch_policies compares fixed (gamma), adaptive (today's controller per request) and
    # goodput at each; the report's "batch" rows hold tokens/s, per-request tokens/s, tau...
    batch_size: int = 1
    batch_sizes: list[int] | None = None
    batch_policies: list[str] | None = None
    # each batch size's runs (plain, then each policy) repeated this many times, in reversed
    # order every other time, and pooled: a machine whose speed drifts between runs (+-20%
    # between two plain runs was seen on a 2-core VM) then weighs on every configuration alike
    batch_repeats: int = 1
    # each batch size gets an untimed plain run over its requests before its timed runs: the
    # first run at new shapes pays alone for what a device does the first time (we infer: on a
    # CPU oneDNN's kernels for each new prefill shape, on a GPU the allocator too), and plain,
    # always the first timed run, read 3-4% slow at B = 16 on a CPU and up to 2x on an H200
    batch_warmup: bool = True
    # waiting requests join the batch once this many slots are free: 1 = as soon as a row
    # finishes (each join is one prefill forward and a copy of the running cache; with prefills
    # grouped by length that costs no more prefill time than joining a quarter of the batch at
    # once, and keeps the batch fuller: docs/benchmarks.md, issue 30 part 4)
    batch_admit: int = 1
    # equal: every request asks for max_new_tokens; mixed: each asks for its own length, drawn
    # once per prompt (seeded) uniformly from [max_new_tokens / 4, max_new_tokens], as a
    # server's requests do (the same lengths for plain and speculative decoding)
    request_lengths: str = "equal"
    # requests per second arriving as a Poisson process (seeded: the same schedule for plain
    # and speculative decoding), one sweep point each (e.g. [0.5,2,8]); empty: every request
    # waiting from the start. The report adds each request's time to first token, time per
    # output token and end-to-end latency (mean, p50, p90, p99), as vLLM's benchmark_serving
    request_rates: list[float] | None = None
    # decode every request to its full length, past the end-of-sequence token (vLLM's
    # benchmark_serving --ignore-eos): at T > 0 speculative and plain decoding draw different
    # samples, which end at different steps, so the batch's joins differ by chance; with this
    # both decode the same number of tokens per request
    ignore_eos: bool = False
    # write acceptance traces (per drafted token: the draft's signals, and whether it was
    # accepted) to this JSONL file, for ``specdraft-disco``; needs adaptive=false
    traces: str | None = None
    seed: int = 0
    warmup_tokens: int = 16
    compare_hf: bool = False  # also time transformers' assisted generation (draft LMs only)
    report: str = "eval_report.json"
    plot: str | None = None  # PNG path; default: the report path with .png
    data_path: str | None = None  # for bench=sharegpt_val: the data (default: packaged ShareGPT)
    val_fraction: float = 0.02  # for bench=sharegpt_val: must match training's split
    split_seed: int = 0  # for bench=sharegpt_val: training's train.seed
    max_val_records: int = 128  # for bench=sharegpt_val: training's data.max_val_records
    # the decoder: torch (the built-in one, the exact reference) or llama.cpp (llama-server,
    # installed by `bash scripts/install.sh engine`; see decoding/engine_eval.py). In llama.cpp
    # gamma is its n_max (chain length) and p_min its confidence stop.
    engine: str = "torch"
    p_min: float = 0.0
    target_gguf: str | None = None  # llama.cpp: the target's GGUF (default: the embedded one's)
    engine_threads: int | None = None  # llama.cpp threads (default: all cores)
    # llama.cpp's repacked CPU weight layouts (AMX, AVX-512 repack): auto = on unless an
    # 8-token llama-bench run crashes with them here (seen on an AMX Xeon), then off, said
    engine_repack: str = "auto"
    engine_ngram: str = (
        "ngram-simple"  # llama.cpp: its n-gram type for draft=ngram (gamma: its length)
    )
    engine_tie_tolerance: float = 0.5  # llama.cpp: log-prob gap that counts as a near-tie
    predict: bool = True  # llama.cpp: measure the engine's costs and predict the speedup
    plan: bool = False  # llama.cpp: pick n_max (<= plan_max) from those costs first
    plan_max: int = 6
    calibration_tokens: int = 96


# Greedy speculative and plain decoding may part where two tokens' logits are (nearly) tied: a
# forward over k tokens rounds differently from a forward over one. A divergence is a near-tie
# when, in plain decoding's own logits at that point, the two tokens are within this many
# logits of each other; anything wider is a real divergence (a bug). The bf16 figure covers
# what the embedded target's 1-token vs k-token forwards were measured to differ by
# (docs/benchmarks.md), with margin; fp32 differences are ~1e-5.
NEAR_TIE_TOLERANCE = {torch.float32: 1e-3, torch.bfloat16: 0.5, torch.float16: 0.1}


def classify_divergence(
    plain: list[int], spec: list[int], plain_logits: list[torch.Tensor], tolerance: float
) -> dict[str, Any] | None:
    """Where two greedy outputs of the same prompt first part, and whether that is a near-tie.

    plain, spec: the new tokens of plain and speculative decoding; plain_logits[i]: (V,) the
    target logits that chose plain[i]. Returns None when the outputs are identical, else
    ``{"position", "plain_token", "spec_token", "logit_gap", "near_tie"}`` where logit_gap =
    logit[plain token] - logit[spec token] in plain decoding's logits (>= 0: plain took the
    argmax). Outputs of different length with one a prefix of the other part where the
    shorter one ended (a stop token on one side): the stop token is the one compared."""
    n = min(len(plain), len(spec))
    i = next((k for k in range(n) if plain[k] != spec[k]), None)
    if i is None:
        if len(plain) == len(spec):
            return None
        i = n
    if i >= len(plain) or i >= len(spec) or i >= len(plain_logits):
        # one side stopped (max_new_tokens) where the other went on: no token to compare
        return {
            "position": i,
            "plain_token": None,
            "spec_token": None,
            "logit_gap": None,
            "near_tie": False,
        }
    row = plain_logits[i]
    gap = float(row[plain[i]] - row[spec[i]])
    return {
        "position": i,
        "plain_token": plain[i],
        "spec_token": spec[i],
        "logit_gap": gap,
        "near_tie": abs(gap) <= tolerance,
    }


class EvalError(ValueError):
    """An evaluation setting out of range; the message names it."""


def _stats_row(spec: Stats, ar: Stats, c: float, parallel: bool = False) -> dict[str, Any]:
    tps = spec.new_tokens / spec.t_total if spec.t_total else float("nan")
    ar_tps = ar.new_tokens / ar.t_total if ar.t_total else float("nan")
    drafted = sum(spec.drafted.values())
    accepted = sum(spec.accepted.values())
    drafting = sum(n for g, n in spec.gamma_used.items() if g)
    other = spec.t_total - spec.t_target - spec.t_draft - spec.t_prefill
    return {
        "tau": spec.tau,
        "alpha": spec.alpha,
        "alpha_per_position": spec.alpha_per_position(),
        "draft_acceptance_rate": accepted / drafted if drafted else float("nan"),
        "tokens_per_second": tps,
        "ar_tokens_per_second": ar_tps,
        "speedup": tps / ar_tps if ar_tps else float("nan"),
        # the same after the prompt's prefill (long prompts: where a draft's own prefill or
        # the target's dominates the wall time, this is what decoding gains)
        "decode_speedup": _decode_rate(spec) / _decode_rate(ar)
        if _decode_rate(ar)
        else float("nan"),
        # the formula is for chains; a tree's expected length depends on its shape
        "predicted_speedup": (
            predicted_speedup(spec.alpha, spec.gamma_used, c, parallel)
            if not spec.tree_iterations
            else float("nan")
        ),
        # what the decoder would give if verifying cost a plain step and nothing but drafting
        # were added: tau / (1 + drafting per iteration over a plain step). Measured speedup
        # below it is the decoder's cost (wider forwards, bookkeeping); the bound itself below
        # the goal is the draft's (its tau) or its drafting cost
        "speedup_bound": _speedup_bound(spec, ar),
        "target_calls": spec.target_calls,
        # what drafting costs per iteration that drafted (a chain drafter: its steps; a
        # parallel one: its one forward), over one plain target step
        "draft_ms_per_iteration": 1e3 * spec.t_draft / drafting if drafting else float("nan"),
        "draft_cost_per_iteration": (
            (spec.t_draft / drafting) / (ar.t_target / ar.target_calls)
            if drafting and ar.target_calls
            else float("nan")
        ),
        "tree_iterations": spec.tree_iterations,
        "draft_calls": spec.draft_calls,
        "new_tokens": spec.new_tokens,
        "ar_new_tokens": ar.new_tokens,
        "gamma_used": {str(k): v for k, v in sorted(spec.gamma_used.items())},
        "accept_length_hist": {str(k): v for k, v in sorted(spec.accept_len.items())},
        "time_s": {
            "total": spec.t_total,
            "target_forward": spec.t_target,
            "prefill": spec.t_prefill,
            "draft": spec.t_draft,
            "other": other,
            "other_fraction": other / spec.t_total if spec.t_total else float("nan"),
        },
    }


def _speedup_bound(spec: Stats, ar: Stats) -> float:
    if not (spec.target_calls and ar.target_calls and ar.t_target):
        return float("nan")
    plain_step = ar.t_target / ar.target_calls
    return spec.tau / (1 + (spec.t_draft / spec.target_calls) / plain_step)


def _decode_rate(s: Stats) -> float:
    """Tokens per second after the prefill (the prompt's forward and a draft's own)."""
    t = s.t_total - s.t_prefill
    return s.new_tokens / t if t > 0 else float("nan")


def _clean(x):
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if isinstance(x, dict):
        return {k: _clean(v) for k, v in x.items()}
    if isinstance(x, list):
        return [_clean(v) for v in x]
    return x


def bench_questions(cfg: DictConfig) -> list[dict[str, Any]]:
    """The benchmark questions ``cfg`` selects (bench, categories, number; the ShareGPT
    validation split as training drew it)."""
    return load_bench(
        cfg.bench,
        categories=cfg.categories,
        num=cfg.num_prompts,
        data_path=cfg.data_path,
        val_fraction=cfg.val_fraction,
        split_seed=cfg.split_seed,
        max_val_records=cfg.max_val_records,
    )


def stop_ids(cfg: DictConfig, tok) -> set[int]:
    """The tokens that end a reply: EOS (and the pad token), none with ``ignore_eos``."""
    if cfg.ignore_eos:
        return set()
    return {tok.eos_token_id} | ({tok.pad_token_id} if tok.pad_token_id is not None else set())


def evaluate(cfg: DictConfig) -> dict[str, Any]:
    if cfg.engine not in ("torch", "llama.cpp"):
        raise EvalError(f"engine={cfg.engine!r}: use torch (built in) or llama.cpp")
    if cfg.engine == "llama.cpp":
        from .engine_eval import evaluate_engine

        if wants_batch(cfg):
            raise EvalError(
                "batch_size / batch_sizes / request_rates / stop=goodput are measured in the "
                "built-in decoder (engine=torch); llama-server's parallel slots are not"
            )
        if cfg.ignore_eos:
            raise EvalError("ignore_eos=true is for the built-in decoder (engine=torch)")
        return _clean(evaluate_engine(cfg))
    if cfg.gamma < 1:
        raise EvalError(f"gamma={cfg.gamma}: must be >= 1 (use draft=none for plain decoding)")
    if cfg.max_new_tokens < 1:
        raise EvalError(f"max_new_tokens={cfg.max_new_tokens}: must be >= 1")
    if not cfg.temperature >= 0:
        raise EvalError(f"temperature={cfg.temperature}: must be >= 0")
    if not 0 < cfg.top_p <= 1:
        raise EvalError(f"top_p={cfg.top_p}: must be in (0, 1] (1: off)")
    if not cfg.sample_top_k >= 0:
        raise EvalError(f"sample_top_k={cfg.sample_top_k}: must be >= 0 (0: off)")
    try:
        compile_mode(cfg.compile)
    except RunnerError as e:
        raise EvalError(str(e)) from None
    target = load_target(OmegaConf.to_object(cfg.target))
    tok = target.tokenizer
    questions = bench_questions(cfg)
    if cfg.tree not in ("auto", "chain", "dynamic", "static"):
        raise EvalError(f"tree={cfg.tree!r}: use auto, chain, dynamic or static")
    for key in ("depth", "top_k", "total_tokens"):
        if cfg[key] < 1:
            raise EvalError(f"{key}={cfg[key]}: must be >= 1")
    if not 0.0 <= cfg.min_prob < 1.0:
        raise EvalError(f"min_prob={cfg.min_prob}: must be in [0, 1) (0: a fixed-size tree)")
    if cfg.tree_nodes is not None and cfg.tree_nodes < 1:
        raise EvalError(f"tree_nodes={cfg.tree_nodes}: must be >= 1")
    if cfg.acceptance not in ("exact", "typical"):
        raise EvalError(f"acceptance={cfg.acceptance!r}: use exact or typical")
    if not 0 < cfg.lenience <= 1:
        raise EvalError(f"lenience={cfg.lenience}: must be in (0, 1] (1: exact)")
    try:
        check_mode(cfg.draft_weights)  # here too: drafts without weights (ngram...) never read it
    except ValueError as e:
        raise EvalError(str(e)) from None
    keys = (
        "tree",
        "depth",
        "top_k",
        "total_tokens",
        "min_prob",
        "tree_nodes",
        "tree_file",
        "draft_weights",
    )
    tree = DecodeSettings(**{k: cfg[k] for k in keys})
    la = (cfg.lookahead_window, cfg.lookahead_ngram, cfg.lookahead_guesses)
    proposer, draft_desc = load_proposer(
        cfg.draft,
        target,
        cfg.ngram_max,
        tree=tree,
        lookahead=la,
        streaming=(cfg.stream_sinks, cfg.stream_window),
    )
    if cfg.stop not in ("gamma", "disco", "goodput"):
        raise EvalError(
            f"stop={cfg.stop!r}: use gamma (the gamma controller), disco or goodput (SmartSpec)"
        )
    if wants_batch(cfg):
        sampling = Sampling(cfg.temperature, cfg.sample_top_k, cfg.top_p)
        tok = target.tokenizer
        stop = stop_ids(cfg, tok)
        try:
            report = evaluate_batched(cfg, target, proposer, draft_desc, questions, sampling, stop)
        except BatchError as e:
            raise EvalError(str(e)) from None
        report["settings"] = {
            **OmegaConf.to_container(cfg, resolve=True),
            "draft_description": draft_desc,
            "target_identity": target.identity,
            "device": str(target.device),
            "dtype": str(target.dtype),
            "torch_threads": torch.get_num_threads(),
            "machine": platform.machine(),
            "date": datetime.now(timezone.utc).isoformat(),
        }
        return _clean(report)
    if cfg.traces and cfg.adaptive:
        raise EvalError(
            "traces need every drafted position tested at a fixed gamma: add adaptive=false"
        )
    if cfg.traces and cfg.stop != "gamma":
        raise EvalError("traces are recorded with stop=gamma (a stop rule would censor them)")
    stop_rule = None
    if cfg.stop == "disco":
        stop_rule = load_stop_rule(cfg.disco, cfg.draft, proposer)
        draft_desc += f", DISCO stop ({stop_rule.describe()})"
    traces: list | None = [] if cfg.traces else None
    method = proposer.method  # the trained draft behind it, if any
    changed = method.changes_target() if method is not None else None
    sampling = Sampling(cfg.temperature, cfg.sample_top_k, cfg.top_p)
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
            adaptive=cfg.adaptive and stop_rule is None,
            seed=cfg.seed,
            acceptance=cfg.acceptance,
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
    stop = stop_ids(cfg, tok)
    # warm-up: first-call costs (allocations, kernel selection) stay out of the timings
    w = prompt_ids(tok, [{"role": "user", "content": questions[0]["turns"][0]}])
    for dec in (ar, spec):
        dec.generate(w, cfg.warmup_tokens, stop)
        dec.stats = Stats()
    if traces is not None:
        traces.clear()
    per_cat: dict[str, dict[str, Stats]] = defaultdict(lambda: {"spec": Stats(), "ar": Stats()})
    outputs, n_turns, divergences, compared = [], 0, [], 0
    for q in tqdm(questions, desc="prompts", dynamic_ncols=True, file=sys.stderr):
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
    report = _stats_row(spec.stats, ar.stats, c, par)
    report["decoder"] = {
        "runner": spec.runner.kind,
        "plain_runner": ar.runner.kind,
        "compile": compile_mode(cfg.compile),
        "drafter": type(spec.proposer).__name__,
        "capture_seconds": spec.runner.capture_seconds + ar.runner.capture_seconds,
        "plain_ms_per_step": 1e3 * ar_step,
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
            "mean_tvd": spec.stats.mean_tvd
            if (typical or (lenient and not sampling.greedy))
            else None,
            "verifier_changed": changed,
            "convention": CONVENTION,
            "per_category": {
                cat: _stats_row(s["spec"], s["ar"], c, par) for cat, s in sorted(per_cat.items())
            },
            "settings": {
                **OmegaConf.to_container(cfg, resolve=True),
                "draft_description": draft_desc,
                "target_identity": target.identity,
                "device": str(target.device),
                "dtype": str(target.dtype),
                "torch_threads": torch.get_num_threads(),
                "machine": platform.machine(),
                "date": datetime.now(timezone.utc).isoformat(),
            },
            "outputs": outputs,
        }
    )
    if traces is not None:
        report["traces"] = write_traces(cfg.traces, traces, report, draft_desc)
    if changed and cfg.compare_original:
        report["against_original"] = _against_original(target, method, outputs, tok)
    for rec in outputs:  # the token ids were kept for the comparison above only
        for t in rec["turns"]:
            t.pop("ids"), t.pop("prompt_len")
    if cfg.compare_hf:
        report["hf_assisted"] = _hf_assisted(target, proposer, questions, cfg, stop, report)
    return _clean(report)


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
        kw.update(temperature=cfg.temperature, top_k=cfg.sample_top_k or None, top_p=cfg.top_p)
    ours = SpeculativeDecoder(
        target,
        proposer,
        Sampling(cfg.temperature, cfg.sample_top_k, cfg.top_p),
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


def print_report(r: dict[str, Any], out=print) -> None:
    def f(x, nd=2):
        return "-" if x is None else f"{x:.{nd}f}"

    out(
        f"\ndraft: {r['settings']['draft_description']}   target: {r['settings']['target_identity']}"
        f"   T={r['settings']['temperature']}   "
        + (
            "trees verified whole"
            + (" (drafted while they pay: adaptive)" if r["settings"]["adaptive"] else "")
            if r.get("tree_iterations")
            else f"gamma<={r['settings']['gamma']}"
            f"{' (adaptive)' if r['settings']['adaptive'] and not r.get('engine') else ''}"
        )
    )
    head = f"{'category':<16}{'tau':>6}{'alpha':>7}  {'alpha by position':<28}{'tok/s':>7}{'AR tok/s':>9}{'speedup':>8}"
    out(head)
    out("-" * len(head))
    rows = list(r["per_category"].items()) + [("all", r)]
    for name, s in rows:
        pos = " ".join(f(a) for a in (s["alpha_per_position"] or [])[:6])
        out(
            f"{name:<16}{f(s['tau']):>6}{f(s['alpha']):>7}  {pos:<28}{f(s['tokens_per_second'], 1):>7}"
            f"{f(s['ar_tokens_per_second'], 1):>9}{f(s['speedup']):>8}"
        )
    t = r["time_s"]
    if r.get("engine"):
        c = r.get("costs") or {}
        fwd = c.get("target_forward_ms_by_tokens") or {}
        out(
            f"engine: {r['engine']} ({r['settings'].get('spec_type')}, n_max "
            f"{r['settings'].get('n_max')}, p_min {r['settings'].get('p_min')}); "
            f"draft_acceptance_rate {f(r['draft_acceptance_rate'], 3)}"
        )
        if c:
            out(
                f"engine costs: plain step {f(c['plain_ms_per_token'])} ms; target forward over "
                + ", ".join(f"{k}: {f(v)}" for k, v in list(fwd.items())[:6])
                + f" tokens (ms); draft {f(c['draft_ms_per_iteration'])} ms per iteration + "
                f"{f(c['draft_ms_per_drafted_token'])} ms per drafted token "
                f"({f(100 * c['draft_step_over_target_step'], 1)}% of a target step)"
            )
            out(
                f"predicted speedup {f(r['predicted_speedup'])} (measured {f(r['speedup'])}, "
                f"ratio {f(r['predicted_vs_measured'])}); ceiling (a draft always right) "
                f"{f(r['ceiling_speedup'])} at n_max {r['ceiling_n_max']}; lossless: "
                f"{r['lossless']} ({r['lossless_note']})"
            )
        else:
            out(f"lossless: {r['lossless']} ({r['lossless_note']})")
    else:
        d = r.get("decoder") or {}
        if d:
            out(
                f"decoder: {d['runner']} (compile={d['compile']}; plain: {d['plain_runner']}, "
                f"{f(d['plain_ms_per_step'])} ms a step"
                + (
                    f"; graphs captured in {f(d['capture_seconds'], 1)} s"
                    if d["capture_seconds"]
                    else ""
                )
                + f"); speedup {f(r['speedup'])} against a bound of {f(r.get('speedup_bound'))} "
                "(tau over 1 + drafting's share of a plain step)"
            )
        out(
            f"predicted speedup {f(r['predicted_speedup'])} (alpha {f(r['alpha'], 3)}, c "
            f"{f(r['draft_cost_ratio'], 3)}); gamma used {r['gamma_used']}; time outside model "
            f"forwards {f(100 * (t['other_fraction'] or 0), 1)}%; lossless: {r['lossless']} "
            f"({r['lossless_note']})"
        )
    if r.get("verifier_changed"):
        out(f"NOTE: {r['verifier_changed']}")
        o = r.get("against_original")
        if o and o.get("tokens"):
            out(
                f"  against the original target on these outputs: mean per-token TVD "
                f"{f(o['mean_tvd_adapted_vs_original'], 4)}, original's greedy token emitted "
                f"{f(100 * o['original_greedy_agreement'], 1)}% of the time"
            )
    if "hf_assisted" in r and "hf_tokens_per_second" in r["hf_assisted"]:
        h = r["hf_assisted"]
        out(
            f"HF assisted generation: {f(h['hf_tokens_per_second'], 1)} tok/s; ours "
            f"{f(h['ours_tokens_per_second'], 1)} tok/s ({f(h['ours_over_hf'])}x)"
        )
    out(f"convention: {r['convention']}")


def plot_report(r: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 3.8))
    alphas = [x if x is not None else 0.0 for x in (r["alpha_per_position"] or [])]
    a.bar(range(1, len(alphas) + 1), alphas, color="#4878d0")
    a.set_xticks(range(1, len(alphas) + 1))
    a.set_xlabel("draft position k")
    a.set_ylabel("P(accepted | 1..k-1 accepted)")
    a.set_ylim(0, 1)
    a.set_title(f"acceptance by position (alpha {r['alpha'] or 0:.2f})")
    hist = Counter({int(k): v for k, v in r["accept_length_hist"].items()})
    xs = list(range(0, max(hist, default=0) + 1))
    b.bar(xs, [hist[x] for x in xs], color="#ee854a")
    b.set_xlabel("accepted draft tokens per verification (iterations that drafted)")
    b.set_ylabel("iterations")
    b.set_xticks(xs)
    b.set_title(f"accepted length (tau {r['tau'] or 0:.2f})")
    fig.suptitle(r["settings"]["draft_description"], fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


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
    for k, v in found.items():
        cfg[k] = v
    shown = " ".join(f"{k}={v}" for k, v in found.items())
    return (
        f"decode settings saved with the draft for {kind} machines: {shown} (set any to override)"
    )


@hydra.main(version_base="1.3", config_path="../conf", config_name="eval")
def _main(cfg: DictConfig) -> None:
    from hydra.core.hydra_config import HydraConfig

    given = {o.split("=")[0].lstrip("+~") for o in HydraConfig.get().overrides.task}
    try:
        line = apply_saved_decode(cfg, given)
        if line:
            print(line)
        r = evaluate(cfg)
    except USER_ERRORS as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    path = Path(cfg.report)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(r, indent=1))
    png = Path(cfg.plot) if cfg.plot else path.with_suffix(".png")
    if "batch" in r:
        plot_batch_report(r, png)
        print_batch_report(r)
    else:
        plot_report(r, png)
        print_report(r)
    print(f"report: {path}   plot: {png}")


def main() -> None:
    _main()


if __name__ == "__main__":
    main()
