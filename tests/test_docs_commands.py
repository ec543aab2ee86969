"""The command lines the documentation shows still run as shown, and its links land: a setting
renamed or removed in the code, or a section retitled, breaks the docs here, not on a user's
machine.

Read: README.md, docs/*.md and the shipped drafts' READMEs (CHANGELOG.md records what each
version did, in its words of the day, and is left out). Each fenced block's lines (a ``\\`` at a
line's end joins the next) and each inline code span that holds a ``key=value``; within them
every command of the package, as its console script (``specdraft-eval ...``) or its module
(``python -m decoding.eval ...``, ``accelerate launch ... -m flow ...``), and every
``scripts/...`` file run by ``python`` or ``bash``. What is checked:

- ``specdraft-train``, ``-eval``, ``-prepare``: the overrides compose against the command's typed
  config, with the refusal the command itself would print (``conf.cli.check_command_line``);
- ``specdraft-export``, ``-disco`` and the Python scripts: the flags parse (nothing runs);
- every script named exists.

A placeholder value (``draft=<run>``, ``target.path=...``) is a name the reader fills in: its
word is left out, the rest of the line is checked. ``$VAR`` set earlier in the same block
(``T="target=hf target.path=..."``) is expanded; another ``$`` word is left out. A command of
an earlier day whose script has since gone is kept in the docs as a comment saying so."""

from __future__ import annotations

import argparse
import importlib
import re
import shlex
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = [
    "README.md",
    *(f"docs/{p.name}" for p in sorted((ROOT / "docs").glob("*.md"))),
    *(str(p.relative_to(ROOT)) for p in sorted((ROOT / "models" / "shipped").glob("*/README.md"))),
]
HYDRA = {"specdraft-train": "train", "specdraft-eval": "eval", "specdraft-prepare": "prepare"}
MODULES = {  # python -m <module>: the console script it is
    "flow": "specdraft-train",
    "flow.app": "specdraft-train",
    "decoding.eval": "specdraft-eval",
    "flow.regenerate": "specdraft-prepare",
    "flow.export": "specdraft-export",
    "decoding.disco": "specdraft-disco",
}
ARGPARSE = {"specdraft-export": "flow.export", "specdraft-disco": "decoding.disco"}
SEPARATORS = {"&&", "||", ";", "|", "&", "(", ")", ";;"}
PLACEHOLDER = re.compile(r"<[^<>]*>|\.\.\.|…")
MARK = "<placeholder>"  # what a placeholder reads as, once found


@dataclass(frozen=True)
class Shown:
    where: str  # file:line
    command: str  # specdraft-eval, scripts/bench_decode.py, ...
    args: tuple[str, ...]
    inline: bool = False  # a code span in a sentence: a flag named, perhaps not a whole command

    def __str__(self) -> str:
        return f"{self.where}: {self.command} {' '.join(self.args)}"


def _spans(text: str):
    """(first line number, [lines]) of each fenced block, and of each inline code span that
    holds a ``key=value`` or a ``--flag``."""
    lines = text.split("\n")
    i = 0
    while i < len(lines):
        if lines[i].lstrip().startswith("```"):
            j, body = i + 1, []
            while j < len(lines) and not lines[j].lstrip().startswith("```"):
                body.append((j + 1, lines[j]))
                j += 1
            yield False, body
            i = j + 1
            continue
        for m in re.finditer(r"`([^`\n]+)`", lines[i]):
            span = m.group(1)
            if ("=" in span or " --" in span) and not PLACEHOLDER.search(span.split(" ", 1)[0]):
                yield True, [(i + 1, span)]
        i += 1


def _logical(body):
    """Lines joined where one ends in a backslash, each with the number of its first line."""
    cur, first = "", None
    for n, line in body:
        first = n if first is None else first
        if line.rstrip().endswith("\\"):
            cur += line.rstrip()[:-1] + " "
            continue
        yield first, cur + line
        cur, first = "", None
    if first is not None:
        yield first, cur


def _words(line: str) -> list[str] | None:
    lex = shlex.shlex(line, posix=True, punctuation_chars=";&|()")
    lex.whitespace_split = True
    lex.commenters = "#"
    try:
        return list(lex)
    except ValueError:  # an unclosed quote: prose, not a command
        return None


def _script(word: str) -> str | None:
    m = re.fullmatch(r"(?:\./)?(scripts/[\w./-]+\.(?:py|sh))", word)
    return m.group(1) if m else None


def _commands(where: str, body, inline: bool = False) -> list[Shown]:
    env: dict[str, str] = {}
    out = []
    for n, line in _logical(body):
        words = _words(PLACEHOLDER.sub(MARK, line))
        if not words:
            continue
        for w in words:
            key, eq, value = w.partition("=")
            if eq and re.fullmatch(r"[A-Za-z_]\w*", key) and key.isupper():
                env[key] = value
        i = 0
        while i < len(words):
            w, start = words[i], None
            if w in HYDRA or w in ARGPARSE:
                command, start = w, i + 1
            elif w == "-m" and i + 1 < len(words) and words[i + 1] in MODULES:
                command, start = MODULES[words[i + 1]], i + 2
            elif _script(w) and i > 0 and words[i - 1] in ("python", "python3", "bash", "sh"):
                command, start = _script(w), i + 1
            elif _script(w) and i == 0 and w.startswith("./"):
                command, start = _script(w), i + 1
            if start is None:
                i += 1
                continue
            j = start
            while j < len(words) and words[j] not in SEPARATORS:
                j += 1
            args: list[str] = []
            for a in words[start:j]:
                a = a[1:-1] if a.startswith("[") and a.endswith("]") and "=" in a else a
                var = re.fullmatch(r"\$\{?(\w+)\}?", a)
                if var and var.group(1) in env:  # unquoted: its words
                    args += shlex.split(PLACEHOLDER.sub(MARK, env[var.group(1)]))
                    continue
                # within a word: its value where set above, else a placeholder
                args.append(re.sub(r"\$\{?(\w+)\}?", lambda m: env.get(m.group(1), MARK), a))
            out.append(Shown(f"{where}:{n}", command, tuple(args), inline))
            i = j
    return out


def shown() -> list[Shown]:
    found = []
    for doc in DOCS:
        for inline, body in _spans((ROOT / doc).read_text()):
            found += _commands(doc, body, inline)
    return found


SHOWN = shown()


def _ids(items: list[Shown]) -> list[str]:
    return [s.where + ":" + s.command.rsplit("/", 1)[-1] for s in items]


class _Parsed(Exception):
    """Raised in place of running a command once its flags have parsed."""


def _parse_only(monkeypatch):
    real_known = argparse.ArgumentParser.parse_known_args

    def parse_args(self, args=None, namespace=None):
        # argparse's own parse_args calls parse_known_args, which raises below: its check of
        # what is left is made here, as argparse words it
        _, extra = real_known(self, args, namespace)
        if extra:
            self.error(f"unrecognized arguments: {' '.join(extra)}")
        raise _Parsed

    def parse_known_args(self, args=None, namespace=None):
        real_known(self, args, namespace)
        raise _Parsed

    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", parse_args)
    monkeypatch.setattr(argparse.ArgumentParser, "parse_known_args", parse_known_args)


def _flags_refusal(main, argv: list[str], monkeypatch, capsys) -> str | None:
    """What ``main`` says of ``argv`` when its parser refuses it, or None once it has parsed."""
    _parse_only(monkeypatch)
    monkeypatch.setattr(sys, "argv", ["prog", *argv])
    try:
        main()
    except _Parsed:
        return None
    except SystemExit as e:
        if not e.code:
            return None
        err = capsys.readouterr().err.strip().splitlines()
        return err[-1] if err else f"exit {e.code}"
    return None  # no argparse (scripts/memory_plan.py): it ran, and only prints a plan


HYDRA_SHOWN = [s for s in SHOWN if s.command in HYDRA]
FLAGS_SHOWN = [
    s for s in SHOWN if s.command in ARGPARSE or s.command.endswith(".py") and s.args != ("--help",)
]
SCRIPTS_SHOWN = [s for s in SHOWN if s.command.startswith("scripts/")]


def test_the_docs_show_commands_of_each_kind():
    """The reader finds them: a change to the docs' layout that hid them all would pass
    every test below with nothing to check."""
    kinds = {s.command for s in SHOWN}
    assert set(HYDRA) | set(ARGPARSE) <= kinds, kinds
    assert len(HYDRA_SHOWN) >= 100 and len(SCRIPTS_SHOWN) >= 50, (
        len(HYDRA_SHOWN),
        len(SCRIPTS_SHOWN),
    )
    # a line of each form the reader is meant to read
    assert any(
        s.where.startswith("README.md") and s.args == ("experiment=quickstart",) for s in SHOWN
    )
    assert any("-m" in s.args and s.command == "specdraft-train" for s in SHOWN)  # a sweep
    assert any(
        s.where.startswith("docs/scaling.md") and s.command == "specdraft-train" for s in SHOWN
    )


@pytest.mark.parametrize("line", HYDRA_SHOWN, ids=_ids(HYDRA_SHOWN))
def test_each_shown_command_line_composes(line):
    import decoding.eval  # noqa: F401  (each command registers its typed schema on import)
    import flow.regenerate  # noqa: F401
    import trainer.config  # noqa: F401
    from conf.cli import check_command_line, home_expanded

    args = [a for a in line.args if MARK not in a]  # key=<run>: the reader's to fill in
    said = check_command_line(HYDRA[line.command], home_expanded(args))
    assert said is None, f"{line}\n  -> {said}"


@pytest.mark.parametrize("line", FLAGS_SHOWN, ids=_ids(FLAGS_SHOWN))
def test_each_shown_command_s_flags_parse(line, monkeypatch, capsys):
    if line.command in ARGPARSE:
        main = importlib.import_module(ARGPARSE[line.command]).main
    else:
        scripts = str(ROOT / "scripts")
        monkeypatch.syspath_prepend(scripts)
        main = importlib.import_module(Path(line.command).stem).main
    args = [a.replace(MARK, "X") for a in line.args]  # --out <folder>: a value all the same
    said = _flags_refusal(main, args, monkeypatch, capsys)
    if line.inline and said and "arguments are required" in said:
        said = None  # a sentence naming a flag (`specdraft-export --format gguf`), not a line
    assert said is None, f"{line}\n  -> {said}"


@pytest.mark.parametrize("line", SCRIPTS_SHOWN, ids=_ids(SCRIPTS_SHOWN))
def test_each_shown_script_is_there(line):
    assert (ROOT / line.command).is_file(), f"{line}\n  -> no such file"


# ---------------------------------------------------------------------- the reader's own checks


def test_the_reader_finds_continued_lines_variables_and_modules():
    body = list(
        enumerate(
            [
                'T="target=hf target.path=/m/x"   # a target',
                "specdraft-train method=eagle3 $T \\",
                "    data.path=a.jsonl && specdraft-eval draft=<run> gamma=3 $UNSET",
                'E=runs/e; python scripts/bench_decode.py --drafts "$E;tree=dynamic" --out <dir>',
                "accelerate launch --config_file c.yaml -m flow method=eagle3 target.path=...",
                "OUT=x python scripts/bench_host.py --parts regen  # comment=1",
                "bash scripts/gpu_check.sh | tee log",
            ],
            start=1,
        )
    )
    got = [(s.where, s.command, s.args) for s in _commands("d.md", body)]
    assert got == [
        (
            "d.md:2",
            "specdraft-train",
            ("method=eagle3", "target=hf", "target.path=/m/x", "data.path=a.jsonl"),
        ),
        ("d.md:2", "specdraft-eval", ("draft=" + MARK, "gamma=3", MARK)),
        ("d.md:4", "scripts/bench_decode.py", ("--drafts", "runs/e;tree=dynamic", "--out", MARK)),
        ("d.md:5", "specdraft-train", ("method=eagle3", "target.path=" + MARK)),
        ("d.md:6", "scripts/bench_host.py", ("--parts", "regen")),
        ("d.md:7", "scripts/gpu_check.sh", ()),
    ]


def test_a_renamed_setting_or_flag_is_caught(monkeypatch, capsys):
    """The checks above can fail: a key the schema lacks, a flag the parser lacks."""
    import decoding.eval  # noqa: F401
    from conf.cli import check_command_line

    assert "no such setting" in check_command_line("eval", ["draft=ngram", "gama=3"])
    from flow.export import main

    said = _flags_refusal(
        main, ["runs/x", "--format", "vllm", "--fromat", "x"], monkeypatch, capsys
    )
    assert said is not None and "--fromat" in said
    assert _flags_refusal(main, ["runs/x", "--format", "vllm"], monkeypatch, capsys) is None


# ------------------------------------------------------------------------------------ the links


def _slugs(md: Path):
    """The anchors GitHub gives a Markdown file's headings: lower case, punctuation dropped
    (``-`` and ``_`` kept), spaces as ``-``, a repeated heading's ``-1``, ``-2``..."""
    seen: dict[str, int] = {}
    fenced = False
    for line in md.read_text().split("\n"):
        if line.lstrip().startswith("```"):
            fenced = not fenced
        m = None if fenced else re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
        if m:
            text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", m.group(1).replace("`", ""))
            slug = re.sub(r"[^\w\- ]", "", text.lower()).replace(" ", "-")
            seen[slug] = seen.get(slug, -1) + 1
            yield slug if seen[slug] == 0 else f"{slug}-{seen[slug]}"


LINKED = [*DOCS, "CHANGELOG.md"]


@pytest.mark.parametrize("doc", LINKED)
def test_each_link_names_a_file_and_a_heading_that_are_there(doc):
    """The measurement log's sections are retitled as they grow: a link to an old title lands
    at the top of a 5,000-line page."""
    page = ROOT / doc
    text = page.read_text()
    broken = []
    for m in re.finditer(r"\]\(([^)\s]+)\)", text):
        link = m.group(1)
        if re.match(r"[a-z]+:", link):  # https:, mailto:
            continue
        path, _, anchor = link.partition("#")
        target = (page.parent / path).resolve() if path else page
        line = text[: m.start()].count("\n") + 1
        if not target.exists():
            broken.append(f"{doc}:{line}: {link}: no such file")
        elif anchor and target.suffix == ".md" and anchor not in set(_slugs(target)):
            broken.append(f"{doc}:{line}: {link}: no such heading in {path or doc}")
    assert not broken, "\n".join(broken)


def test_the_anchors_are_githubs():
    page = ROOT / "docs" / "benchmarks.md"
    slugs = set(_slugs(page))
    assert (
        "the-data-generators-loop-at-512-rows-the-hosts-work-a-step-2026-12-04-amd-epyc-family-26-model-2"
        in slugs
    )
    assert not any(s.startswith("bash") for s in slugs)  # a fenced block's comment is no heading
