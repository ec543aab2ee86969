"""Staying up: malformed data, kill -9 and resume, failed checkpoint writes, non-finite losses,
several processes, bad command lines, sweep summaries."""

from __future__ import annotations

import csv
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import (
    ROOT,
    accelerate_launch,
    compose,
    free_port,
    read_metrics,
    run_module,
    tiny_overrides,
)
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from data.conversations import DataError, load_conversations
from flow.app import check_group_choices
from trainer.checkpoint import CheckpointError, latest_checkpoint, validate_checkpoint
from trainer.train import run

# -- bad input: a fuzz test of the loader --------------------------------------------------------

good = st.builds(
    lambda q, a: {"conversations": [{"from": "human", "value": q}, {"from": "gpt", "value": a}]},
    st.text(min_size=1).filter(str.strip),
    st.text(min_size=1).filter(str.strip),
)
json_leaf = st.one_of(
    st.none(), st.booleans(), st.integers(), st.floats(allow_nan=False), st.text()
)
junk_value = st.recursive(
    json_leaf,
    lambda c: st.lists(c, max_size=3) | st.dictionaries(st.text(max_size=5), c, max_size=3),
)
bad_record = st.one_of(
    junk_value.filter(lambda v: not isinstance(v, dict)),  # not an object
    st.dictionaries(st.sampled_from(["id", "text", "conv"]), junk_value, max_size=3),  # no turns
    st.builds(lambda v: {"conversations": v}, json_leaf),  # turns not a list
    st.builds(lambda t: {"conversations": [t]}, junk_value),  # a turn of any shape
    st.builds(  # a role nobody knows
        lambda r: {"conversations": [{"from": r, "value": "x"}, {"from": "gpt", "value": "y"}]},
        st.text(max_size=6).filter(
            lambda r: (
                r.strip().lower()
                not in {
                    "human",
                    "user",
                    "gpt",
                    "assistant",
                    "system",
                    "chatgpt",
                    "bing",
                    "bard",
                    "model",
                }
            )
        ),
    ),
    st.builds(  # empty text
        lambda w: {
            "messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": w}]
        },
        st.sampled_from(["", "  ", "\n\t"]),
    ),
    st.just({"messages": [{"role": "user", "content": "only a question"}]}),  # nothing to learn
)
raw_line = st.one_of(
    st.just(b"{not json"),
    st.just(b'{"conversations": [}'),
    st.just(b"\xff\xfe\xfa invalid utf-8"),
    st.just(b"[" * 50_000 + b"]" * 50_000),  # nesting deep enough to overflow a recursive parser
    st.just(json.dumps({"conversations": [{"from": "human", "value": "x" * 2_000_000}]}).encode()),
)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    goods=st.lists(good, max_size=5),
    bads=st.lists(bad_record, max_size=8),
    raws=st.lists(raw_line, max_size=3),
    order=st.randoms(),
)
def test_loader_survives_malformed_records_and_counts_every_rejection(
    tmp_path_factory, goods, bads, raws, order
):
    lines = [json.dumps(r).encode() for r in goods + bads] + raws
    order.shuffle(lines)
    f = tmp_path_factory.mktemp("fuzz") / "data.jsonl"
    f.write_bytes(b"\n".join(lines) + b"\n")
    try:
        convs, report = load_conversations(f)
    except DataError as e:
        assert not goods and str(f) in str(e)  # nothing usable: one error naming the file
        return
    assert report.kept == len(convs) == len(goods)
    assert report.read == report.kept + sum(report.rejected.values())
    assert report.read == sum(1 for line in lines if line.strip())


# -- kill -9 mid-epoch, then resume ----------------------------------------------------------------

COMMON = {
    "train.save_every": 4,
    "train.keep_checkpoints": 10,
    "train.eval_every": 0,
    "train.log_every": 1,
    "train.record_samples": "true",
    "data.batch_size": 4,
}


def test_resume_after_kill_9_matches_an_uninterrupted_run(data_file, tmp_path):
    steps = 36  # 2.5 epochs of 14 batches
    # every run is its own process, as in real life (and bit-identical to each other)
    ref = tmp_path / "ref"
    r = run_module("flow", tiny_overrides(data_file, ref, **{**COMMON, "train.max_steps": steps}))
    assert r.returncode == 0, r.stderr[-2000:]

    out = tmp_path / "killed"
    args = tiny_overrides(data_file, out, **{**COMMON, "train.max_steps": steps})
    p = subprocess.Popen(
        [sys.executable, "-m", "flow", *args],
        cwd=ROOT,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.time() + 120
    killed_at = 0
    while time.time() < deadline:
        rows = read_metrics(out) if (out / "metrics.jsonl").exists() else []
        killed_at = max((r["step"] for r in rows), default=0)
        if killed_at >= 18:  # mid-epoch 1 (steps 15..28), past the checkpoint at 16
            break
        time.sleep(0.05)
    assert p.poll() is None, "the run finished before it could be killed"
    p.send_signal(signal.SIGKILL)  # no handler runs: a machine lost mid-step
    p.wait(timeout=30)
    assert killed_at >= 18, "training never got far enough"
    ck = latest_checkpoint(out)
    assert ck is not None and int(ck.name.split("_")[1]) >= 16

    r = run_module(
        "flow",
        tiny_overrides(data_file, out, **{**COMMON, "train.max_steps": steps, "resume": "true"}),
    )
    assert r.returncode == 0 and "resumed from" in r.stdout, r.stderr[-2000:]
    assert json.loads((out / "summary.json").read_text())["step"] == steps
    a = {r["step"]: r["loss"] for r in read_metrics(ref) if "loss" in r}
    b = {r["step"]: r["loss"] for r in read_metrics(out) if "loss" in r}
    assert sorted(b) == list(range(1, steps + 1))  # each step logged once
    for step in range(1, steps + 1):
        assert b[step] == pytest.approx(a[step], rel=1e-6, abs=1e-7), step
    # every sample of every finished epoch exactly once (the killed run's tail was dropped)
    rows = [json.loads(x) for x in (out / "samples-rank0.jsonl").read_text().splitlines()]
    ref_rows = [json.loads(x) for x in (ref / "samples-rank0.jsonl").read_text().splitlines()]
    assert rows == ref_rows
    n_train = len({i for r in ref_rows for i in r["index"]})
    for epoch in (0, 1):  # finished epochs: the killed one (1) included
        seen = [i for r in rows if r["epoch"] == epoch for i in r["index"]]
        assert len(seen) == len(set(seen)) == n_train, epoch


# -- a checkpoint write that fails halfway -----------------------------------------------------------


def test_data_that_is_not_there_is_refused_before_the_target_loads(tmp_path, monkeypatch):
    """A missing data file, or a folder with no data in it, is said before the target loads
    (minutes for a large one), in one line naming it."""
    import trainer.train as tt

    def no_load(*a, **k):
        raise AssertionError("the target loaded before the data was found")

    monkeypatch.setattr(tt, "load_target", no_load)
    (tmp_path / "empty").mkdir()
    for where, says in [
        (tmp_path / "no.jsonl", "no such file or folder"),
        (tmp_path / "empty", "folder holds no .json or .jsonl file"),
    ]:
        with pytest.raises(DataError, match=f"^{where}: {says}"):
            run(compose(tiny_overrides(where, tmp_path / "run")))


def test_failed_checkpoint_write_keeps_the_previous_one(data_file, tmp_path, monkeypatch):
    from accelerate import Accelerator

    real = Accelerator.save_state
    calls = {"n": 0}

    def flaky(self, output_dir=None, **kw):
        calls["n"] += 1
        if calls["n"] == 2:  # the second checkpoint: half written, then the disk is full
            Path(output_dir).mkdir(parents=True, exist_ok=True)
            (Path(output_dir) / "model.safetensors").write_bytes(b"partial")
            raise OSError(28, "No space left on device")
        return real(self, output_dir, **kw)

    monkeypatch.setattr(Accelerator, "save_state", flaky)
    out = tmp_path / "run"
    over = {"train.max_steps": 9, "train.save_every": 3, "train.eval_every": 0}
    with pytest.raises(CheckpointError, match=r"step_6.*No space left.*step_3 is intact"):
        run(compose(tiny_overrides(data_file, out, **over)))
    assert latest_checkpoint(out) == out / "checkpoints" / "step_3"
    validate_checkpoint(out / "checkpoints" / "step_3")
    assert not list((out / "checkpoints").glob(".tmp-*"))  # no debris
    monkeypatch.setattr(Accelerator, "save_state", real)
    s = run(compose(tiny_overrides(data_file, out, **{**over, "resume": "true"})))
    assert s["step"] == 9 and s["reason"] == "finished"


def test_partial_checkpoint_is_named_and_skipped(data_file, tmp_path):
    out = tmp_path / "run"
    run(
        compose(
            tiny_overrides(
                data_file,
                out,
                **{"train.max_steps": 6, "train.save_every": 3, "train.eval_every": 0},
            )
        )
    )
    (out / "checkpoints" / "step_6" / "COMPLETE").unlink()  # killed before the marker
    with pytest.raises(CheckpointError, match="step_6: incomplete checkpoint"):
        validate_checkpoint(out / "checkpoints" / "step_6")
    msgs = []
    assert latest_checkpoint(out, log=msgs.append) == out / "checkpoints" / "step_3"
    assert "step_6" in msgs[0]


# -- non-finite losses ---------------------------------------------------------------------------


def test_nonfinite_losses_are_skipped_then_stop_the_run_with_a_checkpoint(
    data_file, tmp_path, monkeypatch
):
    from models.eagle import EagleHead

    real = EagleHead.forward
    calls = {"n": 0}

    def poisoned(self, batch):
        out = real(self, batch)
        calls["n"] += 1
        if calls["n"] in (3,) or calls["n"] >= 6:  # one bad batch, later a run of them
            out.loss = out.loss * float("nan")
        return out

    monkeypatch.setattr(EagleHead, "forward", poisoned)
    out = tmp_path / "run"
    s = run(
        compose(
            tiny_overrides(
                data_file,
                out,
                **{
                    "train.max_steps": 50,
                    "train.max_nonfinite": 3,
                    "train.eval_every": 0,
                    "train.save_every": 0,
                },
            )
        )
    )
    assert s["reason"] == "nonfinite" and s["final"] is None
    # batches 1, 2, 4, 5 were good (batch 3 skipped alone); 6, 7, 8 bad in a row: stop at step 4
    assert s["step"] == 4
    ck = latest_checkpoint(out)
    assert ck == out / "checkpoints" / "step_4"
    state = json.loads((ck / "trainer_state.json").read_text())
    assert state["nonfinite_skipped"] == 4


def test_updates_the_fp16_loss_scaler_skips_are_not_steps_and_the_schedule_waits(
    data_file, tmp_path, monkeypatch
):
    """Under fp16 the loss scaler skips an update whose gradients overflowed (and lowers its
    scale): the weights stay as they were, so it is not a step, the learning-rate schedule does
    not move, and the checkpoint counts it. Stood in for by accelerate's own flag (a CPU run
    has no scaler): the run with two updates skipped logs the learning rates, steps and losses
    of the run without, two batches on."""
    from accelerate import Accelerator

    common = {
        "train.max_steps": 4,
        "train.eval_every": 0,
        "train.save_every": 4,
        "train.log_every": 1,
        "optim.warmup_steps": 3,
        "method.noise": 0.0,
    }
    plain = run(compose(tiny_overrides(data_file, tmp_path / "plain", **common)))
    calls = {"n": 0}

    def skipped(self):
        calls["n"] += 1
        return calls["n"] in (2, 3)  # the second and third updates overflowed

    monkeypatch.setattr(Accelerator, "optimizer_step_was_skipped", property(skipped))
    out = tmp_path / "fp16"
    s = run(compose(tiny_overrides(data_file, out, **common)))
    assert s["step"] == plain["step"] == 4 and calls["n"] == 6  # six updates asked for
    rows = [r for r in read_metrics(out) if "loss" in r]
    ref = [r for r in read_metrics(tmp_path / "plain") if "loss" in r]
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    assert [r["lr"] for r in rows] == [r["lr"] for r in ref]  # the warmup waited
    state = json.loads((out / "checkpoints" / "step_4" / "trainer_state.json").read_text())
    assert state["scaler_skipped"] == 2 and state["batch_in_epoch"] == 6


# -- several processes -------------------------------------------------------------------------------


def test_two_processes_match_one_with_the_same_global_batch(data_file, tmp_path):
    from safetensors.torch import load_file

    common = {
        "train.max_steps": 6,
        "train.eval_every": 0,
        "train.save_every": 3,
        "train.record_samples": "true",
        "method.noise": 0.0,  # the only randomness in a step; it would differ per process
        "data.batch_size": 2,
        "train.threads": 1,
        "optim.lr": 1e-3,
        "train.log_every": 1,
    }
    common_lr = 1e-3
    one = tmp_path / "one"
    run(compose(tiny_overrides(data_file, one, **{**common, "train.grad_accum": 2})))
    two = tmp_path / "two"
    r = accelerate_launch(2, tiny_overrides(data_file, two, **common))
    assert r.returncode == 0, r.stderr[-3000:]
    # the logged loss is the global batch's in both: the same at every step, up to the order
    # of floating-point reductions
    la = {r["step"]: r["loss"] for r in read_metrics(one) if "loss" in r}
    lb = {r["step"]: r["loss"] for r in read_metrics(two) if "loss" in r}
    assert sorted(la) == sorted(lb) == list(range(1, 7))
    for step in la:
        assert lb[step] == pytest.approx(la[step], rel=1e-5), step
    a = load_file(str(one / "final" / "model.safetensors"))
    b = load_file(str(two / "final" / "model.safetensors"))
    for k in a:  # Adam normalises updates, so weights agree to a fraction of one lr step
        assert (a[k] - b[k]).abs().max() < 0.05 * common_lr, k
    # each rank saw its own shard: together, step by step, the single run's micro-batches
    r0 = [json.loads(x) for x in (two / "samples-rank0.jsonl").read_text().splitlines()]
    r1 = [json.loads(x) for x in (two / "samples-rank1.jsonl").read_text().splitlines()]
    ref = [json.loads(x) for x in (one / "samples-rank0.jsonl").read_text().splitlines()]
    for x, y in zip(r0, r1, strict=True):
        assert x["step"] == y["step"] and not set(x["index"]) & set(y["index"])
    assert sorted(i for r in r0 + r1 for i in r["index"]) == sorted(
        i for r in ref for i in r["index"]
    )
    # only rank 0 writes logs and checkpoints
    assert len(read_metrics(two)) >= 1
    assert (two / "checkpoints" / "step_3").is_dir()
    assert sorted(p.name for p in two.iterdir() if p.name.startswith("samples")) == [
        "samples-rank0.jsonl",
        "samples-rank1.jsonl",
    ]


def test_resume_with_another_process_count_mid_epoch_says_what_is_supported(data_file, tmp_path):
    out = tmp_path / "run"
    run(compose(tiny_overrides(data_file, out, **{"train.max_steps": 3, "train.eval_every": 0})))
    r = accelerate_launch(
        2, tiny_overrides(data_file, out, **{"train.max_steps": 6, "resume": "true"})
    )
    assert r.returncode != 0
    assert "saved by 1 process(es) mid-epoch" in r.stderr and "epoch boundary" in r.stderr


_STAGGERED = """
import os, sys, time
time.sleep(1.5 * int(os.environ["RANK"]))  # reaches Hydra's ${now:...} a second later
sys.argv = ["flow", *sys.argv[1:]]
from flow.app import main
main()
"""


def test_processes_started_seconds_apart_share_the_default_time_stamped_folder(data_file, tmp_path):
    """The default output_dir (and a sweep's folder) is stamped with each process's own clock;
    the second process starts 1.5 s late, in another second: both must still write into the
    main process's folder (one checkpoint holding both processes' RNG states), and no other
    folder is left behind."""
    shim = tmp_path / "staggered.py"
    shim.write_text(_STAGGERED)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2"]
    cmd += ["--master_port", str(free_port()), str(shim)]
    common = ["target=tiny_random", f"data.path={data_file}", "data.max_records=24"]
    common += ["train.save_every=2", "train.progress=false", "method=eagle1"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}

    def launch(*args):
        r = subprocess.run(
            [*cmd, *args, *common], cwd=tmp_path, env=env, capture_output=True, text=True,
            timeout=120,  # ~12 s; before the fix, the two processes hung at the end
        )  # fmt: skip
        assert r.returncode == 0, r.stderr[-3000:]

    launch("train.max_steps=2")
    runs = list((tmp_path / "runs").iterdir())
    assert [p.name.split("-")[0] for p in runs] == ["eagle1"], runs
    step = runs[0] / "checkpoints" / "step_2"
    assert {"random_states_0.pkl", "random_states_1.pkl"} <= {p.name for p in step.iterdir()}
    assert (runs[0] / "final" / "model.safetensors").exists()

    launch("-m", "train.max_steps=1,2")
    sweeps = list((tmp_path / "multirun").iterdir())
    assert len(sweeps) == 1, sweeps
    assert {p.name for p in sweeps[0].iterdir()} >= {"0", "1", "summary.csv"}
    assert (sweeps[0] / "1" / "checkpoints" / "step_2" / "random_states_1.pkl").exists()


# -- command lines ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "args,needle",
    [
        (
            ["method=medusa9"],
            "method=medusa9: no such method (choose from dflash, distillspec, domino, dspark, eagle1, eagle3, eagle3_1",
        ),
        (["target=llama_huge"], "target=llama_huge: no such target"),
        (["-m", "method=eagle1,nope"], "method=nope: no such method"),
    ],
)
def test_unknown_group_options_are_one_line_errors(tmp_path, args, needle):
    r = run_module("flow", ["debug=default", f"output_dir={tmp_path / 'o'}", *args])
    assert r.returncode == 2 and needle in r.stderr, r.stderr[-2000:]
    assert len([x for x in r.stderr.splitlines() if x.strip()]) == 1


def test_group_check_leaves_valid_and_sweep_syntax_alone():
    assert check_group_choices(["method=eagle3", "train.max_steps=3", "data.path=x"]) is None
    assert check_group_choices(["method=choice(eagle1,eagle3)", "experiment=null"]) is None


# -- sweeps ----------------------------------------------------------------------------------------


def test_sweep_writes_a_sortable_summary(data_file, tmp_path):
    sweep = tmp_path / "sweep"
    r = run_module(
        "flow",
        [
            "-m",
            "debug=default",
            f"data.path={data_file}",
            "train.max_steps=2,4",
            "optim.lr=1e-3",
            "train.eval_every=0",
            f"output_dir={sweep}",  # a sweep's folder: the jobs in sweep/0, sweep/1
            f"data.cache_dir={tmp_path / 'cache'}",
        ],
        timeout=240,
    )
    assert r.returncode == 0, r.stderr[-2000:]
    assert f"sweep: the jobs write to {sweep}/<job>" in r.stdout
    assert (sweep / "0").is_dir() and (sweep / "1").is_dir()
    rows = list(csv.DictReader(open(sweep / "summary.csv")))
    assert len(rows) == 2 and all("train.max_steps=" in r["overrides"] for r in rows)
    assert sorted(int(r["step"]) for r in rows) == [2, 4]
    assert all("val/top1_pos1" in r and r["reason"] == "finished" for r in rows)
    md = (sweep / "summary.md").read_text()
    assert "sorted by val/alpha_pos1" in md and md.count("\n| ") >= 3
    # the table says once what every job shares; its rows, what sets them apart
    assert "Every job: `debug=default" in md and "optim.lr=" in md.splitlines()[1]
    assert "| train.max_steps=2 |" in md and "| train.max_steps=4 |" in md


def test_feature_cache_is_built_in_shards_by_every_process(data_file, tmp_path):
    out = tmp_path / "run"
    r = accelerate_launch(
        2,
        tiny_overrides(
            data_file,
            out,
            **{"train.max_steps": 2, "train.eval_every": 0, "data.cache_features": "true"},
        ),
    )
    assert r.returncode == 0, r.stderr[-3000:]
    stores = list((tmp_path / "cache" / "features").iterdir())
    assert len(stores) == 2  # train and validation
    for store in stores:
        meta = json.loads((store / "done.json").read_text())
        shards = set(meta["index"].values())
        assert {s.split("_")[1] for s in shards} == {"r0", "r1"}  # both processes wrote
        assert len(meta["index"]) == meta["samples"]  # and together every sample


def test_regeneration_shards_over_processes_and_merges_in_input_order(data_file, tmp_path):
    args = [
        "target=tiny_random",
        f"data.path={data_file}",
        "data.max_records=12",
        "max_new_tokens=6",
        "batch_size=2",
        "progress=false",
        "temperature=1.0",  # sampled: the seeds must not depend on the sharding
    ]
    one = run_module("flow.regenerate", [*args, f"out={tmp_path / 'one.jsonl'}"], 180)
    assert one.returncode == 0, one.stderr[-2000:]
    two = accelerate_launch(2, [*args, f"out={tmp_path / 'two.jsonl'}"], module="flow.regenerate")
    assert two.returncode == 0, two.stderr[-2000:]
    parts = sorted(p.name for p in (tmp_path / "two.jsonl.parts").glob("rank*.jsonl"))
    assert parts == ["rank0-of-2.jsonl", "rank1-of-2.jsonl"]
    assert (tmp_path / "one.jsonl").read_text() == (tmp_path / "two.jsonl").read_text()
    # the one-process output continued by two processes: each copies its share of what the
    # output holds (the replies marked, to show they are not written again) and writes the rest
    one = tmp_path / "one.jsonl"
    recs = [json.loads(x) for x in one.read_text().splitlines()]
    for r in recs:
        r["conversations"][1]["value"] = "KEPT"
    one.write_text("".join(json.dumps(r) + "\n" for r in recs))
    more = [a.replace("data.max_records=12", "data.max_records=16") for a in args]
    r = accelerate_launch(2, [*more, f"out={one}"], module="flow.regenerate")
    assert r.returncode == 0, r.stderr[-2000:]
    after = [json.loads(x) for x in one.read_text().splitlines()]
    kept = [a["id"] for a in after if a["conversations"][1]["value"] == "KEPT"]
    assert kept == [a["id"] for a in recs] and len(after) > len(recs)


@pytest.mark.parametrize(
    "config,args,said",
    [
        (
            "train",
            ["train.max_stepz=1"],
            "train.max_stepz=1: no such setting; did you mean train.max_steps?",
        ),
        (
            "eval",
            ["draft=none", "tempreature=1"],
            "tempreature=1: no such setting; did you mean temperature?",
        ),
        (
            "prepare",
            ["out=x.jsonl", "max_new_token=3"],
            "max_new_token=3: no such setting; did you mean max_new_tokens?",
        ),
        (
            "eval",
            ["gamma=abc"],
            "gamma=abc: Value 'abc' of type 'str' could not be converted to Integer",
        ),
        ("eval", ["+nosuchkey=1"], "+nosuchkey: no such setting (the command would ignore it)"),
        ("train", ["+train.foo=1"], "+train.foo: no such setting (the command would ignore it)"),
        (
            "train",
            ["-m", "method=eagle1,eagle3", "--cfg", "job"],
            "-m with --cfg: Hydra prints one job's config, not a sweep's; drop -m and give one "
            "value per key (e.g. method=eagle3 --cfg job)",
        ),
        ("eval", ["--info", "-c", "job"], "--cfg and --info: Hydra takes one of them at a time"),
    ],
)
def test_a_key_that_names_no_setting_is_one_line(config, args, said):
    """Hydra answers a misspelled key with a screen (and exit 1), and takes +key=value for a
    key the typed schema lacks, which the command then ignores: both are one line first."""
    import decoding.eval  # noqa: F401  the schemas are registered on import
    import flow.regenerate  # noqa: F401
    from conf.cli import check_command_line

    assert check_command_line(config, args) == said


def test_the_command_line_check_leaves_good_lines_sweeps_and_free_mappings_alone():
    import decoding.eval  # noqa: F401
    import flow.regenerate  # noqa: F401
    from conf.cli import check_command_line

    assert (
        check_command_line("train", ["method=eagle3", "train.max_steps=3", "optim.lr=1e-4"]) is None
    )
    assert check_command_line("train", ["-m", "method=eagle1,eagle3"]) is None
    assert check_command_line("train", ["method=eagle3", "--cfg", "job"]) is None
    assert check_command_line("eval", ["engine=vllm", "draft=runs/x", "gamma=2"]) is None
    assert check_command_line("prepare", ["out=x", "+engine_args.tensor_parallel_size=2"]) is None


def test_a_misspelled_key_on_each_command_line_exits_2_in_one_line(tmp_path):
    for module, args in [
        ("decoding.eval", ["draft=none", "gama=3"]),
        ("flow.regenerate", [f"out={tmp_path / 'o.jsonl'}", "max_new_token=3"]),
        ("flow", [f"output_dir={tmp_path / 'run'}", "optim.lrr=1"]),
    ]:
        r = run_module(module, args)
        lines = [x for x in r.stderr.splitlines() if x.strip()]
        assert r.returncode == 2 and len(lines) == 1 and "no such setting" in lines[0], r.stderr
    assert not (tmp_path / "run").exists()


def test_a_sweeps_output_dir_is_its_folder_and_one_swept_over_is_refused():
    from flow.app import sweep_into_output_dir
    from trainer.train import ConfigError

    one = ["train.max_steps=2"]
    assert sweep_into_output_dir(["output_dir=x", *one]) == (["output_dir=x", *one], None)
    assert sweep_into_output_dir(["-m", *one]) == (["-m", *one], None)
    argv = ["-m", "output_dir=x", "hydra.sweep.dir=y"]
    assert sweep_into_output_dir(argv) == (argv, None)  # the line's own sweep folder wins
    assert sweep_into_output_dir(["-m", "output_dir=runs/s"]) == (
        ["-m", "output_dir=runs/s", "hydra.sweep.dir=runs/s"],
        "sweep: the jobs write to runs/s/<job>",
    )
    with pytest.raises(ConfigError, match="output_dir=a,b: a sweep writes each job"):
        sweep_into_output_dir(["-m", "output_dir=a,b"])


# -- signals: a long command stops at a boundary and keeps what it has -------------------------


def test_stop_signals_defer_the_first_signal_and_raise_on_the_second():
    from conf.cli import Stopped, StopSignals, exit_code_of

    before = signal.getsignal(signal.SIGTERM)
    # SIGINT as in a terminal's foreground job, whatever this test process inherited
    old_int = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        with StopSignals() as sig:
            assert StopSignals.requested() is None
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(0.01)  # the handler runs at the next bytecode boundary
            assert sig.caught == signal.SIGTERM and StopSignals.requested() == signal.SIGTERM
            with pytest.raises(Stopped) as e:
                os.kill(os.getpid(), signal.SIGINT)
                time.sleep(0.01)
            assert exit_code_of(e.value) == 130
    finally:
        signal.signal(signal.SIGINT, old_int)
    assert signal.getsignal(signal.SIGTERM) is before and StopSignals.requested() is None
    assert exit_code_of(KeyboardInterrupt()) == 130


def test_stop_signals_at_once_nested_and_an_ignored_sigint_left_ignored():
    from conf.cli import Stopped, StopSignals

    with StopSignals() as outer:
        with StopSignals(deferred=False), pytest.raises(Stopped) as e:
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(0.01)
        assert e.value.exit_code == 143
        assert outer.caught is None  # the inner one ruled while open
    old = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        with StopSignals() as sig:  # a background job of a script: Ctrl-C is not for it
            assert signal.getsignal(signal.SIGINT) == signal.SIG_IGN
            assert signal.getsignal(signal.SIGTERM) == sig._handle
    finally:
        signal.signal(signal.SIGINT, old)


# SIGTERM after the second prompt's speculative decode, from inside the run: no race with time
_SIGNAL_AFTER = """
import os, signal, sys
from decoding.decoder import SpeculativeDecoder
gen, calls = SpeculativeDecoder.generate, []
def generate(self, *a, **k):
    out = gen(self, *a, **k)
    if self.proposer.__class__.__name__ != "NoDraft":
        calls.append(1)
        if len(calls) == {after}:
            os.kill(os.getpid(), signal.{sig})
    return out
SpeculativeDecoder.generate = generate
from decoding.eval import main
sys.argv = ["specdraft-eval", *sys.argv[1:]]
main()
"""


def _eval_signalled(tmp_path, after: int, sig: str, *args: str):
    code = _SIGNAL_AFTER.replace("{after}", str(after)).replace("{sig}", sig)
    # a child whose SIGINT is at its default whatever this process inherited
    return subprocess.run(
        [sys.executable, "-c", code, "target=tiny_random", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )


def test_eval_stopped_by_a_signal_writes_its_report_on_the_prompts_finished(tmp_path):
    rep = tmp_path / "r.json"
    args = ["draft=ngram", "num_prompts=6", "max_new_tokens=12", "turns=1", f"report={rep}"]
    # the warm-up is the first speculative decode, so the signal lands in prompt 2
    r = _eval_signalled(tmp_path, 3, "SIGTERM", *args)
    assert r.returncode == 143, r.stderr[-2000:]
    assert "SIGTERM: stopping after this prompt" in r.stderr
    assert "STOPPED by SIGTERM after 2 of 6 prompts" in r.stdout
    d = json.loads(rep.read_text())
    assert d["stopped"] == {"signal": "SIGTERM", "prompts": 2, "asked": 6}
    assert len(d["outputs"]) == 2 and d["lossless"] is True
    # the figures are those two prompts' only: every emitted token is one of their outputs
    assert d["new_tokens"] == sum(t["spec_tokens"] for o in d["outputs"] for t in o["turns"])
    # stopped before any prompt finished: one line, nothing written
    rep.unlink()
    r = _eval_signalled(tmp_path, 1, "SIGINT", *args)
    assert r.returncode == 130, r.stderr[-2000:]
    assert r.stderr.strip().splitlines()[-1] == "stopped by SIGINT: no report written"
    assert "Traceback" not in r.stderr and not rep.exists()


def test_an_engine_run_stops_between_prompts_on_a_signal(tiny_target):
    from types import SimpleNamespace

    from conf.cli import Stopped, StopSignals
    from decoding.engines.base import Completion, run_bench

    class Echo:  # an engine answering with its prompt's last token; a signal at call ``at``
        def __init__(self, at: int):
            self.calls, self.at = 0, at

        def complete(self, prompt, n_predict, **kw):
            self.calls += 1
            if self.calls == self.at:
                os.kill(os.getpid(), signal.SIGTERM)
            return Completion([prompt[-1]] * 3, {"predicted_n": 3, "predicted_ms": 1.0})

    cfg = SimpleNamespace(
        temperature=0.5, sample_top_k=0, top_p=1.0, turns=1, max_new_tokens=3, seed=0
    )
    qs = [{"question_id": i, "category": "c", "turns": [f"q{i}"]} for i in range(5)]
    tok = tiny_target.tokenizer
    with StopSignals():  # signalled in prompt 2's plain request: prompt 2 finishes, 3 never starts
        run = run_bench(Echo(2), Echo(0), qs, cfg, tok, set(), "echo")
    assert run.stopped == signal.SIGTERM and run.finished
    assert [o["question_id"] for o in run.outputs] == [0, 1]
    assert run.pooled.requests == 2 and run.pooled.tokens == 6
    with StopSignals(), pytest.raises(Stopped):  # signalled before prompt 1: nothing to report
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.01)
        run_bench(Echo(0), Echo(0), qs, cfg, tok, set(), "echo")


def test_a_sweeps_keys_are_checked_as_a_single_runs_are():
    """``-m +optim.lrr=1e-4,3e-4`` (Hydra's own advice for a key it does not know) trained
    every job with the default lr under a summary showing them as different: a sweep's line
    is checked by its first job's values; lists, quoted commas and sweep functions pass."""
    from conf.cli import check_command_line

    assert check_command_line("train", ["-m", "+optim.lrr=1e-4,3e-4"]) == (
        "+optim.lrr: no such setting (the command would ignore it); did you mean optim.lr?"
    )
    assert check_command_line("train", ["-m", "optim.lrr=1e-4,3e-4"]).startswith(
        "optim.lrr=1e-4: no such setting"
    )
    assert check_command_line("train", ["--multirun", "train.max_steps=ten,5"]).startswith(
        "train.max_steps=ten: "
    )
    good = ["-m", "method=eagle1,eagle3", "optim.lr=range(1,3)", "train.seed=choice(1,2)"]
    assert check_command_line("train", good) is None
    assert check_command_line("eval", ["-m", "batch_sizes=[1,4],[16]", "gamma=2,3"]) is None


def test_a_path_starting_with_a_tilde_is_the_home_folder_on_every_command_line(tmp_path):
    """Shells leave ``~`` after ``=`` alone and Hydra's grammar has no value starting with it
    (its error reads LexerNoViableAltException): the commands expand it themselves."""
    from conf.cli import check_command_line, home_expanded

    home = os.path.expanduser("~")
    assert home_expanded(["draft=~/runs/x", "~optim.lr", "gamma=2", "-m", "data.path=~"]) == [
        f"draft={home}/runs/x",
        "~optim.lr",
        "gamma=2",
        "-m",
        f"data.path={home}",
    ]
    assert home_expanded(["output_dir=~/a,~/b,c~/d"]) == [f"output_dir={home}/a,{home}/b,c~/d"]
    assert check_command_line("eval", home_expanded(["draft=~/runs/x"])) is None
    # the whole command: the draft is looked for in the home folder
    env = {**os.environ, "HOME": str(tmp_path)}
    r = subprocess.run(
        [sys.executable, "-m", "decoding.eval", "draft=~/no-such-run", "target=tiny_random"],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert r.returncode == 2, r.stderr
    assert f"draft={tmp_path}/no-such-run: no such folder" in r.stderr, r.stderr
