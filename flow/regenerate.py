"""``specdraft-prepare``: have the target write the assistant replies of a dataset.

EAGLE-3, HASS and Medusa-2 train on the target's own answers to the dataset's prompts
(DistillSpec calls it sequence-level KD). This keeps every user turn, and replaces every
assistant turn by the target's reply to the conversation so far (its own earlier replies
included), turn by turn, with continuous batching over conversations and a KV cache
(the evaluator's batched decoder with nothing drafted, ``decoding/batch.py``, on its static
cache and CUDA graphs where they run: a finished reply leaves the batch and the next prompt
joins it). The output is a ShareGPT-format JSONL that ``data.path=`` reads like any other file.

    specdraft-prepare out=data/regen.jsonl data.max_records=2000 max_turns=1
    specdraft-prepare out=data/regen2.jsonl data.skip_records=2000 data.max_records=2000 ...  # the next 2,000
    accelerate launch --num_processes 4 -m flow.regenerate out=...   # sharded, then merged

Resumable: each process appends finished conversations to its own part file (flushed and
fsynced per conversation); a restart skips the conversations already there. When every part is
complete, rank 0 merges them in the input's order into ``out`` (temp file + rename) and writes
``out`` + ``.meta.json`` (settings and counts). Restarting with different generation settings
is refused, naming the setting, so one file never mixes two settings.
"""

from __future__ import annotations

import gc
import hashlib
import json
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import hydra
import torch
from hydra.core.config_store import ConfigStore
from omegaconf import MISSING, DictConfig, OmegaConf
from tqdm.auto import tqdm

from conf.cli import StopSignals, check_command_line, exit_code_of, home_expanded
from data.chat import prompt_ids
from data.conversations import Conversation, DataError, load_conversations, split_reasoning
from decoding.batch import BatchDecoder
from decoding.batch_checks import BatchError, check_batchable
from decoding.decoder import NoDraft
from decoding.runner import COMPILE_MODES
from models.base import unwritable
from models.sampling import Sampling
from models.target import (
    GenRequest,
    TargetConfig,
    TargetError,
    describe_target,
    generate_many,
    load_target,
)
from trainer.config import DataConfig, register_configs


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
    batch_size: int = 64  # replies generated together (continuous batching)
    #: waiting replies join the batch once this many rows are free (1: as soon as one
    #: finishes; each join is a prefill forward and a copy of the running cache)
    batch_admit: int = 1
    seed: int = 0
    progress: bool = True
    #: time budget: after this many minutes no new conversation starts, the ones in flight
    #: finish and what is done is merged (the same command later continues from there)
    max_minutes: float | None = None
    #: the target's forward, as the evaluator's ``compile``: auto (the batched decoder's
    #: static cache: CUDA graphs per row bucket on a GPU, eager on a CPU; transformers' ragged
    #: cache where the lean forward cannot run), true, false (transformers')
    compile: str = "auto"
    #: who writes the replies: torch (the built-in batched decoder) or vllm (vLLM in its own
    #: environment, ``bash scripts/install.sh vllm``: its batching and kernels, and on GPU
    #: clusters its parallelism through ``engine_args``)
    engine: str = "torch"
    #: vLLM's own ``LLM`` arguments, e.g. engine_args.tensor_parallel_size=4 or
    #: engine_args.data_parallel_size=8 (engine=vllm only)
    engine_args: dict[str, Any] = field(default_factory=dict)
    #: engine=vllm: requests handed to vLLM per call (vLLM batches inside a call; finished
    #: conversations are written after each, so a crash repeats at most one call's)
    engine_chunk: int = 512


COUNTS = (
    "replies",
    "truncated",
    "reply_tokens",
    "stopped_context",
    "stopped_template",  # the target's chat template refused the conversation's prompt
    "empty_replies",  # replies with no answer: training ends the conversation there
    "dropped",
)

# Settings that change the output; a resumed run must use the same ones.
_OUTPUT_SETTINGS = (
    "max_new_tokens",
    "temperature",
    "top_p",
    "top_k",
    "max_turns",
    "seed",
    "engine",  # engines round differently in bf16, and sample with their own streams
)


#: the key under which a part file's record carries its conversation's counts (left out of
#: the merged output)
_COUNTS_KEY = "_counts"
#: the key under which it carries a digest of the input it answered (the turns the target
#: does not write: system, user, tool), so a resume after the input changed is refused
_INPUT_KEY = "_input"
#: the most seconds between syncs of the replies written to disk (``regenerate``)
SYNC_SECONDS = 1.0


def _input_digest(c) -> str:
    """What a conversation asks, in a few characters: its turns other than the assistant's,
    and its tools."""
    asked = [m for m in c.messages if m["role"] != "assistant"]
    text = json.dumps([asked, c.tools], sort_keys=True, ensure_ascii=False)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


class PrepareError(ValueError):
    """A bad setting or an output that cannot be resumed; the message names it."""


def _part_path(out: Path, rank: int, world: int) -> Path:
    return _parts_dir(out) / f"rank{rank}-of-{world}.jsonl"


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
    # the whole path: a relative one names another file when the command runs elsewhere
    s["source"] = str(Path(source).resolve())
    s["max_length"] = cfg.data.max_length
    s["skip_records"] = cfg.data.skip_records
    s["reasoning"] = cfg.data.reasoning
    return s


# settings added after outputs were written without them: what those outputs used
_ADDED_LATER = {"skip_records": 0, "engine": "torch", "reasoning": "keep"}


def _check_settings(meta_file: Path, settings: dict[str, Any], out: Path | None = None) -> None:
    """Record the settings, or check them against the earlier parts' (a run that wrote no
    reply yet, e.g. one stopped by an error, binds nothing), or where there are none (parts
    removed once merged), against those of the finished ``out`` that the run would replace."""
    written = any(f.stat().st_size for f in meta_file.parent.glob("rank*-of-*.jsonl"))
    out_meta = None if out is None else out.with_name(out.name + ".meta.json")
    if meta_file.exists() and written:
        old = json.loads(meta_file.read_text()).get("settings", {})
        where = f"{meta_file.parent}: earlier parts were"
    elif out_meta is not None and out.exists() and out_meta.exists():
        try:
            old = json.loads(out_meta.read_text()).get("settings", {})
        except ValueError:  # cut while written: nothing to hold the run to
            old = None
        where = f"{out}: it was"
    else:
        old = None
    if old is not None:
        _compare_settings(old, settings, where)
    if not meta_file.exists() or not written:
        meta_file.parent.mkdir(parents=True, exist_ok=True)
        _write_atomic(meta_file, json.dumps({"settings": settings}, indent=1))


def _compare_settings(old: dict[str, Any], settings: dict[str, Any], where: str) -> None:
    from models.export import same_weights

    for k, now in settings.items():
        was = old.get(k, _ADDED_LATER.get(k))
        if k == "target" and same_weights(was, now):
            continue  # the same weights, moved or renamed
        if k == "source":
            # where the input lies is no setting of the output: the same conversations under
            # another path (another machine, a bundle unpacked elsewhere, the packaged data in
            # another environment) continue it; each one answered is checked by its content
            # (``_INPUT_KEY``), and an input sharing none of them is refused (``_seed_from_out``)
            continue
        if was != now:
            raise PrepareError(
                f"{where} generated with {k}={was!r}, now {k}={now!r}; use the same settings "
                "or another out="
            )


class _Conversations:
    """The regeneration of some conversations, turn by turn: hands out the prompt of each
    conversation's next assistant turn and takes the reply back. Round r of a conversation is
    its (r+1)-th assistant turn; its sampling seed depends only on the conversation's index in
    the input, the round and ``cfg.seed``, so a resumed or differently sharded run draws the
    same samples."""

    def __init__(self, target, convs: list[tuple[int, Conversation]], cfg: DictConfig):
        self.tok, self.cfg = target.tokenizer, cfg
        # counted per conversation and handed over with its record, so a resumed run's totals
        # count exactly the conversations written
        self.counts = {i: dict.fromkeys(COUNTS, 0) for i, _ in convs}
        self.convs = dict(convs)  # input index -> conversation
        self.msgs = {i: [dict(m) for m in c.messages] for i, c in convs}
        self.upto = dict.fromkeys(self.convs, 0)  # messages kept so far (regenerated prefix)
        self.round = dict.fromkeys(self.convs, 0)

    def next_request(self, i: int) -> GenRequest | None:
        """The request for conversation i's next assistant turn, or None when it is done."""
        cfg, ms = self.cfg, self.msgs[i]
        r = self.round[i]
        idx = [j for j, m in enumerate(ms) if m["role"] == "assistant"]
        if r >= len(idx) or (cfg.max_turns is not None and r >= cfg.max_turns):
            return None
        p = _prompt(self.tok, ms[: idx[r]], self.convs[i].tools, cfg.data.reasoning)
        if p is None:
            self.counts[i]["stopped_template"] += 1
            return None
        if len(p) + 1 >= cfg.data.max_length:
            self.counts[i]["stopped_context"] += 1
            return None
        return GenRequest((i, idx[r]), p, (cfg.seed * 1_000_003 + i) * 1_009 + r)

    def take_reply(self, key, reply: list[int], truncated: bool) -> GenRequest | None:
        """Store a reply; returns the conversation's next request (None: it is finished)."""
        i, j = key
        # the reply replaces the turn whole: its reasoning (a thinking target writes
        # <think>...</think> first, kept as it wrote it) and any tool call are in its text
        self.msgs[i][j] = {
            "role": "assistant",
            "content": self.tok.decode(reply, skip_special_tokens=True),
        }
        self.upto[i] = j + 1
        self.round[i] += 1
        n = self.counts[i]
        n["replies"] += 1
        n["truncated"] += int(truncated)
        n["reply_tokens"] += len(reply)
        # no answer (white space, or a reasoning trace only): training ends the conversation
        # at such a turn (the later turns are still written: the record stays whole)
        n["empty_replies"] += int(not split_reasoning(self.msgs[i][j]["content"])[1].strip())
        return self.next_request(i)

    def record(self, i: int) -> tuple[dict, dict[str, int]]:
        """The finished conversation as a ShareGPT record (or a dropped marker), and its
        counts."""
        c, k, n = self.convs[i], self.upto[i], self.counts.pop(i)
        if k == 0:  # not even the first reply fitted: a marker, so a resume skips it too
            n["dropped"] += 1
            return {"id": c.id, "dropped": True}, n
        msgs = self.msgs[i][:k]
        if c.tools or any(set(m) != {"role", "content"} for m in msgs):
            # tool turns, tool calls or reasoning fields: the OpenAI shape keeps them
            rec = {"id": c.id, "messages": msgs}
            return ({**rec, "tools": c.tools} if c.tools else rec), n
        turns = [
            {
                "from": {"user": "human", "assistant": "gpt"}.get(m["role"], m["role"]),
                "value": m["content"],
            }
            for m in msgs
        ]
        return {"id": c.id, "conversations": turns}, n


def _prompt(tok, messages, tools, reasoning: str) -> list[int] | None:
    """The prompt's token ids, or None where the target's chat template refuses the
    conversation (roles that must alternate, a system turn it does not take...): that
    conversation stops there and is counted, as training skips such a record."""
    try:
        return prompt_ids(tok, messages, tools, reasoning)
    except DataError:
        raise
    except Exception:  # noqa: BLE001 - jinja's own errors, raised by the template's text
        return None


def _first_prompt_len(tok, conv: Conversation, reasoning: str = "keep") -> int:
    """Tokens of the prompt that the first assistant reply answers (0: none, or a prompt the
    template refuses: counted when its turn comes)."""
    i = next((j for j, m in enumerate(conv.messages) if m["role"] == "assistant"), None)
    if i is None:
        return 0
    return len(_prompt(tok, conv.messages[:i], conv.tools, reasoning) or [])


def regenerate(cfg: DictConfig) -> dict[str, Any]:
    """Run the regeneration for this process's share, merge when all shares are done."""
    from accelerate import PartialState

    from trainer.train import data_path

    if OmegaConf.is_missing(cfg, "out"):
        raise PrepareError("out=<file.jsonl> is required: where the target's answers are written")
    for key, ok, why in [
        ("max_new_tokens", cfg.max_new_tokens >= 1, "must be >= 1"),
        ("batch_size", cfg.batch_size >= 1, "must be >= 1"),
        (
            "batch_admit",
            1 <= cfg.batch_admit <= max(1, cfg.batch_size),
            f"free rows before waiting replies join: between 1 and batch_size ({cfg.batch_size})",
        ),
        ("temperature", cfg.temperature >= 0, "must be >= 0"),
        ("top_p", 0 < cfg.top_p <= 1, "must be in (0, 1]"),
        ("top_k", cfg.top_k >= 0, "must be >= 0 (0: off)"),
        ("max_turns", cfg.max_turns is None or cfg.max_turns >= 1, "must be >= 1"),
        ("max_minutes", cfg.max_minutes is None or cfg.max_minutes > 0, "must be > 0"),
        ("compile", str(cfg.compile).lower() in COMPILE_MODES, "use auto, true, false or fused"),
        ("engine", cfg.engine in ("torch", "vllm"), "use torch (built in) or vllm"),
        ("engine_chunk", cfg.engine_chunk >= 1, "must be >= 1"),
    ]:
        if not ok:
            raise PrepareError(f"{key}={cfg[key]!r}: {why}")
    d = cfg.data
    for key, value, ok, why in [
        ("max_length", d.max_length, d.max_length >= 8, "must be >= 8"),
        ("max_records", d.max_records, d.max_records is None or d.max_records >= 1, "must be >= 1"),
        ("skip_records", d.skip_records, d.skip_records >= 0, "must be >= 0"),
    ]:
        if not ok:
            raise PrepareError(f"data.{key}={value!r}: {why}")
    if cfg.engine != "vllm" and cfg.engine_args:
        raise PrepareError(
            f"engine_args={OmegaConf.to_container(cfg.engine_args)}: vLLM's arguments, and "
            f"engine={cfg.engine}; use engine=vllm, or leave engine_args out"
        )
    # On the CPU the processes must be told so, or each one starts as a world of its own.
    state = PartialState(cpu=str(cfg.target.device) == "cpu" or not torch.cuda.is_available())
    rank, world = state.process_index, state.num_processes
    out = Path(cfg.out).expanduser().resolve()
    source = data_path(cfg.data)
    if out.exists() and Path(source).resolve() == out:
        raise PrepareError(f"out={out} is the input file; choose another path")
    if Path(source).is_dir() and out.is_relative_to(Path(source).resolve()):
        raise PrepareError(
            f"out={out} is inside data.path={source}: the next run would read its output as "
            "input; choose a path outside that folder"
        )
    if out.is_dir():
        raise PrepareError(f"out={out} is a folder; name a file in it (out={out}/regen.jsonl)")
    why = unwritable(out)
    if why is not None:
        raise PrepareError(f"out={out}: {why}")
    ours = out.with_name(out.name + ".meta.json").exists() or _parts_dir(out).exists()
    if out.exists() and not ours:
        raise PrepareError(
            f"out={out} exists and is no output of specdraft-prepare (no {out.name}.meta.json "
            "beside it); choose another path, or remove the file"
        )
    convs, report = load_conversations(source, cfg.data.max_records, cfg.data.skip_records)
    if rank == 0:
        print(report.summary(), flush=True)
    target_cfg = OmegaConf.to_object(cfg.target)
    target_cfg.device = str(state.device)  # one device per process (cuda:<local rank>)
    if cfg.engine == "vllm":
        if world > 1:
            raise PrepareError(
                "engine=vllm runs in one process: vLLM parallelises itself "
                "(engine_args.tensor_parallel_size=N, engine_args.data_parallel_size=N)"
            )
        from decoding.engines.base import EngineError
        from decoding.engines.vllm_eval import vllm_python

        try:  # vLLM missing: say which command installs it, before anything runs
            vllm_python()
        except EngineError as e:
            raise PrepareError(f"engine=vllm: {e}") from None
    if cfg.engine == "torch" and target_cfg.path is None and target_cfg.name == "tiny_random":
        target = load_target(target_cfg)  # built in memory in a moment
        eos = _eos(target)
    else:
        # the tokenizer and identity only: the weights are loaded (or the engine started) once
        # something is left to generate, so a finished run resumed loads nothing
        tok, identity, folder, eos = describe_target(target_cfg)
        target = SimpleNamespace(
            tokenizer=tok, identity=identity, folder=folder, dtype=target_cfg.dtype
        )
    meta_file = _parts_dir(out) / "settings.json"
    settings = _settings(cfg, target.identity, source)
    if rank == 0:
        _check_settings(meta_file, settings, out)
    state.wait_for_everyone()
    if rank != 0:
        _check_settings(meta_file, settings, out)

    # Conversations go to processes round-robin, each process serving its share shortest
    # prompt first (rows that join the running batch together then need little padding); the
    # merged output keeps the input's order.
    first = [_first_prompt_len(target.tokenizer, c, cfg.data.reasoning) for c in convs]
    order = sorted(range(len(convs)), key=lambda i: first[i])
    mine = order[rank::world]
    part = _part_path(out, rank, world)
    part.parent.mkdir(parents=True, exist_ok=True)
    done = _read_done(part)
    seeded = _seed_from_out(out, part, convs, mine, done, source)
    if seeded and rank == 0:
        print(f"continuing from the {len(seeded):,} conversations of {out}", flush=True)
    for i in mine:  # records without ids are named by their line: an edited input renames them
        c = convs[i]
        was = done.get(c.id, {}).get(_INPUT_KEY)
        if was is not None and was != _input_digest(c):
            raise _changed_input(source, c.id, part)
    counts_file = part.parent / f"counts-rank{rank}-of-{world}.json"
    counts = dict.fromkeys(COUNTS, 0)
    if counts_file.exists() and done:  # resumed: keep counting from where it stopped
        try:
            counts.update(json.loads(counts_file.read_text()))
        except ValueError:  # cut by a stop while it was written: the records hold theirs
            pass
    for rec in seeded:  # copied from the output into the part just now
        for k, v in rec[_COUNTS_KEY].items():
            counts[k] = counts.get(k, 0) + v
    todo = [i for i in mine if convs[i].id not in done]
    work = _Conversations(target, [(i, convs[i]) for i in todo], cfg)
    t0 = time.time()
    deadline = t0 + 60 * (cfg.max_minutes or 0)
    bar = tqdm(
        total=len(mine),
        initial=len(mine) - len(todo),
        desc=f"regenerating (rank {rank})" if world > 1 else "regenerating",
        unit="conv",
        disable=not cfg.progress,
    )
    new_tokens = 0
    synced = time.monotonic()

    with open(part, "a", encoding="utf-8") as f:

        def sync() -> None:
            nonlocal synced
            os.fsync(f.fileno())
            _write_atomic(counts_file, json.dumps(counts))
            synced = time.monotonic()

        def finish(i: int) -> None:
            # each conversation is written when its last turn is done and handed to the OS at
            # once, so a stopped or killed process repeats only the conversations in flight;
            # the disk is synced at most every SYNC_SECONDS (a machine's crash repeats those
            # seconds' too): a GPU writes dozens of replies a second, and a sync can take
            # milliseconds on a network file system
            nonlocal new_tokens
            rec, n = work.record(i)
            # its counts travel with it: the merge counts exactly the records it writes
            rec = {**rec, _COUNTS_KEY: n, _INPUT_KEY: _input_digest(convs[i])}
            f.write(json.dumps(rec, ensure_ascii=False) + "\n")
            f.flush()
            for k, v in n.items():
                counts[k] += v
            if time.monotonic() - synced >= SYNC_SECONDS:
                sync()
            new_tokens += n["reply_tokens"]
            bar.update(1)
            bar.set_postfix(tok_s=f"{new_tokens / max(time.time() - t0, 1e-9):.0f}")

        def on_done(key, reply, truncated):
            nxt = work.take_reply(key, reply, truncated)
            if nxt is None:
                finish(key[0])
                return ()
            return (nxt,)

        first_requests = []
        for i in todo:
            r = work.next_request(i)
            if r is None:
                finish(i)
            else:
                first_requests.append(r)
        if first_requests:
            if cfg.engine == "torch" and not hasattr(target, "model"):
                target = load_target(target_cfg)
                eos = _eos(target)
            # what is loaded (data, target, libraries) lives to the end: frozen, the collector
            # skips it, where scanning it paused a 512-row loop for milliseconds a step
            gc.collect()
            gc.freeze()
            try:
                loop = _generate(
                    target,
                    cfg,
                    first_requests,
                    eos,
                    on_done,
                    None if cfg.max_minutes is None else lambda: time.time() > deadline,
                )
            finally:
                gc.unfreeze()
            if loop is not None and loop.forwards:
                print(loop_account(loop), flush=True)
        sync()
    bar.close()
    state.wait_for_everyone()
    summary: dict[str, Any] = {"out": str(out), "rank": rank}
    if rank == 0:
        summary.update(_merge(out, convs, world, settings, report.kept))
        print(
            f"wrote {summary['records']} conversations ({summary['replies']} replies, "
            f"{summary['truncated']} cut at max_new_tokens, {summary['dropped']} dropped: "
            f"first prompt longer than data.max_length or refused by the chat template) to "
            f"{out}",
            flush=True,
        )
        notes = [
            f"{summary.get('stopped_template', 0)} conversations stopped where the target's chat "
            "template refused their prompt",
            f"{summary.get('empty_replies', 0)} replies had no answer (white space, or a "
            "reasoning trace only): training ends their conversations there",
        ]
        for note in notes:
            if not note.startswith("0 "):
                print(f"note: {note}", flush=True)
        if summary["not_reached"]:
            print(
                f"stopped at max_minutes={cfg.max_minutes}: {summary['not_reached']} "
                "conversations not reached; the same command continues from here",
                flush=True,
            )
    state.wait_for_everyone()
    return summary


def loop_account(st) -> str:
    """Where the batched decoder's time went while it wrote replies (``BatchStats``): tokens/s,
    the batch's occupancy, and the shares of the target's forwards, prefills and the rest (the
    host's work between forwards, the replies' writing)."""
    wall, rest = max(st.wall, 1e-9), max(0.0, st.host_seconds)
    return (
        f"decoding: {st.rows.new_tokens:,} tokens (stop tokens included) in {wall:.1f} s "
        f"({st.tokens_per_second:,.0f} tokens/s), {st.forwards:,} forwards of "
        f"{st.row_slots / st.forwards:.0f} rows on average; forwards "
        f"{st.rows.t_target / wall:.0%}, prefills {st.rows.t_prefill / wall:.0%}, the rest "
        f"{rest / wall:.0%} ({1e3 * rest / st.forwards:.2f} ms a forward)"
    )


def _eos(target) -> set[int]:
    """The tokens that end a reply: the loaded target's generation config's and its
    tokenizer's end of sequence."""
    eos = target.model.generation_config.eos_token_id
    eos = set(eos if isinstance(eos, list) else [eos] if eos is not None else [])
    return eos | {target.tokenizer.eos_token_id}


def _generate(target, cfg, requests: list[GenRequest], eos: set[int], on_done, should_stop):
    """The replies, with continuous batching: on the batched decoder with nothing drafted
    (``decoding/batch.py``: the evaluator's loop, on its static cache and, on a GPU, its CUDA
    graphs), or for a target whose cache cannot be joined (sliding-window layers) on
    ``models.target.generate_many`` (batches of one padded prefill each, the next once one has
    finished). Returns the batched decoder's ``BatchStats`` where it ran, else None."""
    if cfg.engine == "vllm":
        _generate_vllm(target, cfg, requests, eos, on_done, should_stop)
        return None
    sampling = Sampling(cfg.temperature, cfg.top_k, cfg.top_p)
    try:
        check_batchable(target, NoDraft())
    except BatchError:
        generate_many(
            target.model,
            requests,
            cfg.max_new_tokens,
            eos,
            target.pad_token_id,
            on_done,
            sampling,
            batch_size=cfg.batch_size,
            should_stop=should_stop,
        )
        return None
    longest = cfg.data.max_length + cfg.max_new_tokens  # a prompt is cut before max_length
    try:
        dec = BatchDecoder(
            target,
            NoDraft(),
            sampling,
            cfg.batch_size,
            gamma=0,
            admit=cfg.batch_admit,
            compile=str(cfg.compile).lower(),
            max_len=longest + 8,
            race=True,  # a resumed run writes the same file (``AcceptRule.race``)
        )
    except BatchError as e:
        raise PrepareError(f"compile={cfg.compile}: {e}") from None
    dec.run(
        requests,
        cfg.max_new_tokens,
        frozenset(eos),
        on_done=on_done,
        should_stop=should_stop,
        longest=longest,
    )
    return dec.stats


def _generate_vllm(target, cfg, requests: list[GenRequest], eos, on_done, should_stop):
    """The replies written by vLLM (``decoding/engines/vllm_eval.py``), ``engine_chunk``
    requests a call, each with its own seed (a resumed run draws the same samples); a
    conversation's next turn joins a later call once its reply is back."""
    from collections import deque

    from decoding.engines.base import EngineError
    from decoding.engines.vllm_eval import VLLMWorker

    dtype = target.dtype
    if dtype == "auto":  # as load_target would choose: bf16 where it is native
        from models.target import default_dtype, resolve_device

        dtype = str(default_dtype(resolve_device(cfg.target.device))).removeprefix("torch.")
    longest = cfg.data.max_length + cfg.max_new_tokens
    args = {"max_num_seqs": cfg.batch_size, **OmegaConf.to_container(cfg.engine_args)}
    pending = deque(requests)
    try:
        with VLLMWorker(
            target.folder, dtype=dtype, max_model_len=longest + 8, seed=cfg.seed, extra=args
        ) as eng:
            while pending and not (should_stop is not None and should_stop()):
                chunk = [pending.popleft() for _ in range(min(cfg.engine_chunk, len(pending)))]
                params = [
                    {
                        "max_tokens": cfg.max_new_tokens,
                        "temperature": cfg.temperature,
                        "top_p": cfg.top_p,
                        "top_k": cfg.top_k,
                        "seed": r.seed,
                        "stop_token_ids": sorted(eos),
                        "skip_special_tokens": False,
                        "detokenize": False,
                    }
                    for r in chunk
                ]
                outs = eng.generate_many([r.prompt for r in chunk], params)
                for r, o in zip(chunk, outs, strict=True):
                    reply = [t for t in o["tokens"] if t not in eos]  # its stop token left out
                    pending.extend(on_done(r.key, reply, o["finish_reason"] == "length"))
    except EngineError as e:
        raise PrepareError(f"engine=vllm: {e}") from None


def _changed_input(source, cid: str, where: Path) -> PrepareError:
    """The refusal of an input whose conversation ``cid`` is not the one ``where`` answered."""
    return PrepareError(
        f"{Path(source).resolve()}: conversation {cid} is not the one answered in {where} (the "
        "input changed since); give the input as it was, or another out="
    )


def _seed_from_out(out: Path, part: Path, convs, mine: list[int], done: dict, source) -> list:
    """Copy into this process's part the conversations of ``mine`` that a finished ``out``
    answered and the part lacks (``out`` carried without its parts, or written by another
    number of processes), each with the digest and counts its ``.meta.json`` index keeps, so
    they are not written again. A conversation whose input changed since, or an output whose
    conversations are none of the input's, is refused. Returns the records copied."""
    meta_file = out.with_name(out.name + ".meta.json")
    if not out.exists() or not meta_file.exists():
        return []
    try:
        index = json.loads(meta_file.read_text()).get("index") or {}
    except ValueError:  # cut while written: nothing to continue from
        return []
    if not index:
        return []  # nothing reached, or written before outputs kept their index
    if not any(c.id in index for c in convs):
        raise PrepareError(
            f"out={out} holds {len(index):,} conversations of another input: none of them is "
            f"in data.path={Path(source).resolve()}; give the input it was written from, or "
            "another out="
        )
    wanted = {convs[i].id for i in mine if convs[i].id in index and convs[i].id not in done}
    if not wanted:
        return []
    for i in mine:  # before anything is copied: the part stays as it was
        if convs[i].id in wanted and index[convs[i].id][0] != _input_digest(convs[i]):
            raise _changed_input(source, convs[i].id, out)
    records = {}
    with open(out, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            try:
                rec = json.loads(line)
            except ValueError as e:  # edited by hand, or cut on the way
                raise PrepareError(
                    f"out={out}: line {n} is not JSON ({e.msg}); mend it, or remove the line "
                    "(its conversation is then written again)"
                ) from None
            if isinstance(rec, dict) and rec.get("id") in wanted:
                records[rec["id"]] = rec
    copied = []
    with open(part, "a", encoding="utf-8") as f:
        for i in mine:
            cid = convs[i].id
            if cid not in wanted:
                continue
            digest, *values = index[cid]
            counts = dict(zip(COUNTS, values, strict=False))
            rec = records.get(cid)
            if rec is None and not counts.get("dropped"):
                continue  # not in the output (edited since): written again
            rec = rec or {"id": cid, "dropped": True}
            rec = {**rec, _COUNTS_KEY: counts, _INPUT_KEY: digest}
            f.write(json.dumps(rec, ensure_ascii=False) + "\n")
            done[cid] = rec
            copied.append(rec)
        f.flush()
        os.fsync(f.fileno())
    return copied


def _parts_dir(out: Path) -> Path:
    """Where each process appends its replies until they are merged into ``out``."""
    return out.parent / f"{out.name}.parts"


def _write_atomic(path: Path, text: str) -> None:
    """``path`` holds the old text or the new, never a part of either (a stop can land in the
    middle of a write)."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def _merge(out: Path, convs, world: int, settings: dict, kept: int) -> dict[str, Any]:
    parts = _parts_dir(out)
    recs: dict[str, dict] = {}
    for r in range(world):
        recs.update(_read_done(_part_path(out, r, world)))
    mine = [recs[c.id] for c in convs if c.id in recs]
    counts = dict.fromkeys(COUNTS, 0)
    if all(_COUNTS_KEY in rec for rec in mine):
        # the counts of the records written, not of every record the parts hold (a resumed run
        # with a smaller data.max_records writes fewer)
        for rec in mine:
            for k, v in rec[_COUNTS_KEY].items():
                counts[k] = counts.get(k, 0) + v
    else:  # parts written before records carried their counts: each process's totals
        for f in parts.glob(f"counts-rank*-of-{world}.json"):
            for k, v in json.loads(f.read_text()).items():
                counts[k] = counts.get(k, 0) + v
    tmp = out.with_name(out.name + ".tmp")
    n = 0
    with open(tmp, "w", encoding="utf-8") as f:
        for rec in mine:  # the input's order, whatever the sharding
            if not rec.get("dropped"):
                rec = {k: v for k, v in rec.items() if k not in (_COUNTS_KEY, _INPUT_KEY)}
                f.write(json.dumps(rec, ensure_ascii=False) + "\n")
                n += 1
    os.replace(tmp, out)
    reached = len(mine)
    meta = {"settings": settings, "input_conversations": kept, "records": n, **counts}
    # each conversation reached: the digest of its input and its counts, so the output alone
    # (carried to another machine, or read by another number of processes, its parts left
    # behind) continues where it stopped (``_seed_from_out``)
    meta["index"] = {
        rec["id"]: [rec[_INPUT_KEY], *(rec[_COUNTS_KEY].get(k, 0) for k in COUNTS)]
        for rec in mine
        if _INPUT_KEY in rec and _COUNTS_KEY in rec
    }
    meta["dropped"] = reached - n  # first prompts too long, or refused by the template
    meta["not_reached"] = kept - reached  # left by max_minutes
    _write_atomic(out.with_name(out.name + ".meta.json"), json.dumps(meta, indent=1))
    return meta


register_configs()
ConfigStore.instance().store(name="prepare_schema", node=PrepareConfig)


@hydra.main(version_base="1.3", config_path="../conf", config_name="prepare")
def _main(cfg: DictConfig) -> None:
    try:
        # at once: every finished conversation is already in its part file
        with StopSignals(deferred=False):
            regenerate(cfg)
    except (DataError, TargetError, PrepareError) as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    except KeyboardInterrupt as e:  # Ctrl-C, or a scheduler's SIGTERM
        parts = _parts_dir(Path(cfg.out).expanduser().resolve())
        print(
            f"\nstopped: the replies written so far are kept in {parts}; the same command "
            "continues from them",
            file=sys.stderr,
        )
        sys.exit(exit_code_of(e))


def main() -> None:
    sys.argv[1:] = home_expanded(sys.argv[1:])
    msg = check_command_line("prepare", sys.argv[1:])
    if msg:
        print(f"error: {msg}", file=sys.stderr)
        sys.exit(2)
    _main()


if __name__ == "__main__":
    main()
