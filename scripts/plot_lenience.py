"""Speed against distance from the target for a lenience sweep (specdraft-eval reports).

    python scripts/bench_decode.py --drafts "smollm2-eagle3;tree=chain" \
        "smollm2-eagle3;tree=chain;lenience=0.8" "smollm2-eagle3;tree=chain;lenience=0.5" \
        "smollm2-eagle3;tree=chain;lenience=0.3" --temperatures 0 1 --out bench-lenience
    python scripts/plot_lenience.py bench-lenience/*.json --out docs/figures/lenience.png

One line per temperature: speedup over plain decoding (y) against how far the output moved
(x): at T = 0 the share of emitted tokens that are not the target's argmax, at T > 0 the mean
per-token total variation distance from the target's own distribution. Each point is labelled
with its lenience l (l = 1: exact, distance 0).
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def distance(r: dict) -> float:
    if r.get("lenience", 1.0) >= 1.0:
        return 0.0
    if r.get("off_argmax_rate") is not None:
        return r["off_argmax_rate"]
    if r.get("mean_tvd") is not None:
        return r["mean_tvd"]
    raise SystemExit(f"report with lenience {r['lenience']} has no distance figure")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("reports", nargs="+")
    ap.add_argument("--out", default="lenience.png")
    args = ap.parse_args()
    from decoding.report import plot_path_problem

    why = plot_path_problem(Path(args.out))
    if why:
        raise SystemExit(f"--out {args.out}: {why}")
    lines: dict[float, list[tuple[float, float, float]]] = defaultdict(list)
    for path in args.reports:
        try:
            r = json.loads(Path(path).read_text())
        except (OSError, json.JSONDecodeError) as e:
            raise SystemExit(f"{path}: not a specdraft-eval report ({e})") from None
        if "speedup" not in r or "settings" not in r:
            raise SystemExit(f"{path}: not a specdraft-eval report (no speedup/settings)")
        t = float(r["settings"]["temperature"])
        lines[t].append((distance(r), r["speedup"], r.get("lenience", 1.0)))
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for t, pts in sorted(lines.items()):
        pts.sort()
        xs, ys, ls = zip(*pts, strict=True)
        label = "T = 0 (x: share of tokens off the argmax)" if t == 0 else f"T = {t:g} (x: TVD)"
        ax.plot(xs, ys, marker="o", label=label)
        for x, y, lv in pts:
            ax.annotate(f"l={lv:g}", (x, y), textcoords="offset points", xytext=(4, 4), fontsize=8)
    ax.axhline(1.0, color="grey", lw=0.8, ls="--")
    ax.set_xlabel("distance from the target's output (0 = lossless)")
    ax.set_ylabel("speedup over plain decoding")
    ax.set_title("Lenience: speed against fidelity")
    ax.legend(fontsize=8)
    fig.tight_layout()
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(args.out, dpi=120)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
