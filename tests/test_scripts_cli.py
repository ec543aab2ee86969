"""The command lines of the memory plan, the long-prompt and later-turn writers and the training
throughput benchmark: what they cannot use is one line on stderr (``error: ...``, status 2)
naming the flag, key or file, never a traceback, and no file the user has is written over."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import script_outcome as _outcome

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
LLAMA_70B = f"target.path={ROOT / 'scripts' / 'model_configs' / 'llama-3.3-70b-instruct'}"


def _refused(rc, out: str, err: str) -> str:
    """The one error line of a refusal (status 2, nothing else on stderr)."""
    assert rc == 2, (rc, out, err)
    assert err.count("\n") == 1 and err.startswith("error: ") and "Traceback" not in err, err
    return err


# --------------------------------------------------------------------------------- memory plan


@pytest.mark.parametrize(
    "arg, says",
    [
        ("method=nope", "method=nope: no such method (choose from "),
        ("foo=1", "foo=1: no such setting"),
        ("data.max_length=abc", "data.max_length=abc: "),
        ("gpu_memory_gb=-1", "gpu_memory_gb=-1: must be a number of GiB > 0"),
        ("gpu_memory_gb=0", "gpu_memory_gb=0: must be a number of GiB > 0"),
        ("data.batch_size=0", "data.batch_size=0: must be >= 1"),  # as specdraft-train says
        ("train.log_every=0", "train.log_every=0: must be >= 1"),
    ],
)
def test_memory_plan_refuses_what_the_trainer_refuses_in_one_line(monkeypatch, capsys, arg, says):
    rc, out, err = _outcome("memory_plan", monkeypatch, capsys, LLAMA_70B, "method=eagle3", arg)
    assert says in _refused(rc, out, err) and out == ""


def test_memory_plan_still_plans_a_good_command_line(monkeypatch, capsys):
    rc, out, err = _outcome(
        "memory_plan", monkeypatch, capsys, LLAMA_70B, "method=eagle3", "gpu_memory_gb=141"
    )
    assert rc == 0 and err == "" and "of 141.00 GiB" in out and "%)" in out


# -------------------------------------------------------------------------------- long prompts


def test_long_prompts_writes_a_bench_file_of_the_tiny_targets_prompts(
    tmp_path, monkeypatch, capsys
):
    out = tmp_path / "long.jsonl"
    args = ("--target", "tiny_random", "--tokens", "64", "--num", "2", "--out", str(out))
    rc, text, err = _outcome("long_prompts", monkeypatch, capsys, *args)
    assert rc == 0, err
    recs = [json.loads(x) for x in out.read_text().splitlines()]
    assert [r["question_id"] for r in recs] == [0, 1] and recs[0]["category"] == "long64"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["long.jsonl"]  # no .tmp left


def test_long_prompts_never_writes_over_an_existing_file(tmp_path, monkeypatch, capsys):
    out = tmp_path / "mine.jsonl"
    out.write_text("the user's prompts\n")
    args = ("--target", "tiny_random", "--tokens", "64", "--num", "1", "--out", str(out))
    rc, text, err = _outcome("long_prompts", monkeypatch, capsys, *args)
    assert f"--out {out}: exists; choose a new file" in _refused(rc, text, err)
    assert out.read_text() == "the user's prompts\n"


@pytest.mark.parametrize(
    "args, says",
    [
        (["--target", "nope"], "--target nope: "),
        (["--num", "0"], "--num 0: must be >= 1"),
        (["--tokens", "-5"], "--tokens -5: must be >= 1"),
        (["--out", "{tmp}/no/such/folder/x.jsonl"], "no folder {tmp}/no/such/folder"),
    ],
)
def test_long_prompts_refuses_bad_arguments_in_one_line(tmp_path, monkeypatch, capsys, args, says):
    args = [a.format(tmp=tmp_path) for a in args]
    base = ["--target", "tiny_random", "--tokens", "64", "--num", "1"]
    base += ["--out", str(tmp_path / "x.jsonl")]
    rc, out, err = _outcome("long_prompts", monkeypatch, capsys, *base, *args)
    assert says.format(tmp=tmp_path) in _refused(rc, out, err)
    assert list(tmp_path.iterdir()) == []  # nothing written


# --------------------------------------------------------------------------------- later turns


def test_later_turns_keep_the_conversations_system_message(tmp_path, monkeypatch, capsys):
    """Each later turn used to lose the conversation's system message, which still holds."""
    from data.conversations import load_conversations

    long = "please explain it once more, this time with an example of each"
    turns = [("system", "Answer as a pirate."), ("human", "hi"), ("gpt", "arr")]
    turns += [("human", long), ("gpt", "arr, an example")]
    src = tmp_path / "in.jsonl"
    src.write_text(
        json.dumps({"id": "a", "conversations": [{"from": f, "value": v} for f, v in turns]})
        + "\n"
        + json.dumps({"id": "b", "conversations": [{"from": f, "value": v} for f, v in turns[1:]]})
        + "\n"
    )
    out = tmp_path / "lt.jsonl"
    rc, _, err = _outcome("later_turns", monkeypatch, capsys, "--data", str(src), "--out", str(out))
    assert rc == 0, err
    convs, _ = load_conversations(out)
    assert [c.id for c in convs] == ["a:turn2", "b:turn2"]
    assert [m["role"] for m in convs[0].messages] == ["system", "user", "assistant"]
    assert convs[0].messages[0]["content"] == "Answer as a pirate."
    assert [m["role"] for m in convs[1].messages] == ["user", "assistant"]


def test_later_turns_checks_the_out_folder_before_writing(tmp_path, monkeypatch, capsys):
    src = tmp_path / "in.jsonl"
    src.write_text(json.dumps({"id": "a", "conversations": [{"from": "human", "value": "hi"}]}))
    out = tmp_path / "missing" / "lt.jsonl"
    rc, text, err = _outcome(
        "later_turns", monkeypatch, capsys, "--data", str(src), "--out", str(out)
    )
    assert f"--out {out}: no folder {out.parent}" in _refused(rc, text, err)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in.jsonl"]


@pytest.mark.parametrize(
    "args, says",
    [
        (["--min-chars", "-1"], "--min-chars -1: must be >= 0"),
        (["--max-turn", "1"], "--max-turn 1: must be >= 2"),
        (["--out", "{tmp}/in.jsonl"], "--out {tmp}/in.jsonl: exists; choose a new file"),
    ],
)
def test_later_turns_refuses_bad_arguments_in_one_line(tmp_path, monkeypatch, capsys, args, says):
    src = tmp_path / "in.jsonl"
    src.write_text("kept\n")
    base = ["--data", str(src), "--out", str(tmp_path / "lt.jsonl")]
    rc, out, err = _outcome(
        "later_turns", monkeypatch, capsys, *base, *[a.format(tmp=tmp_path) for a in args]
    )
    assert says.format(tmp=tmp_path) in _refused(rc, out, err)
    assert src.read_text() == "kept\n" and not (tmp_path / "lt.jsonl").exists()


# ---------------------------------------------------------------------- training throughput


def test_bench_modes_and_overrides_after_them_are_told_apart():
    from bench_train_throughput import split_modes

    words = ["fp32:train.mixed_precision=no", "bf16", "target=tiny_random", "data.path=/a:b"]
    modes, overrides = split_modes([*words, "cached:data.cache_features=true"])
    assert modes == [
        ("fp32", "train.mixed_precision=no"),
        ("bf16", ""),
        ("cached", "data.cache_features=true"),
    ]
    assert overrides == ["target=tiny_random", "data.path=/a:b"]


@pytest.mark.parametrize(
    "args, says",
    [  # 3 steps log no window at train.log_every=5
        (
            ["--steps", "3", "--modes", "fp32:train.mixed_precision=no", "target=tiny_random"],
            "mode fp32: 3 steps at train.log_every=5 log 0 window(s); tokens/s needs >= 2 "
            "(the first holds warm-up): --steps >= 10",
        ),
        # an override after --modes applies to the mode (it is no mode of its own)
        (
            ["--steps", "6", "--modes", "a:", "target=tiny_random", "train.log_every=4"],
            "mode a: 6 steps at train.log_every=4 log 1 window(s)",
        ),
        (["--modes", "a:", "target=tiny_random", "foo=1"], "mode a: foo=1: no such setting"),
        (["--modes", "a:", "method=nope"], "mode a: method=nope: no such method"),
        (["--modes", "a:data.batch_size=0"], "mode a: data.batch_size=0: must be >= 1"),
        (["--modes", "target=tiny_random"], "--modes: no mode given"),
        (["--modes", "a:", "a:target=tiny_random"], "--modes: mode a given twice"),
        (["--records", "0"], "--records 0: must be >= 1"),
        (["--bogus"], "--bogus: no such option"),
    ],
)
def test_bench_refuses_before_training_in_one_line(tmp_path, monkeypatch, capsys, args, says):
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", None)  # mkdtemp reads TMPDIR again
    rc, out, err = _outcome(
        "bench_train_throughput", monkeypatch, capsys, "--method", "eagle1", *args
    )
    assert says in _refused(rc, out, err)
    assert list(tmp_path.iterdir()) == []  # nothing ran, nothing left behind


def test_bench_reports_steps_run_and_the_targets_width_and_refuses_a_one_window_mode(
    tmp_path, data_file
):
    """Two modes on the tiny target (hidden size 64): the first measures; the second runs out
    of data after 3 steps (one window at log_every=2) and is refused in one line, not reported
    as 0 tokens/s; the first mode's result is kept."""
    cmd = [sys.executable, str(ROOT / "scripts" / "bench_train_throughput.py")]
    cmd += ["--method", "eagle1", "--steps", "4", "--records", "40"]
    cmd += ["--modes", "ok:", "short:data.max_records=12"]
    cmd += ["target=tiny_random", f"data.path={data_file}", "train.log_every=2"]
    env = {**os.environ, "TMPDIR": str(tmp_path), "PYTHONUNBUFFERED": "1"}
    r = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    lines = [x for x in r.stderr.splitlines() if x.startswith(("error", "Traceback"))]
    assert r.returncode == 2 and len(lines) == 1, r.stderr[-3000:]
    assert lines[0].startswith("error: mode short: the run stopped at step 3 (finished)")
    assert "logging 1 window(s) at train.log_every=2" in lines[0] and ">= 4 steps" in lines[0]
    (done,) = tmp_path.glob("bench-train-*/results.json")
    assert f"results of the 1 mode(s) done: {done}" in r.stdout
    (ok,) = json.loads(done.read_text())
    assert ok["mode"] == "ok" and ok["steps"] == 4 and ok["hidden_size"] == 64
    assert ok["tokens_per_s"] > 0 and set(ok["matmul_rate"]) == {"fp32", "bf16"}


def test_bench_table_heads_with_the_batch_trained_and_the_machine(capsys):
    """The table's first line said batch 4, max_length 512 whatever was given, and named the
    architecture (x86_64) instead of the machine."""
    from argparse import Namespace

    from bench_train_throughput import _table

    from decoding.engines.base import cpu_name

    row = {"mode": "a", "steps": 3, "tokens_per_s": 10.0, "draft_gflop_per_token": 1.0}
    row |= {"target_gflop_per_token": 0.0, "achieved_gflops": 1.0, "peak": 2.0}
    row |= {"hidden_size": 64, "matmul_rate": {"fp32": 2.0, "bf16": 2.0}, "cache_build_s": None}
    args = Namespace(method="eagle1", steps=3, records=40)
    extra = ["data.batch_size=8", "target=tiny_random", "data.batch_size=16"]
    _table(args, [row], extra, ["data.batch_size=4", "data.max_length=512", *extra])
    head = capsys.readouterr().out.strip().splitlines()[0]
    assert "batch 16, max_length 512," in head
    import torch

    assert (torch.cuda.get_device_name(0) if torch.cuda.is_available() else cpu_name()) in head
