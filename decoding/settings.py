"""``specdraft-eval``'s settings: the typed config (Hydra's structured schema, every key checked
when the command line is read), the error it raises for settings it cannot run, and what a
config selects (the benchmark's questions, the tokens that end a reply)."""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from omegaconf import DictConfig

from models.base import DecodeSettings
from models.quant import check_mode
from models.sampling import Sampling
from models.target import TargetConfig

from .batch_checks import BatchError
from .batch_eval import (
    batch_sizes_of,
    policies_of,
    request_budgets,
    request_rates_of,
    wants_batch,
)
from .bench import load_bench
from .runner import RunnerError, compile_mode

#: seeds below this stay 64-bit once a batched request's own seed is derived from them
SEED_LIMIT = 2**40


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
    # forward over a static KV cache at fixed widths, captured as CUDA graphs on a GPU (eager on
    # a CPU); false = transformers' forward over its dynamic cache; auto = the first wherever it
    # runs (the families of models.lean_layers.ARCHS: Llama, Mistral, Qwen2/3, Qwen3-MoE, Mixtral,
    # Gemma-1/2/3, OLMo-2, Phi-3; a draft LM of those families too; the report says which ran);
    # fused = true with each layer's elementwise ops compiled by torch.compile (fewer kernels)
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
    # exact (lossless speculative sampling) | block (block verification of chains at T > 0,
    # Sun et al.: lossless, accepts at least as much; vLLM's rejection_sample_method="block") |
    # typical (Medusa's typical acceptance at T > 0: not lossless; the report gives the mean
    # per-token TVD from the target)
    acceptance: str = "exact"
    # at T > 0, how a trained draft proposes: sample (drawn from its q, tested with q) or
    # greedy (its argmax, tested as a point mass: lossless too, and what vLLM serves by
    # default, the only rule it allows for reduced-vocabulary heads such as EAGLE-3's)
    draft_sampling: str = "sample"
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
    # stop=confidence (DSpark): draft the block and verify its slots while the confidence
    # head's running product of acceptance estimates is at least confidence_threshold (a slot
    # is worth verifying when the chance that it and every slot before it are accepted pays for
    # its share of the verification forward)
    stop: str = "gamma"
    disco: str | None = None
    confidence_threshold: float = 0.2
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
    # once, and keeps the batch fuller: docs/benchmarks.md, 2026-11-26)
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
    skip_records: int = 0  # for bench=sharegpt_val: training's data.skip_records
    # the decoder: torch (the built-in one, the exact reference) or llama.cpp (llama-server,
    # installed by `bash scripts/install.sh engine`; see decoding/engines/). In llama.cpp
    # gamma is its n_max (chain length) and p_min its confidence stop.
    engine: str = "torch"
    p_min: float = 0.0
    target_gguf: str | None = None  # llama.cpp: the target's GGUF (default: the embedded one's)
    engine_threads: int | None = None  # engine threads (default: OMP_NUM_THREADS or all cores)
    # llama.cpp's repacked CPU weight layouts (AMX, AVX-512 repack): auto = on unless an
    # 8-token llama-bench run crashes with them here (seen on an AMX Xeon), then off, said
    engine_repack: str = "auto"
    engine_ngram: str = (
        "ngram-simple"  # llama.cpp: its n-gram type for draft=ngram (gamma: its length)
    )
    engine_tie_tolerance: float = 0.5  # llama.cpp: log-prob gap that counts as a near-tie
    # vLLM: the export layout a trained EAGLE-3/HASS draft is served in (vllm | speculators;
    # None: each method's default, decoding/engines/vllm_eval.py), vLLM's acceptance rule at T > 0
    # (greedy_draft: argmax drafts tested as one-hot, vLLM's default; exact: drafts sampled
    # from q; block: block verification) and its dtype (auto: the target's)
    engine_format: str | None = None
    engine_rule: str = "greedy_draft"
    engine_dtype: str = "auto"
    # vLLM and llama.cpp: whether the built-in decoder runs the same prompts with the same
    # draft and rule beside the engine (llama.cpp: at T = 0, a model draft, p_min = 0)
    engine_compare: bool = True
    # vLLM: repair the build's known defects before loading, each found by a check and named in
    # the report (today one: the CPU build's expand kernel, which breaks acceptance at T > 0;
    # decoding/engines/vllm_worker.py). false serves the build exactly as installed.
    engine_repair: bool = True
    predict: bool = True  # llama.cpp: measure the engine's costs and predict the speedup
    plan: bool = False  # llama.cpp: pick n_max (<= plan_max) from those costs first
    plan_max: int = 6
    calibration_tokens: int = 96


class EvalError(ValueError):
    """An evaluation setting out of range; the message names it."""


#: the questions each selection gave, read once a process: a run stopped by a signal counts
#: the questions it was asked without reading the bench again (the ShareGPT split takes
#: seconds, a scheduler's grace period is short), and they are the ones it was asked
_QUESTIONS: dict[tuple, list[dict[str, Any]]] = {}


def bench_questions(cfg: DictConfig) -> list[dict[str, Any]]:
    """The benchmark questions ``cfg`` selects (bench, categories, number; the ShareGPT
    validation split as training drew it)."""
    kw = {
        "categories": None if cfg.categories is None else tuple(cfg.categories),
        "num": cfg.num_prompts,
        "data_path": cfg.data_path,
        "val_fraction": cfg.val_fraction,
        "split_seed": cfg.split_seed,
        "max_val_records": cfg.max_val_records,
        "skip_records": cfg.skip_records,
    }
    # a file edited since is read again
    key = (cfg.bench, _stamp(cfg.bench), _stamp(cfg.data_path), *kw.values())
    if key not in _QUESTIONS:
        _QUESTIONS[key] = load_bench(cfg.bench, **kw)
    return [dict(q, turns=list(q["turns"])) for q in _QUESTIONS[key]]


def _stamp(path: str | None) -> tuple[int, int] | None:
    """A file's modification time and size (None: not a file)."""
    try:
        st = Path(str(path)).expanduser().stat()
    except (OSError, ValueError):
        return None
    return (st.st_mtime_ns, st.st_size)


def sampling_of(cfg: DictConfig) -> Sampling:
    """The decoding settings an evaluation samples and verifies under."""
    return Sampling(cfg.temperature, cfg.sample_top_k, cfg.top_p)


def stop_ids(cfg: DictConfig, tok, target=None) -> set[int]:
    """The tokens that end a reply: EOS (and the pad token), none with ``ignore_eos``. With the
    loaded ``target``, its generation config's end-of-sequence tokens too: an instruction
    model's end of turn is often there and not the tokenizer's EOS (Gemma's
    ``<end_of_turn>``), and without it a reply runs on past its end to ``max_new_tokens``."""
    if cfg.ignore_eos:
        return set()
    out = {tok.eos_token_id} | ({tok.pad_token_id} if tok.pad_token_id is not None else set())
    gen = getattr(getattr(target, "model", None), "generation_config", None)
    eos = getattr(gen, "eos_token_id", None)
    out |= set(eos if isinstance(eos, list | tuple) else [eos] if eos is not None else [])
    return {t for t in out if t is not None}


#: the settings only a serving engine reads, and which engines read them (any other engine
#: leaves them unused: ``specdraft-eval`` says so where one is typed)
ENGINE_ONLY = {
    "engine_format": ("vllm",),
    "engine_rule": ("vllm",),
    "engine_dtype": ("vllm",),
    "engine_compare": ("vllm", "llama.cpp"),
    "engine_repair": ("vllm",),
    "engine_repack": ("llama.cpp",),
    "engine_ngram": ("llama.cpp",),
    "target_gguf": ("llama.cpp",),
    "plan": ("llama.cpp",),
    "plan_max": ("llama.cpp",),
    "p_min": ("llama.cpp",),
    "engine_threads": ("llama.cpp", "vllm"),
    "engine_tie_tolerance": ("llama.cpp", "vllm"),
    "predict": ("llama.cpp", "vllm"),
    "calibration_tokens": ("llama.cpp", "vllm"),
}


#: the built-in decoder's settings, which no serving engine reads (``specdraft-eval`` notes
#: one typed with an engine); those that change what is accepted are refused there instead
BUILT_IN_ONLY = (
    "adaptive",
    "compile",
    # how a trained draft proposes (DecodeSettings), less tree=, which the engines read
    *(f.name for f in fields(DecodeSettings) if f.name != "tree"),
    "draft_sampling",
    "typical_epsilon",
    "typical_delta",
    "compare_original",
    "lookahead_window",
    "lookahead_ngram",
    "lookahead_guesses",
    "stream_sinks",
    "stream_window",
    "disco",
    "confidence_threshold",
    "compare_hf",
)


def check_engine_rules(cfg: DictConfig) -> None:
    """An engine verifies by its own rule (llama.cpp: exact; vLLM: ``engine_rule``) with its
    own stop: a lossy or learned rule of the built-in decoder's, asked of an engine, would be
    reported as if the engine had run it. ``EvalError`` naming the setting."""
    e = cfg.engine
    d = str(cfg.draft)
    if d in ("lookahead", "streaming") or d.startswith("truncate:"):
        raise EvalError(
            f"draft={d}: a drafter of the built-in decoder's (engine=torch); engine={e} serves "
            "trained drafts, draft language models and n-gram speculation (draft=ngram)"
        )
    rule = "its rule is engine_rule= (greedy_draft, exact, block)" if e == "vllm" else "exact"
    if cfg.lenience != 1:
        raise EvalError(
            f"lenience={cfg.lenience}: lenient acceptance is the built-in decoder's "
            f"(engine=torch); engine={e} verifies by its own rule ({rule})"
        )
    if cfg.acceptance != "exact":
        hint = " (vLLM's block verification: engine_rule=block)" if e == "vllm" else ""
        raise EvalError(
            f"acceptance={cfg.acceptance}: the built-in decoder's rule (engine=torch); "
            f"engine={e} verifies by its own ({rule}){hint}"
        )
    if cfg.stop != "gamma":
        raise EvalError(
            f"stop={cfg.stop}: the built-in decoder's stop rule (engine=torch); engine={e} "
            "drafts gamma tokens a step" + (" (or stops at p_min=)" if e == "llama.cpp" else "")
        )
    if cfg.traces:
        raise EvalError(f"traces={cfg.traces}: recorded by the built-in decoder (engine=torch)")


def validate(cfg: DictConfig) -> None:
    """Every setting of an evaluation that can be judged without a model, at once, before
    anything loads (every engine's): ``EvalError`` naming the key and the value."""
    if cfg.gamma < 1:
        raise EvalError(f"gamma={cfg.gamma}: must be >= 1 (use draft=none for plain decoding)")
    for key, lo, why in (
        ("max_new_tokens", 1, ""),
        ("turns", 1, " (turns per question fed)"),
        ("ngram_max", 1, " (the longest n-gram looked up)"),
        ("warmup_tokens", 0, ""),
        ("plan_max", 1, ""),
        ("calibration_tokens", 1, ""),
    ):
        if cfg[key] < lo:
            raise EvalError(f"{key}={cfg[key]}: must be >= {lo}{why}")
    if cfg.num_prompts is not None and cfg.num_prompts < 1:
        raise EvalError(f"num_prompts={cfg.num_prompts}: must be >= 1 (null: all)")
    if cfg.compare_hf and cfg.num_prompts == 1:
        raise EvalError(
            "compare_hf=true with num_prompts=1: the first prompt warms both decoders up "
            "untimed; give num_prompts >= 2"
        )
    if not 0 <= cfg.temperature < float("inf"):
        raise EvalError(f"temperature={cfg.temperature}: must be >= 0 (and finite; 0: greedy)")
    if not -SEED_LIMIT < cfg.seed < SEED_LIMIT:
        # each batched request's stream is seeded from it (seed * 100003 + its index), which
        # must stay a 64-bit seed
        raise EvalError(f"seed={cfg.seed}: must be an integer between -2^40 and 2^40")
    if not 0 < cfg.top_p <= 1:
        raise EvalError(f"top_p={cfg.top_p}: must be in (0, 1] (1: off)")
    if not cfg.sample_top_k >= 0:
        raise EvalError(f"sample_top_k={cfg.sample_top_k}: must be >= 0 (0: off)")
    try:
        compile_mode(cfg.compile)
    except RunnerError as e:
        raise EvalError(str(e)) from None
    if cfg.tree not in ("auto", "chain", "dynamic", "static"):
        raise EvalError(f"tree={cfg.tree!r}: use auto, chain, dynamic or static")
    for key in ("depth", "top_k", "total_tokens"):
        if cfg[key] < 1:
            raise EvalError(f"{key}={cfg[key]}: must be >= 1")
    if not 0.0 <= cfg.min_prob < 1.0:
        raise EvalError(f"min_prob={cfg.min_prob}: must be in [0, 1) (0: a fixed-size tree)")
    if cfg.tree_nodes is not None and cfg.tree_nodes < 1:
        raise EvalError(f"tree_nodes={cfg.tree_nodes}: must be >= 1")
    if cfg.acceptance not in ("exact", "block", "typical"):
        raise EvalError(f"acceptance={cfg.acceptance!r}: use exact, block or typical")
    if not 0.0 <= cfg.typical_epsilon <= 1.0:
        raise EvalError(f"typical_epsilon={cfg.typical_epsilon}: must be in [0, 1]")
    if not 0.0 <= cfg.typical_delta < float("inf"):
        raise EvalError(f"typical_delta={cfg.typical_delta}: must be >= 0 (and finite)")
    for key, lo in (("lookahead_window", 1), ("lookahead_ngram", 2), ("lookahead_guesses", 1)):
        if not cfg[key] >= lo:
            raise EvalError(f"{key}={cfg[key]}: must be >= {lo}")
    if cfg.draft_sampling not in ("sample", "greedy"):
        raise EvalError(f"draft_sampling={cfg.draft_sampling!r}: use sample or greedy")
    if not 0 < cfg.lenience <= 1:
        raise EvalError(f"lenience={cfg.lenience}: must be in (0, 1] (1: exact)")
    try:
        check_mode(cfg.draft_weights)  # here too: drafts without weights (ngram...) never read it
    except ValueError as e:
        raise EvalError(str(e)) from None
    if cfg.stop not in ("gamma", "disco", "goodput", "confidence"):
        raise EvalError(
            f"stop={cfg.stop!r}: use gamma (the gamma controller), disco, goodput (SmartSpec) "
            "or confidence (a DSpark draft's confidence head)"
        )
    if not 0 <= cfg.confidence_threshold <= 1:
        raise EvalError(f"confidence_threshold={cfg.confidence_threshold}: must be in [0, 1]")
    if wants_batch(cfg):
        check_batch_keys(cfg)
    if cfg.engine_threads is not None and cfg.engine_threads < 1:
        raise EvalError(
            f"engine_threads={cfg.engine_threads}: must be >= 1 (unset: OMP_NUM_THREADS, else "
            "every core)"
        )


def check_batch_keys(cfg: DictConfig) -> None:
    """The serving regime's settings (batch sizes, policies, repeats, admission, request
    lengths and rates), checked before anything loads: a bad one used to be found only after
    the model, the warm-up and the batch-1 reference had run."""
    try:
        sizes = batch_sizes_of(cfg)
        policies_of(cfg)
        request_rates_of(cfg)
        request_budgets(cfg, 0)
    except BatchError as e:
        raise EvalError(str(e)) from None
    if cfg.batch_repeats < 1:
        raise EvalError(f"batch_repeats={cfg.batch_repeats}: must be >= 1")
    if cfg.batch_admit < 1:
        raise EvalError(f"batch_admit={cfg.batch_admit}: a number of free slots, >= 1")
    for b in sizes:
        if cfg.batch_admit > b:
            where = f"batch_sizes={sizes}" if cfg.batch_sizes else f"batch_size={b}"
            raise EvalError(
                f"batch_admit={cfg.batch_admit}: larger than the batch of {b} ({where})"
            )


def context_of(target) -> int | None:
    """The target's context in tokens (``max_position_embeddings``), or None where its config
    names none."""
    config = target.config
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    n = getattr(text, "max_position_embeddings", None) or getattr(
        config, "max_position_embeddings", None
    )
    return int(n) if n else None


def check_context(cfg: DictConfig, target, questions: list[dict[str, Any]]) -> None:
    """``EvalError`` naming the question where its prompt (with ``turns`` > 1, its user turns
    and room for an answer of ``max_new_tokens`` to each before the last) and the
    ``max_new_tokens`` it may generate do not fit in the target's context: decoding past it
    would measure a model outside the positions it was trained for, in silence."""
    from data.chat import prompt_ids

    ctx = context_of(target)
    if ctx is None:
        return
    tok = target.tokenizer
    for q in questions:
        turns = q["turns"][: cfg.turns]
        msgs: list[dict[str, str]] = []
        for i, t in enumerate(turns):
            if i:
                msgs.append({"role": "assistant", "content": ""})
            msgs.append({"role": "user", "content": t})
        n = len(prompt_ids(tok, msgs)) + len(turns) * cfg.max_new_tokens
        if n > ctx:
            what = "its prompt" if len(turns) == 1 else f"its {len(turns)} turns"
            raise EvalError(
                f"bench={cfg.bench}: question {q['question_id']!r} needs {n} tokens ({what} "
                f"and max_new_tokens={cfg.max_new_tokens} per turn), past the target's context "
                f"of {ctx} tokens; lower max_new_tokens (or turns), or leave the question out"
            )


def apply_saved_target(cfg: DictConfig, given: set[str]) -> str | None:
    """Where the command line names no target (``target=`` or ``target.*``) and ``draft=`` is
    a trained draft (a run, its final/, a checkpoint or a shipped name) or an export by
    specdraft, saved for another target than the default, evaluate against the target it was
    trained (or, with its own merged base, exported) for; returns a line saying so, or None. A
    target whose folder is not there any more is one line naming it."""
    from omegaconf import OmegaConf

    from models.base import DraftError, read_draft_config, resolve_draft_dir
    from models.shipped import shipped_draft
    from models.target import TargetError, looks_like_a_path, saved_target_config

    if any(k == "target" or k.startswith("target.") for k in given):
        return None
    d = str(cfg.draft)
    p = shipped_draft(d) or Path(d).expanduser()
    try:
        draft_dir = resolve_draft_dir(p) if p.is_dir() else None
    except DraftError:
        return None  # said in one line when the draft is loaded
    if draft_dir is not None:
        saved = read_draft_config(draft_dir).get("target") or {}
    else:  # an export by specdraft records its target in its README
        from models.export import exported_target

        saved = (exported_target(p) if p.is_dir() else None) or {}
        if not saved.get("name"):
            return None  # nothing says which target (a third-party checkpoint, an HF model)
        if saved.get("path") and not Path(saved["path"]).is_absolute():
            saved = {**saved, "path": str(p.resolve() / saved["path"])}  # its own base/
        draft_dir = p
    want = saved_target_config(saved)
    now = OmegaConf.to_object(cfg.target)
    fields = ("name", "path", "seed", "tiny_layers", "tiny_head_dim", "family")
    if all(getattr(want, k) == getattr(now, k) for k in fields):
        return None
    if want.path and looks_like_a_path(want.path) and not Path(want.path).expanduser().exists():
        raise TargetError(
            f"draft={d}: trained for target.path={want.path}, which is not there any more; pass "
            "target=hf target.path=<where it is now>"
        )
    for k in fields:
        cfg.target[k] = getattr(want, k)
    return (
        f"target: {want.path or saved.get('identity') or want.name}, the target {draft_dir} was "
        "made for (target=... to choose another)"
    )
