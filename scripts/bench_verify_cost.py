"""What verifying k tokens costs against one plain step, on this machine, in the target's own
dtype: the same measurement the decoder's controller calibrates with
(``SpeculativeDecoder.forward_costs``: k new tokens after a 256-token context, median of
``--reps``). Run it alone on the machine.

    python scripts/bench_verify_cost.py [--max 16] [--reps 7] [target.path=...]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--max", type=int, default=16, help="largest k")
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--path", default=None, help="an HF target folder (default: the embedded one)")
    a = ap.parse_args()
    # imported once the arguments are parsed: --help answers without loading torch
    import torch

    from decoding.decoder import NoDraft, SpeculativeDecoder
    from models.sampling import Sampling
    from models.target import TargetConfig, load_target

    t = load_target(TargetConfig(path=a.path, name="hf" if a.path else "smollm2_135m"))
    print(f"target {t.identity} on {t.device} {t.dtype}, {torch.get_num_threads()} threads")
    dec = SpeculativeDecoder(t, NoDraft(), Sampling(), gamma=0, adaptive=False, calibrate=False)
    sizes = list(range(1, a.max + 1))
    costs = dec.forward_costs(sizes, prefix=256, reps=a.reps)
    for n, s in zip(sizes, costs, strict=True):
        print(f"{n:3d} tokens {s * 1e3:8.1f} ms  {s / costs[0]:.2f}x one token")


if __name__ == "__main__":
    from decoding.contention import measured

    measured(main)
