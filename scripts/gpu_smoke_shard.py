"""Smoke run of the sharded-target code path (trainer/shard.py) on one device, for a machine
with a single GPU (where ``accelerate launch`` cannot start the >= 2 processes that
``target.shard=fsdp`` asks for): one process in a world of one (NCCL on CUDA, gloo on a CPU),
a 4-layer tiny target sharded with FSDP2, features compared with the unsharded target's, then a
few EAGLE-3 training steps through the gathered embedding and LM head, against the same steps
on the unsharded target.

    python scripts/gpu_smoke_shard.py            # prints the differences and "smoke: ok"
"""

from __future__ import annotations

import argparse
import copy
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main() -> None:
    argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    ).parse_args()  # no options: --help answers before torch is imported
    import torch
    import torch.distributed as dist

    from models import METHODS
    from models.eagle.config import Eagle3Config
    from models.target import TargetConfig, load_target
    from trainer.shard import shard_target

    cuda = torch.cuda.is_available()
    device = torch.device("cuda:0" if cuda else "cpu")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29555")
    dist.init_process_group("nccl" if cuda else "gloo", rank=0, world_size=1)
    print(f"device: {torch.cuda.get_device_name(0) if cuda else 'cpu'}, torch {torch.__version__}")
    torch.manual_seed(0)
    cfg = TargetConfig(name="tiny_random", device=str(device), dtype="float32", tiny_layers=4)
    whole, sharded = load_target(cfg), load_target(cfg)
    ids = torch.randint(0, 250, (2, 48), device=device)
    mask = torch.ones_like(ids)
    layers = (1, 2, 3)
    want = whole.features(ids, mask, layers)
    report = shard_target(sharded, device, "fsdp")
    print(report.line())
    with sharded.gathered():
        got = sharded.features(ids, mask, layers)
    d_feat = (got - want).abs().max().item()
    print(f"features, sharded vs whole: max abs diff {d_feat:.2e}")

    mcfg = Eagle3Config(ttt_steps=3)
    a = METHODS["eagle3"](whole, mcfg).to(device)
    b = METHODS["eagle3"](sharded, mcfg).to(device)
    b.load_state_dict(copy.deepcopy(a.state_dict()))
    opt_a = torch.optim.AdamW(a.parameters(), lr=1e-3)
    opt_b = torch.optim.AdamW(b.parameters(), lr=1e-3)
    batch = {
        "input_ids": ids,
        "attention_mask": mask,
        "loss_mask": mask,
        "index": torch.arange(2, device=device),
    }
    worst = 0.0
    for step in range(5):
        la = _step(a, whole, batch, opt_a, None)
        lb = _step(b, sharded, batch, opt_b, sharded.gathered)
        worst = max(worst, abs(la - lb) / abs(la))
        print(f"step {step + 1}: loss whole {la:.6f}  sharded {lb:.6f}")
    print(f"loss, sharded vs whole over 5 steps: max relative diff {worst:.2e}")
    ok = d_feat <= 1e-5 and worst <= 1e-4
    print("smoke: ok" if ok else "smoke: FAILED")
    dist.destroy_process_group()
    sys.exit(0 if ok else 1)


def _step(method, target, batch, opt, gathered) -> float:
    import contextlib

    with gathered() if gathered else contextlib.nullcontext():
        b = dict(batch)
        b["features"] = target.features(b["input_ids"], b["attention_mask"], method.feature_layers)
        out = method(b)
        out.loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return out.loss.item()


if __name__ == "__main__":
    main()
