"""Decoding benchmark: specdraft-eval over several drafts and temperatures, one markdown table.

    python scripts/bench_decode.py --drafts ngram truncate:4 runs/x --temperatures 0 1 \
        [--num-prompts 8 --max-new-tokens 128 --bench mt_bench] [hydra overrides ...]
    python scripts/bench_decode.py --drafts "runs/e3;tree=dynamic;depth=5;top_k=8" runs/e3

A draft may carry its own eval overrides after ``;`` (e.g. a dynamic tree for one entry and a
chain for another). Each (draft, temperature) pair is one `specdraft-eval` run (plain decoding
and speculative decoding interleaved on the same prompts); reports are written to --out.
"""

from __future__ import annotations

import argparse
import json
import platform
import re
import sys
from datetime import date
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

CONF = Path(__file__).resolve().parents[1] / "conf"


def report_name(draft: str, tag: str, t: float, taken: set[str]) -> str:
    """A report's file name for a (draft, temperature) entry, unique in the run: two drafts
    whose folders end alike (``a/final``, ``b/final``) wrote one file, the first lost. A tag's
    paths (``disco=runs/x/disco``) are flattened into the name, not folders under ``--out``."""
    tag = re.sub(r"[^A-Za-z0-9._~-]+", "_", tag.replace(":", "")).strip("_")
    parts = [x for x in Path(draft).parts if x not in ("/", ".")] or [draft]
    for k in range(1, len(parts) + 1):
        name = f"{'-'.join(parts[-k:])}{'-' + tag if tag else ''}-T{t:g}".replace(":", "")
        if name not in taken:
            break
    i = 2
    while name in taken:  # the same draft twice
        name = f"{name.rsplit('~', 1)[0]}~{i}"
        i += 1
    taken.add(name)
    return name


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--drafts", nargs="+", required=True)
    ap.add_argument("--temperatures", nargs="+", type=float, default=[0.0, 1.0])
    ap.add_argument("--num-prompts", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--bench", default="mt_bench")
    ap.add_argument("--out", default="bench-decode")
    args, extra = ap.parse_known_args()
    # imported once the arguments are parsed: --help answers without loading torch
    import torch
    from hydra import compose, initialize_config_dir

    import decoding.eval as ev
    from decoding.settings import apply_saved_target

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    names: set[str] = set()
    for t in args.temperatures:
        for entry in args.drafts:
            d, *own = entry.split(";")
            tag = "-".join(o.split("=")[-1] for o in own)
            name = report_name(d, tag, t, names)
            overrides = [
                f"draft={d}",
                *own,
                f"temperature={t}",
                f"num_prompts={args.num_prompts}",
                f"max_new_tokens={args.max_new_tokens}",
                f"bench={args.bench}",
                f"report={out / name}.json",
                *extra,
            ]
            with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
                cfg = compose("eval", overrides=overrides)
            given = {o.split("=", 1)[0].lstrip("+~") for o in [*own, *extra]}
            try:  # a trained draft against its own target, as specdraft-eval does
                said = apply_saved_target(cfg, given)
                if said:
                    print(said)
                r = ev.evaluate(cfg)
            except ev.USER_ERRORS as e:
                sys.exit(f"error: {entry}: {e}")
            (out / f"{name}.json").write_text(json.dumps(r, indent=1))
            ev.plot_report(r, out / f"{name}.png")
            ev.print_report(r)
            rows.append((d, t, r))
    print(
        f"\n{date.today()}, {platform.machine()}, {torch.get_num_threads()} threads, "
        f"bench={args.bench}, {args.num_prompts} prompts, max_new_tokens={args.max_new_tokens}"
    )
    print(
        "| draft | T | tau | alpha | alpha by position | tok/s | AR tok/s | speedup | predicted "
        "| c | draft/iteration | gamma used | outside forwards | lossless |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    # (typical acceptance and lenience < 1: "lossless" is False and the mean per-token TVD from
    # the target, or at T = 0 the share of tokens that are not the target's argmax, follows in
    # brackets)

    def f(x, nd=2):
        return "-" if x is None else f"{x:.{nd}f}"

    for _d, t, r in rows:
        pos = " ".join(f(a) for a in (r["alpha_per_position"] or [])[:5])
        desc = r["settings"]["draft_description"]
        if r.get("lenience", 1.0) < 1:
            desc += f", lenience {r['lenience']:g}"
        print(
            f"| {desc} | {t:g} | {f(r['tau'])} | {f(r['alpha'])} | "
            f"{pos} | {f(r['tokens_per_second'], 1)} | {f(r['ar_tokens_per_second'], 1)} | "
            f"{f(r['speedup'])} | {f(r['predicted_speedup'])} | {f(r['draft_cost_ratio'], 3)} | "
            f"{f(r.get('draft_cost_per_iteration'), 3)} | "
            f"{r['gamma_used']} | {f(100 * r['time_s']['other_fraction'], 1)}% | {r['lossless']}"
            + (
                f" ({r['divergences']} divergences, {r['near_tie_divergences']} near-ties)"
                if r.get("divergences")
                else ""
            )
            + (f" (TVD {r['mean_tvd']:.3f})" if r.get("mean_tvd") is not None else "")
            + (
                f" ({100 * r['off_argmax_rate']:.1f}% of tokens off the argmax)"
                if r.get("off_argmax_rate") is not None
                else ""
            )
            + " |"
        )


if __name__ == "__main__":
    from decoding.contention import measured

    measured(main)
