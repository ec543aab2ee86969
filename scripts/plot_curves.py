"""Learning curves: validation acceptance per draft position against training tokens.

    python scripts/plot_curves.py RUN_DIR [RUN_DIR ...] --out docs/curves.png \
        [--labels "EAGLE-3" "EAGLE-1"] [--metric alpha] [--positions 5] [--offsets 0 2.8e6]

Reads each run's ``metrics.jsonl`` (every row carries ``tokens``, the training tokens seen so
far, so a resumed run's curve continues where it stopped; a RUN may also name a metrics
``.jsonl`` file itself; a last line cut short, by a crash or a run still writing, is left out)
and plots ``val/top1_pos{k}`` (``--metric top1``: agreement with the target's argmax at draft
position k; Medusa's heads log it as ``val/top1_head{k}``, the MLP speculator's stages as
``val/top1_stage{k}``) or ``val/alpha_pos{k}`` (``--metric alpha``: the same given positions
1..k-1 agreed, EAGLE's n-alpha; Medusa has none) for k = 1..positions, one colour per
position, one line style per run (with more runs than line styles: one colour per run, one
line style per position); or ``val/chain3_alpha`` (``--metric chain3``: what a chain of 3
decoding the validation text at T = 0 accepts, the figure to compare with a decoder's; the
EAGLE family and the MLP speculator log it), one curve a run. A run with none of these is an
error, not an empty plot.

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
import re
from pathlib import Path

# per metric, the names a method logs it by: val/{metric}_{name}{k}, and what k counts
NAMES = {"top1": ("pos", "head", "stage"), "alpha": ("pos",)}
WORDS = {"pos": "position", "head": "head", "stage": "stage"}
CHAIN = "chain of 3"  # --metric chain3: one curve a run, val/chain3_alpha


def _number(v: object) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def read_rows(path: Path) -> list[tuple[int, dict]]:
    """A metrics file's rows, each with its line number. A last line cut short (a run that
    crashed or is still writing) is left out; a malformed line before it is an error."""
    try:
        lines = [(i, x) for i, x in enumerate(path.read_text().splitlines(), 1) if x.strip()]
    except (OSError, UnicodeDecodeError) as e:
        raise SystemExit(f"{path}: cannot read it ({e})") from None
    rows = []
    for i, x in lines:
        try:
            r = json.loads(x)
        except ValueError as e:
            if i == lines[-1][0]:
                break  # cut short
            raise SystemExit(f"{path}:{i}: not a JSON line ({e})") from None
        if not isinstance(r, dict):
            raise SystemExit(f"{path}:{i}: not a JSON object")
        rows.append((i, r))
    return rows


def _found(keys: set[str]) -> str:
    """``val/top1_head1``, ``val/top1_head2``, ... as ``val/top1_head1..2``."""
    groups: dict[str, list[int]] = {}
    for k in keys:
        m = re.fullmatch(r"(.*?)(\d+)", k)
        prefix, n = (m[1], int(m[2])) if m else (k, None)
        groups.setdefault(prefix, []).append(n)
    out = []
    for prefix, ns in sorted(groups.items()):
        ks = sorted(n for n in ns if n is not None)
        out += [prefix] if None in ns else []
        out += [f"{prefix}{ks[0]}..{ks[-1]}" if len(ks) > 1 else f"{prefix}{ks[0]}"] if ks else []
    return ", ".join(out)


def run_curves(
    run: Path, metric: str, positions: int
) -> tuple[str, dict[int, list[tuple[float, float]]]]:
    """What k counts in ``run``'s metric (position, head, stage) and, for k = 1..positions,
    its (training tokens, value) points; an error naming what the file holds where it has
    none of them."""
    path = run if run.suffix == ".jsonl" else run / "metrics.jsonl"
    if not path.is_file():
        raise SystemExit(f"{path}: no metrics file (a run directory or a .jsonl file)")
    by_step: dict[float, dict] = {}
    for i, r in read_rows(path):
        if "step" not in r:
            raise SystemExit(f"{path}:{i}: a row without 'step'")
        for k, v in r.items():
            checked = k == "step" or (k == "tokens" or k.startswith("val/")) and v is not None
            if checked and not _number(v):
                raise SystemExit(f"{path}:{i}: {k} is {v!r}, not a number")
        by_step.setdefault(r["step"], {}).update(r)  # a step logged twice: the later row wins
    rows = [by_step[s] for s in sorted(by_step) if by_step[s].get("tokens") is not None]
    if metric == "chain3":  # one figure a validation, not one a position
        pts = [(r["tokens"], r["val/chain3_alpha"]) for r in rows if "val/chain3_alpha" in r]
        if pts:
            return CHAIN, {1: pts}
    for name in NAMES.get(metric, ()):
        out: dict[int, list[tuple[float, float]]] = {k: [] for k in range(1, positions + 1)}
        for r in rows:
            for k in out:
                v = r.get(f"val/{metric}_{name}{k}")
                if v is not None:
                    out[k].append((r["tokens"], v))
        if any(out.values()):
            return WORDS[name], out
    looked = " or ".join(f"val/{metric}_{name}{{k}}" for name in NAMES.get(metric, ()))
    looked = looked or "val/chain3_alpha"
    found = _found({k for r in rows for k in r if k.startswith("val/")})
    hint = "; --metric top1 plots these" if metric == "alpha" and "val/top1_" in found else ""
    raise SystemExit(
        f"{path}: nothing to plot: looked for {looked}, k = 1..{positions}, in rows that count "
        f"training tokens; found {found or 'no val/ metrics'}{hint}"
    )


def curves(run: Path, metric: str, positions: int) -> dict[int, list[tuple[float, float]]]:
    return run_curves(run, metric, positions)[1]


def curve_end(path: Path) -> float:
    """Training tokens at a metrics file's last row that counts them: where a run continuing
    from these weights starts."""
    rows = read_rows(path)
    return max((float(r["tokens"]) for _, r in rows if _number(r.get("tokens"))), default=0.0)


def read_lineage(path: Path) -> list[list]:
    """The curves a ``lineage.json`` lists, each as [metrics file, training tokens before
    it]; an error in one line where the file is missing or is not one."""
    shape = '{"curves": [[metrics file, training tokens before it], ...]}'
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise SystemExit(f"{path}: no such lineage file") from None
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise SystemExit(f"{path}: not a lineage file ({e})") from None
    curves_ = data.get("curves") if isinstance(data, dict) else None
    if not isinstance(curves_, list) or not curves_:
        raise SystemExit(f"{path}: not a lineage file (expected {shape})")
    for i, c in enumerate(curves_):
        if not (isinstance(c, list) and len(c) == 2 and isinstance(c[0], str) and _number(c[1])):
            raise SystemExit(f"{path}: curves[{i}] is {c!r}, expected [metrics file, tokens]")
    return curves_


def lineage(draft: Path) -> list[list]:
    """The learning curves behind the draft folder ``draft``, each as [metrics file, training
    tokens before it]: a GPU run's (the ``lineage.json`` beside its ``final`` folder), or a
    shipped draft's phases (its ``curve_phase*.jsonl``, one after another); [] where none is
    known."""
    lin = draft.parent / "lineage.json"
    if draft.name == "final" and lin.is_file():
        return read_lineage(lin)
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
    ap.add_argument("--metric", choices=["top1", "alpha", "chain3"], default="top1")
    ap.add_argument("--positions", type=int, default=5)
    ap.add_argument("--title", default=None)
    ap.add_argument("--offsets", nargs="*", type=float, help="training tokens before each run")
    ap.add_argument("--same-style", action="store_true", help="one line style for every run")
    ap.add_argument("--ymax", type=float, default=1.0, help="top of the y axis (default 1)")
    args = ap.parse_args()
    if args.positions < 1:
        raise SystemExit(f"--positions {args.positions}: at least 1")
    from decoding.report import plot_path_problem

    why = plot_path_problem(args.out)
    if why:
        raise SystemExit(f"--out {args.out}: {why}")
    if args.lineage is not None:
        curves_ = read_lineage(args.lineage)
        args.runs = [Path(p) for p, _ in curves_]
        args.offsets = [float(o) for _, o in curves_]
        args.same_style = True
    if not args.runs:
        raise SystemExit("name runs (or metrics files), or --lineage FILE")
    offsets = args.offsets or [0.0] * len(args.runs)
    if len(offsets) != len(args.runs):
        raise SystemExit(f"--offsets: {len(offsets)} values for {len(args.runs)} runs")
    # every run's curves first: a run with nothing to plot stops before a plot is written
    runs = [run_curves(run, args.metric, args.positions) for run in args.runs]
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = args.labels or [r.name for r in args.runs]
    if len(labels) != len(args.runs):
        raise SystemExit(f"--labels: {len(labels)} labels for {len(args.runs)} runs")
    styles = ["-", "--", ":", "-."]
    by_run = len(args.runs) > len(styles) and not args.same_style  # colours tell runs apart
    fig, ax = plt.subplots(figsize=(8, 4.8))
    for i, ((word, points), label, off) in enumerate(zip(runs, labels, offsets, strict=True)):
        if off:
            ax.axvline(off / 1e6, color="grey", ls=":", lw=1)
            ax.text(off / 1e6, 0.97, f" {label}", fontsize=7, va="top", color="grey")
        for k, pts in points.items():
            if not pts:
                continue
            xs, ys = zip(*pts, strict=True)
            curve = word if word == CHAIN else f"{word} {k}"  # the chain: one curve a run
            ax.plot(
                [(x + off) / 1e6 for x in xs],
                ys,
                styles[
                    (k - 1) % len(styles) if by_run else 0 if args.same_style else i % len(styles)
                ],
                color=f"C{i % 10}" if by_run else f"C{k - 1}",
                marker="o" if len(pts) < 30 else None,
                ms=3,
                label=(curve if i == 0 else "_nolegend_")
                if args.same_style
                else f"{label}, {curve}",
            )
    ax.set_xlabel("training tokens (millions)")
    what = {
        "top1": "top-1 agreement",
        "alpha": "acceptance given earlier positions",
        "chain3": "acceptance of a chain of 3 (T = 0)",
    }[args.metric]
    ax.set_ylabel(f"validation {what}")
    ax.set_ylim(0, args.ymax)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, ncol=2)
    by = "" if args.metric == "chain3" else " by draft position"
    ax.set_title(args.title or f"validation {what}{by}", fontsize=10)
    fig.tight_layout()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(args.out, dpi=120)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
