"""The host's work in the batched decoder, apart from the forwards: what a GPU cannot hide.

A GPU replays a 135M target's step as one graph in ~4 ms, so the Python around it (building a
verification's inputs, accepting each row, the goodput policy's choice, a drafter's inputs)
decides how much of the card is used. This times that work on any machine with the tiny random
target (3 layers, hidden 64), whose forwards are small enough for the host's share to show:

    python scripts/bench_host.py                  # all parts, medians of 5 runs
    python scripts/bench_host.py --parts plain    # plain | drafter | batched_draft | single |
                                                  # accept | launches | regen

  plain          BatchDecoder on the static batch cache (eager), B = 16, 32 requests x 64
                 tokens, no draft: ms of host work an iteration (wall time less the forwards
                 and prefills the decoder reports)
  drafter        the same with an EAGLE head attached and the goodput policy held at plain
                 every iteration (as the H100 ran it, docs/benchmarks.md, 2026-11-27/28)
  batched_draft  the fixed-shape batched EAGLE chain (16 rows, a chain of 3): a proposal's
                 time less its function's (the committed pairs, the inputs' copies)
  single         the batch-1 decoder (the same loop with one row), 16 prompts x 64 tokens on
                 the static cache (eager) and on transformers': ms an iteration outside the
                 forwards, prefills and drafting, plain and with an EAGLE chain of 3
  accept         T = 1: one iteration's acceptance step (``verify.accept_rows``) row by row on
                 the host, and the batch at once on the device with one read
                 (``sampled_on_device``), over the embedded target's 49,152 tokens: ms here,
                 and the aten operations and reads of the device it makes (on a GPU each
                 operation is a launch and each read a wait; ``--device cuda`` times it there)
  launches       the loop on fixed shapes (compile=emulate) at B = 1 (plain, an EAGLE chain of
                 3, an EAGLE-2 tree) and B = 8 (the batched chain of 3), T = 0 and 1: an
                 iteration's operations outside its graphs, reads of the device and graph
                 replays (what a GPU's host does around the graphs)
  regen          the data generator's loop (specdraft-prepare): nothing drafted, 512 rows
                 (--rows) with continuous batching, 2,048 requests of ShareGPT-like budgets
                 (<= 256 tokens): tokens/s, ms a step and the host's ms a step (--device cuda:
                 on the static cache's CUDA graphs); not in the default parts

Run it alone on the machine (a second busy process slows small forwards 10-70x on 2 cores).
"""

from __future__ import annotations

import argparse
import functools
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
    from decoding.costs import StepCostModel
    from decoding.decoder import NoDraft
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
        d.run(reqs, 64)
        s = d.stats
        host.append(1e3 * s.host_seconds / s.forwards)
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


def part_regen(runs: int, device: str = "cpu", rows: int = 512) -> dict:
    """The data generator's loop (``flow/regenerate.py``): nothing drafted, ``rows`` rows
    with continuous batching (a finished reply's slot taken by the next request at once),
    4 x ``rows`` requests whose budgets mimic ShareGPT's first turns at 256 new tokens (half
    cut at 256, the rest ending anywhere), the collector's generations frozen as the
    generator freezes them. Reports tokens/s, ms a step and the host's ms a step (wall time
    less the forwards and prefills)."""
    import gc
    import random

    from decoding.batch import BatchDecoder
    from decoding.decoder import NoDraft
    from models.sampling import Sampling
    from models.target import GenRequest, TargetConfig, load_target

    torch.set_num_threads(1 if device == "cpu" else torch.get_num_threads())
    t = load_target(TargetConfig(name="tiny_random", dtype="float32", device=device))
    rng = random.Random(0)
    reqs = [
        GenRequest(
            i,
            [rng.randrange(5, 200) for _ in range(rng.randrange(20, 120))],
            max_new_tokens=rng.choice([256, rng.randrange(8, 256)]),
        )
        for i in range(4 * rows)
    ]
    d = BatchDecoder(t, NoDraft(), Sampling(), rows, gamma=0, admit=1, compile="auto", max_len=400)
    d.run(reqs[:rows], 8)  # warm-up (graphs captured on a GPU)
    gc.collect()
    gc.freeze()
    tok_s, step, host = [], [], []
    try:
        for _ in range(runs):
            d.run(reqs, 256)
            s = d.stats
            tok_s.append(s.tokens_per_second)
            step.append(1e3 * s.wall / s.forwards)
            host.append(1e3 * s.host_seconds / s.forwards)
    finally:
        gc.unfreeze()
    return {
        "rows": rows,
        "device": device,
        "tokens/s (median)": statistics.median(tok_s),
        "ms a step (median)": statistics.median(step),
        "host ms a step (median)": statistics.median(host),
        "host ms a step (runs)": host,
        "forwards a run": s.forwards,
        "prefills a run": s.prefills,
    }


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


def _accept_case(rows: int, tree: bool, V: int, dev: str, seed: int):
    """One iteration's rows at T = 1: a chain of 3 drafted from a q near the target's p, or a
    12-node tree of the target's likeliest tokens (point masses, as EAGLE-2 drafts)."""
    from models.base import Proposal

    g = torch.Generator().manual_seed(seed)
    # a tree: the root's 4 children, 4 under the first, 2 under its first, 1 under that, 1
    # under the root's second; a chain: 3 nodes
    parents = [-1, -1, -1, -1, 0, 0, 0, 0, 4, 4, 8, 1] if tree else [-1, 0, 1]
    n = len(parents)
    logits = torch.randn(rows, n + 1, V, generator=g) * 4
    props = []
    for b in range(rows):
        if tree:
            kids: dict[int, list[int]] = {}
            for i, par in enumerate(parents):
                kids.setdefault(par, []).append(i)
            tokens = [0] * n
            for par, ch in kids.items():
                top = logits[b, par + 1].topk(len(ch)).indices.tolist()
                for i, t in zip(ch, top, strict=True):
                    tokens[i] = t
            props.append(Proposal(tokens, parents))
        else:
            q = (logits[b, :n] + torch.randn(n, V, generator=g)).softmax(-1)
            toks = [int(torch.multinomial(q[i], 1, generator=g)) for i in range(n)]
            props.append(Proposal.chain(toks, q.to(dev)))
    return props, logits.to(dev)


def _count_ops_and_reads(fn) -> tuple[int, int, int]:
    """The aten operations ``fn()`` dispatches that are not views (on a GPU, each a kernel's
    launch), its reads of the device (``item``-like scalar reads and ``tolist``: on a CPU
    neither waits, on a GPU each waits for the work queued before it) and its graph replays,
    whose own operations are not counted (a CUDA graph replays them as one launch)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    import models.lean as lean

    class Count(TorchDispatchMode):
        ops = reads = replays = paused = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if self.paused:
                pass
            elif func is torch.ops.aten._local_scalar_dense.default:
                self.reads += 1
            elif not func.is_view:  # a view launches nothing
                self.ops += 1
            return func(*args, **(kwargs or {}))

    count, tolist, replay = Count(), torch.Tensor.tolist, lean.Captured.__call__

    def counted(self):
        count.reads += not count.paused
        return tolist(self)

    def replayed(self):
        count.replays += not count.paused
        count.paused += 1
        try:
            return replay(self)
        finally:
            count.paused -= 1

    torch.Tensor.tolist, lean.Captured.__call__ = counted, replayed
    try:
        with count:
            fn()
    finally:
        torch.Tensor.tolist, lean.Captured.__call__ = tolist, replay
    return count.ops, count.reads, count.replays


def _streams(rows: int, device: str, seed: int) -> list[torch.Generator]:
    return [torch.Generator(device=device).manual_seed(1000 * seed + b) for b in range(rows)]


def part_accept(runs: int, device: str = "cpu") -> dict:
    from decoding.verify import AcceptRule, accept_rows
    from models.sampling import Sampling

    rule = AcceptRule(Sampling(1.0))
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    out = {}
    for rows, tree in ((1, False), (1, True), (16, False), (16, True)):
        what = f"B = {rows}, {'a 12-node tree' if tree else 'a chain of 3'}"
        cases = [_accept_case(rows, tree, 49152, device, s) for s in range(runs * 4)]
        for on_device in (False, True):
            accept_rows(rule, *cases[0], _streams(rows, device, 0), on_device)  # warm-up
            per = []
            for i, (props, logits) in enumerate(cases):
                gs = _streams(rows, device, i)
                sync()
                t = time.perf_counter()
                accept_rows(rule, props, logits, gs, on_device)
                sync()
                per.append(1e3 * (time.perf_counter() - t))
            args = (rule, *cases[1], _streams(rows, device, 1), on_device)
            ops, reads, _ = _count_ops_and_reads(functools.partial(accept_rows, *args))
            where = "device" if on_device else "host"
            out[f"{what}, {where}: ms (median) / aten ops / reads"] = [
                round(statistics.median(per), 3),
                ops,
                reads,
            ]
    return out


def part_launches() -> dict:
    """The batch-1 loop on fixed shapes (``compile=emulate``: the graph path's buffers run
    eagerly), tiny target, 4 prompts x 32 tokens: an iteration's operations outside its
    graphs, reads of the device and graph replays, prefills included, at T = 0 and T = 1
    (rejection sampling row by row on the host, or on the device)."""
    from decoding.batch import BatchDecoder
    from decoding.decoder import NoDraft, SpeculativeDecoder
    from models.base import DecodeSettings
    from models.eagle import Eagle1Config, EagleHead
    from models.sampling import Sampling

    t, reqs = _setup()
    prompts = [r.prompt for r in reqs[:4]]
    torch.manual_seed(0)
    head = EagleHead(t, Eagle1Config()).eval()
    tree = DecodeSettings(tree="dynamic", depth=4, top_k=4, total_tokens=12)
    out = {}
    for name, prop, kw in (
        ("plain", NoDraft(), {}),
        ("EAGLE chain of 3", head.proposer(), {"gamma": 3, "adaptive": False}),
        ("EAGLE-2 tree (4, 4, 12)", head.proposer(tree), {"gamma": 4, "adaptive": False}),
    ):
        for temp, where in ((0.0, None), (1.0, False), (1.0, True)):
            BatchDecoder.sample_on_device = where
            try:
                dec = SpeculativeDecoder(
                    t, prop, Sampling(temp), calibrate=False, compile="emulate", **kw
                )
                dec.generate(prompts[0], 8)  # warm-up
                its = []

                def run(dec=dec, its=its):
                    for p in prompts:
                        dec.generate(p, 32)
                        # every iteration of the loop: the first token's one too
                        its.append(dec.last.target_calls + dec.last.first_tokens)

                ops, reads, replays = _count_ops_and_reads(run)
            finally:
                BatchDecoder.sample_on_device = None
            n = sum(its)
            how = "" if where is None else (", sampled on the device" if where else ", on the host")
            out[f"B = 1, {name}, T = {temp:g}{how}: ops / reads / replays an iteration"] = [
                round(ops / n, 1),
                round(reads / n, 2),
                round(replays / n, 2),
            ]
    # B = 8: the batched loop, its static batch cache and the batched chain on fixed shapes
    for temp, where in ((0.0, None), (1.0, False), (1.0, True)):
        BatchDecoder.sample_on_device = where
        try:
            dec = BatchDecoder(
                t, head.proposer(), Sampling(temp), 8, gamma=3, compile="emulate", calibrate=False
            )
            dec.run(reqs[:8], 8)  # warm-up
            ops, reads, replays = _count_ops_and_reads(lambda dec=dec: dec.run(reqs[:16], 32))
        finally:
            BatchDecoder.sample_on_device = None
        n = dec.stats.forwards
        how = "" if where is None else (", sampled on the device" if where else ", on the host")
        out[f"B = 8, EAGLE chain of 3, T = {temp:g}{how}: ops / reads / replays a forward"] = [
            round(ops / n, 1),
            round(reads / n, 2),
            round(replays / n, 2),
        ]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--parts", default="plain,drafter,batched_draft,single")
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--out", type=Path)
    ap.add_argument("--device", default="cpu", help="where parts accept and regen run")
    ap.add_argument("--rows", type=int, default=512, help="part regen's batch")
    a = ap.parse_args()
    known = {
        "plain": lambda: part_loop(False, a.runs),
        "drafter": lambda: part_loop(True, a.runs),
        "batched_draft": lambda: part_batched_draft(a.runs),
        "single": lambda: part_single(a.runs),
        "accept": lambda: part_accept(a.runs, a.device),
        "launches": part_launches,
        "regen": lambda: part_regen(a.runs, a.device, a.rows),
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
    from decoding.contention import measured

    measured(main)
