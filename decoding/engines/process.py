"""What every engine's subprocess shares: a log file, a ``with`` block, and nothing left running.

An engine (``llama-server``, a vLLM worker) runs as a process of its own, one per served model,
writing its log to a temporary file. The log is removed when the engine closes, unless an error
named it (``keep_log``: every message that quotes the log keeps it). Whatever engine is still
running when this process exits (``atexit``), or is sent SIGTERM with no handler of its own, is
stopped first: none outlives the evaluator.
"""

from __future__ import annotations

import atexit
import os
import re
import signal
import subprocess
import tempfile
from pathlib import Path
from typing import IO

_LIVE: set[EngineProcess] = set()


def terminate(p: subprocess.Popen, grace: float = 10.0) -> None:
    """SIGTERM, then SIGKILL where ``p`` has not exited within ``grace`` seconds."""
    if p.poll() is None:
        p.terminate()
        try:
            p.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def _stop_all(*_: object) -> None:
    for e in list(_LIVE):
        e.stop_now()


atexit.register(_stop_all)


def _on_sigterm(signum, frame):  # pragma: no cover - exercised by hand
    # stop the engines, then die of the signal as if no handler were installed (raising
    # SystemExit instead could be swallowed by a caller's except clause)
    _stop_all()
    signal.signal(signum, signal.SIG_DFL)
    os.kill(os.getpid(), signum)


def _stop_engines_on_sigterm() -> None:
    """A SIGTERM to this process stops its engines first (where nobody else handles it: a
    command that takes SIGTERM itself closes them as its ``with`` blocks end)."""
    try:
        if signal.getsignal(signal.SIGTERM) in (signal.SIG_DFL, None):
            signal.signal(signal.SIGTERM, _on_sigterm)
    except ValueError:  # not the main thread
        pass


class EngineProcess:
    """One engine's subprocess and its log.

    A subclass starts its process in ``start`` (``open_log``, then ``launch`` with the
    ``Popen``) and may end it its own way in ``shutdown``; ``close`` (and the end of a ``with``
    block) ends it, closes the log and removes it unless ``keep_log``."""

    #: the log file's name prefix, in the system's temporary folder
    log_prefix = "specdraft-engine-"

    def __init__(self) -> None:
        self.proc: subprocess.Popen | None = None
        self._log: IO | None = None
        fd, name = tempfile.mkstemp(prefix=self.log_prefix, suffix=".log")
        os.close(fd)
        self.log_path = Path(name)
        #: the log outlives the engine only where an error named it (else it is removed)
        self.keep_log = False

    def __enter__(self):
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.keep_log |= exc[0] is not None
        self.close()

    def start(self) -> None:
        raise NotImplementedError

    def open_log(self, mode: str = "w") -> IO:
        """The log file, opened for the process to write to."""
        self._log = open(self.log_path, mode)
        return self._log

    def launch(self, proc: subprocess.Popen) -> subprocess.Popen:
        """Take ``proc`` as this engine's process: stopped at exit and on SIGTERM from now on."""
        _stop_engines_on_sigterm()
        self.proc = proc
        _LIVE.add(self)
        return proc

    def shutdown(self, p: subprocess.Popen) -> None:
        """End the running process ``p`` (the engine's own way; by default SIGTERM, then
        SIGKILL)."""
        terminate(p)

    def end_now(self, p: subprocess.Popen) -> None:
        """End the running process ``p`` without asking it (at exit, on SIGTERM); by default
        SIGTERM, then SIGKILL."""
        terminate(p)

    def stop_now(self) -> None:
        p = self.proc
        if p is not None and p.poll() is None:
            self.end_now(p)
        _LIVE.discard(self)

    def close(self) -> None:
        p = self.proc
        if p is not None:
            if p.poll() is None:
                self.shutdown(p)
            self.proc = None
        _LIVE.discard(self)
        if self._log is not None:
            self._log.close()
            self._log = None
        if not self.keep_log:
            self.log_path.unlink(missing_ok=True)

    # -- the log, for error messages ---------------------------------------------------------

    def log_lines(self) -> list[str] | None:
        """The log's non-empty lines, stripped (None where it cannot be read)."""
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return None
        return [s.strip() for s in text.splitlines() if s.strip()]

    def log_tail(self, n: int = 6) -> str:
        """The log's last ``n`` lines and its path, for an error message (the log is kept)."""
        self.keep_log = True
        lines = self.log_lines()
        if lines is None:
            return "(no log)"
        return " | ".join(lines[-n:]) + f" (log: {self.log_path})"

    def last_error(self) -> str:
        """The log's last error line (else its last line), for an error message that names the
        log itself."""
        lines = self.log_lines()
        if lines is None:
            return "(no log)"
        lines = [s for s in lines if not s.startswith("For further information")]
        errs = [s for s in lines if re.search(r"\w*(Error|error)\b[:,]", s)]
        return (errs or lines or ["(empty log)"])[-1][:400]
