"""vLLM's side of the vLLM engine: a small program run by vLLM's own Python (vLLM pins its own
torch and transformers, so it lives in an environment of its own), answering one JSON request
per line on standard input with one JSON line on standard output.

It imports the standard library and vLLM only, never specdraft. vLLM's own logs go to standard
error (standard output is kept for the answers). Requests:

    {"cmd": "init", "llm": {...LLM keyword arguments...}, "repair": true}
        -> {"vllm": version, "seconds": load time, "device": "CPU" / "CUDA" / ...,
            "repairs": [one line per defect of the build found and repaired before loading]}
    {"cmd": "generate", "prompts": [[ids], ...], "params": {...SamplingParams...} or a list
     of them (one a prompt), "metrics": true}
        -> {"outputs": [{"tokens", "first_token_ts", "last_token_ts", "finish_reason",
            "logprobs"}], "seconds", "spec": {"drafts", "draft_tokens", "accepted",
            "accepted_per_pos"}}  (the spec-decode counters' increase over this request)
    {"cmd": "hidden_states", ...}  (not served: answered with an error)
    {"cmd": "exit"}

Every failure is answered as {"error": "<type>: <message>"}; the client decides what it means.

``vllm_worker.py --zygote SOCKET`` is the same worker started once and forked for each engine:
it imports vLLM (most of a worker's start on a CPU), builds nothing, and listens on the Unix
socket ``SOCKET``. Each connection sends one line, ``{"python": the interpreter the client
wants, "env": {...}, "log": path}``; the zygote answers ``{"pid": ...}`` from a forked child
that takes the environment, writes its log to ``path`` and then serves the protocol above on
that connection, as a process of its own would on its pipes; or ``{"error": ...}`` (another
interpreter was asked for) and the client starts a process of its own.
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback

SPEC_COUNTERS = {
    "vllm:spec_decode_num_drafts": "drafts",
    "vllm:spec_decode_num_draft_tokens": "draft_tokens",
    "vllm:spec_decode_num_accepted_tokens": "accepted",
}


def spec_counters(llm) -> dict:
    """vLLM's spec-decode counters, summed over engines."""
    out = {"drafts": 0, "draft_tokens": 0, "accepted": 0, "accepted_per_pos": []}
    for m in llm.get_metrics():
        if m.name in SPEC_COUNTERS:
            out[SPEC_COUNTERS[m.name]] += int(m.value)
        elif m.name == "vllm:spec_decode_num_accepted_tokens_per_pos":
            vals = [int(v) for v in m.values]
            acc = out["accepted_per_pos"]
            acc.extend([0] * (len(vals) - len(acc)))
            for i, v in enumerate(vals):
                acc[i] += v
    return out


def delta(after: dict, before: dict) -> dict:
    per = [
        a - (before["accepted_per_pos"][i] if i < len(before["accepted_per_pos"]) else 0)
        for i, a in enumerate(after["accepted_per_pos"])
    ]
    return {
        **{k: after[k] - before[k] for k in ("drafts", "draft_tokens", "accepted")},
        "accepted_per_pos": per,
    }


def error_line(e: BaseException) -> str:
    """The line of an exception's message that says what went wrong (pydantic's last line is
    a link), cut to 400 characters."""
    lines = [s.strip() for s in str(e).splitlines() if s.strip()]
    lines = [s for s in lines if not s.startswith("For further information")]
    return (lines[-1] if lines else "")[:400]


def _expand(output, input_val, cu_num_tokens, replace_from, replace_to, MAX_NUM_TOKENS=None):
    """vLLM's ``expand_kernel`` in torch, for any dtype: request i's value (``replace_from``
    read as ``replace_to``) written over its tokens, ``cu_num_tokens[i-1]:cu_num_tokens[i]``."""
    import torch

    cu = cu_num_tokens.to(torch.int64)
    counts = torch.diff(cu, prepend=cu.new_zeros(1))
    to = torch.tensor(replace_to, dtype=input_val.dtype, device=input_val.device)
    vals = torch.where(input_val == replace_from, to, input_val)
    n = int(cu[-1]) if len(cu) else 0
    output[:n].copy_(torch.repeat_interleave(vals, counts).to(output.dtype))


#: what the repair below says in the report
EXPAND_REPAIR = (
    "vLLM's CPU expand kernel wrote its per-token temperature / top-k / top-p into a copy and "
    "left the sampler's buffer unwritten (vLLM issue 55005): replaced by an exact torch version"
)


def cpu_expand_is_wrong(cpu_tl) -> bool:
    """Whether the CPU build's expand kernel (``cpu_tl``: its ``vllm.utils.cpu_triton_utils``)
    leaves a float32 output unwritten, checked on a small case: request values 0.5 and 2.0
    over 2 and 1 tokens must read 0.5, 0.5, 2.0."""
    import torch

    out = torch.full((3,), -1.0)
    try:
        # the platform loads the kernels built for this CPU (vllm._C needs AVX-512 with bf16;
        # importing it by name on an AVX2-only CPU kills the process with SIGILL)
        from vllm.platforms import current_platform

        current_platform.import_kernels()
        cpu_tl._expand_kernel_impl(
            out, torch.tensor([0.5, 2.0]), torch.tensor([2, 3], dtype=torch.int32), 0.0, 1.0
        )
    except Exception:  # noqa: BLE001 - a kernel that cannot run here is replaced too
        pass
    return out.tolist() != [0.5, 0.5, 2.0]


def repair_cpu_expand() -> str | None:
    """vLLM's CPU builds stand a C++ kernel in for the Triton ``expand_kernel`` that spreads each
    request's temperature, top-k and top-p over its draft positions before the rejection
    sampler. Its wrapper hands the int64-only kernel an int64 *copy* of the float32 / int32
    output and never copies it back, so at T > 0 the verifier divides the target's logits by
    uninitialised memory: acceptance collapses (vLLM 0.32's CPU build: 0 of 344 tests at the
    second draft position). Checked on a small case first; replaced only where it is wrong, so
    a build that has it right (a GPU build, a fixed CPU build) runs as it is. Returns the
    report's line, or None where nothing was repaired."""
    try:
        from vllm.utils import cpu_triton_utils as cpu_tl
    except ImportError:
        return None  # not a CPU build: Triton's kernel runs
    if getattr(cpu_tl, "_expand_kernel_impl", None) is None or not cpu_expand_is_wrong(cpu_tl):
        return None
    # 0.31 and 0.32 read the function by name when the platform registers its kernels; 0.27
    # to 0.30 wrap it once, at import, in the object the model runner hands the rejection
    # sampler (``cpu_tl.expand_kernel``): replacing the name alone left their sampler on the
    # broken kernel while the report said it was repaired
    cpu_tl._expand_kernel_impl = _expand
    wrapper = getattr(cpu_tl, "expand_kernel", None)
    if wrapper is not None and hasattr(wrapper, "func"):
        wrapper.func = _expand
    return EXPAND_REPAIR


#: each known defect's check-and-repair, run before loading: its report line, or None
REPAIRS = (repair_cpu_expand,)


class Worker:
    def __init__(self) -> None:
        self.llm = None

    def init(self, msg: dict) -> dict:
        import vllm
        from vllm import LLM
        from vllm.platforms import current_platform

        fixes = REPAIRS if msg.get("repair", True) else ()
        repairs = [line for fix in fixes if (line := fix()) is not None]
        t = time.perf_counter()
        self.llm = LLM(**msg["llm"], disable_log_stats=False)
        device = str(getattr(current_platform, "device_type", "?")).upper()
        return {
            "vllm": vllm.__version__,
            "seconds": time.perf_counter() - t,
            "device": device,
            "repairs": repairs,
        }

    def generate(self, msg: dict) -> dict:
        from vllm import SamplingParams

        # one set of sampling settings for every prompt, or one each (a seed per request)
        p = msg["params"]
        params = [SamplingParams(**x) for x in p] if isinstance(p, list) else SamplingParams(**p)
        before = spec_counters(self.llm) if msg.get("metrics", True) else None
        t = time.perf_counter()
        results = self.llm.generate(
            [{"prompt_token_ids": p} for p in msg["prompts"]], params, use_tqdm=False
        )
        seconds = time.perf_counter() - t
        outs = []
        for r in results:
            o = r.outputs[0]
            m = r.metrics
            lps = None
            if o.logprobs is not None:
                lps = [{str(k): float(v.logprob) for k, v in d.items()} for d in o.logprobs]
            outs.append(
                {
                    "tokens": list(o.token_ids),
                    "first_token_ts": getattr(m, "first_token_ts", None),
                    "last_token_ts": getattr(m, "last_token_ts", None),
                    "finish_reason": o.finish_reason,
                    "logprobs": lps,
                }
            )
        spec = delta(spec_counters(self.llm), before) if before is not None else None
        return {"outputs": outs, "seconds": seconds, "spec": spec}


def _own_path() -> None:
    # run as a script, this folder is first on the path: nothing of it may shadow vLLM's own
    here = os.path.dirname(os.path.abspath(__file__))
    sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != here]


def main() -> None:
    _own_path()
    serve()


def serve() -> None:
    """The protocol, on standard input and output."""
    answers = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # whatever vLLM prints goes to standard error
    worker = Worker()
    for line in sys.stdin:
        if not line.strip():
            continue
        msg = json.loads(line)
        cmd = msg.get("cmd")
        if cmd == "exit":
            answers.write(json.dumps({"bye": True}) + "\n")
            # nothing is left to save (one process, no engine core beside it): the interpreter's
            # teardown of vLLM would take seconds more (5.5 s on a 2-core Zen 3)
            sys.stderr.flush()
            answers.flush()
            os._exit(0)
        try:
            if cmd == "init":
                out = worker.init(msg)
            elif cmd == "generate":
                out = worker.generate(msg)
            else:
                out = {"error": f"ValueError: unknown request {cmd!r}"}
        except Exception as e:  # noqa: BLE001 - every failure is answered, not raised
            traceback.print_exc()
            out = {"error": f"{type(e).__name__}: {error_line(e)}"}
        answers.write(json.dumps(out) + "\n")


def _child(conn, req: dict) -> None:
    """In the forked child: the requested environment, the log, the connection as standard
    input and output; then the protocol, and exit."""
    os.setpgrp()  # killed with its own group, never the zygote's
    os.environ.clear()
    os.environ.update(req.get("env") or {})
    os.chdir(req.get("cwd") or ".")
    threads = os.environ.get("OMP_NUM_THREADS")
    if threads:
        import torch

        torch.set_num_threads(int(threads))  # the runtime read the zygote's value at load
    log = os.open(req["log"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(log, 2)
    os.close(log)
    os.dup2(conn.fileno(), 0)
    os.dup2(conn.fileno(), 1)
    conn.close()
    sys.stdin = os.fdopen(0, "r")
    sys.stdout = os.fdopen(1, "w", buffering=1)
    sys.stderr = os.fdopen(2, "w", buffering=1)
    os.write(1, (json.dumps({"pid": os.getpid()}) + "\n").encode())
    serve()


def zygote(path: str) -> None:
    """Import vLLM once, then fork a fresh worker for each connection on ``path``."""
    import signal
    import socket

    _own_path()
    # what Worker.init imports before its repairs, in its order: a child starts from the state
    # a process of its own would reach there, no further (no kernel loaded, no engine built)
    import vllm  # noqa: F401
    from vllm import LLM  # noqa: F401
    from vllm.platforms import current_platform  # noqa: F401

    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # children are reaped as they end
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    tmp = f"{path}.{os.getpid()}"
    srv.bind(tmp)
    srv.listen(16)
    os.replace(tmp, path)  # the socket appears once it accepts
    me = os.path.abspath(sys.executable)
    while True:
        conn, _ = srv.accept()
        try:
            with conn.makefile("r") as f:  # closed here, or the zygote would hold the socket
                line = f.readline()
            req = json.loads(line) if line.strip() else {}
            if os.path.abspath(req.get("python") or "") != me or "log" not in req:
                conn.sendall((json.dumps({"error": f"this zygote runs {me}"}) + "\n").encode())
                continue
            if os.fork() == 0:
                srv.close()
                signal.signal(signal.SIGCHLD, signal.SIG_DFL)
                try:
                    _child(conn, req)
                finally:
                    os._exit(0)
        except OSError:
            pass
        finally:
            conn.close()


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--zygote":
        zygote(sys.argv[2])
    else:
        main()
