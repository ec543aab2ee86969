"""The GPU training recipe (issue 45: ``scripts/gpu_train_pack.py`` here, ``scripts/gpu_train.sh``
on the lent machine, ``scripts/gpu_train_unpack.py`` here again), run end to end on the CPU with
the tiny target: what comes back fits what a device call returns, and makes a draft that loads
and decodes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _run(cmd, env=None, check=True):
    r = subprocess.run(
        cmd, cwd=ROOT, env={**os.environ, **(env or {})}, capture_output=True, text=True
    )
    if check and r.returncode != 0:
        raise AssertionError(f"{cmd} -> {r.returncode}\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}")
    return r


def test_the_gpu_training_recipe_runs_end_to_end_on_the_cpu(tmp_path):
    stash, out = tmp_path / "stash", tmp_path / "out"
    _run([sys.executable, "scripts/gpu_train_pack.py", "--count", "12", "--out", str(stash)])
    slice_ = json.loads((stash / "slice.json").read_text())
    assert (slice_["skip"], slice_["count"], slice_["init"]) == (0, 12, "smollm2-eagle3")
    env = {
        "STASH": str(stash),
        "CARRIED": str(tmp_path / "carried"),  # not this checkout's .gpu parts, if any
        "WORK": str(tmp_path / "work"),
        "DEVICE": "cpu",
        "TARGET": "tiny_random",
        "TARGET_ARGS": "target.tiny_layers=4",
        "INIT": "null",  # the shipped head is the embedded target's, not the tiny one's
        "REGEN_MIN": "0.1",
        "REGEN_T": "1",  # the random target's greedy replies decode to nothing
        "REGEN_BATCH": "4",
        "TRAIN_MIN": "0.1",
        "PROMPTS": "2",
        "TOKENS": "8",
        "EXTRA_TRAIN": "data.batch_size=4 data.num_proc=1 data.max_length=128 "
        "method.draft_vocab_size=64 train.eval_every=0",
    }
    _run(["bash", "scripts/gpu_train.sh", "run", str(out)], env)
    files = sorted(p.name for p in out.iterdir())
    # what a device call brings back: at most 8 files of at most 16 MiB
    assert len(files) <= 8 and all((out / f).stat().st_size <= 16 * 2**20 for f in files)
    assert "draft.tar.part_00" in files and "summary.json" in files
    s = json.loads((out / "summary.json").read_text())
    assert s["method"] == "eagle3" and s["slice"]["count"] == 12
    assert s["regenerated"]["records"] >= 1
    assert s["train"]["tokens"] > 0 and s["train"]["tokens_per_s_median"] > 0
    assert s["train"]["model_flops_per_token"] == (
        2 * s["train"]["target_params"]
        + 6 * s["train"]["head_trainable_params"] * s["train"]["ttt_steps"]
    )
    assert s["mt_bench_chain3_t0"]["lossless"] is True

    runs = tmp_path / "runs"
    r = _run([sys.executable, "scripts/gpu_train_unpack.py", str(out), "--dest", str(runs)])
    final = next(runs.iterdir()) / "final"
    assert "--skip 12 --count 12" in r.stdout
    from models.base import read_draft_config

    assert read_draft_config(final)["specdraft"]["method"] == "eagle3"
    # the learning curve: the shipped head's five CPU phases, then this run, each after the
    # tokens of those before it; plot_curves draws it from the lineage file
    lin = json.loads((final.parent / "lineage.json").read_text())["curves"]
    assert [Path(p).name for p, _ in lin] == [
        *(f"curve_phase{i}.jsonl" for i in range(1, 6)),
        "metrics.jsonl",
    ]
    offsets = [o for _, o in lin]
    assert offsets[0] == 0 and all(a < b for a, b in zip(offsets, offsets[1:], strict=False))
    assert 13e6 < offsets[-1] < 14e6  # the shipped head's ~13.3M CPU training tokens
    png = tmp_path / "curves.png"
    _run(
        [
            sys.executable,
            "scripts/plot_curves.py",
            "--lineage",
            str(final.parent / "lineage.json"),
            "--metric",
            "alpha",
            "--out",
            str(png),
        ]
    )
    assert png.stat().st_size > 10_000


def test_the_recipe_says_what_a_call_did_not_carry(tmp_path):
    """No prompts in the stash: one line naming the part to carry, exit 2, nothing run."""
    out = tmp_path / "out"
    env = {
        "STASH": str(tmp_path / "empty"),
        "CARRIED": str(tmp_path / "carried"),
        "DEVICE": "cpu",
        "TARGET": "tiny_random",
    }
    r = _run(["bash", "scripts/gpu_train.sh", "run", str(out)], env, check=False)
    assert r.returncode == 2
    assert "carry .gpu/t1 (scripts/gpu_train_pack.py)" in r.stderr
    pack = tmp_path / "pack"
    r = _run(
        [sys.executable, "scripts/gpu_train_pack.py", "--init", str(tmp_path), "--out", str(pack)],
        check=False,
    )
    assert r.returncode != 0 and "not a saved draft" in r.stderr
    assert not pack.exists()  # refused before anything was written
