"""specdraft-eval's inputs and what its report says of them: settings checked before anything
loads, settings a run cannot use noted, prompts that do not fit the target, the tokens that end
a reply, outputs replaced, and report lines that follow what the decoder ran."""

from __future__ import annotations

import json

import pytest

from models.base import Proposal, Proposer


def _eval_cfg(**over):
    from conftest import CONF
    from hydra import compose, initialize_config_dir

    import decoding.eval  # noqa: F401  registers the schema

    o = {"target": "tiny_random", "num_prompts": 1, "max_new_tokens": 8, "warmup_tokens": 1}
    o.update(over)
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        return compose("eval", overrides=[f"{k}={v}" for k, v in o.items()])


def _bench(tmp_path, *prompts: str):
    p = tmp_path / "b.jsonl"
    p.write_text(
        "".join(
            json.dumps({"question_id": f"q{i}", "category": "c", "turns": [t]}) + "\n"
            for i, t in enumerate(prompts)
        )
    )
    return p


@pytest.mark.parametrize("batch", [False, True])
def test_a_prompt_past_the_targets_context_is_one_line_before_decoding(tmp_path, batch):
    """The tiny target's context is 4,096 positions (its byte tokenizer: a token a character).
    A prompt past it, or one whose max_new_tokens would run past it, used to be decoded in
    silence, positions beyond the model's context and all; now it is refused, naming the
    question, before anything is decoded."""
    from decoding.eval import EvalError, evaluate

    bench = _bench(tmp_path, "short question", "a" * 4200)
    over = {"batch_size": 2} if batch else {}
    with pytest.raises(EvalError) as e:
        evaluate(_eval_cfg(draft="ngram", bench=bench, num_prompts=2, **over))
    msg = str(e.value)
    assert msg.startswith(f"bench={bench}: question 'q1' needs ") and "\n" not in msg
    assert "past the target's context of 4096 tokens; lower max_new_tokens" in msg


@pytest.mark.parametrize("engine", ["vllm", "llama.cpp"])
def test_a_prompt_past_the_targets_context_is_refused_before_an_engine_starts(
    tmp_path, monkeypatch, engine
):
    """In a serving engine too: the question is named before any engine process starts (one
    that would start here fails at once)."""
    from decoding.eval import EvalError, evaluate

    dead = tmp_path / "dead-python"
    dead.write_text("#!/bin/sh\nexit 1\n")
    dead.chmod(0o755)
    monkeypatch.setenv("SPECDRAFT_VLLM_PYTHON", str(dead))
    monkeypatch.setenv("SPECDRAFT_LLAMA_CPP", str(tmp_path / "no-llama"))
    bench = _bench(tmp_path, "short question", "a" * 4200)
    with pytest.raises(EvalError, match="question 'q1' needs .* past the target's context"):
        evaluate(_eval_cfg(draft="ngram", engine=engine, bench=bench, num_prompts=2))


def test_a_prompt_that_fits_only_without_its_answer_is_refused(tmp_path, tiny_target):
    """The prompt alone fits; with the tokens it may generate it does not."""
    from decoding.eval import EvalError
    from decoding.settings import check_context

    (q,) = [{"question_id": 7, "category": "c", "turns": ["a" * 3900]}]
    check_context(_eval_cfg(max_new_tokens=8), tiny_target, [q])  # fits
    with pytest.raises(EvalError, match=r"question 7 needs \d+ tokens \(its prompt and "):
        check_context(_eval_cfg(max_new_tokens=400), tiny_target, [q])
    # later turns: room for an answer to each turn before the last
    two = {"question_id": 8, "category": "c", "turns": ["a" * 2000, "b" * 2000]}
    check_context(_eval_cfg(turns=1, max_new_tokens=100), tiny_target, [two])
    with pytest.raises(EvalError, match="its 2 turns and max_new_tokens=100 per turn"):
        check_context(_eval_cfg(turns=2, max_new_tokens=100), tiny_target, [two])


def test_the_generation_configs_end_of_turn_ends_a_reply(tiny_target, monkeypatch):
    """An instruction model's end of turn is often in its generation config only (Gemma's
    ``<end_of_turn>``: the tokenizer's EOS is ``<eos>``); the evaluator stopped at the
    tokenizer's EOS alone, so every reply ran on past its end to max_new_tokens. Here the
    tiny target's generation config names token 198 (what its greedy decoding emits first)."""
    import decoding.eval as ev
    from decoding.settings import stop_ids

    monkeypatch.setattr(tiny_target.model.generation_config, "eos_token_id", [258, 198])
    tok = tiny_target.tokenizer
    assert stop_ids(_eval_cfg(), tok, tiny_target) == {258, 198}
    assert stop_ids(_eval_cfg(ignore_eos=True), tok, tiny_target) == set()
    monkeypatch.setattr(ev, "load_target", lambda _cfg: tiny_target)
    r = ev.evaluate(_eval_cfg(draft="ngram", adaptive="false"))
    (turn,) = r["outputs"][0]["turns"]
    assert turn["ar_tokens"] == 1 and turn["spec_tokens"] == 1, turn  # ended at 198
    assert r["new_tokens"] == 1 and r["lossless"] is True


def test_a_batch_report_says_the_verifier_was_changed(tiny_target, monkeypatch):
    """A draft that changes the verifier (Medusa-2's adapter): the batch-1 report says so; the
    batch report said ``lossless: True`` with no word that every output, plain and reference
    included, followed the adapted model and not the target."""
    import decoding.eval as ev
    from decoding.proposers import NGramProposer
    from decoding.report import print_batch_report

    said = "the verifier is the target with this draft's adapter (a stand-in)"

    class Adapted:
        def changes_target(self):
            return said

    def load(*a, **k):
        p = NGramProposer(max_ngram=3)
        p.method = Adapted()
        return p, "ngram with an adapter"

    monkeypatch.setattr(ev, "load_target", lambda _cfg: tiny_target)
    monkeypatch.setattr(ev, "load_proposer", load)
    r = ev.evaluate(
        _eval_cfg(
            draft="ngram",
            batch_size=2,
            num_prompts=2,
            max_new_tokens=4,
            adaptive="false",
            batch_warmup="false",
            compile="false",
        )
    )
    assert r["verifier_changed"] == said
    assert "against the adapted verifier, not the original target" in r["lossless_note"]
    lines: list[str] = []
    print_batch_report(r, out=lines.append)
    assert f"NOTE: {said}" in lines


@pytest.mark.parametrize(
    "draft,said,unsaid",
    [
        # lookahead drafts every iteration whatever adaptive says
        ("lookahead", "trees verified whole", "drafted while they pay"),
        # plain decoding drafts nothing: no "gamma<=4 (adaptive)"
        ("none", "no draft (plain decoding)", "gamma<="),
    ],
)
def test_the_reports_header_says_what_the_decoder_ran(
    tiny_target, monkeypatch, draft, said, unsaid
):
    import decoding.eval as ev
    from decoding.report import print_report

    monkeypatch.setattr(ev, "load_target", lambda _cfg: tiny_target)
    r = ev.evaluate(_eval_cfg(draft=draft))
    assert r["settings"]["adaptive"] is True  # the default, which neither run follows
    if draft == "lookahead":
        assert r["decoder"]["adaptive"] is False
    else:
        assert r["decoder"]["gamma"] == 0
    lines: list[str] = []
    print_report(r, out=lines.append)
    head = next(s for s in lines if s.lstrip("\n").startswith("draft:"))
    assert said in head and unsaid not in head, head


@pytest.mark.parametrize(
    "over,said",
    [
        # each was found only after the target, the draft, the warm-up and (T = 0) the batch-1
        # reference decoding had run
        ({"batch_size": 2, "batch_repeats": 0}, "batch_repeats=0: must be >= 1"),
        ({"batch_size": 2, "batch_admit": 3}, "batch_admit=3: larger than the batch of 2"),
        ({"batch_size": 2, "request_lengths": "random"}, "request_lengths='random': use equal"),
        ({"batch_sizes": "[2,0]"}, "batch_sizes=[2, 0]: 0 is not an integer >= 1"),
        ({"batch_policies": "[fixed,best]"}, "batch_policies=['fixed', 'best']: 'best' is not one"),
        ({"request_rates": "[1,0]"}, "request_rates=[1.0, 0.0]: 0.0 is not a rate"),
        # a batched request's seed (seed * 100003 + i) overflowed 64 bits: a traceback at T > 0
        ({"seed": 2**50}, f"seed={2**50}: must be an integer between -2^40 and 2^40"),
        ({"seed": -(2**50)}, f"seed={-(2**50)}: must be an integer between -2^40 and 2^40"),
        # uniform sampling, with no word
        ({"temperature": "inf"}, "temperature=inf: must be >= 0 (and finite"),
    ],
)
def test_settings_are_checked_before_anything_loads(over, said):
    from decoding.eval import EvalError
    from decoding.settings import validate

    with pytest.raises(EvalError) as e:
        validate(_eval_cfg(draft="ngram", **over))
    assert str(e.value).startswith(said), str(e.value)


def test_batch_settings_outside_a_batch_are_not_refused():
    """At batch_size=1 the serving regime's settings are unused (noted, below), not errors."""
    from decoding.settings import validate

    validate(_eval_cfg(batch_repeats=0, batch_admit=3, request_lengths="mixed"))
    validate(_eval_cfg(seed=-1, batch_size=2, temperature=1))  # a negative seed is a seed


def test_settings_this_run_does_not_read_are_each_one_note():
    """The serving regime's settings typed at batch_size=1, the sampling filters at
    temperature=0 and ``adaptive`` beside ``batch_policies`` were dropped without a word."""
    from decoding.eval import dropped_settings

    def notes(given, **over):
        return dropped_settings(_eval_cfg(**over), set(given))

    (rep,) = notes(["batch_repeats"], batch_repeats=3)
    assert rep.startswith("note: batch_repeats=3 is the serving regime's (batch_size > 1")
    assert rep.endswith("unused at batch_size=1")
    assert len(notes(["request_lengths", "batch_admit"], request_lengths="mixed")) == 2
    assert notes(["batch_repeats", "batch_size"], batch_repeats=3, batch_size=2) == []
    (top_p,) = notes(["top_p"], top_p=0.9)
    assert top_p == (
        "note: top_p=0.9 applies at temperature > 0 only; at temperature=0 the target and the "
        "draft take their argmax"
    )
    assert (
        len(notes(["sample_top_k", "draft_sampling"], sample_top_k=5, draft_sampling="greedy")) == 2
    )
    assert notes(["top_p", "temperature"], top_p=0.9, temperature=1) == []
    assert notes(["top_p"], top_p=1.0) == []  # the default typed: nothing dropped
    (ad,) = notes(["adaptive", "batch_policies"], adaptive="false", batch_policies="[fixed]")
    assert ad.startswith("note: adaptive=False is unused where batch_policies=['fixed']")
    # an engine's run: one note for a built-in decoder's key, not two
    assert len(notes(["draft_sampling"], engine="vllm", draft_sampling="greedy")) == 1


def test_turns_past_the_benchs_are_noted():
    from decoding.eval import turns_note
    from decoding.settings import bench_questions

    qs = bench_questions(_eval_cfg(num_prompts=2))
    assert turns_note(_eval_cfg(turns=2), qs) is None
    assert turns_note(_eval_cfg(turns=3), qs) == (
        "note: turns=3: bench=mt_bench's questions have at most 2 turns; each is fed the turns "
        "it has"
    )


def test_an_earlier_report_is_replaced_with_a_word(tmp_path):
    """An earlier report and plot at the paths given were written over in silence."""
    from decoding.report import replaced_outputs, report_paths

    rep = tmp_path / "r.json"
    cfg = _eval_cfg(report=rep)
    assert replaced_outputs(cfg) == []
    rep.write_text(
        json.dumps({"settings": {"date": "2026-11-30T10:00:00+00:00"}, "convention": ""})
    )
    rep.with_suffix(".png").write_bytes(b"\x89PNG\r\n\x1a\n....")
    report_paths(cfg)  # both ours: replaced, not refused
    assert replaced_outputs(cfg) == [
        f"note: report={rep} holds an earlier report (its run of 2026-11-30T10:00:00); this "
        "run replaces it (report= names another file to keep it)",
        f"note: plot={rep.with_suffix('.png')} holds an earlier plot; this run replaces it "
        "(plot= names another file to keep it)",
    ]


class _PastTheBudget(Proposer):
    """Drafts two tokens more than asked, each the tiny target's greedy token (198), as a
    Falcon tree does where its k-token blocks end past ``gamma``."""

    def propose(self, state, gamma):
        return Proposal.chain([198] * (gamma + 2)) if gamma else Proposal([], [])


@pytest.mark.parametrize("batch", [1, 2])
def test_tokens_accepted_past_max_new_tokens_are_not_counted(tiny_target, batch):
    """A proposal that reaches past the request's budget was accepted whole: its tokens past
    max_new_tokens were cut from the output but counted as accepted draft positions (alpha by
    position had a position the budget never allowed, the accepted-length histogram a length
    no output had)."""
    from data.chat import prompt_ids
    from decoding.batch import BatchDecoder
    from models.sampling import Sampling
    from models.target import GenRequest

    tok = tiny_target.tokenizer
    prompts = [prompt_ids(tok, [{"role": "user", "content": f"Question {i}?"}]) for i in (1, 2)]
    dec = BatchDecoder(tiny_target, _PastTheBudget(), Sampling(), batch, gamma=4, calibrate=False)
    out = dec.run([GenRequest(i, prompts[i]) for i in range(batch)], 5)
    st = dec.stats.rows
    assert all(o == [198] * 5 for o in out.values()), out
    # the prefill's token, then one verification a request: 3 drafted tokens asked (budget 5
    # less the first token and the bonus), 5 drafted, the first 4 emitted and counted
    assert st.target_calls == batch and st.new_tokens == 5 * batch
    assert st.alpha_per_position() == [1.0] * 4
    assert dict(st.accept_len) == {4: batch} and st.tau == 4.0


def test_the_questions_are_read_once_unless_the_file_changed(tmp_path, monkeypatch):
    """A run stopped by a signal counts the questions it was asked without reading the bench
    again (the ShareGPT split takes seconds; a scheduler's grace period is short); a bench
    file edited since is read again, and a caller's changes never reach the next one."""
    import decoding.settings as st

    reads = []
    real = st.load_bench
    monkeypatch.setattr(st, "load_bench", lambda *a, **k: reads.append(a) or real(*a, **k))
    bench = tmp_path / "b.jsonl"
    bench.write_text('{"turns": ["one"]}\n{"turns": ["two"]}\n')
    cfg = _eval_cfg(bench=bench, num_prompts=2)
    first = st.bench_questions(cfg)
    first[0]["turns"].append("changed by a caller")
    assert [q["turns"] for q in st.bench_questions(cfg)] == [["one"], ["two"]]
    assert len(reads) == 1
    bench.write_text('{"turns": ["uno"]}\n{"turns": ["dos"]}\n{"turns": ["tres"]}\n')
    assert [q["turns"] for q in st.bench_questions(cfg)] == [["uno"], ["dos"]]
    assert len(reads) == 2


def test_a_report_that_cannot_be_written_after_the_run_keeps_its_figures(
    tmp_path, monkeypatch, capsys
):
    """A write that fails after the run (a full disk, a folder removed meanwhile) was a
    traceback that lost the run's figures: the table is printed first, then one line names
    the file, with exit status 1."""
    import sys

    import decoding.eval as ev

    png = tmp_path / "r.png"

    def full(r, where):
        raise OSError(28, "No space left on device", str(where))

    monkeypatch.setattr(ev, "plot_report", full)
    argv = ["target=tiny_random", "num_prompts=1", "max_new_tokens=4", f"report={tmp_path}/r.json"]
    monkeypatch.setattr(sys, "argv", ["specdraft-eval", *argv])
    with pytest.raises(SystemExit) as stop:
        ev.main()
    assert stop.value.code == 1
    out, err = capsys.readouterr()
    assert "lossless" in out  # the table
    assert err.strip().splitlines()[-1] == (
        f"error: could not write {png} (No space left on device); the run's figures are the "
        "table above"
    )


def test_a_draft_folder_that_is_not_there_is_said_before_the_target_loads(
    tmp_path, monkeypatch, capsys
):
    """``draft=<a path>`` that is not there was said after the target had loaded (seconds
    for a real one, minutes for a large one): now before anything is evaluated."""
    import os
    import sys

    import decoding.eval as ev

    monkeypatch.setattr(ev, "evaluate", lambda cfg: pytest.fail("it loaded and evaluated"))
    for draft in ("/nonexistent/run", "./no-such-run", "~/no-such-run/final"):
        monkeypatch.setattr(sys, "argv", ["specdraft-eval", f"draft={draft}"])
        with pytest.raises(SystemExit) as stop:
            ev.main()
        assert stop.value.code == 2
        said = capsys.readouterr().err.strip().splitlines()
        named = os.path.expanduser(draft)  # the command line's ~ is the home folder
        assert said[-1] == f"error: draft={named}: no such folder", said
