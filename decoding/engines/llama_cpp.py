"""llama.cpp as the engine that decodes: find it, run ``llama-server`` on loopback, decode token
ids through its ``/completion`` endpoint, read its own timings and draft counters.

The engine is optional (``bash scripts/install.sh engine`` builds llama.cpp b11434 once into
``~/.cache/specdraft/llama.cpp-b11434/bin``; ``SPECDRAFT_LLAMA_CPP=<bin dir>`` names another
build). Every server started here is stopped when its ``with`` block ends, when the process
exits and on SIGTERM (``process.EngineProcess``): none is left running after the evaluator.
"""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from .base import Completion, EngineError, cache_root, default_threads, engine_draft_dir
from .process import EngineProcess

BUILD = 11434  # the llama.cpp build scripts/install_engine.sh installs (EAGLE-3 since b9606)
PROGRAMS = ("llama-server", "llama-bench")
INSTALL_HINT = (
    "bash scripts/install.sh engine (builds llama.cpp once, ~15-40 minutes on 2 cores), or set "
    "SPECDRAFT_LLAMA_CPP=<a llama.cpp bin dir>"
)

#: the target architectures (a target GGUF's ``general.architecture``) whose graph hands
#: llama.cpp b11434's EAGLE-3 and DFlash-family drafters the target's layer inputs: the model
#: builders that set ``t_layer_inp`` in its ``src/models/`` (a test reads them from the cached
#: source tree). A target of any other architecture (qwen2, gemma2, gemma3, phi3, olmo2,
#: deepseek2, ...) loads, then aborts the server at its first speculative step.
FEATURE_ARCHS = frozenset(
    {
        "bailingmoe3", "deepseek4", "gemma4", "gpt-oss", "hunyuan_vl", "lfm2", "llama", "mimo2",
        "minimax-01", "minimax-m2", "muse-glimmer", "nanbeige", "nemotron_h", "qwen3", "qwen35",
        "qwen35moe", "qwen3moe", "qwen3next", "qwen4exp",
    }
)  # fmt: skip
#: the speculative types whose drafts read the target's layer inputs
FEATURE_DRAFTS = ("draft-eagle3", "draft-dflash", "draft-dspark")


def gguf_architecture(path: str | Path) -> str | None:
    """A GGUF's ``general.architecture`` (its header only is read)."""
    from models.gguf import field, read

    return field(read(path, EngineError), "general.architecture")


def check_feature_target(target: str | Path, spec_type: str | None) -> None:
    """Refuse, in one line and before any server starts, a draft that reads the target's
    layer inputs (EAGLE-3, DFlash, DSpark) against a target whose architecture llama.cpp
    gives none (``FEATURE_ARCHS``): its server would load both and abort at the first draft
    ("layer input tensor is null")."""
    if spec_type not in FEATURE_DRAFTS:
        return
    arch = gguf_architecture(target)
    if arch not in FEATURE_ARCHS:
        kind = spec_type.removeprefix("draft-")
        raise EngineError(
            f"{target}: a {arch!r} target: llama.cpp b{BUILD} feeds {kind} drafts the layer "
            f"inputs of {', '.join(sorted(FEATURE_ARCHS))} targets only (on this one its "
            "server aborts at the first draft: 'layer input tensor is null'); measure the draft "
            "in vLLM (engine=vllm) or the built-in decoder"
        )


def engine_dir(required: bool = True) -> Path | None:
    """The llama.cpp bin dir: ``$SPECDRAFT_LLAMA_CPP``, else the cached build; None (or
    EngineError when ``required``) where neither holds the programs."""
    env = os.environ.get("SPECDRAFT_LLAMA_CPP")
    if env:
        cands = [Path(env).expanduser()]
    else:  # the cache in use, then the default one (a test may point the cache elsewhere)
        roots = dict.fromkeys([cache_root(), Path("~/.cache/specdraft").expanduser()])
        cands = [r / f"llama.cpp-b{BUILD}" / "bin" for r in roots]
    for cand in cands:
        missing = [p for p in PROGRAMS if not (cand / p).is_file()]
        if not missing:
            return cand
    cand = cands[0]
    if required:
        where = f"SPECDRAFT_LLAMA_CPP={env}" if env else str(cand)
        raise EngineError(
            f"llama.cpp not found ({where} has no {', '.join(missing)}): {INSTALL_HINT}"
        )
    return None


def engine_source() -> Path | None:
    """llama.cpp's source tree of the cached build (its converter and gguf-py), if there."""
    for root in dict.fromkeys([cache_root(), Path("~/.cache/specdraft").expanduser()]):
        src = root / f"llama.cpp-b{BUILD}" / "src"
        if (src / "convert_hf_to_gguf.py").is_file():
            return src
    return None


def convert_hf(
    hf_dir: Path,
    out: Path,
    outtype: str = "q8_0",
    log=print,
    extra: tuple[str, ...] = (),
    tiny_tokenizer: bool = False,
) -> Path:
    """``hf_dir`` (a Hugging Face causal LM folder with its tokenizer) as a GGUF at ``out``,
    converted by llama.cpp's own ``convert_hf_to_gguf.py`` from the cached build's source tree
    (a target, or a standalone draft model such as a DistillSpec student, is served this way);
    ``extra``: more converter arguments (``--target-model-dir <dir>`` for a draft head's
    layout). ``tiny_tokenizer``: the folder holds the tiny targets' tokenizer (byte-level BPE
    made here, no merges), which the converter is told is GPT-2's pre-tokenizer (it knows only
    published tokenizers, by a hash of their output) and given one merge that never applies
    (llama.cpp loads no BPE vocabulary without merges); token ids are fed as they are."""
    import sys

    src = engine_source()
    if src is None:
        raise EngineError(f"llama.cpp's converter is not in the cache: {INSTALL_HINT}")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".part")
    env = {**os.environ, "PYTHONPATH": str(src / "gguf-py"), "HF_HUB_OFFLINE": "1"}
    log(f"converting {hf_dir} to GGUF ({outtype}) with llama.cpp's convert_hf_to_gguf.py")
    argv = [str(src / "convert_hf_to_gguf.py"), str(hf_dir), "--outtype", outtype,
            "--outfile", str(tmp), *extra]  # fmt: skip
    if not tiny_tokenizer:
        cmd = [sys.executable, *argv]
    else:  # the converter as it is, told what it cannot know of a tokenizer made here
        code = (
            "import runpy, sys; sys.path.insert(0, sys.argv[1]); import gguf; "
            "import conversion.base as b; "
            "b.TextModel.get_vocab_base_pre = lambda self, tokenizer: 'gpt-2'; "
            "add = gguf.SpecialVocab.add_to_gguf; "
            "gguf.SpecialVocab.add_to_gguf = lambda self, gw, quiet=False: "
            "(setattr(self, 'merges', self.merges or ['\u0120\u0120 \u0120\u0120\u0120']), "
            "add(self, gw, quiet)); "
            "sys.argv = sys.argv[2:]; runpy.run_path(sys.argv[0], run_name='__main__')"
        )
        cmd = [sys.executable, "-c", code, str(src), *argv]
    r = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=1800)
    if r.returncode != 0:
        tmp.unlink(missing_ok=True)
        last = (r.stderr.strip().splitlines() or ["(no output)"])[-1]
        raise EngineError(f"llama.cpp's converter failed on {hf_dir}: {last}")
    os.replace(tmp, out)
    return out


#: the converter's --outtype for a target in each dtype: the weights the built-in decoder runs
TARGET_OUTTYPES = {"float32": "f32", "float16": "f16", "bfloat16": "bf16"}


def converted_target(target, log=print) -> Path:
    """``target`` as the GGUF ``llama-server`` loads: its Hugging Face folder (or hub id)
    converted once by llama.cpp's own converter, in the target's own dtype, cached under
    ``engine-targets`` and keyed by the target's identity and its weights' names, sizes and
    times (a changed folder is converted again); a tiny random target's with its tokenizer
    made known to the converter (``convert_hf``'s ``tiny_tokenizer``)."""
    from models.target import target_folder

    from ..drafts import _hub_folder

    tiny = target.cfg.name == "tiny_random" and target.cfg.path is None
    folder = target_folder(target)
    if not folder.is_dir():
        folder = _hub_folder(str(folder), "target.path")
    outtype = TARGET_OUTTYPES.get(str(target.dtype).removeprefix("torch."), "f32")
    where = engine_draft_dir(folder, f"-{outtype}", "engine-targets", salt=target.identity)
    out = where / "target.gguf"
    if not out.is_file():
        convert_hf(folder, out, outtype, log, tiny_tokenizer=tiny)
    return out


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def port_in_use(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


def spec_args(spec_type: str, n_max: int, p_min: float, ngram: int = 3) -> list[str]:
    """llama-server flags that set the draft length (and, for model drafts, the confidence stop)
    of ``spec_type``. Set at start: b11434's eagle3 drafter ignores a request's
    ``speculative.n_max``/``p_min``, and each n-gram type has its own length flag."""
    if spec_type.startswith("draft-"):
        return ["--spec-draft-n-max", str(n_max), "--spec-draft-p-min", str(p_min)]
    if spec_type == "ngram-mod":  # its default drafts 48-64 tokens or none
        return ["--spec-ngram-mod-n-max", str(n_max), "--spec-ngram-mod-n-min", str(min(48, n_max))]
    if spec_type in ("ngram-simple", "ngram-map-k", "ngram-map-k4v"):
        # their default lookup is a 12-token n-gram, which chat rarely repeats
        return [f"--spec-{spec_type}-size-m", str(n_max), f"--spec-{spec_type}-size-n", str(ngram)]
    return []


STEP_LINE = re.compile(r"accepted\s+(\d+)/\s*(\d+) draft tokens")


class LlamaServer(EngineProcess):
    """``llama-server`` on 127.0.0.1 for one model (and, optionally, a draft), one slot.

    with LlamaServer(target_gguf, draft_gguf, spec_type="draft-eagle3") as srv:
        out = srv.complete(prompt_ids, n_predict=128, temperature=0.0)
    """

    log_prefix = "llama-server-"

    def __init__(
        self,
        model: str | Path,
        draft: str | Path | None = None,
        spec_type: str | None = None,
        n_max: int = 3,
        p_min: float = 0.0,
        ngram: int = 3,
        threads: int | None = None,
        ctx_size: int = 4096,
        port: int | None = None,
        repack: bool = True,
        extra: list[str] | None = None,
        startup_timeout: float = 180.0,
        bin_dir: Path | None = None,
        check_target: bool = True,
    ):
        self.bin = (bin_dir or engine_dir()) / "llama-server"
        self.model, self.draft, self.spec_type = Path(model), draft, spec_type
        for f in (self.model, *([Path(draft)] if draft else [])):
            if not Path(f).is_file():
                raise EngineError(f"{f}: no such GGUF file")
        if draft and check_target:  # check_target=False: to watch the engine's own failure
            check_feature_target(self.model, spec_type)
        if port is not None and port_in_use(port):
            raise EngineError(f"port {port} on 127.0.0.1 is in use: pick another or leave it unset")
        self.port = port or free_port()
        self.threads = default_threads(threads)
        args = [
            str(self.bin), "-m", str(self.model), "--host", "127.0.0.1", "--port",
            str(self.port), "-np", "1", "-t", str(self.threads), "-c", str(ctx_size),
            "--no-webui", "--no-warmup", "-lv", "3",
        ]  # fmt: skip
        if draft:
            args += ["-md", str(draft), "-td", str(self.threads)]
        if spec_type:
            args += ["--spec-type", spec_type, *spec_args(spec_type, n_max, p_min, ngram)]
        if not repack:  # llama.cpp's plain weight layouts (see ``repack_works``)
            args += ["--no-repack"]
        self.args = args + list(extra or [])
        self.startup_timeout = startup_timeout
        super().__init__()

    # -- life cycle (the log, ``with`` and the stop at exit: process.EngineProcess) ------------

    def start(self) -> None:
        env = {**os.environ, "LLAMA_TRACE": "1"}  # one "accepted a/n draft tokens" line a step
        log = self.open_log("wb")
        proc = self.launch(
            subprocess.Popen(
                self.args, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env
            )
        )
        t0 = time.monotonic()
        while True:
            if proc.poll() is not None:
                tail = self.log_tail()
                self.close()
                raise EngineError(
                    f"llama-server exited with code {proc.returncode} while starting "
                    f"({' '.join(self.args[1:5])}...): {tail}"
                )
            try:
                with urllib.request.urlopen(f"{self.url}/health", timeout=2) as r:
                    if r.status == 200:
                        return
            except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
                pass
            if time.monotonic() - t0 > self.startup_timeout:
                tail = self.log_tail()
                self.close()
                raise EngineError(
                    f"llama-server did not answer /health within {self.startup_timeout:.0f} s: {tail}"
                )
            time.sleep(0.2)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    # -- requests --------------------------------------------------------------------------

    def complete(
        self,
        prompt: list[int],
        n_predict: int,
        temperature: float = 0.0,
        seed: int = 0,
        top_k: int = 0,
        top_p: float = 1.0,
        timeout: float = 600.0,
    ) -> Completion:
        """Decode ``n_predict`` tokens after ``prompt`` (token ids, fed as they are: no template,
        no BOS added)."""
        body: dict[str, Any] = {
            "prompt": [int(t) for t in prompt],
            "n_predict": int(n_predict),
            "temperature": float(temperature),
            "top_k": int(top_k),
            "top_p": float(top_p),
            "min_p": 0.0,
            "seed": int(seed),
            "cache_prompt": False,
        }
        start = self.log_path.stat().st_size if self.log_path.exists() else 0
        out = self.post(body, timeout)
        steps = self._steps_since(start)
        tokens = list(out.get("tokens") or [])
        timings = dict(out.get("timings") or {})
        # predicted_ms runs from the first token (sampled from the prompt's forward) to the
        # last: it times predicted_n - 1 forwards, as llama.cpp's own tokens/s counts them
        # (one token in 1 us read as a million tokens/s)
        timings["timed_n"] = max(0, int(timings.get("predicted_n") or len(tokens)) - 1)
        return Completion(tokens, timings, steps)

    def top_logprobs(self, prompt: list[int], k: int) -> dict[int, float]:
        """The top-``k`` next-token log-probs after ``prompt`` (a request of its own)."""
        out = self.post(
            {
                "prompt": [int(t) for t in prompt],
                "n_predict": 1,
                "temperature": 0.0,
                "n_probs": int(k),
                "post_sampling_probs": False,
                "cache_prompt": False,
            }
        )
        probs = (out.get("completion_probabilities") or [{}])[0].get("top_logprobs") or []
        return {int(c["id"]): float(c["logprob"]) for c in probs if "id" in c}

    def post(self, body: dict[str, Any], timeout: float = 600.0) -> dict[str, Any]:
        """One ``/completion`` request; its JSON answer."""
        if self.proc is None or self.proc.poll() is not None:
            raise EngineError(f"llama-server is not running: {self.log_tail()}")
        req = urllib.request.Request(
            f"{self.url}/completion",
            data=json.dumps({"return_tokens": True, "stream": False, **body}).encode(),
            headers={"Content-Type": "application/json"},
        )
        try:
            with urllib.request.urlopen(req, timeout=timeout) as r:
                return json.loads(r.read())
        except urllib.error.HTTPError as e:
            raise EngineError(f"llama-server answered {e.code}: {e.read()[:300]!r}") from None
        except (urllib.error.URLError, ConnectionError, TimeoutError) as e:
            raise EngineError(
                f"llama-server failed during a request ({e}): {self.log_tail()}"
            ) from None

    def _steps_since(self, offset: int) -> list[tuple[int, int]]:
        # the server logs from its own thread; its last lines for this request may trail the
        # HTTP answer by a moment
        self._log.flush()
        time.sleep(0.02)
        with open(self.log_path, "rb") as f:
            f.seek(offset)
            text = f.read().decode(errors="replace")
        return [(int(a), int(n)) for a, n in STEP_LINE.findall(text)]


REPACK_MODES = ("auto", "on", "off")
_REPACK_PROBED: dict[tuple[str, str], bool] = {}


def repack_works(model: str | Path, bin_dir: Path | None = None) -> bool:
    """Whether llama.cpp runs ``model`` here with its repacked CPU weight layouts (its "extra
    buffer types": AMX tiles, AVX-512 / AVX2 repacks), on by default in llama.cpp. On an Intel
    Xeon with AMX (a Firecracker VM, 2026-11-27) b11434 died with SIGSEGV at the Q4_1 target's
    first forward of 2 or more tokens with them (1-token forwards ran) and ran without them. One
    8-token ``llama-bench`` run tells; the answer is kept per model and build for the process.
    A failure that is not a crash (a bad file) raises."""
    bench = (bin_dir or engine_dir()) / "llama-bench"
    key = (str(bench), str(model))
    if key not in _REPACK_PROBED:
        args = [str(bench), "-m", str(model), "-p", "8", "-n", "0", "-r", "1", "-t", "1"]
        r = subprocess.run(args, capture_output=True, text=True, timeout=300)
        if r.returncode > 0:
            raise EngineError(
                f"llama-bench could not run {model} ({r.returncode}): {r.stderr.strip()[-300:]}"
            )
        _REPACK_PROBED[key] = r.returncode == 0  # < 0: killed by a signal
    return _REPACK_PROBED[key]


def resolve_repack(mode: str, model: str | Path, log=print, bin_dir: Path | None = None) -> bool:
    """``engine_repack``: on / off as given; auto = on unless ``repack_works`` finds that
    llama.cpp crashes with it on this machine, then off, said in one line."""
    if mode not in REPACK_MODES:
        raise EngineError(f"engine_repack={mode!r}: one of {', '.join(REPACK_MODES)}")
    if mode != "auto":
        return mode == "on"
    if repack_works(model, bin_dir):
        return True
    log(
        "engine: llama.cpp crashes on this CPU with its repacked weight layouts (AMX / AVX-512 "
        "repack); serving with --no-repack (engine_repack=on forces them)"
    )
    return False


def bench_forward_ms(
    model: str | Path,
    sizes: list[int],
    threads: int,
    depth: int = 128,
    reps: int = 5,
    repack: bool = True,
) -> dict[int, float]:
    """The target's forward over k tokens in the engine (``llama-bench``: prompt processing of
    k tokens at a context of ``depth``), in ms, for each k in ``sizes``: what verifying k-1
    drafted tokens costs there."""
    bench = engine_dir() / "llama-bench"
    args = [
        str(bench), "-m", str(model), "-p", ",".join(str(k) for k in sizes), "-n", "0",
        "-d", str(depth), "-r", str(reps), "-t", str(threads), "-o", "json",
        "--repack", "1" if repack else "0",
    ]  # fmt: skip
    r = subprocess.run(args, capture_output=True, text=True, timeout=900)
    if r.returncode != 0:
        raise EngineError(f"llama-bench failed ({r.returncode}): {r.stderr.strip()[-400:]}")
    rows = json.loads(r.stdout)
    out = {}
    for row in rows:
        k = int(row["n_prompt"])
        out[k] = float(row["avg_ns"]) / 1e6
    return out
