"""The model-family table of docs/families.md, from the tests that measure each cell.

    python scripts/family_matrix.py                  # runs tests/test_families.py, writes the doc
    python scripts/family_matrix.py --cells c.jsonl  # renders cells recorded earlier

Runs ``tests/test_families.py`` with ``SPECDRAFT_FAMILY_MATRIX`` set, so every test appends the
cells it checked (family, method, column, value); a cell no test recorded stays empty, and a
failing test leaves its cells out (the run's failures are listed under the tables). The vLLM
column needs vLLM installed (``bash scripts/install.sh vllm``), the llama.cpp column llama.cpp
(``bash scripts/install.sh engine``); without them the columns say so.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def machine() -> str:
    """The CPU (name, family and model, native bf16 or not) and its core count."""
    from decoding.engines.base import cpu_name

    return f"{cpu_name()}, {os.cpu_count()} cores"


def run_tests(cells: Path, extra: list[str]) -> tuple[int, list[str]]:
    env = {**os.environ, "SPECDRAFT_FAMILY_MATRIX": str(cells)}
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:warnings", "tests/test_families.py"]
    proc = subprocess.run(
        cmd + extra, cwd=ROOT, env=env, capture_output=True, text=True, check=False
    )
    failed = [ln for ln in proc.stdout.splitlines() if ln.startswith(("FAILED", "ERROR"))]
    print(proc.stdout.splitlines()[-1] if proc.stdout else proc.stderr[-2000:])
    return proc.returncode, failed


def render(cells: list[dict], failed: list[str], when: str, where: str, command: str) -> str:
    from models import METHODS
    from models.families import FAMILIES

    got: dict[tuple[str, str, str], str] = {}
    for c in cells:
        got[(c["family"], c["method"], c["column"])] = c["value"]
    names = [f for f in FAMILIES if f != "llama"]
    methods = sorted(METHODS)
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
                cell = "no: " + ", ".join(missing) if cells else ""
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
        "Chains and EAGLE-2 trees at T = 0 give the target's greedy output; a batch of 3 ragged "
        "rows gives each row's own (rollback and holes on the windowed layers' cache); at "
        "T = 1 every token is drawn from the target's own distribution (the rows the decoder "
        "sampled from equal a fresh forward over what it produced, chains and trees); the "
        "static path (the lean forward over a static cache, `compile=true`) is lossless where "
        "the family has one, else the one-line reason it falls back to transformers' forward; "
        "vLLM serves our EAGLE-3 export for the tiny target (heads 64 wide) with its "
        "speculative output equal to the target's greedy one and acceptance per position "
        "within 0.1 of ours (per position, vLLM's vs ours), else vLLM's own message. The head "
        "drafts the target's logit lens (its last fused state through the target's final norm "
        "and LM head, the layer adding nothing): acceptance is high where a tiny target repeats "
        "itself and near 0 where it does not, so this column checks that vLLM loads and serves "
        "the head exactly and counts acceptance as we do (vLLM counts a little higher where "
        "acceptance is high: it drafts a request's first tokens after the prompt's prefill, "
        "where the built-in decoder verifies the prompt's last token with its first draft); "
        "how well a trained head drafts is measured on the embedded target (docs/results.md). "
        "llama.cpp: its own converter turns the tiny target into the GGUF its server loads, "
        "our EAGLE-3 GGUF of the same head goes beside it, and the server's speculative output "
        "must be its plain one, with acceptance per position within 0.1 of ours (llama.cpp's "
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
        row.append(got.get((fam, "eagle3", "vllm"), "not run (vLLM not installed)"))
        row.append(got.get((fam, "eagle3", "llama.cpp"), "not run (llama.cpp not installed)"))
        out.append("| " + " | ".join(row) + " |")
    for engine, what in (("vllm", "vLLM serves our EAGLE-3 export"),
                         ("llama.cpp", "llama.cpp serves our EAGLE-3 GGUF")):  # fmt: skip
        served = sum(1 for f in names if got.get((f, "eagle3", engine), "").startswith("Y"))
        out += ["", f"{what} for {served} of {len(names)} families."]
    if notes:
        out += ["", "Notes:", ""] + [f"{i}. With {t}." for t, i in notes.items()]
    if failed:
        out += ["", "Tests that failed in this run (their cells are left out):", ""]
        out += [f"- `{ln}`" for ln in failed]
    return "\n".join(out) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=str(ROOT / "docs" / "families.md"))
    ap.add_argument("--cells", help="render these recorded cells instead of running the tests")
    ap.add_argument("pytest_args", nargs="*", help="passed to pytest (e.g. -k qwen3)")
    a = ap.parse_args()
    failed: list[str] = []
    if a.cells:
        path = Path(a.cells)
    else:
        path = Path(tempfile.mkdtemp()) / "cells.jsonl"
        path.touch()
        _, failed = run_tests(path, a.pytest_args)
    cells = [json.loads(ln) for ln in path.read_text().splitlines() if ln.strip()]
    when = datetime.date.today().isoformat()
    text = render(cells, failed, when, machine(), "python scripts/family_matrix.py")
    Path(a.out).write_text(text)
    print(f"wrote {a.out} ({len(cells)} cells)")


if __name__ == "__main__":
    main()
