"""Learning curves: validation acceptance per draft position against training tokens.

    python scripts/plot_curves.py RUN_DIR [RUN_DIR ...] --out docs/curves.png \
        [--labels "EAGLE-3" "EAGLE-1"] [--metric alpha] [--positions 5] [--offsets 0 2.8e6]

Reads each run's ``metrics.jsonl`` (every row carries ``tokens``, the training tokens seen so
far, so a resumed run's curve continues where it stopped; a RUN may also name a metrics
``.jsonl`` file itself) and plots ``val/top1_pos{k}``
(``--metric top1``: agreement with the target's argmax at draft position k) or
``val/alpha_pos{k}`` (``--metric alpha``: the same given positions 1..k-1 agreed, EAGLE's
n-alpha) for k = 1..positions, one colour per position, one line style per run (with more
runs than line styles: one colour per run, one line style per position).

``--offsets`` adds training tokens seen before a run started: a run started from another's
weights (``train.init_from``) counts its tokens from zero, and its offset places it after the
run it continues (a dotted vertical line marks where it starts). ``--same-style`` draws every
run in one line style, for phases of one model.

``--lineage FILE``: the runs and offsets a draft's ``lineage.json`` lists (written by
``scripts/gpu_train_unpack.py``: the shipped head's CPU phases, then every GPU run after
them), in one style: the whole learning curve from the first CPU phase through the last run.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def curves(run: Path, metric: str, positions: int) -> dict[int, list[tuple[float, float]]]:
    path = run if run.suffix == ".jsonl" else run / "metrics.jsonl"
    if not path.is_file():
        raise SystemExit(f"{path}: no metrics file (a run directory or a .jsonl file)")
    rows = [json.loads(x) for x in path.read_text().splitlines() if x]
    by_step: dict[int, dict] = {}
    for r in rows:  # a resumed run may log a step twice; the later row wins
        by_step.setdefault(r["step"], {}).update(r)
    out: dict[int, list[tuple[float, float]]] = {k: [] for k in range(1, positions + 1)}
    for step in sorted(by_step):
        r = by_step[step]
        if "tokens" not in r:
            continue
        for k in out:
            v = r.get(f"val/{metric}_pos{k}")
            if v is not None:
                out[k].append((r["tokens"], v))
    return out


def curve_end(path: Path) -> float:
    """Training tokens at a metrics file's last row that counts them: where a run continuing
    from these weights starts."""
    rows = [json.loads(x) for x in path.read_text().splitlines() if x.strip()]
    return max((float(r["tokens"]) for r in rows if "tokens" in r), default=0.0)


def lineage(draft: Path) -> list[list]:
    """The learning curves behind the draft folder ``draft``, each as [metrics file, training
    tokens before it]: a GPU run's (the ``lineage.json`` beside its ``final`` folder), or a
    shipped draft's phases (its ``curve_phase*.jsonl``, one after another); [] where none is
    known."""
    lin = draft.parent / "lineage.json"
    if draft.name == "final" and lin.is_file():
        return json.loads(lin.read_text())["curves"]
    out, off = [], 0.0
    for f in sorted(draft.glob("curve_phase*.jsonl")):
        out.append([str(f), off])
        off += curve_end(f)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("runs", nargs="*", type=Path)
    ap.add_argument("--lineage", type=Path, help="a lineage.json: its curves and offsets")
    ap.add_argument("--labels", nargs="*")
    ap.add_argument("--out", type=Path, default=Path("curves.png"))
    ap.add_argument("--metric", choices=["top1", "alpha"], default="top1")
    ap.add_argument("--positions", type=int, default=5)
    ap.add_argument("--title", default=None)
    ap.add_argument("--offsets", nargs="*", type=float, help="training tokens before each run")
    ap.add_argument("--same-style", action="store_true", help="one line style for every run")
    ap.add_argument("--ymax", type=float, default=1.0, help="top of the y axis (default 1)")
    args = ap.parse_args()
    if args.lineage is not None:
        curves_ = json.loads(args.lineage.read_text())["curves"]
        args.runs = [Path(p) for p, _ in curves_]
        args.offsets = [float(o) for _, o in curves_]
        args.same_style = True
    if not args.runs:
        raise SystemExit("name runs (or metrics files), or --lineage FILE")
    offsets = args.offsets or [0.0] * len(args.runs)
    if len(offsets) != len(args.runs):
        raise SystemExit(f"--offsets: {len(offsets)} values for {len(args.runs)} runs")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = args.labels or [r.name for r in args.runs]
    styles = ["-", "--", ":", "-."]
    by_run = len(args.runs) > len(styles) and not args.same_style  # colours tell runs apart
    fig, ax = plt.subplots(figsize=(8, 4.8))
    for i, (run, label, off) in enumerate(zip(args.runs, labels, offsets, strict=True)):
        if off:
            ax.axvline(off / 1e6, color="grey", ls=":", lw=1)
            ax.text(off / 1e6, 0.97, f" {label}", fontsize=7, va="top", color="grey")
        for k, pts in curves(run, args.metric, args.positions).items():
            if not pts:
                continue
            xs, ys = zip(*pts, strict=True)
            ax.plot(
                [(x + off) / 1e6 for x in xs],
                ys,
                styles[
                    (k - 1) % len(styles) if by_run else 0 if args.same_style else i % len(styles)
                ],
                color=f"C{i % 10}" if by_run else f"C{k - 1}",
                marker="o" if len(pts) < 30 else None,
                ms=3,
                label=(f"position {k}" if i == 0 else "_nolegend_")
                if args.same_style
                else f"{label}, position {k}",
            )
    ax.set_xlabel("training tokens (millions)")
    what = "top-1 agreement" if args.metric == "top1" else "acceptance given earlier positions"
    ax.set_ylabel(f"validation {what}")
    ax.set_ylim(0, args.ymax)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, ncol=2)
    ax.set_title(args.title or f"validation {what} by draft position", fontsize=10)
    fig.tight_layout()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(args.out, dpi=120)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
