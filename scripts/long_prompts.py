"""Long-context prompts for self-speculation (``draft=streaming``) benchmarks: Spec-Bench's own
summarization articles (real news text, ``data/spec_bench``), several concatenated until a
prompt reaches a token budget under the target's chat template, then one instruction.

    python scripts/long_prompts.py --tokens 2048 --num 6 --out /tmp/long2k.jsonl
    specdraft-eval draft=streaming bench=/tmp/long2k.jsonl num_prompts=6 ...

Each prompt uses different articles (taken in order, none twice across prompts, cycling only
when the set runs out), so prompts do not share text. Writes the bench JSONL format
(question_id, category, turns) and prints each prompt's token count.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import NoReturn

ROOT = Path(__file__).resolve().parents[1]
INSTRUCTION = "Summarize the articles above in a few sentences each."


def articles() -> list[str]:
    out = []
    for line in (ROOT / "data/spec_bench/question.jsonl").read_text().splitlines():
        rec = json.loads(line)
        if rec["category"] == "summarization":
            text = rec["turns"][0]
            out.append(text.removeprefix("Summarize:").strip())
    return out


def fail(msg: str) -> NoReturn:
    """The project's refusal: one line on stderr, exit status 2."""
    print(f"error: {msg}", file=sys.stderr)
    sys.exit(2)


def check_args(a: argparse.Namespace) -> Path:
    """The arguments' own checks, before the target loads; returns ``--out``, a new file in a
    folder that exists (an existing file is never written over, as scripts/later_turns.py)."""
    if a.tokens < 1:
        fail(f"--tokens {a.tokens}: must be >= 1")
    if a.num < 1:
        fail(f"--num {a.num}: must be >= 1 (a bench file of no prompts measures nothing)")
    out = Path(a.out)
    if out.exists():
        fail(f"--out {out}: exists; choose a new file")
    if not out.parent.is_dir():
        fail(f"--out {out}: no folder {out.parent}; create it or choose another path")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=2048, help="minimum prompt tokens")
    ap.add_argument("--num", type=int, default=6)
    ap.add_argument("--out", required=True, help="a new file (an existing one is refused)")
    ap.add_argument("--target", default="smollm2_135m", help="target name (its tokenizer)")
    a = ap.parse_args()
    out = check_args(a)
    from data.chat import prompt_ids
    from models.target import TargetConfig, TargetError, load_target

    try:
        tok = load_target(TargetConfig(name=a.target, device="cpu")).tokenizer
    except TargetError as e:
        fail(f"--target {a.target}: {e}")

    def count(text: str) -> int:
        return len(prompt_ids(tok, [{"role": "user", "content": text}]))

    arts, k = articles(), 0
    recs = []
    for i in range(a.num):
        parts: list[str] = []
        while True:
            parts.append(f"Article {len(parts) + 1}:\n{arts[k % len(arts)]}")
            k += 1
            text = "\n\n".join(parts) + "\n\n" + INSTRUCTION
            n = count(text)
            if n >= a.tokens:
                break
        # cut the last article (at a word) to the shortest length that still reaches the budget
        last, lo, hi = parts[-1], 0, len(parts[-1])
        while hi - lo > 64:
            mid = (lo + hi) // 2
            cut = last[: last.rfind(" ", 0, mid) + 1 or mid]
            if count("\n\n".join([*parts[:-1], cut]) + "\n\n" + INSTRUCTION) >= a.tokens:
                hi = mid
            else:
                lo = mid
        parts[-1] = last[: last.rfind(" ", 0, hi) + 1 or hi].rstrip()
        text = "\n\n".join(parts) + "\n\n" + INSTRUCTION
        n = count(text)
        recs.append({"question_id": i, "category": f"long{a.tokens}", "turns": [text]})
        print(f"prompt {i}: {len(parts)} articles, {n} tokens")
    tmp = out.with_name(out.name + ".tmp")
    try:  # whole or not at all: a partial bench file is never left under --out
        tmp.write_text("".join(json.dumps(r) + "\n" for r in recs))
        tmp.rename(out)
    except OSError as e:
        tmp.unlink(missing_ok=True)
        fail(f"--out {out}: cannot write ({e.strerror or e})")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
