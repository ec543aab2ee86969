"""``specdraft-prepare``: have the target write the assistant replies of a dataset.

EAGLE-3, HASS and Medusa-2 train on the target's own answers to the dataset's prompts
(DistillSpec calls it sequence-level KD). This keeps every user turn, and replaces every
assistant turn by the target's reply to the conversation so far (its own earlier replies
included), turn by turn, batched over conversations with a KV cache (``generate``). The output
is a ShareGPT-format JSONL that ``data.path=`` reads like any other file.

    specdraft-prepare out=data/regen.jsonl data.max_records=2000 max_turns=1
    accelerate launch --num_processes 4 -m trainer.regenerate out=...   # sharded, then merged

Resumable: each process appends finished conversations to its own part file (flushed and
fsynced per batch); a restart skips the conversations already there. When every part is
complete, rank 0 merges them in the input's order into ``out`` (temp file + rename) and writes
``out`` + ``.meta.json`` (settings and counts). Restarting with different generation settings
is refused, naming the setting, so one file never mixes two settings.
"""

from __future__ import annotations

import json
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import hydra
import torch
from hydra.core.config_store import ConfigStore
from omegaconf import MISSING, DictConfig, OmegaConf
from tqdm.auto import tqdm

from data.chat import prompt_ids
from data.conversations import Conversation, DataError, load_conversations
from models.target import TargetConfig, TargetError, load_target

from .config import DataConfig, register_configs


@dataclass
class PrepareConfig:
    target: TargetConfig = field(default_factory=TargetConfig)
    data: DataConfig = field(default_factory=DataConfig)
    out: str = MISSING  # output JSONL
    max_new_tokens: int = 512  # per reply; a reply cut here is kept and counted as truncated
    temperature: float = 0.0  # 0: greedy. Match the decoding the draft will be used with.
    top_p: float = 1.0
    top_k: int = 0
    max_turns: int | None = None  # assistant turns regenerated per conversation (None: all)
    batch_size: int = 8  # conversations generated together
    seed: int = 0
    progress: bool = True


# Settings that change the output; a resumed run must use the same ones.
_OUTPUT_SETTINGS = ("max_new_tokens", "temperature", "top_p", "top_k", "max_turns", "seed")


class PrepareError(ValueError):
    """A bad setting or an output that cannot be resumed; the message names it."""


def _part_path(out: Path, rank: int, world: int) -> Path:
    return out.parent / f"{out.name}.parts" / f"rank{rank}-of-{world}.jsonl"


def _read_done(part: Path) -> dict[str, dict]:
    """Finished records of a part file. A line cut by a crash (no newline, or bad JSON) is
    dropped and the file truncated back to the last good line, so appends stay valid."""
    done: dict[str, dict] = {}
    if not part.exists():
        return done
    good = 0
    with open(part, "rb") as f:
        for raw in f:
            if not raw.endswith(b"\n"):
                break
            try:
                rec = json.loads(raw)
            except json.JSONDecodeError:
                break
            done[rec["id"]] = rec
            good += len(raw)
    if good != part.stat().st_size:
        with open(part, "r+b") as f:
            f.truncate(good)
    return done


def _settings(cfg: DictConfig, target_identity: str, source: str) -> dict[str, Any]:
    s = {k: cfg[k] for k in _OUTPUT_SETTINGS}
    s["target"] = target_identity
    s["source"] = source
    s["max_length"] = cfg.data.max_length
    return s


def _check_settings(meta_file: Path, settings: dict[str, Any]) -> None:
    if not meta_file.exists():
        meta_file.parent.mkdir(parents=True, exist_ok=True)
        meta_file.write_text(json.dumps({"settings": settings}, indent=1))
        return
    old = json.loads(meta_file.read_text()).get("settings", {})
    for k, v in settings.items():
        if old.get(k) != v:
            raise PrepareError(
                f"{meta_file.parent}: earlier parts were generated with {k}={old.get(k)!r}, "
                f"now {k}={v!r}; use the same settings or another out="
            )


@torch.no_grad()
def _generate(target, prompts: list[list[int]], cfg: DictConfig, seed: int):
    """Replies (token lists, end-of-turn excluded) and whether each hit max_new_tokens."""
    tok = target.tokenizer
    pad = target.pad_token_id
    n = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), n), pad, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):  # left padding: every row's last token is its own
        ids[i, n - len(p) :] = torch.tensor(p)
        mask[i, n - len(p) :] = 1
    eos = target.model.generation_config.eos_token_id
    eos = set(eos if isinstance(eos, list) else [eos] if eos is not None else [])
    eos.add(tok.eos_token_id)
    sample = cfg.temperature > 0
    kwargs: dict[str, Any] = dict(do_sample=sample, max_new_tokens=cfg.max_new_tokens)
    if sample:
        kwargs.update(temperature=cfg.temperature, top_p=cfg.top_p, top_k=cfg.top_k or None)
    else:  # greedy; unset the model's own sampling defaults so generate does not warn
        kwargs.update(temperature=None, top_p=None, top_k=None)
    torch.manual_seed(seed)
    out = target.model.generate(
        input_ids=ids.to(target.device),
        attention_mask=mask.to(target.device),
        pad_token_id=pad,
        eos_token_id=sorted(eos),
        **kwargs,
    )[:, n:].tolist()
    replies, truncated = [], []
    for row in out:
        cut = next((j for j, t in enumerate(row) if t in eos), None)
        replies.append(row[:cut] if cut is not None else row)
        truncated.append(cut is None)
    return replies, truncated


def _regenerate_batch(target, convs: list[Conversation], cfg: DictConfig, index: int, counts):
    """Rewrite the assistant turns of ``convs`` in place order: round r generates the r-th
    assistant reply of every conversation that still has one (and still fits). Sampling seeds
    depend on the batch's ``index`` in the input and the round only, so a resumed or differently
    sharded run draws the same samples."""
    tok = target.tokenizer
    msgs = [[dict(m) for m in c.messages] for c in convs]
    n_asst = [sum(m["role"] == "assistant" for m in ms) for ms in msgs]
    rounds = max(n_asst) if cfg.max_turns is None else min(max(n_asst), cfg.max_turns)
    upto = [0] * len(convs)  # messages kept so far (regenerated prefix)
    alive = [True] * len(convs)
    for r in range(rounds):
        batch, prompts = [], []
        for i, ms in enumerate(msgs):
            if not alive[i]:
                continue
            # the index of the (r+1)-th assistant message
            idx = [j for j, m in enumerate(ms) if m["role"] == "assistant"]
            if r >= len(idx):
                continue
            p = prompt_ids(tok, ms[: idx[r]])
            if len(p) + 1 >= cfg.data.max_length:
                alive[i] = False
                counts["stopped_context"] += 1
                continue
            batch.append((i, idx[r]))
            prompts.append(p)
        if not batch:
            break
        seed = (cfg.seed * 1_000_003 + index) * 1_009 + r
        replies, truncated = _generate(target, prompts, cfg, seed)
        for (i, j), reply, cut in zip(batch, replies, truncated, strict=True):
            msgs[i][j]["content"] = tok.decode(reply, skip_special_tokens=True)
            upto[i] = j + 1
            counts["replies"] += 1
            counts["truncated"] += int(cut)
            counts["reply_tokens"] += len(reply)
    out = []
    for c, ms, k in zip(convs, msgs, upto, strict=True):
        if k == 0:  # not even the first reply fitted: a marker, so a resume skips it too
            counts["dropped"] += 1
            out.append({"id": c.id, "dropped": True})
            continue
        turns = [
            {
                "from": {"user": "human", "assistant": "gpt"}.get(m["role"], m["role"]),
                "value": m["content"],
            }
            for m in ms[:k]
        ]
        out.append({"id": c.id, "conversations": turns})
    return out


def regenerate(cfg: DictConfig) -> dict[str, Any]:
    """Run the regeneration for this process's share, merge when all shares are done."""
    from accelerate import PartialState

    from .train import data_path

    for key, ok, why in [
        ("max_new_tokens", cfg.max_new_tokens >= 1, "must be >= 1"),
        ("batch_size", cfg.batch_size >= 1, "must be >= 1"),
        ("temperature", cfg.temperature >= 0, "must be >= 0"),
        ("top_p", 0 < cfg.top_p <= 1, "must be in (0, 1]"),
        ("max_turns", cfg.max_turns is None or cfg.max_turns >= 1, "must be >= 1"),
    ]:
        if not ok:
            raise PrepareError(f"{key}={cfg[key]!r}: {why}")
    # On the CPU the processes must be told so, or each one starts as a world of its own.
    state = PartialState(cpu=str(cfg.target.device) == "cpu" or not torch.cuda.is_available())
    rank, world = state.process_index, state.num_processes
    out = Path(cfg.out).expanduser().resolve()
    source = data_path(cfg.data)
    if out.exists() and Path(source).resolve() == out:
        raise PrepareError(f"out={out} is the input file; choose another path")
    convs, report = load_conversations(source, cfg.data.max_records)
    if rank == 0:
        print(report.summary(), flush=True)
    target_cfg = OmegaConf.to_object(cfg.target)
    target_cfg.device = str(state.device)  # one device per process (cuda:<local rank>)
    target = load_target(target_cfg)
    meta_file = out.parent / f"{out.name}.parts" / "settings.json"
    settings = _settings(cfg, target.identity, source)
    if rank == 0:
        _check_settings(meta_file, settings)
    state.wait_for_everyone()
    if rank != 0:
        _check_settings(meta_file, settings)

    batches = [convs[i : i + cfg.batch_size] for i in range(0, len(convs), cfg.batch_size)]
    mine = list(range(len(batches)))[rank::world]
    part = _part_path(out, rank, world)
    part.parent.mkdir(parents=True, exist_ok=True)
    done = _read_done(part)
    counts_file = part.parent / f"counts-rank{rank}-of-{world}.json"
    counts = {k: 0 for k in ("replies", "truncated", "reply_tokens", "stopped_context", "dropped")}
    if counts_file.exists() and done:  # resumed: keep counting from where it stopped
        counts.update(json.loads(counts_file.read_text()))
    new_tokens = 0
    todo = [i for i in mine if not all(c.id in done for c in batches[i])]
    t0 = time.time()
    bar = tqdm(
        total=sum(len(batches[i]) for i in mine),
        initial=sum(len(batches[i]) for i in mine) - sum(len(batches[i]) for i in todo),
        desc=f"regenerating (rank {rank})" if world > 1 else "regenerating",
        unit="conv",
        disable=not cfg.progress,
    )
    with open(part, "a", encoding="utf-8") as f:
        for i in todo:
            # a batch is written whole after it finishes, so a crash repeats at most one batch
            before = counts["reply_tokens"]
            for rec in _regenerate_batch(target, batches[i], cfg, i, counts):
                f.write(json.dumps(rec, ensure_ascii=False) + "\n")
            f.flush()
            os.fsync(f.fileno())
            counts_file.write_text(json.dumps(counts))
            new_tokens += counts["reply_tokens"] - before
            bar.update(len(batches[i]))
            bar.set_postfix(tok_s=f"{new_tokens / (time.time() - t0):.0f}")
    bar.close()
    counts_file.write_text(json.dumps(counts))
    state.wait_for_everyone()
    summary: dict[str, Any] = {"out": str(out), "rank": rank}
    if rank == 0:
        summary.update(_merge(out, convs, world, settings, report.kept))
        print(
            f"wrote {summary['records']} conversations ({summary['replies']} replies, "
            f"{summary['truncated']} cut at max_new_tokens, {summary['dropped']} dropped: "
            f"prompt longer than data.max_length) to {out}",
            flush=True,
        )
    state.wait_for_everyone()
    return summary


def _merge(out: Path, convs, world: int, settings: dict, kept: int) -> dict[str, Any]:
    parts = out.parent / f"{out.name}.parts"
    recs: dict[str, dict] = {}
    for r in range(world):
        recs.update(_read_done(_part_path(out, r, world)))
    counts: dict[str, int] = {}
    for f in parts.glob(f"counts-rank*-of-{world}.json"):
        for k, v in json.loads(f.read_text()).items():
            counts[k] = counts.get(k, 0) + v
    tmp = out.with_name(out.name + ".tmp")
    n = 0
    with open(tmp, "w", encoding="utf-8") as f:
        for c in convs:  # the input's order, whatever the sharding
            if c.id in recs and not recs[c.id].get("dropped"):
                f.write(json.dumps(recs[c.id], ensure_ascii=False) + "\n")
                n += 1
    os.replace(tmp, out)
    meta = {"settings": settings, "input_conversations": kept, "records": n, **counts}
    meta["dropped"] = kept - n
    out.with_name(out.name + ".meta.json").write_text(json.dumps(meta, indent=1))
    return meta


register_configs()
ConfigStore.instance().store(name="prepare_schema", node=PrepareConfig)


@hydra.main(version_base="1.3", config_path="../conf", config_name="prepare")
def _main(cfg: DictConfig) -> None:
    try:
        regenerate(cfg)
    except (DataError, TargetError, PrepareError) as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)


def main() -> None:
    _main()


if __name__ == "__main__":
    main()
