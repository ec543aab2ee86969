"""How big should an EAGLE draft tree be on this machine? Measure, then replay.

    python scripts/tree_sizes.py --draft smollm2-eagle3 --bench spec_bench \
        --categories qa summarization rag math_reasoning --num-prompts 16 --max-new-tokens 96

1. Greedy (T = 0) speculative decoding of the prompts with a generous dynamic tree
   (``--depth`` levels, ``--top-k`` children per expanded node, every candidate verified), on
   the target's default dtype, recording every tree the proposer drafts and each node's
   cumulative draft probability.
2. Each node's outcome is read off the decoded output: at T = 0 a node is accepted exactly when
   its path equals the tokens the target emitted from that position on.
3. Calibration: the draft's cumulative probability against how often such nodes are accepted.
4. Costs, measured here: a target forward over k tokens after a 256-token context (k = 1..17,
   median of ``--reps``), and a draft level (the proposer's own time per level in step 1), both
   in units of one plain decoding step.
5. Replay: every iteration's tree cut down to what a smaller policy would have verified (a fixed
   EAGLE-2 tree of depth D and N nodes, or ``min_prob`` thresholds), giving tau, the cost per
   iteration and their ratio (the speedup over plain decoding that these costs predict; a real
   run adds prefill and per-iteration overheads, so use it to rank policies, then measure the
   best with ``specdraft-eval``).
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import numpy as np
from tqdm.auto import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def node_outcomes(rec, full: list[int]):
    """(scores, depths, accepted) arrays for one recorded tree: accepted when the node's path
    is what the target emitted from the tree's position on."""
    n, tokens, parents, scores = rec
    depth, ok = [], []
    for i, par in enumerate(parents):
        depth.append(1 if par < 0 else depth[par] + 1)
        above = True if par < 0 else ok[par]
        pos = n + depth[-1] - 1
        ok.append(above and pos < len(full) and full[pos] == tokens[i])
    return np.array(scores), np.array(depth), np.array(ok)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--draft", default="smollm2-eagle3")
    ap.add_argument("--bench", default="spec_bench")
    ap.add_argument("--categories", nargs="*", default=None)
    ap.add_argument("--num-prompts", type=int, default=16)
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--depth", type=int, default=5)
    ap.add_argument("--top-k", type=int, default=4)
    ap.add_argument("--reps", type=int, default=9)
    ap.add_argument("--draft-weights", default="auto")
    args = ap.parse_args()
    # imported once the arguments are parsed: --help answers without loading torch
    from omegaconf import OmegaConf

    from data.chat import prompt_ids
    from decoding.bench import load_bench
    from decoding.decoder import NoDraft, SpeculativeDecoder
    from decoding.drafts import load_proposer
    from decoding.eval import USER_ERRORS, EvalConfig
    from decoding.settings import apply_saved_target
    from models.base import DecodeSettings
    from models.sampling import Sampling
    from models.target import load_target

    # the target the draft was made for (the embedded one for the shipped head), as
    # specdraft-eval chooses it
    cfg = OmegaConf.structured(EvalConfig(draft=args.draft))
    try:
        said = apply_saved_target(cfg, set())
        if said:
            print(said, file=sys.stderr)
        target = load_target(OmegaConf.to_object(cfg.target))
    except USER_ERRORS as e:
        sys.exit(f"error: {e}")
    tok = target.tokenizer
    big = args.top_k + (args.depth - 1) * args.top_k**2  # every candidate the tree can hold
    settings = DecodeSettings(
        tree="dynamic",
        depth=args.depth,
        top_k=args.top_k,
        total_tokens=big,
        draft_weights=args.draft_weights,
    )
    try:
        prop, desc = load_proposer(args.draft, target, tree=settings)
    except USER_ERRORS as e:
        sys.exit(f"error: {e}")
    records: list = []
    level_seconds: list[float] = []
    inner = prop.propose

    def recording(state, gamma):
        p = inner(state, gamma)
        if len(p):
            records.append((len(state.ids), p.tokens, p.parents, prop.last_scores))
            level_seconds.append(prop.last_step_seconds)
        return p

    prop.propose = recording  # this instance only
    dec = SpeculativeDecoder(target, prop, Sampling(), gamma=args.depth, adaptive=False)
    qs = load_bench(args.bench, args.categories, args.num_prompts)
    stop = {tok.eos_token_id}
    trees = []
    for q in tqdm(qs, desc="prompts", file=sys.stderr):
        prompt = prompt_ids(tok, [{"role": "user", "content": q["turns"][0]}])
        records.clear()
        new = dec.generate(prompt, args.max_new_tokens, stop)
        full = prompt + new
        trees += [node_outcomes(r, full) for r in records]
    print(f"{desc}, {target.dtype}, {len(qs)} prompts of {args.bench}, {len(trees)} trees")

    # calibration
    sc = np.exp(np.concatenate([t[0] for t in trees]))
    acc = np.concatenate([t[2] for t in trees])
    print("\n| cumulative draft probability | nodes | mean probability | accepted |")
    print("|---|---|---|---|")
    edges = [0, 0.01, 0.02, 0.03, 0.05, 0.08, 0.12, 0.2, 0.3, 0.5, 0.7, 0.9, 1.0001]
    for lo, hi in zip(edges[:-1], edges[1:], strict=True):
        m = (sc >= lo) & (sc < hi)
        if m.any():
            print(
                f"| {lo:.2f}-{min(hi, 1):.2f} | {m.sum()} | {sc[m].mean():.3f} | {acc[m].mean():.3f} |"
            )

    # costs in plain steps
    ks = sorted(set(range(1, 11)) | {12, 14, 17})
    timer = SpeculativeDecoder(target, NoDraft(), Sampling(), calibrate=False)
    cost = dict(zip(ks, timer.forward_costs(ks, reps=args.reps), strict=True))
    plain = cost[1]
    rel = {k: v / plain for k, v in cost.items()}
    level = float(np.median(level_seconds)) / plain

    def verify(k: int) -> float:
        if k in rel:
            return rel[k]
        lo = max(x for x in rel if x <= k)
        hi = min((x for x in rel if x >= k), default=lo)
        if hi == lo:  # past the table: its last slope
            a, b = sorted(rel)[-2:]
            return rel[b] + (k - b) * (rel[b] - rel[a]) / (b - a)
        return rel[lo] + (k - lo) * (rel[hi] - rel[lo]) / (hi - lo)

    print(
        f"\nforward over k tokens / one plain step ({plain * 1000:.1f} ms), draft level "
        f"{level:.3f}:"
    )
    print(" ".join(f"k={k}: {v:.3f}" for k, v in rel.items()))

    def replay(select) -> tuple[float, float, float]:
        tau = cost_sum = nodes = 0.0
        for s, d, a in trees:
            keep, levels = select(s, d)
            tau += 1 + a[keep].sum()
            cost_sum += verify(len(keep) + 1) + level * levels
            nodes += len(keep)
        n = len(trees)
        return tau / n, cost_sum / n, nodes / n

    def fixed(depth: int, total: int):
        def f(s, d):
            idx = np.where(d <= depth)[0]
            return idx[np.argsort(-s[idx], kind="stable")][:total], depth

        return f

    def threshold(depth: int, total: int, p: float):
        lp = math.log(p)

        def f(s, d):
            levels = 1
            while levels < depth and (d == levels).any() and s[d == levels].max() >= lp:
                levels += 1
            idx = np.where((d <= levels) & (s >= lp))[0]
            idx = idx[np.argsort(-s[idx], kind="stable")][:total]
            return (idx if len(idx) else np.argsort(-s, kind="stable")[:1]), levels

        return f

    print("\n| tree | tau | cost (plain steps) | predicted speedup | nodes verified |")
    print("|---|---|---|---|---|")
    rows = [
        (f"fixed {d}/{args.top_k}/{n}", fixed(d, n))
        for d in range(2, args.depth + 1)
        for n in (4, 8, 12)
        if n <= big
    ]
    rows += [
        (f"min_prob {p:g}, depth <= {d}, <= 12 nodes", threshold(d, 12, p))
        for d in sorted({3, 4, args.depth})
        for p in (0.01, 0.02, 0.03, 0.04, 0.05, 0.08)
    ]
    for name, f in rows:
        tau, c, nodes = replay(f)
        print(f"| {name} | {tau:.3f} | {c:.3f} | {tau / c:.3f} | {nodes:.1f} |")


if __name__ == "__main__":
    main()
