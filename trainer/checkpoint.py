"""Checkpoints: written to a temporary folder and renamed into place, so a crash or a full disk
mid-write never damages the previous one.

A checkpoint ``<run>/checkpoints/step_N/`` holds accelerate's state (the draft's trainable
weights and buffers, optimizer, scheduler, per-process RNG), ``trainer_state.json`` (step, epoch, data position, elapsed
time), the draft in its standalone format under ``draft/``, and ``COMPLETE`` written last.

Frozen parameters (the target's own weights inside a draft, e.g. Medusa-2's backbone under its
LoRA adapter) are left out: they are rebuilt from the target when the run starts, and saving
them would put a copy of the target in every checkpoint (16 GB each for an 8B model).
"""

from __future__ import annotations

import json
import os
import re
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, is_dataclass
from pathlib import Path
from typing import Any

from models.base import readable_by_others

STATE_FILE = "trainer_state.json"
COMPLETE = "COMPLETE"
_STEP_RE = re.compile(r"^step_(\d+)$")


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be used; the message names it."""


def checkpoints_dir(run_dir: str | Path) -> Path:
    return Path(run_dir) / "checkpoints"


def list_checkpoints(run_dir: str | Path) -> list[Path]:
    """Completed checkpoints in ``run_dir``, oldest first."""
    d = checkpoints_dir(run_dir)
    if not d.is_dir():
        return []
    found = []
    for p in d.iterdir():
        m = _STEP_RE.match(p.name)
        if m and p.is_dir():
            found.append((int(m.group(1)), p))
    return [p for _, p in sorted(found)]


def validate_checkpoint(path: Path) -> dict:
    """The trainer state of an intact checkpoint; ``CheckpointError`` naming what is wrong."""
    if not path.is_dir():
        raise CheckpointError(f"{path}: no such checkpoint folder")
    if not (path / COMPLETE).exists():
        raise CheckpointError(f"{path}: incomplete checkpoint (no {COMPLETE} marker)")
    try:
        state = json.loads((path / STATE_FILE).read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{path / STATE_FILE}: unreadable ({e})") from None
    expected = json.loads((path / COMPLETE).read_text() or "{}").get("files", {})
    for name, size in expected.items():
        f = path / name
        if not f.exists() or f.stat().st_size != size:
            raise CheckpointError(f"{path}: {name} is missing or truncated")
    return state


def latest_checkpoint(run_dir: str | Path, log=print) -> Path | None:
    """The newest intact checkpoint; damaged ones are named and passed over."""
    for p in reversed(list_checkpoints(run_dir)):
        try:
            validate_checkpoint(p)
            return p
        except CheckpointError as e:
            log(f"warning: skipping damaged checkpoint: {e}")
    return None


def save_checkpoint(
    accelerator: Any,
    run_dir: str | Path,
    step: int,
    state: dict,
    draft: Any,
    keep: int,
    frozen: Any = (),
) -> Path:
    """Write ``step_N`` atomically on every process's behalf and prune to ``keep`` newest.

    ``draft.save_draft(dir)`` writes the standalone draft (on the main process, its weights
    whole: ``whole_weights``; ``frozen``: the target's parameters, never gathered)."""
    root = checkpoints_dir(run_dir)
    final = root / f"step_{step}"
    tmp = root / f".tmp-step_{step}"
    if accelerator.is_main_process:
        root.mkdir(parents=True, exist_ok=True)
        if tmp.exists():
            shutil.rmtree(tmp)
    accelerator.wait_for_everyone()
    # DeepSpeed's engine saves its module whole, frozen weights included (and, under ZeRO-2,
    # those again as fragments), past accelerate's pre-hook
    kwargs = {"exclude_frozen_parameters": True} if _deepspeed(accelerator) else {}
    try:
        with _deepspeed_leaves_out_tied_frozen(accelerator):
            accelerator.save_state(str(tmp), **kwargs)
        accelerator.wait_for_everyone()
        with whole_weights(draft, accelerator.is_main_process, frozen):
            if accelerator.is_main_process:
                draft.save_draft(tmp / "draft")
        if accelerator.is_main_process:
            (tmp / STATE_FILE).write_text(json.dumps(state, indent=1))
            files = {
                str(f.relative_to(tmp)): f.stat().st_size
                for f in sorted(tmp.rglob("*"))
                if f.is_file()
            }
            _fsync_write(tmp / COMPLETE, json.dumps({"files": files}))
            readable_by_others(tmp)  # safetensors writes 0600; the draft/ is served as it is
            if final.exists():  # a re-run of the same step (after resume); replace it
                shutil.rmtree(final)
            os.rename(tmp, final)
            _prune(run_dir, step, keep, accelerator.print)
    except OSError as e:  # disk full, permissions, a vanished mount: keep what was there
        shutil.rmtree(tmp, ignore_errors=True)
        prev = list_checkpoints(run_dir)
        raise CheckpointError(
            f"could not write checkpoint {final} ({type(e).__name__}: {e}); "
            + (f"the previous checkpoint {prev[-1]} is intact" if prev else "no earlier one")
            + "; free space and continue with resume=true"
        ) from None
    accelerator.wait_for_everyone()
    return final


@contextmanager
def whole_weights(model: Any, is_main: bool, skip: Any = ()) -> Iterator[None]:
    """Every process: inside the block, the main process's ``model`` holds its FSDP-sharded
    parameters whole, so that ``save_draft`` (``state_dict``, ``save_pretrained``) writes the
    draft rather than this process's shard (a DTensor, which safetensors cannot write).

    Under accelerate's FSDP (``scripts/accelerate/fsdp.yaml``) a parameter between steps is a
    DTensor holding 1/N of its rows. Each one is gathered in turn (a collective: every process
    enters the block) in its stored precision, not the compute precision of a mixed-precision
    forward, and kept on the main process only; the sharded parameters are put back when the
    block ends. Frozen parameters of ``skip`` (the target's, which no draft file holds) are not
    gathered: a whole target on one device is what sharding it avoids. Without FSDP, nothing
    happens."""
    import torch
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.tensor import DTensor

    bare = _bare(model)
    for module in bare.modules():  # a unit a forward left whole (the root after validation)
        if isinstance(module, FSDPModule):  # holds its shards again, as between steps
            module.reshard()
    skipped = {id(p) for p in skip}
    owners: dict[int, list[tuple[Any, str]]] = {}
    for module in bare.modules():
        for name, p in module.named_parameters(recurse=False):
            if isinstance(p, DTensor) and (p.requires_grad or id(p) not in skipped):
                owners.setdefault(id(p), []).append((module, name))
    if not owners:
        yield
        return
    put_back: list[tuple[Any, str, Any]] = []
    for places in owners.values():  # the same order on every process
        module, name = places[0]
        sharded = module._parameters[name]
        full = sharded.full_tensor()
        if not is_main:
            del full
            continue
        whole = torch.nn.Parameter(full.detach(), requires_grad=sharded.requires_grad)
        for module, name in places:  # a tied weight: every module that holds it
            put_back.append((module, name, module._parameters[name]))
            module.register_parameter(name, whole)
    try:
        yield
    finally:
        for module, name, sharded in reversed(put_back):
            module.register_parameter(name, sharded)


def _bare(model: Any) -> Any:
    """``model`` out of a launcher's wrapper (DDP's ``module.``, DeepSpeed's engine): the names
    accelerate saves and loads weights under."""
    from accelerate.utils import extract_model_from_parallel

    return extract_model_from_parallel(model)


def frozen_names(model: Any) -> set[str]:
    """State-dict names of ``model``'s frozen parameters, as a checkpoint names them (out of
    any DDP wrapper: under a multi-process launch the prepared draft is ``module.``-prefixed,
    the weights accelerate saves are not)."""
    named = _bare(model).named_parameters(remove_duplicate=False)  # a tied LM head's name too
    return {n for n, p in named if not p.requires_grad}


def drop_frozen_weights(models: list, weights: list[dict], _output_dir: str) -> None:
    """accelerate save-state pre-hook: checkpoints keep only what training changes, and a
    tensor tied under several names (the MLP speculator's shared stages) once, under its first
    name, as accelerate's safetensors writer would keep it, but without its warning that the
    file may not reload (``_check_saved_weights`` and the load read tied names as one)."""
    import torch
    from accelerate.utils import id_tensor_storage

    for model, state in zip(models, weights, strict=False):  # FSDP/DeepSpeed: no weights here
        for name in frozen_names(model):
            state.pop(name, None)
        kept: set = set()
        for name, t in list(state.items()):
            if isinstance(t, torch.Tensor) and t.numel():
                where = id_tensor_storage(t)
                if where in kept:
                    del state[name]
                kept.add(where)


@contextmanager
def _deepspeed_leaves_out_tied_frozen(accelerator: Any) -> Iterator[None]:
    """DeepSpeed's ``exclude_frozen_parameters`` leaves out a frozen parameter under its first
    name only: a target's LM head tied to its embedding (SmolLM2, Qwen2.5 up to 3B, Gemma)
    stayed in every checkpoint under its second. While ``save_state`` runs, each engine's
    module state leaves out every name of a frozen parameter."""
    engines = [m for m in getattr(accelerator, "_models", []) if hasattr(m, "module_state_dict")]
    for engine in engines:

        def trimmed(*args, _save=engine.module_state_dict, _module=engine.module, **kwargs):
            state = _save(*args, **kwargs)
            for name in frozen_names(_module):
                state.pop(name, None)
            return state

        engine.module_state_dict = trimmed  # an instance attribute, over the class's method
    try:
        yield
    finally:
        for engine in engines:
            del engine.module_state_dict


def _deepspeed(accelerator: Any) -> bool:
    return getattr(getattr(accelerator, "distributed_type", None), "value", None) == "DEEPSPEED"


#: where accelerate's ``save_state`` puts a DeepSpeed engine's module weights
DEEPSPEED_WEIGHTS = Path("pytorch_model") / "mp_rank_00_model_states.pt"


def _saved_names(path: Path) -> tuple[Path, set[str]] | None:
    """The weight file of checkpoint ``path`` and the names it holds: accelerate's safetensors,
    or a DeepSpeed engine's module states; None for another layout (FSDP's shards, pickles),
    which accelerate loads strictly."""
    f = path / "model.safetensors"
    try:
        if f.exists():
            from safetensors import safe_open

            with safe_open(str(f), "pt") as sf:
                return f, set(sf.keys())
        f = path / DEEPSPEED_WEIGHTS
        if f.exists():
            import torch

            # memory-mapped: the names, not a read of every weight that accelerate reads again
            states = torch.load(str(f), map_location="cpu", weights_only=False, mmap=True)
            return f, set(states["module"])
    except Exception as e:
        raise CheckpointError(f"{f}: unreadable ({type(e).__name__}: {e})") from None
    return None


def _check_saved_weights(model: Any, path: Path) -> bool:
    """The checkpoint's weights must be exactly the model's trainable ones and buffers
    (frozen parameters may be present: checkpoints written before they were left out).
    False where the layout keeps its names to itself (accelerate loads those strictly)."""
    found = _saved_names(path)
    if found is None:
        return False
    f, saved = found

    frozen = frozen_names(model)
    state = _bare(model).state_dict()
    wanted = set(state) - frozen
    # tied weights (e.g. an LM head sharing the embedding) are saved once under one name
    shared: dict[tuple, set[str]] = {}
    for k, v in state.items():
        if v.numel():
            shared.setdefault((v.device, v.data_ptr()), set()).add(k)
    covered = set(saved)
    for names in shared.values():
        if names & saved:
            covered |= names
    missing, unexpected = sorted(wanted - covered), sorted(saved - wanted - frozen)
    if missing or unexpected:
        raise CheckpointError(
            f"{f}: does not fit this draft (missing {missing[:3]}{'...' if len(missing) > 3 else ''}"
            f", unexpected {unexpected[:3]}{'...' if len(unexpected) > 3 else ''}); was it "
            "written by another method or configuration?"
        )
    return True


def load_checkpoint(accelerator: Any, path: Path, model: Any = None) -> dict:
    """Restore ``path`` into the prepared objects; ``model`` (the prepared draft) is checked
    against the saved weights first, which may omit its frozen parameters."""
    state = validate_checkpoint(path)
    log = getattr(accelerator, "print", print)
    kwargs = {}
    if model is not None:
        _check_same_draft(model, path, log)
    if model is not None and frozen_names(model) and _check_saved_weights(model, path):
        # frozen parameters are not in the file; checked above
        kwargs["load_module_strict" if _deepspeed(accelerator) else "strict"] = False
    configured = _optimizer_settings(accelerator)
    try:
        accelerator.load_state(str(path), **kwargs)
    except Exception as e:  # torch/safetensors raise many types for damaged files
        raise CheckpointError(f"{path}: cannot restore ({type(e).__name__}: {e})") from None
    _keep_configured_optimizer(accelerator, configured, path, log)
    return state


def _check_same_draft(model: Any, path: Path, log=print) -> None:
    """The checkpoint's draft (``draft/config.json``) must be of this run's method and target:
    weights of the same names and shapes (EAGLE-3 and HASS, two targets of one architecture)
    would load without a word and go on training against another loss or target. Method
    settings that differ (no shape changes) are named: the run continues with its own."""
    f = path / "draft" / "config.json"
    if not f.exists():
        return  # a checkpoint from before drafts were saved with it
    try:
        saved = json.loads(f.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{f}: unreadable ({e})") from None
    bare = _bare(model)
    cfg, target = getattr(bare, "cfg", None), getattr(bare, "target", None)
    was_method = saved.get("specdraft", {}).get("method")
    name = getattr(cfg, "name", None)
    if was_method and name and was_method != name:
        raise CheckpointError(
            f"{path}: a checkpoint of a {was_method} draft; this run trains {name} "
            f"(resume with method={was_method}, or start a new run)"
        )
    from models.export import same_weights  # a target moved or renamed is the same target

    was_target = saved.get("target", {}).get("identity")
    identity = getattr(target, "identity", None)
    if was_target and identity and not same_weights(was_target, identity):
        raise CheckpointError(
            f"{path}: trained for target {was_target}; this run's target is {identity} "
            "(resume with the same target, or start a new run)"
        )
    if cfg is not None:
        changed = [
            f"method.{k}={was!r} -> {now!r}"
            for k, was, now in changed_method_settings(saved.get("method"), cfg)
        ]
        if changed:
            log(
                f"resume: method settings differ from {path}'s ({', '.join(changed)}); "
                "training continues with this run's"
            )


def changed_method_settings(saved: Any, cfg: Any) -> list[tuple[str, Any, Any]]:
    """(key, saved value, this run's) for each method setting a saved draft's config records
    (its ``method`` section) that this run's method config ``cfg`` sets otherwise, in key
    order; compared as JSON holds them (a tuple is a list)."""
    if not isinstance(saved, dict) or not is_dataclass(cfg):
        return []
    now = json.loads(json.dumps(asdict(cfg), default=str))
    return [(k, saved[k], now[k]) for k in sorted(now) if k in saved and saved[k] != now[k]]


#: optimizer group keys that say how a step is computed, not what it computes
_IMPLEMENTATION_KEYS = ("foreach", "fused", "capturable", "differentiable")


def _plain(v: Any) -> Any:
    return list(v) if isinstance(v, tuple) else v


def _optimizer_settings(accelerator: Any) -> list[list[dict]]:
    """Every prepared optimizer's param-group settings as this run configured them (less the
    parameters and the current lr, which the schedule sets)."""
    return [
        [{k: v for k, v in g.items() if k not in ("params", "lr")} for g in opt.param_groups]
        for opt in getattr(accelerator, "_optimizers", [])
    ]


def _keep_configured_optimizer(
    accelerator: Any, configured: list[list[dict]], path: Path, log=print
) -> None:
    """Loading a checkpoint also loads its optimizer's settings (lr, betas, weight decay) and
    its scheduler's base lr, so ``resume=true optim.lr=...`` would continue at the old lr
    without a word. This run's configured settings are put back, the ones that differ named;
    the optimizer's state (moments, step counts) stays the checkpoint's."""
    changed: list[str] = []
    for o, (opt, groups) in enumerate(
        zip(getattr(accelerator, "_optimizers", []), configured, strict=False)
    ):
        loaded = opt.param_groups
        if len(loaded) != len(groups):
            raise CheckpointError(
                f"{path}: its optimizer has {len(loaded)} parameter groups, this run's "
                f"{len(groups)}; was it written by another method or optimizer?"
            )
        for i, (g, want) in enumerate(zip(loaded, groups, strict=True)):
            for k, v in want.items():
                if k in g and _plain(g[k]) != _plain(v):
                    if k not in _IMPLEMENTATION_KEYS:
                        where = f"optimizer {o} " if len(configured) > 1 else ""
                        changed.append(f"{where}group {i} {k} {_plain(g[k])} -> {_plain(v)}")
                    g[k] = v
    if not changed:
        return
    for sched in getattr(accelerator, "_schedulers", []):
        inner = getattr(sched, "scheduler", sched)
        opt = getattr(inner, "optimizer", None)
        if opt is None or not hasattr(inner, "base_lrs"):
            continue
        groups = opt.param_groups
        new = [g.get("initial_lr", b) for g, b in zip(groups, inner.base_lrs, strict=False)]
        for g, was, base in zip(groups, inner.base_lrs, new, strict=False):
            if was:  # the lr of the step resumed at: the schedule's factor, on the new base
                g["lr"] = g["lr"] * base / was
        inner.base_lrs = new
        inner._last_lr = [g["lr"] for g in groups]
    log(
        f"resume: optimizer settings differ from {path}'s ({'; '.join(changed)}); "
        "training continues with this run's (the optimizer state is the checkpoint's)"
    )


def _step_of(path: Path) -> int:
    return int(_STEP_RE.match(path.name).group(1))


def _prune(run_dir: str | Path, step: int, keep: int, log=print) -> None:
    """After ``step_{step}`` is written: drop the checkpoints of later steps (written before this
    run was resumed from an earlier checkpoint: another history, which ``resume=true`` would
    otherwise continue instead of this one), then keep the ``keep`` newest (0: all). The one
    just written is never pruned."""
    found = list_checkpoints(run_dir)
    later = [p for p in found if _step_of(p) > step]
    if later:
        log(
            f"removing checkpoints {', '.join(p.name for p in later)}: written before this run "
            f"resumed from an earlier step (step {step} now continues from there)"
        )
    for p in later:
        shutil.rmtree(p, ignore_errors=True)
    kept = [p for p in found if _step_of(p) <= step]
    for old in kept[:-keep] if keep > 0 else []:
        shutil.rmtree(old, ignore_errors=True)


def _fsync_write(path: Path, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
