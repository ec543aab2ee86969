"""Where metrics go: ``metrics.jsonl`` in the run directory (always), and Weights & Biases when
``logger=wandb``. Only the main process writes."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any


class TrackerError(RuntimeError):
    """The logger could not start (``logger=wandb`` without the package or an account); the
    message says what to do."""


class Tracker:
    def __init__(self, run_dir: str | Path, logger_cfg: Any, config: dict, enabled: bool):
        self.enabled = enabled
        self.path = Path(run_dir) / "metrics.jsonl"
        self.wandb = None
        if not enabled:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if logger_cfg.name == "wandb":
            try:
                import wandb
            except ImportError:
                raise TrackerError(
                    "logger=wandb needs the wandb package: pip install wandb"
                ) from None
            os.environ.setdefault("WANDB_SILENT", "true")
            try:
                self.wandb = wandb.init(
                    project=logger_cfg.project,
                    entity=logger_cfg.entity,
                    name=logger_cfg.run_name,
                    mode=logger_cfg.mode,
                    dir=str(run_dir),
                    config=config,
                    # one W&B run per run directory: a resumed run continues its curves
                    id=wandb_run_id(Path(run_dir)),
                    resume="allow",
                )
            except Exception as e:  # wandb's own errors (no API key, no network, bad entity)
                if not type(e).__module__.startswith("wandb"):
                    raise
                first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
                raise TrackerError(
                    f"logger=wandb logger.mode={logger_cfg.mode}: {first} (logger.mode=offline "
                    "logs without an account or network; `wandb sync` uploads it later)"
                ) from None
        elif logger_cfg.name != "none":
            raise ValueError(f"logger.name={logger_cfg.name!r}: use none or wandb")

    def truncate_after(self, step: int) -> None:
        """Drop rows past ``step`` (written by a run that died after its last checkpoint), so
        a resumed run's log has each step once."""
        if not self.enabled or not self.path.exists():
            return
        keep = []
        for line in self.path.read_text().splitlines():
            try:
                if json.loads(line).get("step", 0) <= step:
                    keep.append(line)
            except json.JSONDecodeError:
                continue  # a line cut short by the crash
        self.path.write_text("".join(x + "\n" for x in keep))

    def log(self, step: int, metrics: dict[str, float]) -> None:
        if not self.enabled:
            return
        row = {"step": step, **{k: _clean(v) for k, v in metrics.items()}}
        with open(self.path, "a") as f:
            f.write(json.dumps(row) + "\n")
        if self.wandb is not None:
            self.wandb.log(metrics, step=step)

    def close(self) -> None:
        if self.wandb is not None:
            self.wandb.finish()
            self.wandb = None


def _clean(v: float) -> float | None:
    return None if isinstance(v, float) and not math.isfinite(v) else v


class SampleLog:
    """``samples-rank{r}.jsonl``: which training samples each optimizer step consumed (one row
    per micro-batch: step, epoch, sample indices), written by every process when
    ``train.record_samples=true``; to audit data order, resume and sharding."""

    def __init__(self, run_dir: str | Path, rank: int, enabled: bool):
        self.enabled = enabled
        self.path = Path(run_dir) / f"samples-rank{rank}.jsonl"
        if enabled:
            self.path.parent.mkdir(parents=True, exist_ok=True)

    def truncate_after(self, step: int) -> None:
        """Drop micro-batches of steps after ``step`` (a crashed run's tail)."""
        if not self.enabled or not self.path.exists():
            return
        keep = []
        for line in self.path.read_text().splitlines():
            try:
                if json.loads(line)["step"] <= step:
                    keep.append(line)
            except (json.JSONDecodeError, KeyError):
                continue
        self.path.write_text("".join(x + "\n" for x in keep))

    def log(self, step: int, epoch: int, index: list[int]) -> None:
        if self.enabled:
            with open(self.path, "a") as f:
                f.write(json.dumps({"step": step, "epoch": epoch, "index": index}) + "\n")


def wandb_run_id(run_dir: Path) -> str:
    """The W&B run id of ``run_dir``: made on its first start and kept in ``wandb_id`` there,
    so that ``resume=true`` logs into the same W&B run rather than a new one."""
    f = run_dir / "wandb_id"
    kept = f.read_text().strip() if f.is_file() else ""
    if kept:
        return kept
    import uuid

    run_id = uuid.uuid4().hex[:12]
    f.write_text(run_id + "\n")
    return run_id
