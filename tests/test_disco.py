"""DISCO: acceptance traces from the decoder, the classifier and its threshold, the stop rule at
decode time (lossless), the CLI and its errors. (Exact sampling under a stop rule:
test_decoder.py::test_a_stop_rule_keeps_sampling_exact.)"""

from __future__ import annotations

import json
import random

import pytest
import torch
from conftest import run_module

from decoding.decoder import NoDraft, SpeculativeDecoder
from decoding.disco import (
    DiscoError,
    DiscoStop,
    examples,
    load_disco,
    read_traces,
    replay,
    save_disco,
    train_disco,
)
from decoding.proposers import DraftLMProposer, NGramProposer
from models.base import SIGNAL_NAMES
from models.sampling import Sampling
from models.tiny import build_tiny_target

PROMPT = [257, 72, 101, 108, 108, 111, 32, 72, 101, 108, 108, 111, 32, 119, 111, 114, 108, 100, 258]


def test_traces_hold_each_drafted_token_and_the_accepted_count(tiny_target):
    traces: list = []
    dec = SpeculativeDecoder(
        tiny_target,
        DraftLMProposer(tiny_target.truncated(1)),
        Sampling(),
        gamma=4,
        adaptive=False,
        traces=traces,
    )
    dec.generate(PROMPT, 40)
    assert len(traces) == dec.stats.target_calls - (dec.stats.gamma_used[0])
    assert sum(r["accepted"] for r in traces) == sum(dec.stats.accepted.values())
    for r in traces:
        sig = torch.tensor(r["signals"])
        assert sig.shape == (r["drafted"], len(SIGNAL_NAMES))
        assert sig[:, -1].tolist() == [float(k) for k in range(1, r["drafted"] + 1)]
        torch.testing.assert_close(sig[:, 0], sig[:, 1])  # greedy: the drafted token is the top
        assert (sig[:, 1] >= sig[:, 2]).all() and (sig[:, 5] >= 0).all()


def test_examples_are_the_tested_tokens():
    rows = [
        {"signals": [[0.1] * 7, [0.2] * 7, [0.3] * 7], "accepted": 1, "drafted": 3},
        {"signals": [[0.4] * 7, [0.5] * 7], "accepted": 2, "drafted": 2},
    ]
    x, y = examples(rows)
    assert x[:, 0].tolist() == pytest.approx([0.1, 0.2, 0.4, 0.5])  # 0.3 was never tested
    assert y.tolist() == [1.0, 0.0, 1.0, 1.0]


def _synthetic_rows(n=600, seed=0, gamma=5):
    """Tokens are accepted exactly when their drafted probability exceeds 0.5."""
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        sig, acc, done = [], 0, False
        for k in range(1, gamma + 1):
            p = rng.random()
            top = sorted([p, rng.random() * (1 - p), 0.05, 0.01], reverse=True)
            sig.append([p, *top, 2.0 * (1 - p), float(k)])
            if not done and p > 0.5:
                acc += 1
            else:
                done = True
        rows.append({"signals": sig, "accepted": acc, "drafted": gamma})
    return rows


def test_the_classifier_learns_a_separable_signal_and_stopping_pays():
    rows = _synthetic_rows()
    c = 0.3  # drafting is expensive: stopping at a likely rejection must pay
    model, thr, summary = train_disco(rows, c, epochs=300, log=lambda *_: None)
    assert summary["val_accuracy"] > 0.9
    t = summary["val_tokens_per_cost"]
    assert t["disco"] > t["never_stop"] and t["disco"] >= max(
        v for k, v in t.items() if k.startswith("fixed_gamma")
    )
    assert 0 < thr < 1
    stop = DiscoStop(model, thr)
    assert stop(torch.tensor([0.1, 0.6, 0.3, 0.05, 0.01, 1.8, 1.0]))  # a weak token: stop
    assert not stop(torch.tensor([0.95, 0.95, 0.04, 0.05, 0.01, 0.1, 1.0]))
    assert replay(rows, None, 1.0, c)[1] == 5.0


def test_training_needs_both_outcomes():
    rows = [{"signals": [[0.9] * 7], "accepted": 1, "drafted": 1}] * 10
    with pytest.raises(DiscoError, match="both outcomes"):
        train_disco(rows, 0.1, log=lambda *_: None)


@pytest.mark.parametrize("always", [True, False])
def test_a_stop_rule_only_shortens_drafts_and_greedy_stays_lossless(tiny_target, always):
    other, _ = build_tiny_target(seed=1)
    ref = SpeculativeDecoder(tiny_target, NoDraft(), Sampling(), calibrate=False).generate(
        PROMPT, 40
    )
    dec = SpeculativeDecoder(
        tiny_target,
        DraftLMProposer(other),
        Sampling(),
        gamma=4,
        adaptive=False,
        stop_rule=lambda sig: always,
    )
    assert dec.generate(PROMPT, 40) == ref
    used = {g for g, n in dec.stats.gamma_used.items() if n and g}
    assert used == {1} if always else max(used) == 4


def test_stop_rules_and_traces_need_a_drafter_that_reports_signals(tiny_target):
    with pytest.raises(ValueError, match="NGramProposer does not"):
        SpeculativeDecoder(tiny_target, NGramProposer(), Sampling(), stop_rule=lambda s: False)
    with pytest.raises(ValueError, match="acceptance traces"):
        SpeculativeDecoder(tiny_target, NGramProposer(), Sampling(), traces=[])


def test_save_load_roundtrip(tmp_path):
    rows = _synthetic_rows(200)
    model, thr, summary = train_disco(rows, 0.2, epochs=50, log=lambda *_: None)
    save_disco(model, thr, summary, {"draft": "x"}, tmp_path / "disco")
    stop = load_disco(tmp_path / "disco")
    x = torch.tensor(rows[0]["signals"])
    torch.testing.assert_close(stop.model(x), model(x))
    assert stop.threshold == thr
    with pytest.raises(DiscoError, match="no DISCO classifier"):
        load_disco(tmp_path)


def test_bad_traces_are_named(tmp_path):
    p = tmp_path / "t.jsonl"
    meta = {"meta": {"draft": "x", "c": 0.1, "signal_names": list(SIGNAL_NAMES)}}
    p.write_text(json.dumps(meta) + "\n" + json.dumps({"signals": [[0.1] * 7], "drafted": 1}))
    with pytest.raises(DiscoError, match=r"t.jsonl:2: no 'accepted' field"):
        read_traces(p)
    p.write_text(json.dumps({"signals": [[0.1] * 7], "accepted": 0, "drafted": 1}) + "\n")
    with pytest.raises(DiscoError, match="no meta line"):
        read_traces(p)
    p.write_text(
        json.dumps(meta) + "\n" + json.dumps({"signals": [[0.1] * 3], "accepted": 0, "drafted": 1})
    )
    with pytest.raises(DiscoError, match="rows of 7 values"):
        read_traces(p)


def test_eval_traces_then_cli_then_stop_disco(tmp_path):
    """The whole loop on the tiny target: record traces, train the classifier with the CLI,
    decode with stop=disco (lossless at T = 0)."""
    traces, disco = tmp_path / "t.jsonl", tmp_path / "disco"
    draft, tok = build_tiny_target(seed=3)  # an unrelated draft LM: accepted at times only
    draft.save_pretrained(tmp_path / "draft")
    tok.save_pretrained(tmp_path / "draft")
    common = ["target=tiny_random", f"draft={tmp_path / 'draft'}", "max_new_tokens=24"]
    r = run_module(
        "decoding.eval",
        [
            *common,
            "num_prompts=6",
            "adaptive=false",
            "gamma=4",
            f"traces={traces}",
            f"report={tmp_path / 'a.json'}",
        ],
        300,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    meta, rows = read_traces(traces)
    assert meta["c"] > 0 and meta["gamma"] == 4 and len(rows) > 10
    # the tiny random target's chat replies are degenerate loops every draft gets right, so the
    # classifier is fitted on synthetic rows under the same meta line
    mixed = tmp_path / "mixed.jsonl"
    mixed.write_text(
        "".join(json.dumps(x) + "\n" for x in [{"meta": meta}, *rows, *_synthetic_rows(100)])
    )
    r = run_module("decoding.disco", [str(mixed), "--out", str(disco), "--epochs", "50"], 120)
    assert r.returncode == 0, r.stderr[-3000:]
    assert (disco / "model.safetensors").exists() and "saved" in r.stdout
    assert f"stop=disco disco={disco})" in r.stdout  # the classifier is not the draft's own
    for bad in (traces, traces / "d"):  # a file, or a path under one: refused before fitting
        r = run_module("decoding.disco", [str(mixed), "--out", str(bad)], 120)
        assert r.returncode == 2 and "a file, not a folder" in r.stderr, r.stderr[-2000:]
    assert read_traces(traces)[0] == meta  # untouched
    rep = tmp_path / "b.json"
    r = run_module(
        "decoding.eval",
        [*common, "num_prompts=2", "stop=disco", f"disco={disco}", f"report={rep}"],
        300,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    d = json.loads(rep.read_text())
    assert d["lossless"] is True and "DISCO stop" in d["settings"]["draft_description"]


@pytest.mark.parametrize(
    "args,needle",
    [
        (["draft=truncate:1", "traces=t.jsonl"], "add adaptive=false"),
        (["draft=ngram", "stop=disco", "disco=/x"], "does not report per-token signals"),
        (["draft=truncate:1", "stop=disco"], "has no folder to hold a classifier"),
        (["draft=truncate:1", "stop=often"], "stop='often'"),
        (["draft=truncate:1", "stop=disco", "disco=/nonexistent"], "specdraft-disco"),
        (
            ["draft=truncate:1", "adaptive=false", "lenience=0.5", "traces=t.jsonl"],
            "traces with lenience=0.5",
        ),
        (["draft=truncate:1", "stop=disco", f"disco={__file__}"], "a file, not a folder"),
    ],
)
def test_eval_disco_errors_are_one_line(tmp_path, args, needle):
    r = run_module(
        "decoding.eval",
        ["target=tiny_random", "num_prompts=1", f"report={tmp_path / 'r.json'}", *args],
        120,
    )
    assert r.returncode == 2, r.stderr[-2000:]
    assert needle in r.stderr and "Traceback" not in r.stderr


def test_cli_errors_are_one_line(tmp_path):
    r = run_module("decoding.disco", [str(tmp_path / "missing.jsonl"), "--out", str(tmp_path)])
    assert r.returncode == 2 and "no such traces file" in r.stderr
    assert "Traceback" not in r.stderr
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    with pytest.raises(DiscoError, match=r"empty.jsonl: empty \(write traces"):
        read_traces(empty)
    with pytest.raises(DiscoError, match="a folder; name the traces file"):
        read_traces(tmp_path)


def test_a_classifier_never_replaces_a_draft_and_is_found_beside_it(tmp_path, capsys):
    """``--out`` a trained draft is refused (naming its classifier's folder) and the draft is
    left whole; ``disco=<the draft>`` reads the classifier in its ``disco/`` folder; one fit on
    another draft's traces is used with a warning."""
    from types import SimpleNamespace

    from decoding.disco import load_stop_rule, main

    final = tmp_path / "run" / "final"
    final.mkdir(parents=True)
    (final / "config.json").write_text(json.dumps({"specdraft": {"method": "eagle3"}}))
    (final / "model.safetensors").write_bytes(b"weights")
    meta = {"draft": str(tmp_path / "other"), "c": 0.2, "signal_names": list(SIGNAL_NAMES)}
    traces = tmp_path / "t.jsonl"
    traces.write_text(
        "".join(json.dumps(x) + "\n" for x in [{"meta": meta}, *_synthetic_rows(200)])
    )
    for out in (final, tmp_path / "run"):
        with pytest.raises(SystemExit) as e:
            main([str(traces), "--out", str(out), "--epochs", "5"])
        err = capsys.readouterr().err
        assert e.value.code == 2 and "(a trained draft)" in err and str(final / "disco") in err
    assert (final / "model.safetensors").read_bytes() == b"weights"
    main([str(traces), "--out", str(final / "disco"), "--epochs", "5"])
    capsys.readouterr()
    chain = SimpleNamespace(gives_signals=True, tree_depth=None)
    stop = load_stop_rule(str(tmp_path / "run"), str(tmp_path / "run"), chain)
    assert stop.path == str(final / "disco")
    assert f"fit on traces of draft={tmp_path / 'other'}" in capsys.readouterr().out
    (tmp_path / "other").mkdir()
    meta_same = load_stop_rule(str(final / "disco"), str(tmp_path / "other"), chain)
    assert meta_same.trained_on["draft"] == str(tmp_path / "other")
    assert "warning" not in capsys.readouterr().out


@pytest.mark.parametrize("named", ["smollm2-eagle3", "path"])
def test_traces_of_the_shipped_head_never_write_over_its_classifier(tmp_path, capsys, named):
    """Without --out the classifier went to the traced draft's disco/: for the shipped head,
    the one in the package (the documented recipe replaced it)."""
    from decoding.disco import main
    from models.shipped import shipped_draft

    home = shipped_draft("smollm2-eagle3")
    draft = "smollm2-eagle3" if named == "smollm2-eagle3" else str(home)
    before = {p: p.read_bytes() for p in (home / "disco").iterdir()}
    meta = {"draft": draft, "c": 0.2, "signal_names": list(SIGNAL_NAMES)}
    traces = tmp_path / "t.jsonl"
    traces.write_text(
        "".join(json.dumps(x) + "\n" for x in [{"meta": meta}, *_synthetic_rows(200)])
    )
    with pytest.raises(SystemExit) as e:
        main([str(traces), "--epochs", "5"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "part of the package" in err and "pass --out DIR" in err
    assert {p: p.read_bytes() for p in (home / "disco").iterdir()} == before
    main([str(traces), "--epochs", "5", "--out", str(tmp_path / "mine")])
    assert (tmp_path / "mine").is_dir()
