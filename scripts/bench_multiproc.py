"""One process vs several under ``accelerate launch --cpu``: throughput and parity.

    python scripts/bench_multiproc.py [--steps 20] [--records 400] [--nproc 2] [overrides...]

(``--cpu`` with several processes would need mpirun; ``--multi_gpu`` starts them through
torch-elastic, and with no CUDA each trains on the CPU over gloo, as ``scripts/accelerate/
cpu_2proc.yaml`` does.) Trains the same EAGLE-1 head twice on the embedded target with the same global batch: one
process with ``--nproc`` micro-batches of gradient accumulation (all cores as torch threads),
and ``--nproc`` processes (DDP over gloo, cores split between them). Feature noise is off, so
both runs take the same optimizer steps up to floating-point reduction order. Prints tokens/s
of each (mean over logged windows after the first), the largest relative difference between
the two final drafts' weights and both final validation agreements.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import load_file

ROOT = Path(__file__).resolve().parents[1]


def train(nproc: int, threads: int, out: Path, args: list[str]) -> float:
    cmd = [sys.executable, "-m", "flow"]
    if nproc > 1:
        cmd = [
            sys.executable,
            "-m",
            "accelerate.commands.launch",
            "--multi_gpu",  # the torch-elastic launcher; with no CUDA each process uses gloo
            "--num_processes",
            str(nproc),
            "--num_machines",
            "1",
            "--mixed_precision",
            "no",
            "--dynamo_backend",
            "no",
            "-m",
            "flow",
        ]
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    t = time.perf_counter()
    subprocess.run(
        [*cmd, *args, f"output_dir={out}", f"train.threads={threads}"],
        cwd=ROOT,
        env=env,
        check=True,
    )
    return time.perf_counter() - t


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--records", type=int, default=400)
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--micro-batch", type=int, default=2)
    a, extra = ap.parse_known_args()
    cores = os.cpu_count() or 1
    tmp = Path(tempfile.mkdtemp(prefix="bench-mp-"))
    base = [
        "method=eagle1",
        "method.noise=0.0",
        f"data.max_records={a.records}",
        "data.max_length=512",
        f"data.batch_size={a.micro_batch}",
        "data.max_val_records=32",
        f"train.max_steps={a.steps}",
        "train.log_every=5",
        "train.eval_every=0",
        "train.save_every=0",
        "train.progress=false",
        f"data.cache_dir={tmp / 'cache'}",
        *extra,
    ]
    one, many = tmp / "one", tmp / f"proc{a.nproc}"
    w1 = train(1, cores, one, [*base, f"train.grad_accum={a.nproc}"])
    wn = train(a.nproc, max(1, cores // a.nproc), many, base)

    def tps(d: Path) -> float:
        rows = [json.loads(x) for x in (d / "metrics.jsonl").read_text().splitlines()]
        v = [r["tokens_per_s"] for r in rows if "tokens_per_s" in r][1:]
        return sum(v) / max(1, len(v))

    def val(d: Path) -> dict:
        return json.loads((d / "summary.json").read_text())["val"]

    wa = load_file(str(one / "final" / "model.safetensors"))
    wb = load_file(str(many / "final" / "model.safetensors"))
    rel = max(float((wa[k] - wb[k]).norm() / wa[k].norm().clamp_min(1e-12)) for k in wa)
    print(
        f"\n{platform.machine()}, {cores} cores, torch {torch.__version__}; {a.steps} steps, "
        f"global batch {a.micro_batch * a.nproc} ({a.nproc} x {a.micro_batch})"
    )
    print("| run | tokens/s | wall (s) | val top1_pos1 | val top1_pos2 |")
    print("|---|---|---|---|---|")
    for name, d, w in (
        (f"1 process, {cores} threads, grad_accum {a.nproc}", one, w1),
        (f"{a.nproc} processes x {max(1, cores // a.nproc)} thread(s)", many, wn),
    ):
        v = val(d)
        print(
            f"| {name} | {tps(d):.0f} | {w:.0f} | {v.get('top1_pos1', float('nan')):.4f} | "
            f"{v.get('top1_pos2', float('nan')):.4f} |"
        )
    print(f"largest relative difference between the two final drafts' weights: {rel:.2e}")


if __name__ == "__main__":
    from decoding.contention import measured

    measured(main)
