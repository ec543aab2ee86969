"""Draws the plots of docs/results.md from the figures it reports (each row below names its
date and machine; docs/benchmarks.md has the command behind every one).

    python scripts/plot_results.py --out docs/figures
"""

from __future__ import annotations

import argparse
from pathlib import Path

# The shipped EAGLE-3 head on the embedded SmolLM2-135M target, MT-bench, T = 0: speedup over
# plain decoding in the same engine on the same machine. (label, speedup, engine, machine, date)
SPEEDUP = [
    ("built-in, tree (min_prob 0.04)", 1.53, "built-in", "AMD Zen 5, 2 cores", "2026-11-25"),
    ("built-in, no flags (saved tree)", 1.60, "built-in", "Intel AMX Xeon, 2 cores", "2026-11-27"),
    ("built-in, chain of 3", 1.26, "built-in", "AMD Zen 4, 2 cores", "2026-11-29"),
    ("built-in, chain of 3, CUDA graphs", 1.32, "built-in", "NVIDIA H100", "2026-11-27"),
    ("vLLM 0.32, chain of 3", 1.41, "vLLM", "AMD Zen 4, 2 cores", "2026-11-29"),
    (
        "llama.cpp b11434, n_max 3, p_min 0.6",
        0.91,
        "llama.cpp",
        "Intel AMX Xeon, 2 cores",
        "2026-11-27",
    ),
    ("llama.cpp b11434, n_max 3, p_min 0.6", 0.82, "llama.cpp", "AMD Zen 3, 2 cores", "2026-11-26"),
]

# Acceptance by draft position (conditional, alpha_k), chain of 3, MT-bench 80 x 128, T = 0.
ACCEPTANCE = [
    ("built-in decoder (bf16, Zen 4, 2026-11-29)", [0.426, 0.430, 0.449]),
    ("vLLM 0.32 (bf16, Zen 4, 2026-11-29)", [0.433, 0.436, 0.441]),
    ("built-in decoder (Zen 3, 2026-11-26)", [0.413, 0.416, 0.441]),
    ("llama.cpp b11434 (Zen 3, 2026-11-26)", [0.423, 0.435, 0.455]),
]

# Drafters at an equal CPU budget on the same data: validation top-1 at draft position 1.
# (method, top-1 pos 1, budget, machine, date)
METHODS = [
    ("EAGLE-3", 0.232, "20 min", "CPU-2", "2026-11-25"),
    ("HASS", 0.280, "20 min", "CPU-2", "2026-11-25"),
    ("MLP speculator", 0.175, "20 min", "CPU-2", "2026-11-25"),
    ("EAGLE-3", 0.121, "9 min", "Zen 3", "2026-11-26"),
    ("HASS", 0.160, "9 min", "Zen 3", "2026-11-26"),
    ("P-EAGLE", 0.147, "9 min", "Zen 3", "2026-11-26"),
    ("DFlash", 0.078, "9 min", "Zen 3", "2026-11-26"),
    ("Falcon", 0.050, "9 min", "Zen 3", "2026-11-26"),
]

COLORS = {"built-in": "#1f77b4", "vLLM": "#2ca02c", "llama.cpp": "#ff7f0e"}
PLOTS = ("results_speedup.png", "results_acceptance.png", "results_methods.png")
PNG = b"\x89PNG\r\n\x1a\n"  # the signature every PNG file starts with


def check_out(out: Path, force: bool) -> None:
    """Refuse, in one line, an --out that is not a folder, or one where a plot's name holds a
    file that is not a PNG (unless --force); earlier plots, PNGs, are replaced."""
    if out.exists() and not out.is_dir():
        raise SystemExit(f"--out {out}: a file, not a folder")
    for name in PLOTS:
        f = out / name
        if f.is_dir():
            raise SystemExit(f"--out {out}: {name} is a folder")
        if f.exists() and not force:
            try:
                with f.open("rb") as fh:
                    png = fh.read(len(PNG)) == PNG
            except OSError as e:
                raise SystemExit(f"--out {out}: cannot read {name} ({e.strerror})") from None
            if not png:
                raise SystemExit(
                    f"--out {out}: {name} is there and is not a PNG; use --force to replace it"
                )


def plot_speedup(out: Path) -> None:
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 3.8))
    labels = [f"{lab}\n{machine}, {date}" for lab, _, _, machine, date in SPEEDUP]
    vals = [s for _, s, *_ in SPEEDUP]
    colors = [COLORS[e] for _, _, e, *_ in SPEEDUP]
    y = range(len(SPEEDUP))[::-1]
    ax.barh(list(y), vals, color=colors)
    ax.set_yticks(list(y), labels, fontsize=7)
    ax.axvline(1.0, color="black", lw=0.8, ls="--")
    for yi, v in zip(y, vals, strict=True):
        ax.text(v + 0.02, yi, f"{v:.2f}x", va="center", fontsize=8)
    ax.set_xlabel("speedup over plain decoding in the same engine (MT-bench, T = 0)")
    ax.set_xlim(0, max(vals) * 1.15)
    ax.set_title("The shipped EAGLE-3 head on SmolLM2-135M, by engine and machine", fontsize=9)
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in COLORS.values()]
    ax.legend(handles, list(COLORS), fontsize=7, loc="lower right")
    fig.tight_layout()
    fig.savefig(out / "results_speedup.png", dpi=130)
    plt.close(fig)


def plot_acceptance(out: Path) -> None:
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.4))
    width = 0.8 / len(ACCEPTANCE)
    for i, (lab, vals) in enumerate(ACCEPTANCE):
        xs = [k + (i - (len(ACCEPTANCE) - 1) / 2) * width for k in range(len(vals))]
        ax.bar(xs, vals, width, label=lab)
    ax.set_xticks(range(3), ["position 1", "position 2", "position 3"])
    ax.set_ylabel("acceptance (conditional)")
    ax.set_ylim(0, 0.6)
    ax.set_title("One head, three engines: acceptance by draft position (chain of 3)", fontsize=9)
    ax.legend(fontsize=7, loc="upper left", ncol=2)
    fig.tight_layout()
    fig.savefig(out / "results_acceptance.png", dpi=130)
    plt.close(fig)


def plot_methods(out: Path) -> None:
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(8, 3.2), sharey=True)
    for ax, budget in zip(axes, ["20 min", "9 min"], strict=True):
        rows = [r for r in METHODS if r[2] == budget]
        ax.bar([r[0] for r in rows], [r[1] for r in rows], color="#1f77b4")
        ax.set_title(f"{budget} of CPU training each ({rows[0][3]}, {rows[0][4]})", fontsize=8)
        ax.tick_params(axis="x", labelsize=7, rotation=20)
    axes[0].set_ylabel("validation top-1, draft position 1")
    fig.suptitle("Drafters at an equal CPU budget on the embedded target", fontsize=9)
    fig.tight_layout()
    fig.savefig(out / "results_methods.png", dpi=130)
    plt.close(fig)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--out", type=Path, default=Path("docs/figures"), help="the folder of the plots"
    )
    ap.add_argument("--force", action="store_true", help="replace files that are not PNGs too")
    a = ap.parse_args()
    check_out(a.out, a.force)
    import matplotlib

    matplotlib.use("Agg")
    try:
        a.out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise SystemExit(f"--out {a.out}: cannot make the folder ({e.strerror})") from None
    plot_speedup(a.out)
    plot_acceptance(a.out)
    plot_methods(a.out)
    print(f"wrote {a.out}/results_speedup.png, results_acceptance.png, results_methods.png")


if __name__ == "__main__":
    main()
