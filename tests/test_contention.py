"""A report says when other processes kept the machine busy while it was measured
(decoding/contention.py): timings beside another job are not the machine's own, and a user
reading a speedup must be told."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from decoding import contention
from decoding.contention import BUSY_CORES, OtherLoad, busy_note
from decoding.report import run_label

linux = pytest.mark.skipif(not os.path.exists("/proc/stat"), reason="reads /proc (Linux)")

STAT = """cpu  900 0 900 900 0 0 0 0 0 0
cpu0 100 10 50 500 7 1 2 3 0 0
cpu1 200 0 100 400 0 0 0 0 0 0
cpu2 300 0 300 0 0 0 0 0 0 0
intr 12345
ctxt 999
"""


def test_only_the_cores_the_process_may_use_are_read():
    """A container's cpuset: the host's other cores are not this run's, busy or not; steal
    (the hypervisor running others) counts as busy, idle and iowait do not."""
    tick = os.sysconf("SC_CLK_TCK")
    assert contention._busy_seconds({0}, STAT) == pytest.approx((100 + 10 + 50 + 1 + 2 + 3) / tick)
    assert contention._busy_seconds({0, 1}, STAT) == pytest.approx(466 / tick)
    assert contention._busy_seconds({7}, STAT) is None


def test_the_note_is_said_above_a_quarter_core_only():
    assert busy_note(None) is None
    assert busy_note({"cores": 2, "seconds": 10.0, "others_busy_cores": BUSY_CORES}) is None
    note = busy_note({"cores": 2, "seconds": 12.0, "others_busy_cores": 0.9})
    assert note.startswith("BUSY MACHINE: other processes kept 0.90 of this run's 2 cores")
    r = {"settings": {"cpu": "Some CPU", "bench": "mt_bench", "temperature": 0}}
    assert "busy" not in run_label(r)
    r["other_load"] = {"cores": 2, "seconds": 12.0, "others_busy_cores": 0.9}
    assert run_label(r).endswith("busy machine: timings not its own")


BUSY = "import time\nt = time.time()\nwhile time.time() - t < {s}: pass\n"  # wall seconds
SPIN = "import time\nwhile time.process_time() < {s}: pass\n"  # CPU seconds, however shared


@linux
def test_the_runs_own_children_are_its_own_not_others():
    """A child's CPU time, while it runs and once reaped, is this run's: it must not read as
    another process's."""
    before = contention._own_seconds()
    p = subprocess.Popen([sys.executable, "-c", SPIN.format(s=1.2)])
    time.sleep(1.0)
    live = contention._descendants_seconds(os.getpid())
    p.wait()
    after = contention._own_seconds()
    assert live >= 0.3, live
    assert after - before >= 1.15, (before, after)


def _orphan(seconds: float) -> int:
    """A busy process that is not a descendant (its shell exits; init adopts it): its pid."""
    out = subprocess.run(
        ["sh", "-c", f"{sys.executable} -c '{BUSY.format(s=seconds)}' >/dev/null 2>&1 & echo $!"],
        capture_output=True,
        text=True,
        check=True,
    )
    return int(out.stdout.strip())


@linux
def test_a_report_measured_beside_a_busy_process_says_so(tmp_path, monkeypatch, capsys):
    """``specdraft-eval`` beside a busy process (in this process: the command's own path, its
    imports done): the report holds the load, its printout and plot title say so."""
    import decoding.eval as ev

    rep = tmp_path / "r.json"
    args = ["target=tiny_random", "draft=truncate:1", "num_prompts=1", "max_new_tokens=8"]
    monkeypatch.setattr(sys, "argv", ["specdraft-eval", *args, f"report={rep}"])
    pid = _orphan(120)
    try:
        ev.main()
    finally:
        os.kill(pid, signal.SIGKILL)
    r = json.loads(rep.read_text())
    assert r["other_load"]["others_busy_cores"] > 0.4 and r["other_load"]["cores"] >= 1, r
    assert "BUSY MACHINE: other processes kept" in capsys.readouterr().out
    assert run_label(r).endswith("busy machine: timings not its own")


@linux
def test_other_load_reads_a_busy_orphan_as_another_process():
    pid = _orphan(5)
    try:
        with OtherLoad() as load:
            time.sleep(1.5)
    finally:
        os.kill(pid, signal.SIGKILL)
    assert load.summary()["others_busy_cores"] > 0.4, load.summary()


@linux
def test_a_training_run_beside_a_busy_process_says_its_tokens_per_s_is_not_its_own(
    tmp_path, monkeypatch, capsys
):
    """``specdraft-train`` (one process) records the load in its summary and says so."""
    import flow.app as app

    def trained(cfg):  # the training run's stand-in: a summary, written, after a while
        time.sleep(1.5)
        summary = {"reason": "finished", "final": None, "step": 1, "tokens_per_s": 10.0}
        with open(f"{cfg.output_dir}/summary.json", "w") as f:
            f.write(json.dumps(summary))
        return summary

    monkeypatch.setattr(app, "run", trained)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    out = tmp_path / "run"
    monkeypatch.setattr(sys, "argv", ["specdraft-train", f"output_dir={out}"])
    pid = _orphan(60)
    try:
        app.main()
    finally:
        os.kill(pid, signal.SIGKILL)
    load = json.loads((out / "summary.json").read_text())["other_load"]
    assert load["others_busy_cores"] > 0.4, load
    said = capsys.readouterr().out
    assert "BUSY MACHINE" in said and "its tokens/s is not the machine's own" in said
