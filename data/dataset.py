"""Tokenised training data: a memory-mapped ``datasets`` cache, a deterministic split, batches.

``prepare_tokenized`` turns conversation files into two Arrow datasets (train, validation)
with columns ``id``, ``input_ids``, ``loss_mask``, ``length``. The result is saved under a
cache folder keyed by the data files (paths and contents), the tokenizer (vocabulary, chat
template, its whole pipeline) and the settings, so a second run skips reading and tokenising.
The load report (records read and skipped per reason) is stored with it and printed on every
run.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from .chat import TemplateSkip, template_kwargs, tokenize_conversation
from .conversations import DataError, LoadReport, data_files, load_conversations

# 2: reasoning, tool calls, template skips; 3: unique ids, replies located safely; 4: a turn of
# white space ends its conversation there instead of dropping it
CACHE_VERSION = 5  # 5: the split hashes ids alone, surplus held out


@dataclass
class TokenizedData:
    train: Any  # datasets.Dataset
    val: Any  # datasets.Dataset
    report: LoadReport
    too_long: int  # conversations whose assistant tokens all fell past max_length
    cache_dir: Path
    key: str
    #: the data files (names under data.path, contents) and the settings that choose and
    #: split the records: a resumed run must see the same
    source: str = ""
    #: the tokenizer and chat template that made the ids (``tokenizer_fingerprint``): a resumed
    #: run must tokenise as the checkpoint's did
    tokenizer: str = ""
    #: held out past ``max_val_records``: neither validated nor trained on (``split_of``)
    held: int = 0


def tokenizer_fingerprint(tokenizer: Any) -> str:
    """What turns text into ids: the vocabulary, the chat template and, for a fast tokenizer,
    its whole pipeline (merges, normaliser, pre-tokeniser, added tokens), less the truncation
    and padding state that calls leave behind. Two tokenizers with one vocabulary can split
    text differently (a lower-casing normaliser, other merges)."""
    h = hashlib.sha256()
    h.update(json.dumps(sorted(tokenizer.get_vocab().items())).encode())
    h.update(str(tokenizer.chat_template).encode())
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        spec = json.loads(backend.to_str())
        for k in ("truncation", "padding"):
            spec.pop(k, None)
        h.update(json.dumps(spec, sort_keys=True).encode())
    return h.hexdigest()[:16]


def _file_digests(path: str) -> list[tuple[Path, str, str]]:
    """(file, its name under ``path``, sha256 of its bytes) of each data file: contents, not
    times (``cp -p``, ``tar`` and ``rsync -t`` keep a file's time through an edit). Hashing
    reads every byte: about a second per GB."""
    root = Path(path).expanduser()
    out = []
    for f in data_files(path):
        h = hashlib.sha256()
        with open(f, "rb") as fh:
            while chunk := fh.read(1 << 22):
                h.update(chunk)
        name = f.relative_to(root).as_posix() if root.is_dir() else f.name
        out.append((f, name, h.hexdigest()))
    return out


def _fingerprint(parts: list[str]) -> str:
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()[:16]


def _nothing_to_train(path: str, max_length: int, report: LoadReport, too_long: int, val: int):
    """Why no conversation is left to train on, every cause counted."""
    why = []
    if too_long:
        why.append(f"{too_long} with no assistant token within data.max_length={max_length}")
    if report.rejected:
        why.append("skipped " + ", ".join(f"{k}={v}" for k, v in sorted(report.rejected.items())))
    if val:
        why.append(f"{val} in validation (data.val_fraction)")
    return f"{path}: no conversation left to train on ({'; '.join(why) or 'none read'})"


def _is_val(conv_id: str, seed: int, val_fraction: float) -> bool:
    """Whether a conversation is held out from training: a hash of (seed, id) alone, so a
    conversation falls on the same side in every run with the same seed and fraction,
    whatever slice, file order or regeneration of the dataset it comes in (a regeneration
    keeps the ids). It hashed the record's position too: a conversation trained on in one
    slice was validated in another, and a head continued on regenerated answers to the same
    prompts was measured on text it had learnt."""
    digest = hashlib.sha256(f"{seed}:{conv_id}".encode()).digest()
    return int.from_bytes(digest[:8], "little") / 2**64 < val_fraction


def split_of(ids: list[str], seed: int, val_fraction: float, max_val_records: int) -> list[str]:
    """``train``, ``val`` or ``held`` for each conversation: the first ``max_val_records`` held
    out (file order) are validated, the held-out ones past them are neither validated nor
    trained on (trained on here, they would be validated by a run that reads fewer)."""
    out, n = [], 0
    for cid in ids:
        if not _is_val(cid, seed, val_fraction):
            out.append("train")
            continue
        n += 1
        out.append("val" if n <= max_val_records else "held")
    return out


def _tokenize_batch(batch: dict, tokenizer: Any, max_length: int, reasoning: str) -> dict:
    """Tokenised rows; a record the template cannot render comes back as a row with only its
    ``skip`` reason (counted by the caller), one with no assistant token is left out."""
    out: dict[str, list] = {
        "id": [],
        "input_ids": [],
        "loss_mask": [],
        "length": [],
        "split": [],
        "skip": [],
    }
    rows = zip(batch["id"], batch["messages"], batch["tools"], batch["split"], strict=True)
    for cid, messages, tools, split in rows:
        try:
            enc = tokenize_conversation(
                tokenizer, json.loads(messages), max_length, json.loads(tools), reasoning
            )
        except TemplateSkip as e:
            enc, skip = {"input_ids": [], "loss_mask": []}, e.reason
        else:
            if sum(enc["loss_mask"]) == 0:
                continue  # counted by the caller (length difference)
            skip = ""
        out["skip"].append(skip)
        out["id"].append(cid)
        out["input_ids"].append(enc["input_ids"])
        out["loss_mask"].append(enc["loss_mask"])
        out["length"].append(len(enc["input_ids"]))
        out["split"].append(split)
    return out


def prepare_tokenized(
    path: str,
    tokenizer: Any,
    *,
    max_length: int,
    val_fraction: float,
    max_val_records: int,
    max_records: int | None,
    seed: int,
    skip_records: int = 0,
    reasoning: str = "keep",
    cache_root: str,
    num_proc: int = 1,
    log=print,
) -> TokenizedData:
    """Load, normalise, tokenise and split ``path``; reuse the cache when nothing changed."""
    import datasets

    if max_length < 8:
        raise DataError(f"data.max_length={max_length}: must be at least 8 tokens")
    if not 0.0 <= val_fraction < 1.0:
        raise DataError(f"data.val_fraction={val_fraction}: must be in [0, 1)")
    digests = _file_digests(path)
    settings = {
        "max_length": max_length,
        "val_fraction": val_fraction,
        "max_val_records": max_val_records,
        "max_records": max_records,
        "skip_records": skip_records,
        "reasoning": reasoning,
        "seed": seed,
    }
    # what a resumed run must train on again: the files by their names under data.path (the
    # folder may move) and contents, and the settings that pick and split the records
    source = _fingerprint([f"{n}:{d}" for _, n, d in digests] + [json.dumps(settings)])
    tok_print = tokenizer_fingerprint(tokenizer)
    key_src = json.dumps(
        {
            "v": CACHE_VERSION,
            "files": _fingerprint([f"{f.resolve()}:{d}" for f, _, d in digests]),
            "tok": tok_print,
            "max_length": max_length,
            "val_fraction": val_fraction,
            "max_val_records": max_val_records,
            "max_records": max_records,
            "seed": seed,
        },
        sort_keys=True,
    )
    if skip_records:  # only when set, so the caches of earlier runs keep their keys
        key_src += f"|skip={skip_records}"
    template_kwargs(reasoning)  # a bad mode fails here, in one line
    if reasoning != "keep":
        key_src += f"|reasoning={reasoning}"
    key = hashlib.sha256(key_src.encode()).hexdigest()[:20]
    cache_dir = Path(cache_root).expanduser() / "tokenized" / key
    if (cache_dir / "done.json").exists():
        try:
            meta = json.loads((cache_dir / "done.json").read_text())
            train = datasets.load_from_disk(str(cache_dir / "train"))
            val = datasets.load_from_disk(str(cache_dir / "val"))
            report = LoadReport.from_dict(meta["report"])
            too_long = meta["too_long"]
            held = meta.get("held", 0)
        except Exception as e:  # files lost or cut short since: tokenise again
            log(
                f"warning: tokenised-data cache {cache_dir} is damaged "
                f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}); "
                "tokenising again"
            )
            shutil.rmtree(cache_dir, ignore_errors=True)
        else:
            return TokenizedData(
                train, val, report, too_long, cache_dir, key, source, tok_print, held
            )

    convs, report = load_conversations(path, max_records=max_records, skip_records=skip_records)
    splits = split_of([c.id for c in convs], seed, val_fraction, max_val_records)
    held = splits.count("held")
    kept = [(c, s) for c, s in zip(convs, splits, strict=True) if s != "held"]
    raw = datasets.Dataset.from_dict(
        {
            "id": [c.id for c, _ in kept],
            "messages": [json.dumps(c.messages) for c, _ in kept],
            "tools": [json.dumps(c.tools) for c, _ in kept],
            "split": [s for _, s in kept],
        }
    )
    tok = raw.map(
        _tokenize_batch,
        batched=True,
        batch_size=64,
        remove_columns=raw.column_names,
        fn_kwargs={"tokenizer": tokenizer, "max_length": max_length, "reasoning": reasoning},
        num_proc=num_proc if num_proc > 1 and len(raw) >= 256 * num_proc else None,
        desc="tokenising",
        new_fingerprint=key,
    )
    datasets.disable_progress_bars()  # the split and save below are instant; keep logs clean
    if "skip" not in tok.column_names:  # every row left out: no assistant token in max_length
        datasets.enable_progress_bars()
        raise DataError(_nothing_to_train(path, max_length, report, len(raw), 0))
    skips = [s for s in tok["skip"] if s]
    for s in skips:  # records the template cannot render, counted by reason
        report.rejected[s] += 1
    report.kept -= len(skips)
    if skips:
        tok = tok.filter(lambda s: [not x for x in s], input_columns="skip", batched=True)
    tok = tok.remove_columns("skip")
    too_long = len(raw) - len(skips) - len(tok)
    train = tok.filter(
        lambda s: [x == "train" for x in s], input_columns="split", batched=True, desc="split"
    ).remove_columns("split")
    val = tok.filter(
        lambda s: [x == "val" for x in s], input_columns="split", batched=True, desc="split"
    ).remove_columns("split")
    if len(train) == 0:
        datasets.enable_progress_bars()
        raise DataError(_nothing_to_train(path, max_length, report, too_long, len(val)))
    cache_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{key}-", dir=cache_dir.parent))
    try:
        train.save_to_disk(str(tmp / "train"))
        val.save_to_disk(str(tmp / "val"))
        (tmp / "done.json").write_text(
            json.dumps(
                {
                    "report": report.to_dict(),
                    "too_long": too_long,
                    "held": held,
                    "key": json.loads(key_src.split("|")[0]),
                    "key_extra": key_src.split("|")[1:],  # skip=..., reasoning=...
                },
                indent=1,
            )
        )
        try:
            os.rename(tmp, cache_dir)
        except OSError:
            if (cache_dir / "done.json").exists():  # another process finished first: the same
                shutil.rmtree(tmp, ignore_errors=True)
            else:  # a folder with no done.json (a copy cut short): never read, replaced
                shutil.rmtree(cache_dir)
                os.rename(tmp, cache_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    train = datasets.load_from_disk(str(cache_dir / "train"))
    val = datasets.load_from_disk(str(cache_dir / "val"))
    datasets.enable_progress_bars()
    return TokenizedData(train, val, report, too_long, cache_dir, key, source, tok_print, held)


class LengthGroupedBatches(torch.utils.data.Sampler[list[int]]):
    """Batches of similar length (little padding), in an order fixed by ``(seed, epoch)``.

    Indices are shuffled, cut into mega-batches of ``batch_size * group`` samples, each sorted
    by length and split into batches; the batch order is then shuffled again. ``set_epoch``
    changes the order; the same (seed, epoch) always gives the same batches, which is what
    makes resuming at a batch position exact.
    """

    def __init__(
        self,
        lengths: list[int],
        batch_size: int,
        seed: int,
        group: int = 64,
        drop_last: bool = False,
    ):
        if batch_size < 1:
            raise DataError(f"data.batch_size={batch_size}: must be at least 1")
        self.lengths = list(lengths)
        self.batch_size = batch_size
        self.seed = seed
        self.group = group
        self.drop_last = drop_last
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def batches(self) -> list[list[int]]:
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + self.epoch)
        order = torch.randperm(len(self.lengths), generator=g).tolist()
        mega = self.batch_size * self.group
        batches: list[list[int]] = []
        for s in range(0, len(order), mega):
            chunk = sorted(order[s : s + mega], key=lambda i: -self.lengths[i])
            batches += [
                chunk[j : j + self.batch_size] for j in range(0, len(chunk), self.batch_size)
            ]
        if self.drop_last:
            batches = [b for b in batches if len(b) == self.batch_size]
        perm = torch.randperm(len(batches), generator=g).tolist()
        return [batches[i] for i in perm]

    def __iter__(self):
        return iter(self.batches())

    def __len__(self) -> int:
        n = len(self.lengths) / self.batch_size
        return int(n) if self.drop_last else math.ceil(n)


def validation_batches(
    lengths: list[int], batch_size: int, rank: int = 0, world_size: int = 1, cap: int | None = None
) -> list[list[int]]:
    """This process's validation batches: conversations longest first (``cap``: lengths cut
    there), dealt out rank::world_size, in batches of ``batch_size``. Every conversation is in
    exactly one process's batches, none twice (a distributed sampler pads uneven shards with
    repeats, which would bias the metrics), and the split depends only on the lengths, so the
    same held-out set gives the same numbers in every run."""
    if batch_size < 1:
        raise DataError(f"data.batch_size={batch_size}: must be at least 1")
    vl = [min(n, cap) if cap else n for n in lengths]
    order = sorted(range(len(vl)), key=lambda i: -vl[i])[rank::world_size]
    return [order[i : i + batch_size] for i in range(0, len(order), batch_size)]


class Collator:
    """Right-pad a list of samples into tensors.

    Returns ``input_ids`` (B, T) long, ``attention_mask`` (B, T) long (1 = real token; padding
    is told apart by this mask, never by token id, since pad and EOS can be the same id),
    ``loss_mask`` (B, T) long, ``index`` (B,) long, and ``features`` (B, T, L, H) when samples
    carry cached target features.
    """

    def __init__(self, pad_token_id: int):
        self.pad = pad_token_id

    def __call__(self, samples: list[dict]) -> dict[str, torch.Tensor]:
        T = max(len(s["input_ids"]) for s in samples)
        B = len(samples)
        ids = torch.full((B, T), self.pad, dtype=torch.long)
        attn = torch.zeros((B, T), dtype=torch.long)
        loss = torch.zeros((B, T), dtype=torch.long)
        for b, s in enumerate(samples):
            n = len(s["input_ids"])
            ids[b, :n] = torch.as_tensor(s["input_ids"])
            attn[b, :n] = 1
            loss[b, :n] = torch.as_tensor(s["loss_mask"])
        out = {
            "input_ids": ids,
            "attention_mask": attn,
            "loss_mask": loss,
            "index": torch.as_tensor([s["index"] for s in samples]),
        }
        if "features" in samples[0]:
            f0 = samples[0]["features"]
            feats = torch.zeros((B, T, *f0.shape[1:]), dtype=f0.dtype)
            for b, s in enumerate(samples):
                feats[b, : s["features"].shape[0]] = s["features"]
            out["features"] = feats
        return out


class IndexedDataset(torch.utils.data.Dataset):
    """A tokenised ``datasets.Dataset`` as torch samples, optionally joined with a feature store
    (any object with ``get(index) -> Tensor (T, L, H)``), optionally cut to ``max_length``."""

    def __init__(self, ds: Any, features: Any | None = None, max_length: int | None = None):
        self.ds = ds
        self.features = features
        self.max_length = max_length  # cut samples to this many tokens (None: as stored)

    def __len__(self) -> int:
        return len(self.ds)

    def __getitem__(self, i: int) -> dict:
        row = self.ds[int(i)]
        n = self.max_length
        s = {"input_ids": row["input_ids"][:n], "loss_mask": row["loss_mask"][:n], "index": int(i)}
        if self.features is not None:
            s["features"] = self.features.get(int(i))[:n]
        return s
