"""What a launch config's FSDP or DeepSpeed asks of a run (``scripts/accelerate/*.yaml``).

accelerate hands the draft to FSDP or to DeepSpeed's engine in ``prepare``; the loop then runs
as under DDP. What differs is settled here, before and after ``prepare``:

- what would fail mid-step is refused before the target loads (``check_launch``): Muon where
  each process steps a slice of each matrix (FSDP, ZeRO), ZeRO-3 for the draft (FSDP shards
  drafts here; ``target.shard`` shards targets);
- DeepSpeed takes its micro-batch, accumulation and clipping from its own config, where a
  launch config's values would silently replace the run's: ``deepspeed_settings`` writes the
  run's there;
- DeepSpeed's bf16/fp16 casts its module's weights, and with them the target's own weights a
  draft holds (Medusa-2's backbone): ``say_cast_target`` says so.

Checkpoints under either are ``trainer/checkpoint.py``'s (``whole_weights``; DeepSpeed's module
state without the frozen weights).
"""

from __future__ import annotations

from typing import Any


class LaunchError(ValueError):
    """A launch (FSDP, DeepSpeed) this run cannot train under; the message says what to use."""


def _zero_stage(accelerator: Any) -> int | None:
    plugin = accelerator.state.deepspeed_plugin
    return None if plugin is None else int(plugin.zero_stage or 0)


def slices_parameters(accelerator: Any) -> str:
    """What splits the draft's parameters (or their optimizer state) over processes under this
    launch: ``FSDP``, ``DeepSpeed ZeRO-n``; '' where every process steps whole matrices."""
    if accelerator.distributed_type.value == "FSDP":
        return "FSDP"
    stage = _zero_stage(accelerator)
    return f"DeepSpeed ZeRO-{stage}" if stage else ""


def check_launch(cfg: Any, accelerator: Any) -> None:
    """Refuse, before the target loads, what would fail in the first step."""
    if _zero_stage(accelerator) == 3:
        raise LaunchError(
            "DeepSpeed ZeRO-3 (the launch config's zero_stage: 3) would partition the draft's "
            "parameters, which this trainer shards with FSDP: launch with scripts/accelerate/"
            "fsdp.yaml, or ZeRO-2 (deepspeed_zero2.yaml); a target too large for one device "
            "is sharded by target.shard=fsdp or zero3"
        )
    sliced = slices_parameters(accelerator)
    if cfg.optim.name == "muon" and sliced:
        # torch's Muon would orthogonalise each process's slice, not the matrix
        raise LaunchError(
            f"optim=muon: Muon orthogonalises whole matrices and {sliced} gives each process a "
            "slice of them; train with optim=adamw, or launch with DDP (scripts/accelerate/"
            "ddp.yaml)"
        )


def deepspeed_settings(cfg: Any, accelerator: Any, log=print) -> None:
    """Under DeepSpeed, the run's ``data.batch_size``, ``train.grad_accum`` and
    ``optim.max_grad_norm`` become DeepSpeed's micro-batch, accumulation and clipping: its
    engine reads them from its config, where a launch config's values (``accelerate config``
    writes accumulation 1 and clipping 1.0) would replace the run's with a warning at most, and
    the length-grouped batches give accelerate no batch size to fill in. The log names every
    value of the launch config replaced."""
    plugin = accelerator.state.deepspeed_plugin
    if plugin is None:
        return
    config = plugin.deepspeed_config
    ours = {
        "train_micro_batch_size_per_gpu": cfg.data.batch_size,
        "gradient_accumulation_steps": cfg.train.grad_accum,
        "gradient_clipping": float(cfg.optim.max_grad_norm),
    }
    changed = [
        f"{k} {config[k]} -> {v}"
        for k, v in ours.items()
        if config.get(k, "auto") != "auto" and config[k] != v
    ]
    config.update(ours)
    config["train_batch_size"] = (
        cfg.data.batch_size * cfg.train.grad_accum * accelerator.num_processes
    )
    if changed:
        log(
            "deepspeed: the run's settings replace the launch config's: "
            + ", ".join(changed)
            + " (data.batch_size, train.grad_accum, optim.max_grad_norm)"
        )


def say_cast_target(accelerator: Any, target: Any, was: Any, method: str, log=print) -> None:
    """After ``prepare``: where DeepSpeed's mixed precision cast the target's own weights that
    the draft holds (``was``: the target's dtype before), the log says so."""
    if accelerator.state.deepspeed_plugin is None:
        return
    now = next((p.dtype for p in target.model.parameters() if p.dtype != was), None)
    if now is not None:
        log(
            f"deepspeed: its mixed precision casts the draft's module to {now} weights, and "
            f"with it the target's own weights the draft holds ({method}): the target "
            f"computes in {now} from here, not {was}"
        )
