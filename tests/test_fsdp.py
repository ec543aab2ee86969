"""Training under accelerate's FSDP (``scripts/accelerate/fsdp.yaml``), two CPU processes.

accelerate shards a draft with FSDP on GPUs only; ``tests/accelerate_on_cpu.py`` keeps its FSDP on
the CPU, so that the loop meets what it meets on GPUs: parameters that are DTensor shards
between steps, forwards that gather from every process, accelerate's sharded checkpoints."""

from __future__ import annotations

import json
import subprocess

import pytest
from conftest import (
    accelerate_launch,
    copy_stopped_after,
    final_weights,
    launch_with_config,
    read_metrics,
    tiny_overrides,
)
from safetensors.torch import load_file

#: one validation conversation: the second process holds no validation batch
COMMON = {
    "train.max_steps": 4,
    "train.eval_every": 0,
    "train.save_every": 2,
    "data.batch_size": 2,
    "data.max_val_records": 1,
    "train.threads": 1,
    "optim.lr": 1e-3,
}


def _launch(args: list[str]) -> subprocess.CompletedProcess:
    return launch_with_config("fsdp.yaml", args)


def _fsdp(args: list[str]) -> subprocess.CompletedProcess:
    """``_launch`` run to the end, sharded."""
    r = _launch(args)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "processes: 2 (FSDP)" in r.stdout, r.stdout[-2000:]  # sharded, not DDP
    return r


def test_fsdp_trains_checkpoints_and_resumes_as_one_process_does(data_file, tmp_path):
    """Medusa-2 (heads and a LoRA adapter on the target, the config's own example) under FSDP:
    the losses, validation and saved draft of DDP over the same two processes (which matches
    one process: test_robustness.py); its checkpoints hold the draft whole beside accelerate's
    shards, and a run resumed from one ends with the same weights."""
    common = {**COMMON, "method": "medusa2"}
    one = tmp_path / "ddp"
    r = accelerate_launch(2, tiny_overrides(data_file, one, **common))
    assert r.returncode == 0 and "processes: 2 (MULTI_CPU)" in r.stdout, r.stderr[-3000:]
    two = tmp_path / "fsdp"
    _fsdp(tiny_overrides(data_file, two, **common))

    la = {r["step"]: r["loss"] for r in read_metrics(one) if "loss" in r}
    lb = {r["step"]: r["loss"] for r in read_metrics(two) if "loss" in r}
    assert sorted(la) == sorted(lb) == [1, 2, 3, 4]
    for step in la:
        assert lb[step] == pytest.approx(la[step], rel=1e-6), step
    # the second process ran a stand-in for the one validation batch; its metrics are dropped
    va = [{k: v for k, v in r.items() if k.startswith("val/")} for r in read_metrics(one)]
    vb = [{k: v for k, v in r.items() if k.startswith("val/")} for r in read_metrics(two)]
    va, vb = [r for r in va if r], [r for r in vb if r]
    assert len(va) == len(vb) == 1 and vb[0] == pytest.approx(va[0], rel=1e-6)

    a, b = final_weights(one), final_weights(two)
    assert sorted(a) == sorted(b) and any(k.startswith("adapter/") for k in a)
    for k in a:  # whole tensors, not one process's rows, with DDP's values
        assert b[k].shape == a[k].shape, k
        assert (a[k] - b[k]).abs().max() < 1e-6, k

    step2 = two / "checkpoints" / "step_2"
    assert (step2 / "pytorch_model_fsdp_0").is_dir()  # accelerate's sharded layout
    assert load_file(str(step2 / "draft" / "model.safetensors")).keys() == {
        k.split("/", 1)[1] for k in b if k.startswith("final/")
    }

    # resumed from step 2: steps 3 and 4 again, the same weights
    three = copy_stopped_after(two, tmp_path / "three", 2)
    r = _fsdp(tiny_overrides(data_file, three, **common, resume="true"))
    assert "resumed from" in r.stdout and "step 2" in r.stdout
    c = final_weights(three)
    for k in b:
        assert (b[k] - c[k]).abs().max() < 1e-6, k


def test_fsdp_keeps_a_students_tied_head_tied(data_file, tmp_path):
    """A DistillSpec student whose LM head is its embedding: accelerate's FSDP moves the draft
    to the meta device and back, which unties them unless the draft ties them again; untied,
    the two train apart and the saved student (tied in its config) loses the head's updates."""
    out = tmp_path / "s"
    common = {**COMMON, "train.max_steps": 2, "method": "distillspec", "method.num_layers": 1}
    _fsdp(tiny_overrides(data_file, out, **common))
    cfg = json.loads((out / "final" / "student" / "config.json").read_text())
    assert cfg["tie_word_embeddings"] is True
    w = load_file(str(out / "final" / "student" / "model.safetensors"))
    # saved once, under the embedding's name; a head trained apart is saved beside it
    assert "lm_head.weight" not in w, "the student's head was trained apart from its embedding"
    assert "model.embed_tokens.weight" in w


def test_muon_under_fsdp_is_refused_before_the_target_loads(data_file, tmp_path):
    """Muon orthogonalises whole matrices; FSDP gives each process rows of them."""
    out = tmp_path / "m"
    r = _launch(tiny_overrides(data_file, out, **{**COMMON, "optim": "muon"}))
    assert r.returncode != 0
    assert "error: optim=muon: Muon orthogonalises whole matrices" in r.stdout + r.stderr
    assert "target:" not in r.stdout and not (out / "checkpoints").exists()
