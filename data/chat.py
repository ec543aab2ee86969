"""Render conversations with the target's own chat template and mark the assistant tokens.

transformers' ``return_assistant_tokens_mask`` needs a ``{% generation %}`` block that most
templates (SmolLM2's ChatML among them) lack, and then silently returns an all-zero mask. We
find the assistant spans from the template itself instead: render the conversation up to
each assistant turn with ``add_generation_prompt=True`` and up to the end of that turn; the
characters in between are the reply as the model generates it (text plus end-of-turn token,
trailing whitespace excluded since generation stops at the end-of-turn token). Character spans
map to tokens through the fast tokenizer's offset mapping.
"""

from __future__ import annotations

from typing import Any

from .conversations import DataError, Message


def render(tokenizer: Any, messages: list[Message], add_generation_prompt: bool = False) -> str:
    return tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=add_generation_prompt
    )


def assistant_char_spans(
    tokenizer: Any, messages: list[Message]
) -> tuple[str, list[tuple[int, int]]]:
    """The rendered text and the ``[start, end)`` character span of every assistant reply."""
    text = render(tokenizer, messages)
    spans: list[tuple[int, int]] = []
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        before = render(tokenizer, messages[:i], add_generation_prompt=True)
        through = render(tokenizer, messages[: i + 1])
        if text.startswith(before) and text.startswith(through) and len(through) > len(before):
            start, end = len(before), len(through)
        else:
            # Templates that rewrite earlier turns (e.g. strip reasoning) are not prefix
            # stable; fall back to locating the reply text itself after the previous span.
            start = text.find(m["content"], spans[-1][1] if spans else 0)
            if start < 0:
                raise DataError(
                    "the chat template does not reproduce assistant replies verbatim; "
                    "cannot build a loss mask"
                )
            end = start + len(m["content"])
            eos_end = text.find(">", end)  # include a directly following special token
            if text.startswith("<", end) and eos_end > 0:
                end = eos_end + 1
        while end > start and text[end - 1].isspace():
            end -= 1
        spans.append((start, end))
    return text, spans


def tokenize_conversation(
    tokenizer: Any, messages: list[Message], max_length: int
) -> dict[str, list[int]]:
    """Token ids and a 0/1 loss mask (1 on assistant tokens), cut to ``max_length`` tokens."""
    text, spans = assistant_char_spans(tokenizer, messages)
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    ids: list[int] = enc["input_ids"][:max_length]
    offsets = enc["offset_mapping"][: len(ids)]
    mask = [0] * len(ids)
    j = 0
    for t, (a, b) in enumerate(offsets):
        while j < len(spans) and spans[j][1] <= a:
            j += 1
        if j == len(spans):
            break
        s, e = spans[j]
        if b > a and a >= s and a < e:
            mask[t] = 1
    return {"input_ids": ids, "loss_mask": mask}


def prompt_ids(tokenizer: Any, messages: list[Message]) -> list[int]:
    """Token ids of a prompt ending in the generation prompt (what evaluation feeds)."""
    text = render(tokenizer, messages, add_generation_prompt=True)
    return tokenizer(text, add_special_tokens=False)["input_ids"]
