"""The life cycle every engine's subprocess shares (``decoding/engines/process.py``): the log is
removed after a clean run and kept where an error named it, a ``with`` block always ends the
process, and nothing outlives this process (at exit, on SIGTERM). Checked here with a plain
Python child standing in for an engine; tests/test_engine.py and tests/test_vllm.py check the
same through the real engines where they are installed."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from decoding.engines import process
from decoding.engines.process import EngineProcess, terminate

ROOT = Path(__file__).resolve().parents[1]
#: a stand-in engine: says it is up, then waits (SIGTERM ends it, unless told to ignore it)
CHILD = (
    "import signal, sys, time\n"
    "if 'stubborn' in sys.argv: signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
    "print('engine up', flush=True)\n"
    "print('RuntimeError: the last thing it said', flush=True)\n"
    "print('shutting down', flush=True)\n"
    "time.sleep(120)\n"
)


class Sleeper(EngineProcess):
    log_prefix = "specdraft-test-engine-"

    def __init__(self, *args: str):
        self.args = args
        super().__init__()

    def start(self) -> None:
        log = self.open_log("w")
        self.launch(subprocess.Popen([sys.executable, "-c", CHILD, *self.args], stdout=log))
        deadline = time.monotonic() + 30
        while "shutting down" not in self.log_path.read_text():
            assert time.monotonic() < deadline, "the stand-in engine did not start"
            time.sleep(0.02)


def gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


def test_a_clean_run_ends_the_process_and_removes_its_log():
    with Sleeper() as e:
        p = e.proc
        assert p.poll() is None and e in process._LIVE
    assert p.poll() is not None and e.proc is None
    assert e not in process._LIVE
    assert not e.log_path.exists()


def test_an_error_keeps_the_log_and_the_messages_quote_it():
    with pytest.raises(ValueError), Sleeper() as e:
        p = e.proc
        assert e.last_error() == "RuntimeError: the last thing it said"
        raise ValueError("something failed while the engine ran")
    assert p.poll() is not None
    assert e.log_path.is_file()  # the error is what the log explains: kept
    e.log_path.unlink()
    fresh = Sleeper()  # never started: an empty log
    assert fresh.log_tail(2) == f" (log: {fresh.log_path})"
    assert fresh.last_error() == "(empty log)"
    fresh.log_path.unlink()
    assert fresh.log_tail() == "(no log)"


def test_log_tail_names_the_log_and_keeps_it():
    with Sleeper() as e:
        tail = e.log_tail(2)
    assert tail == (f"RuntimeError: the last thing it said | shutting down (log: {e.log_path})")
    assert e.log_path.is_file()
    e.log_path.unlink()


def test_terminate_kills_what_ignores_sigterm():
    e = Sleeper("stubborn")
    e.start()
    p = e.proc
    t0 = time.monotonic()
    terminate(p, grace=0.5)
    assert p.returncode == -signal.SIGKILL
    assert time.monotonic() - t0 < 10
    e.close()


SCRIPT = textwrap.dedent(
    """
    import sys, time
    sys.path.insert(0, {tests!r})
    from test_engine_process import Sleeper
    e = Sleeper()
    e.start()
    print(e.proc.pid, e.log_path, flush=True)
    if sys.argv[1] == "wait":
        time.sleep(120)
    # "exit": leaves without closing it
    """
)


@pytest.mark.parametrize("how", ["exit", "sigterm"])
def test_nothing_outlives_this_process(how):
    """Started and never closed, the engine ends with the process that started it: when that
    one exits, and when it is sent SIGTERM with no handler of its own (it then dies of the
    signal, as it would have without engines)."""
    code = SCRIPT.format(tests=str(ROOT / "tests"))
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    parent = subprocess.Popen(
        [sys.executable, "-c", code, "wait" if how == "sigterm" else "exit"],
        stdout=subprocess.PIPE,
        text=True,
        env=env,
        cwd=ROOT,
    )
    pid, log = parent.stdout.readline().split()
    pid = int(pid)
    if how == "sigterm":
        assert not gone(pid)
        parent.send_signal(signal.SIGTERM)
    rc = parent.wait(timeout=60)
    assert rc == (-signal.SIGTERM if how == "sigterm" else 0)
    assert gone(pid), f"the engine ({pid}) outlived the process that started it ({how})"
    Path(log).unlink()  # kept: the engine was not closed, its log may say why
