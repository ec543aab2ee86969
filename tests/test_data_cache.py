"""The tokenised-data cache is reused only for the same bytes and the same tokenizer, and a
data set with nothing to train on says why."""

from __future__ import annotations

import json
import os

import pytest

from data.conversations import DataError
from data.dataset import prepare_tokenized, tokenizer_fingerprint
from models.tiny import build_tiny_tokenizer

KW = dict(max_length=512, val_fraction=0.0, max_val_records=0, max_records=None, seed=0)


def _conv(i: int, reply: str = "fine") -> str:
    msgs = [{"from": "human", "value": f"question {i}"}, {"from": "gpt", "value": reply}]
    return json.dumps({"id": f"c{i}", "conversations": msgs}) + "\n"


def test_an_edit_that_keeps_size_and_time_is_tokenised_again(tmp_path):
    """``cp -p``, ``tar`` and ``rsync -t`` keep a file's time through an edit: the cache is
    keyed by the bytes."""
    f = tmp_path / "d.jsonl"
    f.write_text("".join(_conv(i, "good") for i in range(4)))
    st = f.stat()
    tok = build_tiny_tokenizer()
    a = prepare_tokenized(str(f), tok, cache_root=str(tmp_path / "c"), **KW)
    f.write_text("".join(_conv(i, "evil") for i in range(4)))  # same size
    os.utime(f, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert f.stat().st_size == st.st_size
    b = prepare_tokenized(str(f), tok, cache_root=str(tmp_path / "c"), **KW)
    assert b.cache_dir != a.cache_dir and b.source != a.source
    assert list(b.train["input_ids"]) != list(a.train["input_ids"])


def test_a_tokenizer_that_splits_text_otherwise_is_another_cache_key():
    """Same vocabulary and template, another normaliser: other ids for the same text."""
    from tokenizers import normalizers

    a, b = build_tiny_tokenizer(), build_tiny_tokenizer()
    assert tokenizer_fingerprint(a) == tokenizer_fingerprint(b)
    b.backend_tokenizer.normalizer = normalizers.Lowercase()
    assert a("HELLO")["input_ids"] != b("HELLO")["input_ids"]
    assert tokenizer_fingerprint(a) != tokenizer_fingerprint(b)
    # what calls leave behind (truncation, padding) is not part of it
    b2 = build_tiny_tokenizer()
    b2("x " * 50, truncation=True, max_length=8)
    assert tokenizer_fingerprint(b2) == tokenizer_fingerprint(a)


def test_no_record_within_max_length_is_one_line_not_a_traceback(tmp_path):
    f = tmp_path / "long.jsonl"
    f.write_text(_conv(0).replace("question 0", "word " * 400))
    with pytest.raises(DataError) as e:
        prepare_tokenized(
            str(f),
            build_tiny_tokenizer(),
            cache_root=str(tmp_path / "c"),
            **{**KW, "max_length": 40},
        )
    assert str(e.value) == (
        f"{f}: no conversation left to train on (1 with no assistant token within "
        "data.max_length=40)"
    )


def test_nothing_to_train_names_the_template_not_max_length(tmp_path):
    """Every record skipped because the template drops tool calls: the error says so, not
    that nothing fitted in max_length."""
    call = {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "P"}}}
    msgs = [
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "content": "21 degrees"},
        {"role": "assistant", "content": "It is 21 degrees."},
    ]
    f = tmp_path / "tools.jsonl"
    f.write_text(json.dumps({"id": "t", "messages": msgs}) + "\n")
    with pytest.raises(DataError) as e:
        prepare_tokenized(str(f), build_tiny_tokenizer(), cache_root=str(tmp_path / "c"), **KW)
    assert str(e.value).startswith(f"{f}: no conversation left to train on (skipped template_")
    assert "max_length" not in str(e.value)
