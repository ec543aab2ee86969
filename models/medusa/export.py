"""Medusa's serving layouts, driven by the generic pipeline in ``models/export.py``.

``medusa``       Medusa heads as TGI, TensorRT-LLM and the Medusa reference load them:
                 ``medusa_lm_head.safetensors`` with ``{k}.{j}.linear.{weight,bias}`` (residual
                 block j of head k) and ``{k}.{num_layers}.weight`` (its LM head); config keys
                 ``medusa_num_heads``, ``medusa_num_layers``, ``base_model_name_or_path``, our
                 candidate tree as ``medusa_choices``, and ``medusa_fc_bias: true`` (vLLM
                 reads this layout too, and drops the blocks' biases without it). A Medusa-2
                 draft needs ``--merge``: the adapter-merged target is written to ``base/`` and
                 named as the base.
``medusa-vllm``  the same heads in vLLM's Medusa layout: ``blocks.{k}.layers.{j}`` and
                 ``lm_heads.{k}``, config ``model_type: medusa``, ``num_heads``,
                 ``num_hidden_layers``, ``medusa_fc_bias: true``.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import torch

from ..base import ExportError, ExportFormat
from ..export import cast, default_prompt, load_tensors, verifier_name
from .config import Medusa1Config
from .model import MedusaHeads


class MedusaFormat(ExportFormat):
    methods = ("medusa1", "medusa2")

    def names(self, k: int, j: int | None, num_layers: int) -> tuple[str, str | None]:
        """(weight name, bias name) of head k's residual block j, or of its LM head (j None)."""
        raise NotImplementedError

    def vllm_tokens(self, config: dict, gamma: int) -> int:
        return int(self.counts(config)[0])  # one token a head, in either layout

    def counts(self, config: dict) -> tuple[Any, Any]:
        raise NotImplementedError

    def tensors(self, draft: MedusaHeads, dtype: torch.dtype) -> dict[str, torch.Tensor]:
        L = draft.cfg.num_layers
        out = {}
        for k, head in enumerate(draft.heads):
            for j in range(L):
                w, b = self.names(k, j, L)
                out[w], out[b] = head[j].linear.weight, head[j].linear.bias
            out[self.names(k, None, L)[0]] = head[L].weight
        return cast(out, dtype)

    def expected(self, config: dict, target_config: Any) -> dict[str, tuple]:
        H, V = target_config.hidden_size, target_config.vocab_size
        K, L = self.counts(config)
        want = {}
        for k in range(K):
            for j in range(L):
                w, b = self.names(k, j, L)
                want[w], want[b] = (H, H), (H,)
            want[self.names(k, None, L)[0]] = (V, H)
        return want

    def read(self, folder: Path, target, config: dict) -> MedusaHeads:
        K, L = self.counts(config)
        if not isinstance(K, int) or not isinstance(L, int):
            raise ExportError(f"{folder / 'config.json'}: needs the number of heads and layers")
        tensors = load_tensors(folder / self.weights_file)
        want = self.expected(config, target.config)
        missing, unexpected = sorted(set(want) - set(tensors)), sorted(set(tensors) - set(want))
        if missing or unexpected:
            raise ExportError(
                f"{folder / self.weights_file}: missing keys {missing[:5]}, unexpected keys "
                f"{unexpected[:5]} for {K} heads of {L} layers on {target.identity}"
            )
        for k, shape in want.items():  # copy_ would broadcast or raise a bare RuntimeError
            if tuple(tensors[k].shape) != tuple(shape):
                raise ExportError(
                    f"{folder / self.weights_file}: {k} has shape {tuple(tensors[k].shape)}, "
                    f"target {target.identity} implies {tuple(shape)}: the draft was made for "
                    "another target"
                )
        heads = MedusaHeads(target, Medusa1Config(num_heads=K, num_layers=L))
        with torch.no_grad():
            for k, head in enumerate(heads.heads):
                for j in range(L):
                    w, b = self.names(k, j, L)
                    head[j].linear.weight.copy_(tensors[w])
                    head[j].linear.bias.copy_(tensors[b])
                head[L].weight.copy_(tensors[self.names(k, None, L)[0]])
        if config.get("medusa_choices"):
            heads.tree = [tuple(p) for p in config["medusa_choices"]]
        return heads

    def extra(self, draft, tmp: Path, dtype, merge: bool = False, out=None, **_: Any):
        """Medusa-2: the adapted target, merged, in ``base/`` (the heads' base model)."""
        adapted = draft.changes_target() is not None
        if adapted and not merge:
            raise ExportError(
                "this Medusa-2 draft trained a LoRA adapter on the backbone, so the heads need "
                "the adapted model as their base: pass --merge to write it beside them"
            )
        if merge and not adapted:
            raise ExportError("--merge: this draft has no adapter (Medusa-1 keeps the target)")
        if not merge:
            return None
        merged = _write_merged(draft, tmp / "base", dtype)
        _check_merged(draft, merged, tmp / "base", default_prompt(draft.target), dtype)
        return "merged base model gives the adapted logits"

    @staticmethod
    def base_name(draft, merge: bool = False, out: Path | None = None) -> str:
        """The heads' base model: the target, or (``--merge``) the merged copy in out/base."""
        return str((Path(out) / "base").resolve()) if merge else verifier_name(draft.target)

    def readme_lines(self, draft, config: dict) -> list[str]:
        return [
            f"- {draft.cfg.num_heads} heads of {draft.cfg.num_layers} residual block(s), for "
            f"`{config['base_model_name_or_path']}`",
            f"- candidate tree ({len(draft.candidate_tree())} nodes) in `medusa_choices` "
            "(rank paths)",
        ]


class MedusaReference(MedusaFormat):
    name = "medusa"
    weights_file = "medusa_lm_head.safetensors"
    description = "Medusa heads (TGI, TensorRT-LLM, Medusa reference)"
    serve_hint = "TGI / TensorRT-LLM / Medusa reference: point them at this dir."
    vllm_method = "medusa"  # vLLM maps this layout's keys onto its own

    def names(self, k, j, num_layers):
        if j is None:
            return f"{k}.{num_layers}.weight", None
        return f"{k}.{j}.linear.weight", f"{k}.{j}.linear.bias"

    def counts(self, config):
        return config.get("medusa_num_heads"), config.get("medusa_num_layers")

    def config(self, draft, dtype, merge: bool = False, out=None, **_: Any) -> dict:
        tc = draft.target.config
        return {
            "medusa_num_heads": draft.cfg.num_heads,
            "medusa_num_layers": draft.cfg.num_layers,
            "base_model_name_or_path": self.base_name(draft, merge, out),
            "hidden_size": tc.hidden_size,
            "vocab_size": tc.vocab_size,
            "medusa_choices": [list(p) for p in draft.candidate_tree()],  # rank paths
            # the blocks have a bias: vLLM reads this layout too, and without the key builds
            # bias-free blocks and drops the file's biases without a word (the reference's
            # and TGI's blocks always have one and ignore the key)
            "medusa_fc_bias": True,
            "torch_dtype": str(dtype).removeprefix("torch."),
        }

    def detect(self, folder: Path, config: dict) -> bool:
        return "medusa_num_heads" in config

    def vllm_mismatch(self, folder: Path, config: dict) -> str | None:
        # the Medusa reference's own configs have no medusa_fc_bias: vLLM then builds
        # bias-free blocks and drops the file's biases without a word
        if config.get("medusa_fc_bias"):
            return None
        from safetensors import safe_open

        f = folder / self.weights_file
        with safe_open(str(f), "pt") as st:
            if not any(k.endswith(".linear.bias") for k in st.keys()):
                return None
        return (
            f'{folder / "config.json"}: no "medusa_fc_bias": true, while {f.name} holds the '
            "blocks' biases: vLLM would build bias-free blocks and drop them without a word; "
            "add the key (or export again: specdraft-export writes it)"
        )


class MedusaVLLM(MedusaFormat):
    name = "medusa-vllm"
    weights_file = "model.safetensors"
    description = "Medusa heads for vLLM"
    vllm_method = "medusa"

    def names(self, k, j, num_layers):
        if j is None:
            return f"lm_heads.{k}.weight", None
        return f"blocks.{k}.layers.{j}.weight", f"blocks.{k}.layers.{j}.bias"

    def counts(self, config):
        return config.get("num_heads"), config.get("num_hidden_layers")

    def config(self, draft, dtype, merge: bool = False, out=None, **_: Any) -> dict:
        tc = draft.target.config
        tree = [list(p) for p in draft.candidate_tree()]
        return {
            "architectures": ["MedusaModel"],
            "model_type": "medusa",
            "hidden_size": tc.hidden_size,
            "vocab_size": tc.vocab_size,
            "truncated_vocab_size": tc.vocab_size,
            "num_heads": draft.cfg.num_heads,
            "num_hidden_layers": draft.cfg.num_layers,
            "medusa_fc_bias": True,  # our residual blocks have a bias (vLLM's default is none)
            "max_paths": len(tree),
            "topk": draft.cfg.top_k,
            "medusa_choices": tree,
            "base_model_name_or_path": self.base_name(draft, merge, out),
            "torch_dtype": str(dtype).removeprefix("torch."),
        }

    def detect(self, folder: Path, config: dict) -> bool:
        return config.get("model_type") == "medusa"


def _write_merged(heads, folder: Path, dt: torch.dtype) -> torch.nn.Module:
    """The adapted target as a standalone HF model folder, in ``dt``. A copy is merged (the
    in-memory target keeps its adapter); returns that merged copy, in full precision."""
    merged = copy.deepcopy(heads.backbone).merge_and_unload().eval()
    copy.deepcopy(merged).to(dt).save_pretrained(str(folder))
    if heads.target.tokenizer is not None:
        heads.target.tokenizer.save_pretrained(str(folder))
    return merged


def _check_merged(
    heads, merged: torch.nn.Module, folder: Path, prompt: list[int], dt: torch.dtype
) -> None:
    """The merged copy computes what the adapted target computes, and the written folder
    holds exactly its weights at the export's precision."""
    from transformers import AutoModelForCausalLM

    target = heads.target
    ids = torch.tensor([prompt], device=target.device)
    with torch.no_grad():
        a = target.model(input_ids=ids).logits.float()
        b = merged(input_ids=ids).logits.float()
    if not torch.allclose(a, b, atol=1e-3 * max(1.0, float(a.abs().max()))):
        raise ExportError("merging the adapter changed the model's logits")
    loaded = AutoModelForCausalLM.from_pretrained(str(folder), dtype=dt).state_dict()
    for k, v in merged.state_dict().items():
        if k not in loaded:
            if k.endswith("lm_head.weight"):  # tied to the embedding
                continue
            raise ExportError(f"{folder}: {k} is missing from the merged model")
        if not torch.equal(loaded[k].cpu(), v.detach().to(dt).cpu()):
            raise ExportError(f"{folder}: {k} differs from the merged weights")


FORMATS = (MedusaReference(), MedusaVLLM())
