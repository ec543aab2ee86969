"""The one contract between the training loop and a draft method.

A method is an ``nn.Module`` whose registered parameters are exactly what it trains (the frozen
target is held by reference, never registered), with:

- ``feature_layers``: target hidden-state indices it reads (see ``models.target``); the loop
  fills ``batch["features"]`` (B, T, len(feature_layers), H) from the target or from the
  on-disk cache before calling the method.
- ``forward(batch) -> StepOutput``: the training loss and metrics.
- ``evaluate(batch) -> metrics``: validation metrics (no gradients).
- ``save_draft(dir)`` / ``load_draft(dir, target)``: the draft's own weights and config,
  loadable without any training state.

Metrics are ``{name: tensor([sum, count])}``, detached, so that they add up across steps and
processes and are divided only when logged (no ``.item()`` in the hot path).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import torch

DRAFT_CONFIG = "config.json"
DRAFT_WEIGHTS = "model.safetensors"


@dataclass
class StepOutput:
    loss: torch.Tensor
    metrics: dict[str, torch.Tensor] = field(default_factory=dict)


def metric(total: torch.Tensor | float, count: torch.Tensor | float) -> torch.Tensor:
    """A summable metric: stack([sum, count]) as a detached float32 tensor."""
    t = torch.as_tensor(total, dtype=torch.float32).detach()
    c = torch.as_tensor(count, dtype=torch.float32, device=t.device).detach()
    return torch.stack([t.float(), c])


def add_metrics(acc: dict[str, torch.Tensor], new: dict[str, torch.Tensor]) -> None:
    for k, v in new.items():
        acc[k] = acc[k] + v.to(acc[k].device) if k in acc else v.clone()


def reduce_metrics(acc: dict[str, torch.Tensor]) -> dict[str, float]:
    out = {}
    for k, v in acc.items():
        s, c = v.tolist()
        if c > 0:
            out[k] = s / c
    return out


class DraftError(ValueError):
    """A draft checkpoint that cannot be used; the message names the folder and the problem."""


# The modules LoRA adapts by default (Llama-family names; any HF decoder's names work).
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def write_draft_config(
    path: Path, method_cfg: object, target, format_version: int, **extra
) -> None:
    """``config.json`` of a saved draft: the method and its settings, the target it was trained
    for (checked when it is loaded or evaluated), and any method-specific ``extra`` keys."""
    from dataclasses import asdict

    t = target
    cfg = {
        "specdraft": {"method": method_cfg.name, "format_version": format_version},
        "method": asdict(method_cfg),
        "target": {
            "identity": t.identity,
            "name": t.cfg.name,
            "path": t.cfg.path,
            "hidden_size": t.hidden_size,
            "num_hidden_layers": t.num_layers,
            "vocab_size": t.config.vocab_size,
        },
        **extra,
    }
    (Path(path) / DRAFT_CONFIG).write_text(json.dumps(cfg, indent=1))


def read_draft_config(path: str | Path) -> dict:
    p = Path(path)
    f = p / DRAFT_CONFIG
    if not f.exists():
        raise DraftError(f"{p}: not a draft folder (no {DRAFT_CONFIG})")
    try:
        cfg = json.loads(f.read_text())
    except json.JSONDecodeError as e:
        raise DraftError(f"{f}: not valid JSON ({e})") from None
    if not isinstance(cfg, dict) or "specdraft" not in cfg:
        raise DraftError(f"{f}: not a specdraft draft config (no 'specdraft' key)")
    return cfg


# ---------------------------------------------------------------------------------------------
# Decode-time contract (shared by every proposer; the decoder lives in decoding/)


@dataclass
class Proposal:
    """Draft tokens as a tree. ``parents[i]`` is the index of node i's parent (-1: the root, i.e.
    the last committed token); a chain has parents [-1, 0, 1, ...]. ``q[i]`` is the (warped)
    draft distribution node i was sampled from, (N, V); None for deterministic proposers (a
    point mass on the token) and for greedy decoding."""

    tokens: list[int]
    parents: list[int]
    q: torch.Tensor | None = None
    bucket: str | None = None  # a confidence class; acceptance is tracked per bucket

    @staticmethod
    def chain(
        tokens: list[int], q: torch.Tensor | None = None, bucket: str | None = None
    ) -> Proposal:
        return Proposal(list(tokens), list(range(-1, len(tokens) - 1)), q, bucket)

    def truncated(self, k: int) -> Proposal:
        """The first ``k`` nodes (for a chain: the first k tokens)."""
        if k >= len(self.tokens):
            return self
        if any(p >= k for p in self.parents[:k]):
            raise ValueError("truncating a tree must keep every kept node's parent")
        q = self.q[:k] if self.q is not None else None
        return Proposal(self.tokens[:k], self.parents[:k], q, self.bucket)

    def __len__(self) -> int:
        return len(self.tokens)


@dataclass
class DecodeState:
    """What a proposer may read. ``ids``: committed tokens (prompt + generated) as a list; the
    last one is not yet fed to the target. ``features``: (len(ids) - 1, L, H) target hidden
    states at the proposer's ``feature_layers`` for every fed position (None if it needs none).
    """

    ids: list[int]
    features: torch.Tensor | None
    sampling: object  # decoding.sampling.Sampling
    generator: torch.Generator | None
    device: torch.device


def crop_cache(cache, length: int) -> None:
    """Cut a transformers KV cache back to its first ``length`` positions."""
    n = cache.get_seq_length()
    if n > length:
        cache.crop(-(n - length))
