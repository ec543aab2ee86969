"""Render conversations with the target's own chat template and mark the assistant tokens.

transformers' ``return_assistant_tokens_mask`` needs a ``{% generation %}`` block that most
templates (SmolLM2's ChatML among them) lack, and then silently returns an all-zero mask. We
find the assistant spans from the template itself instead: render the conversation up to
each assistant turn with ``add_generation_prompt=True`` and up to the end of that turn; the
characters in between are the reply as the model generates it (reasoning, text, tool calls and
the end-of-turn token; trailing whitespace excluded since generation stops at the end-of-turn
token). Character spans map to tokens through the fast tokenizer's offset mapping. Tool results
(``tool`` turns) are input, never in the loss.

Reasoning traces (``reasoning_content``, ``data/conversations.py``): ``reasoning=keep`` hands
them to the template (which may drop those of earlier turns, as Qwen3's does: the mask follows
what it renders); a template that has no place for them gets them inline as the model wrote
them (``<think>...</think>`` before the answer). ``reasoning=drop`` removes them and renders with
``enable_thinking=False`` (a thinking template's answer-only mode), as the target's own template
does for earlier turns.
"""

from __future__ import annotations

import os
from typing import Any

from .conversations import THINK_CLOSE, THINK_OPEN, DataError, Message

REASONING_MODES = ("keep", "drop")
_MARK = "\u2063specdraft\u2063"


class TemplateSkip(DataError):
    """A record the target's template cannot render as given; ``reason`` is counted."""

    def __init__(self, reason: str, detail: str = ""):
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason


def template_kwargs(reasoning: str) -> dict[str, Any]:
    if reasoning not in REASONING_MODES:
        raise DataError(f"data.reasoning={reasoning!r}: use keep or drop")
    return {"enable_thinking": False} if reasoning == "drop" else {}


def render(
    tokenizer: Any,
    messages: list[Message],
    add_generation_prompt: bool = False,
    tools: list[dict] | None = None,
    reasoning: str = "keep",
) -> str:
    kw = template_kwargs(reasoning)
    if tools:
        kw["tools"] = tools
    return tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=add_generation_prompt, **kw
    )


def _probe(tokenizer: Any, key: str) -> str:
    """What the template renders around a marker (cached per template)."""
    cache = _PROBES.setdefault(getattr(tokenizer, "chat_template", None) or "", {})
    if key not in cache:
        user = {"role": "user", "content": "q"}
        if key == "reasoning":
            msgs = [user, {"role": "assistant", "content": "a", "reasoning_content": _MARK}]
        else:  # the text after a reply: the end-of-turn marker
            msgs = [user, {"role": "assistant", "content": _MARK}]
        try:
            cache[key] = render(tokenizer, msgs)
        except Exception:  # noqa: BLE001 - a template that cannot render the probe
            cache[key] = ""
    return cache[key]


_PROBES: dict[str, dict[str, str]] = {}


def template_reads_reasoning(tokenizer: Any) -> bool:
    """Whether the template renders an assistant turn's ``reasoning_content`` (Qwen3's does,
    SmolLM2's ChatML does not)."""
    return _MARK in _probe(tokenizer, "reasoning")


def turn_end(tokenizer: Any) -> str | None:
    """The text the template puts after an assistant reply (``<|im_end|>``), None if none."""
    text = _probe(tokenizer, "end")
    if _MARK not in text:
        return None
    end = text.split(_MARK, 1)[1].rstrip()
    return end or None


def for_template(tokenizer: Any, messages: list[Message], reasoning: str) -> list[Message]:
    """The messages as the template should see them under ``reasoning`` (keep | drop).

    A reply whose text holds ``</think>`` (one that mentions the tag: reading already took any
    trace apart) gets an empty ``reasoning_content`` where the template reads that field, since
    a template that finds none splits the text at the tag itself (Qwen3's does), turning the
    words before it into a trace."""
    template_kwargs(reasoning)
    mentions = [m["role"] == "assistant" and THINK_CLOSE in m["content"] for m in messages]
    if not any("reasoning_content" in m for m in messages) and not any(mentions):
        return messages
    out = []
    reads = template_reads_reasoning(tokenizer)
    inline = reasoning == "keep" and not reads
    for m, mention in zip(messages, mentions, strict=True):
        r = m.get("reasoning_content")
        if r is None:
            out.append({**m, "reasoning_content": ""} if mention and reads else m)
            continue
        m = {k: v for k, v in m.items() if k != "reasoning_content"}
        if inline:
            m["content"] = f"{THINK_OPEN}\n{r}\n{THINK_CLOSE}\n\n{m['content']}"
        elif reasoning == "keep":
            m["reasoning_content"] = r
        elif mention and reads:
            m["reasoning_content"] = ""
        out.append(m)
    return out


def assistant_char_spans(
    tokenizer: Any,
    messages: list[Message],
    tools: list[dict] | None = None,
    reasoning: str = "keep",
) -> tuple[str, list[tuple[int, int]]]:
    """The rendered text and the ``[start, end)`` character span of every assistant reply.
    ``TemplateSkip`` where the template fails on the record, leaves out its tool calls or tool
    results, or renders a reply where it cannot be told apart from the turns around it
    (``reply_not_located``): a span never covers the text of another turn."""
    messages = for_template(tokenizer, messages, reasoning)

    def rend(ms, gen=False):
        try:
            return render(tokenizer, ms, gen, tools=tools, reasoning=reasoning)
        except DataError:
            raise
        except Exception as e:  # noqa: BLE001 - jinja's own errors (roles must alternate...)
            raise TemplateSkip("template_error", str(e).splitlines()[0][:200]) from None

    text = rend(messages)
    term = turn_end(tokenizer)
    spans: list[tuple[int, int]] = []
    # where the text of the user and tool turns so far ends: no reply starts before it (its
    # words may also be in the tool result before it). Not the system turn's: templates move
    # it (Mistral's into the last user turn).
    floor = 0
    for i, m in enumerate(messages):
        if m["role"] in ("user", "tool"):
            floor = _after(text, m["content"], floor)
        if m["role"] != "assistant":
            continue
        prev = spans[-1][1] if spans else 0
        before = rend(messages[:i], gen=True)
        through = rend(messages[: i + 1])
        # where the reply starts: after the generation prompt, or where the rendering of this
        # turn first differs from it (a thinking template's answer-only prompt ends in an
        # empty think block that a turn with tool calls and no reasoning does not have)
        start = len(os.path.commonprefix([before, text]))
        if start < len(before):  # diverged inside a word: back to the header's end
            while start > prev and not (text[start - 1].isspace() or text[start - 1] == ">"):
                start -= 1
        if start == 0 or (spans and start <= prev):
            # Templates that rewrite earlier turns (e.g. strip reasoning) are not prefix
            # stable; locate the reply itself after the previous span and the turns since.
            calls = [c["function"]["name"] for c in m.get("tool_calls", [])]
            key = next((s for s in [m["content"].strip(), *calls] if s), "")
            start = text.find(key, max(prev, floor)) if key else -1
            if start < 0:
                raise TemplateSkip("reply_not_located", "not rendered as written")
        if text.startswith(through) and len(through) > start:
            end = len(through)
        else:
            at = text.find(term, start) if term else -1
            if at < 0:
                raise DataError(
                    "the chat template's assistant turns have no end marker after the reply; "
                    "cannot build a loss mask"
                )
            end = at + len(term)
        while end > start and text[end - 1].isspace():
            end -= 1
        nxt = next(
            (n["content"].strip() for n in messages[i + 1 :] if n["role"] != "assistant"), ""
        )
        if nxt and text.find(nxt, max(prev, floor), start + len(nxt) - 1) >= 0:
            # the next turn's text starts before the reply: what was found is no reply of
            # this turn (its words in a later turn), and the mask would cover that turn
            raise TemplateSkip("reply_not_located", "found after the turn that follows it")
        floor = end
        for c in m.get("tool_calls", []):
            if c["function"]["name"] not in text[start:end]:
                raise TemplateSkip("template_drops_tool_calls", c["function"]["name"])
        spans.append((start, end))
    for m in messages:
        if m["role"] == "tool" and m["content"].strip() and m["content"].strip() not in text:
            raise TemplateSkip("template_drops_tool_results")
    return text, spans


def _after(text: str, content: str, start: int) -> int:
    """Where ``content`` (stripped) first ends in ``text`` from ``start``; ``start`` where it
    is not there (a template that rewrites the turn: the bound stays where it was; the check
    that the next turn does not start before a reply still holds)."""
    key = content.strip()
    at = text.find(key, start) if key else -1
    return at + len(key) if at >= 0 else start


def tokenize_conversation(
    tokenizer: Any,
    messages: list[Message],
    max_length: int,
    tools: list[dict] | None = None,
    reasoning: str = "keep",
) -> dict[str, list[int]]:
    """Token ids and a 0/1 loss mask (1 on assistant tokens), cut to ``max_length`` tokens."""
    text, spans = assistant_char_spans(tokenizer, messages, tools, reasoning)
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


def prompt_ids(
    tokenizer: Any,
    messages: list[Message],
    tools: list[dict] | None = None,
    reasoning: str = "keep",
) -> list[int]:
    """Token ids of a prompt ending in the generation prompt (what evaluation feeds; with
    ``reasoning=drop`` a thinking template's answer-only prompt)."""
    ms = for_template(tokenizer, messages, reasoning)
    text = render(tokenizer, ms, add_generation_prompt=True, tools=tools, reasoning=reasoning)
    return tokenizer(text, add_special_tokens=False)["input_ids"]
