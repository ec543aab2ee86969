"""DSpark drafts as llama.cpp GGUF (``--format gguf``): DFlash's GGUF (``models/dflash/gguf.py``)
plus the Markov head, which llama.cpp detects by its tensors and serves as ``draft-dspark``.

    llama-server -m target.gguf -md draft.gguf --spec-type draft-dspark --spec-draft-n-max <B - 1>

Added keys and tensors (as llama.cpp's converter writes them for vLLM's ``Qwen3DSparkModel``
layout): ``dflash.sample_from_anchor = false`` (the block is [last token, mask x (B - 1)], slot
i drafting position i), ``dflash.has_confidence_head``; ``markov_w1`` (V x r), ``markov_w2``
(r -> draft vocabulary), ``conf_proj`` (weight and bias). In llama.cpp, as in our drafter, slot
i's logits get ``markov_w2(markov_w1[token of slot i - 1])`` and its argmax feeds slot i + 1.

The confidence head: llama.cpp's reads [final-normed slot state; Markov embedding] (ours with
``confidence_with_markov``, the default) and stops a draft at the first slot whose estimate is
below ``--spec-draft-p-min``, where ``stop=confidence`` in our decoder stops when the running
product of the estimates falls below its threshold. A head trained without the Markov input has
no place in the GGUF: it is left out (``has_confidence_head = false``) and the export says so.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from ..base import ExportError
from ..dflash.gguf import ARCH, DFlashGGUF
from .export import VLLMDSpark


class GGUFDSpark(DFlashGGUF, VLLMDSpark):
    """DSpark drafts for llama.cpp (``--spec-type draft-dspark``)."""

    name, methods, description = "gguf-dspark", ("dspark",), "DSpark GGUF for llama.cpp"
    family = "gguf"
    spec_type = "draft-dspark"
    extra_names = {
        "markov_head.markov_w1.weight": "markov_w1.weight",
        "markov_head.markov_w2.weight": "markov_w2.weight",
        "confidence_head.proj.weight": "conf_proj.weight",
        "confidence_head.proj.bias": "conf_proj.bias",
    }
    serve_hint = (
        "llama.cpp: `llama-server -m <target.gguf> -md <this dir>/draft.gguf --spec-type "
        "draft-dspark --spec-draft-n-max <block_size - 1> --spec-draft-p-min 0` (or "
        "`specdraft-eval engine=llama.cpp draft=<this dir>` to measure it inside llama.cpp)"
    )

    @staticmethod
    def _confidence(draft) -> bool:
        """Whether the GGUF holds the draft's confidence head (llama.cpp's reads the Markov
        embedding too)."""
        return bool(draft.cfg.confidence_head and draft.cfg.confidence_with_markov)

    def extra(self, draft, tmp: Path, dtype, **opts):
        super().extra(draft, tmp, dtype, **opts)
        if draft.cfg.confidence_head and not draft.cfg.confidence_with_markov:
            return (
                "confidence head left out: llama.cpp's reads the Markov embedding too "
                "(method.confidence_with_markov=false here)"
            )
        return None

    def tensors(self, draft, dtype: torch.dtype) -> dict[str, torch.Tensor]:
        out = super().tensors(draft, dtype)
        if not self._confidence(draft):
            out = {k: v for k, v in out.items() if not k.startswith("confidence_head.")}
        return out

    def gguf_keys(self, w, draft) -> None:
        w.add_bool(f"{ARCH}.sample_from_anchor", False)
        w.add_bool(f"{ARCH}.has_confidence_head", self._confidence(draft))

    def read_config(self, folder: Path) -> dict[str, Any]:
        """The GGUF's settings in vLLM's ``Qwen3DSparkModel`` config's words."""
        g = self.gguf_settings(folder)
        shapes = g["shapes"]
        f = folder / self.weights_file
        if "markov_w1.weight" not in shapes:
            raise ExportError(f"{f}: no markov_w1.weight: a DFlash GGUF, not a DSpark one")
        rank = shapes["markov_w1.weight"][1]
        conf = shapes.get("conf_proj.weight")
        H = shapes["output_norm.weight"][0]
        return {
            "num_hidden_layers": g["num_layers"],
            "block_size": g["block_size"],
            "eagle_aux_hidden_state_layer_ids": g["fuse_layers"],
            "dflash_config": {"mask_token_id": g["mask_token_id"]},
            "draft_vocab_size": g["draft_vocab_size"],
            "markov_rank": rank,
            "markov_head_type": "vanilla",
            "enable_confidence_head": conf is not None,
            "confidence_head_with_markov": conf is not None and conf[1] == H + rank,
            # the key's absence means true to llama.cpp
            "sample_from_anchor": g["sample_from_anchor"]
            if g["sample_from_anchor"] is not None
            else True,
            "attention_bias": False,
            "causal": g["causal"],
        }


FORMATS = (GGUFDSpark(),)
