"""Sweep summary: after ``specdraft-train -m ...`` (or ``specdraft-eval -m ...``) every job has
its own folder; this Hydra callback then writes one table over them, ``summary.csv`` and
``summary.md`` in the sweep folder: one row per job with its overrides, stop reason, steps,
throughput and final validation metrics (an evaluation's: tau, alpha, speedup), sorted by
``sort_by`` (best first).

It runs on the machine that launched the sweep (``on_multirun_end``), so it works the same with
the basic launcher and with Hydra's joblib or submitit launchers (they only change where the
jobs run; each job writes ``summary.json`` into its own folder).

A sweep run again into the same folder tabulates its own jobs only: a job folder it neither ran
nor refused (a job of an earlier sweep there) has no row, and the summary names it. A job it
refused because its folder holds an earlier run (nothing is written there) has its row from a
note in the sweep folder, ``refused-<job>.json``: the earlier run's results, marked so, where
that run had this job's settings; else ``refused``, with this job's settings.
"""

from __future__ import annotations

import csv
import json
import math
import os
from pathlib import Path
from typing import Any

from hydra.experimental.callback import Callback
from omegaconf import DictConfig, OmegaConf

SUMMARY = "summary.json"  # written by every training run into its output folder
#: written when a sweep starts: a job folder whose record is older is an earlier sweep's
STARTED = ".started"
#: a job this sweep refused for a folder that holds an earlier run: its row, in the sweep folder
REFUSED_NOTE = "refused-{job}.json"


def sweep_job(
    cfg: DictConfig, files: tuple[str, ...] = ("report", "plot", "traces")
) -> Path | None:
    """Under ``-m``, the job's folder (sweep folder / job number) for a command whose outputs
    are files named by settings (``specdraft-eval``'s report, plot and traces): each of
    ``files`` that is set is moved into it under its own name (else each job would write over
    the one before), and the job's overrides are recorded there for the summary. None for a
    single run."""
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    hc = HydraConfig.get()
    if hc.mode != RunMode.MULTIRUN:
        return None
    job = Path(hc.runtime.output_dir)
    for key in files:
        if cfg.get(key):
            cfg[key] = str(job / Path(str(cfg[key])).name)
    (job / ".hydra").mkdir(parents=True, exist_ok=True)
    OmegaConf.save(OmegaConf.create(list(hc.overrides.task)), job / ".hydra" / "overrides.yaml")
    return job


def refused_line(jobs: list[str]) -> str:
    """What a sweep says at its end of the jobs it refused for their settings or inputs."""
    return (
        f"error: {len(jobs)} job(s) of the sweep were refused (see each one's error above, and "
        "the summary): " + ", ".join(jobs)
    )


def _written(path: Path) -> float:
    """When ``path`` was last written (-inf where it is not there)."""
    try:
        return path.stat().st_mtime
    except OSError:
        return -math.inf


def refused_notes(sweep_dir: Path) -> dict[str, Path]:
    """The refusal notes in ``sweep_dir``, by job folder name."""
    pre, post = REFUSED_NOTE.split("{job}")
    return {p.name[len(pre) : -len(post)]: p for p in sweep_dir.glob(f"{pre}*{post}")}


def job_folders(sweep_dir: Path) -> list[Path]:
    """The job folders under ``sweep_dir`` (those with a ``.hydra`` record), in job order."""
    return sorted(
        (p for p in sweep_dir.iterdir() if p.is_dir() and (p / ".hydra").is_dir()),
        key=lambda p: (len(p.name), p.name),
    )


def this_sweeps(job: Path, since: float | None, notes: dict[str, Path]) -> bool:
    """Whether the sweep that started at ``since`` (None: any sweep) ran or refused ``job``."""
    if since is None or job.name in notes:
        return True
    return _written(job / ".hydra" / "overrides.yaml") >= since


def collect(sweep_dir: Path, since: float | None = None) -> list[dict[str, Any]]:
    """One row per job folder under ``sweep_dir`` (a job without ``summary.json`` did not
    finish: its row says so; a job refused for its settings says why, under ``error``).
    ``since``: the time the sweep started (the mtime of its ``.started``): only its own jobs,
    a refused one from its note."""
    rows = []
    notes = refused_notes(sweep_dir) if since is not None else {}
    for job in job_folders(sweep_dir):
        if not this_sweeps(job, since, notes):
            continue
        ov = job / ".hydra" / "overrides.yaml"
        overrides = OmegaConf.to_container(OmegaConf.load(ov)) if ov.exists() else []
        row: dict[str, Any] = {"job": job.name, "overrides": list(overrides)}
        earlier = False
        if job.name in notes:  # the folder holds an earlier run: this sweep's job was refused
            note = json.loads(notes[job.name].read_text())
            if list(note.get("overrides") or []) != row["overrides"]:
                # another job's results there: they must not stand under this job's settings
                rows.append(
                    {
                        "job": job.name,
                        "overrides": list(note.get("overrides") or []),
                        "reason": "refused",
                        "error": note.get("error"),
                    }
                )
                continue
            earlier = True  # the same job, run before: its results, marked as such
        s = job / SUMMARY
        if s.exists():
            summ = json.loads(s.read_text())
            row["reason"] = summ.get("reason")
            if "metrics" not in summ:  # a training run's (an evaluation has neither)
                row["step"] = summ.get("step")
                tps = summ.get("tokens_per_s")
                row["tokens_per_s"] = None if tps is None else round(tps, 1)
            if summ.get("other_load"):  # tokens/s beside other work is not the machine's own
                row["others_busy_cores"] = summ["other_load"].get("others_busy_cores")
            row.update({f"val/{k}": v for k, v in sorted((summ.get("val") or {}).items())})
            row.update(summ.get("metrics") or {})  # specdraft-eval's: tau, alpha, speedup...
            if summ.get("error"):  # refused before training: what refused it
                row["error"] = summ["error"]
        else:
            row["reason"] = "did not finish"
        if earlier:
            row["reason"] = f"{row['reason']} (an earlier run, kept)"
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
    for k in ("val/alpha_pos1", "val/accept_T1", "val/top1_head1", "val/top1_pos1", "speedup"):
        if k in keys:
            return k
    return None


def sort_rows(rows: list[dict[str, Any]], key: str) -> str:
    """Sort ``rows`` by ``key`` in place, best first: a number high to low (a loss low to
    high), text in order; rows without it last. Returns how the table says it was sorted."""
    present = [r[key] for r in rows if r.get(key) is not None]
    if all(isinstance(v, int | float) and not isinstance(v, bool) for v in present):
        low = "loss" in key.rsplit("/", 1)[-1]  # val/loss...: lower is better
        rows.sort(key=lambda r: (r.get(key) is None, (1 if low else -1) * (r.get(key) or 0.0)))
        return f"sorted by {key} ({'lowest' if low else 'highest'} first)"
    rows.sort(key=lambda r: (r.get(key) is None, str(r.get(key))))
    return f"sorted by {key}"


def write_summary(
    sweep_dir: Path, sort_by: str | None = None, since: float | None = None
) -> Path | None:
    """``summary.csv`` and ``summary.md`` over the jobs of the sweep that started at ``since``
    (None: every job folder in ``sweep_dir``); None where there is none."""
    rows = collect(sweep_dir, since)
    names = {r["job"] for r in rows}
    earlier = [p.name for p in job_folders(sweep_dir) if p.name not in names]
    if not rows and not earlier:
        return None
    cols: list[str] = []
    for r in rows:
        cols += [c for c in r if c not in cols]
    cols.sort(key=lambda c: c == "error")  # last, whichever row has one first
    key = sort_by or default_sort_key(rows)
    order = ""
    if key and key not in cols:  # a misspelled sort_by would sort nothing under its name
        order = f", not sorted: sort_by={key} names no column (the columns: {', '.join(cols)})"
    elif key:
        order = ", " + sort_rows(rows, key)
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
        text = f"{v:.4f}" if isinstance(v, float) else ("" if v is None else str(v))
        # one line, its own column: a "|" in an error or a path would start another
        return " ".join(text.split("\n")).replace("|", "\\|")

    lines = [
        f"Sweep {sweep_dir}: {len(rows)} jobs{order}",
        *([f"Every job: `{' '.join(common)}`"] if common else []),
        *(
            [
                f"Not in this table: job folder(s) {', '.join(earlier)}, of an earlier sweep "
                "into this folder (each keeps its own summary.json)"
            ]
            if earlier
            else []
        ),
        "",
    ]
    if rows:  # none: no job of this sweep left a record (an earlier one's summary is not kept)
        lines += ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
        lines += ["| " + " | ".join(cell(r.get(c)) for c in cols) + " |" for r in rows]
    (sweep_dir / "summary.md").write_text("\n".join(lines) + "\n")
    return sweep_dir / "summary.md"


def write_stopped_sweep_summary(hydra: DictConfig) -> Path | None:
    """A sweep stopped by a signal ends without Hydra's ``on_multirun_end``: the summary of
    the jobs it ran so far (the stopped one's row says ``signal``), as the callback configured
    in ``hydra.callbacks.sweep_summary`` would write it; None without that callback."""
    cb = (hydra.get("callbacks") or {}).get("sweep_summary")
    sweep_dir = Path(hydra.sweep.dir)
    if cb is None or not sweep_dir.is_dir():
        return None
    started = sweep_dir / STARTED
    return write_summary(
        sweep_dir, cb.get("sort_by"), _written(started) if started.exists() else None
    )


def _other_process() -> bool:
    """A process of a launch other than the main one (whose sweep folder every job uses)."""
    return int(os.environ.get("RANK", "0")) != 0


class SweepSummary(Callback):
    """Hydra callback: ``summary.csv`` / ``summary.md`` over a multirun's jobs (written by the
    main process of a launch of several)."""

    def __init__(self, sort_by: str | None = None):
        self.sort_by = sort_by
        self.started: float | None = None

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        """Mark the sweep's start in its folder (the file's own time, as the jobs' records
        get theirs) and drop an earlier sweep's refusal notes."""
        sweep_dir = Path(config.hydra.sweep.dir)
        if _other_process():
            return
        try:
            sweep_dir.mkdir(parents=True, exist_ok=True)
            for note in refused_notes(sweep_dir).values():
                note.unlink()
            (sweep_dir / STARTED).unlink(missing_ok=True)  # a new file: a new time
            (sweep_dir / STARTED).write_text("")
        except OSError:  # the launcher says why it cannot write there
            return
        self.started = _written(sweep_dir / STARTED)

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        sweep_dir = Path(config.hydra.sweep.dir)
        if _other_process():
            # its jobs ran in the main process's folder (flow/app.py); a folder of this
            # process's own clock holds Hydra's multirun.yaml alone
            if sweep_dir.is_dir() and {p.name for p in sweep_dir.iterdir()} == {"multirun.yaml"}:
                (sweep_dir / "multirun.yaml").unlink()
                sweep_dir.rmdir()
            return
        if not sweep_dir.is_dir():
            return
        path = write_summary(sweep_dir, self.sort_by, self.started)
        if path is not None:
            print(f"sweep summary: {path} (and summary.csv)")
