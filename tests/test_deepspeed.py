"""Training under accelerate's DeepSpeed (``scripts/accelerate/deepspeed_zero2.yaml``), two CPU
processes.

accelerate hands a draft to DeepSpeed on GPUs only; ``tests/accelerate_on_cpu.py`` keeps its
DeepSpeed on the CPU (DeepSpeed's CPU accelerator, over gloo), so that the loop meets what it
meets on GPUs: DeepSpeed's engine stepping the optimizer inside ``backward``, its ZeRO-2
optimizer holding each process's part of the optimizer state, its own checkpoints."""

from __future__ import annotations

import importlib.util

import pytest
import torch
from conftest import (
    ROOT,
    accelerate_launch,
    copy_stopped_after,
    final_weights,
    launch_with_config,
    read_metrics,
    tiny_overrides,
)

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("deepspeed") is None,
    reason="DeepSpeed is not installed: bash scripts/install.sh dev installs it",
)

COMMON = {
    "method": "medusa2",  # heads and a LoRA adapter on the target's frozen weights
    "train.max_steps": 4,
    "train.eval_every": 0,
    "train.save_every": 2,
    "data.batch_size": 2,
    "data.max_val_records": 1,
    "train.threads": 1,
    "optim.lr": 1e-3,
    # not the launch config's (accumulation 1, clipping 1.0): the run's must win
    "train.grad_accum": 2,
    "optim.max_grad_norm": 0.05,
}


def _deepspeed(args: list[str]):
    r = launch_with_config("deepspeed_zero2.yaml", args)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "processes: 2 (DEEPSPEED)" in r.stdout, r.stdout[-2000:]  # DeepSpeed's, not DDP
    return r


def test_deepspeed_trains_checkpoints_and_resumes_as_ddp_does(data_file, tmp_path):
    """Medusa-2 under ZeRO-2 with accumulation and clipping of its own: DDP's losses, gradient
    norms and saved draft; checkpoints without the target's frozen weights; resumed from one,
    the same weights."""
    ddp = tmp_path / "ddp"
    r = accelerate_launch(2, tiny_overrides(data_file, ddp, **COMMON))
    assert r.returncode == 0 and "processes: 2 (MULTI_CPU)" in r.stdout, r.stderr[-3000:]
    ds = tmp_path / "ds"
    r = _deepspeed(tiny_overrides(data_file, ds, **COMMON))
    assert (
        "deepspeed: the run's settings replace the launch config's: "
        "gradient_accumulation_steps 1 -> 2, gradient_clipping 1.0 -> 0.05"
    ) in r.stdout

    la = {r["step"]: r for r in read_metrics(ddp) if "loss" in r}
    lb = {r["step"]: r for r in read_metrics(ds) if "loss" in r}
    assert sorted(la) == sorted(lb) == [1, 2, 3, 4]
    for step in la:
        assert lb[step]["loss"] == pytest.approx(la[step]["loss"], rel=1e-6), step
        # the norm before clipping, and clipping to 0.05 bites: the weights below check it
        assert lb[step]["grad_norm"] == pytest.approx(la[step]["grad_norm"], rel=1e-5), step
        assert la[step]["grad_norm"] > 0.05
    a, b = final_weights(ddp), final_weights(ds)
    assert sorted(a) == sorted(b) and any(k.startswith("adapter/") for k in a)
    for k in a:
        assert (a[k] - b[k]).abs().max() < 1e-6, k

    # DeepSpeed's module states hold what training changes, not the target's frozen weights
    step2 = ds / "checkpoints" / "step_2"
    states = torch.load(
        step2 / "pytorch_model" / "mp_rank_00_model_states.pt",
        map_location="cpu",
        weights_only=False,
    )
    saved = set(states["module"])
    assert any("lora_" in k for k in saved) and any(k.startswith("heads.") for k in saved)
    # the target's LM head, tied to its embedding, under either name
    frozen = [k for k in saved if "base_layer" in k or "embed_tokens" in k or "lm_head" in k]
    assert not frozen, frozen[:3]
    assert not states.get("frozen_param_fragments")

    three = copy_stopped_after(ds, tmp_path / "three", 2)
    r = _deepspeed(tiny_overrides(data_file, three, **COMMON, resume="true"))
    assert "resumed from" in r.stdout and "step 2" in r.stdout
    c = final_weights(three)
    for k in b:
        assert (b[k] - c[k]).abs().max() < 1e-7, k


POISON = """
import os, runpy, sys
from models import METHODS

cls = METHODS["medusa2"]
real = cls.forward
bad = {int(x) for x in os.environ["POISONED"].split(",")}
seen = []  # this process's micro-batches in the order trained (by their records)


def poisoned(self, batch):
    out = real(self, batch)
    if self.training:
        key = tuple(batch["index"].tolist())
        if key not in seen:
            seen.append(key)
        if seen.index(key) + 1 in bad:
            out.loss = out.loss * float("nan")
    return out


cls.forward = poisoned
runpy.run_path(sys.argv.pop(1), run_name="__main__")
"""


def test_a_non_finite_micro_batch_is_left_out_alike_under_ddp_fsdp_and_deepspeed(
    data_file, tmp_path
):
    """With accumulation, a micro-batch whose loss is not finite is left out and its window
    steps on the rest, under every backend alike: at a window's end too, where DDP's gradient
    all-reduce, FSDP's reduce-scatter and DeepSpeed's step happen inside the last backward
    (skipped, DDP dropped the whole window and FSDP and DeepSpeed carried it into the next
    one). Same losses at every step, same weights."""
    script = tmp_path / "poisoned.py"
    script.write_text(POISON)
    args = [str(ROOT / "tests" / "accelerate_on_cpu.py")]
    # micro-batches 4 (a window's end) and 7 (a window's start) come out NaN
    env = {"POISONED": "4,7", "PYTHONPATH": str(ROOT)}
    common = {**COMMON, "train.save_every": 0}
    runs = {}
    for config in ("cpu_2proc.yaml", "fsdp.yaml", "deepspeed_zero2.yaml"):
        out = tmp_path / config.split(".")[0]
        r = launch_with_config(
            config, args + tiny_overrides(data_file, out, **common), script=script, env=env
        )
        assert r.returncode == 0, r.stderr[-3000:]
        assert r.stdout.count("warning: non-finite loss") == 2, r.stdout[-2000:]
        rows = [m for m in read_metrics(out) if "loss" in m]
        assert [m["step"] for m in rows] == [1, 2, 3, 4]
        runs[config] = ([m["loss"] for m in rows], final_weights(out))
    (ddp_loss, ddp_w), *others = runs.values()
    for loss, w in others:
        assert loss == pytest.approx(ddp_loss, rel=1e-6, abs=1e-6)
        assert all(torch.allclose(w[k], ddp_w[k], atol=1e-5) for k in ddp_w)


@pytest.mark.parametrize(
    "config,override,says",
    [
        (
            "deepspeed_zero2.yaml",
            "optim=muon",
            "error: optim=muon: Muon orthogonalises whole matrices and DeepSpeed ZeRO-2 gives",
        ),
        (
            "zero3",
            "",
            "error: DeepSpeed ZeRO-3 (the launch config's zero_stage: 3) would partition",
        ),
    ],
)
def test_what_deepspeed_would_break_is_refused_before_the_target_loads(
    data_file, tmp_path, config, override, says
):
    """Muon under ZeRO (each process steps a slice of each matrix) and ZeRO-3 for the draft (its
    parameters partitioned, which this trainer does with FSDP) fail mid-step without a word
    on what to change; both are refused first."""
    if config == "zero3":  # a user's own launch config (an absolute path)
        shipped = ROOT / "scripts" / "accelerate" / "deepspeed_zero2.yaml"
        config = str(tmp_path / "zero3.yaml")
        (tmp_path / "zero3.yaml").write_text(
            shipped.read_text().replace("zero_stage: 2", "zero_stage: 3")
        )
    out = tmp_path / "run"
    extra = dict([override.split("=")]) if override else {}
    r = launch_with_config(config, tiny_overrides(data_file, out, **{**COMMON, **extra}))
    assert r.returncode != 0
    assert says in r.stdout + r.stderr
    assert "target:" not in r.stdout and not (out / "checkpoints").exists()


def test_bf16_says_the_targets_weights_in_the_draft_are_cast(data_file, tmp_path):
    """DeepSpeed's bf16 turns its module's weights to bf16, the target's frozen weights inside
    Medusa-2 too (the same tensors the target computes with): the log says so."""
    out = tmp_path / "bf16"
    overrides = {
        **COMMON,
        "train.max_steps": 1,
        "train.save_every": 0,
        "train.mixed_precision": "bf16",
    }
    r = _deepspeed(tiny_overrides(data_file, out, **overrides))
    assert (
        "deepspeed: its mixed precision casts the draft's module to torch.bfloat16 weights, and "
        "with it the target's own weights the draft holds (medusa2): the target computes in "
        "torch.bfloat16 from here, not torch.float32"
    ) in r.stdout
