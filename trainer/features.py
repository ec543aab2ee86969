"""Offline target features: run the frozen target once over a tokenised split and keep the
hidden states a method reads, so later epochs (and later runs) skip the target forward.

Layout: ``<cache>/features/<key>/shard_r{rank}_{n}.safetensors`` holding one tensor per sample
(key = sample index, shape (T, L, H) in ``feature_dtype``), and ``done.json`` written last.
The key hashes the target identity and dtype, the tokenised data's own cache key, the split
and the layer indices, so a change in any of them builds a new cache. Shards are written to a
temp name and renamed, so an interrupted build resumes from the shards already written.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from tqdm.auto import tqdm

from data.dataset import Collator

from .shard import equal_forwards

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


class FeatureStore:
    """Read side: ``get(i)`` -> (T, L, H) tensor for sample ``i``."""

    def __init__(self, path: Path):
        self.path = path
        meta = json.loads((path / "done.json").read_text())
        self.index: dict[int, str] = {int(k): v for k, v in meta["index"].items()}
        self.bytes_per_token = meta["bytes_per_token"]
        self._handles: dict[str, Any] = {}

    def get(self, i: int) -> torch.Tensor:
        shard = self.index[i]
        h = self._handles.get(shard)
        if h is None:
            h = self._handles[shard] = safe_open(str(self.path / shard), framework="pt")
        return h.get_tensor(str(i))

    def __getstate__(self):  # DataLoader workers reopen shards themselves
        d = dict(self.__dict__)
        d["_handles"] = {}
        return d


def feature_cache_key(
    target: Any, data_key: str, split: str, layers: tuple[int, ...], dtype: str
) -> str:
    src = json.dumps(
        {
            "target": target.identity,
            "target_dtype": str(target.dtype),
            "data": data_key,
            "split": split,
            "layers": list(layers),
            "dtype": dtype,
            "v": 1,
        },
        sort_keys=True,
    )
    return hashlib.sha256(src.encode()).hexdigest()[:20]


def build_feature_store(
    target: Any,
    ds: Any,
    layers: tuple[int, ...],
    cache_root: str,
    key: str,
    *,
    batch_size: int,
    shard_tokens: int,
    dtype: str,
    rank: int = 0,
    world_size: int = 1,
    barrier=lambda: None,
    progress: bool = True,
) -> FeatureStore:
    """Build (or reuse) the feature cache for ``ds`` (a tokenised split). Each process computes
    samples ``i % world_size == rank`` into its own shards ``shard_r{rank}_*``; the main process
    writes ``done.json`` (one index over every rank's shards) after all, so any later world size
    reads the cache. An interrupted build resumes from the complete shards of every rank, with
    this run's world size."""
    path = Path(cache_root).expanduser() / "features" / key
    if (path / "done.json").exists():
        problem = _damage(path, len(ds))
        if problem is None:
            return FeatureStore(path)
        if rank == 0:
            print(f"warning: feature cache {path} is damaged ({problem}); building it again")
        barrier()  # every process has looked before done.json goes
        if rank == 0:
            (path / "done.json").unlink(missing_ok=True)
        barrier()
    if dtype not in DTYPES:
        raise ValueError(f"data.feature_dtype={dtype!r}: use one of {sorted(DTYPES)}")
    path.mkdir(parents=True, exist_ok=True)
    done = _scan(path)
    lengths = list(ds["length"])
    todo = [i for i in range(len(ds)) if i % world_size == rank and i not in done]
    todo.sort(key=lambda i: -lengths[i])  # similar lengths per batch: little padding
    collate = Collator(target.pad_token_id)
    shard_no = 1 + max(
        [
            int(n.split("_")[-1].split(".")[0])
            for n in set(done.values())
            if n.startswith(f"shard_r{rank}_")
        ],
        default=-1,
    )
    buf: dict[str, torch.Tensor] = {}
    buf_tokens = 0

    def flush():
        nonlocal buf, buf_tokens, shard_no
        if not buf:
            return
        name = f"shard_r{rank}_{shard_no:05d}.safetensors"
        tmp = path / f".{name}.tmp"
        save_file(buf, str(tmp))
        os.replace(tmp, path / name)
        shard_no += 1
        buf, buf_tokens = {}, 0

    bar = tqdm(
        total=sum(lengths[i] for i in todo),
        unit="tok",
        desc="caching target features",
        disable=not progress or not todo,
        dynamic_ncols=True,
    )
    # A sharded target's forwards are collective: a rank with fewer batches left (uneven
    # shares, or a resumed build) runs one-token stand-ins until every rank has run as many.
    pad = equal_forwards(target, -(-len(todo) // batch_size), layers)
    with target.gathered():
        for s in range(0, len(todo), batch_size):
            idx = todo[s : s + batch_size]
            batch = collate([{**ds[i], "index": i} for i in idx])
            feats = target.features(batch["input_ids"], batch["attention_mask"], layers)
            feats = feats.to(DTYPES[dtype]).cpu()
            for b, i in enumerate(idx):
                n = lengths[i]
                buf[str(i)] = feats[b, :n].contiguous()
                buf_tokens += n
            bar.update(sum(lengths[i] for i in idx))
            if buf_tokens >= shard_tokens:
                flush()
        pad()
    flush()
    bar.close()
    barrier()
    if rank == 0:
        index = {str(i): shard for i, shard in _scan(path).items()}
        missing = len(ds) - len(index)
        if missing:
            raise RuntimeError(f"{path}: feature cache is missing {missing} samples")
        H = target.hidden_size
        meta = {
            "index": index,
            "layers": list(layers),
            "dtype": dtype,
            "samples": len(ds),
            "bytes_per_token": len(layers) * H * DTYPES[dtype].itemsize,
        }
        tmp = path / ".done.json.tmp"
        tmp.write_text(json.dumps(meta))
        os.replace(tmp, path / "done.json")
    barrier()
    return FeatureStore(path)


def _damage(path: Path, samples: int) -> str | None:
    """What is wrong with a finished cache (a shard deleted or cut short since, an index of
    another size), or None. Reading each shard's header is cheap; a shard that cannot be read
    is removed, so the build that follows recomputes its samples only."""
    try:
        meta = json.loads((path / "done.json").read_text())
        index = {int(k): v for k, v in meta["index"].items()}
    except (OSError, ValueError, KeyError, AttributeError) as e:
        return f"done.json unreadable: {type(e).__name__}"
    if len(index) != samples or meta.get("samples") != samples:
        return f"{len(index)} samples indexed, the data has {samples}"
    found = _scan(path)
    lost = sorted({shard for i, shard in index.items() if found.get(i) != shard})
    if lost:
        return f"{lost[0]} missing or unreadable" + (
            f" (+{len(lost) - 1} more)" if len(lost) > 1 else ""
        )
    return None


def _scan(path: Path) -> dict[int, str]:
    """Sample index -> shard name for every complete shard in ``path``."""
    found: dict[int, str] = {}
    for f in sorted(path.glob("shard_r*.safetensors")):
        try:
            with safe_open(str(f), framework="pt") as h:
                for k in h.keys():
                    found[int(k)] = f.name
        except Exception:  # a damaged shard is rebuilt: its samples count as missing
            f.unlink(missing_ok=True)
    return found
