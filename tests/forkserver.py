"""``python -m module args`` for the test suite, forked from a process that imported the heavy
third-party packages once.

The suite runs the commands (``specdraft-train``, ``-eval``, ``-prepare``, ``-export``) as
processes of their own a hundred times and more; each spent 3-5 s of a 2-core CPU importing
torch, transformers, datasets, peft and Hydra before doing its work. A fork server imports those
once (nothing of this project: the child imports it fresh, as a new process would) and forks a
child for each command, which takes the command's arguments, environment, working folder and
output files, runs the module as ``python -m`` would, and exits with its status.

A command whose environment differs from the server's in anything but the variables below (a
test's ``HF_HOME``, ``OMP_NUM_THREADS``, ``PATH``...) runs as a process of its own instead: the
imported packages read some variables when imported. ``SPECDRAFT_TEST_FORKSERVER=`` (empty) in
the suite's environment starts every command as a process of its own.
"""

from __future__ import annotations

import json
import os
import socket
import struct
import subprocess
import sys
import time
from pathlib import Path

ENV = "SPECDRAFT_TEST_FORKSERVER"

#: imported once by the server (none reads this project's variables)
PRELOAD = (
    "torch",
    "numpy",
    "transformers",
    "datasets",
    "peft",
    "accelerate",
    "hydra",
    "omegaconf",
    "safetensors.torch",
    "tqdm.auto",
    "transformers.models.llama.modeling_llama",
)

#: variables a command may set differently from the server's: none of ``PRELOAD`` reads them
#: when imported. This project's (``SPECDRAFT_*``, read at run time), Python's (the child
#: applies it), pytest's and the terminal's, and those a library sets in the test process for
#: its own children: wandb's service address, inductor's pointer for its compiled modules,
#: DeepSpeed's choice of how torch counts CUDA devices (NVML's count, not whether there are
#: any; set when the test process imports DeepSpeed, as accelerate does where it is installed)
FREE = (
    "PYTHONUNBUFFERED",
    "PYTEST_CURRENT_TEST",
    "COLUMNS",
    "LINES",
    "_TORCHINDUCTOR_PYOBJECT_TENSOR_DATA_PTR",
    "PYTORCH_NVML_BASED_CUDA_CHECK",
)
FREE_PREFIX = ("SPECDRAFT_", "WANDB_")


def _send(sock: socket.socket, obj) -> None:
    data = json.dumps(obj).encode()
    sock.sendall(struct.pack("!I", len(data)) + data)


def _recv(sock: socket.socket):
    head = b""
    while len(head) < 4:
        part = sock.recv(4 - len(head))
        if not part:
            raise ConnectionError("the fork server closed the connection")
        head += part
    (n,) = struct.unpack("!I", head)
    data = b""
    while len(data) < n:
        part = sock.recv(n - len(data))
        if not part:
            raise ConnectionError("the fork server closed the connection")
        data += part
    return json.loads(data)


def _differs(env: dict, base: dict) -> list[str]:
    keys = set(env) | set(base)
    return sorted(
        k
        for k in keys
        if env.get(k) != base.get(k) and k not in FREE and not k.startswith(FREE_PREFIX)
    )


# -- the server ----------------------------------------------------------------------------------


def _run_child(req: dict) -> None:
    """In the forked child: become ``python -m module args`` and exit with its status."""
    import atexit
    import runpy
    import signal
    import threading
    import traceback

    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    fd_in = os.open(os.devnull, os.O_RDONLY)
    fd_out = os.open(req["stdout"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    fd_err = os.open(req["stderr"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    for fd, to in ((fd_in, 0), (fd_out, 1), (fd_err, 2)):
        os.dup2(fd, to)
        os.close(fd)
    os.environ.clear()
    os.environ.update(req["env"])
    unbuffered = bool(req["env"].get("PYTHONUNBUFFERED"))
    sys.stdin = open(0, closefd=False)  # noqa: SIM115
    sys.stdout = open(1, "w", buffering=1, closefd=False)  # noqa: SIM115
    sys.stdout.reconfigure(write_through=unbuffered)
    sys.stderr = open(2, "w", buffering=1, closefd=False, errors="backslashreplace")  # noqa: SIM115
    sys.stderr.reconfigure(write_through=True)
    os.chdir(req["cwd"])
    sys.path[0] = req["cwd"]  # what -m puts first
    sys.argv = [req["module"], *req["args"]]
    code = 0
    try:
        runpy.run_module(req["module"], run_name="__main__", alter_sys=True)
    except SystemExit as e:
        if e.code is None:
            code = 0
        elif isinstance(e.code, int):
            code = e.code
        else:
            print(e.code, file=sys.stderr)
            code = 1
    except KeyboardInterrupt:
        traceback.print_exc()
        code = 130
    except BaseException:  # as the interpreter reports an uncaught exception
        traceback.print_exc()
        code = 1
    try:  # the interpreter's exit: other threads, then atexit, then the streams
        for t in threading.enumerate():
            if t is not threading.main_thread() and not t.daemon:
                t.join()
        atexit._run_exitfuncs()
        sys.stdout.flush()
        sys.stderr.flush()
    finally:
        os._exit(code & 0xFF)


def serve(path: str) -> None:
    """The server: import ``PRELOAD``, then fork a child per request on ``path``."""
    import importlib
    import threading

    for name in PRELOAD:
        importlib.import_module(name)
    if threading.active_count() != 1:  # forking a process with threads is not safe
        sys.exit(f"fork server: {threading.active_count()} threads after the imports")
    base = dict(os.environ)
    parent = os.getppid()
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    srv.bind(path)
    srv.listen(4)
    srv.settimeout(5)
    while True:
        try:
            conn, _ = srv.accept()
        except TimeoutError:
            if os.getppid() != parent:  # the test process died without stopping it
                return
            continue
        conn.settimeout(None)
        with conn:
            try:
                req = _recv(conn)
            except (ConnectionError, ValueError):
                continue
            differs = _differs(req["env"], base)
            if differs:  # the log says why a command ran apart
                print(f"{req['module']}: its own process ({', '.join(differs)})", flush=True)
                _send(conn, {"pid": None})
                continue
            pid = os.fork()
            if pid == 0:
                srv.close()
                conn.close()
                _run_child(req)
            _send(conn, {"pid": pid})
            t0 = time.monotonic()
            _, status = os.waitpid(pid, 0)
            print(f"{req['module']}: forked, {time.monotonic() - t0:.1f} s", flush=True)
            try:
                _send(conn, {"status": os.waitstatus_to_exitcode(status)})
            except OSError:
                pass


# -- the client ----------------------------------------------------------------------------------


def start(folder: Path) -> tuple[subprocess.Popen, Path]:
    """A server under ``folder`` (its socket and its log), importing in the background."""
    path = folder / "fork.sock"
    log = open(folder / "fork.log", "w")  # noqa: SIM115
    code = f"import sys; sys.path.insert(0, {str(Path(__file__).parent)!r}); "
    code += f"import forkserver; forkserver.serve({str(path)!r})"
    proc = subprocess.Popen(
        [sys.executable, "-c", code],
        stdin=subprocess.DEVNULL,
        stdout=log,
        stderr=log,
        cwd=folder,
        start_new_session=True,
    )
    return proc, path


def run(
    path: Path, module: str, args: list[str], cwd: Path, env: dict, timeout: float
) -> subprocess.CompletedProcess | None:
    """``python -m module args`` forked by the server at ``path``, output captured; None where
    the server is not up (or died) or the environment differs from its own: run it yourself."""
    deadline = time.monotonic() + 60
    while not path.exists():  # still importing
        if time.monotonic() > deadline:
            return None
        time.sleep(0.05)
    out = path.parent / f"out-{os.getpid()}-{time.monotonic_ns()}"
    req = {"module": module, "args": list(args), "cwd": str(cwd), "env": dict(env)}
    req |= {"stdout": f"{out}.stdout", "stderr": f"{out}.stderr"}
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        try:
            sock.connect(str(path))
            _send(sock, req)
            pid = _recv(sock)["pid"]
        except OSError:  # no server (it failed to start, or died): nothing ran
            return None
        if pid is None:
            return None
        sock.settimeout(timeout)
        try:
            status = _recv(sock)["status"]
        except TimeoutError:
            os.kill(pid, 9)
            raise subprocess.TimeoutExpired([module, *args], timeout) from None
    finally:
        sock.close()
    texts = []
    for suffix in (".stdout", ".stderr"):
        f = Path(f"{out}{suffix}")
        texts.append(f.read_text(errors="replace"))
        f.unlink()
    return subprocess.CompletedProcess([module, *args], status, texts[0], texts[1])
