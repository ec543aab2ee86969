"""The frozen target sharded across processes (``target.shard=fsdp``): each process keeps 1/N of
the target's weights and gathers what a forward needs when it needs it.

- Every decoder layer is its own FSDP2 unit (``torch.distributed.fsdp.fully_shard``, no
  gradients, no optimizer state, resharded after its forward): a target forward gathers one
  layer at a time.
- The rest (input embedding, final norm, LM head; tied or not) is the *shared* part: the draft
  reads it directly every step (EAGLE's token embeddings, the target's LM head for logits and
  soft labels), outside any target forward, so no module hook can gather it. Each process keeps
  its 1/N rows; ``SharedWeights.gathered()`` all-gathers the full tensors for one training step
  (forward and backward) or one cache/validation pass and frees them after.

So between steps a process holds 1/N of the target; during a step it holds 1/N + one layer +
the shared part (``scripts/memory_plan.py`` prints both). Every process must run the same number
of target forwards (each is a collective): the loop's steps are equal by construction, and the
feature cache pads the ranks with fewer batches (``trainer.features``).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

SHARD_CHOICES = ("none", "fsdp", "zero3")


class ShardError(ValueError):
    """A sharding setting that cannot work; the message names the setting and why."""


def check_shard(setting: str, num_processes: int, changes_target: str | None) -> None:
    """One line for a ``target.shard`` that cannot work here."""
    if setting not in SHARD_CHOICES:
        raise ShardError(f"target.shard={setting}: use one of {', '.join(SHARD_CHOICES)}")
    if setting == "none":
        return
    if num_processes < 2:
        raise ShardError(
            f"target.shard={setting} needs >= 2 processes (accelerate launch --num_processes N); "
            "with one process the whole target is on it anyway: drop target.shard"
        )
    if changes_target:
        raise ShardError(
            f"target.shard={setting}: this method trains the target's own weights "
            f"({changes_target}); shard it as the trainable model through accelerate's FSDP "
            "config (scripts/accelerate/fsdp.yaml) instead"
        )


def local_bytes(module: nn.Module) -> int:
    """Bytes of ``module``'s parameters and buffers held by this process (a sharded
    parameter counts its local shard: FSDP2's DTensor or ZeRO-3's partition; a shared weight
    its rows here)."""
    from torch.distributed.tensor import DTensor

    seen: set[int] = set()
    total = 0
    for t in [*module.parameters(), *module.buffers()]:
        if id(t) in seen:
            continue
        seen.add(id(t))
        x = t.to_local() if isinstance(t, DTensor) else getattr(t, "ds_tensor", t)
        total += x.numel() * x.element_size()
    return total


def outside_layers(model: nn.Module) -> list[nn.Parameter]:
    """The parameters of a causal LM outside its decoder layers (embedding, final norm, LM
    head), each once (a tied embedding and head is one)."""
    in_layers = {id(p) for p in model.get_decoder().layers.parameters()}
    found: dict[int, nn.Parameter] = {}
    for p in model.parameters():
        if id(p) not in in_layers:
            found.setdefault(id(p), p)
    return list(found.values())


class SharedWeights:
    """The target's parameters outside its decoder layers, kept as this process's 1/N rows
    (padded to equal row counts) and all-gathered on demand. Tied weights are one entry."""

    def __init__(self, params: list[nn.Parameter], rank: int, world: int):
        self.world = world
        self.entries: list[tuple[nn.Parameter, torch.Size, int]] = []
        self.depth = 0
        for p in params:
            rows = p.shape[0]
            per = -(-rows // world)
            flat = p.data.reshape(rows, -1)
            mine = torch.zeros(per, flat.shape[1], dtype=p.dtype, device=p.device)
            part = flat[rank * per : (rank + 1) * per]
            mine[: len(part)] = part
            self.entries.append((p, p.shape, per))
            p.data = mine  # the full tensor is freed with its last reference
        self.full_bytes = sum(s.numel() * p.element_size() for p, s, _ in self.entries)

    @contextlib.contextmanager
    def gathered(self):
        """The full weights inside the block (re-entrant: an inner block is free)."""
        if self.depth == 0:
            self._gather()
        self.depth += 1
        try:
            yield
        finally:
            self.depth -= 1
            if self.depth == 0:
                self._release()

    def _gather(self) -> None:
        self._local = []
        for p, shape, per in self.entries:
            mine = p.data
            full = torch.empty(
                per * self.world, mine.shape[1], dtype=mine.dtype, device=mine.device
            )
            dist.all_gather_into_tensor(full, mine.contiguous())
            self._local.append(mine)
            p.data = full[: shape[0]].view(shape)

    def _release(self) -> None:
        for (p, _, _), mine in zip(self.entries, self._local, strict=True):
            p.data = mine
        self._local = []


def _shard_zero3(target: Any, device: torch.device) -> ShardReport:
    """The target's decoder layers partitioned by DeepSpeed ZeRO stage 3 (no optimizer: it is
    frozen); on a CPU, DeepSpeed's CPU accelerator over the existing gloo group. Unlike
    ``fsdp``, the embedding, norm and head stay whole on every process."""
    import os

    if device.type == "cpu":
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    try:
        import deepspeed
    except ImportError:
        raise ShardError(
            "target.shard=zero3 needs DeepSpeed (pip install -e '.[deepspeed]', or pip "
            "install deepspeed); or use target.shard=fsdp"
        ) from None
    world = dist.get_world_size()
    model = target.model.requires_grad_(False)
    full = local_bytes(model)
    config = {
        "train_micro_batch_size_per_gpu": 1,
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
    }
    # ZeRO-3 over the decoder layers alone: its hooks gather a layer for its forward and free
    # it after. The embedding, norm and head stay whole on every process: the draft reads them
    # directly and inside its own forward, where ZeRO's hooks would free them mid-step.
    engine, *_ = deepspeed.initialize(model=model.get_decoder().layers, config=config)
    target._zero_engine = engine  # keeps DeepSpeed's hooks alive with the target
    target.shard_mode = "zero3"
    shared_bytes = sum(p.numel() * p.element_size() for p in outside_layers(model))
    return ShardReport(world, full, local_bytes(model), shared_bytes, "zero3")


@dataclass
class ShardReport:
    world: int
    full_bytes: int  # the whole target, unsharded
    local_bytes: int  # what this process keeps between steps
    shared_bytes: int  # the shared part, gathered during a step
    mode: str = "fsdp"

    @property
    def fraction(self) -> float:
        return self.local_bytes / max(1, self.full_bytes)

    def line(self) -> str:
        mib = 2**20
        return (
            f"target sharded over {self.world} processes ("
            + ("FSDP2, one unit per decoder layer" if self.mode == "fsdp" else "DeepSpeed ZeRO-3")
            + "): "
            f"{self.local_bytes / mib:.2f} MiB of its {self.full_bytes / mib:.2f} MiB of weights "
            f"here ({self.fraction:.3f} of the whole; 1/N = {1 / self.world:.3f}); "
            f"{self.shared_bytes / mib:.2f} MiB (embedding, norm, LM head) "
            + ("gathered per step" if self.mode == "fsdp" else "whole on every process")
        )


def shard_target(target: Any, device: torch.device, mode: str = "fsdp") -> ShardReport:
    """Shard ``target`` (a ``models.target.Target``) over the default process group, in place;
    afterwards ``target.gathered()`` gives the shared weights for a block."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    if not dist.is_initialized():
        raise ShardError(f"target.shard={mode}: no process group (run under accelerate launch)")
    if mode == "zero3":
        return _shard_zero3(target, device)
    world, rank = dist.get_world_size(), dist.get_rank()
    model = target.model.requires_grad_(False)
    full = local_bytes(model)
    mesh = init_device_mesh(device.type, (world,))
    for layer in model.get_decoder().layers:
        fully_shard(layer, mesh=mesh, reshard_after_forward=True)
    shared = SharedWeights(outside_layers(model), rank, world)
    target.shared, target.shard_mode = shared, "fsdp"
    return ShardReport(world, full, local_bytes(model), shared.full_bytes)


def most_across_processes(n: int, device: Any) -> int:
    """The largest ``n`` any process holds (a collective: every process calls it)."""
    t = torch.tensor([n], device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return int(t.item())


def equal_forwards(target: Any, n_local: int, layers: tuple[int, ...]):
    """Every process must run as many forwards of a sharded target as the others (each gathers
    layers from all). Returns a function to call after this process's ``n_local`` forwards: it
    runs one-token forwards until this process has run the most any process runs. A no-op for
    an unsharded target."""
    if not getattr(target, "sharded", False):
        return lambda: None
    extra = most_across_processes(n_local, target.device) - n_local

    def pad() -> None:
        ids = torch.zeros(1, 1, dtype=torch.long)
        for _ in range(extra):
            target.features(ids, torch.ones_like(ids), layers)

    return pad
