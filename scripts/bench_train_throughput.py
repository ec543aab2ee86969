"""Training throughput: tokens/s and achieved model FLOP/s against the machine's matmul rate.

    python scripts/bench_train_throughput.py --method eagle3 --steps 30 --records 300 \
        --modes "fp32-online:train.mixed_precision=no target.dtype=float32" \
                "bf16-online:" "bf16-cached:data.cache_features=true" [hydra overrides...]

Each mode is ``name:overrides`` (space-separated Hydra overrides on top of the shared ones) and
is one short training run of ``--method`` on the embedded target and ShareGPT (or
``data.path=...``). A word with ``=`` before any ``:`` (``target=tiny_random``,
``data.path=/a:b``) is a Hydra override shared by every mode, wherever it stands on the line,
after ``--modes`` too. A run's tokens/s is the mean over its logged windows after the first
(which holds warm-up), so a mode needs at least 2 windows: ``--steps`` >= 2 x
``train.log_every`` (5 here), and data for that many steps (one epoch ends a run); a mode that
logs fewer is refused in one line. The feature cache, when a mode uses it, is built before the
timed steps and its build time is reported apart. Model FLOPs per token are counted, not
estimated: one training step (forward + backward of the draft, plus the target's forward when
features are computed online) runs under ``torch.utils.flop_counter.FlopCounterMode`` on a batch
of the run's own data. The matmul rate is measured here too (GEMMs of the shapes of the target
the run trained against, its own hidden size, in fp32 and bf16; once per hidden size), so
"% of matmul peak" says how far the whole step is from what the machine's matrix units allow.
"""

from __future__ import annotations

import argparse
import json
import shlex
import subprocess
import sys
import tempfile
import time
from datetime import date
from pathlib import Path
from typing import NoReturn

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from hydra import compose, initialize_config_dir  # noqa: E402
from omegaconf import OmegaConf  # noqa: E402

import trainer.train as tt  # noqa: E402

CONF = Path(__file__).resolve().parents[1] / "conf"
#: the shared training settings' log interval: tokens/s needs 2 windows of it
LOG_EVERY = 5


class BenchError(ValueError):
    """A mode that cannot be measured; the message says why and what to change."""


def fail(msg: str) -> NoReturn:
    """The project's refusal: one line on stderr, exit status 2."""
    print(f"error: {msg}", file=sys.stderr)
    sys.exit(2)


def matmul_rate(dtype: torch.dtype, h: int, rows: int = 2048, reps: int = 10) -> float:
    """GFLOP/s of (rows x h) @ (h x 4h) in ``dtype``: the shape of a transformer MLP."""
    a = torch.randn(rows, h, dtype=dtype)
    w = torch.randn(4 * h, h, dtype=dtype)
    for _ in range(3):
        torch.nn.functional.linear(a, w)
    t = time.perf_counter()
    for _ in range(reps):
        torch.nn.functional.linear(a, w)
    return 2 * rows * h * 4 * h * reps / (time.perf_counter() - t) / 1e9


def compose_cfg(overrides: list[str]):
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        return compose("train", overrides=overrides)


def run_mode(overrides: list[str]) -> dict:
    cfg = compose_cfg(overrides)
    t = time.perf_counter()
    summary = tt.run(cfg)
    wall = time.perf_counter() - t
    out = Path(cfg.output_dir)
    metrics = out / "metrics.jsonl"
    rows = [json.loads(x) for x in metrics.read_text().splitlines()] if metrics.exists() else []
    windows = [r["tokens_per_s"] for r in rows if "tokens_per_s" in r]
    k = cfg.train.log_every
    if len(windows) < 2:
        raise BenchError(
            f"the run stopped at step {summary['step']} ({summary['reason']}), logging "
            f"{len(windows)} window(s) at train.log_every={k}; tokens/s needs >= 2 (the first "
            f"holds warm-up): >= {2 * k} steps, and data for them (--records: one epoch ends "
            "the run)"
        )
    tps = windows[1:]
    return {"tokens_per_s": sum(tps) / len(tps), "wall": wall, "summary": summary}


def flops_per_token(overrides: list[str]) -> tuple[float, float, float, int]:
    """(draft FLOPs/token for forward + backward, target forward FLOPs/token when features are
    computed online, else 0, mean tokens per batch, the target's hidden size), counted on the
    run's first batch."""
    from accelerate.utils import set_seed
    from torch.utils.flop_counter import FlopCounterMode

    from data.dataset import Collator, IndexedDataset, LengthGroupedBatches, prepare_tokenized
    from models import METHODS
    from models.target import load_target
    from trainer.loop import attach_features

    cfg = compose_cfg(overrides)
    set_seed(cfg.train.seed)
    tcfg = OmegaConf.to_object(cfg.target)
    target = load_target(tcfg)
    data = prepare_tokenized(
        tt.data_path(cfg.data),
        target.tokenizer,
        max_length=cfg.data.max_length,
        val_fraction=cfg.data.val_fraction,
        max_val_records=cfg.data.max_val_records,
        max_records=cfg.data.max_records,
        seed=cfg.train.seed,
        cache_root=cfg.data.cache_dir,
        log=lambda *a: None,
    )
    method = METHODS[cfg.method.name](target, OmegaConf.to_object(cfg.method))
    if hasattr(method, "init_from_data"):
        method.init_from_data(data.train, lambda *a: None)
    sampler = LengthGroupedBatches(list(data.train["length"]), cfg.data.batch_size, 0)
    batches = sampler.batches()[:3]
    ds, collate = IndexedDataset(data.train), Collator(target.pad_token_id)
    draft = target_f = tokens = 0.0
    mp = tt._mixed_precision(cfg.train.mixed_precision, target.device) == "bf16"
    for idx in batches:
        batch = collate([ds[i] for i in idx])
        tokens += int(batch["attention_mask"].sum())
        with FlopCounterMode(display=False) as fc:
            batch = attach_features(batch, method, target)
        target_f += fc.get_total_flops()
        with FlopCounterMode(display=False) as fc:
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=mp):
                out = method(batch)
            out.loss.backward()
        draft += fc.get_total_flops()
    return draft / tokens, target_f / tokens, tokens / len(batches), target.hidden_size


def split_modes(words: list[str]) -> tuple[list[tuple[str, str]], list[str]]:
    """``--modes``' words as (name, overrides) modes and the Hydra overrides among them: a word
    with ``=`` before any ``:`` is an override (``target=tiny_random``, ``data.path=/a:b``),
    so that overrides after ``--modes``, as the usage shows them, are not taken for modes."""
    modes, overrides = [], []
    for w in words:
        name, _, ov = w.partition(":")
        if "=" in name:
            overrides.append(w)
        else:
            modes.append((name, ov))
    return modes, overrides


def check_modes(modes: list[tuple[str, str]], base: list[str], tmp: Path) -> None:
    """Every mode's command line composed and checked before anything runs (as specdraft-train
    checks its own), and refused in one line where it cannot give a tokens/s."""
    from conf.cli import check_command_line
    from flow.app import check_group_choices

    if not modes:
        fail("--modes: no mode given (a mode is name:overrides, e.g. bf16-online:)")
    names = [n for n, _ in modes]
    for name, ov in modes:
        if not name or name in (".", "..") or "/" in name or name.startswith("-"):
            fail(f"--modes {name}:{ov}: a mode needs a name (name:overrides, e.g. bf16-online:)")
        if names.count(name) > 1:
            fail(f"--modes: mode {name} given twice")
        try:
            ovs = base + shlex.split(ov) + [f"output_dir={tmp / name}"]
        except ValueError as e:
            fail(f"--modes {name}:{ov}: {e}")
        msg = check_group_choices(ovs) or check_command_line("train", ovs)
        if msg:
            fail(f"mode {name}: {msg}")
        cfg = compose_cfg(ovs)
        try:
            tt.check_config(cfg)
        except tt.ConfigError as e:
            fail(f"mode {name}: {e}")
        steps, k = cfg.train.max_steps, cfg.train.log_every
        if steps < 2 * k:
            fail(
                f"mode {name}: {steps} steps at train.log_every={k} log {steps // k} window(s); "
                f"tokens/s needs >= 2 (the first holds warm-up): --steps >= {2 * k}"
            )


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        epilog="Words with '=' before any ':' are Hydra overrides shared by every mode, also "
        "after --modes.",
    )
    ap.add_argument("--method", default="eagle3")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--records", type=int, default=300)
    ap.add_argument(
        "--modes", nargs="+", default=["bf16-online:"], help="name:overrides (one run each)"
    )
    ap.add_argument("--one", help=argparse.SUPPRESS)
    ap.add_argument("--result", help=argparse.SUPPRESS)
    ap.add_argument("--tmp", help=argparse.SUPPRESS)
    args, extra = ap.parse_known_args()
    from conf.cli import home_expanded

    modes, shared = split_modes(args.modes)
    extra = home_expanded(extra + shared)
    flags = [a for a in extra if a.startswith("-")]
    if flags:
        fail(f"{flags[0]}: no such option (see --help)")
    if args.steps < 1:
        fail(f"--steps {args.steps}: must be >= 1")
    if args.records < 1:
        fail(f"--records {args.records}: must be >= 1")
    tmp = Path(args.tmp) if args.tmp else Path(tempfile.mkdtemp(prefix="bench-train-"))
    base = [
        f"method={args.method}",
        f"data.max_records={args.records}",
        "data.max_length=512",
        "data.batch_size=4",
        f"train.max_steps={args.steps}",
        f"train.log_every={LOG_EVERY}",
        "train.eval_every=0",
        "train.save_every=0",
        "train.progress=false",
        "data.max_val_records=8",
        f"data.cache_dir={tmp / 'cache'}",
        *extra,
    ]
    tmp.mkdir(parents=True, exist_ok=True)
    if args.one:  # one mode in this process (accelerate's precision is fixed per process)
        name, _, ov = args.one.partition(":")
        try:
            r = measure(name, ov, base + shlex.split(ov) + [f"output_dir={tmp / name}"], tmp)
        except (BenchError, tt.ConfigError, *tt.USER_ERRORS) as e:
            fail(f"mode {name}: {e}")
        Path(args.result).write_text(json.dumps(r))
        return
    try:
        check_modes(modes, base, tmp)
    except SystemExit:
        if not args.tmp:  # refused before anything ran: no empty folder left behind
            tmp.rmdir()
        raise
    results = []
    for name, ov in modes:
        res = tmp / f"{name}.json"
        cmd = [sys.executable, __file__, "--one", f"{name}:{ov}", "--result", str(res)]
        cmd += ["--tmp", str(tmp), "--method", args.method]
        cmd += ["--steps", str(args.steps), "--records", str(args.records)]
        rc = subprocess.run(cmd + extra).returncode
        if rc != 0:  # the mode said why on stderr; the modes done are kept
            if results:
                (tmp / "results.json").write_text(json.dumps(results, indent=1))
                print(f"results of the {len(results)} mode(s) done: {tmp / 'results.json'}")
            sys.exit(rc)
        results.append(json.loads(res.read_text()))
    _table(args, results, extra, base)
    (tmp / "results.json").write_text(json.dumps(results, indent=1))
    print(f"results: {tmp / 'results.json'}")


def matmul_peak(tmp: Path, h: int) -> dict:
    """The machine's matmul rate at hidden size ``h`` (fp32 and bf16), measured once per size
    and kept in ``tmp/peak.json`` for the other modes."""
    f = tmp / "peak.json"
    peaks = json.loads(f.read_text()) if f.exists() else {}
    if str(h) not in peaks:
        peaks[str(h)] = {
            "fp32": matmul_rate(torch.float32, h),
            "bf16": matmul_rate(torch.bfloat16, h),
        }
        f.write_text(json.dumps(peaks))
    return peaks[str(h)]


def measure(name: str, ov: str, overrides: list[str], tmp: Path) -> dict:
    """One mode: its tokens/s (cache built first, untimed), FLOPs per token and rates."""
    cached = "data.cache_features=true" in overrides
    if cached:  # build the cache first: its cost is reported apart from the timed run
        t = time.perf_counter()
        warm = overrides[:-1] + [f"output_dir={tmp / (name + '-build')}", "train.max_steps=1"]
        run_mode(warm)
        build = time.perf_counter() - t
    r = run_mode(overrides)
    draft_f, target_f, tok_batch, hidden = flops_per_token(overrides)
    peak = matmul_peak(tmp, hidden)  # the shapes of the target this run trained against
    model_f = draft_f + (0.0 if cached else target_f)
    bf16 = "float32" not in ov and "mixed_precision=no" not in ov
    achieved = model_f * r["tokens_per_s"] / 1e9
    return {
        "mode": name,
        "overrides": ov,
        "steps": r["summary"]["step"],
        "tokens_per_s": r["tokens_per_s"],
        "draft_gflop_per_token": draft_f / 1e9,
        "target_gflop_per_token": 0.0 if cached else target_f / 1e9,
        "achieved_gflops": achieved,
        "hidden_size": hidden,
        "matmul_rate": peak,
        "peak": peak["bf16" if bf16 else "fp32"],
        "cache_build_s": build if cached else None,
        "tokens_per_batch": tok_batch,
    }


def _table(args, results: list[dict], extra: list[str], base: list[str]) -> None:
    """The results as a markdown table, headed by the date, the machine and the settings every
    mode shares (``base``: read as the trainer reads them)."""
    from decoding.engines.base import cpu_name

    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    data = compose_cfg(base).data
    batch, length = data.batch_size, data.max_length
    print(
        f"\n{date.today()}, {gpu or cpu_name()}, {torch.get_num_threads()} torch threads, "
        f"torch {torch.__version__}; method {args.method}, --steps {args.steps}, batch {batch}, "
        f"max_length {length}, {args.records} "
        + ("records" if any(a.startswith("data.path=") for a in extra) else "ShareGPT records")
        + (f"; overrides: {' '.join(extra)}" if extra else "")
    )
    for h in sorted({r["hidden_size"] for r in results}):
        peak = next(r["matmul_rate"] for r in results if r["hidden_size"] == h)
        print(
            f"measured matmul rate ((2048 x {h}) @ ({h} x {4 * h})): fp32 {peak['fp32']:.0f} "
            f"GFLOP/s, bf16 {peak['bf16']:.0f} GFLOP/s"
        )
    print(
        "| mode | steps run | tokens/s | draft GFLOP/token (fwd+bwd) | target GFLOP/token "
        "| model GFLOP/s | % of matmul rate | cache build |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for r in results:
        build = f"{r['cache_build_s']:.0f} s" if r["cache_build_s"] else "-"
        print(
            f"| {r['mode']} | {r['steps']} | {r['tokens_per_s']:.0f} | "
            f"{r['draft_gflop_per_token']:.3f} | "
            f"{r['target_gflop_per_token']:.3f} | {r['achieved_gflops']:.0f} | "
            f"{100 * r['achieved_gflops'] / r['peak']:.0f}% | {build} |"
        )


if __name__ == "__main__":
    from decoding.contention import measured

    measured(main)
