"""Drafting for a batch in one forward per step against drafting row by row, in the batched
decoder (decoding/batch.py), at the same batch size, policy and prompts.

    python scripts/bench_batched_drafting.py --drafts runs/peagle runs/dflash \
        --batch-sizes 4 16 [--gamma 4 --num-prompts 16 --max-new-tokens 48 --repeats 2]

For each draft and batch size it decodes the prompts three ways, alternating within each
repeat so that the VM's slow and fast spells weigh on all three: plain decoding, speculative
decoding with the draft's batched drafter (``Proposer.batched``), and the same with one copy
of the proposer per row (``Proposer.fresh``, as before a batched drafter existed). Policy
``fixed``: every row drafts ``gamma`` tokens each iteration, so the drafting cost is measured
on every forward, whatever the draft's acceptance. Prints one markdown table: tokens/s, ms
of drafting and of verification per forward (medians over repeats), tau, and how many outputs
equal plain decoding's (T = 0).
"""

from __future__ import annotations

import argparse
import platform
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def row_by_row(proposer):
    """A copy of the proposer with its batched form hidden: the decoder drafts row by row."""
    p = proposer.fresh()
    p.batched = lambda: None
    return p


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--drafts", nargs="+", required=True)
    ap.add_argument("--batch-sizes", nargs="+", type=int, default=[4, 16])
    ap.add_argument("--gamma", type=int, default=4)
    ap.add_argument("--num-prompts", type=int, default=16)
    ap.add_argument("--max-new-tokens", type=int, default=48)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--bench", default="mt_bench")
    args = ap.parse_args()
    # imported once the arguments are parsed: --help answers without loading torch
    import torch

    from data.chat import prompt_ids
    from decoding.batch import BatchDecoder
    from decoding.bench import load_bench
    from decoding.decoder import NoDraft
    from decoding.drafts import load_proposer
    from models.sampling import Sampling
    from models.target import GenRequest, TargetConfig, load_target

    torch.manual_seed(0)
    target = load_target(TargetConfig())
    qs = load_bench(args.bench, num=args.num_prompts)
    prompts = [
        prompt_ids(target.tokenizer, [{"role": "user", "content": q["turns"][0]}]) for q in qs
    ]
    reqs = [GenRequest(i, p, seed=i) for i, p in enumerate(prompts)]
    tok = target.tokenizer
    stop = {tok.eos_token_id} | ({tok.pad_token_id} if tok.pad_token_id is not None else set())
    print(
        f"# {platform.processor() or platform.machine()}, torch {torch.__version__}, "
        f"{torch.get_num_threads()} threads, target {target.identity}, {len(prompts)} prompts "
        f"of {args.bench}, {args.max_new_tokens} new tokens, gamma {args.gamma}, T = 0, "
        f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}",
        flush=True,
    )
    lines = [
        "| draft | B | decoding | tok/s | draft ms / forward | verify ms / forward | "
        "forwards | tau | outputs = plain |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for spec in args.drafts:
        prop, desc = load_proposer(spec, target)
        for p in (NoDraft(), prop):  # warm-up: first-call costs stay out of the timings
            BatchDecoder(target, p, Sampling(), 2, gamma=args.gamma, calibrate=False).run(
                reqs[:2], 8, stop
            )
        for B in args.batch_sizes:
            ways = {
                "plain": NoDraft(),
                "batched drafting": prop,
                "row by row": row_by_row(prop),
            }
            runs: dict[str, list] = {w: [] for w in ways}
            outs: dict[str, dict] = {}
            for rep in range(args.repeats):
                for w, p in ways.items():
                    dec = BatchDecoder(
                        target, p, Sampling(), B, gamma=args.gamma, policy="fixed", calibrate=False
                    )
                    assert dec.batched_drafting == (w == "batched drafting") or w == "plain"
                    outs[w] = dec.run(reqs, args.max_new_tokens, stop)
                    st = dec.stats
                    runs[w].append(st)
                    print(
                        f"{desc} B={B} {w} repeat {rep}: {st.tokens_per_second:.1f} tok/s, "
                        f"draft {1e3 * st.rows.t_draft / st.forwards:.1f} ms / forward",
                        flush=True,
                    )
            for w, sts in runs.items():

                def med(f, sts=sts):
                    return statistics.median(f(s) for s in sts)

                same = sum(outs[w][k] == outs["plain"][k] for k in outs["plain"])
                lines.append(
                    f"| {Path(spec).name or spec} | {B} | {w} | "
                    f"{med(lambda s: s.tokens_per_second):.1f} | "
                    f"{med(lambda s: 1e3 * s.rows.t_draft / s.forwards):.1f} | "
                    f"{med(lambda s: 1e3 * s.rows.t_target / s.forwards):.1f} | "
                    f"{sts[0].forwards} | "
                    f"{'' if w == 'plain' else f'{sts[0].rows.tau:.2f}'} | "
                    f"{same}/{len(outs['plain'])} |"
                )
    print("\n".join(lines))


if __name__ == "__main__":
    from decoding.contention import measured

    measured(main)
