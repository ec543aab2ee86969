"""Training throughput, online target features vs the offline feature cache.

    python scripts/bench_train_throughput.py [--steps 30] [--records 200] [hydra overrides...]

Runs the same EAGLE-1 training twice on the embedded target and ShareGPT (unless overridden):
once computing target features every step, once from the safetensors feature cache (built
first; its build time is reported separately). Prints a markdown table of tokens/s (the mean
over logged windows after the first, which holds warm-up) and the cache's bytes per token.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from hydra import compose, initialize_config_dir  # noqa: E402

import trainer.train as tt  # noqa: E402

CONF = Path(__file__).resolve().parents[1] / "conf"


def one(overrides: list[str]) -> tuple[float, float, Path]:
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        cfg = compose("train", overrides=overrides)
    t = time.perf_counter()
    tt.run(cfg)
    wall = time.perf_counter() - t
    out = Path(cfg.output_dir)
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    tps = [r["tokens_per_s"] for r in rows if "tokens_per_s" in r][1:]
    return sum(tps) / max(1, len(tps)), wall, out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--records", type=int, default=200)
    args, extra = ap.parse_known_args()
    tmp = Path(tempfile.mkdtemp(prefix="bench-train-"))
    base = [
        "method=eagle1",
        f"data.max_records={args.records}",
        "data.max_length=512",
        "data.batch_size=4",
        f"train.max_steps={args.steps}",
        "train.log_every=5",
        "train.eval_every=0",
        "train.save_every=0",
        "data.max_val_records=8",
        f"data.cache_dir={tmp / 'cache'}",
        *extra,
    ]
    online, _, _ = one(base + [f"output_dir={tmp / 'online'}"])
    t = time.perf_counter()
    cached, wall_c, out = one(base + [f"output_dir={tmp / 'cached'}", "data.cache_features=true"])
    feats = sorted((tmp / "cache" / "features").iterdir())
    bpt = json.loads((feats[0] / "done.json").read_text())["bytes_per_token"]
    size = sum(f.stat().st_size for d in feats for f in d.iterdir())
    print(
        f"\nmachine: {platform.processor() or platform.machine()}, "
        f"{torch.get_num_threads()} torch threads, torch {torch.__version__}"
    )
    print("| mode | training tokens/s |")
    print("|---|---|")
    print(f"| online (target forward every step) | {online:.0f} |")
    print(f"| cached features | {cached:.0f} |")
    print(
        f"\ncache: {bpt} bytes/token, {size / 2**20:.1f} MiB on disk; "
        f"cached run incl. building the cache took {time.perf_counter() - t:.0f}s"
    )


if __name__ == "__main__":
    main()
