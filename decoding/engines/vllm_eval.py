"""vLLM as the engine that decodes: ``specdraft-eval engine=vllm``.

vLLM pins its own torch and transformers, so it lives in an environment of its own
(``bash scripts/install.sh vllm``: the CPU build where there is no CUDA, vLLM itself where
there is; ``SPECDRAFT_VLLM_PYTHON=<python>`` names another environment's interpreter). It runs
as a subprocess, ``vllm_worker.py``, one JSON request and answer a line, holding one offline
``LLM``: the target alone (plain decoding) or the target with the draft (speculative decoding).

The draft is exported on the fly to the layout vLLM loads (EAGLE-3 and HASS: ``--format vllm``,
or ``engine_format=speculators``; EAGLE-1: ``eagle1-vllm``; Medusa: ``medusa-vllm``; DFlash:
``dflash``; P-EAGLE: ``peagle``), cached beside llama.cpp's; an export folder is served as it
is; ``draft=ngram`` is vLLM's own n-gram (prompt lookup) speculation.

Figures come from vLLM itself: acceptance per position from its spec-decode counters
(``vllm:spec_decode_num_accepted_tokens_per_pos``, read before and after each request), tokens/s
from each request's own timestamps (first token to last: the prompt's prefill excluded, as in the
built-in decoder). ``engine_compare=true`` (the default) then runs the built-in decoder on the
same prompts with the same draft (the exported folder, read back), chain and length, under the
acceptance rule vLLM ran, and puts its acceptance beside vLLM's; where vLLM accepts far less than
that predicts, the report flags the engine (``engine_flag``) rather than the draft.
"""

from __future__ import annotations

import json
import os
import queue
import re
import subprocess
import threading
from pathlib import Path
from typing import Any

from conf.cli import StopSignals

from .base import (
    Completion,
    EngineError,
    EngineStats,
    cache_root,
    cached_export,
    context_needed,
    default_threads,
    engine_flag,
    lossless_note,
    ours_beside,
    run_bench,
    steps_from_positions,
    where_and_when,
)
from .process import EngineProcess
from .vllm_zygote import fork_worker

VERSION = "0.32.0"  # the vLLM release scripts/install_vllm.sh installs
INSTALL_HINT = (
    "bash scripts/install.sh vllm (vLLM in an environment of its own under the cache, a few "
    "minutes), or set SPECDRAFT_VLLM_PYTHON=<the python of an environment with vLLM>"
)
WORKER = Path(__file__).with_name("vllm_worker.py")


def served_formats() -> dict[str, str]:
    """Our export formats vLLM serves, and the speculative method each is served with (each
    format's ``vllm_method``, checked against vLLM in tests/test_vllm.py)."""
    from models import FORMATS

    return {name: f.vllm_method for name, f in FORMATS.items() if f.vllm_method}


#: the format a trained draft is exported to for vLLM, by method
FORMAT_OF_METHOD = {
    "eagle3": "vllm",
    "hass": "vllm",
    "eagle1": "eagle1-vllm",
    "medusa1": "medusa-vllm",
    "medusa2": "medusa-vllm",
    "dflash": "dflash",
    "dspark": "dspark",
    "peagle": "peagle",
}
#: vLLM's acceptance rules, by our name: (draft_sample_method, rejection_sample_method)
RULES = {
    "greedy_draft": ("greedy", "standard"),  # vLLM's default: argmax drafts, q one-hot
    "exact": ("probabilistic", "standard"),  # drafts sampled from q, tested with q
    "block": ("greedy", "block"),  # block verification (Sun et al.) of argmax drafts
}


def vllm_python(required: bool = True) -> Path | None:
    """The interpreter of vLLM's environment: ``$SPECDRAFT_VLLM_PYTHON``, else the one
    ``install.sh vllm`` made under the cache; None (or EngineError when ``required``) where
    neither is there."""
    env = os.environ.get("SPECDRAFT_VLLM_PYTHON")
    if env:
        cands = [Path(env).expanduser()]
    else:
        roots = dict.fromkeys([cache_root(), Path("~/.cache/specdraft").expanduser()])
        cands = [r / f"vllm-{VERSION}" / "bin" / "python" for r in roots]
    for c in cands:
        # the install writes .ok last: a half-made environment is not one
        if c.is_file() and (env or (c.parent.parent / ".ok").is_file()):
            return c
    if required:
        where = f"SPECDRAFT_VLLM_PYTHON={env}" if env else str(cands[0].parent.parent)
        raise EngineError(f"vLLM is not installed ({where} has none): {INSTALL_HINT}")
    return None


class VLLMWorker(EngineProcess):
    """One vLLM ``LLM`` in a subprocess of vLLM's own environment.

    with VLLMWorker(model_dir, speculative={"method": "eagle3", "model": d,
                    "num_speculative_tokens": 3}) as eng:
        out = eng.complete(prompt_ids, 128, temperature=0.0)
    """

    log_prefix = "specdraft-vllm-"

    def __init__(
        self,
        model: str | Path,
        speculative: dict[str, Any] | None = None,
        dtype: str = "auto",
        max_model_len: int = 2048,
        seed: int = 0,
        threads: int | None = None,
        kv_cache_gib: int = 1,
        python: Path | None = None,
        extra: dict[str, Any] | None = None,
        repair: bool = True,
    ):
        self.python = python or vllm_python()
        # repair the build's known defects before loading (vllm_worker.repair_cpu_expand);
        # what was repaired is in self.repairs, one line each
        self.repair, self.repairs = bool(repair), []
        self.model, self.speculative = str(model), speculative
        self.gamma = int((speculative or {}).get("num_speculative_tokens") or 0)
        self.threads = default_threads(threads)
        self.llm_args = {
            "model": self.model,
            "tokenizer": self.model,
            "dtype": dtype,
            "max_model_len": int(max_model_len),
            "seed": int(seed),
            "enforce_eager": True,
            **({"speculative_config": speculative} if speculative else {}),
            **(extra or {}),
        }
        self.kv_cache_gib = kv_cache_gib
        self.version = self.device = None
        self.load_seconds = float("nan")
        super().__init__()

    # -- the process (the log, ``with`` and the stop at exit: process.EngineProcess) ---------
    def start(self) -> None:
        env = {
            **os.environ,
            # the engine core in this process: no second process polling beside the timings
            "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
            "OMP_NUM_THREADS": str(self.threads),
            # the CPU build's KV cache, GiB (an integer); its default takes most of the memory
            "VLLM_CPU_KVCACHE_SPACE": str(int(self.kv_cache_gib)),
            "VLLM_NO_USAGE_STATS": "1",
            "DO_NOT_TRACK": "1",
            "TOKENIZERS_PARALLELISM": "false",
            "PYTHONUNBUFFERED": "1",
        }
        log = self.open_log("w")
        # forked from a zygote that imported vLLM already, where one is named (vllm_zygote.py)
        self.launch(
            fork_worker(self.python, env, self.log_path)
            or subprocess.Popen(
                [str(self.python), str(WORKER)],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=log,
                text=True,
                env=env,
            )
        )
        self._answers: queue.Queue = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()
        try:
            out = self.ask({"cmd": "init", "llm": self.llm_args, "repair": self.repair}, 900)
        except BaseException:
            # vLLM refused the model or the draft: its process would wait on for commands (a
            # `with` block never reaches __exit__ when __enter__ raises)
            self.close()
            raise
        self.version, self.load_seconds = out["vllm"], out["seconds"]
        self.repairs = list(out.get("repairs") or [])
        self.device = out.get("device", "?")  # where vLLM runs, by its own platform

    def _read(self) -> None:
        assert self.proc is not None and self.proc.stdout is not None
        for line in self.proc.stdout:
            self._answers.put(line)
        self._answers.put(None)  # the process closed its output: it ended

    def end_now(self, p) -> None:
        p.kill()  # nothing of it to save; a forked worker (vllm_zygote.Forked) has only kill
        p.wait()

    def shutdown(self, p: subprocess.Popen) -> None:
        # asked to exit, it leaves at once (vllm_worker.py); killed where it does not answer
        try:
            self.ask({"cmd": "exit"}, timeout=30)
            p.wait(timeout=30)
        except (EngineError, subprocess.TimeoutExpired):
            p.kill()
            p.wait()

    def ask(self, msg: dict[str, Any], timeout: float = 1800) -> dict[str, Any]:
        try:
            return self._ask(msg, timeout)
        except EngineError as e:
            self.keep_log = True  # the error names it
            m = re.search(r"Unsupported CPU attention configuration: head_dim=(\d+)", str(e))
            if m:  # say what it means, and the fix for the tiny targets people try things on
                raise EngineError(
                    f"{e}: vLLM's CPU build has no attention kernel for heads {m.group(1)} wide "
                    "(a tiny random target: target.tiny_head_dim=64)"
                ) from None
            raise

    def _ask(self, msg: dict[str, Any], timeout: float) -> dict[str, Any]:
        p = self.proc
        if p is None or p.poll() is not None:
            raise EngineError(f"vLLM is not running: {self.last_error()} (log: {self.log_path})")
        try:
            p.stdin.write(json.dumps(msg) + "\n")
            p.stdin.flush()
        except (BrokenPipeError, OSError):
            pass  # it died; the read below says so
        try:
            line = self._answers.get(timeout=timeout)
        except queue.Empty:
            raise EngineError(f"vLLM gave no answer in {timeout:.0f} s ({msg['cmd']})") from None
        if line is None:
            p.wait()
            raise EngineError(
                f"vLLM exited ({p.returncode}) during {msg['cmd']}: {self.last_error()} "
                f"(log: {self.log_path})"
            )
        out = json.loads(line)
        if "error" in out:
            raise EngineError(f"vLLM: {out['error']} (log: {self.log_path})")
        return out

    # -- the engine contract ----------------------------------------------------------------
    def params(self, n, temperature, seed, top_k, top_p, **more) -> dict[str, Any]:
        return {
            "max_tokens": int(n),
            "temperature": float(temperature),
            "top_k": int(top_k),
            "top_p": float(top_p),
            "seed": int(seed),
            "skip_special_tokens": False,
            **more,
        }

    def complete(
        self,
        prompt: list[int],
        n_predict: int,
        temperature: float = 0.0,
        seed: int = 0,
        top_k: int = 0,
        top_p: float = 1.0,
    ) -> Completion:
        out = self.ask(
            {
                "cmd": "generate",
                "prompts": [[int(t) for t in prompt]],
                "params": self.params(n_predict, temperature, seed, top_k, top_p),
            }
        )
        o = out["outputs"][0]
        n = len(o["tokens"])
        first, last = o.get("first_token_ts"), o.get("last_token_ts")
        timed = (1000 * (last - first), n - 1) if first and last and n > 1 else (0.0, 0)
        spec = out.get("spec") or {}
        steps = []
        if self.gamma and spec.get("drafts"):
            steps = steps_from_positions(
                spec["drafts"], self.gamma, spec.get("accepted_per_pos") or []
            )
        timings = {
            "predicted_n": n,
            "predicted_ms": timed[0],
            "timed_n": timed[1],
            "draft_n": spec.get("draft_tokens", 0),
            "draft_n_accepted": spec.get("accepted", 0),
            "drafts": spec.get("drafts", 0),
            "accepted_per_pos": spec.get("accepted_per_pos") or [],
            "finish_reason": o.get("finish_reason"),
        }
        return Completion(list(o["tokens"]), timings, steps)

    def top_logprobs(self, prompt: list[int], k: int) -> dict[int, float]:
        out = self.ask(
            {
                "cmd": "generate",
                "prompts": [[int(t) for t in prompt]],
                "params": self.params(1, 0.0, 0, 0, 1.0, logprobs=int(k)),
                "metrics": False,
            }
        )
        lps = out["outputs"][0].get("logprobs") or [{}]
        return {int(t): float(v) for t, v in lps[0].items()}

    def generate_many(
        self, prompts: list[list[int]], params: list[dict[str, Any]]
    ) -> list[dict[str, Any]]:
        """Many prompts in one call, each with its own sampling settings (``params``: vLLM
        ``SamplingParams`` keyword arguments), scheduled by vLLM's own continuous batching;
        per prompt its new ``tokens`` and ``finish_reason``."""
        out = self.ask(
            {
                "cmd": "generate",
                "prompts": [[int(t) for t in p] for p in prompts],
                "params": params,
                "metrics": False,
            }
        )
        return out["outputs"]


# -- what vLLM serves -----------------------------------------------------------------------


def speculative_config(
    folder: Path, fmt: str, gamma: int, rule: str = "greedy_draft"
) -> dict[str, Any]:
    """vLLM's ``speculative_config`` for an exported draft ``folder`` in layout ``fmt``."""
    if fmt not in served_formats():
        raise EngineError(
            f"{folder}: a {fmt} export; vLLM {VERSION} serves {', '.join(served_formats())}"
        )
    from models import FORMATS

    config = json.loads((Path(folder) / "config.json").read_text())
    n = FORMATS[fmt].vllm_tokens(config, int(gamma))
    return {**_speculative(served_formats()[fmt], folder, n, rule), **FORMATS[fmt].vllm_options}


def _speculative(method: str, model: str | Path, n: int, rule: str) -> dict[str, Any]:
    """vLLM's ``speculative_config``: ``method`` drafting ``n`` tokens with ``model``, under
    the acceptance rule ``rule`` (``RULES``)."""
    draft_sampling, rejection = RULES[rule]
    return {
        "method": method,
        "model": str(model),
        "num_speculative_tokens": int(n),
        "draft_sample_method": draft_sampling,
        "rejection_sample_method": rejection,
    }


def vllm_draft(cfg, target, log) -> tuple[dict[str, Any], str, str | None]:
    """(speculative_config, description, folder our decoder reads back or None) for
    ``cfg.draft``: vLLM's n-gram speculation, a draft language model (a DistillSpec run's
    student, any causal LM with the target's tokenizer: vLLM's ``draft_model``), an export
    folder as it is, or a trained draft exported once (cached) to the layout vLLM loads."""
    from models.base import DraftError, ExportError
    from models.export import (
        check_method,
        detect_format,
        load_trained_head,
        made_for,
        made_for_note,
        noted,
    )
    from models.shipped import shipped_draft

    from ..drafts import standalone_lm

    d = str(cfg.draft)
    if d in ("none", "ar"):
        raise EngineError("engine=vllm compares a draft with plain decoding: set draft=")
    if d in ("ngram", "pld"):
        spec = {
            "method": "ngram",
            "num_speculative_tokens": int(cfg.gamma),
            "prompt_lookup_max": int(cfg.ngram_max),
            "prompt_lookup_min": 1,
        }
        return spec, f"vLLM ngram (prompt lookup, n <= {cfg.ngram_max})", None
    p = shipped_draft(d) or Path(d).expanduser()
    note = made_for_note(made_for(p), target) if p.is_dir() else None
    lm = standalone_lm(d, target)
    if note:
        log(f"warning: {p}: {note}")
    if lm is not None:  # a draft language model: vLLM's draft_model method
        folder, desc = lm
        spec = _speculative("draft_model", folder, cfg.gamma, cfg.engine_rule)
        return spec, desc + noted(note), str(folder)
    if not p.exists():
        raise DraftError(f"draft={d}: no such folder")
    fmt = detect_format(p) if (p / "config.json").is_file() else None
    if fmt is not None:
        from models import FORMATS

        layout = FORMATS[fmt]
        if fmt not in served_formats():
            why = f" as trained ({layout.vllm_refusal})" if layout.vllm_refusal else ""
            raise EngineError(
                f"draft={d}: a {fmt} export, which vLLM does not serve{why}; vLLM {VERSION} "
                f"serves {', '.join(served_formats())} (specdraft-export --format ...)"
            )
        mismatch = layout.vllm_mismatch(p, layout.read_config(p))
        if mismatch:
            raise EngineError(mismatch)
        folder = p
    else:
        head = load_trained_head(p, target)
        method = head.cfg.name
        fmt = cfg.engine_format or FORMAT_OF_METHOD.get(method)
        if fmt is None or fmt not in served_formats():
            raise EngineError(
                f"draft={d}: a {method} draft"
                + (f" as engine_format={fmt}" if fmt else "")
                + f"; vLLM {VERSION} serves {', '.join(served_formats())} "
                f"({', '.join(sorted(FORMAT_OF_METHOD))} drafts, and draft language models: "
                "DistillSpec students, any causal LM with the target's tokenizer)"
            )
        try:  # engine_format= of another method's layout: refused before anything is exported
            check_method(fmt, head, flag="engine_format=")
        except ExportError as e:
            default = FORMAT_OF_METHOD.get(method)
            unset = f" (leave engine_format unset: {default})" if default else ""
            raise EngineError(f"draft={d}: {e}{unset}") from None
        folder = cached_export(p, head, fmt, log, f"-{fmt}", gamma=int(cfg.gamma))
    spec = speculative_config(folder, fmt, cfg.gamma, cfg.engine_rule)
    return spec, f"{fmt} export ({folder}{noted(note)})", str(folder)


# -- the evaluation -------------------------------------------------------------------------


def _validate(cfg) -> None:
    from ..settings import EvalError

    if cfg.max_new_tokens < 1:
        raise EvalError(f"max_new_tokens={cfg.max_new_tokens}: must be >= 1")
    if cfg.gamma < 1:
        raise EvalError(f"gamma={cfg.gamma}: vLLM's num_speculative_tokens, must be >= 1")
    if cfg.tree not in ("auto", "chain"):
        raise EvalError(f"tree={cfg.tree}: engine=vllm drafts chains (use tree=auto or chain)")
    if cfg.p_min:
        raise EvalError(f"p_min={cfg.p_min}: llama.cpp's confidence stop; vLLM has none")
    if cfg.engine_rule not in RULES:
        raise EvalError(f"engine_rule={cfg.engine_rule!r}: use one of {', '.join(RULES)}")
    if cfg.engine_dtype not in ("auto", "float32", "bfloat16", "float16"):
        raise EvalError(
            f"engine_dtype={cfg.engine_dtype!r}: use auto (the target's), float32, bfloat16 "
            "or float16"
        )


def evaluate(cfg, log=print) -> dict[str, Any]:
    from omegaconf import OmegaConf

    from data.chat import prompt_ids
    from models.target import load_target, target_folder

    from ..report import CONVENTION
    from ..sample_check import check_run
    from ..settings import bench_questions, check_context, sampling_of, stop_ids

    _validate(cfg)
    python = vllm_python()
    target = load_target(OmegaConf.to_object(cfg.target))
    tok = target.tokenizer
    questions = bench_questions(cfg)
    check_context(cfg, target, questions)  # a question past the context: before any export
    spec_cfg, desc, readback = vllm_draft(cfg, target, log)
    n_max = int(spec_cfg["num_speculative_tokens"])
    if n_max != cfg.gamma:  # a DFlash block, Medusa's heads: the layout fixes it
        log(f"gamma={cfg.gamma}: this draft drafts {n_max} tokens a step in vLLM (its layout "
            f"fixes it); measured, and compared with ours, at {n_max}")  # fmt: skip
    stop = stop_ids(cfg, tok, target)
    model_dir = target_folder(target)
    dtype = (
        str(target.dtype).removeprefix("torch.") if cfg.engine_dtype == "auto" else cfg.engine_dtype
    )
    greedy = cfg.temperature == 0
    sampling = {"temperature": cfg.temperature, "top_k": cfg.sample_top_k, "top_p": cfg.top_p}
    warm = prompt_ids(tok, [{"role": "user", "content": questions[0]["turns"][0]}])
    common = {
        "dtype": dtype,
        "max_model_len": max(256, context_needed(cfg, tok, questions, cfg.max_new_tokens)),
        "seed": cfg.seed,
        "threads": cfg.engine_threads or None,
        "python": python,
        "repair": cfg.engine_repair,
    }
    log(f"vLLM: {model_dir} in {dtype}, plain and with {desc}")
    with VLLMWorker(model_dir, **common) as plain:
        plain.complete(warm, cfg.warmup_tokens, **sampling, seed=cfg.seed)
        with VLLMWorker(model_dir, speculative=spec_cfg, **common) as spec:
            spec.complete(warm, cfg.warmup_tokens, **sampling, seed=cfg.seed)
            costs = _calibrate(cfg, plain, spec, warm, sampling) if cfg.predict else None
            run = run_bench(plain, spec, questions, cfg, tok, stop, "vLLM")
            version, threads, device = spec.version, spec.threads, spec.device
            repairs = spec.repairs
            last = spec.last_error() if not run.finished else None
    if not run.outputs:
        raise EngineError(run.error or "vLLM finished no prompt")
    pooled = run.pooled
    report = pooled.row()
    near = sum(bool(d["near_tie"]) for d in run.divergences)
    rule = "greedy" if greedy else cfg.engine_rule
    report.update(
        {
            "engine": f"vLLM {version} (offline LLM, {device})",
            "lossless": (near == len(run.divergences)) if greedy else None,
            "divergences": len(run.divergences) if greedy else None,
            "near_tie_divergences": near if greedy else None,
            "divergence_details": run.divergences,
            "lossless_note": lossless_note(
                run, greedy, cfg.engine_tie_tolerance, f"vLLM's sampler ({_rule_text(rule)})"
            ),
            "acceptance": rule,
            "verifier_changed": None,
            "finished": run.finished,
            "engine_error": run.error,
            "engine_repairs": repairs,
            "engine_last_log_line": last,
            **_prediction(costs, pooled, n_max),
            "convention": CONVENTION
            + " In vLLM: tokens/s from each request's first and last token timestamps; alpha "
            "per position from its spec-decode counters (accepted per position over drafts); "
            "draft_acceptance_rate from accepted / draft tokens.",
            "per_category": {c: s.row() for c, s in sorted(run.per_category.items())},
            "settings": {
                **OmegaConf.to_container(cfg, resolve=True),
                "n_max": n_max,
                "spec_type": spec_cfg["method"],
                "speculative_config": spec_cfg,
                "draft_description": f"{desc}; vLLM {spec_cfg['method']}, "
                f"{n_max} speculative tokens, rule {rule}",
                "target_identity": target.identity,
                "target_folder": str(model_dir),
                "engine_dtype": dtype,
                "engine_threads": threads,
                **where_and_when(),
            },
            "outputs": run.outputs,
        }
    )
    if not greedy:
        report["sample_check"] = check_run(target, run.samples, sampling_of(cfg), log)
    if cfg.engine_compare and run.finished and run.stopped is None:  # a stop: report now
        ours = ours_beside(cfg, readback, rule, pooled, log, n_max, run.outputs)
        if StopSignals.requested() is None:
            report["ours"] = ours
            report["engine_flag"] = engine_flag(ours, pooled)
        else:  # on fewer prompts than the engine's: no comparison
            report["stopped"] = {"left_out": "the built-in decoder's comparison (engine_compare)"}
    return report


def _calibrate(cfg, plain: VLLMWorker, spec: VLLMWorker, prompt, sampling) -> dict:
    """vLLM's own costs on this machine, on a calibration prompt apart from the evaluation's
    requests: ms per plain step, and ms per speculative step (a target forward over the
    drafted tokens plus the drafting before it, whatever was accepted)."""
    n = int(cfg.calibration_tokens)
    ar = plain.complete(prompt, n, **sampling, seed=cfg.seed)
    sp = spec.complete(prompt, n, **sampling, seed=cfg.seed)
    st = EngineStats()
    st.add(sp, ar)
    plain_ms = ar.predicted_ms / max(1, ar.timings["timed_n"])
    step_ms = sp.predicted_ms / max(1, st.target_calls)
    return {
        "plain_ms_per_token": plain_ms,
        "speculative_step_ms": step_ms,
        "speculative_step_over_plain_step": step_ms / plain_ms if plain_ms else float("nan"),
        "calibration_tokens": n,
    }


def _prediction(costs: dict | None, pooled: EngineStats, gamma: int) -> dict[str, Any]:
    """The speedup vLLM's own costs predict from the acceptance measured here (tokens per
    target forward x plain step / speculative step), and the ceiling of a draft always right."""
    nan = float("nan")
    if not costs or not costs["speculative_step_ms"]:
        return {"predicted_speedup": nan, "ceiling_speedup": nan, "costs": costs}
    calls = pooled.target_calls
    per_call = (pooled.tokens - pooled.requests) / calls if calls else nan
    ratio = costs["speculative_step_over_plain_step"]
    pred = per_call / ratio
    row = pooled.row()
    return {
        "predicted_speedup": pred,
        "predicted_vs_measured": pred / row["speedup"] if row["speedup"] else nan,
        "ceiling_speedup": (gamma + 1) / ratio,
        "ceiling_n_max": gamma,
        "costs": costs,
        "draft_cost_ratio": ratio - 1.0,
    }


def _rule_text(rule: str) -> str:
    return {
        "greedy": "greedy: the target's argmax",
        "greedy_draft": "argmax drafts tested as one-hot q: vLLM's default",
        "exact": "drafts sampled from q and tested with q",
        "block": "block verification of argmax drafts",
    }[rule]
