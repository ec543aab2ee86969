"""specdraft-prepare: the target's own replies, resumable, refusing mixed settings."""

from __future__ import annotations

import json
import re

import pytest
import torch
from conftest import compose_prepare, run_module

from data.chat import prompt_ids
from data.conversations import load_conversations


def _cfg(data_file, out, **extra):
    extra = {"max_new_tokens": 12, "data.max_records": 10, **extra}
    return compose_prepare(data_file, out, **extra)


def test_replies_are_the_targets_greedy_answers(tmp_path, data_file, tiny_target, capsys):
    from flow.regenerate import regenerate

    out = tmp_path / "regen.jsonl"
    meta = regenerate(_cfg(data_file, out, max_turns=1))
    # where the loop's time went, said once it has written the replies
    said = re.search(
        r"decoding: ([\d,]+) tokens \(stop tokens included\) in .* forwards ([\d]+)%",
        capsys.readouterr().out,
    )
    # the replies' tokens and each reply's stop token where it stopped before its budget
    decoded = int(said[1].replace(",", "")) if said else -1
    assert meta["reply_tokens"] <= decoded <= meta["reply_tokens"] + meta["replies"]
    assert int(said[2]) > 0
    src, _ = load_conversations(data_file, 10)
    got = [json.loads(line) for line in out.read_text().splitlines()]
    assert meta["records"] == len(got) == 10
    assert [g["id"] for g in got] == [c.id for c in src]
    tok = tiny_target.tokenizer
    # all 10: prompts of different lengths are prefilled in groups and put back in order
    for s, g in zip(src, got, strict=True):
        turns = g["conversations"]
        # one regenerated reply (max_turns=1) after the user's turn, which is kept verbatim
        assert [t["from"] for t in turns] == ["human", "gpt"]
        assert turns[0]["value"] == s.messages[0]["content"]
        p = torch.tensor([prompt_ids(tok, s.messages[:1])])
        ref = tiny_target.model.generate(
            p, do_sample=False, max_new_tokens=12, pad_token_id=tiny_target.pad_token_id
        )[0, p.shape[1] :].tolist()
        eos = tok.eos_token_id
        ref = ref[: ref.index(eos)] if eos in ref else ref
        assert turns[1]["value"] == tok.decode(ref, skip_special_tokens=True)


def test_resume_after_a_crash_gives_the_same_file(tmp_path, data_file):
    from flow.regenerate import regenerate

    full = tmp_path / "full.jsonl"
    regenerate(_cfg(data_file, full, temperature=1.0))
    out = tmp_path / "cut.jsonl"
    regenerate(_cfg(data_file, out, temperature=1.0))
    # simulate a crash: the part keeps one finished batch and half a line, no merged file
    part = tmp_path / "cut.jsonl.parts" / "rank0-of-1.jsonl"
    lines = part.read_bytes().splitlines(keepends=True)
    part.write_bytes(b"".join(lines[:4]) + lines[4][:10])
    out.unlink()
    regenerate(_cfg(data_file, out, temperature=1.0))
    assert out.read_text() == full.read_text()
    meta = json.loads((tmp_path / "cut.jsonl.meta.json").read_text())
    assert meta["records"] == 10


def test_different_settings_are_refused_naming_the_setting(tmp_path, data_file):
    out = tmp_path / "r.jsonl"
    common = [
        "target=tiny_random",
        f"data.path={data_file}",
        f"out={out}",
        "batch_size=4",
        "data.max_records=4",
        "progress=false",
    ]
    r = run_module("flow.regenerate", common + ["max_new_tokens=8"])
    assert r.returncode == 0, r.stderr
    r = run_module("flow.regenerate", common + ["max_new_tokens=9"])
    assert r.returncode == 2
    err = r.stderr.strip().splitlines()
    assert len(err) == 1 and "max_new_tokens=8" in err[0] and "max_new_tokens=9" in err[0]
    r = run_module("flow.regenerate", common + ["max_new_tokens=0"])
    assert r.returncode == 2 and "max_new_tokens=0" in r.stderr
    # another slice of the source into the same output: refused, naming the setting
    r = run_module("flow.regenerate", common + ["max_new_tokens=8", "data.skip_records=2"])
    assert r.returncode == 2 and "skip_records=0" in r.stderr and "skip_records=2" in r.stderr


def test_skip_records_regenerates_a_later_slice(tmp_path, data_file):
    from flow.regenerate import regenerate

    out = tmp_path / "later.jsonl"
    regenerate(_cfg(data_file, out, max_turns=1, **{"data.max_records": 3, "data.skip_records": 5}))
    src, _ = load_conversations(data_file, 8)
    got = [json.loads(line)["id"] for line in out.read_text().splitlines()]
    assert got == [c.id for c in src[5:8]]


def test_output_trains(tmp_path, data_file):
    """The regenerated file is ordinary training data."""
    from conftest import compose, tiny_overrides

    from flow.regenerate import regenerate
    from trainer.train import run

    out = tmp_path / "regen.jsonl"
    regenerate(_cfg(data_file, out, max_new_tokens=24, temperature=1.0, **{"data.max_records": 40}))
    s = run(compose(tiny_overrides(out, tmp_path / "run", **{"train.max_steps": 3})))
    assert s["step"] == 3


def test_outputs_written_before_skip_records_existed_still_resume(tmp_path):
    from flow.regenerate import PrepareError, _check_settings

    meta = tmp_path / "regen.jsonl.parts" / "meta.json"
    meta.parent.mkdir()
    meta.write_text(json.dumps({"settings": {"max_new_tokens": 8, "source": "a.jsonl"}}))
    (meta.parent / "rank0-of-1.jsonl").write_text('{"id": "a"}\n')  # replies written
    _check_settings(meta, {"max_new_tokens": 8, "source": "a.jsonl", "skip_records": 0})
    with pytest.raises(PrepareError, match="skip_records=0, now skip_records=2"):
        _check_settings(meta, {"max_new_tokens": 8, "source": "a.jsonl", "skip_records": 2})


def test_later_turns_become_one_turn_prompts_that_load(tmp_path):
    """scripts/later_turns.py: user turns 2..max_turn with a reply, long enough to stand
    alone, each a conversation of its own that the loader (and so specdraft-prepare) reads."""
    import subprocess
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
    from later_turns import later_turns

    def conv(*turns):
        roles = ["human", "gpt"]
        return [{"from": roles[i % 2], "value": t} for i, t in enumerate(turns)]

    long = "please explain how a hash map resolves collisions, with an example"
    src = tmp_path / "in.jsonl"
    recs = [
        {"id": "a", "conversations": conv("first question here", "r1", long, "r2", "ok", "r3")},
        {"id": "b", "conversations": conv("only one turn", "r1")},
        {"id": "c", "conversations": conv("q1", "r1", "short", "r2", long + "?", "r3", long)},
    ]
    src.write_text("\n".join(json.dumps(r) for r in recs) + "\n")
    msgs = [
        {"role": "user" if i % 2 == 0 else "assistant", "content": t}
        for i, t in enumerate(["q1", "r1", long, "r2", long, "r3", long, "r4"])
    ]
    assert [t for t, _, _ in later_turns(msgs, 40, 4)] == [2, 3, 4]
    assert [t for t, _, _ in later_turns(msgs, 40, 3)] == [2, 3]
    assert later_turns(msgs, 1000, 4) == []
    out = tmp_path / "later.jsonl"
    script = Path(__file__).resolve().parents[1] / "scripts" / "later_turns.py"
    r = subprocess.run(
        [sys.executable, str(script), "--data", str(src), "--out", str(out)],
        capture_output=True,
        text=True,
    )
    assert r.returncode == 0, r.stderr
    got = [json.loads(x) for x in out.read_text().splitlines()]
    # a's "ok" is too short; c's last user turn has no reply
    assert [g["id"] for g in got] == ["a:turn2", "c:turn3"]
    assert got[0]["conversations"][0]["value"] == long
    convs, _ = load_conversations(out)
    assert [c.messages[0]["content"] for c in convs] == [long, long + "?"]
    # an existing output is never overwritten
    r = subprocess.run(
        [sys.executable, str(script), "--data", str(src), "--out", str(out)],
        capture_output=True,
        text=True,
    )
    assert r.returncode != 0 and "exists" in r.stderr


def test_max_minutes_stops_starting_conversations_and_the_same_command_continues(
    tmp_path, data_file, capsys
):
    """A time budget: once it is spent no conversation starts, what is done is merged and
    counted (``not_reached``), and the same command without the budget finishes the file as
    one uninterrupted run writes it."""
    from flow.regenerate import regenerate

    full = tmp_path / "full.jsonl"
    regenerate(_cfg(data_file, full, max_turns=1))
    out = tmp_path / "budget.jsonl"
    meta = regenerate(_cfg(data_file, out, max_turns=1, max_minutes=1e-9))
    assert (meta["records"], meta["not_reached"], meta["dropped"]) == (0, 10, 0)
    assert "10 conversations not reached; the same command continues" in capsys.readouterr().out
    meta = regenerate(_cfg(data_file, out, max_turns=1))
    assert (meta["records"], meta["not_reached"]) == (10, 0)
    assert out.read_text() == full.read_text()
    with pytest.raises(Exception, match="max_minutes=0"):
        regenerate(_cfg(data_file, tmp_path / "x.jsonl", max_minutes=0))


def test_the_loops_account_splits_its_wall_time():
    """``loop_account``: tokens/s, the batch's mean rows and each share of the wall time, the
    rest (the host's work between forwards) also in ms a forward."""
    from decoding.stats import BatchStats
    from flow.regenerate import loop_account

    st = BatchStats()
    st.wall, st.forwards, st.row_slots = 10.0, 1000, 400_000
    st.rows.new_tokens, st.rows.t_target, st.rows.t_prefill = 380_000, 6.0, 1.5
    assert loop_account(st) == (
        "decoding: 380,000 tokens (stop tokens included) in 10.0 s (38,000 tokens/s), 1,000 "
        "forwards of 400 "
        "rows on average; forwards 60%, prefills 15%, the rest 25% (2.50 ms a forward)"
    )


def test_generate_many_should_stop_lets_rows_in_flight_finish(tiny_target):
    """``should_stop``: checked before each batch starts; once True the waiting requests never
    start, and the rows already generating run to their end."""
    from models.target import GenRequest, generate_many

    reqs = [GenRequest((i,), [257, 72 + i]) for i in range(6)]
    done: list = []

    def on_done(key, reply, truncated):
        done.append((key, len(reply)))
        return ()

    generate_many(
        tiny_target.model,
        reqs,
        8,
        set(),
        tiny_target.pad_token_id,
        on_done,
        batch_size=2,
        should_stop=lambda: len(done) >= 1,
    )
    # two rows started together; after the first finished nothing else joined
    assert sorted(k for k, _ in done) == [(0,), (1,)]
    assert all(n == 8 for _, n in done)


@pytest.mark.parametrize("joins", [True, False], ids=["batched", "cannot_join"])
def test_a_sliding_window_target_is_regenerated_with_its_greedy_answers(
    tmp_path, data_file, monkeypatch, joins
):
    """A target with sliding-window layers (a 16-column window, prompts longer than it): the
    batched decoder serves it (its rows' caches keep every column and the window is applied
    by the mask), and where a target's cache cannot join rows into a running batch,
    specdraft-prepare generates on transformers' own continuous batching (``generate_many``:
    one padded batch, refilled when it has finished). Either way the replies are the target's
    greedy answers."""
    import transformers as tr

    import flow.regenerate as fr
    from decoding.batch_checks import BatchError, check_batchable
    from decoding.decoder import NoDraft
    from models.target import Target, TargetConfig
    from models.tiny import build_tiny_tokenizer

    tok = build_tiny_tokenizer()
    cfg = tr.MistralConfig(
        vocab_size=len(tok),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=4096,
        sliding_window=16,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
        attn_implementation="sdpa",
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = tr.MistralForCausalLM(cfg).eval()
    target = Target(model, tok, "tiny-sliding", TargetConfig(name="test"))
    check_batchable(target, NoDraft())  # served by the batched decoder
    if not joins:

        def refuse(*_):
            raise BatchError("this model has LinearAttentionLayer; use batch_size=1")

        monkeypatch.setattr(fr, "check_batchable", refuse)
    monkeypatch.setattr(fr, "load_target", lambda c: target)
    out = tmp_path / "regen.jsonl"
    meta = fr.regenerate(_cfg(data_file, out, max_turns=1, **{"data.max_records": 4}))
    src, _ = load_conversations(data_file, 4)
    got = [json.loads(line) for line in out.read_text().splitlines()]
    assert meta["records"] == len(got) == 4
    for s, g in zip(src, got, strict=True):
        p = torch.tensor([prompt_ids(tok, s.messages[:1])])
        ref = model.generate(p, do_sample=False, max_new_tokens=12, pad_token_id=tok.pad_token_id)[
            0, p.shape[1] :
        ].tolist()
        ref = ref[: ref.index(tok.eos_token_id)] if tok.eos_token_id in ref else ref
        assert g["conversations"][1]["value"] == tok.decode(ref, skip_special_tokens=True)


def test_a_finished_run_resumed_loads_no_weights(tmp_path, data_file, tiny_target, monkeypatch):
    """A target from a folder is described (tokenizer, identity) before its weights load, and
    they load only where something is left to write: resumed once finished, the command
    answers with the same file without loading them; with a conversation left, it loads."""
    import flow.regenerate as regen
    from models.target import target_folder

    extra = {"target": "hf", "target.path": str(target_folder(tiny_target))}
    out = tmp_path / "regen.jsonl"
    first = regen.regenerate(_cfg(data_file, out, max_turns=1, **extra))
    written = out.read_text()
    loads = []

    def load(cfg):
        loads.append(cfg.path)
        raise RuntimeError("weights loaded")

    monkeypatch.setattr(regen, "load_target", load)
    again = regen.regenerate(_cfg(data_file, out, max_turns=1, **extra))
    assert out.read_text() == written and again["records"] == first["records"] == 10
    assert loads == []
    part = tmp_path / "regen.jsonl.parts" / "rank0-of-1.jsonl"
    *kept, left = part.read_text().splitlines(keepends=True)
    part.write_text("".join(kept))  # one left: in neither the part nor the output
    gone = json.loads(left)["id"]
    out.write_text("".join(x for x in written.splitlines(keepends=True) if gone not in x))
    with pytest.raises(RuntimeError, match="weights loaded"):
        regen.regenerate(_cfg(data_file, out, max_turns=1, **extra))
    assert len(loads) == 1


def test_prepare_without_out_is_one_line(data_file):
    r = run_module("flow.regenerate", ["target=tiny_random", f"data.path={data_file}"])
    assert r.returncode == 2
    assert r.stderr.strip().splitlines() == [
        "error: out=<file.jsonl> is required: where the target's answers are written"
    ]


def test_an_out_that_is_not_preparess_own_is_refused_before_anything_runs(tmp_path, data_file):
    """``out=`` naming a file that prepare did not write (no ``.meta.json`` beside it) was
    overwritten; a folder failed after the whole regeneration, in a traceback. Both are one
    line now, first, and the file is left as it was; prepare's own finished output resumes."""
    keep = tmp_path / "precious.jsonl"
    keep.write_text("precious\n")
    folder = tmp_path / "outdir"
    folder.mkdir()
    args = ["target=tiny_random", f"data.path={data_file}", "data.max_records=2", "progress=false"]
    r = run_module("flow.regenerate", [*args, f"out={keep}", "max_new_tokens=4"])
    assert r.returncode == 2 and keep.read_text() == "precious\n"
    assert r.stderr.strip().splitlines() == [
        f"error: out={keep} exists and is no output of specdraft-prepare (no precious.jsonl"
        ".meta.json beside it); choose another path, or remove the file"
    ]
    assert not (tmp_path / "precious.jsonl.parts").exists()
    r = run_module("flow.regenerate", [*args, f"out={folder}", "max_new_tokens=4"])
    assert r.returncode == 2 and "is a folder; name a file in it" in r.stderr.strip()
    assert len(r.stderr.strip().splitlines()) == 1 and not (tmp_path / "outdir.parts").exists()
    ours = tmp_path / "ours.jsonl"
    for _ in range(2):  # written, then resumed finished: its own file is no stranger
        r = run_module("flow.regenerate", [*args, f"out={ours}", "max_new_tokens=4"])
        assert r.returncode == 0, r.stderr
    assert len(ours.read_text().splitlines()) == 2


@pytest.mark.parametrize("sig", ["SIGINT", "SIGTERM"])
def test_ctrl_c_keeps_the_replies_and_says_how_to_continue(tmp_path, data_file, sig):
    """SIGINT (Ctrl-C) or a scheduler's SIGTERM part way: one line saying where the replies
    are and that the same command goes on (it was a traceback; SIGTERM ended it silently), exit
    128 + the signal; the same command then writes the file an uninterrupted run writes."""
    import os
    import signal
    import subprocess
    import sys
    import time

    from conftest import ROOT

    args = [
        "target=tiny_random",
        f"data.path={data_file}",
        "data.max_records=60",
        "max_new_tokens=48",
        "batch_size=2",
        "batch_admit=1",
        "progress=false",
    ]
    out = tmp_path / "int.jsonl"
    part = tmp_path / "int.jsonl.parts" / "rank0-of-1.jsonl"
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    p = subprocess.Popen(
        [sys.executable, "-m", "flow.regenerate", *args, f"out={out}"],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        # SIGINT at its default whatever this process inherited (a background job of a
        # script starts with it ignored, and the command leaves it so)
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    deadline = time.time() + 240
    while time.time() < deadline and p.poll() is None:
        if part.exists() and part.read_text().count("\n") >= 2:
            break
        time.sleep(0.05)
    assert p.poll() is None, "finished before it could be interrupted: give it more work"
    p.send_signal(getattr(signal, sig))
    _, err = p.communicate(timeout=120)
    assert p.returncode == 128 + getattr(signal, sig), err[-2000:]
    lines = [x for x in err.splitlines() if x.strip()]
    assert lines[-1] == (
        f"stopped: the replies written so far are kept in {out}.parts; the same command "
        "continues from them"
    ), err[-2000:]
    assert "Traceback" not in err and not out.exists()
    if sig == "SIGTERM":
        return  # the same stop; the continuation is checked once
    r = run_module("flow.regenerate", [*args, f"out={out}"], timeout=600)
    assert r.returncode == 0, r.stderr
    full = tmp_path / "full.jsonl"
    r = run_module("flow.regenerate", [*args, f"out={full}"], timeout=600)
    assert r.returncode == 0, r.stderr
    assert out.read_text() == full.read_text()


def test_an_out_inside_the_input_folder_is_refused(tmp_path, data_file):
    """The next run (the documented way to continue) would read the output, and its parts,
    as more input."""
    folder = tmp_path / "data"
    folder.mkdir()
    (folder / "conv.jsonl").write_text(data_file.read_text())
    out = folder / "sub" / "regen.jsonl"
    r = run_module("flow.regenerate", ["target=tiny_random", f"data.path={folder}", f"out={out}"])
    assert r.returncode == 2 and not out.parent.exists()
    assert r.stderr.strip().splitlines() == [
        f"error: out={out} is inside data.path={folder}: the next run would read its output as "
        "input; choose a path outside that folder"
    ]


def test_a_prompt_the_template_refuses_stops_its_conversation_counted(tmp_path, data_file):
    """A template that refuses a conversation (Gemma's and Mistral's refuse a system turn or
    roles that do not alternate) stops that conversation, counted, as training skips such a
    record; the others are regenerated. A run stopped before any reply binds no settings."""
    from types import SimpleNamespace

    from flow.regenerate import _check_settings, _Conversations, _first_prompt_len
    from models.tiny import build_tiny_tokenizer

    tok = build_tiny_tokenizer()
    tok.chat_template = (
        "{% if messages[0].role == 'system' %}{{ raise_exception('System role not supported') }}"
        "{% endif %}" + tok.chat_template
    )
    convs, _ = load_conversations(data_file, max_records=2)
    sys_turn = {"role": "system", "content": "be brief"}
    convs[1].messages.insert(0, sys_turn)
    assert _first_prompt_len(tok, convs[1]) == 0 and _first_prompt_len(tok, convs[0]) > 0
    cfg = _cfg(data_file, tmp_path / "o.jsonl")
    work = _Conversations(SimpleNamespace(tokenizer=tok), list(enumerate(convs)), cfg)
    assert work.next_request(0) is not None and work.next_request(1) is None
    rec, n = work.record(1)
    assert rec == {"id": convs[1].id, "dropped": True} and n["stopped_template"] == 1
    # settings of a run that wrote nothing are replaced, not held against the next
    meta = tmp_path / "o.jsonl.parts" / "settings.json"
    _check_settings(meta, {"max_new_tokens": 4})
    _check_settings(meta, {"max_new_tokens": 5})
    (meta.parent / "rank0-of-1.jsonl").write_text('{"id": "x"}\n')
    with pytest.raises(ValueError, match="max_new_tokens=5"):
        _check_settings(meta, {"max_new_tokens": 6})


def test_a_moved_target_continues_its_regeneration(tmp_path):
    """The target's folder renamed (the same weights) is the same target; other weights are
    not."""
    from flow.regenerate import PrepareError, _check_settings

    meta = tmp_path / "regen.jsonl.parts" / "settings.json"
    _check_settings(meta, {"target": "/a/mymodel:86dd61b9ed35"})
    (meta.parent / "rank0-of-1.jsonl").write_text('{"id": "a"}\n')
    _check_settings(meta, {"target": "/b/renamed:86dd61b9ed35"})
    with pytest.raises(PrepareError, match="target="):
        _check_settings(meta, {"target": "/b/renamed:0123456789ab"})


@pytest.mark.parametrize("reply", ["  \n", "<think>\nonly a plan\n</think>\n\n"])
def test_a_reply_with_no_answer_is_counted_empty(tmp_path, reply):
    """A reply of white space, or of a reasoning trace with nothing after ``</think>``, is a
    turn with no text (training ends the conversation there); the reasoning-only reply was not
    counted."""
    from types import SimpleNamespace

    from flow.regenerate import _Conversations
    from models.tiny import build_tiny_tokenizer

    f = tmp_path / "one.jsonl"
    turns = [{"from": "human", "value": "a question"}, {"from": "gpt", "value": "an answer"}]
    f.write_text(json.dumps({"id": "c0", "conversations": turns}) + "\n")
    convs, _ = load_conversations(str(f))
    tok = build_tiny_tokenizer()
    counts = []
    for text in ("an answer", reply):
        work = _Conversations(SimpleNamespace(tokenizer=tok), list(enumerate(convs)), _cfg(f, "o"))
        work.take_reply(work.next_request(0).key, tok.encode(text), False)
        counts.append(work.record(0)[1]["empty_replies"])
    assert counts == [0, 1]
