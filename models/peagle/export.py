"""P-EAGLE's serving layout, driven by the generic pipeline in ``models/export.py``.

``peagle``  vLLM speculators' P-EAGLE layout: EAGLE-3's speculators layout (``layers.0.*``,
            ``fc``, ``norm``, ``lm_head`` over the draft vocabulary, ``d2t``/``t2d``, the
            target's ``embed_tokens``) plus ``mask_hidden`` (1, 1, 3H); ``config.json`` with
            ``speculators_model_type: peagle``, the top-level ``mask_token_id`` and
            ``speculative_tokens`` = K. vLLM turns it into EAGLE-3 with
            ``parallel_drafting: true`` and reads ``mask_token_id`` as its parallel-drafting
            token (the EAGLE-3 layouts ``sglang``/``vllm``/``speculators`` have no place for
            ``mask_hidden``, so a P-EAGLE head exports only here).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from ..base import ExportError
from ..eagle.export import SpeculatorsEagle3
from ..export import cast
from .config import PEagleConfig
from .model import PEagleHead


class SpeculatorsPEagle(SpeculatorsEagle3):
    name, methods, description = "peagle", ("peagle",), "P-EAGLE, vLLM speculators"
    vllm_method = "eagle3"  # vLLM reads the P-EAGLE layout as EAGLE-3 with parallel drafting
    # spelled out: given the method, vLLM does not take it from the layout, drafts the head
    # sequentially as EAGLE-3 and skips mask_hidden (with a warning in its log)
    vllm_options = {"parallel_drafting": True}  # noqa: RUF012 (read only)

    def tensors(self, draft: PEagleHead, dtype: torch.dtype) -> dict[str, torch.Tensor]:
        out = super().tensors(draft, dtype)
        out.update(cast({"mask_hidden": draft.mask_hidden}, dtype))
        return out

    def config(self, draft: PEagleHead, dtype: torch.dtype, gamma: int | None = None, **_: Any):
        k = draft.cfg.ttt_steps
        # the layout records K; vLLM may serve fewer (num_speculative_tokens <= K), so a
        # smaller gamma (the one an engine evaluation serves with) exports the same folder
        if gamma is not None and gamma > k:
            raise ExportError(
                f"--gamma {gamma}: a P-EAGLE head drafts at most K = {k} tokens per forward "
                "(its ttt_steps); train it with method.ttt_steps >= the tokens you will serve"
            )
        cfg = super().config(draft, dtype, gamma=k)
        cfg["architectures"] = ["PEagleSpeculator"]
        cfg["speculators_model_type"] = "peagle"
        cfg["speculators_config"]["algorithm"] = "peagle"
        cfg["mask_token_id"] = draft.cfg.mask_token_id
        return cfg

    def expected(self, config: dict, target_config: Any) -> dict[str, tuple]:
        s = super().expected(config, target_config)
        s["mask_hidden"] = (1, 1, 3 * target_config.hidden_size)
        return s

    def check(self, path: Path, tensors: dict, config: dict, draft) -> None:
        super().check(path, tensors, config, draft)
        m, V = config.get("mask_token_id"), draft.target.config.vocab_size
        if not isinstance(m, int) or not 0 <= m < V:
            raise ExportError(
                f"{path.parent / 'config.json'}: mask_token_id={m!r}, must be a token id in "
                f"0..{V - 1}"
            )

    def build(self, target, config: dict, **settings: Any) -> PEagleHead:
        props = config.get("speculators_config", {}).get("proposal_methods") or [{}]
        k = int(props[0].get("speculative_tokens") or PEagleConfig.ttt_steps)
        return PEagleHead(
            target,
            PEagleConfig(**settings, ttt_steps=k, mask_token_id=config.get("mask_token_id")),
        )

    def detect(self, folder: Path, config: dict) -> bool:
        return config.get("speculators_model_type") == "peagle"


FORMATS = (SpeculatorsPEagle(),)
