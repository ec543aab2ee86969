"""Put a trained draft into the repository as a shipped draft (``models/shipped/<name>/``),
loadable by its short name (``specdraft-eval draft=<name>``).

    python scripts/ship_draft.py runs/e3long/final smollm2-eagle3 [--max-mb 25]

Floating-point tensors are stored in bf16 (the draft is cast to the target's dtype when it
decodes, so nothing is lost on a bf16 target; on an fp32 target the bf16 weights are widened).
The draft's own ``config.json`` is copied unchanged. The folder's README (commands, figures)
is written by hand; this script keeps it if present.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from models.base import DRAFT_WEIGHTS  # noqa: E402
from models.shipped import SHIPPED  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("draft", type=Path, help="a saved draft folder (a run's final/ or draft/)")
    ap.add_argument("name", help=f"short name, one of {sorted(SHIPPED)}")
    ap.add_argument("--max-mb", type=float, default=25.0)
    args = ap.parse_args()
    if args.name not in SHIPPED:
        sys.exit(f"{args.name}: add it to SHIPPED in models/shipped/__init__.py first")
    src = args.draft
    for f in ("config.json", DRAFT_WEIGHTS):
        if not (src / f).is_file():
            sys.exit(f"{src / f}: missing (expected a saved draft folder)")
    state = load_file(str(src / DRAFT_WEIGHTS))
    state = {
        k: (v.to(torch.bfloat16) if v.is_floating_point() else v).contiguous()
        for k, v in state.items()
    }
    dst = SHIPPED[args.name]
    dst.mkdir(parents=True, exist_ok=True)
    tmp = dst / (DRAFT_WEIGHTS + ".tmp")
    save_file(state, str(tmp), metadata={"format": "pt"})
    mb = tmp.stat().st_size / 1e6
    if mb > args.max_mb:
        tmp.unlink()
        sys.exit(f"{args.name}: {mb:.1f} MB in bf16, over --max-mb {args.max_mb}")
    tmp.replace(dst / DRAFT_WEIGHTS)
    shutil.copyfile(src / "config.json", dst / "config.json")
    cfg = json.loads((dst / "config.json").read_text())
    print(
        f"shipped {src} as {args.name}: {dst} ({mb:.1f} MB, bf16; method {cfg['specdraft']['method']})"
    )


if __name__ == "__main__":
    main()
