"""Measure a draft right after training (``train.eval_after``): decode a few benchmark prompts
plainly and speculatively with the new draft and with each draft in ``compare`` (the built-in
decoder, ``decoding.eval``), print one row per draft and keep each full report."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from decoding.eval import EvalConfig, apply_saved_decode, evaluate


def measure_after(cfg: DictConfig, final: Path, run_dir: Path, log=print) -> list[dict[str, Any]]:
    """One row per draft (``final`` first, as "this run"); each full report goes to
    ``run_dir/eval-<k>.json``."""
    ea = cfg.train.eval_after
    rows = []
    for k, draft in enumerate([str(final), *ea.compare]):
        ecfg = OmegaConf.structured(
            EvalConfig(
                target=OmegaConf.to_object(cfg.target),
                draft=draft,
                bench=ea.bench,
                num_prompts=ea.num_prompts,
                max_new_tokens=ea.max_new_tokens,
                temperature=ea.temperature,
                report=str(run_dir / f"eval-{k}.json"),
            )
        )
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
                "report": ecfg.report,
            }
        )
    log(table(rows, ea))
    return rows


def table(rows: list[dict[str, Any]], ea) -> str:
    def f(x):
        return "-" if x is None else f"{x:.2f}"

    lines = [
        f"\nspeculative decoding of {ea.num_prompts} {ea.bench} prompts, {ea.max_new_tokens} new "
        f"tokens, T={ea.temperature:g} (tau: tokens per target forward; speedup: tokens/s over "
        "plain decoding on this machine):",
        f"  {'draft':<28}{'tau':>6}{'alpha':>7}{'speedup':>9}  lossless",
    ]
    for r in rows:
        lines.append(
            f"  {r['draft']:<28}{f(r['tau']):>6}{f(r['alpha']):>7}{f(r['speedup']):>9}  "
            f"{r['lossless']}"
        )
    return "\n".join(lines)
