"""Shared fixtures: the tiny random target, small conversation files, composed configs."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
CONF = ROOT / "conf"


def pytest_configure(config):
    """The suite runs on pytest-xdist workers (``-n`` in pyproject.toml). Each worker, and every
    process it starts, computes with one thread: two processes each running two OpenMP threads
    on two cores make PyTorch's small forwards 10-70x slower (the threads wait on each other)."""
    if os.environ.get("PYTEST_XDIST_WORKER"):
        for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):
            os.environ[var] = "1"
        torch.set_num_threads(1)


def free_port() -> int:
    """A TCP port nobody listens on now (for a launcher's rendezvous: tests run in parallel)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


CONVERSATION = [
    {"from": "human", "value": "What is the capital of France?"},
    {"from": "gpt", "value": "The capital of France is Paris."},
    {"from": "human", "value": "And of Italy?"},
    {"from": "gpt", "value": "Rome is the capital of Italy."},
]


def synthetic_conversations(n: int, seed: int = 0) -> list[dict]:
    """Varied, learnable conversations (a few templates, different numbers and words)."""
    import random

    rng = random.Random(seed)
    words = ["apple", "river", "stone", "cloud", "music", "paper", "light", "garden"]
    out = []
    for i in range(n):
        a, b = rng.randint(1, 99), rng.randint(1, 99)
        w = rng.choice(words)
        turns = [
            {"from": "human", "value": f"Add {a} and {b}, then tell me about {w}."},
            {
                "from": "gpt",
                "value": f"{a} plus {b} is {a + b}. A {w} is a {w}, and the {w} "
                f"is nice: {w} {w} {w}. " * rng.randint(1, 3),
            },
        ]
        if i % 3 == 0:
            turns += [
                {"from": "human", "value": "Say it again."},
                {"from": "gpt", "value": f"Again: {a} plus {b} is {a + b}."},
            ]
        out.append({"id": f"syn-{i}", "conversations": turns})
    return out


@pytest.fixture(scope="session", autouse=True)
def _env(tmp_path_factory):
    torch.set_num_threads(1 if os.environ.get("PYTEST_XDIST_WORKER") else 2)
    os.environ.setdefault("SPECDRAFT_CACHE", str(tmp_path_factory.mktemp("cache")))
    os.environ["HF_HUB_OFFLINE"] = "1"
    os.environ["WANDB_MODE"] = "offline"


#: where the decoder's exactness tests decode: cpu (CI), or cuda (scripts/gpu_check.sh, which
#: selects the tests that are written device-clean: the runner-parametrized ones)
TEST_DEVICE = os.environ.get("SPECDRAFT_TEST_DEVICE", "cpu")


@pytest.fixture(scope="session")
def tiny_target():
    from models.target import TargetConfig, load_target

    return load_target(TargetConfig(name="tiny_random", device=TEST_DEVICE, dtype="float32"))


@pytest.fixture(scope="session")
def windowed_target():
    """A tiny target whose every layer attends within a window of 8 tokens (Mistral's shape:
    the window its drafts read too, ``Target.draft_window``), short enough that the tests'
    rows cross it."""
    target = family_target("mistral", device=TEST_DEVICE)
    target.config.sliding_window = 8
    assert target.draft_window == 8
    return target


@pytest.fixture(scope="session")
def data_file(tmp_path_factory) -> Path:
    p = tmp_path_factory.mktemp("data") / "conv.jsonl"
    p.write_text("".join(json.dumps(r) + "\n" for r in synthetic_conversations(60)))
    return p


def compose(overrides: list[str]):
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    import trainer.train  # noqa: F401  registers the structured configs

    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        return hydra_compose("train", overrides=overrides)


def compose_prepare(data_file: Path, out: Path, **extra):
    """specdraft-prepare's config: the tiny target answering ``data_file`` into ``out``, in
    batches of 4, no progress bar; ``extra``: more overrides (key: value)."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    import flow.regenerate  # noqa: F401  registers the schema

    o = {"target": "tiny_random", "data.path": str(data_file), "out": str(out)}
    o |= {"batch_size": 4, "progress": "false", **extra}
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        return hydra_compose("prepare", overrides=[f"{k}={v}" for k, v in o.items()])


def tiny_overrides(data_file: Path, out: Path, **extra) -> list[str]:
    o = {
        "debug": "default",
        "data.path": str(data_file),
        "output_dir": str(out),
        "data.cache_dir": str(out.parent / "cache"),
        "train.log_every": 1,
        "train.progress": "false",
    }
    o.update(extra)
    return [f"{k}={v}" for k, v in o.items()]


def read_metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _installed(module: str, finder: str) -> bool:
    return getattr(__import__(module, fromlist=["x"]), finder)(required=False) is not None


#: tests that need a serving engine, skipped with the command that installs it
needs_vllm = pytest.mark.skipif(
    not _installed("decoding.engines.vllm_eval", "vllm_python"),
    reason="vLLM is not installed: `bash scripts/install.sh vllm` puts it in an environment of "
    "its own under the cache (a few minutes), or set SPECDRAFT_VLLM_PYTHON=<its python>",
)


def _runs_vllm(item) -> bool:
    return any(
        str(m.kwargs.get("reason", "")).startswith("vLLM is not installed")
        for m in item.iter_markers("skipif")
    )


def pytest_addoption(parser):
    parser.addoption(
        "--vllm-only",
        action="store_true",
        help="run only the tests that serve in vLLM (scripts/vllm_versions.py: one vLLM "
        "release after another, SPECDRAFT_VLLM_PYTHON naming each)",
    )


def pytest_collection_modifyitems(config, items):
    if not config.getoption("--vllm-only"):
        return
    keep = [i for i in items if _runs_vllm(i)]
    config.hook.pytest_deselected(items=[i for i in items if not _runs_vllm(i)])
    items[:] = keep


@pytest.fixture(scope="session", autouse=True)
def _vllm_zygote(request):
    """Where this session runs vLLM's tests: one zygote per test process, a process that imports
    vLLM once and forks each engine's worker from there (decoding/engines/vllm_zygote.py), so
    that an engine starts in ~6 s rather than ~20 s on a CPU. Set SPECDRAFT_VLLM_ZYGOTE= (empty)
    to start every engine as a process of its own."""
    import tempfile

    from decoding.engines import vllm_zygote
    from decoding.engines.vllm_eval import vllm_python

    python = vllm_python(required=False)
    if (
        vllm_zygote.ENV in os.environ
        or python is None
        or not any(_runs_vllm(i) for i in request.session.items)
    ):
        yield None
        return
    where = Path(tempfile.mkdtemp(prefix="specdraft-zygote-")) / "vllm.sock"
    if len(str(where)) > 100:  # a Unix socket's path has room for 107 bytes
        yield None
        return
    proc = vllm_zygote.start_zygote(python, where)
    os.environ[vllm_zygote.ENV] = str(where)
    try:
        yield where
    finally:
        os.environ.pop(vllm_zygote.ENV, None)
        vllm_zygote.stop_zygote(proc, where)
        import shutil

        shutil.rmtree(where.parent, ignore_errors=True)


needs_engine = pytest.mark.skipif(
    not _installed("decoding.engines.llama_cpp", "engine_dir"),
    reason="llama.cpp is not installed: `bash scripts/install.sh engine` builds it once "
    "(~15-40 CPU-minutes), or set SPECDRAFT_LLAMA_CPP=<bin dir>",
)


@pytest.fixture(scope="session", autouse=True)
def _fork_server(tmp_path_factory, _env):
    """One fork server per test process (tests/forkserver.py), for ``run_module``; set
    SPECDRAFT_TEST_FORKSERVER= (empty) to start every command as a process of its own."""
    import forkserver

    if forkserver.ENV in os.environ:
        yield None
        return
    folder = tmp_path_factory.mktemp("fork")
    if len(str(folder / "fork.sock")) > 100:  # a Unix socket's path has room for 107 bytes
        yield None
        return
    proc, path = forkserver.start(folder)
    _FORK_SERVER[0] = path
    try:
        yield path
    finally:
        _FORK_SERVER[0] = None
        proc.kill()
        proc.wait()


_FORK_SERVER: list[Path | None] = [None]


def run_module(module: str, args: list[str], timeout: int = 120) -> subprocess.CompletedProcess:
    """``python -m module args`` from the repo root, output captured: forked by the fork server
    where its environment allows (tests/forkserver.py), else a process of its own."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    if _FORK_SERVER[0] is not None:
        import forkserver

        r = forkserver.run(_FORK_SERVER[0], module, args, ROOT, env, timeout)
        if r is not None:
            return r
    return subprocess.run(
        [sys.executable, "-m", module, *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def accelerate_cmd(nproc: int, args: list[str], module: str = "flow") -> list[str]:
    """``accelerate launch --num_processes nproc -m module args`` on the CPU. Several
    processes go through the torch-elastic launcher (``--multi_gpu``; with no CUDA each trains
    on the CPU over gloo): accelerate's ``--cpu`` launches a single process unless mpirun is
    configured."""
    return [
        sys.executable,
        "-m",
        "accelerate.commands.launch",
        "--multi_gpu" if nproc > 1 else "--cpu",
        "--num_processes",
        str(nproc),
        "--num_machines",
        "1",
        "--mixed_precision",
        "no",
        "--dynamo_backend",
        "no",
        *(["--main_process_port", str(free_port())] if nproc > 1 else []),
        "-m",
        module,
        *args,
    ]


def accelerate_launch(
    nproc: int, args: list[str], timeout: int = 300, module: str = "flow"
) -> subprocess.CompletedProcess:
    """``accelerate_cmd`` run to the end, output captured."""
    cmd = accelerate_cmd(nproc, args, module)
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)


def final_weights(run_dir: Path) -> dict:
    """Every tensor of a run's saved draft (``final/``, its adapter too), by file and name."""
    from safetensors.torch import load_file

    out = {}
    for f in sorted((run_dir / "final").rglob("*.safetensors")):
        out |= {f"{f.parent.name}/{k}": v for k, v in load_file(str(f)).items()}
    return out


def copy_stopped_after(run_dir: Path, dest: Path, step: int) -> Path:
    """A copy of a finished run as it was after its step-``step`` checkpoint, for
    ``resume=true``: no ``final/``, no summary, no later checkpoint."""
    import shutil

    shutil.copytree(run_dir, dest)
    for p in (dest / "final", dest / "summary.json"):
        shutil.rmtree(p) if p.is_dir() else p.unlink()
    for ck in (dest / "checkpoints").glob("step_*"):
        if int(ck.name.removeprefix("step_")) > step:
            shutil.rmtree(ck)
    return dest


def launch_with_config(
    config: str,
    args: list[str],
    nproc: int = 2,
    timeout: int = 300,
    script: Path | None = None,
    env: dict[str, str] | None = None,
) -> subprocess.CompletedProcess:
    """``accelerate launch --config_file scripts/accelerate/<config>`` (or a path of its own)
    with ``nproc`` processes
    in float32, through ``tests/accelerate_on_cpu.py`` (or ``script``, which runs it), which
    keeps the config's FSDP or DeepSpeed on CPU processes (accelerate applies both to GPU
    processes only); ``env``: more environment variables."""
    script = script or ROOT / "tests" / "accelerate_on_cpu.py"
    cmd = [sys.executable, "-m", "accelerate.commands.launch"]
    cmd += ["--config_file", str(ROOT / "scripts" / "accelerate" / config)]
    cmd += ["--num_processes", str(nproc), "--mixed_precision", "no"]
    cmd += ["--main_process_port", str(free_port()), str(script)]
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1", **(env or {})}
    return subprocess.run(
        [*cmd, *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout
    )


@pytest.fixture(params=[False, True], ids=["sample_on_host", "sample_on_device"])
def sampling_where(request, monkeypatch):
    """At T > 0, each row's rejection sampling on the host (row by row) or on the device (the
    batch at once, one read: ``verify.sampled_on_device``), whatever the device is (on a GPU
    the decoder's own choice is the device: scripts/gpu_check.sh leaves the host's out).

    Crossed with nothing, a test runs both ways. A chi-square test over a grid of settings
    pairs the two with its settings instead (``parametrize("...,sampling_where", ...,
    indirect=["sampling_where"])``): the two ways are the same law for every kind of proposal
    and batch, which tests/test_verify.py checks on the functions themselves, so at the
    decoder's level each way needs its settings covered, not every setting twice."""
    from decoding.batch import BatchDecoder

    monkeypatch.setattr(BatchDecoder, "sample_on_device", request.param)
    return request.param


def assert_first_two_tokens_follow_the_target(target, dec, prompt, s, gen=2, n=2500):
    """Chi-square test (false-alarm rate 1e-3) that the two tokens after a request's first
    (the prefill's, which nothing drafts) follow the target's warped distribution ``s``, over a
    10-token vocabulary: ``dec`` generates 1 + ``gen`` tokens, so its first verification may
    draft up to ``gen - 1`` tokens; the pair's distribution is the target's, summed over the
    first token."""
    pairs = [tuple(dec.generate(prompt, 1 + gen)[1:3]) for _ in range(n)]
    assert_pairs_follow_the_target(target, prompt, s, pairs)


def assert_pairs_follow_the_target(target, prompt, s, pairs, what=""):
    """Chi-square test (false-alarm rate 1e-3) that sampled (second, third) tokens after
    ``prompt`` follow the target's warped distribution ``s`` over a 10-token vocabulary (the
    first token summed out: it is the prefill's, and sampled as plain decoding samples)."""
    from scipy.stats import chisquare

    from models.sampling import warp

    dev = target.device

    def dist(seq):
        return warp(target.model(torch.tensor([seq], device=dev)).logits[0, -1], s).double().cpu()

    expected = torch.zeros(100, dtype=torch.float64)
    with torch.no_grad():
        p1 = dist(prompt)
        for x in range(10):
            if p1[x] == 0:
                continue
            p2 = dist(prompt + [x])
            p3 = torch.stack([dist(prompt + [x, y]) for y in range(10)])
            expected += p1[x] * (p2[:, None] * p3).flatten()
    expected /= expected.sum()  # float32 distributions: their sum is 1 to ~1e-7
    n = len(pairs)
    counts = torch.zeros(100, dtype=torch.float64)
    for a, b in pairs:
        counts[a * 10 + b] += 1
    e = expected * n
    keep = e >= 5
    obs = torch.cat([counts[keep], counts[~keep].sum()[None]])
    exp = torch.cat([e[keep], e[~keep].sum()[None]])
    assert (counts[expected == 0] == 0).all(), what
    mask = exp > 0
    assert chisquare(obs[mask].numpy(), exp[mask].numpy()).pvalue > 1e-3, what


def small_vocab_llama(seed: int, layers: int = 2):
    """A tiny random Llama over a 10-token vocabulary, its LM head sharpened (x40) so that its
    distributions are distinct: the chi-square tests' model."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=10,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
    )
    m = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        m.lm_head.weight.mul_(40.0)
    return m


def small_vocab_target(layers: int = 2):
    """``small_vocab_llama(0, layers)`` as a target."""
    from models.target import Target, TargetConfig

    model = small_vocab_llama(0, layers).to(TEST_DEVICE)
    return Target(model, None, "small-vocab", TargetConfig(name="test"))


@pytest.fixture(scope="module")
def small_vocab_pair():
    """A target and a draft over a 10-token vocabulary (tiny random Llamas, sharpened)."""
    return small_vocab_target(), small_vocab_llama(1).to(TEST_DEVICE)


def family_target(family: str, device: str = "cpu", **kw):
    """A 4-layer tiny random target of ``family`` (``models/families.py``), float32 on the CPU
    (or ``device``)."""
    from models.target import TargetConfig, load_target

    return load_target(
        TargetConfig(
            name="tiny_random", device=device, dtype="float32", tiny_layers=4, family=family, **kw
        )
    )


def every_third_eagle3(target, seed: int = 0, noise: float = 0.05, **flags):
    """An EAGLE-3 head fusing layers 1-3 with a chosen draft vocabulary of 64 ids, every third
    token (draft id i is target id 3i: not the identity, so every layout's mapping is read),
    its weights ``noise`` livelier than the init so that proposals vary; ``flags``: more
    ``Eagle3Config`` fields. The exports' and engines' tests' head."""
    from models.eagle import Eagle3Config, Eagle3Head

    torch.manual_seed(seed)
    cfg = Eagle3Config(fuse_layers=[1, 2, 3], draft_vocab_size=64, **flags)
    head = Eagle3Head(target, cfg).eval()
    with torch.no_grad():
        head.d2t.copy_(torch.arange(64) * 2)
        head.t2d.zero_()
        head.t2d[torch.arange(64) * 3] = True
        for p in head.parameters():
            p.add_(torch.randn_like(p) * noise)
    head.vocab_chosen = True
    return head


def vllm_acceptance(outs, n: int) -> list[float]:
    """Acceptance at each of ``n`` positions as vLLM counts it, from its completions'
    counters: the tokens accepted there over its drafting steps."""
    drafts = sum(o.timings["drafts"] for o in outs)
    assert drafts > 0, "vLLM drafted nothing"
    return [
        sum((o.timings["accepted_per_pos"] + [0] * n)[k] for o in outs) / drafts for k in range(n)
    ]


def steps_acceptance(steps: list[tuple[int, int]], n: int) -> list[float]:
    """Acceptance at each of ``n`` positions from an engine's (accepted, drafted) steps
    (llama.cpp's log): accepted there over the steps that drafted that far."""
    return [
        sum(a >= k for a, _ in steps) / max(sum(d >= k for _, d in steps), 1)
        for k in range(1, n + 1)
    ]


def our_acceptance(stats, n: int) -> list[float]:
    """The built-in decoder's acceptance at each of ``n`` positions, counted as the engines
    count theirs: accepted there over the drafts that reached it."""
    return [stats.accepted[k] / max(stats.drafted[k], 1) for k in range(1, n + 1)]


def accepting_block_draft(draft, prompts: list[list[int]]):
    """A DFlash (or DSpark) draft of a tiny target that accepts, and only where an engine
    serves its weights as trained: 60 steps on the target's own greedy answers to ``prompts``
    (of one length; a tiny target repeats a prompt's last token; argmax targets), then its
    first layer's weights blurred by seeded noise of their mean size, so that positions can
    accept unevenly (the vLLM test's DFlash draft: 0.12 at slot 1 to 0.10 at slot 7). It
    reads the context: trained so, a draft with ``fc``'s rows rolled by one accepted nothing.
    No hand-set lens does this: the mask slots' queries and keys pass through per-head norms
    (Qwen3's), so they cannot be set to copy the anchor token."""
    t = draft.target
    ids = torch.tensor(prompts)
    with torch.no_grad():
        ids = t.model.generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=40, do_sample=False
        )
    mask = torch.ones_like(ids)
    loss_mask = mask.clone()
    loss_mask[:, : len(prompts[0])] = 0
    batch = {
        "input_ids": ids,
        "attention_mask": mask,
        "loss_mask": loss_mask,
        "features": t.features(ids, mask, draft.feature_layers),
    }
    draft.cfg.targets = "hard"
    draft.train()
    opt = torch.optim.AdamW([p for p in draft.parameters() if p.requires_grad], lr=1e-2)
    for _ in range(60):
        out = draft(batch)
        opt.zero_grad()
        out.loss.backward()
        opt.step()
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for p in draft.layers[0].parameters():
            p += 1.0 * p.abs().mean() * torch.randn(p.shape, generator=g)
    return draft.eval()


def tiny_target_gguf(path, target) -> Path:
    """A GGUF holding what ``--format gguf`` reads of a target's: its shape and tokenizer (the
    embedded SmolLM2's is a real one; tiny targets have none)."""
    import gguf

    w = gguf.GGUFWriter(str(path), "llama")
    w.add_embedding_length(target.config.hidden_size)
    w.add_block_count(target.config.num_hidden_layers)
    w.add_tokenizer_model("gpt2")
    w.add_token_list([f"t{i}" for i in range(target.config.vocab_size)])
    w.add_token_types([1] * target.config.vocab_size)
    w.add_eos_token_id(0)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return Path(path)


# The target runners the decoder's exactness tests run on (decoding/runner.py): transformers'
# forward, the lean static-cache forward (eager), and the CUDA-graph path's fixed widths and
# static buffers run eagerly ("graphs" here; real graphs in scripts/gpu_check.sh on CUDA)
RUNNERS = ["transformers", "static", "graphs"]


def make_runner(kind: str, target, layers=(), widths=(1, 8)):
    from decoding.runner import HFRunner, StaticRunner

    if kind == "transformers":
        return HFRunner(target, tuple(layers))
    graphs = {"graphs": "cuda" if target.device.type == "cuda" else "emulate"}.get(kind, "off")
    return StaticRunner(target, tuple(layers), widths, graphs=graphs, max_len=256)


#: the decoder's compile= setting that runs each of RUNNERS (on CUDA, true captures graphs)
COMPILE = {
    "transformers": "false",
    "static": "true",
    "graphs": "true" if TEST_DEVICE.startswith("cuda") else "emulate",
}


def script_outcome(script: str, monkeypatch, capsys, *args: str) -> tuple[int, str, str]:
    """``scripts/<script>.py``'s ``main()`` with ``args`` as its command line: its exit
    status, standard output and standard error."""
    import importlib

    scripts = str(Path(__file__).resolve().parents[1] / "scripts")
    if scripts not in sys.path:
        sys.path.insert(0, scripts)
    module = importlib.import_module(script)
    monkeypatch.setattr(sys, "argv", [f"{script}.py", *args])
    try:
        module.main()
        rc = 0
    except SystemExit as e:
        rc = e.code
    out = capsys.readouterr()
    return rc, out.out, out.err


def finished_training_run(cfg) -> dict:
    """A training run's stand-in for the run flow's tests: a finished run's summary and
    metrics, written at once, its validation loss the configured lr."""
    summary = {"reason": "finished", "final": None, "step": 3, "val": {"loss": cfg.optim.lr}}
    with open(f"{cfg.output_dir}/summary.json", "w") as f:
        f.write(json.dumps(summary))
    with open(f"{cfg.output_dir}/metrics.jsonl", "w") as f:
        f.write(json.dumps({"step": 3, "loss": cfg.optim.lr}) + "\n")
    return summary
