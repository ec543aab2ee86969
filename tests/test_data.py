"""Data pipeline: record normalisation, bad-input accounting, assistant masks, split, batches."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import CONVERSATION

from data.chat import tokenize_conversation
from data.conversations import DataError, load_conversations, normalise_record
from data.dataset import Collator, LengthGroupedBatches, prepare_tokenized
from models.tiny import build_tiny_tokenizer


def masked_spans(tok, ids, mask):
    spans, cur = [], []
    for i, m in zip(ids, mask, strict=True):
        if m:
            cur.append(i)
        elif cur:
            spans.append(tok.decode(cur))
            cur = []
    if cur:
        spans.append(tok.decode(cur))
    return spans


# Golden ids of CONVERSATION under the tiny byte-level tokenizer (byte ids in ByteLevel alphabet
# order: "\n" = 198, " " = 220; 257 = <|im_start|>, 258 = <|im_end|>). Fixed so that a change in
# rendering or masking shows up as a diff here, not as a silently different loss.
TINY_GOLDEN_PREFIX = [257, 82, 88, 82, 83, 68, 76, 198, 56, 78, 84, 220, 64, 81, 68, 220, 64]


def test_assistant_mask_is_exactly_the_replies():
    tok = build_tiny_tokenizer()
    msgs = normalise_record({"conversations": CONVERSATION})
    enc = tokenize_conversation(tok, msgs, max_length=4096)
    assert enc["input_ids"][: len(TINY_GOLDEN_PREFIX)] == TINY_GOLDEN_PREFIX
    assert masked_spans(tok, enc["input_ids"], enc["loss_mask"]) == [
        "The capital of France is Paris.<|im_end|>",
        "Rome is the capital of Italy.<|im_end|>",
    ]
    # The ids are what the template renders, tokenised as a whole.
    text = tok.apply_chat_template(msgs, tokenize=False)
    assert enc["input_ids"] == tok(text, add_special_tokens=False)["input_ids"]
    # The default system turn is injected, as at evaluation time.
    assert "You are a tiny test model." in tok.decode(enc["input_ids"])


def test_mask_survives_truncation():
    tok = build_tiny_tokenizer()
    msgs = normalise_record({"conversations": CONVERSATION})
    full = tokenize_conversation(tok, msgs, max_length=4096)
    cut = tokenize_conversation(tok, msgs, max_length=120)
    assert len(cut["input_ids"]) == 120
    assert cut["loss_mask"] == full["loss_mask"][:120]


def test_roles_are_normalised_and_turns_merged():
    rec = {
        "messages": [
            {"role": "assistant", "content": "leading reply dropped"},
            {"role": "user", "content": "a"},
            {"role": "human", "content": "b"},
            {"role": "bard", "content": "c"},
            {"role": "user", "content": "trailing dropped"},
        ]
    }
    assert normalise_record(rec) == [
        {"role": "user", "content": "a\n\nb"},
        {"role": "assistant", "content": "c"},
    ]
    rec = {
        "conversations": [
            {"from": "system", "value": "s"},
            {"from": "human", "value": "q"},
            {"from": "chatgpt", "value": "r"},
        ]
    }
    assert [m["role"] for m in normalise_record(rec)] == ["system", "user", "assistant"]


BAD = [
    ("not_a_dict", [1, 2]),
    ("missing_field", {"id": "x"}),
    ("missing_field", {"conversations": [{"from": "human"}]}),
    ("bad_type", {"conversations": "hello"}),
    ("bad_type", {"conversations": [{"from": "human", "value": 3}]}),
    ("unknown_role", {"conversations": [{"from": "robot", "value": "hi"}]}),
    (
        "empty_text",
        {"conversations": [{"from": "human", "value": "  "}, {"from": "gpt", "value": "x"}]},
    ),
    ("no_assistant_turn", {"conversations": [{"from": "human", "value": "hi"}]}),
    (
        "late_system",
        {"messages": [{"role": "user", "content": "q"}, {"role": "system", "content": "s"}]},
    ),
]


def test_an_empty_turn_ends_the_conversation_and_keeps_the_turns_before_it():
    """A reply of white space only (a target's empty answer, an export's blank turn) dropped
    the whole conversation, its good earlier turns with it; an empty system message did too."""
    turns = [("system", ""), ("user", "q1"), ("assistant", "a1"), ("user", "q2")]
    turns += [("assistant", "  \n"), ("user", "q3"), ("assistant", "a3")]
    rec = {"messages": [{"role": r, "content": c} for r, c in turns]}
    assert normalise_record(rec) == [
        {"role": "user", "content": "q1"},
        {"role": "assistant", "content": "a1"},
    ]
    rec["messages"][0]["content"] = "be brief"
    assert [m["content"] for m in normalise_record(rec)] == ["be brief", "q1", "a1"]


def test_bad_records_are_counted_per_reason(tmp_path):
    p = tmp_path / "mixed.jsonl"
    good = {"id": "ok", "conversations": CONVERSATION}
    lines = [json.dumps(good)] + [json.dumps(r) for _, r in BAD] + ["{not json"]
    p.write_text("\n".join(lines) + "\n")
    convs, rep = load_conversations(p)
    assert [c.id for c in convs] == ["ok"]
    expected = {}
    for reason, _ in BAD:
        expected[reason] = expected.get(reason, 0) + 1
    expected["invalid_json"] = 1
    assert dict(rep.rejected) == expected
    assert rep.read == len(lines)
    assert rep.first_bad == (str(p), "line 2", "not_a_dict")


def test_file_with_nothing_usable_names_file_position_and_reason(tmp_path):
    p = tmp_path / "bad.jsonl"
    p.write_text(json.dumps({"id": 1}) + "\n" + json.dumps([1]) + "\n")
    with pytest.raises(DataError) as e:
        load_conversations(p)
    msg = str(e.value)
    assert str(p) in msg and "line 1" in msg and "missing_field" in msg


def test_skip_records_takes_a_later_slice_of_usable_records(tmp_path, data_file):
    every, _ = load_conversations(data_file)
    assert len(every) >= 8
    part, _ = load_conversations(data_file, max_records=3, skip_records=4)
    assert [c.id for c in part] == [c.id for c in every[4:7]]
    # bad records are not counted: the skip is over usable conversations
    p = tmp_path / "mixed.jsonl"
    rows = [{"id": "a", "conversations": CONVERSATION}, {"id": 1}]
    rows += [{"id": "b", "conversations": CONVERSATION}, {"id": "c", "conversations": CONVERSATION}]
    p.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    assert [c.id for c in load_conversations(p, skip_records=1)[0]] == ["b", "c"]
    with pytest.raises(DataError, match=r"after skipping the first 3 \(data.skip_records=5\)"):
        load_conversations(p, skip_records=5)
    with pytest.raises(DataError, match="data.skip_records=-1"):
        load_conversations(p, skip_records=-1)


def test_not_json_at_all(tmp_path):
    p = tmp_path / "notes.json"
    p.write_text("hello, this is text\n")
    with pytest.raises(DataError, match="notes.json: not JSON"):
        load_conversations(p)
    p.write_bytes(b"\xff\xfe\x00garbage")
    with pytest.raises(DataError, match="notes.json"):
        load_conversations(p)


def test_truncated_json_array_keeps_complete_records(tmp_path):
    recs = [{"id": str(i), "conversations": CONVERSATION} for i in range(3)]
    text = json.dumps(recs, indent=2)
    cut = text[: text.rfind('"id": "2"') + 5]  # cut inside the third record
    p = tmp_path / "cut.json"
    p.write_text(cut)
    convs, rep = load_conversations(p)
    assert [c.id for c in convs] == ["0", "1"]
    assert rep.truncated == [str(p)]
    line = cut[: cut.rfind("{")].count("\n") + 1  # where the cut record starts
    assert rep.cut_at == {str(p): f"record 2, line {line}, column 3"}
    assert f"ends mid-record (its last record, from record 2, line {line}" in rep.summary()


def test_folder_and_messages_format(tmp_path):
    (tmp_path / "a.jsonl").write_text(json.dumps({"id": "a", "conversations": CONVERSATION}) + "\n")
    sub = tmp_path / "sub"
    sub.mkdir()
    msgs = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]
    (sub / "b.json").write_text(json.dumps([{"id": "b", "messages": msgs}]))
    (tmp_path / "readme.txt").write_text("ignored")
    convs, rep = load_conversations(tmp_path)
    assert [c.id for c in convs] == ["a", "b"] and len(rep.files) == 2


def test_split_is_deterministic_and_disjoint(tmp_path, data_file):
    tok = build_tiny_tokenizer()
    kw = dict(max_length=512, val_fraction=0.2, max_val_records=100, max_records=None, seed=3)
    a = prepare_tokenized(str(data_file), tok, cache_root=str(tmp_path / "c1"), **kw)
    b = prepare_tokenized(str(data_file), tok, cache_root=str(tmp_path / "c2"), **kw)
    assert list(a.train["id"]) == list(b.train["id"]) and list(a.val["id"]) == list(b.val["id"])
    assert not set(a.train["id"]) & set(a.val["id"])
    assert len(a.train) + len(a.val) == 60 and len(a.val) > 0
    # Second call with the same settings reads the cache.
    c = prepare_tokenized(str(data_file), tok, cache_root=str(tmp_path / "c1"), **kw)
    assert c.cache_dir == a.cache_dir and list(c.val["id"]) == list(a.val["id"])


def test_no_conversation_is_trained_on_in_one_run_and_validated_in_another(tmp_path):
    """The split hashed each record's position: a conversation trained on in one slice of a
    dataset was validated in another slice, or in the regenerated answers to the same prompts
    (a later phase continuing the same weights measured text it had learnt); and validation
    records past max_val_records were trained on, where a run reading fewer validated them.
    Now: slices, another file order and a smaller cap put each conversation on one side."""
    from conftest import synthetic_conversations

    records = [{"id": f"c{i}", **r} for i, r in enumerate(synthetic_conversations(300))]
    whole = tmp_path / "all.jsonl"
    whole.write_text("".join(json.dumps(r) + "\n" for r in records))
    turned = tmp_path / "reversed.jsonl"  # e.g. a regeneration that wrote them in another order
    turned.write_text("".join(json.dumps(r) + "\n" for r in reversed(records)))
    tok = build_tiny_tokenizer()
    kw = dict(max_length=512, val_fraction=0.1, max_records=None, seed=1)
    runs = [
        prepare_tokenized(
            str(whole), tok, cache_root=str(tmp_path / "c"), max_val_records=50, **kw
        ),
        prepare_tokenized(
            str(whole),
            tok,
            cache_root=str(tmp_path / "c"),
            max_val_records=50,
            **{**kw, "max_records": 120},
        ),
        prepare_tokenized(
            str(whole),
            tok,
            cache_root=str(tmp_path / "c"),
            max_val_records=50,
            skip_records=100,
            **kw,
        ),
        prepare_tokenized(
            str(turned), tok, cache_root=str(tmp_path / "c"), max_val_records=5, **kw
        ),
    ]
    trained = set().union(*(set(r.train["id"]) for r in runs))
    validated = set().union(*(set(r.val["id"]) for r in runs))
    assert validated and not trained & validated
    small = runs[3]
    assert len(small.val) == 5 and small.held == len(validated) - 5 > 0
    assert len(small.train) + len(small.val) + small.held == 300


def test_length_grouped_batches_cover_each_sample_once_and_repeat_per_epoch():
    lengths = [(i * 37) % 101 + 1 for i in range(250)]
    s = LengthGroupedBatches(lengths, batch_size=8, seed=1, group=4)
    e0 = s.batches()
    assert sorted(i for b in e0 for i in b) == list(range(250))
    assert s.batches() == e0
    s.set_epoch(1)
    assert s.batches() != e0
    # grouped: within a batch lengths are close compared with a random batch
    spread = sum(max(lengths[i] for i in b) - min(lengths[i] for i in b) for b in e0) / len(e0)
    assert spread < 30


def test_collator_pads_with_attention_mask_not_token_identity():
    eos = 7
    samples = [
        {"input_ids": [1, 2, eos], "loss_mask": [0, 1, 1], "index": 0},
        {"input_ids": [3], "loss_mask": [1], "index": 5},
    ]
    b = Collator(pad_token_id=eos)(samples)
    assert b["input_ids"].tolist() == [[1, 2, eos], [3, eos, eos]]
    assert b["attention_mask"].tolist() == [[1, 1, 1], [1, 0, 0]]  # a real EOS stays attended
    assert b["loss_mask"].tolist() == [[0, 1, 1], [1, 0, 0]]
    assert b["index"].tolist() == [0, 5]
    f = Collator(0)(
        [
            {**samples[0], "features": torch.ones(3, 1, 2)},
            {**samples[1], "features": torch.ones(1, 1, 2)},
        ]
    )["features"]
    assert f.shape == (2, 3, 1, 2) and f[1, 1:].abs().sum() == 0


@pytest.mark.parametrize("world", [1, 2, 3])
def test_validation_batches_cover_every_conversation_once(world):
    from data.dataset import validation_batches

    lengths = [5, 900, 40, 40, 300, 7, 1200, 64, 8, 512, 3]
    shards = [validation_batches(lengths, 2, r, world, cap=512) for r in range(world)]
    seen = [i for s in shards for b in s for i in b]
    assert sorted(seen) == list(range(len(lengths)))  # all of them, none twice
    assert all(len(b) <= 2 for s in shards for b in s)
    capped = [min(n, 512) for n in lengths]
    for s in shards:  # longest first within each process
        flat = [capped[i] for b in s for i in b]
        assert flat == sorted(flat, reverse=True)
    assert shards == [validation_batches(lengths, 2, r, world, cap=512) for r in range(world)]


def test_a_later_slice_tokenises_and_its_cache_records_the_slice(tmp_path, data_file):
    from data.dataset import prepare_tokenized
    from models.tiny import build_tiny_tokenizer

    kw = dict(
        max_length=256,
        val_fraction=0.0,
        max_val_records=0,
        max_records=5,
        seed=0,
        cache_root=str(tmp_path / "cache"),
        log=lambda *_: None,
    )
    tok = build_tiny_tokenizer()
    first = prepare_tokenized(str(data_file), tok, **kw)
    later = prepare_tokenized(str(data_file), tok, skip_records=5, **kw)
    assert set(first.train["id"]).isdisjoint(later.train["id"]) and len(later.train) == 5
    done = json.loads((later.cache_dir / "done.json").read_text())
    assert done["key_extra"] == ["skip=5"]


def test_a_bad_record_inside_a_json_array_is_skipped_and_the_rest_is_read(tmp_path):
    """A record that does not parse in the middle of a .json array (a trailing comma) is
    skipped and counted, as a bad .jsonl line is; the records after it are read (before, the
    array ended there and the file was reported cut off). Where it is: line and column."""
    recs = [{"id": str(i), "conversations": CONVERSATION} for i in range(6)]
    text = json.dumps(recs, indent=1)
    bad = text.index('"id": "3"')
    text = text[:bad] + '"x": 1,}, {' + text[bad:]  # record 3 ends in a trailing comma
    p = tmp_path / "mid.json"
    p.write_text(text)
    convs, rep = load_conversations(p)
    assert [c.id for c in convs] == ["0", "1", "2", "3", "4", "5"]
    assert rep.rejected == {"invalid_json": 1} and rep.truncated == []
    f, pos, reason = rep.first_bad
    line = text[:bad].count("\n") + 1
    assert f == str(p) and pos.startswith(f"record 3 (line {line}, column ")
    assert "the first skipped: " in rep.summary() and f"line {line}" in rep.summary()
    # two records with no comma between them: one line naming where
    p.write_text(json.dumps(recs[:2]).replace('}, {"id": "1"', '} {"id": "1"'))
    with pytest.raises(DataError, match=r"expected ',' or '\]' after record 0, at line 1"):
        load_conversations(p)


def test_json_lines_in_a_file_named_json_and_a_byte_order_mark(tmp_path):
    """Records one after another in a .json file (JSON Lines under another name) are all read,
    not only the first; a UTF-8 byte-order mark costs no record, in either format."""
    lines = [json.dumps({"id": str(i), "conversations": CONVERSATION}) for i in range(4)]
    p = tmp_path / "lines.json"
    p.write_text("\n".join(lines) + "\n")
    assert [c.id for c in load_conversations(p)[0]] == ["0", "1", "2", "3"]
    p.write_text("\n".join(lines[:2] + ["{broken"] + lines[2:]) + "\n")
    convs, rep = load_conversations(p)  # one record a line: read as JSON Lines, line by line
    assert [c.id for c in convs] == ["0", "1", "2", "3"]
    assert rep.first_bad == (str(p), "line 3", "invalid_json")
    p.write_text(json.dumps(json.loads(lines[0]), indent=2) + json.dumps(json.loads(lines[1])))
    assert [c.id for c in load_conversations(p)[0]] == ["0", "1"]  # objects one after another
    for name in ("bom.jsonl", "bom.json"):
        q = tmp_path / name
        body = (
            "\n".join(lines)
            if name.endswith("jsonl")
            else json.dumps([json.loads(x) for x in lines])
        )
        q.write_bytes(b"\xef\xbb\xbf" + body.encode())
        convs, rep = load_conversations(q)
        assert len(convs) == 4 and not rep.rejected, name


def test_a_compressed_file_says_so(tmp_path):
    import gzip

    line = json.dumps({"id": "a", "conversations": CONVERSATION}) + "\n"
    for name in ("d.jsonl.gz", "d.json"):
        p = tmp_path / name
        p.write_bytes(gzip.compress(line.encode()))
        with pytest.raises(DataError, match=f"{name}: a gzip file; decompress it first"):
            load_conversations(p)
