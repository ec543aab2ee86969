"""Sweep summary: after ``specdraft-train -m ...`` every job has its own folder; this Hydra
callback then writes one table over them, ``summary.csv`` and ``summary.md`` in the sweep
folder: one row per job with its overrides, stop reason, steps, throughput and final validation
metrics, sorted by ``sort_by`` (best first).

It runs on the machine that launched the sweep (``on_multirun_end``), so it works the same with
the basic launcher and with Hydra's joblib or submitit launchers (they only change where the
jobs run; each job writes ``summary.json`` into its own folder).
"""

from __future__ import annotations

import csv
import json
from pathlib import Path
from typing import Any

from hydra.experimental.callback import Callback
from omegaconf import DictConfig, OmegaConf

SUMMARY = "summary.json"  # written by every training run into its output folder


def collect(sweep_dir: Path) -> list[dict[str, Any]]:
    """One row per job folder under ``sweep_dir`` (a job without ``summary.json`` did not
    finish: its row says so; a job refused for its settings says why, under ``error``)."""
    rows = []
    jobs = sorted(
        (p for p in sweep_dir.iterdir() if p.is_dir() and (p / ".hydra").is_dir()),
        key=lambda p: (len(p.name), p.name),
    )
    for job in jobs:
        ov = job / ".hydra" / "overrides.yaml"
        overrides = OmegaConf.to_container(OmegaConf.load(ov)) if ov.exists() else []
        row: dict[str, Any] = {"job": job.name, "overrides": list(overrides)}
        s = job / SUMMARY
        if s.exists():
            summ = json.loads(s.read_text())
            row.update(
                {
                    "reason": summ.get("reason"),
                    "step": summ.get("step"),
                    "tokens_per_s": None
                    if summ.get("tokens_per_s") is None
                    else round(summ["tokens_per_s"], 1),
                }
            )
            row.update({f"val/{k}": v for k, v in sorted((summ.get("val") or {}).items())})
            if summ.get("error"):  # refused before training: what refused it
                row["error"] = summ["error"]
        else:
            row["reason"] = "did not finish"
        rows.append(row)
    return rows


def common_overrides(rows: list[dict[str, Any]]) -> list[str]:
    """The overrides every job shares (none for a single job), in the first job's order."""
    if len(rows) < 2:
        return []
    return [o for o in rows[0]["overrides"] if all(o in r["overrides"] for r in rows[1:])]


def default_sort_key(rows: list[dict[str, Any]]) -> str | None:
    """The metric that best says how good a draft is, among those present: acceptance first."""
    keys = {k for r in rows for k in r}
    for k in ("val/alpha_pos1", "val/accept_T1", "val/top1_head1", "val/top1_pos1"):
        if k in keys:
            return k
    return None


def write_summary(sweep_dir: Path, sort_by: str | None = None) -> Path | None:
    rows = collect(sweep_dir)
    if not rows:
        return None
    key = sort_by or default_sort_key(rows)
    if key:
        rows.sort(key=lambda r: (r.get(key) is None, -(r.get(key) or 0.0)))
    cols: list[str] = []
    for r in rows:
        cols += [c for c in r if c not in cols]
    # the CSV keeps every job's whole line; the table says once what every job shares, and in
    # each row what sets it apart
    common = common_overrides(rows)
    with open(sweep_dir / "summary.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=cols)
        w.writeheader()
        w.writerows({**r, "overrides": " ".join(r["overrides"])} for r in rows)
    for r in rows:
        r["overrides"] = " ".join(o for o in r["overrides"] if o not in common)

    def cell(v):
        return f"{v:.4f}" if isinstance(v, float) else ("" if v is None else str(v))

    lines = [
        f"Sweep {sweep_dir}: {len(rows)} jobs" + (f", sorted by {key} (best first)" if key else ""),
        *([f"Every job: `{' '.join(common)}`"] if common else []),
        "",
        "| " + " | ".join(cols) + " |",
        "|" + "---|" * len(cols),
    ]
    lines += ["| " + " | ".join(cell(r.get(c)) for c in cols) + " |" for r in rows]
    (sweep_dir / "summary.md").write_text("\n".join(lines) + "\n")
    return sweep_dir / "summary.md"


class SweepSummary(Callback):
    """Hydra callback: ``summary.csv`` / ``summary.md`` over a multirun's jobs."""

    def __init__(self, sort_by: str | None = None):
        self.sort_by = sort_by

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        sweep_dir = Path(config.hydra.sweep.dir)
        if not sweep_dir.is_dir():
            return
        path = write_summary(sweep_dir, self.sort_by)
        if path is not None:
            print(f"sweep summary: {path} (and summary.csv)")
