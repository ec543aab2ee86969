"""Time one draft step of an EAGLE head with its weights as loaded (bf16) and as int8
(``draft_weights=int8``, models/quant.py), at the decoder's shapes: 1 and 4 query rows after a
300-token draft context, with the head's weights in cache ("hot") and after a 160 MB buffer has
been rewritten, as the target's forward does between two draft steps ("evicted").

    python scripts/bench_draft_weights.py                    # the shipped smollm2-eagle3 head
    python scripts/bench_draft_weights.py --draft runs/x --threads 2

Prints median milliseconds for the step (decoder layer) and for the step plus the draft's top-4
over its vocabulary, and how often the int8 head's top-1 token agrees with the full head's on
a prompt's positions (one teacher-forced step). Run it alone on the machine.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--draft", default="smollm2-eagle3")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--context", type=int, default=300)
    ap.add_argument("--reps", type=int, default=200)
    args = ap.parse_args()
    # imported once the arguments are parsed: --help answers without loading torch
    import torch

    from decoding.drafts import load_proposer
    from models.base import DecodeSettings, crop_cache
    from models.target import TargetConfig, load_target

    torch.set_num_threads(args.threads)
    target = load_target(TargetConfig())
    # the same loader as specdraft-eval, once each way (an error if int8 cannot run here)
    head_full = load_proposer(args.draft, target, tree=DecodeSettings(draft_weights="full"))[0].head
    prop, desc = load_proposer(args.draft, target, tree=DecodeSettings(draft_weights="int8"))
    head_int8 = prop.head
    print(f"draft: {desc}; target dtype {target.dtype}; {args.threads} threads")
    H, dt, ctx = target.hidden_size, target.dtype, args.context
    evictor = torch.empty(40_000_000)  # 160 MB, more than any last-level cache here
    g = torch.Generator().manual_seed(0)

    def bench(head, rows: int, evict: bool, top: bool) -> float:
        from transformers import DynamicCache

        cache = DynamicCache()
        with torch.no_grad():
            x = torch.randn(1, ctx, H, generator=g).to(dt)
            head.step(x, x, torch.arange(ctx)[None], None, cache)
            h = torch.randn(1, rows, H, generator=g).to(dt)
            e = torch.randn(1, rows, H, generator=g).to(dt)
            pos = torch.full((1, rows), ctx)
            mask = torch.ones(1, 1, rows, ctx + rows, dtype=torch.bool) if rows > 1 else None
            times = []
            for _ in range(args.reps):
                if evict:
                    evictor.fill_(1.0)
                t = time.perf_counter()
                out = head.step(h, e, pos, mask, cache)
                if top:
                    head.top_tokens(out[0], 4)
                times.append(time.perf_counter() - t)
                crop_cache(cache, ctx)
        times.sort()
        return 1000 * times[len(times) // 2]

    print(f"{'rows':>4} {'cache':>8} {'what':>10} {'full ms':>8} {'int8 ms':>8} {'ratio':>6}")
    for rows in (1, 4):
        for evict in (False, True):
            for top in (False, True):
                a = bench(head_full, rows, evict, top)
                b = bench(head_int8, rows, evict, top)
                what = "step+top4" if top else "step"
                where = "evicted" if evict else "hot"
                print(f"{rows:>4} {where:>8} {what:>10} {a:8.3f} {b:8.3f} {a / b:6.2f}")
    with torch.no_grad():  # the two heads' top-1 after one teacher-forced step on real text
        from data.chat import prompt_ids

        text = "Explain how a speculative decoder keeps the target's output distribution."
        ids = prompt_ids(target.tokenizer, [{"role": "user", "content": text}])
        ids = torch.tensor([ids], device=target.device)
        feats = target.features(ids, torch.ones_like(ids), tuple(head_full.feature_layers))[0]
        pos = torch.arange(ids.shape[1] - 1)[None]
        tops = []
        for head in (head_full, head_int8):
            h0 = head.initial_hidden(feats[:-1])[None]
            out = head.step(h0, head._embed(ids[:, 1:]), pos, None)
            tops.append(head.top_tokens(out[0], 1)[1][:, 0])
        agree = (tops[0] == tops[1]).float().mean()
    print(f"top-1 agreement of the full and int8 heads over {len(tops[0])} positions: {agree:.3f}")


if __name__ == "__main__":
    from decoding.contention import measured

    measured(main)
