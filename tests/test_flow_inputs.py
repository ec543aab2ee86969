"""The training command's inputs and records (flow/app.py, conf/cli.py, the sweep summary): what
a command line asks for is what runs or one line says why not, a sweep's summary tabulates that
sweep's jobs, and the exit status says whether every stage did its part."""

from __future__ import annotations

import csv
import json
import os
import sys
import time

import pytest
from conftest import compose, finished_training_run

import flow.app as app
from trainer.train import ConfigError


def _main(monkeypatch, *args: str) -> int:
    """``specdraft-train args`` in this process; its exit status."""
    monkeypatch.setattr(sys, "argv", ["specdraft-train", *args])
    try:
        app.main()
    except SystemExit as e:
        return int(e.code or 0)
    return 0


def _never(cfg):
    pytest.fail("it trained")


def _one_line(err: str) -> str:
    lines = [x for x in err.splitlines() if x.strip()]
    assert len(lines) == 1, err
    return lines[0]


# -- the sweep summary --------------------------------------------------------------------------


def test_a_sweep_run_again_into_its_folder_tabulates_its_own_jobs(tmp_path, monkeypatch, capsys):
    """A sweep run again into the same folder listed the earlier sweep's rows as finished while
    its closing line said the same jobs were refused. Its table is now its own jobs: one it
    refused whose folder holds the same job run before shows that run's results, marked as an
    earlier run; one whose folder holds another job's shows this sweep's overrides and the
    error, not the other's results; a line names the earlier sweep's folders left out."""
    monkeypatch.setattr(app, "train_measure_serve", finished_training_run)
    sweep = tmp_path / "sweep"
    assert _main(monkeypatch, "-m", f"hydra.sweep.dir={sweep}", "optim.lr=0.001,0.003,0.005") == 0
    past = time.time() - 3600  # the earlier sweep ran an hour ago
    for p in sweep.rglob("*"):
        os.utime(p, (past, past))
    before = {p: p.read_bytes() for p in sweep.glob("[012]/**/*") if p.is_file()}
    capsys.readouterr()

    code = _main(monkeypatch, "-m", f"hydra.sweep.dir={sweep}", "optim.lr=0.001,0.002")
    assert code == 2
    assert "2 job(s) of the sweep were refused" in capsys.readouterr().err
    assert {p: p.read_bytes() for p in sweep.glob("[012]/**/*") if p.is_file()} == before
    md = (sweep / "summary.md").read_text()
    assert md.splitlines()[0] == f"Sweep {sweep}: 2 jobs"
    assert "Not in this table: job folder(s) 2, of an earlier sweep" in md
    assert md.count("| finished (an earlier run, kept) |") == 1 and md.count("| refused |") == 1
    assert "| 1 | optim.lr=0.002 | refused |" in md  # this sweep's value, not 0.003
    rows = list(csv.DictReader(open(sweep / "summary.csv")))
    assert [(r["job"], r["reason"]) for r in rows] == [
        ("0", "finished (an earlier run, kept)"),
        ("1", "refused"),
    ]
    assert rows[0]["val/loss"] == "0.001" and "holds a run already" in rows[1]["error"]

    # a third sweep there, resuming: its jobs are its own again, and no note of the second's
    capsys.readouterr()
    assert (
        _main(monkeypatch, "-m", f"hydra.sweep.dir={sweep}", "optim.lr=0.001", "resume=true") == 0
    )
    rows = list(csv.DictReader(open(sweep / "summary.csv")))
    assert [(r["job"], r["reason"]) for r in rows] == [("0", "finished")]
    assert not list(sweep.glob("refused-*.json"))


def _job(sweep, name: str, overrides: list[str], summary: dict) -> None:
    (sweep / name / ".hydra").mkdir(parents=True)
    (sweep / name / ".hydra" / "overrides.yaml").write_text("".join(f"- {o}\n" for o in overrides))
    (sweep / name / "summary.json").write_text(json.dumps(summary))


def test_the_summary_sorts_a_loss_lowest_first_and_says_when_sort_by_names_no_column(tmp_path):
    """``sort_by=val/loss`` put the highest loss first under "best first"; a misspelled
    ``sort_by`` said the table was sorted by it; a column of text failed the sweep's end with a
    traceback (``bad operand type for unary -``)."""
    from conf.sweep import write_summary

    for i, loss in enumerate([0.5, 0.2, 0.9]):
        _job(tmp_path, str(i), [f"optim.lr={i}"], {"reason": "finished", "val": {"loss": loss}})

    def order(sort_by):
        md = write_summary(tmp_path, sort_by).read_text()
        rows = [x.split(" | ")[0].strip("| ") for x in md.splitlines() if x.startswith("| ")]
        return md.splitlines()[0], rows[1:]

    assert order("val/loss") == (
        f"Sweep {tmp_path}: 3 jobs, sorted by val/loss (lowest first)",
        ["1", "0", "2"],
    )
    head, rows = order("val/los")
    assert rows == ["0", "1", "2"]
    assert head.startswith(f"Sweep {tmp_path}: 3 jobs, not sorted: sort_by=val/los names no column")
    assert order("reason")[1] == ["0", "1", "2"]


def test_the_summary_shows_how_busy_the_machine_was_beside_each_jobs_tokens_per_s(tmp_path):
    """Jobs run side by side (a parallel launcher) or beside other work train slower: each
    row says how many cores other processes kept busy while it trained."""
    from conf.sweep import write_summary

    load = {"cores": 2, "seconds": 60.0, "others_busy_cores": 0.93}
    _job(tmp_path, "0", ["optim.lr=1"], {"reason": "finished", "tokens_per_s": 50.0})
    _job(
        tmp_path,
        "1",
        ["optim.lr=2"],
        {"reason": "finished", "tokens_per_s": 20.0, "other_load": load},
    )
    write_summary(tmp_path)
    rows = list(csv.DictReader(open(tmp_path / "summary.csv")))
    assert [r["others_busy_cores"] for r in rows] == ["", "0.93"]


def test_a_summary_row_keeps_its_columns_whatever_its_error_says(tmp_path):
    """An error with a "|" (a union type, a path) or a second line started another column or
    row of the table: each row has as many cells as the header."""
    from conf.sweep import write_summary

    _job(
        tmp_path,
        "0",
        ["data.path=a|b.jsonl"],
        {"reason": "refused", "error": "x: int | None\nmore"},
    )
    _job(tmp_path, "1", ["data.path=c.jsonl"], {"reason": "finished", "step": 2})
    md = write_summary(tmp_path).read_text()
    table = [x for x in md.splitlines() if x.startswith("|")]
    assert len(table) == 4
    width = {len(x.replace("\\|", "").split("|")) for x in table}
    assert width == {len(table[0].split("|"))}, md
    assert "x: int \\| None more" in md


def test_a_sweep_job_failing_unexpectedly_leaves_a_summary_and_exit_1(
    tmp_path, monkeypatch, capsys
):
    """An unexpected error in one job: Hydra ran the others, then ended with that traceback and
    no summary of any job. The summary is written (that job's row says how it failed), the
    traceback is kept, and the sweep ends with status 1 naming the job."""

    def flaky(cfg):
        if cfg.optim.lr == 0.002:
            raise RuntimeError("boom")
        return finished_training_run(cfg)

    monkeypatch.setattr(app, "train_measure_serve", flaky)
    sweep = tmp_path / "sweep"
    assert _main(monkeypatch, "-m", f"hydra.sweep.dir={sweep}", "optim.lr=0.001,0.002,0.003") == 1
    err = capsys.readouterr().err
    assert "Traceback" in err and "RuntimeError: boom" in err
    assert (
        f"1 job(s) of the sweep failed (see each one's traceback above, and the summary): {sweep / '1'}"
        in err
    )
    rows = list(csv.DictReader(open(sweep / "summary.csv")))
    assert [(r["job"], r["reason"]) for r in rows] == [
        ("0", "finished"),
        ("1", "failed"),
        ("2", "finished"),
    ]
    assert rows[1]["error"] == "RuntimeError: boom"


def test_a_sweep_stopped_by_a_signal_leaves_the_summary_of_the_jobs_it_ran(
    tmp_path, monkeypatch, capsys
):
    """A scheduler's SIGTERM in the second job: the sweep stops there with 143 (Hydra calls no
    end-of-sweep callback then), and the summary holds the jobs it ran, the stopped one as
    such; the third job never ran."""
    import signal

    ran = []

    def stopped(cfg):
        ran.append(cfg.optim.lr)
        if cfg.optim.lr != 0.002:
            return finished_training_run(cfg)
        summary = {"reason": "signal", "signal": int(signal.SIGTERM), "step": 1}
        with open(f"{cfg.output_dir}/summary.json", "w") as f:
            f.write(json.dumps(summary))
        return summary

    monkeypatch.setattr(app, "train_measure_serve", stopped)
    sweep = tmp_path / "sweep"
    code = _main(monkeypatch, "-m", f"hydra.sweep.dir={sweep}", "optim.lr=0.001,0.002,0.003")
    assert code == 143 and ran == [0.001, 0.002]
    err = capsys.readouterr().err
    assert f"sweep summary: {sweep / 'summary.md'}" in err and "stopped at job 1" in err
    rows = list(csv.DictReader(open(sweep / "summary.csv")))
    assert [(r["job"], r["reason"]) for r in rows] == [("0", "finished"), ("1", "signal")]


# -- train.eval_after ---------------------------------------------------------------------------


@pytest.mark.parametrize("sweep", [False, True], ids=["run", "sweep"])
def test_a_current_folder_nothing_can_be_written_in_is_one_line(monkeypatch, capsys, sweep):
    """No folder named, the run goes under ``runs/`` of the current folder: one that takes no
    file was Hydra's mkdir traceback."""
    monkeypatch.setattr(app, "train_measure_serve", _never)
    monkeypatch.chdir("/proc")
    flag = ["-m"] if sweep else []
    assert _main(monkeypatch, *flag, "target=tiny_random") == 2
    assert _one_line(capsys.readouterr().err) == (
        "error: the run's folder goes under runs/ by default: nothing can be written in /proc "
        "(No such file or directory); name one with output_dir=..."
    )
    assert _main(monkeypatch, "--help") == 0  # help writes nothing: it works there
    assert "usage: specdraft-train" in capsys.readouterr().out


@pytest.mark.parametrize(
    "args,said",
    [
        (["train.eval_after.bench=nope"], "train.eval_after.bench=nope: no such file"),
        (["train.eval_after.num_prompts=0"], "train.eval_after.num_prompts=0: must be >= 1"),
        (["train.eval_after.temperature=-1"], "train.eval_after.temperature=-1.0: must be >= 0"),
        (
            ["train.eval_after.compare=[./no/such/run]"],
            "train.eval_after.compare: ./no/such/run: no such folder",
        ),
    ],
)
def test_the_measurement_after_training_is_checked_before_training(
    tmp_path, monkeypatch, capsys, args, said
):
    """A bad ``train.eval_after`` setting was found after the whole training run, as a
    traceback (exit 1): it is one line before anything trains or is written."""
    monkeypatch.setattr(app, "train_measure_serve", _never)
    out = tmp_path / "run"
    code = _main(
        monkeypatch,
        "target=tiny_random",
        f"output_dir={out}",
        "train.eval_after.enabled=true",
        *args,
    )
    assert code == 2
    assert _one_line(capsys.readouterr().err).startswith(f"error: {said}")
    assert not out.exists()


@pytest.mark.parametrize(
    "error,said",
    [
        ("models.base.DraftError", "draft=other: made for another target"),
        ("decoding.bench.BenchError", "bench=sharegpt_val: no prompts selected"),
    ],
)
def test_a_measurement_refused_after_training_is_one_line_exit_2_and_recorded(
    tmp_path, monkeypatch, capsys, error, said
):
    """What only the measurement can find (a draft in ``compare`` made for another target, a
    benchmark with no prompts) ended a finished run with a traceback and exit 1, or a line that
    did not say the draft was saved: one line naming the saved draft and how to measure it,
    exit 2, and the run's summary.json says so."""
    import importlib

    import flow.measure

    module, name = error.rsplit(".", 1)
    cls = getattr(importlib.import_module(module), name)
    out = tmp_path / "run"
    final = out / "final"

    def trained(cfg):
        final.mkdir(parents=True)
        return {"reason": "finished", "final": str(final), "step": 2, "val": {}}

    def refused(*a, **k):
        raise cls(said)

    monkeypatch.setattr(app, "run", trained)
    monkeypatch.setattr(flow.measure, "measure_after", refused)
    code = _main(
        monkeypatch, "target=tiny_random", f"output_dir={out}", "train.eval_after.enabled=true"
    )
    assert code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    assert (
        f"error: {out}: measuring the draft after training: {said}; the draft is saved in " in err
    )
    assert (
        err.strip()
        .splitlines()[-1]
        .endswith(f"; the draft is saved in {final}; measure it with: specdraft-eval draft={final}")
    )
    summary = json.loads((out / "summary.json").read_text())
    assert summary["reason"] == "finished"
    assert summary["error"] == f"measuring after training: {said}"


def test_the_measurement_on_sharegpt_val_draws_the_runs_own_held_out_split(
    data_file, tmp_path, monkeypatch
):
    """``train.eval_after.bench=sharegpt_val`` measured on the packaged ShareGPT's split at the
    evaluator's defaults, whatever data, split fraction, cap and seed the run trained with: its
    "held-out" prompts could be the run's training records."""
    import flow.measure

    cfg = compose(
        [
            "target=tiny_random",
            f"data.path={data_file}",
            "data.val_fraction=0.3",
            "data.max_val_records=5",
            "data.skip_records=3",
            "train.seed=7",
            "train.eval_after.bench=sharegpt_val",
            "train.eval_after.num_prompts=2",
            f"output_dir={tmp_path}",
        ]
    )
    seen = []

    def evaluate(ecfg):
        seen.append(ecfg)
        return {"tau": 1.0, "alpha": 0.0, "speedup": 1.0, "lossless": True}

    monkeypatch.setattr(flow.measure, "evaluate", evaluate)
    monkeypatch.setattr(flow.measure, "apply_saved_decode", lambda *a: None)
    flow.measure.measure_after(cfg, tmp_path / "final", tmp_path, log=lambda *a: None)
    (ecfg,) = seen
    assert ecfg.data_path == str(data_file) and ecfg.val_fraction == 0.3
    assert ecfg.split_seed == 7 and ecfg.max_val_records == 5 and ecfg.skip_records == 3


# -- folders ------------------------------------------------------------------------------------


@pytest.mark.parametrize("arg", ["output_dir=", "hydra.run.dir=", "output_dir=''"])
def test_an_empty_folder_value_is_refused_not_the_current_folder(
    tmp_path, monkeypatch, capsys, arg
):
    """``output_dir=$OUT`` with OUT unset trained into the current folder (the repository's
    root, say): final/, checkpoints/ and metrics beside the user's files."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(app, "train_measure_serve", _never)
    assert _main(monkeypatch, "target=tiny_random", arg) == 2
    key = arg.split("=")[0]
    assert _one_line(capsys.readouterr().err) == (
        f"error: {key}= is empty: name a folder ({key}=runs/x)"
    )
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("key", ["output_dir", "hydra.run.dir", "-m output_dir"])
def test_a_folder_value_naming_a_file_is_one_line(tmp_path, monkeypatch, capsys, key):
    """A run or sweep folder that is a file, or lies under one, was Hydra's mkdir traceback
    (FileExistsError, NotADirectoryError)."""
    monkeypatch.setattr(app, "train_measure_serve", _never)
    data = tmp_path / "conv.jsonl"
    data.write_text("{}\n")
    *flag, key = key.split()
    assert _main(monkeypatch, *flag, "target=tiny_random", f"{key}={data}") == 2
    assert _one_line(capsys.readouterr().err) == (
        f"error: {key}={data}: a file, not a folder; name a folder"
    )
    assert _main(monkeypatch, *flag, "target=tiny_random", f"{key}={data}/run") == 2
    assert _one_line(capsys.readouterr().err) == (
        f"error: {key}={data}/run: {data} is a file, not a folder"
    )
    assert data.read_text() == "{}\n"


@pytest.mark.parametrize("key", ["output_dir", "hydra.run.dir"])
def test_a_folder_nothing_can_be_written_in_is_one_line(monkeypatch, capsys, key):
    """A run folder where no file can be made (no permission, a read-only or special
    filesystem) was Hydra's mkdir traceback; now one line, before anything loads."""
    monkeypatch.setattr(app, "train_measure_serve", _never)
    assert _main(monkeypatch, "target=tiny_random", f"{key}=/proc/specdraft/run") == 2
    assert _one_line(capsys.readouterr().err) == (
        f"error: {key}=/proc/specdraft/run: nothing can be written in /proc "
        "(No such file or directory)"
    )


@pytest.mark.parametrize(
    "args,said",
    [
        (
            ["output_dir=a", "hydra.run.dir=b"],
            "output_dir=a and hydra.run.dir=b: two folders for one run; give one of them",
        ),
        (
            ["-m", "output_dir=a", "hydra.sweep.dir=b", "train.seed=1,2"],
            "output_dir=a and hydra.sweep.dir=b: two folders for one sweep; give one of them",
        ),
        (
            ["-m", "hydra.run.dir=a", "train.seed=1,2"],
            "hydra.run.dir=a: a sweep (-m) writes its jobs under hydra.sweep.dir; name that "
            "folder with output_dir=<folder>",
        ),
        (
            ["hydra.sweep.dir=a"],
            "hydra.sweep.dir=a: the folder of a sweep (-m); a single run writes to "
            "output_dir=<folder>",
        ),
    ],
)
def test_a_folder_hydra_would_ignore_is_one_line(tmp_path, monkeypatch, capsys, args, said):
    """``output_dir=a hydra.run.dir=b`` trained into b (and recorded output_dir=b);
    ``hydra.run.dir`` in a sweep and ``hydra.sweep.dir`` in a single run were ignored: the
    jobs went to the default time-stamped folder."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(app, "train_measure_serve", _never)
    assert _main(monkeypatch, "target=tiny_random", *args) == 2
    assert _one_line(capsys.readouterr().err) == f"error: {said}"
    assert list(tmp_path.iterdir()) == []


def test_resume_with_hydra_run_dir_continues_there(tmp_path, monkeypatch):
    """``hydra.run.dir=X resume=true`` (the run's folder named the Hydra way) was refused as
    if the run went to a new time-stamped folder."""
    ran = []
    monkeypatch.setattr(app, "train_measure_serve", lambda cfg: ran.append(cfg.output_dir) or {})
    out = tmp_path / "run"
    assert _main(monkeypatch, "target=tiny_random", f"hydra.run.dir={out}", "resume=true") == 0
    assert ran == [str(out)]


def test_a_refused_run_keeps_the_folder_hydra_run_dir_named(tmp_path, monkeypatch, capsys):
    """A run refused in an existing (empty) folder named by ``hydra.run.dir`` removed that
    folder: whether it was there was read from ``output_dir`` only."""

    def refused(cfg):
        raise ConfigError("train.max_steps=0: must be >= 1")

    monkeypatch.setattr(app, "train_measure_serve", refused)
    mine = tmp_path / "mine"
    mine.mkdir()
    assert _main(monkeypatch, "target=tiny_random", f"hydra.run.dir={mine}") == 2
    assert "train.max_steps=0: must be >= 1" in capsys.readouterr().err
    assert mine.is_dir() and list(mine.iterdir()) == []


def test_resume_into_a_new_time_stamped_sweep_folder_is_refused(tmp_path, monkeypatch, capsys):
    """``-m resume=true`` without a sweep folder: every job started afresh in a new
    time-stamped one (as a single run's is refused)."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(app, "train_measure_serve", _never)
    assert _main(monkeypatch, "-m", "target=tiny_random", "resume=true", "train.seed=1,2") == 2
    assert _one_line(capsys.readouterr().err).startswith(
        "error: resume=true continues each job of a sweep in its folder under the sweep's"
    )
    assert list(tmp_path.iterdir()) == []


# -- command lines ------------------------------------------------------------------------------


def test_method_name_is_refused_naming_the_group(tmp_path, monkeypatch, capsys):
    """``method.name=eagle3`` kept EAGLE-1's settings under EAGLE-3's name and failed deep in
    training with an AttributeError traceback."""
    monkeypatch.setattr(app, "train_measure_serve", _never)
    out = tmp_path / "run"
    assert _main(monkeypatch, "target=tiny_random", f"output_dir={out}", "method.name=eagle3") == 2
    assert _one_line(capsys.readouterr().err) == (
        "error: method.name=eagle3: the method is chosen by its group: method=eagle3 "
        "(method.name is the chosen method's own)"
    )
    assert not out.exists()


@pytest.mark.parametrize(
    "args,said",
    [
        (["hydra.run.dirr=x"], "hydra.run.dirr=x: no such setting; did you mean hydra.run.dir?"),
        (
            ["hydra.callbacks.sweep_summary.sortby=val/loss"],
            "hydra.callbacks.sweep_summary.sortby=val/loss: no such setting; did you mean "
            "hydra.callbacks.sweep_summary.sort_by?",
        ),
        (
            ["-m", "hydra/launcher=joblib", "train.seed=1,2"],
            "hydra/launcher=joblib: no such launcher (choose from basic); it is a package of its "
            "own: pip install hydra-joblib-launcher",
        ),
        (
            ["hydra.job.chdir=maybe"],
            "hydra.job.chdir=maybe: Value 'maybe' is not a valid bool (type str)",
        ),
        (
            ["train.max_steps=2,4"],
            "train.max_steps=2,4: a comma separates a sweep's values; add -m to run one job per "
            "value, or give one value (a list in brackets: key=[a,b]; a text with a comma in "
            "quotes, in a shell: 'key=\"a,b\"')",
        ),
    ],
)
def test_hydras_own_keys_and_a_comma_without_m_are_one_line(args, said):
    """Hydra's own keys (``hydra.*``, ``hydra/<group>``) were not checked: a misspelled one or
    a launcher plugin not installed was a screen of Hydra's and exit 1. A comma in a value
    without ``-m`` said only "Ambiguous value", not what to do."""
    from conf.cli import check_command_line

    assert check_command_line("train", args) == said


def test_hydras_own_keys_that_compose_pass():
    from conf.cli import check_command_line

    good = [
        "hydra.run.dir=runs/x",
        "hydra.callbacks.sweep_summary.sort_by=val/loss",
        "hydra/job_logging=disabled",
        "hydra.verbose=true",
    ]
    assert check_command_line("train", good) is None
    assert check_command_line("train", ["-m", "hydra.sweep.dir=x", "train.seed=1,2"]) is None
    assert check_command_line("eval", ["hydra.run.dir=x", "draft=none"]) is None


@pytest.mark.parametrize("flag", [[], ["-m"]])
def test_a_path_with_a_comma_is_one_line_saying_to_quote_it(tmp_path, monkeypatch, capsys, flag):
    """``-m data.path=chats,v2.jsonl`` (a file that is there) ran a sweep of two jobs, one on
    ``chats`` and one on ``v2.jsonl``, each refused for a file that is not; without ``-m`` it
    was Hydra's "Ambiguous value". Quoted, the line names the file."""
    from conf.cli import check_command_line

    data = tmp_path / "chats,v2.jsonl"
    data.write_text("{}\n")
    monkeypatch.setattr(app, "train_measure_serve", _never)
    assert _main(monkeypatch, *flag, "target=tiny_random", f"data.path={data}") == 2
    assert _one_line(capsys.readouterr().err) == (
        f"error: data.path={data}: {data} is there, and a comma separates a sweep's values; "
        f"quote it to name it (in a shell: 'data.path=\"{data}\"')"
    )
    assert check_command_line("train", [*flag, f'data.path="{data}"']) is None
    assert check_command_line("train", ["-m", f"data.path={data},{data}"]) is None  # not there
