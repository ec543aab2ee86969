"""Reasoning traces and tool calls: read, rendered by the target's own template (the tiny Qwen3
family's is Qwen3's, written for the tiny tokenizer), masked (the loss covers what the model
writes: reasoning where kept, text, tool calls; never tool results or tool schemas), trained on
and regenerated."""

from __future__ import annotations

import json

import pytest
from test_data import masked_spans

from data.chat import assistant_char_spans, prompt_ids, tokenize_conversation
from data.conversations import load_conversations, normalise_record
from models.tiny import build_tiny_tokenizer

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather of a city",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    }
]
REASONING = {
    "id": "r1",
    "messages": [
        {"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": "<think>\nadd them\n</think>\n\n4"},
        {"role": "user", "content": "and 3+3?"},
        {"role": "assistant", "content": "6", "reasoning_content": "add again"},
    ],
}
TOOL_CALL = {
    "id": "t1",
    "tools": TOOLS,
    "messages": [
        {"role": "user", "content": "Weather in Paris?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "c1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "content": '{"temp": 21}'},
        {"role": "assistant", "content": "It is 21 degrees."},
    ],
}


def masked(tok, record, reasoning="keep") -> list[str]:
    """The loss mask as the texts of its runs of masked tokens, token by token decoded."""
    msgs = normalise_record(record)
    enc = tokenize_conversation(tok, msgs, 4096, record.get("tools"), reasoning)
    return masked_spans(tok, enc["input_ids"], enc["loss_mask"])


def test_a_think_block_or_a_reasoning_field_is_kept_apart_from_the_answer():
    msgs = normalise_record(REASONING)
    assert msgs[1] == {"role": "assistant", "reasoning_content": "add them", "content": "4"}
    assert msgs[3] == {"role": "assistant", "reasoning_content": "add again", "content": "6"}


def test_the_mask_of_a_reasoning_record_follows_qwen3s_template_token_by_token():
    """keep: the last turn's think block is in the loss (the model writes it); the earlier
    turn's is dropped by the template, as Qwen3 drops it from history. drop: no reasoning
    anywhere, and the last turn's empty think block is the generation prompt's, not the
    model's."""
    tok = build_tiny_tokenizer("qwen3")
    assert masked(tok, REASONING, "keep") == [
        "4<|im_end|>",
        "<think>\nadd again\n</think>\n\n6<|im_end|>",
    ]
    assert masked(tok, REASONING, "drop") == ["4<|im_end|>", "6<|im_end|>"]
    text, _ = assistant_char_spans(tok, normalise_record(REASONING), reasoning="drop")
    assert "add" not in text and text.endswith("<think>\n\n</think>\n\n6<|im_end|>\n")


def test_a_template_without_reasoning_gets_the_trace_inline_as_the_model_wrote_it():
    tok = build_tiny_tokenizer()  # ChatML: no place for reasoning_content
    assert masked(tok, REASONING, "keep") == [
        "<think>\nadd them\n</think>\n\n4<|im_end|>",
        "<think>\nadd again\n</think>\n\n6<|im_end|>",
    ]
    assert masked(tok, REASONING, "drop") == ["4<|im_end|>", "6<|im_end|>"]


def test_the_mask_of_a_tool_call_record_covers_the_call_not_the_result_token_by_token():
    tok = build_tiny_tokenizer("qwen3")
    assert masked(tok, TOOL_CALL) == [
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
        "<|im_end|>",
        "<think>\n\n</think>\n\nIt is 21 degrees.<|im_end|>",
    ]
    text, _ = assistant_char_spans(tok, normalise_record(TOOL_CALL), TOOLS)
    assert '"description": "Weather of a city"' in text  # the schemas, in the system turn
    assert '<tool_response>\n{"temp": 21}\n</tool_response>' in text
    assert masked(tok, TOOL_CALL, "drop")[-1] == "It is 21 degrees.<|im_end|>"


def test_bad_tool_calls_are_rejected_by_reason():
    from data.conversations import _Reject

    bad = json.loads(json.dumps(TOOL_CALL))
    bad["messages"][1]["tool_calls"][0]["function"]["arguments"] = "{not json"
    with pytest.raises(_Reject) as e:
        normalise_record(bad)
    assert e.value.reason == "bad_tool_call"


def test_records_the_template_cannot_render_are_skipped_and_counted(tmp_path):
    """ChatML has no place for tool calls: such records are skipped, counted by reason, and
    the others train; the prompt of a tool record carries its schemas in Qwen3's template."""
    from data.dataset import prepare_tokenized

    p = tmp_path / "mixed.jsonl"
    p.write_text("\n".join(json.dumps(r) for r in [REASONING, TOOL_CALL, REASONING]) + "\n")
    tok = build_tiny_tokenizer()
    data = prepare_tokenized(
        str(p),
        tok,
        max_length=512,
        val_fraction=0.0,
        max_val_records=0,
        max_records=None,
        seed=0,
        cache_root=str(tmp_path / "cache"),
        log=lambda *_: None,
    )
    assert data.report.rejected == {"template_drops_tool_calls": 1}
    assert len(data.train) == 2 and data.report.kept == 2
    ids = prompt_ids(build_tiny_tokenizer("qwen3"), normalise_record(TOOL_CALL)[:1], TOOLS)
    assert "get_weather" in build_tiny_tokenizer().decode(ids)


def test_reasoning_and_tool_records_train_and_regenerate_on_a_qwen3_target(tmp_path):
    """A tiny Qwen3 target trains an EAGLE-3 head on reasoning and tool-call records with
    either reasoning mode, and ``specdraft-prepare`` rewrites them with its own replies:
    tools and tool turns kept (OpenAI shape), the replies in place of the originals, the
    file read back and trained on."""
    from conftest import compose, tiny_overrides
    from test_regenerate import _cfg

    from flow.regenerate import regenerate
    from trainer.train import run

    p = tmp_path / "agent.jsonl"
    p.write_text(
        "\n".join(
            json.dumps({**r, "id": f"{r['id']}-{i}"})
            for i in range(6)
            for r in (REASONING, TOOL_CALL)
        )
        + "\n"
    )
    fam = ["target.tiny_layers=4", "target.family=qwen3", "target.dtype=float32"]
    small = ["method=eagle3", "method.draft_vocab_size=64", "method.fuse_layers=[1,2,3]"]
    for mode in ("keep", "drop"):
        over = tiny_overrides(p, tmp_path / f"run-{mode}", **{"train.max_steps": 2})
        run(compose(over + fam + small + [f"data.reasoning={mode}", "data.val_fraction=0"]))
        assert (tmp_path / f"run-{mode}" / "final").exists()

    out = tmp_path / "regen.jsonl"
    # sampled (a random tiny Qwen3's greedy replies are all newlines, which reading rejects)
    over = {"target.family": "qwen3", "target.tiny_layers": 4, "temperature": 1.0}
    regenerate(_cfg(p, out, **over))
    recs = [json.loads(line) for line in out.read_text().splitlines()]
    tool = next(r for r in recs if r["id"].startswith("t1"))
    assert tool["tools"] == TOOLS
    roles = [m["role"] for m in tool["messages"]]
    assert roles == ["user", "assistant", "tool", "assistant"]
    assert tool["messages"][2]["content"] == '{"temp": 21}'
    assert tool["messages"][3]["content"] != "It is 21 degrees."  # the target's own reply
    convs, report = load_conversations(out)
    assert report.kept == len(recs)
    over = tiny_overrides(out, tmp_path / "run-regen", **{"train.max_steps": 2})
    run(compose(over + fam + small + ["data.val_fraction=0"]))
