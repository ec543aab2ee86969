"""Every registered method resumes exactly: a run stopped at a checkpoint and continued with
``resume=true`` takes the steps the uninterrupted run took, loss for loss. Each method runs with
the features that keep state outside its weights turned on (random feature noise, on-policy
micro-batches, warm-ups and curricula, sampled anchors and depths), since those are what a
checkpoint could miss."""

from __future__ import annotations

import shutil

import pytest
from conftest import compose, read_metrics, tiny_overrides

from models import METHODS
from trainer.train import run

#: the block drafters' small shape, with a few random block starts of the many a sequence
#: offers (their anchors: the randomness a resume must restore)
BLOCK = {
    "method.draft_vocab_size": 64,
    "method.mask_token_id": 5,
    "method.block_size": 4,
    "method.num_layers": 1,
    "method.fuse_layers": "[1,3]",
    "method.anchors": 4,
}
#: small settings per method (tests/test_methods.py's), with the stateful features on
SETTINGS: dict[str, dict[str, object]] = {
    "eagle1": {"method.noise": 0.2},
    "eagle3": {"method.draft_vocab_size": 64, "method.fuse_layers": "[1,2,3]"},
    "hass": {
        "method.draft_vocab_size": 64,
        "method.fuse_layers": "[1,2,3]",
        "method.topk": 4,
    },
    "medusa1": {"method.num_heads": 2, "method.tree_nodes": 6},
    # the backbone's loss weight warms up over micro-batches: still rising across the resume
    "medusa2": {
        "method.num_heads": 2,
        "method.tree_nodes": 6,
        "method.lora_r": 4,
        "method.backbone_warmup": 8,
    },
    # every other micro-batch on-policy: the student writes short replies
    "distillspec": {
        "method.num_layers": 1,
        "method.on_policy": 0.5,
        "method.gen_max_new_tokens": 3,
    },
    "mlp_speculator": {},
    "dflash": BLOCK,
    "domino": {
        **BLOCK,
        "method.gru_hidden": 16,
        "method.correction_dim": 8,
    },
    "dspark": {
        **BLOCK,
        "method.markov_rank": 8,
    },
    # depth sampling thins the deeper depths at random
    "peagle": {
        "method.draft_vocab_size": 64,
        "method.fuse_layers": "[1,2,3]",
        "method.mask_token_id": 5,
        "method.ttt_steps": 3,
        "method.depth_keep": 0.5,
    },
    # glancing falls with training progress; feature noise is drawn each step
    "falcon": {"method.lstm_layers": 1, "method.glance": 0.4, "method.noise": 0.2},
}

STEPS = {
    "train.max_steps": 3,
    "train.save_every": 1,
    "train.keep_checkpoints": 0,  # all of them: the test resumes from the first
    "train.eval_every": 0,
    "target.tiny_layers": 4,  # EAGLE-3, HASS, P-EAGLE fuse three distinct layers
    "data.max_length": 128,
    # 8 training records in batches of 4 (none of the first 8 ids is held out at the
    # debug config's val_fraction): the resumed run finishes epoch 0 and starts epoch 1
    "data.max_records": 8,
    "data.max_val_records": 1,
}

#: a logged value that follows the state a method keeps beside its weights: it must change
#: across the steps compared, or the test would not see that state lost
STATEFUL = {
    "distillspec": "on_policy",  # micro-batch 1 on-policy, 0 and 2 not
    "medusa2": "backbone_weight",  # the backbone's warm-up over micro-batches
    "falcon": "glance",  # glancing falls with training progress
}


@pytest.mark.parametrize("name", sorted(METHODS))
def test_a_resumed_run_continues_exactly(data_file, tmp_path, name, caplog):
    assert name in SETTINGS, (
        f"method {name!r} is registered but has no settings in this resume test's SETTINGS"
    )
    extra = {"method": name, **SETTINGS[name], **STEPS}
    full, part = tmp_path / "full", tmp_path / "part"
    assert run(compose(tiny_overrides(data_file, full, **extra)))["step"] == 3
    # stop after step 1 as if the machine had gone: continue from its checkpoint
    (part / "checkpoints").mkdir(parents=True)
    shutil.copytree(full / "checkpoints" / "step_1", part / "checkpoints" / "step_1")
    assert run(compose(tiny_overrides(data_file, part, **extra, resume="true")))["step"] == 3
    # tied weights (the MLP speculator's stages) are stored once, without accelerate's
    # warning that the checkpoint might not reload
    assert "Removed shared tensor" not in caplog.text
    a, b = _rows(full), _rows(part)
    assert sorted(b) == [2, 3], f"{name}: the resumed run logged steps {sorted(b)}"
    assert a[3]["epoch"] == 1, f"{name}: the run did not reach its second epoch"
    if name in STATEFUL:
        k = STATEFUL[name]
        assert len({a[s][k] for s in (1, 2, 3)}) > 1, f"{name}: {k} never changed"
    for step in (2, 3):
        assert set(b[step]) == set(a[step]), (name, step)
        for k, v in a[step].items():  # the loss, each term of it, and what it was weighted by
            assert b[step][k] == pytest.approx(v, rel=1e-5), (
                f"{name}: {k} at step {step} after resuming from step 1 is {b[step][k]}, "
                f"the uninterrupted run's {v}"
            )


#: logged values that measure the machine, not the training
TIMING = ("tokens_per_s", "elapsed_s")


def _rows(run_dir) -> dict[int, dict[str, float]]:
    """Each training step's logged values (not validation's), timings left out."""
    return {
        r["step"]: {k: v for k, v in r.items() if k != "step" and k not in TIMING}
        for r in read_metrics(run_dir)
        if "loss" in r
    }
