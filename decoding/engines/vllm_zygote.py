"""vLLM workers forked from one process that imported vLLM once (``SPECDRAFT_VLLM_ZYGOTE``).

Importing vLLM is most of a worker's start on a CPU (17 of 24 s for a tiny target on a 2-core
Zen 3), and every engine gets a process of its own (docs/serving.md: a second ``LLM`` in one
process serves drafts differently). A zygote, ``vllm_worker.py --zygote SOCKET``, imports vLLM,
builds nothing, and forks a fresh worker for each engine: the child starts from the state a
process of its own reaches after its imports, then takes the engine's environment, working
folder and log, and speaks the worker's protocol on the connection.

Opt-in, for runs that start many engines (the test suite starts one zygote per test process):

    SPECDRAFT_VLLM_ZYGOTE=/tmp/vllm.sock   # where start_zygote() listens, and workers connect

Where the variable is unset, names no socket and no starting zygote, or the zygote runs another
interpreter than the one asked for (``SPECDRAFT_VLLM_PYTHON``), a worker is a process of its
own, as always. Not used on CUDA machines by anything here: forking after vLLM's import is
checked on the CPU build only.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import time
from pathlib import Path

ENV = "SPECDRAFT_VLLM_ZYGOTE"
WORKER = Path(__file__).with_name("vllm_worker.py")


def _pid_file(path: str | Path) -> Path:
    return Path(f"{path}.pid")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def start_zygote(python: str | Path, path: str | Path):
    """Start a zygote of ``python`` (vLLM's environment) listening on ``path``; returns its
    Popen at once (it imports vLLM in the background; workers asked for meanwhile wait for it).
    Its pid is written beside the socket, so that a client can tell a zygote still starting from
    none."""
    path = Path(path)
    path.unlink(missing_ok=True)
    with open(f"{path}.log", "w") as log:  # the zygote's own (each worker has its log)
        proc = subprocess.Popen(
            [str(python), str(WORKER), "--zygote", str(path)],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=log,
            start_new_session=True,
        )
    _pid_file(path).write_text(str(proc.pid))
    return proc


def stop_zygote(proc: subprocess.Popen, path: str | Path) -> None:
    if proc.poll() is None:
        proc.kill()
        proc.wait()
    for p in (Path(path), _pid_file(path)):
        p.unlink(missing_ok=True)


def _socket_when_ready(path: Path, wait_s: float) -> bool:
    """True once the zygote at ``path`` listens; False where there is none, or it died."""
    end = time.monotonic() + wait_s
    while not path.exists():
        try:
            pid = int(_pid_file(path).read_text())
        except (OSError, ValueError):
            return False
        if not _alive(pid) or time.monotonic() > end:
            return False
        time.sleep(0.2)
    return True


class Forked:
    """A worker forked by a zygote, standing in for its ``Popen``: its standard input and output
    are one Unix socket, and it is the zygote's child, not ours (its exit status is not ours to
    read: ``returncode`` is -1 once it ended)."""

    def __init__(self, sock: socket.socket, pid: int, reader):
        self.sock, self.pid = sock, pid
        self._reader = reader
        self.stdin = sock.makefile("w", buffering=1)
        self.stdout = self._lines()
        self.returncode: int | None = None
        self._eof = False

    def _lines(self):
        yield from self._reader
        self._eof = True

    def poll(self) -> int | None:
        if self.returncode is None and (self._eof or not _alive(self.pid)):
            self.returncode = -1
            self._close()
        return self.returncode

    def _close(self) -> None:
        for f in (self.stdin, self._reader, self.sock):
            try:
                f.close()
            except OSError:
                pass

    def kill(self) -> None:
        if self.returncode is None:
            try:
                os.killpg(self.pid, signal.SIGKILL)  # its own group (it called setpgrp)
            except (ProcessLookupError, PermissionError):
                pass

    def wait(self, timeout: float | None = None) -> int:
        end = None if timeout is None else time.monotonic() + timeout
        while _alive(self.pid):
            if end is not None and time.monotonic() > end:
                raise subprocess.TimeoutExpired("vllm worker", timeout)
            time.sleep(0.05)
        if self.returncode is None:
            self.returncode = -1
        self._close()
        return self.returncode


def fork_worker(python: str | Path, env: dict[str, str], log: Path, wait_s: float = 600):
    """A worker forked by the zygote ``$SPECDRAFT_VLLM_ZYGOTE`` names, or None where there is
    none to fork it (the caller starts a process of its own)."""
    where = os.environ.get(ENV)
    if not where or not _socket_when_ready(Path(where), wait_s):
        return None
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.connect(where)
        req = {"python": os.path.abspath(str(python)), "env": env, "cwd": os.getcwd()}
        sock.sendall((json.dumps({**req, "log": str(log)}) + "\n").encode())
        reader = sock.makefile("r")
        first = json.loads(reader.readline() or "{}")
    except (OSError, ValueError):
        sock.close()
        return None
    if "pid" not in first:  # another interpreter, or the zygote is going away
        reader.close()
        sock.close()
        return None
    return Forked(sock, int(first["pid"]), reader)
