"""The training entry point end to end on the tiny target: configs, runs, checkpoints, resume,
feature cache, signals and bad input."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time

import pytest
from conftest import (
    CONF,
    ROOT,
    accelerate_launch,
    compose,
    read_metrics,
    run_module,
    tiny_overrides,
)

from trainer.checkpoint import CheckpointError, latest_checkpoint, list_checkpoints
from trainer.train import run

GROUPS = ["target", "data", "method", "optim", "logger", "experiment", "debug"]


def shipped_options():
    for g in GROUPS:
        for f in sorted((CONF / g).glob("*.yaml")):
            yield g, f.stem


@pytest.mark.parametrize("group,option", list(shipped_options()))
def test_every_shipped_config_composes(group, option):
    extra = ["target.path=/some/model"] if (group, option) == ("target", "hf") else []
    cfg = compose([f"{group}={option}", "output_dir=/tmp/x", *extra])
    assert cfg.method.name and cfg.target.name and cfg.optim.lr > 0


def test_the_continuation_recipe_is_the_long_one_from_the_shipped_weights():
    long = compose(["experiment=eagle3_smollm2_long", "output_dir=/tmp/x"])
    cont = compose(["experiment=eagle3_smollm2_continue", "output_dir=/tmp/x"])
    assert cont.train.init_from == "smollm2-eagle3" and long.train.init_from is None
    assert (cont.optim.lr, long.optim.lr) == (1.5e-4, 3e-4)
    assert (cont.train.max_minutes, long.train.max_minutes) == (45, 150)
    for part in ("method", "data", "target"):  # everything else is the long recipe's
        assert cont[part] == long[part], part


def test_method_file_sets_paper_defaults():
    cfg = compose(["method=eagle1", "output_dir=/tmp/x"])
    assert cfg.method.w_cls == 0.1 and cfg.optim.lr == 3e-5
    assert list(cfg.optim.betas) == [0.9, 0.95] and cfg.optim.max_grad_norm == 0.5
    # the command line still wins
    assert compose(["optim.lr=1e-3", "output_dir=/tmp/x"]).optim.lr == 1e-3


@pytest.mark.parametrize(
    "override", ["method.w_clz=1", "train.max_stepz=3", "optim.lr=fast", "data.batch_size=1.5"]
)
def test_misspelled_or_mistyped_override_fails_at_compose(override):
    from hydra.errors import ConfigCompositionException
    from omegaconf.errors import OmegaConfBaseException

    with pytest.raises((ConfigCompositionException, OmegaConfBaseException)):
        compose([override, "output_dir=/tmp/x"])


def _run(data_file, out, **extra):
    return run(compose(tiny_overrides(data_file, out, **extra)))


def test_run_writes_metrics_checkpoints_and_final(data_file, tmp_path):
    out = tmp_path / "run"
    s = _run(
        data_file,
        out,
        **{"train.max_steps": 12, "train.save_every": 5, "train.keep_checkpoints": 2},
    )
    assert s["reason"] == "finished" and s["step"] == 12
    rows = read_metrics(out)
    assert [r["step"] for r in rows if "loss" in r] == list(range(1, 13))
    assert any("val/top1_pos1" in r for r in rows)
    assert (out / "final" / "model.safetensors").exists()
    assert (
        json.loads((out / "final" / "config.json").read_text())["specdraft"]["method"] == "eagle1"
    )
    assert [p.name for p in list_checkpoints(out)] == ["step_10", "step_12"]  # pruned to 2
    ck = out / "checkpoints" / "step_10"
    state = json.loads((ck / "trainer_state.json").read_text())
    assert state["step"] == 10 and state["batch_in_epoch"] > 0
    for f in ("optimizer.bin", "scheduler.bin", "model.safetensors", "draft/config.json"):
        assert (ck / f).exists()


def test_lr_schedule_decays_over_the_steps_the_epochs_allow(data_file, tmp_path):
    """With epochs binding before max_steps, the schedule ends at the last step of the last
    epoch (it once decayed over max_steps and stayed near the peak)."""
    out = tmp_path / "run"
    s = _run(
        data_file,
        out,
        **{
            "train.max_steps": 100000,
            "train.epochs": 1,
            "train.log_every": 1,
            "train.eval_every": 0,
            "optim.schedule": "linear",
            "optim.warmup_steps": 0,
            "optim.min_lr_ratio": 0.0,
        },
    )
    lrs = [r["lr"] for r in read_metrics(out) if "lr" in r]
    n = s["step"]
    assert len(lrs) == n > 2 and all(b < a for a, b in zip(lrs, lrs[1:], strict=False))
    peak = compose(tiny_overrides(data_file, out)).optim.lr
    assert lrs[-1] == pytest.approx(peak / n, rel=1e-6)  # 1 - (n-1)/n of the peak


@pytest.mark.parametrize(
    "method,key", [("eagle1", "loss_cls"), ("eagle3", "loss_step1"), ("medusa1", "loss_head1")]
)
def test_every_head_trains_with_the_acceptance_loss(data_file, tmp_path, method, key):
    """method.loss=tvd: the logged token loss is a total variation (in [0, 1]) and falls."""
    out = tmp_path / "run"
    extra = {"method": method, "method.loss": "tvd", "train.max_steps": 8, "train.eval_every": 0}
    extra["optim.lr"] = 3e-3
    if method == "eagle3":  # three distinct fused layers, as serving engines need
        extra["target.tiny_layers"] = 4
    assert _run(data_file, out, **extra)["step"] == 8
    vals = [r[key] for r in read_metrics(out) if key in r]
    assert len(vals) == 8 and all(0.0 <= v <= 1.0 for v in vals)
    assert min(vals[-3:]) < vals[0]
    with pytest.raises(Exception, match="method.loss='kl'"):
        _run(data_file, tmp_path / "bad", **{**extra, "method.loss": "kl"})


def test_init_from_starts_at_a_saved_drafts_weights(data_file, tmp_path):
    import torch
    from safetensors.torch import load_file

    from models.base import DraftError

    a = tmp_path / "a"
    _run(data_file, a, **{"train.max_steps": 3, "train.eval_every": 0})
    b = tmp_path / "b"
    _run(
        data_file,
        b,
        **{
            "train.init_from": str(a),
            "train.max_steps": 1,
            "optim.lr": 1e-12,
            "train.eval_every": 0,
        },
    )
    wa, wb = (
        load_file(str(a / "final" / "model.safetensors")),
        load_file(str(b / "final" / "model.safetensors")),
    )
    assert wa.keys() == wb.keys()
    for k in wa:  # one step at lr 1e-12 from a's weights: a's weights
        torch.testing.assert_close(wb[k].float(), wa[k].float(), atol=1e-6, rtol=0)
    fresh = tmp_path / "fresh"
    _run(data_file, fresh, **{"train.max_steps": 1, "optim.lr": 1e-12, "train.eval_every": 0})
    wf = load_file(str(fresh / "final" / "model.safetensors"))
    assert any(not torch.allclose(wf[k].float(), wa[k].float()) for k in wa)  # not by chance
    with pytest.raises(DraftError, match="is a eagle1 draft; this run trains eagle3"):
        _run(data_file, tmp_path / "c", **{"method": "eagle3", "train.init_from": str(a)})
    with pytest.raises(DraftError, match="not a saved draft"):
        _run(data_file, tmp_path / "d", **{"train.init_from": str(tmp_path / "nothing")})


def test_a_run_started_from_saved_weights_validates_them_first(data_file, tmp_path):
    # A continued curve starts at the validation of the weights it continues from: step 0 of
    # the new run must score exactly what the old run's final validation scored (same data).
    a = tmp_path / "a"
    _run(data_file, a, **{"train.max_steps": 3, "train.eval_every": 0})
    last_a = [r for r in read_metrics(a) if "val/top1_pos1" in r][-1]
    assert last_a["step"] == 3
    b = tmp_path / "b"
    _run(data_file, b, **{"train.init_from": str(a), "train.max_steps": 2, "train.eval_every": 2})
    vals_b = [r for r in read_metrics(b) if "val/top1_pos1" in r]
    assert [r["step"] for r in vals_b] == [0, 2]
    assert vals_b[0]["tokens"] == 0
    for k, v in last_a.items():
        if k.startswith("val/"):
            assert vals_b[0][k] == pytest.approx(v, abs=1e-6), k
    c = tmp_path / "c"  # a fresh run does not validate before its first step
    _run(data_file, c, **{"train.max_steps": 2, "train.eval_every": 2})
    assert [r["step"] for r in read_metrics(c) if "val/top1_pos1" in r] == [2]


@pytest.fixture(scope="module")
def full_run(data_file, tmp_path_factory):
    out = tmp_path_factory.mktemp("full") / "run"
    _run(
        data_file,
        out,
        **{
            "train.max_steps": 20,
            "train.save_every": 8,
            "train.keep_checkpoints": 5,
            "train.eval_every": 0,
        },
    )
    return out


@pytest.mark.parametrize("resume_step", [8, 16])  # mid-epoch 0, and mid-epoch 1 (15 batches/epoch)
def test_resume_continues_at_same_step_and_data_position(
    data_file, tmp_path, full_run, resume_step
):
    # A run directory holding only one checkpoint, as if the run died 3 steps after it.
    part = tmp_path / "part"
    (part / "checkpoints").mkdir(parents=True)
    name = f"step_{resume_step}"
    shutil.copytree(full_run / "checkpoints" / name, part / "checkpoints" / name)
    rows = [r for r in read_metrics(full_run) if r["step"] <= resume_step + 3]
    (part / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    s = _run(
        data_file,
        part,
        **{"train.max_steps": 20, "train.save_every": 8, "train.eval_every": 0, "resume": "true"},
    )
    assert s["step"] == 20
    a = {r["step"]: r["loss"] for r in read_metrics(full_run) if "loss" in r}
    b = {r["step"]: r["loss"] for r in read_metrics(part) if "loss" in r}
    assert sorted(b) == list(range(1, 21))  # the dead run's extra rows replaced, each step once
    for step in range(resume_step + 1, 21):
        assert b[step] == pytest.approx(a[step], rel=1e-6, abs=1e-7), step
    sa = json.loads((full_run / "checkpoints/step_20/trainer_state.json").read_text())
    sb = json.loads((part / "checkpoints/step_20/trainer_state.json").read_text())
    assert (sa["epoch"], sa["batch_in_epoch"]) == (sb["epoch"], sb["batch_in_epoch"]) == (1, 5)


def test_a_checkpoint_split_the_earlier_way_resumes_with_a_note(data_file, tmp_path, capsys):
    """A checkpoint from before the split hashed ids alone resumes (its data is the same),
    saying that its validation set changed at this step."""
    out = tmp_path / "run"
    _run(data_file, out, **{"train.max_steps": 2, "train.save_every": 2, "train.eval_every": 0})
    state_file = out / "checkpoints" / "step_2" / "trainer_state.json"
    text = state_file.read_text()
    state = json.loads(text)
    assert state.pop("data_split") == 2
    written = json.dumps(state)
    state_file.write_text(written + " " * (len(text) - len(written)))  # the size it was saved at
    capsys.readouterr()
    s = _run(data_file, out, **{"train.max_steps": 3, "train.eval_every": 0, "resume": "true"})
    assert s["step"] == 3
    said = capsys.readouterr()
    assert "when the validation split hashed each record's position" in said.out + said.err
    # resumed again from its own checkpoint: no note
    _run(data_file, out, **{"train.max_steps": 4, "train.save_every": 1, "resume": "true"})
    _run(data_file, out, **{"train.max_steps": 5, "train.eval_every": 0, "resume": "true"})
    said = capsys.readouterr()
    assert "validation split hashed" not in said.out + said.err


def test_damaged_latest_checkpoint_falls_back_to_previous(data_file, tmp_path):
    out = tmp_path / "run"
    _run(data_file, out, **{"train.max_steps": 6, "train.save_every": 3, "train.eval_every": 0})
    newest = out / "checkpoints" / "step_6"
    (newest / "optimizer.bin").write_bytes(b"broken")
    msgs = []
    assert latest_checkpoint(out, log=msgs.append) == out / "checkpoints" / "step_3"
    assert "step_6" in msgs[0] and "optimizer.bin" in msgs[0]
    (out / "checkpoints" / "step_3" / "COMPLETE").unlink()
    assert latest_checkpoint(out, log=msgs.append) is None


@pytest.mark.parametrize(
    "method,extra,layers",
    [
        ("eagle1", {"method.noise": 0.0}, 1),  # the final hidden state
        (
            "eagle3",  # 3 fused + final; 4 target layers: three distinct layers an engine takes
            {"method.draft_vocab_size": 128, "method.ttt_steps": 2, "target.tiny_layers": 4},
            4,
        ),
    ],
)
def test_cached_features_train_exactly_like_online(data_file, tmp_path, method, extra, layers):
    common = {
        "method": method,
        "train.max_steps": 4,
        "train.eval_every": 0,
        "data.feature_dtype": "float32",
        **extra,
    }
    _run(data_file, tmp_path / "online", **common)
    _run(data_file, tmp_path / "cached", **common, **{"data.cache_features": "true"})
    feats = list((tmp_path / "cache" / "features").iterdir())
    assert len(feats) == 2 and all((f / "done.json").exists() for f in feats)  # train + val
    meta = json.loads((feats[0] / "done.json").read_text())
    assert meta["bytes_per_token"] == layers * 64 * 4  # hidden 64, float32
    a = [r["loss"] for r in read_metrics(tmp_path / "online") if "loss" in r]
    b = [r["loss"] for r in read_metrics(tmp_path / "cached") if "loss" in r]
    assert a == pytest.approx(b, rel=1e-5)


def _cli(args, timeout=120):
    return run_module("flow", args, timeout)


def test_cli_tiny_run_then_one_into_its_folder_touches_nothing(data_file, tmp_path):
    """The command trains and writes its run; the same command again is refused before
    anything in the folder is written (Hydra's own app.log included: logs go to the console)."""
    out = tmp_path / "cli"
    args = [
        "target=tiny_random",
        "method=eagle1",
        "train.max_steps=20",
        f"output_dir={out}",
        f"data.path={data_file}",
        "data.max_length=256",
        "train.progress=false",
        "train.epochs=100",
        f"data.cache_dir={tmp_path / 'cache'}",
    ]
    r = _cli(args)
    assert r.returncode == 0, r.stderr[-2000:]
    assert (out / "metrics.jsonl").exists() and (out / "final" / "model.safetensors").exists()
    assert "data:" in r.stdout and "skipped" in r.stdout  # the load report is printed
    assert (out / ".hydra" / "overrides.yaml").exists() and not (out / "app.log").exists()
    files = {p: (p.read_bytes(), p.stat().st_mtime_ns) for p in out.rglob("*") if p.is_file()}
    again = _cli(args)
    assert again.returncode == 2 and "holds a run already" in again.stderr, again.stderr[-2000:]
    assert {
        p: (p.read_bytes(), p.stat().st_mtime_ns) for p in out.rglob("*") if p.is_file()
    } == files


@pytest.mark.parametrize(
    "args,needle",
    [
        (["train.max_steps=-3"], "train.max_steps=-3: must be >= 1"),
        (["data.path=/nonexistent/file.jsonl"], "/nonexistent/file.jsonl: no such file"),
        (["target=hf", "target.path=/nonexistent/model"], "target.path=/nonexistent/model"),
    ],
)
def test_bad_cli_values_give_one_line_errors(tmp_path, args, needle):
    r = _cli(["debug=default", f"output_dir={tmp_path / 'o'}", *args])
    assert r.returncode == 2
    assert needle in r.stderr and "Traceback" not in r.stderr
    assert len([line for line in r.stderr.splitlines() if line.startswith("error:")]) == 1


@pytest.mark.parametrize(
    "method,key,value,said",
    [
        ("eagle3", "ttt_steps", 0, "must be >= 1"),  # was torch.cat of nothing
        ("eagle1", "lm_head_chunk", 0, "must be >= 1"),  # was range() with step 0
        ("dflash", "val_positions", 0, "must be >= 1"),  # was an IndexError at validation
        ("eagle3", "step_decay", -1.0, "must be >= 0"),  # trained, away from the target
        ("medusa2", "head_decay", -0.5, "must be >= 0"),
        ("eagle1", "noise", -0.1, "must be >= 0"),
    ],
)
def test_shared_method_settings_out_of_range_are_one_line(tmp_path, method, key, value, said):
    from conftest import compose, tiny_overrides

    from trainer.train import ConfigError, check_config

    over = tiny_overrides(tmp_path / "d.jsonl", tmp_path / "o", **{f"method.{key}": value})
    with pytest.raises(ConfigError) as e:
        check_config(compose([f"method={method}", *over]))
    assert str(e.value) == f"method.{key}={value}: {said}"


def test_not_json_data_file_is_one_clear_error(tmp_path):
    bad = tmp_path / "notjson.json"
    bad.write_text("this is not json")
    r = _cli(["debug=default", f"output_dir={tmp_path / 'o'}", f"data.path={bad}"])
    assert r.returncode == 2 and f"{bad}: not JSON" in r.stderr and "Traceback" not in r.stderr


def test_sigterm_saves_a_checkpoint_and_exits_143(data_file, tmp_path):
    out = tmp_path / "sig"
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    p = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "flow",
            "debug=default",
            f"data.path={data_file}",
            f"output_dir={out}",
            "train.max_steps=100000",
            "train.save_every=0",
            "train.eval_every=0",
            "train.log_every=1",
            f"data.cache_dir={tmp_path / 'cache'}",
        ],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    deadline = time.time() + 90
    while time.time() < deadline and not (out / "metrics.jsonl").exists():
        time.sleep(0.2)
    assert (out / "metrics.jsonl").exists(), "training never started"
    p.send_signal(signal.SIGTERM)
    stdout, _ = p.communicate(timeout=60)
    # 128 + SIGTERM, as shells count: a scheduler sees a stopped run, not a finished one
    assert p.returncode == 143, stdout[-2000:]
    assert "Traceback" not in stdout and "resume=true" in stdout
    ck = latest_checkpoint(out)
    assert ck is not None and not (out / "final").exists()
    step = json.loads((ck / "trainer_state.json").read_text())["step"]
    assert step >= 1


def test_multirun_sweep_gives_each_job_its_own_directory(data_file, tmp_path):
    sweep = tmp_path / "sweep"
    r = _cli(
        [
            "-m",
            "debug=default",
            f"data.path={data_file}",
            "train.max_steps=2,3",
            "train.eval_every=0",
            f"hydra.sweep.dir={sweep}",
            f"data.cache_dir={tmp_path / 'cache'}",
        ],
        timeout=180,
    )
    assert r.returncode == 0, r.stderr[-2000:]
    steps = sorted(
        json.loads((sweep / j / "checkpoints" / f"step_{n}" / "trainer_state.json").read_text())[
            "step"
        ]
        for j, n in (("0", 2), ("1", 3))
    )
    assert steps == [2, 3]
    assert (sweep / "0" / "final").is_dir() and (sweep / "1" / "metrics.jsonl").exists()


def test_wandb_logger_offline(data_file, tmp_path):
    out = tmp_path / "wb"
    env_mode = os.environ.get("WANDB_MODE")
    s = _run(data_file, out, **{"logger": "wandb", "train.max_steps": 2, "train.eval_every": 0})
    assert s["step"] == 2 and env_mode == "offline"
    assert list((out / "wandb").glob("offline-run-*")), "no offline W&B run written"
    assert (out / "metrics.jsonl").exists()  # written with any logger
    # resumed, it logs into the same W&B run (its id kept in the run directory)
    run_id = (out / "wandb_id").read_text().strip()
    s = _run(
        data_file,
        out,
        **{"logger": "wandb", "train.max_steps": 4, "train.eval_every": 0, "resume": "true"},
    )
    assert s["step"] == 4
    runs = sorted((out / "wandb").glob("offline-run-*"))
    # W&B names a run's folder offline-run-<second>-<id>, with -1, -2... after it where two
    # starts of one run fall in the same second
    same = re.compile(rf"offline-run-\d{{8}}_\d{{6}}-{re.escape(run_id)}(-\d+)?")
    assert len(runs) == 2 and all(same.fullmatch(r.name) for r in runs), runs


def test_wandb_without_an_account_is_one_line(tmp_path, monkeypatch):
    """Online W&B with no API key: one line saying how to log without an account, not
    wandb's traceback."""
    from omegaconf import OmegaConf

    from trainer.tracking import Tracker, TrackerError

    pytest.importorskip("wandb")
    for k in ("WANDB_API_KEY", "WANDB_BASE_URL"):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("WANDB_MODE", "online")
    monkeypatch.setenv("HOME", str(tmp_path))  # no ~/.netrc, no saved login
    monkeypatch.setenv("NETRC", str(tmp_path / "netrc"))
    monkeypatch.setenv("WANDB_CONFIG_DIR", str(tmp_path / "wandb-config"))
    cfg = OmegaConf.create(
        {"name": "wandb", "project": "p", "entity": None, "run_name": None, "mode": "online"}
    )
    with pytest.raises(TrackerError) as e:
        Tracker(tmp_path / "run", cfg, {}, enabled=True)
    msg = str(e.value)
    assert msg.startswith("logger=wandb logger.mode=online: ") and "\n" not in msg
    assert "logger.mode=offline" in msg


def test_accelerate_launch_runs_the_same_app(data_file, tmp_path):
    out = tmp_path / "acc"
    r = accelerate_launch(
        1,
        [
            "debug=default",
            f"data.path={data_file}",
            f"output_dir={out}",
            "train.max_steps=3",
            f"data.cache_dir={tmp_path / 'cache'}",
        ],
        timeout=180,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    assert (out / "final" / "model.safetensors").exists()


@pytest.mark.parametrize(
    "extra,kept,left_out",
    [
        # Medusa-2: the adapter and heads are saved, the backbone's own (frozen) weights are
        # not, nor its LM head under the second name of the embedding it is tied to
        (
            {"method": "medusa2", "method.num_heads": 2, "method.lora_r": 4},
            ["lora_", "^heads\\."],
            ["base_layer", "embed_tokens.weight", "lm_head.weight"],
        ),
        # DistillSpec, full fine-tuning of a student whose LM head is tied to its embedding
        ({"method": "distillspec", "method.num_layers": 1}, ["^student\\."], []),
        # DistillSpec with a LoRA student: its frozen base stays out
        (
            {"method": "distillspec", "method.num_layers": 1, "method.lora": "true"},
            ["lora_"],
            ["base_layer"],
        ),
    ],
    ids=["medusa2", "distillspec", "distillspec-lora"],
)
def test_checkpoints_hold_what_trains_and_resume_exactly(
    data_file, tmp_path, extra, kept, left_out
):
    from safetensors import safe_open

    steps = {"train.max_steps": 4, "train.save_every": 2, "train.eval_every": 0}
    full, part = tmp_path / "full", tmp_path / "part"
    run(compose(tiny_overrides(data_file, full, **extra, **steps)))
    ck = full / "checkpoints" / "step_2"
    with safe_open(str(ck / "model.safetensors"), "pt") as f:
        names = set(f.keys())
    for k in kept:  # regular expressions
        assert any(re.search(k, n) for n in names), (k, sorted(names)[:10])
    for k in left_out:
        assert not any(k in n for n in names), (k, sorted(n for n in names if k in n)[:5])
    # resume from step 2 as if the run had died there: the same losses afterwards
    (part / "checkpoints").mkdir(parents=True)
    shutil.copytree(ck, part / "checkpoints" / "step_2")
    s = run(compose(tiny_overrides(data_file, part, **extra, **steps, resume="true")))
    assert s["step"] == 4
    a = {r["step"]: r["loss"] for r in read_metrics(full) if "loss" in r}
    b = {r["step"]: r["loss"] for r in read_metrics(part) if "loss" in r}
    for step in (3, 4):
        assert b[step] == pytest.approx(a[step], rel=1e-5), step


def test_checkpoint_of_another_configuration_is_named_not_half_loaded(data_file, tmp_path):
    medusa = {"method": "medusa2", "method.num_heads": 2, "method.lora_r": 4}
    steps = {"train.max_steps": 2, "train.save_every": 2, "train.eval_every": 0}
    run(compose(tiny_overrides(data_file, tmp_path / "a", **medusa, **steps)))
    other = tmp_path / "b"
    (other / "checkpoints").mkdir(parents=True)
    shutil.copytree(tmp_path / "a/checkpoints/step_2", other / "checkpoints/step_2")
    three = {**medusa, "method.num_heads": 3, "train.max_steps": 4, "resume": "true"}
    with pytest.raises(CheckpointError, match="does not fit this draft"):
        run(compose(tiny_overrides(data_file, other, **three, **{"train.eval_every": 0})))


def test_one_process_may_train_again_with_another_mixed_precision():
    """accelerate keeps one process-wide state; a notebook or a test session that trains in
    fp32 and then in bf16 must not be refused (CI failed on this once)."""
    from accelerate import Accelerator

    from trainer.train import _allow_new_precision

    _allow_new_precision("no")
    assert Accelerator(cpu=True, mixed_precision="no").mixed_precision == "no"
    _allow_new_precision("bf16")
    assert Accelerator(cpu=True, mixed_precision="bf16").mixed_precision == "bf16"
    _allow_new_precision("no")
    assert Accelerator(cpu=True, mixed_precision="no").mixed_precision == "no"


def test_a_new_run_in_another_runs_folder_is_refused(data_file, tmp_path):
    """Without resume, an output_dir holding a run is refused before anything is written
    there (metrics would be appended and the draft replaced); resume=true continues it."""
    from conftest import compose, tiny_overrides

    from trainer.train import ConfigError, run

    run_dir = tmp_path / "run"
    run(compose(tiny_overrides(data_file, run_dir, **{"train.max_steps": 2})))
    files = {p: p.read_bytes() for p in run_dir.rglob("*") if p.is_file()}
    with pytest.raises(
        ConfigError, match=r"output_dir=.*holds a run already \(final, .*resume=true"
    ):
        run(compose(tiny_overrides(data_file, run_dir, **{"train.max_steps": 2})))
    assert {p: p.read_bytes() for p in run_dir.rglob("*") if p.is_file()} == files
    again = run(
        compose(tiny_overrides(data_file, run_dir, **{"train.max_steps": 3, "resume": True}))
    )
    assert again["step"] == 3


def test_the_summary_prints_a_dash_where_no_token_reached_a_position():
    """A conditional alpha no validation token reached (every earlier position agreed there
    first) is left out of the metrics, and the summary says so instead of printing nan."""
    from trainer.train import _print_summary

    lines: list[str] = []
    val = {"top1_pos1": 0.5, "alpha_pos1": 0.5, "top1_pos2": 0.0, "alpha_pos2": 0.0,
           "top1_pos3": 0.0}  # fmt: skip
    _print_summary(
        {"reason": "finished", "step": 3, "tokens_per_s": 10.0, "val": val, "final": None},
        lines.append,
    )
    text = "\n".join(lines)
    assert "nan" not in text
    row3 = next(s for s in lines if s.strip().startswith("3 "))
    assert row3.split()[1:] == ["0.000", "-"]
    assert "no validation token reached" in text


@pytest.mark.parametrize(
    ("val", "rows", "said"),
    [
        # the MLP speculator's stages, Medusa's heads: the top1 column under their names
        (
            {"top1_stage1": 0.25, "alpha_pos1": 0.25, "top1_stage2": 0.5, "alpha_pos2": 0.125},
            [["1", "0.250", "0.250"], ["2", "0.500", "0.125"]],
            None,
        ),
        (
            {"top1_head1": 0.5, "top10_head1": 0.75, "top1_head2": 0.25},
            [["1", "0.500", "-"], ["2", "0.250", "-"]],
            "scores each position on its own",
        ),
        # a draft model: its next token's agreement, greedy and at T = 1
        ({"accept_T0": 0.375, "accept_T1": 0.625}, [], "accept_T1  0.625"),
    ],
    ids=["stages", "heads", "draft_model"],
)
def test_the_summary_prints_each_familys_agreement(val, rows, said):
    """Every family's validation agreement reaches the summary, whatever its metrics' names."""
    from trainer.train import _print_summary

    lines: list[str] = []
    _print_summary(
        {"reason": "finished", "step": 3, "tokens_per_s": 10.0, "val": val, "final": None},
        lines.append,
    )
    table = [s.split() for s in lines if s.strip()[:1].isdigit()]
    assert table == rows
    if said is not None:
        assert said in "\n".join(lines)
    else:
        assert not any(s.strip().startswith("(-") for s in lines)


def test_the_exit_status_says_how_a_run_stopped():
    from flow.app import exit_code

    assert exit_code({"reason": "finished"}) == 0 and exit_code({"reason": "time"}) == 0
    assert exit_code({"reason": "signal", "signal": signal.SIGTERM}) == 143
    assert exit_code({"reason": "signal", "signal": signal.SIGINT}) == 130
    assert exit_code({"reason": "signal", "signal": None}) == 130  # caught by another rank
    assert exit_code({"reason": "nonfinite"}) == 1


def test_a_sweep_runs_every_job_and_fails_where_one_diverged(tmp_path, monkeypatch, capsys):
    """Under -m a job stopped by non-finite losses does not stop the sweep: the others run, and
    the sweep ends with status 1 naming it; a single run ends with 1 at once."""
    import flow.app as app

    ran = []

    def fake(cfg):
        ran.append(cfg.optim.lr)
        return {"reason": "nonfinite" if cfg.optim.lr > 1 else "finished", "final": None}

    monkeypatch.setattr(app, "train_measure_serve", fake)
    monkeypatch.setattr(app, "_FAILED", [])
    sweep = tmp_path / "sweep"
    monkeypatch.setattr(
        sys, "argv", ["specdraft-train", "-m", "optim.lr=100,0.001", f"hydra.sweep.dir={sweep}"]
    )
    with pytest.raises(SystemExit) as e:
        app.main()
    assert e.value.code == 1 and ran == [100.0, 0.001]
    err = capsys.readouterr().err
    assert "1 job(s) of the sweep stopped on non-finite losses" in err and str(sweep / "0") in err
    ran.clear()
    monkeypatch.setattr(
        sys, "argv", ["specdraft-train", "optim.lr=100", f"output_dir={tmp_path / 'one'}"]
    )
    with pytest.raises(SystemExit) as e:
        app.main()
    assert e.value.code == 1 and ran == [100.0]
    assert "stopped on 10 non-finite losses in a row" in capsys.readouterr().err


def test_a_sweep_runs_every_job_and_its_summary_names_the_one_refused(
    tmp_path, monkeypatch, capsys
):
    """Under -m a job refused for its value (checked when it starts) does not end the sweep:
    the jobs after it run, the summary is written with the refused job's error in its row,
    and the sweep ends with status 2 naming it."""
    import json

    import flow.app as app
    from trainer.train import ConfigError

    ran = []

    def fake(cfg):
        ran.append(cfg.optim.lr)
        if cfg.optim.lr == 0.002:
            raise ConfigError("optim.lr=0.002: refused here")
        summary = {"reason": "finished", "final": None, "step": 3, "val": {"loss": cfg.optim.lr}}
        with open(f"{cfg.output_dir}/summary.json", "w") as f:
            f.write(json.dumps(summary))
        return summary

    monkeypatch.setattr(app, "train_measure_serve", fake)
    monkeypatch.setattr(app, "_FAILED", [])
    monkeypatch.setattr(app, "_REFUSED", [])
    sweep = tmp_path / "sweep"
    monkeypatch.setattr(
        sys,
        "argv",
        ["specdraft-train", "-m", "optim.lr=0.001,0.002,0.003", f"hydra.sweep.dir={sweep}"],
    )
    with pytest.raises(SystemExit) as e:
        app.main()
    assert e.value.code == 2 and ran == [0.001, 0.002, 0.003]
    err = capsys.readouterr().err
    assert f"error: {sweep / '1'}: optim.lr=0.002: refused here" in err
    assert "1 job(s) of the sweep were refused" in err and str(sweep / "1") in err
    table = (sweep / "summary.md").read_text()
    assert "| refused |" in table and "optim.lr=0.002: refused here" in table
    assert table.count("| finished |") == 2


def test_a_multi_process_launchs_checkpoint_is_checked_by_the_names_it_saves(tmp_path):
    """Under a multi-process launch the prepared draft is DDP-wrapped (``module.``-prefixed
    names) while accelerate saves its weights unwrapped: resuming a draft with frozen weights
    (Medusa-2's backbone) compared the two and refused every checkpoint it had written."""
    import torch
    import torch.distributed as dist
    from conftest import free_port
    from safetensors.torch import save_file
    from torch.nn.parallel import DistributedDataParallel

    from trainer.checkpoint import _check_saved_weights, frozen_names

    net = torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.Linear(3, 2))
    net[0].requires_grad_(False)  # frozen: left out of checkpoints
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1
    )
    try:
        wrapped = DistributedDataParallel(net)
        assert next(iter(wrapped.state_dict())).startswith("module.")
        assert frozen_names(wrapped) == {"0.weight", "0.bias"}
        ck = tmp_path / "ck"
        ck.mkdir()
        trained = {k: v for k, v in net.state_dict().items() if not k.startswith("0.")}
        save_file(trained, str(ck / "model.safetensors"))
        _check_saved_weights(wrapped, ck)  # fits
        save_file({"1.weight": trained["1.weight"]}, str(ck / "model.safetensors"))
        with pytest.raises(CheckpointError, match=r"missing \['1.bias'\]"):
            _check_saved_weights(wrapped, ck)
    finally:
        dist.destroy_process_group()


def test_resume_on_other_data_is_refused_naming_init_from(data_file, tmp_path):
    """A resumed run continues a data position: on other data (another file, an edited one,
    another max_records) that position means nothing, so it is refused, saying how to carry
    the weights over instead. The same data in a moved folder resumes."""
    from trainer.checkpoint import CheckpointError

    folder = tmp_path / "d"
    folder.mkdir()
    shutil.copy(data_file, folder / "conv.jsonl")
    out = tmp_path / "run"
    kw = {"train.max_steps": 2, "train.save_every": 2, "train.eval_every": 0}
    _run(folder, out, **kw)
    with pytest.raises(CheckpointError) as e:
        _run(folder, out, **{**kw, "train.max_steps": 4, "data.max_records": 30, "resume": "true"})
    assert "trained on other data" in str(e.value)
    assert f"train.init_from={out / 'checkpoints' / 'step_2'}" in str(e.value)
    moved = tmp_path / "moved"
    folder.rename(moved)
    s = _run(moved, out, **{**kw, "train.max_steps": 4, "resume": "true"})
    assert s["step"] == 4
    lines = (moved / "conv.jsonl").read_text().splitlines(keepends=True)
    (moved / "conv.jsonl").write_text("".join(lines[:-1]))  # an edited file
    with pytest.raises(CheckpointError, match="trained on other data"):
        _run(moved, out, **{**kw, "train.max_steps": 6, "resume": "true"})


def test_a_sweep_run_again_keeps_its_finished_jobs_records(tmp_path, monkeypatch, capsys):
    """The same sweep again with one value more: the jobs whose folders hold a run are refused
    without a word written there (their summary, metrics and .hydra records stay what they
    were: a refused job's overrides never label another's results), the new job runs, and the
    summary lists the two earlier runs' results, marked as such, beside the new one's."""

    from conftest import finished_training_run

    import flow.app as app

    monkeypatch.setattr(app, "train_measure_serve", finished_training_run)
    monkeypatch.setattr(app, "_FAILED", [])
    monkeypatch.setattr(app, "_REFUSED", [])
    sweep = tmp_path / "sweep"
    line = ["specdraft-train", "-m", f"hydra.sweep.dir={sweep}"]
    monkeypatch.setattr(sys, "argv", [*line, "optim.lr=0.001,0.003"])
    app.main()
    before = {p: p.read_bytes() for p in sweep.glob("[01]/**/*") if p.is_file()}
    assert sweep / "0" / ".hydra" / "overrides.yaml" in before
    monkeypatch.setattr(sys, "argv", [*line, "optim.lr=0.001,0.003,0.005"])
    with pytest.raises(SystemExit) as e:
        app.main()
    assert e.value.code == 2 and "holds a run already" in capsys.readouterr().err
    assert {p: p.read_bytes() for p in sweep.glob("[01]/**/*") if p.is_file()} == before
    table = (sweep / "summary.md").read_text()
    assert table.count("| finished |") == 1 and "| refused |" not in table
    assert table.count("| finished (an earlier run, kept) |") == 2


def test_resume_true_into_the_time_stamped_default_is_refused(tmp_path, monkeypatch, capsys):
    """Without output_dir every run gets a new time-stamped folder, where resume=true could
    only ever start afresh (a silent new run): refused, asking for the folder."""
    import flow.app as app

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(app, "train_measure_serve", lambda cfg: pytest.fail("it trained"))
    monkeypatch.setattr(sys, "argv", ["specdraft-train", "resume=true", "target=tiny_random"])
    with pytest.raises(SystemExit) as e:
        app.main()
    assert e.value.code == 2
    assert capsys.readouterr().err.strip() == (
        "error: resume=true continues the run in output_dir; name it (output_dir=runs/x): the "
        "default is a new time-stamped folder each time"
    )


def test_the_trained_draft_and_checkpoints_are_readable_by_others(data_file, tmp_path):
    """safetensors writes its files 0600: final/ (which vLLM serves as it is, a DistillSpec
    student) and checkpoints were unreadable to a server running as another user. They get
    the modes a plain open() gives under the umask, as exports do."""
    import stat

    from conftest import compose, tiny_overrides

    from trainer.train import run

    old = os.umask(0o022)
    try:
        out = tmp_path / "run"
        run(
            compose(tiny_overrides(data_file, out, **{"train.max_steps": 2, "train.save_every": 2}))
        )
    finally:
        os.umask(old)
    files = [p for d in ("final", "checkpoints") for p in (out / d).rglob("*") if p.is_file()]
    assert any(p.suffix == ".safetensors" for p in files)
    private = [str(p) for p in files if stat.S_IMODE(p.stat().st_mode) != 0o644]
    assert not private, private


def test_a_run_refused_once_its_target_loads_leaves_no_folder_behind(tmp_path):
    """A setting refused after the run's record was written (a DistillSpec student of more
    layers than the tiny target has) left output_dir holding only .hydra/; the folder the
    command made is removed, one given empty is left empty, and the error names the key."""
    args = ["debug=default", "method=distillspec", "method.num_layers=4"]
    r = _cli([*args, f"output_dir={tmp_path / 'new'}"])
    assert r.returncode == 2 and "error: method.num_layers=4 (method.student=truncate)" in r.stderr
    assert "the target has 2 decoder layers; a truncated student keeps 1..1 of them" in r.stderr
    assert not (tmp_path / "new").exists()
    (tmp_path / "mine").mkdir()
    r = _cli([*args, f"output_dir={tmp_path / 'mine'}"])
    assert r.returncode == 2 and list((tmp_path / "mine").iterdir()) == []


def test_resume_of_a_finished_run_changes_nothing(data_file, tmp_path):
    """resume=true on a run that finished validated again (a second row at its last step)
    and rewrote its summary with 0 tokens/s; it says there is nothing left to train, and a
    higher max_steps continues it."""
    from conftest import compose, tiny_overrides

    from trainer.train import run

    out = tmp_path / "run"
    over = {"train.max_steps": 3, "train.eval_every": 2}
    first = run(compose(tiny_overrides(data_file, out, **over)))
    (out / "summary.json").write_text(json.dumps(first))
    files = {p: p.read_bytes() for p in out.rglob("*") if p.is_file() and ".hydra" not in p.parts}
    again = run(compose(tiny_overrides(data_file, out, **over, resume=True)))
    assert again["already_finished"] and again["step"] == 3
    after = {p: p.read_bytes() for p in out.rglob("*") if p.is_file() and ".hydra" not in p.parts}
    assert after == files
    more = run(
        compose(tiny_overrides(data_file, out, **{**over, "train.max_steps": 4}, resume=True))
    )
    assert more["step"] == 4 and not more.get("already_finished")


def test_a_method_the_target_refuses_is_said_before_the_data_is_read(tmp_path):
    """A DFlash draft on a target with no spare token id for its mask used to be refused only
    after the whole dataset was tokenised (minutes of ShareGPT); the method is now built
    first, so a data file that cannot be read is never reached (one that is not there is
    refused before the target loads: test_robustness.py)."""
    from conftest import compose, tiny_overrides

    from models.base import DraftError
    from trainer.train import run

    out = tmp_path / "run"
    bad = tmp_path / "unreadable.jsonl"
    bad.write_text("not json\n")
    cfg = compose(tiny_overrides(bad, out, method="dflash"))
    with pytest.raises(DraftError, match="no spare token id for the mask"):
        run(cfg)


def test_init_from_a_head_of_another_target_says_so(data_file, tmp_path, capsys):
    """A head trained for other target weights of the same shapes started a run without a word
    (the evaluator warns of the same draft); init_from says whose head it was."""
    from conftest import compose, tiny_overrides

    from trainer.train import run

    over = {"train.max_steps": 2, "train.eval_every": 0, "train.save_every": 0}
    run(compose(tiny_overrides(data_file, tmp_path / "a", **over, **{"target.seed": 1})))
    capsys.readouterr()
    run(
        compose(
            tiny_overrides(data_file, tmp_path / "b", **over, **{"train.init_from": tmp_path / "a"})
        )
    )
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("init_from:"))
    assert "(warning: made for target tiny_random(seed=1)" in line and "seed=0" in line
    run(
        compose(
            tiny_overrides(data_file, tmp_path / "c", **over, **{"train.init_from": tmp_path / "b"})
        )
    )
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("init_from:"))
    assert "warning" not in line


def test_resume_of_a_run_out_of_time_changes_nothing(data_file, tmp_path):
    """A run stopped by train.max_minutes trained one more step on each resume=true (and
    rewrote final/); it says there is nothing left to train."""
    from conftest import compose, tiny_overrides

    from trainer.train import run

    out = tmp_path / "run"
    over = {"train.max_steps": 1000, "train.max_minutes": 0.002, "train.eval_every": 0}
    first = run(compose(tiny_overrides(data_file, out, **over)))
    assert first["reason"] == "time"
    (out / "summary.json").write_text(json.dumps(first))
    files = {p: p.read_bytes() for p in out.rglob("*") if p.is_file() and ".hydra" not in p.parts}
    again = run(compose(tiny_overrides(data_file, out, **over, resume=True)))
    assert again["already_finished"] and again["step"] == first["step"]
    after = {p: p.read_bytes() for p in out.rglob("*") if p.is_file() and ".hydra" not in p.parts}
    assert after == files
