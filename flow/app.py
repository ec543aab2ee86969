"""``specdraft-train`` / ``accelerate launch -m flow``: the Hydra app. It trains
(``trainer.train.run``), then, where ``train.eval_after.enabled`` (the quickstart), measures the
new draft with the built-in decoder next to the drafts in ``train.eval_after.compare``, and ends
with how to export and serve it.

    specdraft-train target=tiny_random method=eagle1 train.max_steps=20 output_dir=DIR
    accelerate launch -m flow experiment=quickstart
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import sys
import traceback
from pathlib import Path

import hydra
from omegaconf import DictConfig, OmegaConf, open_dict

from conf.cli import Stopped, StopSignals, check_command_line, home_expanded
from conf.sweep import REFUSED_NOTE, SUMMARY, refused_line
from decoding.contention import OtherLoad, busy_note
from models.base import run_files
from trainer.train import USER_ERRORS, ConfigError, check_fresh_run_dir, run, wants_cpu

CONF_DIR = Path(__file__).resolve().parents[1] / "conf"
GROUPS = ("target", "data", "method", "optim", "logger", "experiment", "debug")


def train_measure_serve(cfg: DictConfig) -> dict:
    """Train; on the main process, measure the saved draft (if asked) and print how to serve
    it. Returns the training summary, with the measurement rows under ``eval_after``."""
    from accelerate import PartialState

    alone = int(os.environ.get("WORLD_SIZE", "1")) == 1  # a launch's ranks are not "others"
    with OtherLoad() as load:
        summary = run(cfg)
    if alone and PartialState().is_main_process and not summary.get("already_finished"):
        note_other_load(summary, load.summary(), Path(cfg.output_dir))
    if not summary["final"] or not PartialState().is_main_process:
        return summary
    if summary.get("already_finished"):  # resume=true on a finished run: nothing new
        return summary
    final = Path(summary["final"])
    run_dir = final.parent
    if cfg.train.eval_after.enabled:
        from decoding.eval import USER_ERRORS as MEASURE_ERRORS
        from flow.measure import measure_after

        try:
            with StopSignals(deferred=False):  # the draft is saved: nothing to wait for
                summary["eval_after"] = measure_after(cfg, final, run_dir)
        except Stopped as e:
            print(
                f"\nstopped by {signal.Signals(e.signum).name} while measuring: the draft is "
                f"saved in {final}; measure it with: specdraft-eval draft={final}",
                file=sys.stderr,
            )
            sys.exit(e.exit_code)
        except MEASURE_ERRORS as e:  # after the whole run: the draft is kept, the run says so
            summary["error"] = f"measuring after training: {e}"
            print(
                f"error: {run_dir}: measuring the draft after training: {e}; the draft is saved "
                f"in {final}; measure it with: specdraft-eval draft={final}",
                file=sys.stderr,
            )
        (run_dir / SUMMARY).write_text(json.dumps(summary, indent=1))
    from flow.serve import serve_hint

    print(serve_hint(cfg.method.name, run_dir))
    return summary


def note_other_load(summary: dict, load: dict | None, run_dir: Path) -> None:
    """How busy other processes kept the machine while the run trained, in its summary (and
    ``summary.json``), and a line where its tokens/s is not the machine's own."""
    if load is None:
        return
    summary["other_load"] = load
    if (run_dir / SUMMARY).is_file():
        (run_dir / SUMMARY).write_text(json.dumps(summary, indent=1))
    note = busy_note(
        load,
        "its tokens/s is not the machine's own (the draft it trained is unaffected)",
    )
    if note:
        print(note)


def exit_code(summary: dict) -> int:
    """The exit status of a training run by how it stopped: 0 finished (or its time budget
    spent); 128 + the signal that stopped it, as shells count (130 for Ctrl-C, 143 for a
    scheduler's SIGTERM; 130 where another process of the launch caught it), its checkpoint
    saved for ``resume=true``; 1 stopped by non-finite losses (no draft saved); 2 its draft
    saved but the measurement after training refused (``error``)."""
    reason = summary.get("reason")
    if reason == "signal":
        return 128 + int(summary.get("signal") or signal.SIGINT)
    if reason == "nonfinite":
        return 1
    if summary.get("error"):
        return 2
    return 0


#: whether a single run's folder was there before the command (Hydra makes it first)
_OUTPUT_DIR_EXISTED = [True]
#: the run's folder as the command line names it (``hydra.run.dir=``, else ``output_dir=``),
#: unresolved; None where the line names none (the config's time-stamped default)
_RUN_DIR_ARG: list[str | None] = [None]
#: sweep jobs that stopped on non-finite losses: the sweep goes on, and ends with status 1
_FAILED: list[str] = []
#: sweep jobs refused for their settings or inputs (one line each): the sweep goes on, its
#: summary names them, and it ends with status 2
_REFUSED: list[str] = []
#: sweep jobs that failed with an unexpected error (its traceback printed): the sweep goes on,
#: its summary is written, and it ends with status 1
_CRASHED: list[str] = []


@hydra.main(version_base="1.3", config_path="../conf", config_name="train")
def _hydra_main(cfg: DictConfig) -> dict:
    from accelerate import PartialState
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    multirun = HydraConfig.get().mode == RunMode.MULTIRUN
    named = _RUN_DIR_ARG[0]
    if named is None:
        named = str(OmegaConf.to_container(cfg, resolve=False).get("output_dir"))
    stamped = "${now:" in named
    if stamped and not multirun and str(cfg.resume).lower() == "true":
        # a new time-stamped folder every time: resume=true there would always start afresh
        print(
            "error: resume=true continues the run in output_dir; name it (output_dir=runs/x): "
            "the default is a new time-stamped folder each time",
            file=sys.stderr,
        )
        sys.exit(2)
    # The run directory is Hydra's job directory: output_dir for a single run, one folder
    # per job (sweep dir / job number) under -m.
    with open_dict(cfg):
        cfg.output_dir = _one_folder_for_every_process(cfg, HydraConfig.get().runtime.output_dir)
    run_dir = Path(cfg.output_dir)
    existed = run_dir.exists() if multirun else _OUTPUT_DIR_EXISTED[0]  # Hydra made it since
    try:
        if cfg.resume in (False, None, "false", "False"):
            check_fresh_run_dir(run_dir)  # before anything is written there
        if cfg.train.eval_after.enabled:
            check_measurement(cfg)  # before training, not after it
        write_run_record(cfg, run_dir)
        summary = train_measure_serve(cfg)
    except USER_ERRORS + (ConfigError,) as e:
        if not multirun:
            print(f"error: {e}", file=sys.stderr)
            if _main_process():
                drop_lone_record(run_dir, existed)
            sys.exit(2)
        # one job's value (train.max_steps=-5 among others): the other jobs still run, and
        # the sweep's summary says what refused this one (in its own folder; a folder that
        # holds a finished run keeps that run's records and summary)
        print(f"error: {cfg.output_dir}: {e}", file=sys.stderr)
        if _main_process():
            if not run_files(run_dir):  # its record is written: it started
                (run_dir / SUMMARY).write_text(
                    json.dumps({"reason": "refused", "error": str(e)}, indent=1)
                )
            else:  # the folder keeps the earlier run's records: the sweep's row is a note
                note_refused(run_dir, str(e))
        _REFUSED.append(cfg.output_dir)
        return {"reason": "refused", "error": str(e)}
    except Exception as e:
        if not multirun:
            raise
        # a sweep's job failing unexpectedly: Hydra would run the others, then end with this
        # traceback and no summary of any job
        traceback.print_exc()
        error = f"{type(e).__name__}: {e}".splitlines()[0]
        print(f"error: {cfg.output_dir}: failed: {error}", file=sys.stderr)
        if _main_process():
            (run_dir / SUMMARY).write_text(
                json.dumps({"reason": "failed", "error": error}, indent=1)
            )
        _CRASHED.append(cfg.output_dir)
        return {"reason": "failed", "error": error}
    code = exit_code(summary)
    if code == 1 and PartialState().is_main_process:
        print(
            f"error: {cfg.output_dir}: stopped on {cfg.train.max_nonfinite} non-finite losses in "
            "a row, no draft saved (its last checkpoint is kept)",
            file=sys.stderr,
        )
    if code == 1 and multirun:
        _FAILED.append(cfg.output_dir)  # the other jobs still run
    elif code == 2 and multirun:
        _REFUSED.append(cfg.output_dir)  # its measurement, said above: the others still run
    elif code:  # a signal stops a sweep too, with the summary of the jobs it ran
        if multirun and _main_process():
            from conf.sweep import write_stopped_sweep_summary

            path = write_stopped_sweep_summary(HydraConfig.get())
            if path is not None:
                print(
                    f"sweep stopped at job {run_dir.name}; the later jobs did not run. "
                    f"sweep summary: {path} (and summary.csv)",
                    file=sys.stderr,
                )
        sys.exit(code)
    return summary


def check_measurement(cfg: DictConfig) -> None:
    """``train.eval_after``'s settings, before training: a ``ConfigError`` naming the key."""
    from decoding.settings import EvalError
    from flow.measure import check_eval_after

    try:
        check_eval_after(cfg)
    except EvalError as e:
        raise ConfigError(str(e)) from None


def note_refused(run_dir: Path, error: str) -> None:
    """A sweep's job refused in a folder that holds an earlier run (whose records stay as they
    are): the sweep summary's row for it, beside the job folders."""
    from hydra.core.hydra_config import HydraConfig

    hc = HydraConfig.get()
    note = run_dir.parent / REFUSED_NOTE.format(job=run_dir.name)
    note.write_text(json.dumps({"overrides": list(hc.overrides.task), "error": error}, indent=1))


def _one_folder_for_every_process(cfg: DictConfig, folder: str) -> str:
    """The main process's run folder, for every process of a launch. Each process resolves the
    default folder's ``${now:...}`` itself, and processes that reach it in different seconds
    (their imports take seconds) would write a checkpoint's parts into different folders; the
    one a process's Hydra made in vain is removed. One process: ``folder``."""
    if int(os.environ.get("WORLD_SIZE", "1")) < 2:
        return folder
    from accelerate import PartialState
    from accelerate.utils import broadcast_object_list

    PartialState(cpu=wants_cpu(cfg))  # the process group, as the run's accelerator joins it
    agreed = broadcast_object_list([folder], from_process=0)[0]
    if agreed != folder:
        with contextlib.suppress(OSError):
            Path(folder).rmdir()  # empty: Hydra made it for this process alone
    return agreed


def _main_process() -> bool:
    """Rank 0 of a launch (read from the launcher's environment: no process group needed)."""
    return int(os.environ.get("RANK", "0")) == 0


def drop_lone_record(run_dir: Path, existed: bool) -> None:
    """After a refused run, the record it wrote where it wrote nothing else (a setting refused
    once the target loaded): a folder the command made (Hydra makes it first) is removed, as
    if never run."""
    record = run_dir / ".hydra"
    if record.is_dir() and {p.name for p in run_dir.iterdir()} == {".hydra"}:
        shutil.rmtree(record, ignore_errors=True)
    if not existed:  # left where it holds anything
        with contextlib.suppress(OSError):
            run_dir.rmdir()


def write_run_record(cfg: DictConfig, run_dir: Path) -> None:
    """``run_dir/.hydra/``: the composed config, Hydra's own and the command line's overrides
    (what a sweep's summary reads), as Hydra writes them; written here, once the run is known
    to start in ``run_dir``, so that a refused command never rewrites another run's record."""
    from hydra.core.hydra_config import HydraConfig
    from omegaconf import OmegaConf

    if not _main_process():
        return
    hc = HydraConfig.get()
    d = run_dir / ".hydra"
    d.mkdir(parents=True, exist_ok=True)
    OmegaConf.save(cfg, d / "config.yaml")
    OmegaConf.save(OmegaConf.create({"hydra": OmegaConf.to_container(hc)}), d / "hydra.yaml")
    OmegaConf.save(OmegaConf.create(list(hc.overrides.task)), d / "overrides.yaml")


def check_group_choices(argv: list[str], conf_dir: Path = CONF_DIR) -> str | None:
    """A one-line message for a ``group=option`` argument whose option does not exist (Hydra's
    own message spans a screen), or None."""
    for arg in argv:
        key, sep, value = arg.lstrip("+~").partition("=")
        if not sep or key not in GROUPS or value in ("null", "") or "(" in value:
            continue
        for v in value.split(","):  # multirun: method=eagle1,eagle3
            if not (conf_dir / key / f"{v}.yaml").exists():
                known = sorted(f.stem for f in (conf_dir / key).glob("*.yaml"))
                return f"{key}={v}: no such {key} (choose from {', '.join(known)})"
    return None


def sweep_into_output_dir(argv: list[str]) -> tuple[list[str], str | None]:
    """A sweep (``-m``) writes each job to ``hydra.sweep.dir/<job>``, where ``output_dir`` is
    not read: ``output_dir=X`` on a sweep's line becomes ``hydra.sweep.dir=X`` (the jobs in
    X/0, X/1, ..., the summary in X) unless the line sets the sweep folder itself. Returns the
    arguments and a line saying so, or a ``ConfigError`` for an ``output_dir`` swept over."""
    if not is_sweep(argv):
        return argv, None
    outs = [a for a in argv if a.lstrip("+~").startswith("output_dir=")]
    if not outs or any(a.startswith("hydra.sweep.dir=") for a in argv):
        return argv, None
    value = outs[-1].split("=", 1)[1]
    if "," in value or value.startswith(("range(", "choice(", "glob(")):
        raise ConfigError(
            f"{outs[-1]}: a sweep writes each job to its own folder under hydra.sweep.dir; set "
            "output_dir (or hydra.sweep.dir) to one folder"
        )
    return [*argv, f"hydra.sweep.dir={value}"], f"sweep: the jobs write to {value}/<job>"


#: the keys that name a folder the command writes to
_FOLDER_KEYS = ("output_dir", "hydra.run.dir", "hydra.sweep.dir")
#: Hydra's flags that print and exit without a run (nothing is written)
_NO_RUN_FLAGS = {"--help", "-h", "--hydra-help", "--cfg", "-c", "--info", "-i", "--version"}
_NO_RUN_FLAGS |= {"--shell-completion", "-sc"}


def last_value(argv: list[str], key: str) -> str | None:
    """The value the last ``key=`` (or ``+key=``) on the command line gives; None where none
    does."""
    vals = [a.split("=", 1)[1] for a in argv if "=" in a and a.lstrip("+").split("=", 1)[0] == key]
    return vals[-1] if vals else None


def is_sweep(argv: list[str]) -> bool:
    return any(a in ("-m", "--multirun") for a in argv)


def check_folders_and_method(argv: list[str]) -> str | None:
    """A one-line message for a folder key given an empty value (``output_dir=$OUT`` with
    ``OUT`` unset: the run wrote into the current folder), a file's path or a folder nothing
    can be written in (the default ``runs/`` too, where none is named), or for
    ``method.name=`` (the method is chosen by its group; another name on a method's settings
    failed deep in training), or None."""
    from models.base import unwritable

    for arg in argv:
        key, sep, value = arg.lstrip("+~").partition("=")
        if sep and key in _FOLDER_KEYS and not value.strip().strip("'\""):
            return f"{key}= is empty: name a folder ({key}=runs/x)"
        if sep and key in _FOLDER_KEYS:  # Hydra's mkdir there was a traceback
            path = Path(value).expanduser()
            if path.exists() and not path.is_dir():
                return f"{key}={value}: a file, not a folder; name a folder"
            why = unwritable(path)
            if why is not None:
                return f"{key}={value}: {why}"
        if sep and key == "method.name":
            choice = value.split(",")[0]
            return (
                f"{arg}: the method is chosen by its group: method={choice} (method.name is "
                "the chosen method's own)"
            )
    named = {a.lstrip("+~").partition("=")[0] for a in argv if "=" in a}
    runs = not set(argv) & _NO_RUN_FLAGS
    if runs and not named & set(_FOLDER_KEYS):  # the default folders, under the current one
        for default in ("runs", "multirun") if is_sweep(argv) else ("runs",):
            why = unwritable(Path.cwd() / default)
            if why is not None:
                return (
                    f"the run's folder goes under {default}/ by default: {why}; name one with "
                    "output_dir=..."
                )
    return None


def folder_conflict(argv: list[str]) -> str | None:
    """A one-line message where the line names a folder Hydra then ignores (``hydra.run.dir``
    in a sweep, ``hydra.sweep.dir`` in a single run) or two folders for one run or sweep
    (``output_dir=X`` beside ``hydra.run.dir=Y``: the run went to Y), or None."""
    sweep = is_sweep(argv)
    last = {k: v for k in _FOLDER_KEYS if (v := last_value(argv, k)) is not None}
    ignored, own = ("hydra.run.dir", "hydra.sweep.dir")
    if not sweep:
        ignored, own = own, ignored
    if ignored in last:
        return f"{ignored}={last[ignored]}: " + (
            "a sweep (-m) writes its jobs under hydra.sweep.dir; name that folder with "
            "output_dir=<folder>"
            if sweep
            else "the folder of a sweep (-m); a single run writes to output_dir=<folder>"
        )
    if own in last and "output_dir" in last and last[own] != last["output_dir"]:
        return (
            f"output_dir={last['output_dir']} and {own}={last[own]}: two folders for one "
            f"{'sweep' if sweep else 'run'}; give one of them"
        )
    return None


def run_dir_argument(argv: list[str]) -> str | None:
    """The run's folder as ``argv`` names it: its last ``hydra.run.dir=`` (where Hydra runs
    it), else its last ``output_dir=``; None where it names neither."""
    named = last_value(argv, "hydra.run.dir")
    return named if named is not None else last_value(argv, "output_dir")


def resume_into_a_new_sweep(argv: list[str]) -> str | None:
    """A sweep (``-m``) with ``resume=true`` into the default sweep folder, a new time-stamped
    one each time, where every job would start afresh (as a single run's is refused), or None."""
    if not is_sweep(argv):
        return None
    resume = last_value(argv, "resume")
    if resume is None or "true" not in resume.lower():
        return None
    folder = last_value(argv, "hydra.sweep.dir")
    if folder is not None and "${now:" not in folder:
        return None
    return (
        "resume=true continues each job of a sweep in its folder under the sweep's; name it "
        "(output_dir=runs/s, as the sweep did): the default is a new time-stamped folder each time"
    )


def main() -> None:
    for jobs in (_FAILED, _REFUSED, _CRASHED):  # this command's sweep only
        jobs.clear()
    sys.argv[1:] = home_expanded(sys.argv[1:])
    msg = (
        check_folders_and_method(sys.argv[1:])
        or folder_conflict(sys.argv[1:])
        or check_group_choices(sys.argv[1:])
        or check_command_line("train", sys.argv[1:])
    )
    if msg:
        print(f"error: {msg}", file=sys.stderr)
        sys.exit(2)
    try:
        argv, note = sweep_into_output_dir(sys.argv[1:])
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    if note:
        print(note, flush=True)
        sys.argv[1:] = argv
    msg = resume_into_a_new_sweep(sys.argv[1:])
    if msg:
        print(f"error: {msg}", file=sys.stderr)
        sys.exit(2)
    _RUN_DIR_ARG[0] = run_dir_argument(sys.argv[1:])
    named = _RUN_DIR_ARG[0]
    _OUTPUT_DIR_EXISTED[0] = named is not None and Path(named).expanduser().exists()
    _hydra_main()
    if _FAILED:
        print(
            f"error: {len(_FAILED)} job(s) of the sweep stopped on non-finite losses: "
            + ", ".join(_FAILED),
            file=sys.stderr,
        )
    if _CRASHED:
        print(
            f"error: {len(_CRASHED)} job(s) of the sweep failed (see each one's traceback "
            "above, and the summary): " + ", ".join(_CRASHED),
            file=sys.stderr,
        )
    if _REFUSED:
        print(refused_line(_REFUSED), file=sys.stderr)
        sys.exit(2)
    if _FAILED or _CRASHED:
        sys.exit(1)


if __name__ == "__main__":
    main()
