"""Packs what a GPU training run (``scripts/gpu_train.sh``, issue 45) carries besides the
target's three parts (``scripts/gpu_pack.sh``): a slice of prompts for the target to answer
on the GPU, and the weights to start from where they are not in the repository.

    python scripts/gpu_train_pack.py                        # ShareGPT's first turns 0..19,999
    python scripts/gpu_train_pack.py --skip 20000 --count 20000 --init runs/gpu/<run>/final

Writes ``.gpu/t1`` (git-ignored): ``prompts.jsonl.gz`` (each conversation's first user turn,
the dataset's reply cut to a stub: the target replaces it), ``slice.json`` (which slice, so
the next run takes the next one), and, for ``--init`` outside the repository, ``init.tar.part_*``
(the draft folder in parts). ``--init`` inside it (the default: the shipped head, 19 MB in the
tree) travels with the working tree. Everything a call carries must fit 64 MiB with the
working tree; the script says what it packed and refuses more.
"""

from __future__ import annotations

import argparse
import gzip
import io
import json
import subprocess
import sys
import tarfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from omegaconf import OmegaConf  # noqa: E402

from data.conversations import DataError, load_conversations  # noqa: E402
from trainer.train import data_path  # noqa: E402

CALL_LIMIT = 64 * 2**20  # what one device call may carry, working tree included
PART = 15 * 2**20  # files come back from a call in at most 16 MiB each


def tree_bytes() -> int:
    """What the working tree sends with every call (tracked and untracked-not-ignored)."""
    names = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=ROOT,
        capture_output=True,
        check=True,
    ).stdout.split(b"\0")
    return sum(
        (ROOT / n.decode()).stat().st_size for n in names if n and (ROOT / n.decode()).is_file()
    )


def _in_repo(p: Path) -> str:
    """``p`` relative to the repository where it is inside it (valid in any clone)."""
    p = p.resolve()
    return str(p.relative_to(ROOT)) if p.is_relative_to(ROOT) else str(p)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--data", default=None, help="file or folder (default: packaged ShareGPT)")
    ap.add_argument("--skip", type=int, default=0, help="usable conversations to pass over")
    ap.add_argument("--count", type=int, default=20000, help="prompts to pack")
    ap.add_argument("--init", default="smollm2-eagle3", help="draft folder or shipped name")
    ap.add_argument("--reply-chars", type=int, default=64, help="dataset reply kept (a stub)")
    ap.add_argument("--out", default=str(ROOT / ".gpu" / "t1"))
    a = ap.parse_args()
    if a.skip < 0 or a.count < 1:
        sys.exit("--skip must be >= 0 and --count >= 1")
    init = Path(a.init).expanduser()
    folder = None  # a draft outside the repository: carried in parts
    if init.exists() and not init.resolve().is_relative_to(ROOT):
        from models.base import resolve_draft_dir

        folder = resolve_draft_dir(init)
        if folder is None:
            sys.exit(f"--init {init}: not a saved draft, run or checkpoint folder")
    try:
        source = data_path(OmegaConf.create({"name": "sharegpt", "path": a.data}))
        convs, report = load_conversations(source, a.count, a.skip)
    except DataError as e:
        sys.exit(str(e))
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    for old in [out / "prompts.jsonl.gz", out / "slice.json", *out.glob("init.tar.part_*")]:
        old.unlink(missing_ok=True)  # what an earlier pack wrote here, nothing else
    buf = io.BytesIO()
    with gzip.GzipFile(fileobj=buf, mode="wb", mtime=0) as gz:
        for c in convs:
            user, reply = c.messages[0], c.messages[1]
            rec = {
                "id": c.id,
                "conversations": [
                    {"from": "human", "value": user["content"]},
                    {"from": "gpt", "value": reply["content"][: a.reply_chars]},
                ],
            }
            gz.write((json.dumps(rec, ensure_ascii=False) + "\n").encode())
    (out / "prompts.jsonl.gz").write_bytes(buf.getvalue())
    meta = {"source": str(source), "skip": a.skip, "count": len(convs), "init": a.init}
    if folder is not None:
        tar = io.BytesIO()
        with tarfile.open(fileobj=tar, mode="w") as t:
            t.add(folder, arcname="init")
        data = tar.getvalue()
        for i in range(0, len(data), PART):
            (out / f"init.tar.part_{i // PART:02d}").write_bytes(data[i : i + PART])
        meta["init"] = "carried"
        meta["init_from"] = str(folder)
    elif init.exists():
        meta["init"] = str(init.resolve().relative_to(ROOT))
    # the learning curves behind the init (the shipped head's CPU phases, earlier GPU runs):
    # the returned run's curve continues them (scripts/gpu_train_unpack.py, plot_curves.py)
    from plot_curves import lineage

    shipped = ROOT / "models" / "shipped" / a.init
    meta["lineage"] = [
        [_in_repo(Path(f)), off]
        for f, off in lineage(folder or (init if init.exists() else shipped))
    ]
    (out / "slice.json").write_text(json.dumps(meta, indent=1))
    packed = sum(
        f.stat().st_size
        for f in [out / "prompts.jsonl.gz", out / "slice.json", *out.glob("init.tar.part_*")]
    )
    total = packed + tree_bytes()
    print(
        f"{out}: {len(convs)} prompts (usable conversations {a.skip}..{a.skip + len(convs) - 1}"
        f" of {source}), init {meta['init']}; {packed / 2**20:.1f} MiB, "
        f"{total / 2**20:.1f} MiB with the working tree"
    )
    if total > CALL_LIMIT:
        sys.exit(f"{total / 2**20:.1f} MiB is over the 64 MiB a call carries: pack fewer prompts")


if __name__ == "__main__":
    main()
