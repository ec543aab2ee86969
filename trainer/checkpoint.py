"""Checkpoints: written to a temporary folder and renamed into place, so a crash or a full disk
mid-write never damages the previous one.

A checkpoint ``<run>/checkpoints/step_N/`` holds accelerate's state (draft weights, optimizer,
scheduler, per-process RNG), ``trainer_state.json`` (step, epoch, data position, elapsed
time), the draft in its standalone format under ``draft/``, and ``COMPLETE`` written last.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path
from typing import Any

STATE_FILE = "trainer_state.json"
COMPLETE = "COMPLETE"
_STEP_RE = re.compile(r"^step_(\d+)$")


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be used; the message names it."""


def checkpoints_dir(run_dir: str | Path) -> Path:
    return Path(run_dir) / "checkpoints"


def list_checkpoints(run_dir: str | Path) -> list[Path]:
    """Completed checkpoints in ``run_dir``, oldest first."""
    d = checkpoints_dir(run_dir)
    if not d.is_dir():
        return []
    found = []
    for p in d.iterdir():
        m = _STEP_RE.match(p.name)
        if m and p.is_dir():
            found.append((int(m.group(1)), p))
    return [p for _, p in sorted(found)]


def validate_checkpoint(path: Path) -> dict:
    """The trainer state of an intact checkpoint; ``CheckpointError`` naming what is wrong."""
    if not path.is_dir():
        raise CheckpointError(f"{path}: no such checkpoint folder")
    if not (path / COMPLETE).exists():
        raise CheckpointError(f"{path}: incomplete checkpoint (no {COMPLETE} marker)")
    try:
        state = json.loads((path / STATE_FILE).read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{path / STATE_FILE}: unreadable ({e})") from None
    expected = json.loads((path / COMPLETE).read_text() or "{}").get("files", {})
    for name, size in expected.items():
        f = path / name
        if not f.exists() or f.stat().st_size != size:
            raise CheckpointError(f"{path}: {name} is missing or truncated")
    return state


def latest_checkpoint(run_dir: str | Path, log=print) -> Path | None:
    """The newest intact checkpoint; damaged ones are named and passed over."""
    for p in reversed(list_checkpoints(run_dir)):
        try:
            validate_checkpoint(p)
            return p
        except CheckpointError as e:
            log(f"warning: skipping damaged checkpoint: {e}")
    return None


def save_checkpoint(
    accelerator: Any, run_dir: str | Path, step: int, state: dict, save_draft, keep: int
) -> Path:
    """Write ``step_N`` atomically on every process's behalf and prune to ``keep`` newest.

    ``save_draft(dir)`` writes the standalone draft (called on the main process only)."""
    root = checkpoints_dir(run_dir)
    final = root / f"step_{step}"
    tmp = root / f".tmp-step_{step}"
    if accelerator.is_main_process:
        root.mkdir(parents=True, exist_ok=True)
        if tmp.exists():
            shutil.rmtree(tmp)
    accelerator.wait_for_everyone()
    try:
        accelerator.save_state(str(tmp))
        accelerator.wait_for_everyone()
        if accelerator.is_main_process:
            save_draft(tmp / "draft")
            (tmp / STATE_FILE).write_text(json.dumps(state, indent=1))
            files = {
                str(f.relative_to(tmp)): f.stat().st_size
                for f in sorted(tmp.rglob("*"))
                if f.is_file()
            }
            _fsync_write(tmp / COMPLETE, json.dumps({"files": files}))
            if final.exists():  # a re-run of the same step (after resume); replace it
                shutil.rmtree(final)
            os.rename(tmp, final)
            for old in list_checkpoints(run_dir)[:-keep] if keep > 0 else []:
                shutil.rmtree(old, ignore_errors=True)
    except OSError as e:  # disk full, permissions, a vanished mount: keep what was there
        shutil.rmtree(tmp, ignore_errors=True)
        prev = list_checkpoints(run_dir)
        raise CheckpointError(
            f"could not write checkpoint {final} ({type(e).__name__}: {e}); "
            + (f"the previous checkpoint {prev[-1]} is intact" if prev else "no earlier one")
            + "; free space and continue with resume=true"
        ) from None
    accelerator.wait_for_everyone()
    return final


def load_checkpoint(accelerator: Any, path: Path) -> dict:
    state = validate_checkpoint(path)
    try:
        accelerator.load_state(str(path))
    except Exception as e:  # torch/safetensors raise many types for damaged files
        raise CheckpointError(f"{path}: cannot restore ({type(e).__name__}: {e})") from None
    return state


def _fsync_write(path: Path, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
