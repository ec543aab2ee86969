"""Input files as users have them: agent records whose replies also appear in tool results,
folders with subfolders and specdraft-prepare's side files, broken or odd JSON, other encodings
and compressions, reasoning fields and tags in the places exports put them."""

from __future__ import annotations

import json

import pytest
from conftest import CONVERSATION
from test_data import masked_spans

from data.chat import TemplateSkip, assistant_char_spans, tokenize_conversation
from data.conversations import (
    DataError,
    _Reject,
    data_files,
    load_conversations,
    normalise_record,
    split_reasoning,
)
from models.tiny import build_tiny_tokenizer

TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {}}}]
CALL = {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}
# an agent turn, a tool result that quotes the reply to come, a follow-up question: Qwen3's
# template drops the traces before the last user turn, so it is not prefix-stable here
AGENT_FOLLOWUP = {
    "id": "agent_followup",
    "tools": TOOLS,
    "messages": [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "reasoning_content": "tool", "tool_calls": [CALL]},
        {"role": "tool", "content": "Result: It is 21 degrees. Sunny."},
        {"role": "assistant", "content": "It is 21 degrees.", "reasoning_content": "read it"},
        {"role": "user", "content": "Thanks! And tomorrow?"},
        {"role": "assistant", "content": "I cannot tell.", "reasoning_content": "no data"},
    ],
}


def rec(i: object, **extra) -> dict:
    return {"id": i, "conversations": CONVERSATION, **extra} if i is not None else extra


def lines(*records: dict) -> str:
    return "".join(json.dumps(r) + "\n" for r in records)


def ids(path) -> list[str]:
    return [c.id for c in load_conversations(path)[0]]


# 1. the loss mask


@pytest.mark.parametrize("reasoning", ["keep", "drop"])
def test_a_reply_quoted_by_the_tool_result_before_it_is_masked_where_the_assistant_says_it(
    reasoning,
):
    """The mask covers the assistant's reply, never the tool result that holds the same text
    (before, Qwen3's non-prefix-stable rendering sent the search into the tool response)."""
    tok = build_tiny_tokenizer("qwen3")
    msgs = normalise_record(AGENT_FOLLOWUP)
    enc = tokenize_conversation(tok, msgs, 4096, TOOLS, reasoning)
    spans = masked_spans(tok, enc["input_ids"], enc["loss_mask"])
    assert not any("Sunny" in s or "tool_response" in s for s in spans)
    assert spans[0].startswith("<tool_call>") and spans[0].endswith("</tool_call><|im_end|>")
    assert spans[1] == "It is 21 degrees.<|im_end|>"
    assert spans[2].endswith("I cannot tell.<|im_end|>") and len(spans) == 3


def test_every_masked_character_is_inside_an_assistant_turn():
    """Whatever the record, each span lies between an assistant header and its end marker."""
    tok = build_tiny_tokenizer("qwen3")
    for reasoning in ("keep", "drop"):
        text, spans = assistant_char_spans(tok, normalise_record(AGENT_FOLLOWUP), TOOLS, reasoning)
        for s, e in spans:
            head = text.rfind("<|im_start|>", 0, s)
            assert text.startswith("<|im_start|>assistant\n", head), text[head:e]
            assert "<|im_start|>" not in text[s:e]


def test_a_reply_the_template_does_not_render_as_written_is_skipped_not_mislabelled():
    """A template that rewrites earlier replies (here: "It is 21" -> "Now 21"), where the
    reply's words are in the tool result before it or in the user turn after it: the record is
    a counted skip, never a mask on the other turn."""
    tok = build_tiny_tokenizer("qwen3")
    tok.chat_template = tok.chat_template.replace(
        "{{- '<|im_start|>' + message.role + '\n' + content }}",
        "{{- '<|im_start|>' + message.role + '\n' + content|replace('It is 21', 'Now 21') }}",
    )
    assert "Now 21" in tok.chat_template, "the tiny Qwen3 template changed: update this test"
    later = json.loads(json.dumps(AGENT_FOLLOWUP))
    later["messages"][2]["content"] = "Sunny."
    later["messages"][4]["content"] = "You said It is 21 degrees. And tomorrow?"
    for record in (AGENT_FOLLOWUP, later):
        with pytest.raises(TemplateSkip) as e:
            assistant_char_spans(tok, normalise_record(record), TOOLS, "keep")
        assert e.value.reason == "reply_not_located"


def test_turns_that_repeat_each_others_words_keep_every_reply_masked():
    """The checks that keep a mask off other turns do not skip records whose turns share words
    (a reply that holds the next question, a question that repeats the last one)."""
    record = {
        "messages": [
            {"role": "user", "content": "Say yes"},
            {"role": "assistant", "content": "yes", "reasoning_content": "easy"},
            {"role": "user", "content": "yes"},
            {"role": "assistant", "content": "Say yes again? yes", "reasoning_content": "ok"},
            {"role": "user", "content": "Say yes"},
            {"role": "assistant", "content": "yes"},
        ]
    }
    msgs = normalise_record(record)
    for family in ("llama", "qwen3"):
        tok = build_tiny_tokenizer(family)
        for reasoning in ("keep", "drop"):
            enc = tokenize_conversation(tok, msgs, 4096, reasoning=reasoning)
            spans = masked_spans(tok, enc["input_ids"], enc["loss_mask"])
            ends = ["yes<|im_end|>", "Say yes again? yes<|im_end|>", "yes<|im_end|>"]
            assert len(spans) == 3, (family, reasoning, spans)
            assert all(s.endswith(e) for s, e in zip(spans, ends, strict=True)), spans


# 2. ids


def test_records_without_an_id_get_one_unique_across_subfolders_and_stable(tmp_path):
    for sub in ("a", "b"):
        (tmp_path / sub).mkdir()
        (tmp_path / sub / "train.jsonl").write_text(lines(rec(None, conversations=CONVERSATION)))
    got = ids(tmp_path)
    assert got == ["a/train.jsonl:line 1", "b/train.jsonl:line 1"]
    assert ids(tmp_path) == got
    assert ids(tmp_path / "a" / "train.jsonl") == ["train.jsonl:line 1"]  # a file: its name


def test_duplicate_ids_are_kept_made_unique_and_counted(tmp_path):
    p = tmp_path / "dup.jsonl"
    p.write_text(lines(rec("x"), rec("y"), rec("x"), rec("x#2"), rec("x")))
    convs, report = load_conversations(p)
    assert [c.id for c in convs] == ["x", "y", "x#2", "x#2#2", "x#3"]
    assert report.renamed_ids == 3
    assert "3 duplicate id(s) made unique (the first: x -> x#2)" in report.summary()
    # a later slice names them as the whole file does
    assert [c.id for c in load_conversations(p, skip_records=2)[0]] == ["x#2", "x#2#2", "x#3"]


# 3. folders


def test_a_folder_skips_prepares_side_files_and_hidden_files(tmp_path):
    """specdraft-prepare writes out.jsonl.meta.json and out.jsonl.parts/ (rank files, settings,
    counts) beside its output: a folder holding them reads the output once."""
    (tmp_path / "regen.jsonl").write_text(lines(rec("r")))
    (tmp_path / "regen.jsonl.meta.json").write_text(json.dumps({"settings": {}, "records": 1}))
    parts = tmp_path / "regen.jsonl.parts"
    parts.mkdir()
    (parts / "rank0-of-1.jsonl").write_text(lines(rec("r")))
    (parts / "settings.json").write_text(json.dumps({"settings": {}}))
    (parts / "counts-rank0-of-1.json").write_text(json.dumps({"dropped": 0}))
    (tmp_path / ".hidden.jsonl").write_text(lines(rec("h")))
    (tmp_path / ".git").mkdir()
    (tmp_path / ".git" / "x.json").write_text(json.dumps(rec("g")))
    assert data_files(tmp_path) == [tmp_path / "regen.jsonl"]
    assert ids(tmp_path) == ["r"]
    # named directly, a file is read whatever its name
    assert data_files(parts / "rank0-of-1.jsonl") == [parts / "rank0-of-1.jsonl"]


def test_an_empty_file_in_a_folder_is_skipped_with_a_note_but_alone_is_an_error(tmp_path):
    (tmp_path / "good.jsonl").write_text(lines(rec("a")))
    (tmp_path / "empty.json").write_text("")
    (tmp_path / "blank.jsonl").write_text("\n \n")
    convs, report = load_conversations(tmp_path)
    assert [c.id for c in convs] == ["a"]
    assert report.empty == [str(tmp_path / "blank.jsonl"), str(tmp_path / "empty.json")]
    assert "2 empty file(s) skipped" in report.summary()
    for name in ("empty.json", "blank.jsonl"):
        with pytest.raises(DataError, match=f"{name}: the file is empty"):
            load_conversations(tmp_path / name)


# 4. a broken record inside an array


def test_a_record_missing_its_brace_in_an_array_costs_that_record_only(tmp_path):
    good = [json.dumps(rec(k)) for k in "abcd"]
    broken = good[1][:-1]  # record b lost its closing brace
    p = tmp_path / "arr.json"
    p.write_text("[\n" + ",\n".join([good[0], broken, good[2], good[3]]) + "\n]\n")
    convs, report = load_conversations(p)
    assert [c.id for c in convs] == ["a", "c", "d"]
    assert report.rejected == {"invalid_json": 1} and report.truncated == []
    assert report.first_bad[1].startswith("record 1 (line 3")
    # leading commas, pretty-printed records: the same
    p.write_text("[\n" + "\n,".join([good[0], broken, good[2], good[3]]) + "\n]\n")
    assert ids(p) == ["a", "c", "d"]
    pretty = json.dumps([rec(k) for k in "abcd"], indent=2)
    cut = pretty.index('"id": "c"')
    at = pretty.rindex("}", 0, cut)  # the brace that closes record b
    p.write_text(pretty[:at] + pretty[at + 1 :])
    assert ids(p) == ["a", "c", "d"]


def test_a_record_missing_its_brace_in_a_one_line_array_is_one_error_naming_it(tmp_path):
    """Where records share a line there is no telling where the next one starts: one line
    naming the record, not a silent loss of every record after it."""
    good = [json.dumps(rec(k)) for k in "abc"]
    p = tmp_path / "one.json"
    p.write_text("[" + ", ".join([good[0], good[1][:-1], good[2]]) + "]")
    with pytest.raises(DataError, match=r"one.json: record 1 at line 1, column \d+ does not end"):
        load_conversations(p)


# 5. encodings


def test_bytes_that_are_not_utf8_reject_the_record_in_json_as_in_jsonl(tmp_path):
    good, bad = json.dumps(rec("a")), json.dumps(rec("b")).replace("France", "Fran\udce7e")
    body = [
        good.encode(),
        bad.encode("utf-8", "surrogateescape"),
        good.replace('"a"', '"c"').encode(),
    ]
    p = tmp_path / "latin1.json"
    p.write_bytes(b"[\n" + b",\n".join(body) + b"\n]\n")
    convs, report = load_conversations(p)
    assert [c.id for c in convs] == ["a", "c"]
    assert report.rejected == {"invalid_json": 1}
    assert report.first_bad[1].startswith("record 1 (line 3, column ")
    assert report.first_bad[1].endswith("not UTF-8)")
    q = tmp_path / "latin1.jsonl"
    q.write_bytes(b"\n".join(body) + b"\n")
    convs, report = load_conversations(q)
    assert [c.id for c in convs] == ["a", "c"] and report.rejected == {"invalid_json": 1}
    assert report.first_bad[1].startswith("line 2 (") and "not UTF-8" in report.first_bad[1]
    q = tmp_path / "lines.json"  # JSON Lines under another name, the bad line first
    q.write_bytes(b"\n".join(body[1:]) + b"\n")
    convs, report = load_conversations(q)
    assert [c.id for c in convs] == ["c"] and report.first_bad[1].startswith("line 1 (")
    one = tmp_path / "one.json"
    one.write_bytes(body[1])
    with pytest.raises(DataError, match=r"one.json: record 0 at line 1, column \d+ .*not UTF-8"):
        load_conversations(one)


# 6. reasoning fields


def test_the_first_non_empty_reasoning_field_is_taken_and_an_inline_trace_kept():
    def assistant(**turn) -> dict:
        r = {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", **turn}]}
        return normalise_record(r)[1]

    got = assistant(content="a", reasoning_content=None, reasoning="trace")
    assert got == {"role": "assistant", "reasoning_content": "trace", "content": "a"}
    got = assistant(content="a", reasoning_content="", reasoning="trace")
    assert got["reasoning_content"] == "trace"
    got = assistant(content="<think>\ninline\n</think>\n\na", reasoning_content="")
    assert got == {"role": "assistant", "reasoning_content": "inline", "content": "a"}
    got = assistant(content="<think>\ninline\n</think>\n\na", reasoning_content="field")
    assert got["reasoning_content"] == "field" and got["content"] == "a"
    with pytest.raises(_Reject, match="bad_type"):
        assistant(content="a", reasoning_content="", reasoning=3)


# 7. a closing tag in a reply


def test_a_reply_that_mentions_the_closing_tag_is_left_as_written():
    """Only a ``</think>`` on a line of its own (as a template that opened the block writes it)
    ends a leading trace; one inside a sentence is reply text."""
    for text in ("The tag </think> closes it.", "Write </think>\nafter the trace.", "a</think>"):
        assert split_reasoning(text) == (None, text)
    assert split_reasoning("trace\n</think>\n\nanswer") == ("trace", "answer")
    assert split_reasoning("</think>\n\nanswer") == ("", "answer")
    r = {"messages": [{"role": "user", "content": "q"}]}
    r["messages"].append({"role": "assistant", "content": "The tag </think> closes it."})
    assert normalise_record(r)[1] == {"role": "assistant", "content": "The tag </think> closes it."}
    tok = build_tiny_tokenizer("qwen3")
    for reasoning in ("keep", "drop"):
        enc = tokenize_conversation(tok, normalise_record(r), 4096, reasoning=reasoning)
        spans = masked_spans(tok, enc["input_ids"], enc["loss_mask"])
        assert spans[-1].endswith("The tag </think> closes it.<|im_end|>"), spans


# 8. tool_calls: []


def test_an_empty_tool_calls_list_is_no_tool_call():
    r = {
        "messages": [
            {"role": "user", "content": "hi", "tool_calls": []},
            {"role": "assistant", "content": "hello", "tool_calls": []},
        ]
    }
    assert normalise_record(r) == [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "hello"},
    ]
    for bad in ({}, "", [{}]):
        r["messages"][1]["tool_calls"] = bad
        with pytest.raises(_Reject, match="bad_tool_call"):
            normalise_record(r)


# 9. other shapes


def test_pretty_printed_records_one_after_another_in_a_json_file(tmp_path):
    """What ``jq . x.jsonl > x.json`` writes: every record read, a broken one skipped."""
    recs = [rec(str(i)) for i in range(4)]
    p = tmp_path / "pretty.json"
    p.write_text("".join(json.dumps(r, indent=2) + "\n" for r in recs))
    assert ids(p) == ["0", "1", "2", "3"]
    broken = json.dumps(recs[1], indent=2)
    broken = broken[: broken.rindex("}")]  # record 1 lost its closing brace
    p.write_text(
        "\n".join(
            [json.dumps(recs[0], indent=2), broken] + [json.dumps(r, indent=2) for r in recs[2:]]
        )
        + "\n"
    )
    convs, report = load_conversations(p)
    assert [c.id for c in convs] == ["0", "2", "3"] and report.rejected == {"invalid_json": 1}


@pytest.mark.parametrize(
    "kind, tool",
    [("bzip2", "bunzip2 -k"), ("xz", "unxz -k"), ("zstd", "unzstd"), ("gzip", "gunzip -k")],
)
def test_a_compressed_file_of_any_common_kind_says_so(tmp_path, kind, tool):
    import bz2
    import gzip
    import lzma

    body = lines(rec("a")).encode()
    data = {
        "bzip2": lambda: bz2.compress(body),
        "xz": lambda: lzma.compress(body),
        "gzip": lambda: gzip.compress(body),
        "zstd": lambda: b"\x28\xb5\x2f\xfd" + b"\x00" * 16,  # the frame's magic number
    }[kind]()
    for name in ("d.jsonl", "d.json"):
        p = tmp_path / name
        p.write_bytes(data)
        with pytest.raises(DataError, match=f"{name}: a {kind} file; decompress it first ") as e:
            load_conversations(p)
        assert f"({tool} " in str(e.value)
