"""Acceptance of a draft in our decoder on the prompts an ``engine=llama.cpp`` report decoded,
for the agreement table (docs/benchmarks.md): the same chain length, p_min 0, T=0, speculative
decoding only (acceptance at T=0 does not depend on timing, so plain decoding is skipped).

    python scripts/engine_agreement.py engine-report.json [--num 20]
"""

from __future__ import annotations

import argparse
import json


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("report", help="a specdraft-eval engine=llama.cpp report (JSON)")
    ap.add_argument("--num", type=int, default=None, help="first N prompts (default: all)")
    a = ap.parse_args()
    # imported once the arguments are parsed: --help answers without loading torch
    from omegaconf import OmegaConf

    from data.chat import prompt_ids
    from decoding.decoder import SpeculativeDecoder
    from decoding.drafts import load_proposer
    from decoding.eval import EvalConfig, bench_questions
    from models.base import DecodeSettings
    from models.sampling import Sampling
    from models.target import load_target

    r = json.load(open(a.report))
    s = r["settings"]
    cfg = OmegaConf.structured(
        EvalConfig(draft=s["draft"], bench=s["bench"], num_prompts=s["num_prompts"])
    )
    target = load_target(OmegaConf.to_object(cfg.target))
    tok = target.tokenizer
    questions = bench_questions(cfg)[: a.num]
    prop, desc = load_proposer(s["draft"], target, tree=DecodeSettings(tree="chain"))
    dec = SpeculativeDecoder(target, prop, Sampling(), gamma=s["n_max"], adaptive=False)
    stop = {tok.eos_token_id}
    d = acc = 0
    for i, q in enumerate(questions):
        ids = prompt_ids(tok, [{"role": "user", "content": q["turns"][0]}])
        dec.generate(ids, s["max_new_tokens"], stop)
        t = r["outputs"][i]["turns"][0]["engine_timings"]
        d, acc = d + t.get("draft_n", 0), acc + t.get("draft_n_accepted", 0)
    st = dec.stats
    ours_dar = sum(st.accepted.values()) / max(1, sum(st.drafted.values()))
    print(
        json.dumps(
            {
                "prompts": len(questions),
                "chain": s["n_max"],
                "ours": {
                    "draft_acceptance_rate": ours_dar,
                    "alpha": st.alpha,
                    "alpha_per_position": st.alpha_per_position(),
                    "drafted": sum(st.drafted.values()),
                },
                "engine_same_prompts": {"draft_acceptance_rate": acc / max(1, d), "drafted": d},
                "draft": desc,
            },
            indent=1,
        )
    )


if __name__ == "__main__":
    main()
