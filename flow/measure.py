"""Measure a draft right after training (``train.eval_after``): decode a few benchmark prompts
plainly and speculatively with the new draft and with each draft in ``compare`` (the built-in
decoder, ``decoding.eval``), print one row per draft and keep each full report."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from decoding.eval import EvalConfig, apply_saved_decode, evaluate

#: the settings of ``train.eval_after`` that an evaluation's message may name by its own key
_KEYS = ("bench", "num_prompts", "max_new_tokens", "temperature")


def eval_config(cfg: DictConfig, draft: str, report: Path) -> DictConfig:
    """The evaluation ``train.eval_after`` asks for, of ``draft`` on the run's target;
    ``bench=sharegpt_val`` draws the held-out split this run's training drew (its data, split
    fraction, cap and seed)."""
    ea = cfg.train.eval_after
    return OmegaConf.structured(
        EvalConfig(
            target=OmegaConf.to_object(cfg.target),
            draft=draft,
            bench=ea.bench,
            num_prompts=ea.num_prompts,
            max_new_tokens=ea.max_new_tokens,
            temperature=ea.temperature,
            report=str(report),
            data_path=cfg.data.path,
            val_fraction=cfg.data.val_fraction,
            split_seed=cfg.train.seed,
            max_val_records=cfg.data.max_val_records,
            skip_records=cfg.data.skip_records,
        )
    )


def _named(e: Exception) -> str:
    """An evaluation's message with its key as the training command's (``num_prompts=0`` is
    ``train.eval_after.num_prompts=0`` there)."""
    text = str(e)
    return f"train.eval_after.{text}" if text.startswith(tuple(f"{k}=" for k in _KEYS)) else text


def check_eval_after(cfg: DictConfig) -> None:
    """``train.eval_after``'s settings, judged before training (each was an error or a
    traceback after the whole run): its values, its benchmark's prompts, and each draft in
    ``compare`` that names a folder or a shipped draft. Raises ``EvalError`` naming the key."""
    from decoding.bench import BenchError
    from decoding.drafts import NO_MODEL
    from decoding.settings import EvalError, bench_questions, validate
    from models.shipped import SHIPPED, shipped_draft
    from models.target import looks_like_a_path

    ecfg = eval_config(cfg, "none", Path("eval-0.json"))
    try:
        validate(ecfg)
        if ecfg.bench != "sharegpt_val":  # that one reads the training data: its loading says
            bench_questions(ecfg)
    except (EvalError, BenchError) as e:
        raise EvalError(_named(e)) from None
    for d in cfg.train.eval_after.compare:
        d = str(d)
        if d in NO_MODEL or d.startswith("truncate:") or shipped_draft(d) is not None:
            continue
        if d in SHIPPED:
            raise EvalError(f"train.eval_after.compare: {d}: the shipped draft is missing")
        if looks_like_a_path(d) and not Path(d).expanduser().exists():
            raise EvalError(f"train.eval_after.compare: {d}: no such folder")


def measure_after(cfg: DictConfig, final: Path, run_dir: Path, log=print) -> list[dict[str, Any]]:
    """One row per draft (``final`` first, as "this run"); each full report goes to
    ``run_dir/eval-<k>.json``."""
    ea = cfg.train.eval_after
    rows = []
    for k, draft in enumerate([str(final), *ea.compare]):
        ecfg = eval_config(cfg, draft, run_dir / f"eval-{k}.json")
        log(f"\nmeasuring {draft} on {ea.num_prompts} {ea.bench} prompts ...")
        line = apply_saved_decode(ecfg, set())  # a shipped draft at its settings for here
        if line:
            log(line)
        r = evaluate(ecfg)
        Path(ecfg.report).write_text(json.dumps(r, indent=1))
        rows.append(
            {
                "draft": "this run" if k == 0 else draft,
                "tau": r["tau"],
                "alpha": r["alpha"],
                "speedup": r["speedup"],
                "lossless": r["lossless"],
                "drafted": r.get("drafted_share"),
                "adaptive": bool((r.get("decoder") or {}).get("adaptive")),
                "report": ecfg.report,
            }
        )
    log(table(rows, ea))
    return rows


def table(rows: list[dict[str, Any]], ea) -> str:
    def f(x):
        return "-" if x is None else f"{x:.2f}"

    def share(x):
        return None if x is None or math.isnan(x) else x

    lines = [
        f"\nspeculative decoding of {ea.num_prompts} {ea.bench} prompts, {ea.max_new_tokens} new "
        f"tokens, T={ea.temperature:g} (tau: tokens per target forward; speedup: tokens/s over "
        "plain decoding on this machine):",
        f"  {'draft':<28}{'tau':>6}{'alpha':>7}{'drafted':>9}{'speedup':>9}  lossless",
    ]
    shared = [(r, share(r.get("drafted"))) for r in rows]
    for r, d in shared:
        lines.append(
            f"  {r['draft']:<28}{f(r['tau']):>6}{f(r['alpha']):>7}"
            f"{'-' if d is None else f'{d:.0%}':>9}{f(r['speedup']):>9}  {r['lossless']}"
        )
    rare = [r["draft"] for r, d in shared if r.get("adaptive") and d is not None and d < 0.25]
    if rare:
        lines.append(
            f"  ({' and '.join(rare)}: drafted for under a quarter of the target's forwards; the "
            "adaptive controller drafts only where what a head accepts pays for drafting and "
            "verifying on this machine, so tau stays near 1 however well its drafts are "
            "accepted; adaptive=false drafts every step, and docs/results.md gives each machine "
            "kind's figures)"
        )
    return "\n".join(lines)
