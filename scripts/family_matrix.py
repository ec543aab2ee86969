"""The model-family table of docs/families.md, from the tests that measure each cell.

    python scripts/family_matrix.py                  # runs tests/test_families.py, writes the doc
    python scripts/family_matrix.py -k qwen3         # those tests only, written beside their cells
    python scripts/family_matrix.py --cells c.jsonl  # renders cells recorded earlier

Runs ``tests/test_families.py`` with ``SPECDRAFT_FAMILY_MATRIX`` set, so every test appends the
cells it checked (family, method, column, value); a cell no test recorded stays empty, and a
failing test leaves its cells out (the run's failures are listed under the tables). The vLLM
column needs vLLM installed (``bash scripts/install.sh vllm``), the llama.cpp column llama.cpp
(``bash scripts/install.sh engine``); without them the columns say so.

The cells file starts with the run's date, machine and command, and ends with its failures, so
``--cells`` renders a recording as it was measured. A subset (``-k``, or pytest arguments after
``--``) is written beside its cells unless ``--out`` names a file: it never replaces the whole
table of docs/families.md by default, and the families it did not run are left empty. ``--out``
replaces only a page this script wrote (``--force``: any file).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shlex
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
HEADER = "# Model families"  # the first line of every page this script writes
CELL = ("family", "method", "column", "value")


def family_names() -> list[str]:
    """The families of the matrix (the default, Llama, is every other test's target)."""
    from models.families import FAMILIES

    return [f for f in FAMILIES if f != "llama"]


def machine() -> str:
    """The CPU (name, family and model, native bf16 or not) and its core count."""
    from decoding.engines.base import cpu_name

    return f"{cpu_name()}, {os.cpu_count()} cores"


def installed() -> dict[str, bool]:
    """Which serving engines this machine has (their columns are "not run" without them)."""
    from decoding.engines.llama_cpp import engine_dir
    from decoding.engines.vllm_eval import vllm_python

    return {
        "vllm": vllm_python(required=False) is not None,
        "llama.cpp": engine_dir(required=False) is not None,
    }


def read_cells(path: Path) -> tuple[list[dict], dict, list[str]]:
    """The cells recorded in ``path``; what the run recorded of itself (date, machine, command,
    subset, engines installed), else when the file was written and that the machine is not named
    (cells recorded by running the tests directly); and the tests that failed in the run."""
    try:
        text = path.read_text()
        mtime = path.stat().st_mtime
    except FileNotFoundError:
        raise SystemExit(f"--cells {path}: no such file") from None
    except (OSError, UnicodeDecodeError) as e:
        raise SystemExit(f"--cells {path}: cannot read it ({e})") from None
    cells: list[dict] = []
    run: dict = {}
    failed: list[str] = []
    for i, ln in enumerate(text.splitlines(), 1):
        if not ln.strip():
            continue
        try:
            row = json.loads(ln)
        except json.JSONDecodeError as e:
            raise SystemExit(f"--cells {path}:{i}: not a JSON line ({e})") from None
        if isinstance(row, dict) and isinstance(row.get("run"), dict):
            run = row["run"]
            for k in ("date", "machine", "command"):
                if not isinstance(run.get(k), str):
                    raise SystemExit(f"--cells {path}:{i}: run.{k} is {run.get(k)!r}, not text")
        elif isinstance(row, dict) and isinstance(row.get("failed"), list):
            failed = [str(f) for f in row["failed"]]
        elif isinstance(row, dict) and all(isinstance(row.get(k), str) for k in CELL):
            cells.append(row)
        else:
            raise SystemExit(
                f"--cells {path}:{i}: not a cell (a JSON object of {', '.join(CELL)}): {ln[:60]}"
            )
    if not run:
        when = datetime.date.fromtimestamp(mtime).isoformat()
        command = f"SPECDRAFT_FAMILY_MATRIX={path.name} python -m pytest tests/test_families.py"
        run = {"date": when, "machine": "a machine the cells do not name", "command": command}
    return cells, run, failed


def is_page(path: Path, header: str = HEADER) -> bool:
    """Whether ``path`` is a page the script of ``header`` wrote (its first line is that)."""
    try:
        with path.open(encoding="utf-8") as f:
            return f.readline().rstrip("\n") == header
    except (OSError, UnicodeDecodeError):
        return False


def check_out(out: Path, force: bool, header: str = HEADER) -> None:
    """Refuse, in one line, an --out that cannot be written or that holds a file of the user's
    (a page whose first line is not ``header``; scripts/vllm_versions.py passes its own)."""
    if out.is_dir():
        raise SystemExit(f"--out {out}: a folder, not a file")
    if not out.parent.is_dir():
        raise SystemExit(f"--out {out}: no such folder {out.parent}")
    if out.exists() and not force and not is_page(out, header):
        raise SystemExit(
            f"--out {out}: exists and is not a page this script wrote (its first line is not "
            f"{header!r}); use --force to replace it"
        )


def run_tests(cells: Path, extra: list[str]) -> tuple[int, list[str]]:
    env = {**os.environ, "SPECDRAFT_FAMILY_MATRIX": str(cells)}
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:warnings", "tests/test_families.py"]
    proc = subprocess.run(
        cmd + extra, cwd=ROOT, env=env, capture_output=True, text=True, check=False
    )
    failed = [ln for ln in proc.stdout.splitlines() if ln.startswith(("FAILED", "ERROR"))]
    print(proc.stdout.splitlines()[-1] if proc.stdout else proc.stderr[-2000:])
    return proc.returncode, failed


def render(
    cells: list[dict],
    failed: list[str],
    when: str,
    where: str,
    command: str,
    engines: dict[str, bool] | None = None,
) -> str:
    """The page. A family no cell names was not run: its cells are empty, not failing; an
    engine's column says "not installed" only where ``engines`` says so."""
    from models import METHODS
    from models.families import FAMILIES

    got: dict[tuple[str, str, str], str] = {}
    for c in cells:
        got[(c["family"], c["method"], c["column"])] = c["value"]
    names = family_names()
    methods = sorted(METHODS)
    ran = [f for f in names if any(c["family"] == f for c in cells)]
    engines = engines or {}

    def tried(fam: str, m: str) -> bool:
        """Whether the test of ``fam`` x ``m`` ran: it recorded a cell, or it failed."""
        ids = (f"[{fam}-{m}]", f"[{m}-{fam}]")
        return any((fam, m, k) in got for k in ("trains", "exact", "exports", "refused")) or any(
            i in ln for ln in failed for i in ids
        )

    notes: dict[str, int] = {}

    def note(text: str) -> str:
        notes.setdefault(text, len(notes) + 1)
        return f"[{notes[text]}]"

    out = [
        "# Model families",
        "",
        "Every method on a tiny random target of each family people train drafts for "
        "(`target=tiny_random target.family=<name>`, built from transformers' own config "
        "classes: a few layers, small widths, no weights carried). Each cell is what a test "
        "in `tests/test_families.py` checked; the table is written by "
        "`scripts/family_matrix.py` from those tests' records.",
        "",
        f"Measured {when} on {where}: `{command}`.",
        "",
    ]
    if len(ran) < len(names):
        out += [
            f"Run for {len(ran)} of {len(names)} families: the cells of the others are empty "
            "(not run).",
            "",
        ]
    out += [
        "## Every method on every family",
        "",
        "Y: trains 3 steps through the one loop, decodes through the one decoder with the "
        "target's greedy output (20-token prompt, 40 new tokens: past the 24-column windows of "
        "the sliding-window families), and exports to each of its formats and reads back with "
        "the same proposals.",
        "",
        "| family | what is particular | " + " | ".join(methods) + " |",
        "|---|---|" + "---|" * len(methods),
    ]
    for fam in names:
        row = [f"`{fam}`", FAMILIES[fam].what]
        for m in methods:
            t, e, x = (got.get((fam, m, k)) for k in ("trains", "exact", "exports"))
            if t and e and x is not None:
                cell = "Y"
                if t != "Y":
                    cell += " " + note(t.removeprefix("Y (").removesuffix(")"))
            else:
                missing = [k for k, v in (("trains", t), ("exact", e), ("exports", x)) if not v]
                cell = "no: " + ", ".join(missing) if tried(fam, m) else ""
            row.append(cell)
        out.append("| " + " | ".join(row) + " |")
    refused = [(f, m, got[(f, m, "refused")]) for f in names for m in methods
               if (f, m, "refused") in got]  # fmt: skip
    if refused:
        out += ["", "Formats refused by name, where the family's layers do not fit the layout "
                "(the other formats of the method export and read back):", ""]  # fmt: skip
        out += [f"- `{f}` / `{m}`: {r}" for f, m, r in refused]
    out += [
        "",
        "## EAGLE-3 on each family, once",
        "",
        "Chains and EAGLE-2 trees at T = 0 give the target's greedy output (transformers' "
        "forward, the reference); a batch of 3 ragged "
        "rows gives each row's own (rollback and holes on the windowed layers' cache); at "
        "T = 1 every token is drawn from the target's own distribution (the rows the decoder "
        "sampled from equal a fresh forward over what it produced, chains and trees); on the "
        "static path (the lean forward over a static cache, `compile=true`) chains, trees and "
        "the batch give the same outputs where the family has one, else the one-line reason "
        "it falls back to transformers' forward; "
        "vLLM serves our EAGLE-3 export for the tiny target (heads 64 wide) with its "
        "speculative output equal to the target's greedy one and acceptance per position "
        "within 0.03 of ours (per position, vLLM's vs ours), else vLLM's own message. The head "
        "drafts the target's logit lens (its last fused state through the target's final norm "
        "and LM head, the layer adding nothing): acceptance is high where a tiny target repeats "
        "itself and near 0 where it does not, so this column checks that vLLM loads and serves "
        "the head exactly and counts acceptance as we do (both draft from a request's second "
        "token: the prefill chooses the first); "
        "how well a trained head drafts is measured on the embedded target (docs/results.md). "
        "llama.cpp: its own converter turns the tiny target into the GGUF its server loads, "
        "our EAGLE-3 GGUF of the same head goes beside it, and the server's speculative output "
        "must be its plain one, with acceptance per position within 0.03 of ours (llama.cpp's "
        "vs ours) over the tokens where its output is the target's greedy one (the engine "
        "computes the converted target itself: where it parts from ours, the cell says after "
        "how many tokens); else the line that refuses the pair "
        "(ours, before any server starts, where llama.cpp gives EAGLE-3 drafts no layer inputs "
        "for the target's architecture and its server would abort; or the converter's).",
        "",
        "| family | trees | batched | T = 1 | static path | vLLM | llama.cpp |",
        "|---|---|---|---|---|---|---|",
    ]
    for fam in names:
        row = [f"`{fam}`"] + [
            got.get((fam, "eagle3", k), "") for k in ("trees", "batched", "sampling", "static")
        ]
        for engine, name in (("vllm", "vLLM"), ("llama.cpp", "llama.cpp")):
            absent = fam in ran and engines.get(engine) is False
            row.append(got.get((fam, "eagle3", engine), f"not run ({name} not installed)"
                               if absent else ""))  # fmt: skip
        out.append("| " + " | ".join(row) + " |")
    for engine, what in (("vllm", "vLLM serves our EAGLE-3 export"),
                         ("llama.cpp", "llama.cpp serves our EAGLE-3 GGUF")):  # fmt: skip
        served = sum(1 for f in ran if got.get((f, "eagle3", engine), "").startswith("Y"))
        rest = f" ({len(names) - len(ran)} not run)" if len(ran) < len(names) else ""
        out += ["", f"{what} for {served} of {len(ran)} families{rest}."]
    if notes:
        out += ["", "Notes:", ""] + [f"{i}. With {t}." for t, i in notes.items()]
    if failed:
        out += ["", "Tests that failed in this run (their cells are left out):", ""]
        out += [f"- `{ln}`" for ln in failed]
    return "\n".join(out) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--out",
        type=Path,
        help="the page to write (default: docs/families.md; for a subset, beside its cells)",
    )
    ap.add_argument("--force", action="store_true", help="--out may replace any file")
    ap.add_argument("--cells", type=Path, help="render cells recorded earlier, run no tests")
    ap.add_argument("-k", dest="keyword", metavar="EXPR", help="only the tests pytest -k selects")
    ap.add_argument("pytest_args", nargs="*", help="more pytest arguments, after -- (e.g. -- -x)")
    a = ap.parse_args()
    extra = (["-k", a.keyword] if a.keyword else []) + a.pytest_args
    doc = ROOT / "docs" / "families.md"
    if a.cells:
        if extra:
            raise SystemExit(
                "--cells renders cells recorded earlier: -k and pytest arguments run tests"
            )
        cells, run, failed = read_cells(a.cells)
        covered = {c["family"] for c in cells}
        subset = bool(run.get("subset", len(covered) < len(family_names())))
        out = a.out or (a.cells.with_suffix(".md") if subset else doc)
        check_out(out, a.force)
        path = a.cells
    else:
        if a.out or not extra:
            check_out(a.out or doc, a.force)  # before the tests run, not after
        path = Path(tempfile.mkdtemp(prefix="family-matrix-")) / "cells.jsonl"
        out = a.out or (path.with_suffix(".md") if extra else doc)
        args = ["-k", a.keyword] if a.keyword else []
        args += ["--", *a.pytest_args] if a.pytest_args else []
        stamp = {
            "date": datetime.date.today().isoformat(),
            "machine": machine(),
            "command": shlex.join(["python", "scripts/family_matrix.py", *args]),
            "subset": bool(extra),
            "engines": installed(),
        }
        path.write_text(json.dumps({"run": stamp}) + "\n")
        _, failed = run_tests(path, extra)
        with path.open("a") as f:
            f.write(json.dumps({"failed": failed}) + "\n")
        cells, run, failed = read_cells(path)
    engines = run.get("engines") if isinstance(run.get("engines"), dict) else None
    text = render(cells, failed, run["date"], run["machine"], run["command"], engines)
    try:
        out.write_text(text)
    except OSError as e:
        raise SystemExit(f"--out {out}: cannot write it ({e.strerror})") from None
    print(f"wrote {out} ({len(cells)} cells, recorded in {path})")


if __name__ == "__main__":
    main()
