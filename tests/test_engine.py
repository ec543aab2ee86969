"""llama.cpp as the engine: GGUF export of EAGLE-3, DFlash and DSpark drafts (always) and,
where llama.cpp is installed (`bash scripts/install.sh engine`), the engine loading and
decoding our drafts (DistillSpec students too, as draft models), our GGUFs against llama.cpp's
own converter, and `specdraft-eval engine=llama.cpp`."""

from __future__ import annotations

import json
import socket
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import (
    accepting_block_draft,
    every_third_eagle3,
    family_target,
    needs_engine,
    our_acceptance,
    run_module,
    steps_acceptance,
    tiny_target_gguf,
)

from models import export as ex
from models.base import DraftError
from models.eagle.gguf import permute, unpermute
from models.export import ExportError, detect_format, export, import_draft
from models.target import Target, TargetConfig, saved_target_config
from models.tiny import build_tiny_target

gguf = pytest.importorskip("gguf")


@pytest.fixture(scope="module")
def target4():
    model, tok = build_tiny_target(seed=1, num_layers=4)
    return Target(model, tok, "tiny4", TargetConfig(name="tiny_random"))


def test_an_engine_export_is_made_again_when_the_layout_code_changes(
    target4, tmp_path, monkeypatch
):
    """A trained draft is exported for an engine once and cached; the cache is keyed by the
    code that writes the layouts too, so a layout fixed since (an export an older specdraft
    wrote) is exported again rather than served as it was."""
    from decoding.engines import base
    from models.eagle import Eagle3Config, Eagle3Head

    monkeypatch.setenv("SPECDRAFT_CACHE", str(tmp_path / "cache"))
    run = tmp_path / "run"
    (run / "final").mkdir(parents=True)
    (run / "final" / "model.safetensors").write_bytes(b"weights")
    torch.manual_seed(0)
    head = Eagle3Head(target4, Eagle3Config(fuse_layers=[1, 2, 3], draft_vocab_size=64)).eval()
    head.vocab_chosen = True
    said: list[str] = []

    def log(msg):
        said.append(str(msg))

    first = base.cached_export(run, head, "vllm", log, "-vllm", dtype="float32")
    again = base.cached_export(run, head, "vllm", log, "-vllm", dtype="float32")
    assert first == again and sum(m.startswith("exporting") for m in said) == 1
    monkeypatch.setattr(base, "export_code_digest", lambda: "another layout")
    fixed = base.cached_export(run, head, "vllm", log, "-vllm", dtype="float32")
    assert fixed != first and (fixed / "config.json").is_file()
    assert sum(m.startswith("exporting") for m in said) == 2


def test_the_layout_digest_follows_every_exporters_code(tmp_path, monkeypatch):
    """The digest reads each method's ``export.py`` and ``gguf.py`` and the shared pipeline:
    a change to any of them changes it, and nothing else does."""
    import models
    from decoding.engines import base

    pkg = tmp_path / "models"
    for rel in ("__init__.py", "export.py", "gguf.py", "dflash/export.py", "dflash/model.py"):
        (pkg / rel).parent.mkdir(parents=True, exist_ok=True)
        (pkg / rel).write_text(f"# {rel}\n")
    monkeypatch.setattr(models, "__file__", str(pkg / "__init__.py"))
    before = base.export_code_digest()
    (pkg / "dflash" / "model.py").write_text("# a model change\n")
    assert base.export_code_digest() == before
    (pkg / "dflash" / "export.py").write_text("# a layout fixed\n")
    assert base.export_code_digest() != before


def test_llama_cpp_eval_says_where_llama_cpp_reads_past_the_targets_window(tmp_path):
    """A Mistral-shaped target (every layer slides, window 24) converted to llama.cpp's
    ``llama`` architecture, which has no window: where the requests reach past it, the
    evaluator says that llama.cpp's outputs and acceptance can differ there; inside it, or for
    a target with no window, nothing."""
    from decoding.engines.llama_cpp_eval import window_note

    mistral, llama = family_target("mistral"), family_target("llama")
    for t in (mistral, llama):
        tiny_target_gguf(tmp_path / f"{t.config.model_type}.gguf", t)
    note = window_note(mistral, tmp_path / "mistral.gguf", 100)
    assert note.startswith("note: the target attends within 24 tokens in every layer")
    assert "without that window" in note and "reach 100" in note
    assert window_note(mistral, tmp_path / "mistral.gguf", 24) is None
    assert window_note(llama, tmp_path / "llama.gguf", 100) is None


def test_permutation_is_the_converters_and_inverts():
    w = torch.arange(8 * 3, dtype=torch.float32).reshape(8, 3)
    # llama.cpp's LlamaModel.permute for 2 heads of 4 rows: halves -> interleaved pairs
    p = permute(w, 2)
    assert p[:, 0].tolist() == [0, 6, 3, 9, 12, 18, 15, 21]
    assert torch.equal(unpermute(p, 2), w)


@pytest.mark.parametrize("dtype", ["float32", "q8_0", "float16", "bfloat16"])
def test_gguf_export_round_trips(target4, tmp_path, dtype):
    tg = tmp_path / "target.gguf"
    tiny_target_gguf(tg, target4)
    head = every_third_eagle3(target4)
    out = tmp_path / "g"
    s = export(head, "gguf", out, dtype=dtype, log=lambda *_: None, target_gguf_path=tg)
    assert detect_format(out) == "gguf" and (out / "draft.gguf").is_file()
    r = gguf.GGUFReader(str(out / "draft.gguf"))
    f = {k: v.contents() for k, v in r.fields.items() if not k.startswith("tokenizer.ggml.")}
    assert f["general.architecture"] == "eagle3"
    assert f["eagle3.target_layers"] == [1, 2, 3]  # hidden_states indices, unchanged
    assert f["eagle3.embedding_length"] == 64 and f["eagle3.block_count"] == 1
    assert r.fields["tokenizer.ggml.tokens"].contents()[:2] == ["t0", "t1"]
    t = {x.name: x for x in r.tensors}
    assert "t2d" not in t and t["d2t"].tensor_type == gguf.GGMLQuantizationType.I64
    # absolute target ids, as llama.cpp's converter writes them
    assert np.array(t["d2t"].data).tolist() == (torch.arange(64) * 3).tolist()
    T = gguf.GGMLQuantizationType
    want = {"float32": T.F32, "q8_0": T.Q8_0, "float16": T.F16, "bfloat16": T.BF16}[dtype]
    assert t["blk.0.attn_q.weight"].tensor_type == want
    assert t["blk.0.attn_norm_2.weight"].tensor_type == gguf.GGMLQuantizationType.F32
    back = import_draft(out, target4)
    prompt = ex.default_prompt(target4)
    a, b = ex.proposals(head, prompt), ex.proposals(back, prompt)
    la, lb = a.pop("logits"), b.pop("logits")
    if dtype == "float32":
        assert torch.equal(la, lb) and a == b and s["chain"] == a["chain"]
    else:  # q8_0 / 16-bit types round the weights: close (and, in the export's own check,
        # equal to the head rounded the same way)
        f = torch.isfinite(la)
        assert torch.equal(f, torch.isfinite(lb))
        assert (la[f] - lb[f]).abs().max() < 0.05 * la[f].abs().max()
    # a wrong q/k order would not survive the re-import: break the inverse and see it caught
    import models.eagle.gguf as g

    orig = g.unpermute
    g.unpermute = lambda w, n: w
    try:
        with pytest.raises(ExportError, match="differ|proposes differently"):
            export(head, "gguf", tmp_path / "bad", dtype="float32", log=lambda *_: None,
                   target_gguf_path=tg)  # fmt: skip
    finally:
        g.unpermute = orig
    assert not (tmp_path / "bad").exists()


def test_gguf_export_refusals_are_one_line(target4, tmp_path):
    head = every_third_eagle3(target4)
    with pytest.raises(ExportError, match="--target-gguf"):
        export(head, "gguf", tmp_path / "a", log=lambda *_: None)
    other = build_tiny_target(seed=1, num_layers=2)
    tg = tmp_path / "t2.gguf"
    tiny_target_gguf(tg, Target(*other, "tiny2", TargetConfig(name="tiny_random")))
    with pytest.raises(ExportError, match="block_count=2.*not the target"):
        export(head, "gguf", tmp_path / "b", log=lambda *_: None, target_gguf_path=tg)
    with pytest.raises(ExportError, match="--dtype q8_0: --format vllm takes"):
        export(head, "vllm", tmp_path / "c", dtype="q8_0", log=lambda *_: None)
    assert not any((tmp_path / n).exists() for n in "abc")


def test_the_rope_a_gguf_draft_holds_and_the_ones_it_refuses():
    """Plain and Llama-3 RoPE (a ``rope_freqs`` tensor), YaRN and linear scaling (the
    ``rope.scaling.*`` keys llama.cpp's converter writes); Gemma-3's two RoPEs give the full
    layers' theta; DeepSeek-style YaRN (mscale) and LongRoPE are refused in one line."""
    from types import SimpleNamespace

    from models.gguf import add_rope_scaling, rope_factors, rope_scaling, target_hparams

    def cfg(rope):
        return SimpleNamespace(
            rope_parameters=rope, num_attention_heads=4, hidden_size=64, head_dim=16
        )

    class Keys:
        def __init__(self):
            self.got = {}

        def __getattr__(self, name):  # add_rope_scaling_factor(v) -> got["factor"] = v
            return lambda v: self.got.__setitem__(name.removeprefix("add_rope_scaling_"), v)

    yarn = {"rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0, "beta_fast": 32.0,
            "original_max_position_embeddings": 32768}  # fmt: skip
    w = Keys()
    add_rope_scaling(w, gguf, cfg(yarn))
    assert w.got == {
        "type": gguf.RopeScalingType.YARN, "factor": 4.0, "orig_ctx_len": 32768,
        "yarn_beta_fast": 32.0,
    }  # fmt: skip
    assert rope_factors(cfg(yarn)) is None
    w = Keys()
    add_rope_scaling(w, gguf, cfg({"rope_type": "linear", "factor": 8.0}))
    assert w.got == {"type": gguf.RopeScalingType.LINEAR, "factor": 8.0}
    w = Keys()
    llama3 = {"rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0}
    add_rope_scaling(w, gguf, cfg(llama3))
    assert w.got == {} and rope_factors(cfg(llama3)).shape == (8,)
    two = {"sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
           "full_attention": {"rope_type": "linear", "rope_theta": 1e6, "factor": 8.0}}  # fmt: skip
    assert target_hparams(cfg(two))["theta"] == 1e6 and rope_scaling(cfg(two))[0] == "linear"
    older = SimpleNamespace(rope_parameters=None, rope_scaling={"type": "yarn", "factor": 2.0})
    assert rope_scaling(older) == ("yarn", {"rope_theta": 10000.0, "rope_type": "yarn",
                                            "type": "yarn", "factor": 2.0})  # fmt: skip
    for rope, why in [
        ({**yarn, "mscale": 1.0, "mscale_all_dim": 1.0}, "DeepSeek-style YaRN"),
        ({"rope_type": "longrope", "short_factor": [1.0]}, "'longrope'"),
    ]:
        with pytest.raises(ExportError, match=why) as e:
            rope_scaling(cfg(rope))
        assert "\n" not in str(e.value)


def test_saved_tiny_target_is_rebuilt_with_its_layers():
    """Defect: a run trained with target.tiny_layers=4 exported against a 2-layer target."""
    c = saved_target_config({"name": "tiny_random", "identity": "tiny_random(seed=3, layers=4)"})
    assert (c.seed, c.tiny_layers) == (3, 4)
    c = saved_target_config({"name": "tiny_random", "identity": "tiny_random(seed=0)"})
    assert (c.seed, c.tiny_layers) == (0, 2)


def test_export_of_a_run_on_a_four_layer_tiny_target(data_file, tmp_path):
    from conftest import compose, tiny_overrides

    from trainer.train import run

    run_dir = tmp_path / "run"
    over = tiny_overrides(data_file, run_dir, **{"train.max_steps": 1})
    run(compose(over + ["method=eagle3", "target.tiny_layers=4", "method.draft_vocab_size=64",
                        "method.fuse_layers=[1,2,3]"]))  # fmt: skip
    r = run_module("flow.export", [str(run_dir), "--format", "vllm", "--dtype", "float32"])
    assert r.returncode == 0, r.stderr[-1500:]
    assert "layers=4" in r.stdout


def test_missing_engine_is_one_clear_line(monkeypatch, tmp_path):
    from decoding.engines.llama_cpp import EngineError, engine_dir

    monkeypatch.setenv("SPECDRAFT_LLAMA_CPP", str(tmp_path))
    with pytest.raises(EngineError, match="install.sh engine"):
        engine_dir()


# ---------------------------------------------------------------------------------------------
# With llama.cpp installed: the engine itself reads what we write


@pytest.fixture(scope="module")
def smollm2():
    from models.target import load_target

    return load_target(TargetConfig(name="smollm2_135m", device="cpu", dtype="float32"))


@pytest.fixture(scope="module")
def shipped_gguf(smollm2, tmp_path_factory):
    from models.export import load_trained_head
    from models.shipped import shipped_draft

    out = tmp_path_factory.mktemp("gguf") / "shipped"
    head = load_trained_head(shipped_draft("smollm2-eagle3"), smollm2)
    export(head, "gguf", out, log=lambda *_: None)
    return out


@needs_engine
@pytest.mark.slow
def test_engine_serves_the_shipped_head_losslessly(smollm2, shipped_gguf):
    from data.chat import prompt_ids
    from decoding.engines.llama_cpp import LlamaServer, repack_works
    from models.target import target_gguf

    tg = target_gguf(smollm2)
    ids = prompt_ids(smollm2.tokenizer, [{"role": "user", "content": "What is a prime number?"}])
    rp = repack_works(tg)
    with (
        LlamaServer(tg, repack=rp) as plain,
        LlamaServer(
            tg, shipped_gguf / "draft.gguf", spec_type="draft-eagle3", n_max=3, repack=rp
        ) as spec,
    ):
        a = plain.complete(ids, 48)
        b = spec.complete(ids, 48)
    assert a.tokens == b.tokens and len(a.tokens) > 10
    assert b.drafted > 0 and b.accepted > 0, b.timings  # the head's drafts are read and accepted
    assert sum(x for x, _ in b.steps) == b.accepted  # the per-step log matches its counters
    assert all(n <= 3 for _, n in b.steps)


@needs_engine
@pytest.mark.slow
def test_our_gguf_equals_llama_cpps_converter(smollm2, tmp_path):
    """The same head converted by llama.cpp's own convert_hf_to_gguf.py (from our sglang
    export, with --target-model-dir) and written by us: same eagle3 keys, same tensors."""
    from models.export import load_trained_head
    from models.shipped import shipped_draft

    head = load_trained_head(shipped_draft("smollm2-eagle3"), smollm2)
    export(head, "sglang", tmp_path / "sg", dtype="float32", log=lambda *_: None)
    export(head, "gguf", tmp_path / "ours", dtype="float32", log=lambda *_: None)
    assert_as_llama_cpp_converts(tmp_path / "sg", tmp_path / "ours" / "draft.gguf", "eagle3.")


def assert_as_llama_cpp_converts(
    hf_export: Path, ours: Path, prefix: str, only_theirs=(), target_dir=None, tiny=False
):
    """llama.cpp's own converter (``--target-model-dir``: ``target_dir``, by default the
    embedded target) on ``hf_export`` writes what we wrote in ``ours``: the same tensors, byte
    for byte (but ``only_theirs``, which only the converter writes), and the same ``prefix``
    keys, the architecture and the mask token."""
    from decoding.engines.llama_cpp import convert_hf, engine_source
    from models.target import smollm2_dir

    pytest.importorskip("sentencepiece", reason="llama.cpp's converter imports sentencepiece")
    if engine_source() is None:
        pytest.skip("llama.cpp's source tree (its converter) is not in the cache")
    target_dir = target_dir or smollm2_dir("~/.cache/specdraft")
    theirs = convert_hf(
        hf_export, ours.parent.parent / "theirs.gguf", "f32", log=lambda *_: None,
        extra=("--target-model-dir", str(target_dir)), tiny_tokenizer=tiny,
    )  # fmt: skip
    a = gguf.GGUFReader(str(ours))
    b = gguf.GGUFReader(str(theirs))
    ta, tb = {t.name: t for t in a.tensors}, {t.name: t for t in b.tensors}
    assert set(tb) - set(ta) == set(only_theirs) and set(ta) <= set(tb)
    for n in ta:
        assert ta[n].tensor_type == tb[n].tensor_type, n
        assert np.array_equal(np.array(ta[n].data), np.array(tb[n].data)), n
    keys = [
        k
        for k in b.fields
        if k.startswith(prefix) or k in ("general.architecture", "tokenizer.ggml.mask_token_id")
    ]
    differ = [
        k for k in keys if k not in a.fields or a.fields[k].contents() != b.fields[k].contents()
    ]
    assert not differ, {
        k: (a.fields[k].contents() if k in a.fields else None, b.fields[k].contents())
        for k in differ
    }


@needs_engine
@pytest.mark.slow
def test_our_yarn_gguf_equals_llama_cpps_converter(tmp_path):
    """A YaRN target (a tiny GPT-OSS: factor 32, betas): llama.cpp's converter on our vLLM
    export writes the rope.scaling keys and tensors we write."""
    from decoding.engines.llama_cpp import converted_target
    from models.target import target_folder

    target = family_target("gpt_oss")
    tg = converted_target(target, log=lambda *_: None)
    head = every_third_eagle3(target)
    export(head, "vllm", tmp_path / "v", dtype="float32", log=lambda *_: None)
    export(head, "gguf", tmp_path / "ours", dtype="float32", log=lambda *_: None,
           target_gguf_path=tg)  # fmt: skip
    ours = tmp_path / "ours" / "draft.gguf"
    assert gguf.GGUFReader(str(ours)).fields["eagle3.rope.scaling.type"].contents() == "yarn"
    assert_as_llama_cpp_converts(
        tmp_path / "v", ours, "eagle3.", target_dir=target_folder(target), tiny=True
    )


def test_the_architectures_that_feed_drafts_are_the_builds_own():
    """FEATURE_ARCHS is what the cached llama.cpp source says: the architectures whose model
    builder (src/models/*.cpp) sets the layer inputs EAGLE-3 and DFlash drafts read."""
    import re

    from decoding.engines.llama_cpp import FEATURE_ARCHS, engine_source

    src = engine_source()
    if src is None:
        pytest.skip("llama.cpp's source tree is not in the cache: bash scripts/install.sh engine")
    mapping = (src / "src" / "llama-model.cpp").read_text()
    mapping = mapping[mapping.index("llama_model_mapping") :]
    arch_of: dict[str, list[str]] = {}
    pending: list[str] = []
    for line in mapping[: mapping.index("\n}\n")].splitlines():
        if m := re.search(r"case (LLM_ARCH_\w+):", line):
            pending.append(m.group(1))
        elif m := re.search(r"return new (\w+)\(", line):
            arch_of.setdefault(m.group(1), []).extend(pending)
            pending = []
    names = dict(
        re.findall(r'\{ (LLM_ARCH_\w+),\s*"([^"]+)"', (src / "src" / "llama-arch.cpp").read_text())
    )
    found = set()
    for f in (src / "src" / "models").glob("*.cpp"):
        text = f.read_text()
        if "t_layer_inp[" in text:
            for cls in set(re.findall(r"(llama_model_\w+)::", text)):
                found |= {names[a] for a in arch_of.get(cls, [])}
    assert found == set(FEATURE_ARCHS)


@needs_engine
@pytest.mark.slow
def test_a_target_that_feeds_no_layer_inputs_is_refused_before_its_server_starts(tmp_path):
    """A Qwen2 target: our EAGLE-3 GGUF would load beside it, and llama.cpp's server aborts at
    the first draft; the refusal comes first, in one line, naming the architecture."""
    from decoding.engines.llama_cpp import EngineError, LlamaServer, converted_target

    target = family_target("qwen2")
    tg = converted_target(target, log=lambda *_: None)
    export(
        every_third_eagle3(target), "gguf", tmp_path / "d", log=lambda *_: None, target_gguf_path=tg
    )
    draft = tmp_path / "d" / "draft.gguf"
    with pytest.raises(EngineError, match="a 'qwen2' target: llama.cpp b11434 feeds eagle3 "
                       "drafts the layer inputs of") as e:  # fmt: skip
        LlamaServer(tg, draft, spec_type="draft-eagle3")
    assert "\n" not in str(e.value)
    # what the refusal spares: the engine's own abort, at the first draft (its assert on the
    # null layer input: AMD Zen 3 to 5), or before the server answers at all (an Intel Xeon with
    # AMX: SIGILL in ggml's AMX kernel at the draft's start-up decode, 2026-12-05)
    srv = LlamaServer(tg, draft, spec_type="draft-eagle3", check_target=False)
    started = False
    with pytest.raises(EngineError) as e:
        with srv:
            started = True
            srv.complete([1, 40, 50, 60], 8)
    if started:
        assert "layer input tensor is null" in srv.log_path.read_text(errors="replace")
    else:
        assert "while starting" in str(e.value), e.value


def test_the_comparison_says_in_how_many_replies_the_text_was_the_same():
    """At T = 0 the engine and the built-in decoder are compared reply by reply (every turn);
    where replies part, the line says their acceptance is counted over other text."""
    from decoding.engines.base import same_text, same_text_note

    def outs(*turns):
        return [{"turns": [{"spec_tokens": t} for t in q]} for q in turns]

    theirs = outs([[1, 2, 3], [4, 5]], [[6, 7]])
    assert same_text(theirs, outs([[1, 2, 3], [4, 5]], [[6, 7]])) == [3, 3]
    assert same_text(theirs, outs([[1, 2, 9], [4, 5]], [[6, 7]])) == [2, 3]
    assert same_text(theirs, None) is None and same_text([], outs([[1]])) is None
    assert same_text_note([3, 3]) == " (the same text in all 3 replies)"
    assert same_text_note([2, 3]).startswith(" (the same text in 2 of 3 replies; the others")
    assert same_text_note(None) == ""


@needs_engine
@pytest.mark.slow
def test_eval_in_the_engine_and_its_failures(tmp_path):
    from decoding.engines.llama_cpp import EngineError, LlamaServer
    from models.target import smollm2_package_dir

    rep = tmp_path / "r.json"
    r = run_module(
        "decoding.eval",
        ["engine=llama.cpp", "draft=smollm2-eagle3", "num_prompts=2", "max_new_tokens=24",
         "gamma=2", "calibration_tokens=24", "plan_max=2", f"report={rep}"],
        900,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr[-2000:]
    rep = json.loads(rep.read_text())
    assert rep["engine"].startswith("llama.cpp") and rep["lossless"] is True
    assert rep["drafted"] > 0 and len(rep["alpha_per_position"]) == 2
    assert rep["costs"]["plain_ms_per_token"] > 0 and rep["predicted_speedup"] > 0
    assert "engine costs" in r.stdout
    # the built-in decoder beside it: the same prompts, the draft the GGUF was written from
    ours = rep["ours"]
    assert len(ours["alpha_per_position"]) == 2 and ours["lossless"] is True
    assert len(ours["difference_per_position"]) == 2
    assert ours["same_text"][1] == 2 and 0 <= ours["same_text"][0] <= 2
    assert "built-in decoder, same prompts and draft" in r.stdout and "the same text in" in r.stdout
    # a port in use is one line, and nothing is left running
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen(1)
    with pytest.raises(EngineError, match="in use"):
        LlamaServer(
            smollm2_package_dir() / "SmolLM2-135M-Instruct.Q4_1.gguf", port=s.getsockname()[1]
        )
    s.close()
    # a draft the engine cannot load: the server's own last words, in one error
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF" + b"\0" * 64)
    srv = LlamaServer(smollm2_package_dir() / "SmolLM2-135M-Instruct.Q4_1.gguf", bad,
                      spec_type="draft-eagle3")  # fmt: skip
    with pytest.raises(EngineError, match="exited"):
        srv.start()
    assert srv.log_path.is_file()  # the error names the server's log: it is kept
    out = subprocess.run(["pgrep", "-f", "llama-server"], capture_output=True, text=True)
    assert out.stdout.strip() == "", "a llama-server was left running"


@pytest.mark.parametrize(
    "over,why",
    [
        ({"temperature": 1.0}, "at T > 0"),
        ({"draft": "ngram"}, "n-gram lookup"),
        ({"p_min": 0.2}, "p_min=0.2"),
        ({"draft": "runs/x/draft.gguf"}, "a GGUF draft"),
        ({}, None),
    ],
)
def test_the_built_in_comparison_is_left_out_where_it_cannot_run_what_llama_cpp_ran(over, why):
    from omegaconf import OmegaConf

    from decoding.engines.llama_cpp_eval import _no_comparison

    cfg = OmegaConf.create({"draft": "smollm2-eagle3", "temperature": 0.0, "p_min": 0.0, **over})
    got = _no_comparison(cfg, cfg.temperature == 0, cfg.p_min)
    assert (got is None) if why is None else (why in got), got


@needs_engine
@pytest.mark.slow
def test_eval_converts_an_hf_target_and_refuses_a_pair_the_engine_cannot_serve(tmp_path):
    """`engine=llama.cpp` on a target with no GGUF of its own: llama.cpp's converter makes one
    (cached) and the report names it; an EAGLE-3 draft beside a target whose architecture
    gives drafts no layer inputs is one line, before any server starts."""
    from decoding.engines.llama_cpp import converted_target

    common = ["engine=llama.cpp", "target=tiny_random", "target.tiny_layers=4",
              "target.dtype=float32", "num_prompts=2", "max_new_tokens=16", "predict=false"]  # fmt: skip
    rep = tmp_path / "r.json"
    r = run_module(
        "decoding.eval",
        [*common, "target.family=qwen3", "draft=ngram", "gamma=2", f"report={rep}"],
        600,
    )
    assert r.returncode == 0, r.stderr[-2000:]
    rep = json.loads(rep.read_text())
    tg = rep["settings"]["target_gguf"]
    assert "/engine-targets/" in tg and tg.endswith("-f32/target.gguf")
    assert rep["lossless"] is True
    qwen2 = family_target("qwen2")
    export(every_third_eagle3(qwen2), "gguf", tmp_path / "d", log=lambda *_: None,
           target_gguf_path=converted_target(qwen2, log=lambda *_: None))  # fmt: skip
    r = run_module("decoding.eval", [*common, "target.family=qwen2", f"draft={tmp_path / 'd'}"])
    assert r.returncode != 0
    last = r.stderr.strip().splitlines()[-1]
    assert "a 'qwen2' target: llama.cpp b11434 feeds eagle3 drafts" in last, r.stderr[-2000:]
    assert "Traceback" not in r.stderr


def test_the_servers_hold_the_longest_prompt_and_its_answer(tiny_target):
    """The servers held llama.cpp's default 4096 tokens of context: a longer bench prompt was
    refused by the server ("request (5524 tokens) exceeds the available context size (4096
    tokens)", seen with the embedded target); they hold what the longest prompt, its earlier
    turns and the longest request need."""
    from omegaconf import OmegaConf

    from decoding.engines.llama_cpp_eval import context_size

    tok = tiny_target.tokenizer  # byte-level: a character a token
    cfg = OmegaConf.create(
        {"turns": 1, "max_new_tokens": 128, "calibration_tokens": 96, "warmup_tokens": 16}
    )
    short = [{"turns": ["hello"]}]
    assert context_size(cfg, tok, short) == 4096
    long = [{"turns": ["x" * 6000, "y" * 10]}, {"turns": ["hello"]}]
    n = context_size(cfg, tok, long)
    assert 6000 + 128 < n < 6000 + 128 + 200
    cfg.turns = 2
    assert context_size(cfg, tok, long) >= 2 * (6000 + 128)


@pytest.mark.slow
def test_at_t1_the_engines_samples_are_checked_against_the_target(tmp_path):
    """`engine=llama.cpp temperature=1`: every output of both servers is scored by the target,
    and llama.cpp's samples, plain and speculative, are the target's (|z| <= 4 on both
    statistics: the Q4_1 GGUF and the built-in target share their weights)."""
    rep = tmp_path / "r.json"
    r = run_module(
        "decoding.eval",
        ["engine=llama.cpp", "draft=smollm2-eagle3", "num_prompts=6", "max_new_tokens=64",
         "gamma=3", "temperature=1", "predict=false", f"report={rep}"],
        900,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr[-2000:]
    rep = json.loads(rep.read_text())
    check = rep["sample_check"]
    assert check["flag"] is None, check
    assert check["spec"]["tokens"] > 200 and check["plain"]["tokens"] > 200
    for side in ("spec", "plain"):
        assert abs(check[side]["z_argmax"]) <= 4 and abs(check[side]["z_logp"]) <= 4, check
    assert "sample check (T > 0" in r.stdout


def test_repacked_layouts_are_turned_off_only_where_the_engine_crashes_with_them(tmp_path):
    """engine_repack=auto probes llama.cpp once per model: a crash (killed by a signal) turns
    the repacked weight layouts off with one line, any other failure is an error naming the
    file, on / off are taken as given, and a server started without them says --no-repack."""
    from decoding.engines.llama_cpp import EngineError, LlamaServer, repack_works, resolve_repack

    model = tmp_path / "m.gguf"
    model.write_bytes(b"GGUF")

    def engine(tag: str, body: str) -> Path:
        d = tmp_path / tag
        d.mkdir()
        for name in ("llama-bench", "llama-server"):
            (d / name).write_text(f'#!/bin/sh\necho "$@" >> {d}/calls\n{body}\n')
            (d / name).chmod(0o755)
        return d

    ok, crash, broken = (
        engine("ok", "exit 0"),
        engine("crash", "kill -SEGV $$"),
        engine("broken", "echo 'bad magic' >&2; exit 1"),
    )
    said: list[str] = []
    assert resolve_repack("auto", model, said.append, ok) is True and said == []
    assert resolve_repack("auto", model, said.append, crash) is False
    assert len(said) == 1 and "--no-repack" in said[0]
    assert resolve_repack("auto", model, said.append, crash) is False  # probed once
    assert (crash / "calls").read_text().count("-p 8") == 1
    assert resolve_repack("on", model, said.append, crash) is True
    assert resolve_repack("off", model, said.append, ok) is False
    with pytest.raises(EngineError, match="m.gguf"):
        repack_works(model, broken)
    with pytest.raises(EngineError, match="engine_repack='maybe'"):
        resolve_repack("maybe", model, said.append, ok)
    off = LlamaServer(model, repack=False, bin_dir=ok, port=None)
    on = LlamaServer(model, bin_dir=ok)
    assert "--no-repack" in off.args and "--no-repack" not in on.args


def test_cost_fit_is_least_squares_with_nonnegative_costs():
    from decoding.engines.llama_cpp_eval import nonnegative_fit

    rng = np.random.default_rng(0)
    A = rng.uniform(1, 50, size=(6, 2))
    assert np.allclose(nonnegative_fit(A, A @ np.array([0.8, 2.4])), (0.8, 2.4))
    # data a negative per-iteration cost would fit best: that cost is 0, the other refitted
    c0, cd = nonnegative_fit(A, A @ np.array([-3.0, 4.0]))
    assert c0 == 0.0 and cd > 0
    col = A[:, 1]
    assert np.isclose(cd, col @ (A @ np.array([-3.0, 4.0])) / (col @ col))


def test_cost_model_counts_the_draft_step_a_confidence_stop_ran():
    """With p_min > 0 a chain that stopped early ran one draft forward more than it drafted
    (the one whose token fell below p_min), and a forward with no draft ran one; at p_min 0 a
    drafted token is a draft forward."""
    from decoding.engines.llama_cpp_eval import CostModel

    m = CostModel({1: 10.0, 2: 15.0, 3: 20.0, 4: 25.0}, plain_ms=10.0, c0=1.0, cd=2.0)
    steps = [(1, 1), (3, 3), (0, 2)]  # (accepted, drafted); n_max 3
    tokens = 2 + 4 + 1 + 1  # + one forward without a draft
    at0 = (15 + 1 + 2) + (25 + 1 + 6) + (20 + 1 + 4) + (10 + 1)
    assert m.predicted_speedup(steps, 1, n_max=3, p_min=0.0) == pytest.approx(tokens * 10 / at0)
    # chains of 1 and 2 stopped early: +1 draft forward each; the full chain of 3 did not;
    # the forward without a draft ran one draft forward
    at6 = at0 + 2 + 2 + 2
    assert m.predicted_speedup(steps, 1, n_max=3, p_min=0.6) == pytest.approx(tokens * 10 / at6)


# -- DFlash and DSpark as llama.cpp ``dflash`` GGUFs ------------------------------------------


def block_draft(target, method: str, **kw):
    """A DFlash (or DSpark) draft with non-trivial weights and a chosen reduced vocabulary
    (draft token i is target token 3i; the whole vocabulary at ``draft_vocab_size`` = V)."""
    from models.dflash import DFlashConfig, DFlashDraft
    from models.dspark import DSparkConfig, DSparkDraft

    cls, cfg = (DSparkDraft, DSparkConfig) if method == "dspark" else (DFlashDraft, DFlashConfig)
    dv = kw.pop("draft_vocab_size", 64)
    settings = dict(draft_vocab_size=dv, mask_token_id=7, block_size=4, fuse_layers=[1, 2, 3])
    if method == "dspark":
        settings["markov_rank"] = 32
    d = cls(target, cfg(**{**settings, **kw}))
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for p in d.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.05)
        if dv < target.config.vocab_size:
            d.d2t.copy_(torch.arange(dv) * 2)
            d.t2d.zero_()
            d.t2d[torch.arange(dv) * 3] = True
    d.vocab_chosen = True
    return d.eval()


@pytest.mark.parametrize("method", ["dflash", "dspark"])
@pytest.mark.parametrize("dtype", ["float32", "q8_0"])
def test_dflash_family_gguf_export_round_trips(target4, tmp_path, method, dtype):
    from decoding.engines.llama_cpp_drafts import gguf_kind

    tg = tiny_target_gguf(tmp_path / "target.gguf", target4)
    d = block_draft(target4, method)
    out = tmp_path / "g"
    # --format gguf means the dflash layout for these drafts
    s = export(d, "gguf", out, dtype=dtype, log=lambda *_: None, target_gguf_path=tg)
    assert s["format"] == f"gguf-{method}" and detect_format(out) == f"gguf-{method}"
    r = gguf.GGUFReader(str(out / "draft.gguf"))
    f = {k: v.contents() for k, v in r.fields.items() if not k.startswith("tokenizer.ggml.t")}
    assert f["general.architecture"] == "dflash"
    assert f["dflash.target_layers"] == [1, 2, 3]  # hidden_states indices = layer inputs
    assert f["dflash.block_size"] == 4 and f["dflash.block_count"] == d.cfg.num_layers
    assert f["dflash.attention.causal"] is False
    assert f["tokenizer.ggml.mask_token_id"] == 7
    t = {x.name: x for x in r.tensors}
    assert "token_embd.weight" not in t  # the engine embeds with the target's own table
    assert np.array(t["d2t"].data).tolist() == (torch.arange(64) * 3).tolist()
    assert tuple(int(n) for n in t["output.weight"].shape) == (target4.config.hidden_size, 64)
    assert {"fc.weight", "enc.output_norm.weight", "blk.0.attn_q_norm.weight"} <= set(t)
    T = gguf.GGMLQuantizationType
    assert t["blk.0.attn_q.weight"].tensor_type == (T.F32 if dtype == "float32" else T.Q8_0)
    if method == "dspark":
        assert f["dflash.sample_from_anchor"] is False and f["dflash.has_confidence_head"]
        assert {"markov_w1.weight", "markov_w2.weight", "conf_proj.weight"} <= set(t)
    else:
        assert not any(n.startswith(("markov", "conf")) for n in t)
    assert gguf_kind(out / "draft.gguf") == (f"draft-{method}", 4)
    back = import_draft(out, target4)
    assert type(back) is type(d) and back.cfg.fuse_layers == [1, 2, 3]
    prompt = ex.default_prompt(target4)
    a, b = ex.proposals(d, prompt), ex.proposals(back, prompt)
    la, lb = a.pop("logits"), b.pop("logits")
    if dtype == "float32":
        assert torch.equal(la, lb) and a == b
    else:  # q8_0 rounds the weights: close (the export's own check: equal to the rounded draft)
        f = torch.isfinite(la)
        assert (la[f] - lb[f]).abs().max() < 0.05 * la[f].abs().max()


def test_dflash_family_gguf_refusals_and_omissions(target4, tmp_path):
    tg = tiny_target_gguf(tmp_path / "target.gguf", target4)
    quiet = dict(log=lambda *_: None, dtype="float32")
    with pytest.raises(ExportError, match="--target-gguf"):
        export(block_draft(target4, "dflash"), "gguf", tmp_path / "a", **quiet)
    with pytest.raises(ExportError, match="Qwen3 layers.*layer_arch=target"):
        export(block_draft(target4, "dflash", layer_arch="target"), "gguf", tmp_path / "b",
               target_gguf_path=tg, **quiet)  # fmt: skip
    with pytest.raises(ExportError, match="exports dflash drafts; this is dspark"):
        export(block_draft(target4, "dspark"), "gguf-dflash", tmp_path / "c",
               target_gguf_path=tg, **quiet)  # fmt: skip
    from models.distillspec import DistillSpecConfig, DistillSpecStudent

    student = DistillSpecStudent(target4, DistillSpecConfig(num_layers=1))
    with pytest.raises(ExportError, match=r"eagle3, hass, dflash or dspark drafts; this is "
                       r"distillspec \(a DistillSpec student is an ordinary model"):  # fmt: skip
        export(student, "gguf", tmp_path / "s", target_gguf_path=tg, **quiet)
    assert not any((tmp_path / n).exists() for n in "abcs")
    # a confidence head without the Markov input has no place in llama.cpp's: left out, said
    d = block_draft(target4, "dspark", confidence_with_markov=False)
    lines = []
    export(d, "gguf", tmp_path / "d", target_gguf_path=tg, log=lines.append, dtype="float32")
    assert "confidence head left out" in lines[-1]
    r = gguf.GGUFReader(str(tmp_path / "d" / "draft.gguf"))
    assert not any(t.name.startswith("conf_proj") for t in r.tensors)
    assert r.fields["dflash.has_confidence_head"].contents() is False
    # a full-vocabulary draft scores with the target's own head: no output, no d2t
    full = block_draft(target4, "dflash", draft_vocab_size=target4.config.vocab_size)
    export(full, "gguf", tmp_path / "e", target_gguf_path=tg, **quiet)
    names = {t.name for t in gguf.GGUFReader(str(tmp_path / "e" / "draft.gguf")).tensors}
    assert "output.weight" not in names and "d2t" not in names
    assert import_draft(tmp_path / "e", target4).cfg.draft_vocab_size == target4.config.vocab_size


@needs_engine
@pytest.mark.slow
def test_our_dspark_gguf_equals_llama_cpps_converter(smollm2, tmp_path):
    """llama.cpp's convert_hf_to_gguf.py on our vLLM DSpark export, and our GGUF of the same
    draft: the same dflash keys and tensors (the converter also copies the target's
    token_embd, which we leave to the target)."""
    d = block_draft(smollm2, "dspark", draft_vocab_size=4096, block_size=5,
                    fuse_layers=[1, 10, 20], mask_token_id=2)  # fmt: skip
    export(d, "dspark", tmp_path / "vl", dtype="float32", log=lambda *_: None)
    export(d, "gguf", tmp_path / "ours", dtype="float32", log=lambda *_: None)
    assert_as_llama_cpp_converts(
        tmp_path / "vl", tmp_path / "ours" / "draft.gguf", "dflash.", {"token_embd.weight"}
    )


@needs_engine
@pytest.mark.slow
@pytest.mark.parametrize("method", ["dflash", "dspark"])
def test_engine_serves_dflash_family_drafts_losslessly(smollm2, tmp_path, method):
    """llama.cpp loads our DFlash / DSpark GGUF for the embedded target, runs its trained
    block (n_max = block_size - 1 drafts a step) and decodes exactly what it decodes alone."""
    from data.chat import prompt_ids
    from decoding.engines.llama_cpp import LlamaServer, repack_works
    from decoding.engines.llama_cpp_drafts import gguf_kind
    from models.target import target_gguf

    d = block_draft(smollm2, method, draft_vocab_size=4096, block_size=5,
                    fuse_layers=[1, 10, 20], mask_token_id=2)  # fmt: skip
    export(d, "gguf", tmp_path / "g", log=lambda *_: None)
    draft = tmp_path / "g" / "draft.gguf"
    spec_type, block = gguf_kind(draft)
    assert (spec_type, block) == (f"draft-{method}", 5)
    tg = target_gguf(smollm2)
    ids = prompt_ids(smollm2.tokenizer, [{"role": "user", "content": "Name three colours."}])
    rp = repack_works(tg)
    with (
        LlamaServer(tg, repack=rp) as plain,
        LlamaServer(tg, draft, spec_type=spec_type, n_max=block - 1, repack=rp) as spec,
    ):
        a = plain.complete(ids, 32)
        b = spec.complete(ids, 32)
    assert not plain.log_path.exists() and not spec.log_path.exists()  # clean runs: no logs left
    assert a.tokens == b.tokens and len(a.tokens) > 10
    assert b.drafted > 0, b.timings  # the draft ran
    assert sum(x for x, _ in b.steps) == b.accepted
    assert max(n for _, n in b.steps) == block - 1  # the whole trained block


@needs_engine
@pytest.mark.parametrize("method", ["dflash", "dspark"])
def test_llama_cpp_accepts_what_we_do_from_our_dflash_family_gguf(tmp_path, method):
    """A DFlash / DSpark draft of a tiny target that accepts part of the time (trained on the
    target's answers, then blurred: ``accepting_block_draft``), as GGUF beside llama.cpp's own
    conversion of the target: llama.cpp decodes what it decodes alone and what the built-in
    decoder decodes from the GGUF read back, and accepts what ours does at every one of the
    block's positions (within 0.03). A draft that accepts nothing, as random ones do, could
    not tell a weight the engine misreads."""
    from decoding.decoder import SpeculativeDecoder
    from decoding.engines.llama_cpp import LlamaServer, converted_target
    from decoding.engines.llama_cpp_drafts import gguf_kind
    from models.base import DecodeSettings
    from models.sampling import Sampling

    target = family_target("llama", tiny_head_dim=64)
    prompts = [[1, 40 + i, 50 + 2 * i, 60, 70 + i] for i in range(4)]
    draft = block_draft(target, method, block_size=8 if method == "dflash" else 7,
                        mask_token_id=256)  # fmt: skip
    with torch.no_grad():  # draft token i is target token 2i: half the answers can be drafted
        draft.d2t.copy_(torch.arange(64))
        draft.t2d.zero_()
        draft.t2d[torch.arange(64) * 2] = True
    draft = accepting_block_draft(draft, prompts)
    tg = converted_target(target, log=lambda *_: None)
    export(draft, "gguf", tmp_path / "g", dtype="float32", log=lambda *_: None,
           target_gguf_path=tg)  # fmt: skip
    kind, block = gguf_kind(tmp_path / "g" / "draft.gguf")
    n = block - 1
    with (
        LlamaServer(tg) as plain,
        LlamaServer(tg, tmp_path / "g" / "draft.gguf", spec_type=kind, n_max=n) as spec,
    ):
        plains = [plain.complete(p, 64) for p in prompts]
        specs = [spec.complete(p, 64) for p in prompts]
    assert [o.tokens for o in specs] == [o.tokens for o in plains]
    dec = SpeculativeDecoder(
        target,
        import_draft(tmp_path / "g", target).proposer(DecodeSettings(tree="chain")),
        Sampling(),
        gamma=n,
        adaptive=False,
    )
    assert [dec.generate(p, 64) for p in prompts] == [o.tokens for o in specs]
    theirs = steps_acceptance([st for o in specs for st in o.steps], n)
    ours = our_acceptance(dec.stats, n)
    assert ours[0] >= 0.05, ours  # it accepts: else the comparison could not fail
    assert max(abs(a - b) for a, b in zip(theirs, ours, strict=True)) <= 0.03, (theirs, ours)
    assert n == (7 if method == "dflash" else 6), n  # the whole trained block


@needs_engine
@pytest.mark.slow
def test_engine_serves_a_distillspec_student_as_a_draft_model(smollm2, tmp_path):
    """A DistillSpec student (the target's first layers) converted by llama.cpp's own
    converter and served as a standalone draft model (draft-simple): exact, and it drafts. The
    student's folder named directly is the same draft model (one conversion, cached)."""
    from omegaconf import OmegaConf

    from data.chat import prompt_ids
    from decoding.engines.llama_cpp import LlamaServer, engine_source, repack_works
    from decoding.engines.llama_cpp_drafts import draft_gguf, gguf_kind
    from models.distillspec import DistillSpecConfig, DistillSpecStudent
    from models.target import target_gguf

    pytest.importorskip("sentencepiece", reason="llama.cpp's converter imports sentencepiece")
    if engine_source() is None:
        pytest.skip("llama.cpp's source tree (its converter) is not in the cache")
    student = DistillSpecStudent(smollm2, DistillSpecConfig(num_layers=4)).eval()
    run = tmp_path / "run"
    student.save_draft(run / "final")

    def resolve(d):
        cfg = OmegaConf.create(
            {"draft": str(d), "engine_ngram": "ngram-simple", "target_gguf": None}
        )
        return draft_gguf(cfg, smollm2, log=lambda *_: None)

    kind, draft, desc, block = resolve(run)
    assert (kind, block) == ("draft-simple", None) and "distillspec student" in desc
    assert gguf_kind(draft) == ("draft-simple", None)
    assert resolve(run / "final" / "student")[1] == draft  # the same folder: cached
    tg = target_gguf(smollm2)
    ids = prompt_ids(smollm2.tokenizer, [{"role": "user", "content": "Count from one to ten."}])
    rp = repack_works(tg)
    with (
        LlamaServer(tg, repack=rp) as plain,
        LlamaServer(tg, draft, spec_type="draft-simple", n_max=3, repack=rp) as spec,
    ):
        a = plain.complete(ids, 32)
        b = spec.complete(ids, 32)
    assert not plain.log_path.exists() and not spec.log_path.exists()  # clean runs: no logs left
    assert a.tokens == b.tokens and len(a.tokens) > 10
    assert b.drafted > 0 and b.accepted > 0, b.timings  # the target's own first layers agree
    assert sum(x for x, _ in b.steps) == b.accepted


def test_the_spec_type_comes_from_the_gguf(target4, tmp_path):
    """As llama.cpp decides: eagle3 -> draft-eagle3; dflash -> draft-dflash, or draft-dspark
    with a Markov head (with the block size); any LM with a tokenizer -> draft-simple; else a
    one-line refusal."""
    from decoding.engines.llama_cpp_drafts import gguf_kind

    tg = tiny_target_gguf(tmp_path / "target.gguf", target4)
    assert gguf_kind(tg) == ("draft-simple", None)  # a whole LM (here: its shape and tokenizer)
    export(
        every_third_eagle3(target4),
        "gguf",
        tmp_path / "e",
        log=lambda *_: None,
        target_gguf_path=tg,
    )
    assert gguf_kind(tmp_path / "e" / "draft.gguf") == ("draft-eagle3", None)
    bare = tmp_path / "bare.gguf"
    w = gguf.GGUFWriter(str(bare), "llama")
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(DraftError, match="no tokenizer: not a draft llama.cpp serves"):
        gguf_kind(bare)
    (tmp_path / "junk.gguf").write_bytes(b"not a gguf")
    with pytest.raises(DraftError, match="not a readable GGUF"):
        gguf_kind(tmp_path / "junk.gguf")


@needs_engine
@pytest.mark.parametrize("family", ["qwen3", "qwen2"])
def test_export_gguf_converts_any_target_where_llama_cpp_is_installed(family, tmp_path):
    """`specdraft-export --format gguf` with no --target-gguf, for a target other than the
    embedded one: llama.cpp's converter makes the target's GGUF (the file printed, which the
    draft's tokenizer is copied from and which is served beside it); a target whose
    architecture llama.cpp feeds no layer inputs gets a one-line warning, the file is written."""
    target = family_target(family)
    run = tmp_path / "run"
    every_third_eagle3(target).save_draft(run / "final")
    r = run_module("flow.export", [str(run), "--format", "gguf", "--dtype", "float32"], 600)
    assert r.returncode == 0, r.stderr[-1500:]
    line = next(s for s in r.stdout.splitlines() if s.startswith("target GGUF"))
    tg = Path(line.rsplit(": ", 1)[1])
    assert tg.is_file() and "engine-targets" in str(tg)
    readme = (run / "export-gguf" / "README.md").read_text()
    assert str(tg) in readme
    warned = [s for s in r.stderr.splitlines() if s.startswith("warning:")]
    if family == "qwen2":
        assert len(warned) == 1 and "'qwen2' target" in warned[0] and "engine=vllm" in warned[0]
    else:
        assert not warned, warned


def test_export_gguf_without_llama_cpp_says_what_to_pass(target4, tmp_path, monkeypatch, capsys):
    import decoding.engines.llama_cpp as lc
    from flow.export import main

    monkeypatch.setattr(lc, "engine_source", lambda: None)
    run = tmp_path / "run"
    every_third_eagle3(family_target("qwen3")).save_draft(run / "final")
    with pytest.raises(SystemExit) as e:
        main([str(run), "--format", "gguf"])
    assert e.value.code == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "--target-gguf" in err and "install.sh engine" in err
    assert not (run / "export-gguf").exists()
