"""DSpark's serving layout, driven by the generic pipeline in ``models/export.py``.

``dspark``  vLLM's native ``Qwen3DSparkModel`` (``vllm/model_executor/models/qwen3_dspark.py``):
            a flat Qwen3 ``config.json`` with the draft layers' sizes, ``architectures:
            [Qwen3DSparkModel]``, ``dflash_config`` (``mask_token_id``, ``target_layer_ids`` =
            our fused ``hidden_states`` indices - 1, non-causal blocks),
            ``eagle_aux_hidden_state_layer_ids``, ``block_size``, ``markov_rank``,
            ``markov_head_type: vanilla``, ``enable_confidence_head``,
            ``confidence_head_with_markov``, ``draft_vocab_size`` and ``sample_from_anchor:
            false`` (the DFlash block this draft is trained on: [last token, mask x (B - 1)],
            each mask predicting the token at its own position, B - 1 tokens a forward);
            ``model.safetensors`` with DFlash's tensors plus ``markov_head.markov_w1`` (V x r),
            ``markov_head.markov_w2`` (r -> draft vocabulary) and ``confidence_head.proj``
            (weight and bias).

vLLM serves DSpark only in its V2 GPU model runner; its CPU build refuses the method
("dspark speculative decoding"), so there the export is checked by reading it back.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from ..base import ExportError
from ..dflash.export import SpeculatorsDFlash
from ..eagle.export import llama_config, target_dims
from .config import DSparkConfig
from .model import DSparkDraft

#: our confidence head's parameter names -> vLLM's
_CONF = {
    "confidence.weight": "confidence_head.proj.weight",
    "confidence.bias": "confidence_head.proj.bias",
}


class VLLMDSpark(SpeculatorsDFlash):
    name, methods, description = "dspark", ("dspark",), "DSpark for vLLM (Qwen3DSparkModel)"
    vllm_method = "dspark"
    serve_hint = (
        'vLLM (its V2 GPU model runner): `--speculative-config \'{"method": "dspark", '
        '"model": "<this dir>", "num_speculative_tokens": <block_size - 1>}\'`'
    )

    def tensors(self, draft: DSparkDraft, dtype: torch.dtype) -> dict[str, torch.Tensor]:
        out = super().tensors(draft, dtype)
        for ours, theirs in _CONF.items():
            if ours in out:
                out[theirs] = out.pop(ours)
        return out

    def config(self, draft: DSparkDraft, dtype: torch.dtype, **_: Any) -> dict[str, Any]:
        c, target = draft.cfg, draft.target
        layer = llama_config(target, dtype)
        layer.update(
            architectures=["Qwen3DSparkModel"],
            model_type="qwen3",
            num_hidden_layers=c.num_layers,
            layer_types=["full_attention"] * c.num_layers,
            use_sliding_window=False,
            sliding_window=None,
        )
        for k in ("mlp_bias", "bos_token_id", "eos_token_id", "pad_token_id"):
            layer.pop(k, None)
        return {
            **layer,
            "draft_vocab_size": c.draft_vocab_size,
            "target_hidden_size": target.hidden_size,
            "block_size": c.block_size,
            "eagle_aux_hidden_state_layer_ids": list(c.fuse_layers),
            "use_aux_hidden_state": True,
            "dflash_config": {
                "mask_token_id": c.mask_token_id,
                "target_layer_ids": [i - 1 for i in c.fuse_layers],
                "causal": False,
                "use_aux_hidden_state": True,
            },
            "sample_from_anchor": False,
            "dspark_bonus_anchor": False,
            "markov_rank": c.markov_rank,
            "markov_head_type": "vanilla",
            "enable_confidence_head": bool(c.confidence_head),
            "confidence_head_with_markov": bool(c.confidence_with_markov),
        }

    def vllm_tokens(self, config: dict, gamma: int) -> int:
        return int(config["block_size"]) - 1

    def expected(self, config: dict, target_config: Any) -> dict[str, tuple]:
        # DFlash's tensors, read off the flat config, and DSpark's heads
        dfl = {
            "transformer_layer_config": {
                "num_hidden_layers": config.get("num_hidden_layers", 0),
                "attention_bias": config.get("attention_bias"),
                "model_type": "qwen3",
            },
            "aux_hidden_state_layer_ids": config.get("eagle_aux_hidden_state_layer_ids"),
            "draft_vocab_size": config.get("draft_vocab_size"),
        }
        s = super().expected(dfl, target_config)
        d = target_dims(target_config)
        r, dv = int(config.get("markov_rank") or 0), config.get("draft_vocab_size")
        s["markov_head.markov_w1.weight"] = (d["V"], r)
        s["markov_head.markov_w2.weight"] = (dv, r)
        if config.get("enable_confidence_head"):
            width = d["H"] + (r if config.get("confidence_head_with_markov") else 0)
            s["confidence_head.proj.weight"] = (1, width)
            s["confidence_head.proj.bias"] = (1,)
        return s

    def check(self, path: Path, tensors: dict, config: dict, draft) -> None:
        f = path.parent / "config.json"
        flat = {**config, "mask_token_id": (config.get("dflash_config") or {}).get("mask_token_id")}
        super().check(path, tensors, flat, draft)
        if config.get("markov_head_type") != "vanilla":
            raise ExportError(f"{f}: markov_head_type={config.get('markov_head_type')!r}")
        if config.get("sample_from_anchor") is not False:
            raise ExportError(
                f"{f}: sample_from_anchor={config.get('sample_from_anchor')!r}: this draft's "
                "blocks are [last token, mask x (B - 1)] (false)"
            )

    def read(self, folder: Path, target, config: dict) -> DSparkDraft:
        f = folder / "config.json"
        if config.get("sample_from_anchor", True) is not False:
            raise ExportError(
                f"{f}: sample_from_anchor=true (each query predicts the next position) is a "
                "block layout this importer does not read; specdraft's DSpark blocks are "
                "[last token, mask x (B - 1)] (sample_from_anchor=false)"
            )
        if config.get("markov_head_type", "vanilla") != "vanilla":
            raise ExportError(f"{f}: markov_head_type={config.get('markov_head_type')!r}")
        dcfg = config.get("dflash_config") or {}
        try:
            cfg = DSparkConfig(
                num_layers=int(config["num_hidden_layers"]),
                block_size=int(config["block_size"]),
                fuse_layers=list(config["eagle_aux_hidden_state_layer_ids"]),
                mask_token_id=dcfg.get("mask_token_id", config.get("mask_token_id")),
                draft_vocab_size=int(config.get("draft_vocab_size") or target.config.vocab_size),
                markov_rank=int(config["markov_rank"]),
                confidence_head=bool(config.get("enable_confidence_head", False)),
                confidence_with_markov=bool(config.get("confidence_head_with_markov", False)),
            )
        except KeyError as e:
            raise ExportError(f"{f}: no {e.args[0]}") from None
        tensors = self.load(folder / self.weights_file, config)
        for ours, theirs in _CONF.items():
            if theirs in tensors:
                tensors[ours] = tensors.pop(theirs)
        return self._fill(DSparkDraft(target, cfg), tensors, folder, "DSpark")

    def detect(self, folder: Path, config: dict) -> bool:
        return "Qwen3DSparkModel" in (config.get("architectures") or [])

    def readme_lines(self, draft, config: dict) -> list[str]:
        c = draft.cfg
        return [
            *super().readme_lines(draft, config),
            f"- Markov head rank {c.markov_rank}; confidence head "
            f"{'on' if c.confidence_head else 'off'}"
            f"{' (reads the Markov embedding)' if c.confidence_head and c.confidence_with_markov else ''}",
            "- vLLM serves DSpark in its V2 GPU model runner only (its CPU build refuses it)",
        ]


FORMATS = (VLLMDSpark(),)
