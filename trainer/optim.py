"""The optimizer a run uses, chosen by ``optim.name`` (``conf/optim/<name>.yaml``):

- ``adamw``: AdamW over every trainable parameter (torch's fused kernel where every parameter
  allows it: 5.5x faster than the per-tensor loop on a 2-core CPU for a 10M-parameter head).
- ``muon``: torch's Muon (momentum orthogonalised by Newton-Schulz iterations) on the hidden
  weight matrices and AdamW on everything else, the split vLLM's speculators trainer defaults
  to: Muon only orthogonalises matrices, and embeddings and vocabulary projections are left to
  AdamW, as in Keller Jordan's Muon. Here a matrix stays with AdamW when its name says it is an
  embedding or an LM head, or when one side is 8x the other or more (a vocabulary projection
  under another name, e.g. a Medusa head's, or a LoRA factor); fc, attention and MLP matrices
  go to Muon.

Both come back as one ``torch.optim.Optimizer``, so the loop, the lr scheduler and
accelerate's checkpointing see a single optimizer whatever the choice.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from trainer.config import OptimConfig

OPTIMIZERS = ("adamw", "muon")
_ADAMW_NAMES = ("embed", "lm_head", "wte", "lora_")
_MAX_ASPECT = 8


class OptimizerError(ValueError):
    """A setting under ``optim.`` that cannot work, named with its value."""


def build_optimizer(cfg: OptimConfig, model: nn.Module, groups: list[Any]) -> torch.optim.Optimizer:
    """``groups``: trainable parameters, or param-group dicts (a method's ``param_groups``,
    e.g. Medusa-2's heads at a multiple of the LoRA lr); ``model`` names them."""
    check_optim(cfg)
    groups = [g if isinstance(g, dict) else {"params": [g]} for g in groups]
    if cfg.name == "adamw":
        return _adamw(cfg, groups)
    names = {id(p): n for n, p in model.named_parameters()}
    muon_groups, adamw_groups = [], []
    for g in groups:
        rest = {k: v for k, v in g.items() if k != "params"}
        to_muon = [goes_to_muon(names.get(id(p), ""), p) for p in g["params"]]
        mp = [p for p, m in zip(g["params"], to_muon, strict=True) if m]
        ap = [p for p, m in zip(g["params"], to_muon, strict=True) if not m]
        if mp:
            scale = g.get("lr", cfg.lr) / cfg.lr  # a group's lr multiple carries over
            muon_groups.append({**rest, "params": mp, "lr": (cfg.muon_lr or cfg.lr) * scale})
        if ap:
            adamw_groups.append({**rest, "params": ap})
    if not muon_groups:
        return _adamw(cfg, adamw_groups)
    muon = torch.optim.Muon(
        muon_groups,
        lr=cfg.muon_lr or cfg.lr,
        momentum=cfg.muon_momentum,
        weight_decay=cfg.muon_weight_decay,
        ns_steps=cfg.muon_ns_steps,
        adjust_lr_fn=cfg.muon_adjust_lr_fn,
    )
    return Combined([muon] + ([_adamw(cfg, adamw_groups)] if adamw_groups else []))


def check_optim(cfg: OptimConfig) -> None:
    """Every ``optim.`` setting in range, else an ``OptimizerError`` naming the first one out
    (before a target loads; torch's own refusal comes at the first step, as a traceback)."""
    if cfg.name not in OPTIMIZERS:
        raise OptimizerError(f"optim.name={cfg.name!r}: choose one of {', '.join(OPTIMIZERS)}")
    betas = list(cfg.betas)
    rules = [
        ("lr", cfg.lr, cfg.lr > 0, "must be > 0"),
        ("betas", betas, len(betas) == 2 and all(0 <= b < 1 for b in betas),
         "two values in [0, 1)"),
        ("eps", cfg.eps, cfg.eps >= 0, "must be >= 0"),
        ("weight_decay", cfg.weight_decay, cfg.weight_decay >= 0, "must be >= 0"),
        ("min_lr_ratio", cfg.min_lr_ratio, 0 <= cfg.min_lr_ratio <= 1, "must be in [0, 1]"),
        ("muon_lr", cfg.muon_lr, cfg.muon_lr is None or cfg.muon_lr > 0, "must be > 0"),
        ("muon_momentum", cfg.muon_momentum, 0 <= cfg.muon_momentum < 1, "must be in [0, 1)"),
        ("muon_weight_decay", cfg.muon_weight_decay, cfg.muon_weight_decay >= 0,
         "must be >= 0"),
        ("muon_ns_steps", cfg.muon_ns_steps, cfg.muon_ns_steps >= 1, "must be >= 1"),
        ("muon_adjust_lr_fn", cfg.muon_adjust_lr_fn,
         cfg.muon_adjust_lr_fn in ("match_rms_adamw", "original"),
         "use match_rms_adamw or original"),
    ]  # fmt: skip
    for key, value, ok, why in rules:
        if not ok:
            raise OptimizerError(f"optim.{key}={value}: {why}")


def goes_to_muon(name: str, p: torch.Tensor) -> bool:
    if p.ndim != 2 or min(p.shape) <= 1 or any(h in name for h in _ADAMW_NAMES):
        return False
    return max(p.shape) < _MAX_ASPECT * min(p.shape)


def _adamw(cfg: OptimConfig, groups: list[dict]) -> torch.optim.AdamW:
    return torch.optim.AdamW(
        groups,
        lr=cfg.lr,
        betas=tuple(cfg.betas),
        eps=cfg.eps,
        weight_decay=cfg.weight_decay,
        fused=fused_adamw_ok(groups),
    )


def fused_adamw_ok(groups) -> bool:
    """torch's fused AdamW (one kernel over all parameters) where every trainable parameter is
    a floating tensor on a device it supports."""
    params = [p for g in groups for p in (g["params"] if isinstance(g, dict) else [g])]
    return bool(params) and all(
        p.is_floating_point() and p.device.type in ("cpu", "cuda") for p in params
    )


class Combined(torch.optim.Optimizer):
    """Several optimizers stepped together, seen as one: ``param_groups`` are theirs (the same
    dicts, so an lr scheduler that sets a group's lr sets it in the optimizer that uses it) and
    the state dict holds each one's under its index."""

    def __init__(self, optimizers: list[torch.optim.Optimizer]):
        params = [p for o in optimizers for g in o.param_groups for p in g["params"]]
        super().__init__(params, {})  # hooks and bookkeeping; the groups are read through
        self.optimizers = optimizers

    @property
    def param_groups(self):  # type: ignore[override]
        # read through every time: an optimizer's load_state_dict replaces its group dicts
        return [g for o in getattr(self, "optimizers", []) for g in o.param_groups]

    @param_groups.setter
    def param_groups(self, value):  # the base class builds its own list at construction
        pass

    @property
    def state(self):  # type: ignore[override]
        merged: dict = {}
        for o in self.optimizers:
            merged.update(o.state)
        return merged

    @state.setter
    def state(self, value):  # the base class assigns an empty state at construction
        pass

    @torch.no_grad()
    def step(self, closure=None):
        loss = closure() if closure is not None else None
        for o in self.optimizers:
            o.step()
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        for o in self.optimizers:
            o.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict:
        return {"optimizers": [o.state_dict() for o in self.optimizers]}

    def load_state_dict(self, state_dict: dict) -> None:
        saved = state_dict.get("optimizers")
        if not isinstance(saved, list) or len(saved) != len(self.optimizers):
            raise OptimizerError(
                "optimizer state: saved by another optim.name (expected "
                f"{len(self.optimizers)} optimizers' states)"
            )
        for o, s in zip(self.optimizers, saved, strict=True):
            o.load_state_dict(s)
