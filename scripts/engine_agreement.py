"""Acceptance of a draft in our decoder on the prompts an ``engine=llama.cpp`` report decoded,
for the agreement table (docs/benchmarks.md): the same chain length, p_min 0, T=0, speculative
decoding only (acceptance at T=0 does not depend on timing, so plain decoding is skipped).

    python scripts/engine_agreement.py engine-report.json [--num 20]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path

#: the report's settings that pick the target and the prompts
KEYS = ("target", "draft", "bench", "categories", "num_prompts")


def read_report(path: Path) -> dict:
    """The report at ``path``, refused in one line unless it is an ``engine=llama.cpp`` report."""
    try:
        r = json.loads(path.read_text())
    except FileNotFoundError:
        raise SystemExit(f"{path}: no such file") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise SystemExit(f"{path}: not a specdraft-eval report ({e})") from None
    s = r.get("settings") if isinstance(r, dict) else None
    if not isinstance(s, dict) or not isinstance(r.get("outputs"), list):
        raise SystemExit(f"{path}: not a specdraft-eval report (no settings and outputs)")
    if s.get("engine") != "llama.cpp":
        raise SystemExit(
            f"{path}: a report of engine={s.get('engine')}, not of engine=llama.cpp (its "
            "acceptance is what this compares ours with)"
        )
    missing = [k for k in ("target", "draft", "bench", "n_max", "max_new_tokens") if k not in s]
    if missing:
        raise SystemExit(f"{path}: settings has no {', '.join(missing)}")
    return {**r, "settings": s}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("report", help="a specdraft-eval engine=llama.cpp report (JSON)")
    ap.add_argument("--num", type=int, default=None, help="first N prompts (default: all)")
    a = ap.parse_args()
    # imported once the arguments are parsed: --help answers without loading torch
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    from data.chat import prompt_ids
    from decoding.decoder import SpeculativeDecoder
    from decoding.drafts import load_proposer
    from decoding.eval import EvalConfig, bench_questions
    from models.base import DecodeSettings
    from models.sampling import Sampling
    from models.target import TargetError, load_target

    r = read_report(Path(a.report))
    s = r["settings"]
    names = {f.name for f in dataclasses.fields(EvalConfig)}
    try:  # the report's target and prompts, as its evaluation loaded them
        cfg = OmegaConf.merge(
            OmegaConf.structured(EvalConfig),
            {k: s[k] for k in KEYS if k in s and k in names},
        )
        target = load_target(OmegaConf.to_object(cfg.target))
    except (OmegaConfBaseException, TargetError) as e:
        raise SystemExit(f"{a.report}: settings: {str(e).splitlines()[0]}") from None
    if s.get("target_identity") not in (None, target.identity):
        raise SystemExit(
            f"{a.report}: made for target {s['target_identity']}, but its settings.target "
            f"loads {target.identity} here"
        )
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
                "target": target.identity,
            },
            indent=1,
        )
    )


if __name__ == "__main__":
    main()
