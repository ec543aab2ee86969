"""Puts a GPU training run (``scripts/gpu_train.sh``, issue 45) back together here from the
files its last device call returned: the draft folder (``draft.tar.part_*``), its metrics and
the summary, under ``runs/gpu/<UTC stamp>/``.

    python scripts/gpu_train_unpack.py /work/.device/<n> [--dest runs/gpu]

Prints how to measure the draft and how to continue from it on the next GPU run (the next
slice of prompts, these weights: short runs add up).
"""

from __future__ import annotations

import argparse
import io
import json
import shutil
import sys
import tarfile
from datetime import datetime, timezone
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("returned", help="the folder the device call's files came back to")
    ap.add_argument("--dest", default=str(ROOT / "runs" / "gpu"))
    a = ap.parse_args()
    src = Path(a.returned)
    parts = sorted(src.glob("draft.tar.part_*"))
    if not parts:
        sys.exit(f"{src}: no draft.tar.part_* (did the run's last call finish? see train.log)")
    data = b"".join(p.read_bytes() for p in parts)
    stamp = datetime.now(timezone.utc).strftime("%Y%m%d-%H%M%S")
    dest = Path(a.dest) / stamp
    dest.mkdir(parents=True)
    try:
        with tarfile.open(fileobj=io.BytesIO(data)) as t:
            t.extractall(dest, filter="data")
    except tarfile.TarError as e:
        shutil.rmtree(dest)
        sys.exit(f"{src}: the parts {[p.name for p in parts]} do not make a whole tar ({e})")
    for name in ("summary.json", "metrics.jsonl", "eval_chain.json", "train.log"):
        if (src / name).exists():
            shutil.copy2(src / name, dest / name)
    final = dest / "final"
    print(f"draft: {final}")
    print(f"  measure: specdraft-eval draft={final} tree=chain gamma=3 adaptive=false")
    s = json.loads((src / "summary.json").read_text()) if (src / "summary.json").exists() else {}
    sl = s.get("slice") or {}
    if (dest / "metrics.jsonl").exists():
        from plot_curves import curve_end

        # this run's curve after those of the weights it started from (lineage.json: what the
        # next run from these weights continues)
        curves = [list(c) for c in sl.get("lineage") or []]
        before = curves[-1][1] + curve_end(Path(curves[-1][0])) if curves else 0.0
        mine = (dest / "metrics.jsonl").resolve()
        curves.append([str(mine.relative_to(ROOT) if mine.is_relative_to(ROOT) else mine), before])
        (dest / "lineage.json").write_text(json.dumps({"curves": curves}, indent=1))
        print(
            f"  learning curve, CPU phases through this run ({len(curves)} runs): python "
            f"scripts/plot_curves.py --lineage {dest / 'lineage.json'} --metric alpha "
            f"--out {dest / 'curves.png'}"
        )
    if "skip" in sl and "count" in sl:
        nxt = sl["skip"] + sl["count"]
        print(
            "  continue on the next GPU run: python scripts/gpu_train_pack.py "
            f"--skip {nxt} --count {sl['count']} --init {final}"
        )


if __name__ == "__main__":
    main()
