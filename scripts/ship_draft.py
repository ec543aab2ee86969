"""Put a trained draft into the repository as a shipped draft (``models/shipped/<name>/``),
loadable by its short name (``specdraft-eval draft=<name>``).

    python scripts/ship_draft.py runs/e3long/final smollm2-eagle3 [--max-mb 25] [--new-target]

The draft is checked before anything is written: a draft trained by specdraft (a run, its
``final/`` or a checkpoint), for the target the shipped name serves (``--new-target`` ships one
for another target).

Floating-point tensors are stored in bf16 (the draft is cast to the target's dtype when it
decodes, so nothing is lost on a bf16 target; on an fp32 target the bf16 weights are widened).
The draft's own ``config.json`` is copied, with the shipped draft's hand-written decode settings
kept (for the same target). The folder's README (commands, figures) is written by hand; this
script keeps it if present.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from models.base import (  # noqa: E402
    DRAFT_WEIGHTS,
    DraftError,
    read_draft_config,
    resolve_draft_dir,
    unfinished_run,
)
from models.shipped import SHIPPED  # noqa: E402


def checked_draft(src: Path, dst: Path, new_target: bool) -> tuple[Path, dict]:
    """The saved draft behind ``src`` (a run, its final/ or a checkpoint) and its config,
    checked before anything is written: a specdraft draft with its weights, trained for the
    target the shipped draft at ``dst`` serves (unless ``new_target``)."""
    if not src.is_dir():
        sys.exit(f"{src}: no such folder (a run, its final/ folder or a checkpoint)")
    found = resolve_draft_dir(src)
    if found is None:
        step = unfinished_run(src)
        hint = f"; its newest checkpoint is {step}" if step else ""
        sys.exit(
            f"{src}: not a draft trained by specdraft (a run, its final/ or a checkpoint){hint}"
        )
    try:
        cfg = read_draft_config(found)
    except DraftError as e:
        sys.exit(str(e))
    if dst.is_dir() and found.resolve() == dst.resolve():
        sys.exit(
            f"{src}: is the shipped draft {dst.name} itself; pass the draft to ship in its place"
        )
    # a shipped draft is its weights and config.json: a draft keeping more (Medusa-2's LoRA
    # adapter/, DistillSpec's student/) would be shipped without it and not load
    more = sorted(p.name for p in found.iterdir() if p.name not in (DRAFT_WEIGHTS, "config.json"))
    if more:
        method = cfg.get("specdraft", {}).get("method")
        sys.exit(
            f"{found}: a {method} draft keeps {', '.join(more)} beside its weights, which a "
            "shipped draft (config.json and model.safetensors) does not hold"
        )
    if not (found / DRAFT_WEIGHTS).is_file():
        sys.exit(f"{found / DRAFT_WEIGHTS}: missing (expected a saved draft folder)")
    if (dst / "config.json").is_file() and not new_target:
        try:
            was = json.loads((dst / "config.json").read_text())["target"]["identity"]
        except (ValueError, KeyError, TypeError):
            was = None
        now = cfg.get("target", {}).get("identity")
        if was is not None and now != was:
            sys.exit(
                f"{found}: trained for target {now}, but {dst.name} serves {was}; pass "
                "--new-target to ship it for its own target"
            )
    return found, cfg


#: keys of a shipped draft's config.json written by hand after it was measured (the decode
#: settings ``specdraft-eval draft=<name>`` uses when none is given, and their note)
SHIPPED_KEYS = ("decode", "decode_note")


def kept_settings(dst: Path, cfg: dict, new_target: bool) -> dict:
    """The hand-written keys (``SHIPPED_KEYS``) of the shipped draft at ``dst`` that the new
    draft's config (``cfg``) lacks: kept across a new head for the same target, where copying
    the new draft's config.json alone would drop them silently; none for a new target."""
    if new_target or not (dst / "config.json").is_file():
        return {}
    try:
        was = json.loads((dst / "config.json").read_text())
    except ValueError:
        return {}
    return {k: was[k] for k in SHIPPED_KEYS if k in was and k not in cfg}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("draft", type=Path, help="a saved draft folder (a run's final/ or draft/)")
    ap.add_argument("name", help=f"short name, one of {sorted(SHIPPED)}")
    ap.add_argument("--max-mb", type=float, default=25.0)
    ap.add_argument(
        "--new-target",
        action="store_true",
        help="ship a draft trained for another target than the one this name serves",
    )
    args = ap.parse_args()
    if args.name not in SHIPPED:
        sys.exit(f"{args.name}: add it to SHIPPED in models/shipped/__init__.py first")
    dst = SHIPPED[args.name]
    src, _ = checked_draft(args.draft.expanduser(), dst, args.new_target)
    try:
        state = load_file(str(src / DRAFT_WEIGHTS))
    except Exception as e:  # safetensors raises several types for damaged files
        sys.exit(f"{src / DRAFT_WEIGHTS}: cannot read weights ({e})")
    state = {
        k: (v.to(torch.bfloat16) if v.is_floating_point() else v).contiguous()
        for k, v in state.items()
    }
    dst.mkdir(parents=True, exist_ok=True)
    tmp = dst / (DRAFT_WEIGHTS + ".tmp")
    save_file(state, str(tmp), metadata={"format": "pt"})
    mb = tmp.stat().st_size / 1e6
    if mb > args.max_mb:
        tmp.unlink()
        sys.exit(f"{args.name}: {mb:.1f} MB in bf16, over --max-mb {args.max_mb}")
    cfg = json.loads((src / "config.json").read_text())
    kept = kept_settings(dst, cfg, args.new_target)
    tmp.replace(dst / DRAFT_WEIGHTS)
    (dst / "config.json").write_text(json.dumps({**cfg, **kept}, indent=1))
    print(
        f"shipped {src} as {args.name}: {dst} ({mb:.1f} MB, bf16; method {cfg['specdraft']['method']})"
    )
    if kept:
        print(
            f"note: kept the decode settings of {args.name} ({', '.join(sorted(kept))} in "
            f"{dst / 'config.json'}), measured on the previous head: measure again and edit "
            "them where this head is best decoded otherwise"
        )
    if (dst / "disco").is_dir():
        print(
            f"note: {dst / 'disco'} was fit on the previous head's traces: fit it again "
            f"(specdraft-eval draft={args.name} adaptive=false traces=t.jsonl, then "
            f"specdraft-disco t.jsonl --out {dst / 'disco'}); the README is kept as it was"
        )


if __name__ == "__main__":
    main()
