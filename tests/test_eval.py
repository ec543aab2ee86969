"""specdraft-eval: the report, bench files, draft resolution and its errors."""

from __future__ import annotations

import json
import re

import pytest
import torch
from conftest import run_module

from decoding.bench import BenchError, load_bench, read_bench_file
from decoding.drafts import load_proposer
from models.base import DraftError

REQUIRED = [
    "tau",
    "alpha",
    "alpha_per_position",
    "tokens_per_second",
    "ar_tokens_per_second",
    "speedup",
    "target_calls",
    "new_tokens",
    "draft_cost_ratio",
    "predicted_speedup",
    "lossless",
    "convention",
    "per_category",
    "settings",
]


def _eval(args, timeout=300):
    return run_module("decoding.eval", args, timeout)


def test_eval_cli_report_and_plot(tmp_path):
    rep = tmp_path / "r.json"
    r = _eval(
        [
            "target=tiny_random",
            "draft=truncate:1",
            "num_prompts=3",
            "max_new_tokens=16",
            "turns=2",
            f"report={rep}",
        ]
    )
    assert r.returncode == 0, r.stderr[-3000:]
    d = json.loads(rep.read_text())
    for k in REQUIRED:
        assert k in d, k
    assert d["lossless"] is True  # T = 0: identical to plain decoding
    assert d["tau"] >= 1.0 and d["new_tokens"] > 0
    assert set(d["per_category"]) == {"writing", "roleplay", "reasoning"}  # spread over categories
    assert len(d["outputs"][0]["turns"]) == 2  # MT-bench's second turn, fed the first answer
    assert rep.with_suffix(".png").stat().st_size > 1000
    assert "tau" in r.stdout and "speedup" in r.stdout


def test_eval_at_temperature_one_reports_no_per_output_lossless(tmp_path):
    rep = tmp_path / "r.json"
    r = _eval(
        [
            "target=tiny_random",
            "draft=ngram",
            "num_prompts=2",
            "max_new_tokens=12",
            "temperature=1.0",
            "top_p=0.9",
            f"report={rep}",
        ]
    )
    assert r.returncode == 0, r.stderr[-3000:]
    d = json.loads(rep.read_text())
    assert d["lossless"] is None and d["settings"]["temperature"] == 1.0
    # the samples are audited as an engine's are: every token of both decoders scored
    check = d["sample_check"]
    assert check["spec"]["tokens"] > 0 and check["plain"]["tokens"] > 0
    assert check["flag"] is None and "sample check (T > 0" in r.stdout


def test_eval_of_a_trained_run(tmp_path, data_file):
    from conftest import compose, tiny_overrides

    from trainer.train import run

    out = tmp_path / "run"
    run(compose(tiny_overrides(data_file, out, **{"train.max_steps": 3})))
    rep = tmp_path / "r.json"
    for draft in (out, out / "final", out / "checkpoints" / "step_3"):
        r = _eval(
            [
                "target=tiny_random",
                f"draft={draft}",
                "num_prompts=1",
                "max_new_tokens=8",
                f"report={rep}",
            ]
        )
        assert r.returncode == 0, r.stderr[-3000:]
        assert json.loads(rep.read_text())["settings"]["draft_description"].startswith("eagle1")


@pytest.mark.parametrize(
    "args,needle",
    [
        (["gamma=0"], "gamma=0: must be >= 1"),
        (["draft=/nonexistent/dir"], "draft=/nonexistent/dir: no such folder"),
        (["draft=runs/no-such-run/final"], "draft=runs/no-such-run/final: no such folder"),
        (["draft=pyproject.toml"], "draft=pyproject.toml: a file; name the folder that holds it"),
        # under a folder that is here: a path, not a hub id to ask the network for
        (["draft=tests/no-such-run"], "draft=tests/no-such-run: no such folder"),
        (["compile=maybe"], "compile='maybe': use auto, true, false or fused"),
        (["bench=/nonexistent.jsonl"], "no such file"),
        (["categories=[nosuch]"], "categories=['nosuch']"),
        (["draft_weights=int4"], "draft_weights='int4': use one of auto, int8, full"),
        (["tree=dynamic", "min_prob=1.0"], "min_prob=1.0: must be in [0, 1)"),
        (["acceptance=typical", "typical_epsilon=-1"], "typical_epsilon=-1.0: must be in [0, 1]"),
        (["acceptance=typical", "typical_delta=-5"], "typical_delta=-5.0: must be >= 0"),
        (
            ["draft=smollm2-eagle"],
            "draft=smollm2-eagle: no such folder, shipped draft or model; "
            "did you mean smollm2-eagle3?",
        ),
    ],
)
def test_eval_errors_are_one_line(args, needle, tmp_path):
    r = _eval(["target=tiny_random", "num_prompts=1", f"report={tmp_path / 'r.json'}", *args])
    assert r.returncode == 2, r.stderr[-2000:]
    assert needle in r.stderr and "Traceback" not in r.stderr


def test_a_draft_that_cannot_load_is_refused_before_the_target(tmp_path, monkeypatch):
    """A draft= that names nothing loadable (a mistyped shipped name, a hub id neither cached
    nor reachable, a folder that is not there) is refused before the target loads, which takes
    minutes for a large target; what can load passes."""
    from huggingface_hub import constants

    from decoding.drafts import check_draft_folder

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(DraftError, match=r"^draft=smollm2-eagle: .*did you mean smollm2-eagle3\?"):
        check_draft_folder("smollm2-eagle")
    with pytest.raises(DraftError, match=r"^draft=someorg/no-such-draft: .*HF_HUB_OFFLINE is set"):
        check_draft_folder("someorg/no-such-draft")
    with pytest.raises(DraftError, match=r"^draft=/no/such/run: no such folder$"):
        check_draft_folder("/no/such/run")
    (tmp_path / "run").mkdir()
    for ok in ("ngram", "lookahead", "none", "truncate:2", "smollm2-eagle3", str(tmp_path / "run")):
        check_draft_folder(ok)


def test_a_bad_bench_is_refused_before_the_target_loads(monkeypatch):
    """bench= is read before the target loads, in the built-in decoder and the engines alike."""
    from omegaconf import OmegaConf

    import decoding.eval as ev
    from decoding.settings import EvalConfig

    def no_load(*a, **k):
        raise AssertionError("the target loaded before the bench was read")

    import models.target

    monkeypatch.setattr(ev, "load_target", no_load)
    monkeypatch.setattr(models.target, "load_target", no_load)
    for engine in ("torch", "vllm"):
        cfg = OmegaConf.merge(
            OmegaConf.structured(EvalConfig),
            {"draft": "ngram", "bench": "/no/such/bench.jsonl", "engine": engine},
        )
        with pytest.raises(BenchError, match="bench=/no/such/bench.jsonl: no such file"):
            ev.evaluate(cfg)


def test_a_sweep_writes_each_jobs_report_in_its_folder_and_a_summary(tmp_path):
    """-m: each job's report and plot go to its own folder under the names given (not one
    file the jobs write over in turn); a job refused for its value leaves the others running,
    and the summary tabulates them all, best speedup first; the command then exits 2."""
    import csv

    from conftest import ROOT

    sweep = tmp_path / "sweep"
    r = _eval(
        [
            "-m",
            "target=tiny_random",
            "draft=truncate:1",
            "num_prompts=1",
            "max_new_tokens=8",
            "gamma=0,2,3",
            "report=r.json",
            f"hydra.sweep.dir={sweep}",
        ]
    )
    assert r.returncode == 2, r.stderr[-2000:]
    assert f"error: {sweep / '0'}: gamma=0: must be >= 1" in r.stderr
    assert "1 job(s) of the sweep were refused" in r.stderr
    for job, gamma in (("1", 2), ("2", 3)):
        report = json.loads((sweep / job / "r.json").read_text())
        assert report["settings"]["gamma"] == gamma
        assert (sweep / job / "r.png").stat().st_size > 1000
    assert not (ROOT / "r.json").exists()
    rows = {
        row["overrides"].split()[-2]: row for row in csv.DictReader(open(sweep / "summary.csv"))
    }
    assert set(rows) == {"gamma=0", "gamma=2", "gamma=3"}
    assert rows["gamma=0"]["reason"] == "refused" and "must be >= 1" in rows["gamma=0"]["error"]
    for g in ("gamma=2", "gamma=3"):
        assert rows[g]["reason"] == "finished" and float(rows[g]["tau"]) >= 1.0
        assert rows[g]["lossless"] == "True" and float(rows[g]["speedup"]) > 0
    assert "sorted by speedup (highest first)" in (sweep / "summary.md").read_text()


def test_bench_file_bad_line_is_named(tmp_path):
    p = tmp_path / "b.jsonl"
    p.write_text('{"question_id": 1, "category": "a", "turns": ["hi"]}\n{"turns": 5}\n')
    with pytest.raises(BenchError, match=r"b.jsonl:2: needs \"turns\""):
        read_bench_file(p)
    p.write_text('{"question_id": 1, "turns": ["hi"]}\nnot json\n')
    with pytest.raises(BenchError, match="b.jsonl:2: not valid JSON"):
        read_bench_file(p)


def test_a_question_without_a_category_is_in_the_default_group(tmp_path):
    """Absent, null or empty: the report's "default" group, not one named "None"."""
    p = tmp_path / "b.jsonl"
    p.write_text(
        '{"turns": ["a"]}\n{"category": null, "turns": ["b"]}\n'
        '{"category": "", "turns": ["c"]}\n{"category": "code", "turns": ["d"]}\n'
    )
    assert [q["category"] for q in read_bench_file(p)] == ["default"] * 3 + ["code"]


def test_shipped_benches():
    mt = load_bench("mt_bench")
    assert len(mt) == 80 and all(len(q["turns"]) == 2 for q in mt)
    sb = load_bench("spec_bench")
    assert len(sb) == 480
    assert {q["category"] for q in sb} >= {
        "translation",
        "summarization",
        "qa",
        "math_reasoning",
        "rag",
        "writing",
    }
    assert [q["category"] for q in load_bench("mt_bench", num=3)] == [
        "writing",
        "roleplay",
        "reasoning",
    ]


def test_unknown_checkpoint_kind_and_other_vocabulary(tmp_path, tiny_target):
    weird = tmp_path / "weird"
    weird.mkdir()
    (weird / "config.json").write_text('{"hello": 1}')
    with pytest.raises(DraftError, match="unknown checkpoint kind"):
        load_proposer(str(weird), tiny_target)
    kind = tmp_path / "kind"
    kind.mkdir()
    (kind / "config.json").write_text('{"specdraft": {"method": "medusa9"}}')
    with pytest.raises(DraftError, match="unknown draft kind 'medusa9'"):
        load_proposer(str(kind), tiny_target)
    # an HF model whose tokenizer has a token the target's lacks
    from models.tiny import build_tiny_target

    model, tok = build_tiny_target(seed=3)
    tok.add_tokens(["<extra>"])
    other = tmp_path / "other"
    model.save_pretrained(other)
    tok.save_pretrained(other)
    with pytest.raises(DraftError, match=r"differs from the target's at id 259"):
        load_proposer(str(other), tiny_target)
    with pytest.raises(DraftError, match="truncate:N"):
        load_proposer("truncate:x", tiny_target)


def test_standalone_draft_lms_are_found_for_the_engines(tmp_path, tiny_target):
    """What engines serve as a draft model: a DistillSpec run's merged student, or a causal LM
    folder with the target's tokenizer; heads, exports and n-gram drafts are not; a student
    missing from its draft and an LM of another vocabulary are refused in one line."""
    from decoding.drafts import standalone_lm
    from models.distillspec import DistillSpecConfig, DistillSpecStudent
    from models.eagle import Eagle3Config, Eagle3Head
    from models.tiny import build_tiny_target

    run = tmp_path / "run"
    DistillSpecStudent(tiny_target, DistillSpecConfig(num_layers=1)).save_draft(run / "final")
    folder, desc = standalone_lm(str(run), tiny_target)
    assert folder == run / "final" / "student" and desc.startswith("distillspec student")
    assert standalone_lm(str(folder), tiny_target) == (folder, f"draft LM ({folder})")
    head = Eagle3Head(tiny_target, Eagle3Config(fuse_layers=[0, 1, 1]))
    head.save_draft(tmp_path / "e3")
    for spec in (str(tmp_path / "e3"), "ngram", "truncate:1", str(tmp_path / "missing")):
        assert standalone_lm(spec, tiny_target) is None, spec
    model, tok = build_tiny_target(seed=3)
    tok.add_tokens(["<extra>"])
    model.save_pretrained(tmp_path / "other")
    tok.save_pretrained(tmp_path / "other")
    with pytest.raises(DraftError, match=r"differs from the target's at id 259"):
        standalone_lm(str(tmp_path / "other"), tiny_target)
    import shutil

    shutil.rmtree(folder)
    with pytest.raises(DraftError, match="a DistillSpec draft without its student"):
        standalone_lm(str(run), tiny_target)


def test_eval_config_composes_and_rejects_typos():
    from conftest import CONF
    from hydra import compose, initialize_config_dir
    from hydra.errors import ConfigCompositionException
    from omegaconf.errors import OmegaConfBaseException

    import decoding.eval  # noqa: F401  registers the schema

    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        cfg = compose("eval", overrides=["target=tiny_random", "draft=ngram"])
        assert cfg.gamma == 4 and cfg.target.name == "tiny_random"
        with pytest.raises((ConfigCompositionException, OmegaConfBaseException)):
            compose("eval", overrides=["gama=3"])


@pytest.mark.parametrize("skip", [0, 7])
def test_sharegpt_val_prompts_are_the_training_validation_split(data_file, tmp_path, skip):
    """With ``skip_records`` too: the split hashes each record's position after the skip, and
    the evaluator's split without it held some of the run's training records."""
    from data.dataset import prepare_tokenized
    from models.tiny import build_tiny_tokenizer

    d = prepare_tokenized(
        str(data_file),
        build_tiny_tokenizer(),
        max_length=512,
        val_fraction=0.2,
        max_val_records=5,
        max_records=None,
        seed=3,
        skip_records=skip,
        cache_root=str(tmp_path),
    )
    qs = load_bench(
        "sharegpt_val",
        data_path=str(data_file),
        val_fraction=0.2,
        split_seed=3,
        max_val_records=5,
        skip_records=skip,
    )
    assert [q["question_id"] for q in qs] == list(d.val["id"])


def test_classify_divergence():
    from decoding.eval import classify_divergence

    row = torch.zeros(8)
    row[3], row[5], row[6] = 10.0, 9.9, 4.0
    logits = [row] * 4
    assert classify_divergence([1, 3, 2], [1, 3, 2], logits, 0.5) is None
    d = classify_divergence([1, 3, 2], [1, 5, 2], logits, 0.5)
    assert d["position"] == 1 and d["near_tie"] and abs(d["logit_gap"] - 0.1) < 1e-5
    d = classify_divergence([1, 3, 2], [1, 6, 2], logits, 0.5)
    assert not d["near_tie"] and abs(d["logit_gap"] - 6.0) < 1e-5
    # one side stopped where the other went on (a stop token compared with a word)
    d = classify_divergence([1, 3], [1, 3, 5], logits, 0.5)
    assert d["position"] == 2 and not d["near_tie"]


def _eval_cfg(**over):
    from conftest import CONF
    from hydra import compose, initialize_config_dir

    import decoding.eval  # noqa: F401  registers the schema

    o = {"target": "tiny_random", "num_prompts": 3, "max_new_tokens": 24, "warmup_tokens": 2}
    o.update(over)
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        return compose("eval", overrides=[f"{k}={v}" for k, v in o.items()])


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_lossless_classifies_divergences_and_catches_a_real_bug(dtype, monkeypatch):
    """``lossless`` neither cries wolf nor hides a bug: an honest decoder is lossless in fp32
    (identical outputs) and in bf16 (any parting is a near-tie); a decoder that accepts the
    draft's first token without checking it is caught as a real divergence in both. (A
    Llama-3-shaped tiny target: the default tiny one repeats its last token, which n-gram
    lookup always guesses, so nothing would be rejected.)"""
    import decoding.verify as ver
    from decoding.eval import evaluate
    from decoding.verify import Verdict

    varied = {"target.dtype": dtype, "target.family": "llama3"}
    honest = evaluate(_eval_cfg(draft="ngram", **varied, adaptive="false"))
    assert honest["lossless"] is True
    assert honest["near_tie_tolerance"]["dtype"] == dtype
    if dtype == "float32":
        assert honest["divergences"] == 0

    real = ver.verify_greedy  # what ``verify.accept``, both decoders' acceptance, calls

    def accepts_first_draft_token(tokens, parents, target_argmax):
        v = real(tokens, parents, target_argmax)
        if tokens and not v.path:  # a planted bug: keep a rejected first token anyway
            return Verdict([0], target_argmax[1])
        return v

    monkeypatch.setattr(ver, "verify_greedy", accepts_first_draft_token)
    buggy = evaluate(_eval_cfg(draft="ngram", **varied, adaptive="false"))
    assert buggy["lossless"] is False
    assert buggy["divergences"] > buggy["near_tie_divergences"]


@pytest.mark.parametrize("compile,runner", [("auto", "static"), ("false", "transformers")])
def test_the_report_says_which_decoder_ran_and_the_bound_beside_the_speedup(compile, runner):
    """``compile=`` picks the target's runner and the report names it; the bound is tau over
    1 + drafting's share of a plain step, from the report's own figures."""
    from decoding.eval import evaluate, print_report

    r = evaluate(_eval_cfg(draft="ngram", compile=compile, adaptive="false"))
    d = r["decoder"]
    assert d["runner"] == d["plain_runner"] == runner and d["compile"] == compile
    drafting = r["time_s"]["draft"] / r["target_calls"]
    # the plain step: the plain run's wall time a token after its prefill, the basis of the
    # decode speedup the bound is printed beside (the speedup with the prefill, the same in
    # both runs, lies nearer 1 and so above a bound below 1)
    assert r["speedup_bound"] == pytest.approx(
        r["tau"] / (1 + drafting / (d["plain_ms_per_token"] / 1e3)), rel=1e-6
    )
    lines: list[str] = []
    print_report(r, out=lines.append)
    (line,) = [x for x in lines if x.startswith("decoder: ")]
    assert f"after the prefill {r['decode_speedup']:.2f}x against a bound of " in line
    assert any(line.startswith(f"decoder: {runner} (compile={compile}") for line in lines)
    # where the acceptance step ran: greedy here; at T > 0 on a CPU, row by row on the host
    assert d["acceptance"].startswith("greedy")
    assert any(f"acceptance: {d['acceptance']}" in line for line in lines)
    sampled = evaluate(_eval_cfg(draft="ngram", compile=compile, adaptive="false", temperature=1))
    assert sampled["decoder"]["acceptance"] == "sampled row by row on the host"


def test_a_drafts_saved_decode_settings_apply_when_none_is_given(tmp_path):
    """The shipped head carries its measured-best settings per machine kind; specdraft-eval
    takes them when the command line sets no decode key, and never mixes them with one."""
    import shutil

    from omegaconf import OmegaConf

    from decoding.drafts import machine_kind
    from decoding.eval import EvalConfig, apply_saved_decode
    from models.base import DraftError
    from models.shipped import shipped_draft

    kind = machine_kind(torch.device("cpu"))
    saved = json.loads((shipped_draft("smollm2-eagle3") / "config.json").read_text())["decode"]
    assert {"cpu_bf16", "cpu_fp32"} <= set(saved)
    cfg = OmegaConf.structured(EvalConfig(draft="smollm2-eagle3"))
    cfg.target.device = "cpu"
    line = apply_saved_decode(cfg, {"num_prompts"})
    assert line and kind in line
    for k, v in saved[kind].items():
        assert cfg[k] == v
    # one decode key on the command line: nothing taken from the draft
    cfg = OmegaConf.structured(EvalConfig(draft="smollm2-eagle3", gamma=2))
    cfg.target.device = "cpu"
    assert apply_saved_decode(cfg, {"gamma"}) is None and cfg.tree == "auto"
    # a copy whose section names an unknown key: one line naming file and key
    d = tmp_path / "draft"
    shutil.copytree(shipped_draft("smollm2-eagle3"), d)
    c = json.loads((d / "config.json").read_text())
    c["decode"][kind] = {"tree": "chain", "beam": 3}
    (d / "config.json").write_text(json.dumps(c))
    cfg = OmegaConf.structured(EvalConfig(draft=str(d)))
    cfg.target.device = "cpu"
    with pytest.raises(DraftError, match=r"decode\.cpu_\w+ has \['beam'\]"):
        apply_saved_decode(cfg, set())
    # a learned stop drafts chains: a saved tree is not taken (it was, then refused)
    c["decode"][kind] = {"tree": "dynamic", "depth": 4, "adaptive": False}
    (d / "config.json").write_text(json.dumps(c))
    cfg = OmegaConf.structured(EvalConfig(draft=str(d), stop="disco"))
    cfg.target.device = "cpu"
    assert "not taken: stop=disco drafts a chain" in apply_saved_decode(cfg, {"stop"})
    assert cfg.tree == "auto" and cfg.adaptive is True
    cfg = OmegaConf.structured(EvalConfig(draft=str(d)))
    cfg.target.device = "cpu"
    assert "tree=dynamic" in apply_saved_decode(cfg, set()) and cfg.tree == "dynamic"
    # drafts without a saved section (n-gram, a run dir) keep the defaults
    cfg = OmegaConf.structured(EvalConfig(draft="ngram"))
    assert apply_saved_decode(cfg, set()) is None


def test_a_tree_report_says_why_it_predicts_no_speedup():
    """The paper's predicted speedup is a chain's formula: where trees were verified the report
    says so instead of printing a bare "-"; a chain's line prints the figure."""
    from decoding.eval import evaluate, print_report

    tree = evaluate(_eval_cfg(draft="lookahead", adaptive="false"))
    assert tree["tree_iterations"] > 0
    lines: list[str] = []
    print_report(tree, out=lines.append)
    (line,) = [x for x in lines if x.startswith("predicted speedup")]
    assert "the formula is for chains" in line
    chain = evaluate(_eval_cfg(draft="ngram", adaptive="false"))
    assert chain["tree_iterations"] == 0
    lines = []
    print_report(chain, out=lines.append)
    (line,) = [x for x in lines if x.startswith("predicted speedup")]
    assert "for chains" not in line and line.split()[2] != "-"


def test_report_paths_are_checked_before_anything_is_measured(tmp_path):
    """``report=`` a folder, a path under a file, or a file that is no report (training data,
    say) was found out after the whole evaluation (a traceback, the console report lost) or
    overwritten; each is one line, first, and nothing is touched (the command line once, exit
    2 in one line; the cases through ``report_paths``). An earlier report and its plot are
    replaced."""
    from decoding.report import report_paths
    from decoding.settings import EvalError

    data = tmp_path / "keep.jsonl"
    data.write_text('{"id": 1}\n')
    (tmp_path / "rdir").mkdir()
    r = _eval(["target=tiny_random", "num_prompts=1", f"report={data}"])
    lines = [x for x in r.stderr.splitlines() if x.strip()]
    assert r.returncode == 2 and len(lines) == 1, r.stderr[-2000:]
    assert f"report={data} exists and is no report of specdraft-eval" in lines[0]
    cases = [
        ({"report": str(tmp_path / "rdir")}, "is a folder; name a file in it"),
        ({"report": str(data / "x.json")}, f"{data} is a file, not a folder"),
        ({"report": str(tmp_path / "r.json"), "plot": str(data)}, "is no plot of specdraft-eval"),
        ({"traces": str(data)}, "is no traces of specdraft-eval"),
        ({"traces": str(data / "t.jsonl")}, f"{data} is a file, not a folder"),
        # a folder that takes no file (a special filesystem; no permission, read-only alike)
        ({"report": "/proc/specdraft/r.json"}, "nothing can be written in /proc"),
        ({"plot": "/proc/r.png"}, "nothing can be written in /proc"),
        # each its own file, and a plot of a kind matplotlib writes
        ({"report": str(tmp_path / "r.png")}, "report= and plot= name the same file"),
        ({"report": str(tmp_path / "s.json"), "plot": str(tmp_path / "s.json")}, "same file"),
        ({"plot": str(tmp_path / "p.json")}, "a plot is written as "),
    ]
    for over, needle in cases:
        with pytest.raises(EvalError, match=re.escape(needle)):
            report_paths(_eval_cfg(**over))
    assert data.read_text() == '{"id": 1}\n'
    mine = tmp_path / "r.json"
    mine.write_text(json.dumps({"settings": {}, "convention": "..."}))
    (tmp_path / "r.png").write_bytes(b"\x89PNG\r\n\x1a\n" + b"0" * 8)
    assert report_paths(_eval_cfg(report=str(mine))) == (mine, tmp_path / "r.png")
    # a plot in another format it writes is replaced too (a .jpg was refused as no plot)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    for kind in ("jpg", "pdf", "svg"):
        plt.figure().savefig(tmp_path / f"r.{kind}")
        assert report_paths(_eval_cfg(report=str(mine), plot=str(tmp_path / f"r.{kind}")))
    plt.close("all")
    # another command's JSON with settings (prepare's .meta.json) is no report: kept
    meta = tmp_path / "regen.jsonl.meta.json"
    meta.write_text(json.dumps({"settings": {"target": "x"}, "records": 3}))
    with pytest.raises(EvalError, match="exists and is no report of specdraft-eval"):
        report_paths(_eval_cfg(report=str(meta)))
    earlier = tmp_path / "t.jsonl"  # an earlier traces file is replaced
    earlier.write_text(json.dumps({"meta": {"signal_names": ["p"]}}) + "\n")
    report_paths(_eval_cfg(report=str(mine), traces=str(earlier)))


def test_a_sample_check_with_no_variance_prints_its_report(tmp_path):
    """T > 0 with sample_top_k=1: every step one-hot, so the sample check's log-p score has no
    variance; the report printed a traceback (exit 1) instead of its table."""
    rep = tmp_path / "r.json"
    r = _eval(
        ["target=tiny_random", "draft=ngram", "num_prompts=1", "max_new_tokens=8",
         "temperature=1", "sample_top_k=1", f"report={rep}"]
    )  # fmt: skip
    assert r.returncode == 0, r.stderr[-2000:]
    assert "sample check" in r.stdout and "n/a" in r.stdout and rep.is_file()


def test_a_bench_that_is_a_folder_is_one_line(tmp_path):
    with pytest.raises(BenchError, match=f"^bench={tmp_path}: a folder; name a .jsonl file"):
        read_bench_file(tmp_path)


def test_more_prompts_asked_than_the_bench_holds_is_said(tmp_path, capsys):
    p = tmp_path / "b.jsonl"
    p.write_text("".join(json.dumps({"question_id": i, "turns": ["hi"]}) + "\n" for i in range(3)))
    assert len(load_bench(str(p), num=10)) == 3
    assert f"num_prompts=10: bench={p} has 3 prompts; decoding all 3" in capsys.readouterr().out
    assert len(load_bench(str(p), num=2)) == 2
    assert "num_prompts" not in capsys.readouterr().out


def test_a_tree_width_given_without_a_dynamic_tree_is_said(tmp_path):
    """``top_k`` is the dynamic tree's width; given with a chain (meant, likely, as sampling's
    top-k, which is ``sample_top_k`` here and ``top_k`` in specdraft-prepare) it is one note."""
    args = ["target=tiny_random", "num_prompts=1", "max_new_tokens=4", "draft=ngram"]
    r = _eval([*args, "temperature=1", "top_k=50", "tree=chain", f"report={tmp_path / 'r.json'}"])
    assert r.returncode == 0, r.stderr[-2000:]
    assert "note: top_k=50 is the dynamic tree's width (tree=dynamic), unused with tree=chain" in (
        r.stdout
    )
    r = _eval([*args, "temperature=1", "sample_top_k=50", f"report={tmp_path / 'r.json'}"])
    assert r.returncode == 0 and "note: top_k" not in r.stdout


def test_settings_a_run_cannot_use_are_each_one_note():
    """A key typed on the command line that this run drops gets a note naming it; the same
    keys where they apply, or left at their defaults, get none."""
    from decoding.eval import dropped_settings

    def notes(given, **over):
        return dropped_settings(_eval_cfg(**over), set(given))

    assert notes(["acceptance"], acceptance="typical") == [
        "note: acceptance=typical decides at T > 0 only; at temperature=0 a drafted token is "
        "accepted where it is the target's argmax, under every rule"
    ]
    assert "acceptance=block decides" in notes(["acceptance"], acceptance="block")[0]
    assert notes(["acceptance"], acceptance="typical", temperature=1) == []
    assert notes([], acceptance="typical") == []  # a saved default is not the user's word
    (la,) = notes(["tree"], draft="lookahead", tree="chain")
    assert la.startswith("note: draft=lookahead verifies its n-gram candidates as one tree")
    assert notes(["tree"], draft="ngram", tree="chain") == []
    assert (
        len(
            notes(
                ["top_k", "tree", "acceptance"],
                draft="lookahead",
                tree="chain",
                top_k=9,
                acceptance="block",
            )
        )
        == 3
    )
    # a setting only another engine reads
    assert notes(["engine_format"], engine="llama.cpp", engine_format="speculators") == [
        "note: engine_format is read by engine=vllm only, unused with engine=llama.cpp"
    ]
    (threads,) = notes(["engine_threads"], engine_threads=2)
    assert threads.endswith(
        "read by engine=llama.cpp and engine=vllm only, unused with engine=torch"
    )
    assert notes(["engine_format", "engine_threads"], engine="vllm", engine_format="vllm") == []


def test_tree_sizes_of_another_tree_are_each_one_note():
    """The dynamic tree's sizes with a chain or static tree, and the static tree's with a chain
    or dynamic tree, used to be dropped without a word."""
    from decoding.eval import dropped_settings

    def notes(given, **over):
        return dropped_settings(_eval_cfg(**over), set(given))

    (depth,) = notes(["depth", "tree"], tree="chain", depth=7)
    assert depth == "note: depth=7 sizes the dynamic tree (tree=dynamic), unused with tree=chain"
    assert len(notes(["total_tokens", "min_prob"], tree="static", min_prob=0.1)) == 2
    assert notes(["depth", "total_tokens", "min_prob", "tree"], tree="dynamic", depth=7) == []
    (nodes,) = notes(["tree_nodes", "tree"], tree="dynamic", tree_nodes=12)
    assert nodes.startswith("note: tree_nodes=12 builds a static candidate tree")
    assert nodes.endswith("unused with tree=dynamic")
    assert len(notes(["tree_file"], tree="chain", tree_file="t.json")) == 1
    assert notes(["tree_nodes", "tree_file"], tree="static", tree_nodes=12) == []
    assert notes(["tree_nodes"], tree="auto", tree_nodes=12) == []  # a Medusa draft's auto
    assert notes([], tree="chain", depth=7) == []  # not typed: a default, not the user's word


@pytest.mark.parametrize("threads", [0, -1])
def test_engine_threads_out_of_range_is_one_line(threads):
    from decoding.eval import EvalError
    from decoding.settings import validate

    with pytest.raises(EvalError, match=f"^engine_threads={threads}: must be >= 1 "):
        validate(_eval_cfg(engine="llama.cpp", engine_threads=threads))


@pytest.mark.parametrize(
    "key,value,lo",
    [("lookahead_window", 0, 1), ("lookahead_ngram", 1, 2), ("lookahead_guesses", 0, 1)],
)
def test_lookahead_settings_are_refused_by_their_own_keys(key, value, lo):
    from decoding.eval import EvalError
    from decoding.settings import validate

    with pytest.raises(EvalError, match=f"^{key}={value}: must be >= {lo}$"):
        validate(_eval_cfg(draft="lookahead", **{key: value}))


@pytest.mark.parametrize(
    "over,said",
    [
        # each ran the engine's whole evaluation first, then failed or reported nothing
        ({"temperature": -1}, "temperature=-1.0: must be >= 0"),
        ({"turns": 0}, "turns=0: must be >= 1"),
        ({"turns": -1}, "turns=-1: must be >= 1"),
        ({"plan_max": 0}, "plan_max=0: must be >= 1"),
        ({"calibration_tokens": 0}, "calibration_tokens=0: must be >= 1"),
        ({"warmup_tokens": -5}, "warmup_tokens=-5: must be >= 0"),
        ({"ngram_max": 0}, "ngram_max=0: must be >= 1"),
        ({"num_prompts": 0}, "num_prompts=0: must be >= 1"),
        # rules an engine does not run were reported as if it had
        ({"lenience": 0.5}, "lenience=0.5: lenient acceptance is the built-in decoder's"),
        ({"acceptance": "typical"}, "acceptance=typical: the built-in decoder's rule"),
        ({"stop": "disco"}, "stop=disco: the built-in decoder's stop rule"),
        ({"traces": "t.jsonl"}, "traces=t.jsonl: recorded by the built-in decoder"),
        # was "no such file or folder"
        ({"draft": "truncate:1"}, "draft=truncate:1: a drafter of the built-in decoder's"),
        ({"draft": "lookahead"}, "draft=lookahead: a drafter of the built-in decoder's"),
    ],
)
@pytest.mark.parametrize("engine", ["llama.cpp", "vllm"])
def test_an_engine_runs_settings_are_checked_before_anything_loads(engine, over, said, tmp_path):
    """Every engine's settings are checked as the built-in decoder's are, before a target or
    an engine loads (the engine need not be installed for the refusal)."""
    from decoding.eval import EvalError, evaluate

    cfg = _eval_cfg(engine=engine, report=str(tmp_path / "r.json"), **over)
    with pytest.raises(EvalError) as e:
        evaluate(cfg)
    assert str(e.value).startswith(said), str(e.value)
    if engine == "vllm" and "acceptance" in over:
        assert "engine_rule=block" in str(e.value)


def test_the_built_in_decoders_settings_typed_for_an_engine_are_noted():
    from decoding.eval import dropped_settings

    notes = dropped_settings(
        _eval_cfg(engine="vllm", draft_weights="int8", adaptive=False, tree="chain"),
        {"draft_weights", "adaptive", "tree"},
    )
    assert notes == [
        "note: adaptive is the built-in decoder's (engine=torch), unused with engine=vllm",
        "note: draft_weights is the built-in decoder's (engine=torch), unused with engine=vllm",
    ]
    assert dropped_settings(_eval_cfg(adaptive=False), {"adaptive"}) == []


@pytest.mark.parametrize("draft", ["ngram", "lookahead", "truncate:1"])
def test_int8_draft_weights_on_a_draft_without_a_head_is_refused(draft, tiny_target):
    from models.base import DecodeSettings

    with pytest.raises(DraftError, match=f"^draft={draft}: draft_weights=int8 quantizes"):
        load_proposer(draft, tiny_target, tree=DecodeSettings(draft_weights="int8"))


def test_one_token_outputs_add_no_time_to_an_engines_rate():
    """llama.cpp times predicted_n - 1 forwards (the first token is the prompt's): a request
    of one token took ~1 us and read as a million tokens/s; it adds no time and no token."""
    from decoding.engines.base import Completion, EngineStats

    st = EngineStats()
    one = Completion([5], {"predicted_n": 1, "predicted_ms": 0.001, "timed_n": 0})
    st.add(one, one)
    assert st.row()["tokens_per_second"] != st.row()["tokens_per_second"]  # nan: nothing timed
    eleven = Completion(list(range(11)), {"predicted_n": 11, "predicted_ms": 100.0, "timed_n": 10})
    plain = Completion(list(range(11)), {"predicted_n": 11, "predicted_ms": 200.0, "timed_n": 10})
    st.add(eleven, plain)
    row = st.row()
    assert row["tokens_per_second"] == pytest.approx(100.0)
    assert row["ar_tokens_per_second"] == pytest.approx(50.0)
    assert row["speedup"] == pytest.approx(2.0) and row["new_tokens"] == 12


def test_the_sample_check_says_what_a_pass_means_under_a_lossy_rule():
    """At T > 0 the sample check scores the run's samples; under exact acceptance a pass reads
    "consistent with the target's distribution"; under typical acceptance, which moves the
    distribution on purpose, a pass says it is no evidence, beside the TVD that measures it."""
    from decoding.eval import evaluate, print_report

    for acceptance, said in (
        ("typical", "which says nothing of typical acceptance"),
        ("exact", "consistent with the target's distribution"),
    ):
        r = evaluate(_eval_cfg(draft="ngram", temperature=1, acceptance=acceptance, num_prompts=2))
        lines = []
        print_report(r, out=lines.append)
        (check,) = [s for s in lines if s.startswith("sample check")]
        assert r["sample_check"]["flag"] is None and said in check, check  # seeded: a pass
        assert (r["sample_check"].get("lossy_rule") == "typical acceptance") == (
            acceptance == "typical"
        )


def test_a_draft_is_evaluated_against_the_target_it_was_trained_for(tmp_path):
    """``specdraft-eval draft=<run>`` with no target on the command line loads the target the
    draft was trained for (not the default SmolLM2, which a head for another target does not
    fit); ``target=...`` still chooses; a target folder that has gone is one line naming it."""
    import shutil

    from conftest import CONF
    from hydra import compose, initialize_config_dir

    from decoding.settings import apply_saved_target
    from models.eagle import Eagle1Config, EagleHead
    from models.target import TargetConfig, TargetError, load_target, target_folder

    tiny = load_target(TargetConfig(name="tiny_random", seed=3, cache_dir=str(tmp_path / "c")))
    folder = tmp_path / "mymodel"
    shutil.copytree(target_folder(tiny), folder)
    mine = load_target(TargetConfig(path=str(folder), dtype="float32"))
    EagleHead(mine, Eagle1Config()).save_draft(tmp_path / "run" / "final")
    import decoding.eval  # noqa: F401  registers the schema

    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        cfg = compose("eval", overrides=[f"draft={tmp_path / 'run'}"])
        line = apply_saved_target(cfg, set())
        assert cfg.target.path == str(folder)  # the path wins over the name
        assert line.startswith(f"target: {folder}, the target {tmp_path / 'run' / 'final'} was")
        chosen = compose("eval", overrides=[f"draft={tmp_path / 'run'}", "target=tiny_random"])
        assert apply_saved_target(chosen, {"draft", "target"}) is None
        assert chosen.target.name == "tiny_random" and chosen.target.path is None
        shipped = compose("eval", overrides=["draft=smollm2-eagle3"])
        assert apply_saved_target(shipped, {"draft"}) is None  # trained for the default
        folder.rename(tmp_path / "moved")
        cfg = compose("eval", overrides=[f"draft={tmp_path / 'run'}"])
        with pytest.raises(TargetError, match="which is not there any more; pass target=hf"):
            apply_saved_target(cfg, set())


def test_an_export_for_another_target_says_so_when_it_does_not_fit(tmp_path, tiny_target):
    """An export read against a target it cannot fit leads with the target it was made for."""
    from models.eagle import Eagle3Config, Eagle3Head
    from models.export import export
    from models.target import TargetConfig, load_target

    t4 = load_target(TargetConfig(name="tiny_random", tiny_layers=4, dtype="float32"))
    head = Eagle3Head(t4, Eagle3Config(fuse_layers=[1, 2, 3], draft_vocab_size=64)).eval()
    with torch.no_grad():  # a chosen vocabulary (every other token)
        head.d2t.copy_(torch.arange(64))
        head.t2d.zero_()
        head.t2d[torch.arange(64) * 2] = True
    export(head, "vllm", tmp_path / "v", log=lambda *_: None)
    with pytest.raises(DraftError) as e:
        load_proposer(str(tmp_path / "v"), tiny_target)
    assert str(e.value).startswith(
        f"{tmp_path / 'v'}: made for target {t4.identity}, evaluated against "
        f"{tiny_target.identity}; it does not fit ("
    )
