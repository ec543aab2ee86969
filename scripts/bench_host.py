"""The host's work in the batched decoder, apart from the forwards: what a GPU cannot hide.

A GPU replays a 135M target's step as one graph in ~4 ms, so the Python around it (building a
verification's inputs, accepting each row, the goodput policy's choice, a drafter's inputs)
decides how much of the card is used. This times that work on any machine with the tiny random
target (3 layers, hidden 64), whose forwards are small enough for the host's share to show:

    python scripts/bench_host.py                  # all parts, medians of 5 runs
    python scripts/bench_host.py --parts plain    # plain | drafter | batched_draft | single

  plain          BatchDecoder on the static batch cache (eager), B = 16, 32 requests x 64
                 tokens, no draft: ms of host work an iteration (wall time less the forwards
                 and prefills the decoder reports)
  drafter        the same with an EAGLE head attached and the goodput policy held at plain
                 every iteration (as the H100 ran it, docs/benchmarks.md part 4)
  batched_draft  the fixed-shape batched EAGLE chain (16 rows, a chain of 3): a proposal's
                 time less its function's (the committed pairs, the inputs' copies)
  single         the batch-1 decoder (the same loop with one row), 16 prompts x 64 tokens on
                 the static cache (eager) and on transformers': ms an iteration outside the
                 forwards, prefills and drafting, plain and with an EAGLE chain of 3

Run it alone on the machine (a second busy process slows small forwards 10-70x on 2 cores).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402


def _setup():
    from models.target import GenRequest, TargetConfig, load_target

    torch.set_num_threads(1)
    t = load_target(TargetConfig(name="tiny_random", dtype="float32"))
    g = torch.Generator().manual_seed(0)
    reqs = [
        GenRequest(i, torch.randint(5, 200, (20 + i % 7,), generator=g).tolist()) for i in range(32)
    ]
    return t, reqs


def part_loop(with_drafter: bool, runs: int) -> dict:
    from decoding.batch import BatchDecoder
    from decoding.batch_runner import StaticBatchRunner, batch_widths
    from decoding.decoder import NoDraft
    from decoding.policies import StepCostModel
    from models.eagle import Eagle1Config, EagleHead
    from models.ragged import prefill_waste
    from models.sampling import Sampling

    t, reqs = _setup()
    prop = EagleHead(t, Eagle1Config()).proposer() if with_drafter else NoDraft()
    r = StaticBatchRunner(
        t, tuple(prop.feature_layers), 16, batch_widths(4), "off", 512, prefill_waste(t.device)
    )
    if with_drafter:  # a step priced so that drafting never pays: plain every iteration
        d = BatchDecoder(
            t, prop, Sampling(), 16, gamma=3, policy="goodput",
            cost=StepCostModel.linear(10.0, 0.0), runner=r,
        )  # fmt: skip
        d.goodput.max_wait = d.goodput.probe_every = 10**6  # and no probes
    else:
        d = BatchDecoder(t, prop, Sampling(), 16, gamma=0, runner=r)
    d.run(reqs[:16], 8)  # warm-up
    host, fwd, choose = [], [], []
    for _ in range(runs):
        t0 = time.perf_counter()
        d.run(reqs, 64)
        wall = time.perf_counter() - t0
        s = d.stats
        host.append(1e3 * (wall - s.rows.t_target - s.rows.t_prefill) / s.forwards)
        fwd.append(1e3 * s.rows.t_target / s.forwards)
        choose.append(1e3 * s.rows.t_draft / s.forwards)
    out = {
        "host ms an iteration (median)": statistics.median(host),
        "host ms an iteration (runs)": host,
        "forward ms (median)": statistics.median(fwd),
    }
    if with_drafter:
        out["of which the policy's choice, ms (median)"] = statistics.median(choose)
    return out


def part_batched_draft(runs: int) -> dict:
    import models.lean as lean
    from models.base import DecodeState
    from models.eagle import Eagle1Config, EagleHead
    from models.eagle.static import StaticBatchedEagleChain
    from models.sampling import Sampling

    t, _ = _setup()
    head = EagleHead(t, Eagle1Config())
    layers = head.proposer().feature_layers
    g = torch.Generator().manual_seed(2)
    R, n = 16, 60
    states = []
    for _ in range(R):
        ids = torch.randint(5, 200, (n,), generator=g).tolist()
        x = torch.tensor([ids])
        f = t.features(x, torch.ones_like(x), layers)[0]
        states.append(DecodeState(ids, f[: n - 1], Sampling(), None, t.device))
    short = [DecodeState(s.ids[:-2], s.features[:-2], Sampling(), None, t.device) for s in states]
    bp = StaticBatchedEagleChain(head, R, 3, "emulate")
    fn_times: list[float] = []
    orig = lean.Captured.__call__

    def timed(self):  # the function alone, without the emulation's checks
        t0 = time.perf_counter()
        out = self.fn()
        fn_times.append(time.perf_counter() - t0)
        return out

    lean.Captured.__call__ = timed
    total = []
    try:
        with torch.no_grad():
            for _ in range(runs * 6):
                bp.reset()
                bp.join(short)
                t0 = time.perf_counter()
                bp.propose(states, [3] * R)
                total.append(time.perf_counter() - t0)
    finally:
        lean.Captured.__call__ = orig
    k = len(total) // 6  # the first sixth: warm-up
    host = [1e3 * (a - b) for a, b in zip(total[k:], fn_times[k:], strict=True)]
    return {"host ms a proposal (median)": statistics.median(host)}


def part_single(runs: int) -> dict:
    from decoding.decoder import NoDraft, SpeculativeDecoder
    from models.eagle import Eagle1Config, EagleHead
    from models.sampling import Sampling

    t, reqs = _setup()
    prompts = [r.prompt for r in reqs[:16]]
    torch.manual_seed(0)
    head = EagleHead(t, Eagle1Config()).eval()
    out = {}
    for name, prop, kw in (
        ("plain", NoDraft(), {}),
        ("EAGLE chain of 3", head.proposer(), {"gamma": 3, "adaptive": False}),
    ):
        for comp in ("true", "false"):
            dec = SpeculativeDecoder(t, prop, Sampling(), calibrate=False, compile=comp, **kw)
            dec.generate(prompts[0], 16)  # warm-up
            per = []
            for _ in range(runs):
                other, its = 0.0, 0
                for p in prompts:
                    dec.generate(p, 64)
                    s = dec.last
                    other += s.t_total - s.t_target - s.t_prefill - s.t_draft
                    its += s.target_calls
                per.append(1e3 * other / its)
            out[f"{name}, compile={comp}: host ms an iteration (median)"] = statistics.median(per)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--parts", default="plain,drafter,batched_draft,single")
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--out", type=Path)
    a = ap.parse_args()
    known = {
        "plain": lambda: part_loop(False, a.runs),
        "drafter": lambda: part_loop(True, a.runs),
        "batched_draft": lambda: part_batched_draft(a.runs),
        "single": lambda: part_single(a.runs),
    }
    res: dict = {
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "torch": torch.__version__,
    }
    for part in a.parts.split(","):
        if part not in known:
            ap.error(f"--parts: no part {part!r} (use {', '.join(known)})")
        res[part] = known[part]()
    text = json.dumps(res, indent=1)
    print(text)
    if a.out:
        a.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
