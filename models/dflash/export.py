"""DFlash's serving layout, driven by the generic pipeline in ``models/export.py``.

``dflash``  vLLM speculators' DFlash layout (``speculators_model_type: dflash``, read by
            speculators' ``DFlashSpeculator`` and by vLLM, which serves it with parallel
            drafting): ``model.safetensors`` with ``fc`` (N*H -> H), ``hidden_norm``,
            ``layers.{i}.*`` (the target's decoder layer), ``norm``, the target's
            ``embed_tokens`` and its LM head's rows for the draft vocabulary as ``lm_head``
            (both frozen copies, so the folder is self-contained), ``d2t``/``t2d`` when the
            draft vocabulary is reduced; ``config.json`` with ``block_size``,
            ``mask_token_id``, ``aux_hidden_state_layer_ids`` (transformers ``hidden_states``
            indices: z-lab's ``target_layer_ids`` + 1, as speculators counts them),
            ``draft_vocab_size``, ``transformer_layer_config`` and ``speculators_config``
            (greedy proposals of block_size - 1 tokens, the verifier).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from ..base import ExportError, ExportFormat, fit_export_weights
from ..eagle.export import check_vocab_chosen, llama_config, target_dims
from ..export import cast, verifier_name
from .config import DFlashConfig
from .model import DFlashDraft


class SpeculatorsDFlash(ExportFormat):
    name, methods, description = "dflash", ("dflash",), "DFlash, vLLM speculators"
    weights_file = "model.safetensors"
    vllm_method = "dflash"

    def vllm_tokens(self, config: dict, gamma: int) -> int:
        return int(config["block_size"]) - 1  # one block a draft forward

    def tensors(self, draft: DFlashDraft, dtype: torch.dtype) -> dict[str, torch.Tensor]:
        if draft.cfg.correction != "none":
            raise ExportError(
                f"--format {self.name}: this draft has Domino's GRU logit correction "
                f"(method.correction={draft.cfg.correction}), which the layout has no place "
                "for (vLLM serves no Domino draft); use the saved draft in the built-in decoder"
            )
        out = {k: v for k, v in draft.state_dict().items() if k not in ("d2t", "t2d")}
        out["embed_tokens.weight"] = draft.target.embed_tokens.weight
        out["lm_head.weight"] = draft.lm_rows()
        out = cast(out, dtype)
        if self._reduced(draft.cfg.draft_vocab_size, draft.target.config.vocab_size):
            out["d2t"] = draft.d2t.to(torch.int64).cpu()
            out["t2d"] = draft.t2d.to(torch.bool).cpu()
        return out

    @staticmethod
    def _reduced(dv: int, V: int) -> bool:
        return dv != V

    def config(self, draft: DFlashDraft, dtype: torch.dtype, **_: Any) -> dict[str, Any]:
        c, target = draft.cfg, draft.target
        layer = {
            k: v
            for k, v in llama_config(target, dtype).items()
            if k not in ("architectures", "torch_dtype")
        }
        layer["num_hidden_layers"] = c.num_layers
        if c.layer_arch == "qwen3":  # Qwen3 layers with the target's sizes (per-head norms)
            layer["model_type"] = "qwen3"
        return {
            "architectures": ["DFlashSpeculator"],
            "speculators_model_type": "dflash",
            "speculators_version": "0.1.0",
            "speculators_config": {
                "algorithm": "dflash",
                "proposal_methods": [
                    {
                        "proposal_type": "greedy",
                        "speculative_tokens": c.block_size - 1,
                        "verifier_accept_k": 1,
                        "accept_tolerance": 0.0,
                    }
                ],
                "default_proposal_method": "greedy",
                "verifier": {
                    "name_or_path": verifier_name(target),
                    "architectures": list(getattr(target.config, "architectures", None) or []),
                },
            },
            "transformer_layer_config": layer,
            "draft_vocab_size": c.draft_vocab_size,
            "block_size": c.block_size,
            "target_hidden_size": None,
            "aux_hidden_state_layer_ids": list(c.fuse_layers),
            "mask_token_id": c.mask_token_id,
            # the blocks are bidirectional (every slot reads its block); vLLM turns False into
            # causal draft layers (``dflash_config.causal``), slot k reading slots <= k only
            "sliding_window_non_causal": True,
            "sample_from_anchor": False,
            "torch_dtype": str(dtype).removeprefix("torch."),
        }

    def expected(self, config: dict, target_config: Any) -> dict[str, tuple]:
        d = target_dims(target_config)
        H, hd, V, I_ = d["H"], d["head_dim"], d["V"], d["I"]
        layer = config.get("transformer_layer_config", {})
        n_layers = int(layer.get("num_hidden_layers", 0))
        n_aux = len(config.get("aux_hidden_state_layer_ids") or [])
        dv = config.get("draft_vocab_size")
        s: dict[str, tuple] = {
            "fc.weight": (H, n_aux * H),
            "hidden_norm.weight": (H,),
            "norm.weight": (H,),
            "embed_tokens.weight": (V, H),
            "lm_head.weight": (dv, H),
        }
        for i in range(n_layers):
            p = f"layers.{i}."
            s.update(
                {
                    p + "self_attn.q_proj.weight": (d["heads"] * hd, H),
                    p + "self_attn.k_proj.weight": (d["kv"] * hd, H),
                    p + "self_attn.v_proj.weight": (d["kv"] * hd, H),
                    p + "self_attn.o_proj.weight": (H, d["heads"] * hd),
                    p + "mlp.gate_proj.weight": (I_, H),
                    p + "mlp.up_proj.weight": (I_, H),
                    p + "mlp.down_proj.weight": (H, I_),
                    p + "input_layernorm.weight": (H,),
                    p + "post_attention_layernorm.weight": (H,),
                }
            )
            if layer.get("attention_bias"):
                for n in ("q", "k", "v"):
                    s[p + f"self_attn.{n}_proj.bias"] = (s[p + f"self_attn.{n}_proj.weight"][0],)
            if layer.get("mlp_bias"):
                for n in ("gate", "up", "down"):
                    s[p + f"mlp.{n}_proj.bias"] = (s[p + f"mlp.{n}_proj.weight"][0],)
            if layer.get("model_type") == "qwen3":  # per-head norms
                s[p + "self_attn.q_norm.weight"] = (hd,)
                s[p + "self_attn.k_norm.weight"] = (hd,)
        if self._reduced(dv, V):
            s.update({"d2t": (dv,), "t2d": (V,)})
        return s

    def check(self, path: Path, tensors: dict, config: dict, draft) -> None:
        f = path.parent / "config.json"
        bs, mask = config.get("block_size"), config.get("mask_token_id")
        V = draft.target.config.vocab_size
        if not isinstance(bs, int) or bs < 2:
            raise ExportError(f"{f}: block_size={bs!r}, must be an int >= 2")
        if not isinstance(mask, int) or not 0 <= mask < V:
            raise ExportError(f"{f}: mask_token_id={mask!r}, must be a token id in 0..{V - 1}")
        if "d2t" in tensors:
            d2t, t2d = tensors["d2t"], tensors["t2d"]
            check_vocab_chosen(path, d2t, draft)
            ids = torch.arange(len(d2t)) + d2t
            if ids.min() < 0 or ids.max() >= V or not (ids[1:] > ids[:-1]).all():
                raise ExportError(f"{path}: d2t maps outside 0..{V - 1} or repeats an id")
            if int(t2d.sum()) != len(d2t) or not t2d[ids].all():
                raise ExportError(f"{path}: t2d does not mark exactly the tokens d2t maps to")

    def read(self, folder: Path, target, config: dict) -> DFlashDraft:
        tensors = self.load(folder / self.weights_file, config)
        layer = config.get("transformer_layer_config") or {}
        V = target.config.vocab_size
        mt = layer.get("model_type", "qwen3")
        if mt == "qwen3":
            arch = "qwen3"
        elif mt == getattr(target.config, "model_type", None):
            arch = "target"
        else:
            raise ExportError(
                f"{folder / 'config.json'}: transformer_layer_config.model_type={mt!r}: DFlash "
                f"layers are qwen3 or the target's own ({target.config.model_type})"
            )
        cfg = DFlashConfig(
            num_layers=int(layer.get("num_hidden_layers", 1)),
            layer_arch=arch,
            block_size=int(config["block_size"]),
            fuse_layers=list(config["aux_hidden_state_layer_ids"]),
            mask_token_id=config.get("mask_token_id"),
            draft_vocab_size=int(config.get("draft_vocab_size") or V),
        )
        return self._fill(DFlashDraft(target, cfg), tensors, folder, "DFlash")

    def _fill(self, draft: DFlashDraft, tensors: dict, folder: Path, what: str) -> DFlashDraft:
        """``draft`` with the folder's ``tensors`` loaded (the target's embedding dropped, its
        LM head rows checked to be the target's own)."""
        target, cfg = draft.target, draft.cfg
        V = target.config.vocab_size
        draft.vocab_chosen = True  # the mapping a checkpoint holds is the one it was trained with
        tensors.pop("embed_tokens.weight", None)  # ours is the target's
        lm = tensors.pop("lm_head.weight", None)
        if "d2t" not in tensors:  # the whole vocabulary
            tensors["d2t"] = torch.zeros(cfg.draft_vocab_size, dtype=torch.long)
            tensors["t2d"] = torch.ones(V, dtype=torch.bool)
        fit_export_weights(draft, tensors, folder / self.weights_file, f"a {what} draft")
        if lm is not None:  # this draft scores with the target's rows: a trained head cannot load
            mine = draft.lm_rows().float().cpu()
            if lm.shape != mine.shape or (lm.float() - mine).abs().max() > 1e-2 * (
                1 + mine.abs().max()
            ):
                raise ExportError(
                    f"{folder / self.weights_file}: lm_head.weight is not the target's LM head "
                    "rows for the draft vocabulary; this importer scores with the target's own"
                )
        return draft

    def detect(self, folder: Path, config: dict) -> bool:
        return config.get("speculators_model_type") == "dflash"

    def readme_lines(self, draft, config: dict) -> list[str]:
        c = draft.cfg
        return [
            f"- block size {c.block_size} ({c.block_size - 1} tokens per draft forward), "
            f"{c.num_layers} draft layers, mask token id {c.mask_token_id}",
            f"- fused target layers (transformers hidden_states index): {c.fuse_layers}; "
            f"draft vocabulary {c.draft_vocab_size} of {draft.target.config.vocab_size}",
        ]


FORMATS = (SpeculatorsDFlash(),)
