"""Training throughput: tokens/s and achieved model FLOP/s against the machine's matmul rate.

    python scripts/bench_train_throughput.py --method eagle3 --steps 30 --records 300 \
        --modes "fp32-online:train.mixed_precision=no target.dtype=float32" \
                "bf16-online:" "bf16-cached:data.cache_features=true" [hydra overrides...]

Each mode is ``name:overrides`` (space-separated Hydra overrides on top of the shared ones) and
is one short training run of ``--method`` on the embedded target and ShareGPT (or
``data.path=...``). A run's tokens/s is the mean over its logged windows after the first (which
holds warm-up); the feature cache, when a mode uses it, is built before the timed steps and its
build time is reported apart. Model FLOPs per token are counted, not estimated: one training
step (forward + backward of the draft, plus the target's forward when features are computed
online) runs under ``torch.utils.flop_counter.FlopCounterMode`` on a batch of the run's own
data. The matmul rate is measured here too (GEMMs of the target's shapes in fp32 and bf16), so
"% of matmul peak" says how far the whole step is from what the machine's matrix units allow.
"""

from __future__ import annotations

import argparse
import json
import platform
import shlex
import subprocess
import sys
import tempfile
import time
from datetime import date
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from hydra import compose, initialize_config_dir  # noqa: E402
from omegaconf import OmegaConf  # noqa: E402

import trainer.train as tt  # noqa: E402

CONF = Path(__file__).resolve().parents[1] / "conf"


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
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    tps = [r["tokens_per_s"] for r in rows if "tokens_per_s" in r][1:]
    return {"tokens_per_s": sum(tps) / max(1, len(tps)), "wall": wall, "summary": summary}


def flops_per_token(overrides: list[str]) -> tuple[float, float, float]:
    """(draft FLOPs/token for forward + backward, target forward FLOPs/token when features are
    computed online, else 0, mean tokens per batch), counted on the run's first batch."""
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
    return draft / tokens, target_f / tokens, tokens / len(batches)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--method", default="eagle3")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--records", type=int, default=300)
    ap.add_argument("--modes", nargs="+", default=["bf16-online:"])
    ap.add_argument("--one", help=argparse.SUPPRESS)
    ap.add_argument("--result", help=argparse.SUPPRESS)
    ap.add_argument("--tmp", help=argparse.SUPPRESS)
    args, extra = ap.parse_known_args()
    tmp = Path(args.tmp) if args.tmp else Path(tempfile.mkdtemp(prefix="bench-train-"))
    base = [
        f"method={args.method}",
        f"data.max_records={args.records}",
        "data.max_length=512",
        "data.batch_size=4",
        f"train.max_steps={args.steps}",
        "train.log_every=5",
        "train.eval_every=0",
        "train.save_every=0",
        "train.progress=false",
        "data.max_val_records=8",
        f"data.cache_dir={tmp / 'cache'}",
        *extra,
    ]
    H = 576
    tmp.mkdir(parents=True, exist_ok=True)
    peak_file = tmp / "peak.json"
    if peak_file.exists():
        peak = json.loads(peak_file.read_text())
    else:  # measured once, before any training run
        peak = {"fp32": matmul_rate(torch.float32, H), "bf16": matmul_rate(torch.bfloat16, H)}
        peak_file.write_text(json.dumps(peak))
    if args.one:  # one mode in this process (accelerate's precision is fixed per process)
        name, _, ov = args.one.partition(":")
        r = measure(name, ov, base + shlex.split(ov) + [f"output_dir={tmp / name}"], tmp, peak)
        Path(args.result).write_text(json.dumps(r))
        return
    results = []
    for spec in args.modes:
        res = tmp / f"{spec.partition(':')[0]}.json"
        cmd = [sys.executable, __file__, "--one", spec, "--result", str(res), "--tmp", str(tmp)]
        cmd += ["--method", args.method, "--steps", str(args.steps), "--records", str(args.records)]
        subprocess.run(cmd + extra, check=True)
        results.append(json.loads(res.read_text()))
    _table(args, peak, results, H)
    (tmp / "results.json").write_text(json.dumps(results, indent=1))
    print(f"results: {tmp / 'results.json'}")


def measure(name: str, ov: str, overrides: list[str], tmp: Path, peak: dict) -> dict:
    """One mode: its tokens/s (cache built first, untimed), FLOPs per token and rates."""
    cached = "data.cache_features=true" in overrides
    if cached:  # build the cache first: its cost is reported apart from the timed run
        t = time.perf_counter()
        warm = overrides[:-1] + [f"output_dir={tmp / (name + '-build')}", "train.max_steps=1"]
        run_mode(warm)
        build = time.perf_counter() - t
    r = run_mode(overrides)
    draft_f, target_f, tok_batch = flops_per_token(overrides)
    model_f = draft_f + (0.0 if cached else target_f)
    bf16 = "float32" not in ov and "mixed_precision=no" not in ov
    achieved = model_f * r["tokens_per_s"] / 1e9
    return {
        "mode": name,
        "overrides": ov,
        "tokens_per_s": r["tokens_per_s"],
        "draft_gflop_per_token": draft_f / 1e9,
        "target_gflop_per_token": 0.0 if cached else target_f / 1e9,
        "achieved_gflops": achieved,
        "peak": peak["bf16" if bf16 else "fp32"],
        "cache_build_s": build if cached else None,
        "tokens_per_batch": tok_batch,
    }


def _table(args, peak: dict, results: list[dict], H: int) -> None:
    print(
        f"\n{date.today()}, {platform.machine()}, {torch.get_num_threads()} torch threads, "
        f"torch {torch.__version__}; method {args.method}, {args.steps} steps, batch 4, "
        f"max_length 512, {args.records} ShareGPT records"
    )
    print(
        f"measured matmul rate ((2048 x {H}) @ ({H} x {4 * H})): fp32 {peak['fp32']:.0f} "
        f"GFLOP/s, bf16 {peak['bf16']:.0f} GFLOP/s"
    )
    print(
        "| mode | tokens/s | draft GFLOP/token (fwd+bwd) | target GFLOP/token | model GFLOP/s "
        "| % of matmul rate | cache build |"
    )
    print("|---|---|---|---|---|---|---|")
    for r in results:
        build = f"{r['cache_build_s']:.0f} s" if r["cache_build_s"] else "-"
        print(
            f"| {r['mode']} | {r['tokens_per_s']:.0f} | {r['draft_gflop_per_token']:.3f} | "
            f"{r['target_gflop_per_token']:.3f} | {r['achieved_gflops']:.0f} | "
            f"{100 * r['achieved_gflops'] / r['peak']:.0f}% | {build} |"
        )


if __name__ == "__main__":
    main()
