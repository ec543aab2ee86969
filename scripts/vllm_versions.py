"""Which vLLM releases serve our exports: the vLLM tests of the suite, run against each release.

    python scripts/vllm_versions.py 0.27.1 0.29.0 0.32.0            # prints the table
    python scripts/vllm_versions.py 0.29.0 --out vllm-versions.md   # and writes it to a page
    python scripts/vllm_versions.py 0.29.0 -- -k eagle3             # more pytest arguments
    SPECDRAFT_VLLM_PYTHON=/opt/vllm/bin/python python scripts/vllm_versions.py --here

Each release is installed once into the cache (``VLLM_VERSION=<release> bash scripts/install.sh
vllm``: PyPI's CPU build where there is no GPU, vLLM itself where there is), then the tests that
serve in vLLM (``pytest --vllm-only``: every export format vLLM serves, loaded and decoding with
the acceptance ours measures; the family matrix's vLLM column; the shipped head through
``specdraft-eval engine=vllm``, T = 0 and T = 1; regeneration through vLLM) run with
``SPECDRAFT_VLLM_PYTHON`` naming that release's interpreter. ``--here`` runs them against the
environment ``SPECDRAFT_VLLM_PYTHON`` already names (yours, with a GPU build of any release),
installing nothing.

The tests pin vLLM's own refusals (a format or family its CPU build does not serve) to the
messages of the release ``scripts/install_vllm.sh`` installs, so another release can fail a test
by saying no in other words: the table gives each failing test's last line, to be read rather
than counted. A release PyPI cannot install (older CPU builds pin a ``torch==X+cpu`` that only
PyTorch's own index holds) is a row saying so.
"""

from __future__ import annotations

import argparse
import datetime
import os
import re
import shlex
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
HEADER = "# vLLM releases and our exports"  # the first line of every page this script writes
RELEASE = re.compile(r"^\d+\.\d+(\.\d+)?([.-]?post\d+)?$")


def installed_python(release: str) -> tuple[Path | None, str]:
    """Install ``release`` into the cache (once); its interpreter, or None and why not."""
    from decoding.engines.base import cache_root

    env = {**os.environ, "VLLM_VERSION": release}
    env.pop("SPECDRAFT_VLLM_PYTHON", None)
    print(f"vllm {release}: installing (once, into the cache)", file=sys.stderr, flush=True)
    proc = subprocess.run(
        ["bash", "scripts/install.sh", "vllm"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        check=False,
    )
    python = cache_root() / f"vllm-{release}" / "bin" / "python"
    if proc.returncode != 0 or not python.is_file():
        lines = [ln for ln in proc.stderr.splitlines() if ln.startswith("vllm:")]
        why = lines[-1].removeprefix("vllm: ") if lines else proc.stderr.strip()[-300:]
        return None, why or f"install.sh vllm exited with {proc.returncode}"
    return python, ""


def run_tests(python: str, extra: list[str]) -> dict:
    """The vLLM tests against the vLLM of ``python``: counts, and each failure's last line."""
    with tempfile.TemporaryDirectory(prefix="specdraft-vllm-versions-") as tmp:
        xml = Path(tmp) / "junit.xml"
        cmd = [sys.executable, "-m", "pytest", "--vllm-only", "-q", "-p", "no:cacheprovider",
               f"--junitxml={xml}", *extra]  # fmt: skip
        env = {**os.environ, "SPECDRAFT_VLLM_PYTHON": str(python)}
        proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, check=False)
        if not xml.is_file():
            tail = (proc.stdout + proc.stderr).strip().splitlines()[-1:] or ["no output"]
            return {"error": f"pytest wrote no results (exit {proc.returncode}): {tail[0]}"}
        return read_junit(xml)


def read_junit(xml: Path) -> dict:
    """passed / failed / skipped counts and {test id: its failure's last line}."""
    counts = {"passed": 0, "failed": 0, "skipped": 0}
    failures: dict[str, str] = {}
    for case in ET.parse(xml).getroot().iter("testcase"):
        if not case.get("classname") and case.find("skipped") is not None:
            continue  # a module that skips as a whole at collection (no vLLM test of its own)
        name = f"{case.get('classname', '').rsplit('.', 1)[-1]}::{case.get('name')}"
        bad = case.find("failure")
        if bad is None:
            bad = case.find("error")
        if bad is not None:
            counts["failed"] += 1
            text = (bad.get("message") or bad.text or "").strip()
            failures[name] = " ".join(text.split())[:240]
        elif case.find("skipped") is not None:
            counts["skipped"] += 1
        else:
            counts["passed"] += 1
    return {**counts, "failures": failures}


def vllm_release(python: str) -> str:
    proc = subprocess.run(
        [python, "-c", "import importlib.metadata as m; print(m.version('vllm'))"],
        capture_output=True,
        text=True,
        check=False,
    )
    if proc.returncode != 0:
        raise SystemExit(f"SPECDRAFT_VLLM_PYTHON={python}: its vLLM does not import")
    return proc.stdout.strip().split("+")[0]


def render(rows: list[dict], run: dict) -> str:
    out = [
        HEADER,
        "",
        f"Measured {run['date']} on {run['machine']}:",
        "",
        f"    {run['command']}",
        "",
        "| vLLM | passed | failed | skipped | what failed (the test's last line) |",
        "|---|---|---|---|---|",
    ]
    for r in rows:
        if "error" in r:
            out.append(f"| {r['release']} | - | - | - | {r['error']} |")
            continue
        why = "; ".join(f"`{t}`: {m}" for t, m in r["failures"].items()) or "-"
        out.append(
            f"| {r['release']} | {r['passed']} | {r['failed']} | {r['skipped']} | "
            f"{why.replace('|', '/')} |"
        )
    return "\n".join(out) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("releases", nargs="*", help="vLLM releases, e.g. 0.29.0 0.32.0")
    ap.add_argument("--here", action="store_true",
                    help="the vLLM that SPECDRAFT_VLLM_PYTHON names, installing nothing")  # fmt: skip
    ap.add_argument("--out", type=Path, help="also write the table to this page")
    ap.add_argument("--force", action="store_true", help="--out may replace any file")
    argv = list(sys.argv[1:] if argv is None else argv)
    cut = argv.index("--") if "--" in argv else len(argv)
    args = ap.parse_args(argv[:cut])
    extra = argv[cut + 1 :]  # more pytest arguments, after -- (e.g. -- -k eagle3)
    bad = [r for r in args.releases if not RELEASE.match(r)]
    if bad:
        raise SystemExit(f"release {bad[0]!r}: not a vLLM release number (like 0.32.0)")
    here = os.environ.get("SPECDRAFT_VLLM_PYTHON")
    if args.here and not here:
        raise SystemExit("--here: SPECDRAFT_VLLM_PYTHON is unset (the python of your vLLM)")
    if args.here and args.releases:
        raise SystemExit("--here runs the vLLM SPECDRAFT_VLLM_PYTHON names: give no releases")
    if not args.here and not args.releases:
        raise SystemExit("name the vLLM releases to check (e.g. 0.29.0 0.32.0), or --here")
    if args.out:
        from family_matrix import check_out  # the same --out guard as the family table's

        check_out(args.out, args.force, HEADER)

    from decoding.engines.base import cpu_name

    rows: list[dict] = []
    targets = [(vllm_release(here), here)] if args.here else [(r, None) for r in args.releases]
    for release, python in targets:
        if python is None:
            path, why = installed_python(release)
            if path is None:
                rows.append({"release": release, "error": f"not installed: {why}"})
                continue
            python = str(path)
        print(f"vllm {release}: running the vLLM tests", file=sys.stderr, flush=True)
        rows.append({"release": release, **run_tests(python, extra)})
    run = {
        "date": datetime.date.today().isoformat(),
        "machine": f"{cpu_name()}, {os.cpu_count()} cores",
        "command": shlex.join(["python", "scripts/vllm_versions.py", *argv]),
    }
    page = render(rows, run)
    print(page, end="")
    if args.out:
        args.out.write_text(page, encoding="utf-8")
    return 0 if all(r.get("failed", 1) == 0 for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
