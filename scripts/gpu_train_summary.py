"""One JSON for a GPU training run (``scripts/gpu_train.sh``): the slice it regenerated,
training throughput and model FLOP utilisation, validation acceptance before and after, and the
MT-bench measurement of the new head; and ``lineage.json`` beside the run's ``final/``: the
learning curves behind the new head (those of the weights it started from, then its own), so
``scripts/plot_curves.py --lineage`` draws one curve through every run.

    python scripts/gpu_train_summary.py --run RUN_DIR --regen REGEN.meta.json \
        --eval eval_chain.json --device cuda --slice slice.json --out summary.json

Model FLOPs per training token (an estimate, written beside the figure): the frozen target's
forward, 2 x its parameters, plus the head's forward and backward, 6 x its trainable
parameters, once per training-time-test step (EAGLE-3's ``ttt_steps``; 1 for heads without
one). Utilisation: achieved FLOP/s over the card's dense bf16 peak (H100 / H200 SXM: 989
TFLOP/s); none on a CPU.

A file named on the line must be there and hold JSON (a missing, empty or malformed one is an
error, in one line, exit 2); a last ``metrics.jsonl`` line cut short (a run stopped while
writing it) is left out.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # plot_curves

PEAK_BF16 = {"H100": 989e12, "H200": 989e12}


class SummaryError(Exception):
    """Input a summary cannot be made from: one line saying why."""


def _json(path: Path, flag: str) -> dict:
    """The JSON object in ``path`` (named by ``flag`` on the line)."""
    if not path.is_file():
        raise SummaryError(f"{flag} {path}: no such file")
    try:
        text = path.read_text()
    except (OSError, UnicodeDecodeError) as e:
        raise SummaryError(f"{flag} {path}: cannot read it ({e})") from None
    if not text.strip():
        raise SummaryError(f"{flag} {path}: empty")
    try:
        data = json.loads(text)
    except ValueError as e:
        raise SummaryError(f"{flag} {path}: not JSON ({e})") from None
    if not isinstance(data, dict):
        raise SummaryError(f"{flag} {path}: not a JSON object")
    return data


def _rows(path: Path) -> list[dict]:
    from plot_curves import read_rows

    try:
        return [r for _, r in read_rows(path)]  # a last line cut short is left out
    except SystemExit as e:
        raise SummaryError(str(e.code)) from None


def _val(rows: list[dict]) -> list[dict]:
    keep = ("step", "tokens")
    return [
        {k: v for k, v in r.items() if k in keep or k.startswith("val/alpha_pos")}
        for r in rows
        if any(k.startswith("val/alpha_pos") for k in r)
    ]


def summarise(
    run: Path,
    regen: Path | None,
    ev: Path | None,
    device: str,
    slice_file: Path | None = None,
) -> dict:
    from safetensors import safe_open

    if not run.is_dir():
        raise SummaryError(f"--run {run}: no such folder")
    for need in ("summary.json", "final/config.json", "final/model.safetensors"):
        if not (run / need).is_file():
            raise SummaryError(f"--run {run}: no {need} (not a finished training run)")
    # the files named on the line, read before anything else
    regenerated = _json(regen, "--regen") if regen is not None else None
    sliced = _json(slice_file, "--slice") if slice_file is not None else None
    evaluated = _json(ev, "--eval") if ev is not None else None
    metrics = run / "metrics.jsonl"  # none where the run stopped before its first logged step
    rows = _rows(metrics) if metrics.is_file() else []
    run_summary = _json(run / "summary.json", "--run")
    target_params = run_summary.get("target_params")
    train = [r for r in rows if "tokens_per_s" in r]
    cfg = _json(run / "final" / "config.json", "--run")
    with safe_open(str(run / "final" / "model.safetensors"), "pt") as f:
        # the head's weights: floating tensors (EAGLE-3's vocabulary maps are integer buffers)
        head_params = sum(
            math.prod(f.get_slice(k).get_shape())
            for k in f.keys()
            if f.get_slice(k).get_dtype() in ("F32", "BF16", "F16")
        )
    ttt = cfg.get("method", {}).get("ttt_steps", 1)
    out: dict = {"method": cfg.get("specdraft", {}).get("method"), "target": cfg.get("target")}
    if regenerated is not None:
        out["regenerated"] = regenerated
    if sliced is not None:
        out["slice"] = sliced
    if train:
        tps = statistics.median(r["tokens_per_s"] for r in train[1:] or train)
        out["train"] = {
            "steps": train[-1].get("step"),
            "tokens": train[-1].get("tokens"),
            "elapsed_s": train[-1].get("elapsed_s"),
            "tokens_per_s_median": tps,
            "head_trainable_params": head_params,
            "ttt_steps": ttt,
            "target_params": target_params,
            "stopped": run_summary.get("reason"),
        }
        if target_params:
            flops = 2 * target_params + 6 * head_params * ttt
            out["train"]["model_flops_per_token"] = flops
            out["train"]["model_flops_note"] = (
                "2 x target params (frozen forward) + 6 x head params x ttt_steps"
            )
            name = torch.cuda.get_device_name(0) if device.startswith("cuda") else ""
            peak = next((v for k, v in PEAK_BF16.items() if k in name), None)
            out["train"]["device"] = name or device
            if peak:
                out["train"]["mfu"] = tps * flops / peak
    out["validation"] = _val(rows)
    if evaluated is not None:
        keep = (
            "tau",
            "alpha",
            "alpha_per_position",
            "speedup",
            "decode_speedup",
            "speedup_bound",
            "lossless",
            "lossless_note",
            "decoder",
            "tokens_per_second",
            "ar_tokens_per_second",
        )
        out["mt_bench_chain3_t0"] = {k: evaluated.get(k) for k in keep}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--run", required=True)
    ap.add_argument("--regen", default=None)
    ap.add_argument("--eval", default=None)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--slice", default=None, help="the slice.json gpu_train.sh writes")
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    try:
        s = summarise(
            Path(a.run),
            Path(a.regen) if a.regen else None,
            Path(a.eval) if a.eval else None,
            a.device,
            Path(a.slice) if a.slice else None,
        )
        before = (s.get("slice") or {}).get("lineage") or []
        if not isinstance(before, list) or not all(
            isinstance(c, list)
            and len(c) == 2
            and isinstance(c[0], str)
            and isinstance(c[1], (int, float))
            for c in before
        ):
            raise SummaryError(f"--slice {a.slice}: lineage is {before!r}, not [[file, tokens]]")
        text = json.dumps(s, indent=1)
        try:
            Path(a.out).write_text(text)
        except OSError as e:
            raise SummaryError(f"--out {a.out}: cannot write it ({e.strerror})") from None
        print(text)
        write_lineage(Path(a.run), before)
    except SummaryError as e:
        print(f"gpu_train_summary: {e}", file=sys.stderr)
        sys.exit(2)


def write_lineage(run: Path, before: list[list]) -> None:
    """``run/lineage.json``: the curves of the weights the run started from, then its own
    ``metrics.jsonl`` after their training tokens."""
    from plot_curves import curve_end

    metrics = run / "metrics.jsonl"
    if not metrics.is_file():
        return
    curves = [list(c) for c in before]
    try:
        offset = curves[-1][1] + curve_end(Path(curves[-1][0])) if curves else 0.0
    except SystemExit as e:  # the earlier run's metrics cannot be read
        raise SummaryError(str(e.code)) from None
    curves.append([str(metrics.resolve()), offset])
    (run / "lineage.json").write_text(json.dumps({"curves": curves}, indent=1))


if __name__ == "__main__":
    main()
