"""specdraft-prepare and specdraft-disco on bad input: one line naming the setting or file,
nothing written; counts and settings that hold across resumes."""

from __future__ import annotations

import json
import math

import pytest
from conftest import compose_prepare, run_module

from data.conversations import DataError, load_conversations
from decoding.disco import DiscoError, read_traces
from models.base import SIGNAL_NAMES


def _cfg(data_file, out, **extra):
    extra = {"max_new_tokens": 4, "data.max_records": 4, **extra}
    return compose_prepare(data_file, out, **extra)


@pytest.mark.parametrize(
    "setting,said",
    [
        ({"top_k": -1}, "top_k=-1: must be >= 0"),
        ({"data.max_records": 0}, "data.max_records=0: must be >= 1"),
        ({"data.max_length": 0}, "data.max_length=0: must be >= 8"),
        ({"+engine_args.tensor_parallel_size": 2}, "engine=torch; use engine=vllm"),
    ],
)
def test_bad_settings_are_refused_before_anything_is_written(tmp_path, data_file, setting, said):
    """top_k=-1 failed in a traceback once the target had loaded; data.max_records=0 (or -1)
    regenerated one conversation; data.max_length=0 wrote an empty file; engine_args with the
    built-in engine were ignored."""
    from flow.regenerate import PrepareError, regenerate

    out = tmp_path / "regen.jsonl"
    with pytest.raises(PrepareError, match=said):
        regenerate(_cfg(data_file, out, **setting))
    assert list(tmp_path.iterdir()) == []


def test_max_records_below_one_is_refused_when_reading(data_file):
    with pytest.raises(DataError, match=r"data.max_records=0: must be >= 1"):
        load_conversations(data_file, max_records=0)
    with pytest.raises(DataError, match=r"data.max_records=-3: must be >= 1"):
        load_conversations(data_file, max_records=-3)


def test_an_out_under_a_file_is_one_line(tmp_path, data_file):
    """``out=<a file>/x.jsonl`` failed with NotADirectoryError's traceback."""
    blocker = tmp_path / "notes.txt"
    blocker.write_text("keep\n")
    r = run_module(
        "flow.regenerate",
        ["target=tiny_random", f"data.path={data_file}", f"out={blocker}/regen.jsonl"],
    )
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert r.stderr.strip().splitlines() == [
        f"error: out={blocker}/regen.jsonl: {blocker} is a file, not a folder"
    ]
    assert blocker.read_text() == "keep\n"


def test_an_out_nothing_can_be_written_in_is_one_line(data_file):
    """``out=`` in a folder that takes no file failed with a traceback after the target and
    the data were loaded; now one line before either is."""
    r = run_module(
        "flow.regenerate", ["target=tiny_random", f"data.path={data_file}", "out=/proc/x.jsonl"]
    )
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert r.stderr.strip().splitlines() == [
        "error: out=/proc/x.jsonl: nothing can be written in /proc (No such file or directory)"
    ]


def _write(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))


def _convs(n, word):
    return [
        {
            "conversations": [
                {"from": "human", "value": f"{word} {i}?"},
                {"from": "gpt", "value": f"{word} {i}."},
            ]
        }
        for i in range(n)
    ]


def test_a_relative_data_path_is_the_file_it_names(tmp_path, monkeypatch):
    """The settings kept the data path as typed: the same command run from another folder
    continued the output with another file's conversations (their ids, ``train.jsonl:line 1``,
    were the same), and the same file given by its whole path was refused. Another file of the
    same name is refused by its content: the conversations answered are not its."""
    from flow.regenerate import PrepareError, regenerate

    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir(), b.mkdir()
    _write(a / "train.jsonl", _convs(4, "apple"))
    _write(b / "train.jsonl", _convs(4, "river"))
    out = tmp_path / "regen.jsonl"
    monkeypatch.chdir(a)
    regenerate(_cfg("train.jsonl", out, **{"data.max_records": 2}))
    # the same file, named by its whole path: the same run, continued
    meta = regenerate(_cfg(a / "train.jsonl", out, **{"data.max_records": 3}))
    assert meta["records"] == 3
    written = out.read_text()
    monkeypatch.chdir(b)
    with pytest.raises(
        PrepareError, match=r"b/train.jsonl: conversation train.jsonl:line 1 is not"
    ):
        regenerate(_cfg("train.jsonl", out, **{"data.max_records": 4}))
    assert out.read_text() == written and "apple 2?" in written


def _carried(tmp_path, n_first: int = 3):
    """An output of the first ``n_first`` of 6 conversations, copied without its parts to
    another folder (as carried to another machine), its replies marked so that one written
    again shows; the input copied to another folder under the same name."""
    import shutil

    from flow.regenerate import regenerate

    (tmp_path / "a").mkdir(), (tmp_path / "c").mkdir(), (tmp_path / "next").mkdir()
    _write(tmp_path / "a" / "train.jsonl", _convs(6, "apple"))
    first = regenerate(
        _cfg(tmp_path / "a" / "train.jsonl", tmp_path / "r.jsonl", **{"data.max_records": 3})
    )
    out = tmp_path / "next" / "r.jsonl"
    recs = [json.loads(x) for x in (tmp_path / "r.jsonl").read_text().splitlines()]
    for r in recs:
        r["conversations"][1]["value"] = "CARRIED"
    _write(out, recs)
    shutil.copy(tmp_path / "r.jsonl.meta.json", tmp_path / "next" / "r.jsonl.meta.json")
    shutil.copy(tmp_path / "a" / "train.jsonl", tmp_path / "c" / "train.jsonl")
    return first, out, tmp_path / "c" / "train.jsonl"


def test_an_output_carried_without_its_parts_continues_where_it_stopped(tmp_path):
    """Carried to another machine without its parts folder (``gpu_train.sh``'s REGEN_FROM
    copies the output and its .meta.json), the output was written again from the start, and
    an input at another path (a bundle unpacked elsewhere) was refused by its path."""
    from flow.regenerate import regenerate

    first, out, moved = _carried(tmp_path)
    meta = regenerate(_cfg(moved, out, **{"data.max_records": 6}))
    replies = [json.loads(x)["conversations"][1]["value"] for x in out.read_text().splitlines()]
    assert replies[:3] == ["CARRIED"] * 3 and "CARRIED" not in replies[3:] and len(replies) == 6
    # the counts are the whole output's: the carried conversations' from the index
    assert meta["records"] == 6 and meta["reply_tokens"] == 2 * first["reply_tokens"] > 0
    assert len(json.loads((out.parent / "r.jsonl.meta.json").read_text())["index"]) == 6


def test_a_carried_output_with_a_damaged_line_is_named(tmp_path):
    from flow.regenerate import PrepareError, regenerate

    _, out, moved = _carried(tmp_path)
    lines = out.read_text().splitlines(keepends=True)
    out.write_text(lines[0] + lines[1][:20] + "\n" + lines[2])
    with pytest.raises(PrepareError, match=rf"out={out}: line 2 is not JSON \("):
        regenerate(_cfg(moved, out, **{"data.max_records": 6}))
    # the line removed: its conversation is written again, the others copied
    out.write_text(lines[0] + lines[2])
    regenerate(_cfg(moved, out, **{"data.max_records": 6}))
    replies = [json.loads(x)["conversations"][1]["value"] for x in out.read_text().splitlines()]
    assert replies[0] == replies[2] == "CARRIED" != replies[1] and len(replies) == 6


@pytest.mark.parametrize("change", ["edited", "another"])
def test_a_carried_output_is_not_continued_from_another_input(tmp_path, change):
    """An input whose conversation changed since, or one sharing no conversation with the
    output: one line naming it, and nothing copied or written."""
    from flow.regenerate import PrepareError, regenerate

    _, out, moved = _carried(tmp_path)
    if change == "edited":
        convs = _convs(6, "apple")
        convs[1]["conversations"][0]["value"] = "pear 1?"
        _write(moved, convs)
        said = rf"{moved}: conversation train.jsonl:line 2 is not the one answered in {out} "
    else:
        moved = moved.with_name("other.jsonl")
        _write(moved, _convs(6, "apple"))
        said = rf"out={out} holds 3 conversations of another input: none of them is in data"
    before = out.read_text()
    with pytest.raises(PrepareError, match=said):
        regenerate(_cfg(moved, out, **{"data.max_records": 6}))
    assert out.read_text() == before
    parts = list((out.parent / "r.jsonl.parts").glob("rank*.jsonl"))
    assert all(p.read_text() == "" for p in parts)


def test_counts_are_those_of_the_records_written(tmp_path, data_file):
    """Resumed with a smaller data.max_records, the output held 2 conversations and the meta
    file counted the replies of the 4 the first run wrote."""
    from flow.regenerate import regenerate

    out = tmp_path / "regen.jsonl"
    first = regenerate(_cfg(data_file, out))
    again = regenerate(_cfg(data_file, out, **{"data.max_records": 2}))
    recs = [json.loads(line) for line in out.read_text().splitlines()]
    replies = sum(t["from"] == "gpt" for r in recs for t in r["conversations"])
    assert again["records"] == len(recs) == 2 and first["records"] == 4
    assert again["replies"] == replies < first["replies"]
    assert again["reply_tokens"] == 4 * replies  # cut at max_new_tokens=4 (no end token)
    meta = json.loads((tmp_path / "regen.jsonl.meta.json").read_text())
    assert meta["replies"] == replies and all("_counts" not in r for r in recs)


def test_a_counts_file_cut_by_a_stop_does_not_stop_the_resume(tmp_path, data_file):
    """The per-process counts were rewritten in place after each conversation: a stop in the
    middle of that write left a file that the resumed run failed to read (a traceback)."""
    from flow.regenerate import regenerate

    out = tmp_path / "regen.jsonl"
    full = regenerate(_cfg(data_file, out))
    whole = out.read_text()
    parts = tmp_path / "regen.jsonl.parts"
    part = parts / "rank0-of-1.jsonl"
    part.write_text("".join(part.read_text().splitlines(keepends=True)[:2]))
    (parts / "counts-rank0-of-1.json").write_text('{"replies": ')
    out.unlink()
    again = regenerate(_cfg(data_file, out))
    assert out.read_text() == whole
    assert {k: again[k] for k in ("records", "replies", "reply_tokens")} == {
        k: full[k] for k in ("records", "replies", "reply_tokens")
    }


def test_a_finished_output_is_not_replaced_under_other_settings(tmp_path, data_file):
    """With the parts folder removed once merged, a rerun under other settings regenerated
    everything and replaced the output without a word."""
    import shutil

    from flow.regenerate import PrepareError, regenerate

    out = tmp_path / "regen.jsonl"
    regenerate(_cfg(data_file, out))
    written = out.read_text()
    shutil.rmtree(tmp_path / "regen.jsonl.parts")
    with pytest.raises(PrepareError, match=r"regen.jsonl: it was generated with temperature=0.0"):
        regenerate(_cfg(data_file, out, temperature=0.7))
    assert out.read_text() == written
    assert regenerate(_cfg(data_file, out))["records"] == 4  # the same settings: redone
    assert out.read_text() == written


# ---------------------------------------------------------------------------------------------
# specdraft-disco

META = {"meta": {"draft": "x", "c": 0.1, "signal_names": list(SIGNAL_NAMES)}}


def _rows(n=40):
    import random

    rng = random.Random(0)
    return [
        {
            "signals": [[rng.random() for _ in SIGNAL_NAMES] for _ in range(3)],
            "accepted": rng.randint(0, 3),
            "drafted": 3,
        }
        for _ in range(n)
    ]


def _traces(path, meta, rows, extra=()):
    lines = [json.dumps(meta), *(json.dumps(r) for r in rows), *extra]
    path.write_text("\n".join(lines) + "\n")
    return path


@pytest.mark.parametrize(
    "line,said",
    [
        ('{"signals": 5, "accepted": 0, "drafted": 1}', "'signals' must hold 1 rows"),
        (
            '{"signals": [[0.1,0.1,0.1,0.1,0.1,0.1,0.1]], "accepted": "1", "drafted": 1}',
            "accepted='1'",
        ),
        (
            '{"signals": [[0.1,0.1,0.1,0.1,0.1,0.1,0.1]], "accepted": 0.5, "drafted": 1}',
            "accepted=0.5",
        ),
        (
            '{"signals": [[NaN,0.1,0.1,0.1,0.1,0.1,0.1]], "accepted": 0, "drafted": 1}',
            "'signals' must be finite numbers",
        ),
        (
            '{"signals": [["a","b","c","d","e","f","g"]], "accepted": 0, "drafted": 1}',
            "'signals' must be finite numbers",
        ),
        ("[1, 2]", r"not a JSON object of a traces file \(\[1, 2\]\)"),
    ],
)
def test_bad_trace_rows_are_named(tmp_path, line, said):
    """Each of these was a TypeError's traceback, or (NaN, a fraction of a token) a classifier
    trained and saved on it without a word: a NaN signal makes every prediction NaN."""
    p = _traces(tmp_path / "t.jsonl", META, _rows(), [line])
    with pytest.raises(DiscoError, match=r"t.jsonl:42: " + said):
        read_traces(p)


def test_a_meta_that_is_not_an_object_and_bytes_not_utf8_are_named(tmp_path):
    p = _traces(tmp_path / "t.jsonl", {"meta": 5}, _rows())
    with pytest.raises(DiscoError, match=r"t.jsonl:1: not a JSON object"):
        read_traces(p)
    p.write_bytes(json.dumps(META).encode() + b"\n\xff\n")
    with pytest.raises(DiscoError, match=r"t.jsonl: byte \d+ is not UTF-8"):
        read_traces(p)


def test_a_draft_cost_that_is_no_number_is_one_line(tmp_path):
    p = _traces(tmp_path / "t.jsonl", {"meta": {**META["meta"], "c": "0.1"}}, _rows())
    r = run_module("decoding.disco", [str(p), "--out", str(tmp_path / "d")])
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert r.stderr.strip().splitlines() == ["error: draft cost c='0.1': must be a number >= 0"]
    assert not (tmp_path / "d").exists()


def test_traces_that_name_no_draft_need_out(tmp_path):
    """Without a draft in the meta line, the classifier went to ./disco (the current folder's)
    and the command then failed with a KeyError's traceback."""
    meta = {"meta": {k: v for k, v in META["meta"].items() if k != "draft"}}
    p = _traces(tmp_path / "t.jsonl", meta, _rows())
    work = tmp_path / "work"
    work.mkdir()
    import subprocess
    import sys

    from conftest import ROOT

    r = subprocess.run(
        [sys.executable, "-m", "decoding.disco", str(p)],
        cwd=work,
        env={**__import__("os").environ, "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    assert "the traced draft None is not a folder here; pass --out" in r.stderr
    assert list(work.iterdir()) == []
    r = run_module("decoding.disco", [str(p), "--out", str(tmp_path / "d"), "--epochs", "5"])
    assert r.returncode == 0 and "Traceback" not in r.stderr, r.stderr
    assert "draft=<draft> stop=disco" in r.stdout and (tmp_path / "d" / "config.json").is_file()


def test_out_with_a_tilde_is_the_home_folder(tmp_path, monkeypatch):
    """``--out=~/d`` (no shell expands a ``~`` after ``=``) wrote a folder named ``~``."""
    from decoding import disco

    p = _traces(tmp_path / "t.jsonl", META, _rows())
    home, work = tmp_path / "home", tmp_path / "work"
    home.mkdir(), work.mkdir()
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.chdir(work)
    disco.main([str(p), "--out=~/d", "--epochs", "5"])
    assert (home / "d" / "config.json").is_file() and list(work.iterdir()) == []
    cfg = json.loads((home / "d" / "config.json").read_text())
    assert math.isfinite(cfg["disco"]["threshold"])


def test_a_resume_after_the_input_changed_is_refused(tmp_path):
    """Records without ids are named by their line: after an edit of the input (a record
    removed, a prompt changed), a resume matched answers to other prompts without a word."""
    from flow.regenerate import PrepareError, regenerate

    src = tmp_path / "in.jsonl"
    rows = [
        {
            "conversations": [
                {"from": "human", "value": f"question {k}"},
                {"from": "gpt", "value": "a"},
            ]
        }
        for k in range(3)
    ]
    _write(src, rows)
    out = tmp_path / "regen.jsonl"
    regenerate(_cfg(src, out))
    regenerate(_cfg(src, out))  # the same input: nothing left to do, nothing refused
    _write(src, rows[1:])  # the first removed: every later line is renamed
    with pytest.raises(PrepareError, match=r"in.jsonl:line 1 is not the one answered in .*input"):
        regenerate(_cfg(src, out))
    recs = [json.loads(line) for line in out.read_text().splitlines()]
    assert all(set(r) == {"id", "conversations"} for r in recs)  # the digest stays in the parts
