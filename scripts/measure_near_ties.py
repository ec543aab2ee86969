"""How much a target's logits move between a 1-token forward and a k-token forward: the basis
of the near-tie tolerance that ``lossless`` uses (decoding/eval.py NEAR_TIE_TOLERANCE).

    python scripts/measure_near_ties.py [--dtype bfloat16] [--prompts 16] [--tokens 128] \
        [--ks 2 4 8 16] [--bench spec_bench --skip 80] [--target-path DIR]

Plain greedy decoding (one token per forward, as the decoder's plain baseline does) records the
logits at each new position; the same sequence is then fed again after the same prefill in
chunks of k tokens (as a verification forward does) and the logits compared position by
position. Reported per k: the largest absolute change of any logit, of the chosen token's
logit, and of the top-1/top-2 gap, plus every position where the argmax itself changed, with
the 1-token logit gap between the two tokens there. A tolerance is safe when it is above every
such flip gap; a real bug moves a token by far more (its logit gap is typically several units).
By default the prompts are Spec-Bench questions after MT-bench's 80 (not the set the decoding
benchmarks report on).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--ks", nargs="+", type=int, default=[2, 4, 8, 16])
    ap.add_argument("--bench", default="spec_bench")
    ap.add_argument("--skip", type=int, default=80, help="questions to skip (MT-bench's 80)")
    ap.add_argument("--target-path", default=None, help="an HF folder (default: embedded)")
    args = ap.parse_args()
    import torch  # once the arguments are parsed: --help answers without loading torch

    with torch.inference_mode():
        measure(args)


def measure(args: argparse.Namespace) -> None:
    import torch
    from transformers import DynamicCache

    from data.chat import prompt_ids
    from decoding.bench import load_bench
    from models.base import cache_kw
    from models.target import TargetConfig, load_target

    tc = TargetConfig(device="cpu", dtype=args.dtype)
    if args.target_path:
        tc = TargetConfig(name="hf", path=args.target_path, device="cpu", dtype=args.dtype)
    target = load_target(tc)
    model, tok = target.model, target.tokenizer
    qs = load_bench(args.bench)[args.skip :]
    step = max(1, len(qs) // args.prompts)
    qs = qs[::step][: args.prompts]
    stats = {k: {"any": 0.0, "chosen": 0.0, "gap": 0.0, "flips": []} for k in args.ks}
    positions = 0
    for qi, q in enumerate(qs):
        prompt = prompt_ids(tok, [{"role": "user", "content": q["turns"][0]}])
        cache = DynamicCache(config=model.config)
        out = model(torch.tensor([prompt]), **cache_kw(model, cache), use_cache=True)
        pre_logits = out.logits[0, -1].float()
        seq, ref = [], []  # the greedy tokens and the logits that chose them (1-token forwards)
        logits = pre_logits
        for _ in range(args.tokens):
            t = int(logits.argmax())
            seq.append(t)
            if t == tok.eos_token_id:
                break
            out = model(torch.tensor([[t]]), **cache_kw(model, cache), use_cache=True)
            logits = out.logits[0, -1].float()
            ref.append(logits)
        # ref[i] = logits after seq[:i+1]; chunked: feed seq in blocks of k after the prefill
        for k in args.ks:
            cache = DynamicCache(config=model.config)
            model(torch.tensor([prompt]), **cache_kw(model, cache), use_cache=True)  # same prefill
            got = []
            for s in range(0, len(ref), k):
                block = seq[s : s + min(k, len(ref) - s)]
                out = model(torch.tensor([block]), **cache_kw(model, cache), use_cache=True)
                got.extend(out.logits[0].float())
            st = stats[k]
            for i, (a, b) in enumerate(zip(ref, got, strict=True)):
                st["any"] = max(st["any"], float((a - b).abs().max()))
                ta = int(a.argmax())
                st["chosen"] = max(st["chosen"], float((a[ta] - b[ta]).abs()))
                top_a = a.topk(2).values
                top_b = b.topk(2).values
                st["gap"] = max(
                    st["gap"], float(((top_a[0] - top_a[1]) - (top_b[0] - top_b[1])).abs())
                )
                tb = int(b.argmax())
                if ta != tb:
                    st["flips"].append((qi, i, float(a[ta] - a[tb])))
        positions += len(ref)
        print(f"prompt {qi + 1}/{len(qs)}: {len(ref)} positions", file=sys.stderr)
    print(
        f"\n{target.identity}, {args.dtype}, {len(qs)} {args.bench} prompts (from #{args.skip}), "
        f"{positions} positions, greedy"
    )
    print(
        "| k | max abs change, any logit | chosen token's logit | top-1/top-2 gap | argmax flips | largest 1-token gap at a flip |"
    )
    print("|---|---|---|---|---|---|")
    for k, st in stats.items():
        gaps = [g for _, _, g in st["flips"]]
        print(
            f"| {k} | {st['any']:.3f} | {st['chosen']:.3f} | {st['gap']:.3f} | {len(gaps)} | "
            f"{max(gaps) if gaps else float('nan'):.3f} |"
        )


if __name__ == "__main__":
    main()
