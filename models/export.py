"""Exports that serving engines load, and the checks every export passes on the way out.

    specdraft-export runs/eagle3-x --format sglang            # -> runs/eagle3-x/export-sglang
    specdraft-export runs/eagle3-x --format vllm --out /models/my-eagle3 --dtype bfloat16
    specdraft-export runs/eagle1-x --format eagle1

Formats (what each engine's loader reads; the README has a table):

``sglang``       EAGLE-3 as SGLang's ``LlamaForCausalLMEagle3`` reads it: ``model.safetensors``
                 with ``fc``, ``midlayer.*``, ``norm``, ``lm_head`` (draft vocabulary), ``d2t``,
                 ``t2d`` and no ``embed_tokens`` (the target's is shared); ``config.json`` with
                 ``draft_vocab_size`` and ``eagle_config.eagle_aux_hidden_state_layer_ids``.
                 SGLang counts layer id k as the *output* of decoder layer k, i.e. one less
                 than our (transformers ``hidden_states``) index.
``vllm``         the same weights for vLLM's ``LlamaForCausalLMEagle3``; the fused layers go in a
                 top-level ``eagle_aux_hidden_state_layer_ids``, counted as vLLM does (id k =
                 the *input* of decoder layer k, our index unchanged), and
                 ``norm_before_residual: false`` is written out (vLLM's defaults differ by path).
``speculators``  EAGLE-3 in vLLM's ``speculators`` format: ``speculators_config`` (algorithm,
                 greedy proposal, verifier), ``transformer_layer_config``, weights
                 ``layers.0.*`` instead of ``midlayer.*``.
``eagle1``       the EAGLE-1 reference layout (SafeAILab/EAGLE; vLLM's and SGLang's EAGLE-1
                 loaders): ``pytorch_model.bin`` with ``embed_tokens``, ``fc`` (with bias),
                 ``layers.0.*`` without an input norm; a one-layer ``config.json`` of the
                 target's architecture with ``"bias": true``.
``medusa``       Medusa heads as TGI, TensorRT-LLM and the Medusa reference load them:
                 ``medusa_lm_head.safetensors`` with ``{k}.{j}.linear.{weight,bias}`` (residual
                 block j of head k) and ``{k}.{num_layers}.weight`` (its LM head); config keys
                 ``medusa_num_heads``, ``medusa_num_layers``, ``base_model_name_or_path``, and
                 our candidate tree as ``medusa_choices``. A Medusa-2 draft needs ``--merge``:
                 the adapter-merged target is written to ``base/`` and named as the base.
``medusa-vllm``  the same heads in vLLM's Medusa layout: ``blocks.{k}.layers.{j}`` and
                 ``lm_heads.{k}``, config ``model_type: medusa``, ``num_heads``,
                 ``num_hidden_layers``, ``medusa_fc_bias: true``.

Every export is written to a temporary folder and checked before it is moved into place:
expected keys present and no others, every shape derived from the *target's* config (not
from the head), ``d2t``/``t2d`` consistent and not the all-zero mapping of an untrained head,
then the folder is read back by ``import_draft`` (the same reader ``specdraft-eval`` uses on
exported or third-party checkpoints) and the re-imported head must propose the same tokens as
the in-memory head on a prompt. Any failure is an ``ExportError``; nothing lands at ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from .base import DecodeState, DraftError, read_draft_config
from .eagle import Eagle1Config, Eagle3Config, Eagle3Head, EagleHead
from .sampling import Sampling
from .target import Target

SMOLLM2_HUB_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"  # what the embedded target is a copy of
# Per-layer parameter names of the Llama decoder layer that every format stores. A target whose
# decoder layer names its parameters otherwise cannot be exported to these layouts.
LAYER_KEYS = (
    "self_attn.q_proj",
    "self_attn.k_proj",
    "self_attn.v_proj",
    "self_attn.o_proj",
    "mlp.gate_proj",
    "mlp.up_proj",
    "mlp.down_proj",
)


class ExportError(RuntimeError):
    """An export that failed a check; the message names the file, key and problem."""


# ---------------------------------------------------------------------------------------------
# What each format holds


@dataclass(frozen=True)
class Format:
    name: str
    method: str  # the specdraft method it exports
    weights_file: str
    layer_prefix: str  # where the decoder layer's parameters live
    description: str
    # The format carries the target's input embedding (``embed_tokens.weight``, frozen): its
    # own loader reads it from the checkpoint rather than from the verifier.
    embeds: bool = False


FORMATS = {
    "sglang": Format("sglang", "eagle3", "model.safetensors", "midlayer.", "EAGLE-3 for SGLang"),
    "vllm": Format("vllm", "eagle3", "model.safetensors", "midlayer.", "EAGLE-3 for vLLM"),
    # speculators' Eagle3DraftModel.from_pretrained leaves embed_tokens zero when a checkpoint
    # lacks it (its own trainer always writes it); vLLM reads it when present.
    "speculators": Format(
        "speculators",
        "eagle3",
        "model.safetensors",
        "layers.0.",
        "EAGLE-3, vLLM speculators",
        embeds=True,
    ),
    "eagle1": Format(
        "eagle1", "eagle1", "pytorch_model.bin", "layers.0.", "EAGLE-1 reference layout", True
    ),
    "medusa": Format(
        "medusa",
        "medusa",
        "medusa_lm_head.safetensors",
        "",
        "Medusa heads (TGI, TensorRT-LLM, Medusa reference)",
    ),
    "medusa-vllm": Format(
        "medusa-vllm", "medusa", "model.safetensors", "", "Medusa heads for vLLM"
    ),
}


def _target_dims(tc: Any) -> dict[str, int]:
    H = tc.hidden_size
    heads = tc.num_attention_heads
    return {
        "H": H,
        "head_dim": getattr(tc, "head_dim", None) or H // heads,
        "heads": heads,
        "kv": getattr(tc, "num_key_value_heads", None) or heads,
        "I": tc.intermediate_size,
        "V": tc.vocab_size,
    }


def expected_shapes(
    fmt: Format,
    target_config: Any,
    draft_vocab_size: int | None,
    attn_bias: bool,
    mlp_bias: bool,
    input_norm: bool = False,
) -> dict[str, tuple[int, ...]]:
    """Every tensor a format holds and its shape, derived from the target's config.
    ``input_norm``: an EAGLE-3 head with speculators' norm over the fused 3H features."""
    d = _target_dims(target_config)
    H, hd, V = d["H"], d["head_dim"], d["V"]
    attn_in = 2 * H if fmt.method == "eagle3" else H  # EAGLE-3 attends over [emb; hidden]
    p = fmt.layer_prefix
    s: dict[str, tuple[int, ...]] = {
        f"{p}self_attn.q_proj.weight": (d["heads"] * hd, attn_in),
        f"{p}self_attn.k_proj.weight": (d["kv"] * hd, attn_in),
        f"{p}self_attn.v_proj.weight": (d["kv"] * hd, attn_in),
        f"{p}self_attn.o_proj.weight": (H, d["heads"] * hd),
        f"{p}mlp.gate_proj.weight": (d["I"], H),
        f"{p}mlp.up_proj.weight": (d["I"], H),
        f"{p}mlp.down_proj.weight": (H, d["I"]),
        f"{p}post_attention_layernorm.weight": (H,),
    }
    if attn_bias:
        for n in ("q", "k", "v"):
            s[f"{p}self_attn.{n}_proj.bias"] = (s[f"{p}self_attn.{n}_proj.weight"][0],)
    if mlp_bias:
        for n in ("gate", "up", "down"):
            s[f"{p}mlp.{n}_proj.bias"] = (s[f"{p}mlp.{n}_proj.weight"][0],)
    if fmt.method == "eagle3":
        dv = draft_vocab_size
        s.update(
            {
                f"{p}input_layernorm.weight": (H,),
                f"{p}hidden_norm.weight": (H,),
                "fc.weight": (H, 3 * H),
                "norm.weight": (H,),
                "lm_head.weight": (dv, H),
                "d2t": (dv,),
                "t2d": (V,),
            }
        )
        if input_norm:
            s["input_norm.weight"] = (3 * H,)
    else:
        s.update({"fc.weight": (H, 2 * H), "fc.bias": (H,)})
    if fmt.embeds:
        s["embed_tokens.weight"] = (V, H)
    return s


def _llama_config(target: Target, dtype: torch.dtype) -> dict[str, Any]:
    """A one-layer Llama config with the target's dimensions (what the engines' EAGLE loaders
    build their draft layer from). Rope settings are written in both the old (``rope_theta``,
    ``rope_scaling``) and the new (``rope_parameters``) spelling, for old and new loaders."""
    tc = target.config
    d = _target_dims(tc)
    rope = dict(getattr(tc, "rope_parameters", None) or {})
    theta = rope.get("rope_theta", getattr(tc, "rope_theta", 10000.0))
    scaling = {k: v for k, v in rope.items() if k != "rope_theta"} or None
    if scaling and scaling.get("rope_type", "default") == "default":
        scaling = None
    cfg = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": d["H"],
        "intermediate_size": d["I"],
        "num_attention_heads": d["heads"],
        "num_key_value_heads": d["kv"],
        "head_dim": d["head_dim"],
        "num_hidden_layers": 1,
        "hidden_act": getattr(tc, "hidden_act", "silu"),
        "max_position_embeddings": getattr(tc, "max_position_embeddings", 4096),
        "rms_norm_eps": getattr(tc, "rms_norm_eps", 1e-6),
        "rope_theta": theta,
        "rope_scaling": scaling,
        "rope_parameters": {"rope_theta": theta, **(scaling or {"rope_type": "default"})},
        "attention_bias": bool(getattr(tc, "attention_bias", False)),
        "mlp_bias": bool(getattr(tc, "mlp_bias", False)),
        "vocab_size": d["V"],
        "tie_word_embeddings": False,
        "bos_token_id": getattr(tc, "bos_token_id", None),
        "eos_token_id": getattr(tc, "eos_token_id", None),
        "pad_token_id": getattr(tc, "pad_token_id", None),
        "torch_dtype": str(dtype).removeprefix("torch."),
        "use_cache": True,
    }
    return cfg


def verifier_name(target: Target) -> str:
    """What a serving engine should load as the target."""
    if target.cfg.path:
        return target.cfg.path
    if target.cfg.name == "smollm2_135m":
        return SMOLLM2_HUB_ID
    return target.identity


def _layer_state(head: EagleHead) -> tuple[dict[str, torch.Tensor], bool, bool]:
    """The head's decoder layer parameters, keyed relative to the layer, and whether it has
    attention / MLP biases. Refuses layers with parameters the Llama layout has no place for."""
    layer = head.midlayer if isinstance(head, Eagle3Head) else head.layer
    state = {k: v for k, v in layer.state_dict().items()}
    allowed = {f"{k}.{w}" for k in LAYER_KEYS for w in ("weight", "bias")}
    allowed |= {"input_layernorm.weight", "post_attention_layernorm.weight", "hidden_norm.weight"}
    odd = sorted(k for k in state if k not in allowed)
    if odd:
        raise ExportError(
            f"the draft's decoder layer ({type(layer).__name__}) has parameters the Llama "
            f"EAGLE layout has no place for: {odd[:5]}"
        )
    attn_bias = "self_attn.q_proj.bias" in state
    mlp_bias = "mlp.gate_proj.bias" in state
    return state, attn_bias, mlp_bias


# ---------------------------------------------------------------------------------------------
# Writing


def export_tensors(head: EagleHead, fmt: Format, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The tensors of ``head`` under ``fmt``'s names (floating tensors cast to ``dtype``)."""
    layer, _, _ = _layer_state(head)
    out: dict[str, torch.Tensor] = {}
    if fmt.method == "eagle3":
        if not isinstance(head, Eagle3Head):
            raise ExportError(
                f"--format {fmt.name} exports EAGLE-3 drafts; this is {head.cfg.name}"
            )
        fuse = head.cfg.fuse_layers
        if len(set(fuse)) != 3 or min(fuse) < 1:
            raise ExportError(
                f"fused layers {fuse}: serving engines need three distinct layers >= 1 "
                "(they capture each once, from the first decoder layer's output on)"
            )
        c = head.cfg
        if (c.norm_before_fc or c.norm_output) and fmt.name != "speculators":
            raise ExportError(
                f"--format {fmt.name}: this head uses speculators' layout variants "
                f"(norm_before_fc={c.norm_before_fc}, norm_output={c.norm_output}), which "
                f"{fmt.description} cannot express; export it with --format speculators"
            )
        for k, v in layer.items():
            out[fmt.layer_prefix + k] = v
        if c.norm_before_fc:
            out["input_norm.weight"] = head.input_norm.weight
        out["fc.weight"] = head.fc.weight
        out["norm.weight"] = head.norm.weight
        out["lm_head.weight"] = head.lm_head.weight
        out["d2t"] = head.d2t.to(torch.int64)
        out["t2d"] = head.t2d.to(torch.bool)
    else:
        if isinstance(head, Eagle3Head) or not isinstance(head, EagleHead):
            raise ExportError(
                f"--format {fmt.name} exports EAGLE-1 drafts; this is {head.cfg.name}"
            )
        if head.cfg.input_norm:
            raise ExportError(
                "this EAGLE-1 head keeps an input norm on its decoder layer (method.input_norm="
                "true), which the reference layout has no place for; retrain with the default"
            )
        for k, v in layer.items():
            out[fmt.layer_prefix + k] = v
        out["fc.weight"] = head.fc.weight
        out["fc.bias"] = head.fc.bias
    if fmt.embeds:
        out["embed_tokens.weight"] = head.target.embed_tokens.weight
    return {
        k: (v.detach().to(dtype) if v.is_floating_point() else v.detach()).contiguous().cpu()
        for k, v in out.items()
    }


def export_config(head: EagleHead, fmt: Format, dtype: torch.dtype, gamma: int = 3) -> dict:
    target = head.target
    base = _llama_config(target, dtype)
    _, attn_bias, mlp_bias = _layer_state(head)
    base["attention_bias"], base["mlp_bias"] = attn_bias, mlp_bias
    if fmt.name == "eagle1":
        base["bias"] = True  # the reference reads this for FC's bias
        return base
    fuse = list(head.cfg.fuse_layers)
    dv = head.cfg.draft_vocab_size
    if fmt.name == "sglang":
        return {
            **base,
            "architectures": ["LlamaForCausalLMEagle3"],
            "draft_vocab_size": dv,
            "eagle_config": {
                "eagle_aux_hidden_state_layer_ids": [i - 1 for i in fuse],
                "use_aux_hidden_state": True,
            },
        }
    if fmt.name == "vllm":
        return {
            **base,
            "architectures": ["LlamaForCausalLMEagle3"],
            "draft_vocab_size": dv,
            "eagle_aux_hidden_state_layer_ids": fuse,
            "norm_before_residual": head.cfg.norm_before_residual,
        }
    layer_cfg = {k: v for k, v in base.items() if k not in ("architectures", "torch_dtype")}
    return {
        "architectures": ["Eagle3Speculator"],
        "speculators_model_type": "eagle3",
        "speculators_version": "0.1.0",
        "speculators_config": {
            "algorithm": "eagle3",
            "proposal_methods": [
                {
                    "proposal_type": "greedy",
                    "speculative_tokens": gamma,
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
        "transformer_layer_config": layer_cfg,
        "draft_vocab_size": dv,
        # written out: speculators' own defaults for these differ between its config class and
        # its trainer, so a loader must not guess
        "norm_before_residual": head.cfg.norm_before_residual,
        "norm_before_fc": head.cfg.norm_before_fc,
        "norm_output": head.cfg.norm_output,
        "fc_norm": False,
        "embed_requires_grad": False,
        "target_hidden_size": None,
        "eagle_aux_hidden_state_layer_ids": fuse,
        "torch_dtype": str(dtype).removeprefix("torch."),
    }


def _write(folder: Path, fmt: Format, tensors: dict[str, torch.Tensor], config: dict) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    if fmt.weights_file.endswith(".safetensors"):
        save_file(tensors, str(folder / fmt.weights_file), metadata={"format": "pt"})
    else:
        torch.save(tensors, folder / fmt.weights_file)


# ---------------------------------------------------------------------------------------------
# Reading (re-import): exported folders and third-party checkpoints in these layouts


def detect_format(folder: Path) -> str | None:
    """The export format of ``folder`` from its config.json, or None if it is none of ours."""
    f = folder / "config.json"
    if not f.exists():
        return None
    try:
        cfg = json.loads(f.read_text())
    except json.JSONDecodeError:
        return None
    if not isinstance(cfg, dict):
        return None
    if cfg.get("speculators_model_type") == "eagle3":
        return "speculators"
    if "medusa_num_heads" in cfg:
        return "medusa"
    if cfg.get("model_type") == "medusa":
        return "medusa-vllm"
    archs = cfg.get("architectures") or []
    if any("Eagle3" in a for a in archs):
        if "eagle_aux_hidden_state_layer_ids" in cfg:
            return "vllm"
        return "sglang"
    # EAGLE-1 reference: a one-layer config beside weights holding FC over [emb; feature]
    weights = folder / FORMATS["eagle1"].weights_file
    if cfg.get("num_hidden_layers") == 1 and weights.exists():
        try:
            keys = torch.load(weights, map_location="cpu", mmap=True, weights_only=True)
        except Exception:
            return None
        if isinstance(keys, dict) and "fc.weight" in keys and "layers.0.mlp.up_proj.weight" in keys:
            return "eagle1"
    return None


def _load_tensors(path: Path) -> dict[str, torch.Tensor]:
    if not path.exists():
        raise ExportError(f"{path}: missing")
    try:
        if path.suffix == ".safetensors":
            return load_file(str(path))
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # damaged files raise many types
        raise ExportError(f"{path}: cannot read ({type(e).__name__}: {e})") from None


def import_draft(folder: str | Path, target: Target, fmt_name: str | None = None):
    """Read an exported (or third-party) EAGLE or Medusa checkpoint into our draft module, for
    ``target``."""
    folder = Path(folder)
    fmt_name = fmt_name or detect_format(folder)
    if fmt_name not in FORMATS:
        raise ExportError(f"{folder}: not a checkpoint in a known serving layout")
    fmt = FORMATS[fmt_name]
    try:
        cfg = json.loads((folder / "config.json").read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ExportError(f"{folder / 'config.json'}: unreadable ({e})") from None
    if fmt.method == "medusa":
        return import_medusa(folder, target, fmt, cfg)
    tensors = _load_tensors(folder / fmt.weights_file)
    if fmt.method == "eagle1":
        head = EagleHead(target, Eagle1Config(input_norm=False))
        prefix, dst = fmt.layer_prefix, "layer."
        tensors = {k: v for k, v in tensors.items() if k != "embed_tokens.weight"}
    else:
        if fmt_name == "sglang":
            ids = (cfg.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
            fuse = [i + 1 for i in ids] if ids else None  # SGLang counts layer outputs
        else:
            fuse = cfg.get("eagle_aux_hidden_state_layer_ids")
        L = target.num_layers
        fuse = fuse or [2, L // 2, L - 3]  # the engines' default
        if "d2t" not in tensors:
            raise ExportError(
                f"{folder / fmt.weights_file}: no d2t; without the draft-to-target mapping "
                "an EAGLE-3 draft proposes the wrong tokens"
            )
        dv = cfg.get("draft_vocab_size") or int(tensors["d2t"].numel())
        if cfg.get("fc_norm"):
            raise ExportError(
                f"{folder / 'config.json'}: fc_norm=true (a norm per fused layer) is a "
                "speculators layout this importer does not read"
            )
        flags = {
            k: bool(cfg.get(k, False))
            for k in ("norm_before_residual", "norm_before_fc", "norm_output")
        }
        head = Eagle3Head(target, Eagle3Config(fuse_layers=fuse, draft_vocab_size=dv, **flags))
        prefix, dst = fmt.layer_prefix, "midlayer."
        tensors.pop("embed_tokens.weight", None)  # ours is the target's
    renamed = {
        (dst + k[len(prefix) :] if k.startswith(prefix) else k): v for k, v in tensors.items()
    }
    own = head.state_dict()
    renamed = {k: v.to(own[k].dtype) if k in own else v for k, v in renamed.items()}
    missing, unexpected = head.load_state_dict(renamed, strict=False)
    if missing or unexpected:
        raise ExportError(
            f"{folder}: weights do not fit an {fmt.method} head for {target.identity} "
            f"(missing {missing[:5]}, unexpected {unexpected[:5]})"
        )
    return head.to(target.device).eval()


# ---------------------------------------------------------------------------------------------
# Checks


def check_tensors(
    folder: Path,
    fmt: Format,
    target: Target,
    draft_vocab_size: int | None,
    attn_bias: bool,
    mlp_bias: bool,
    input_norm: bool = False,
) -> dict[str, torch.Tensor]:
    path = folder / fmt.weights_file
    tensors = _load_tensors(path)
    want = expected_shapes(fmt, target.config, draft_vocab_size, attn_bias, mlp_bias, input_norm)
    missing = sorted(set(want) - set(tensors))
    unexpected = sorted(set(tensors) - set(want))
    if missing or unexpected:
        raise ExportError(f"{path}: missing keys {missing}, unexpected keys {unexpected}")
    for k, shape in want.items():
        if tuple(tensors[k].shape) != shape:
            raise ExportError(
                f"{path}: {k} has shape {tuple(tensors[k].shape)}, the target's config "
                f"({target.identity}) implies {shape}"
            )
    for k, v in tensors.items():
        if v.is_floating_point() and not torch.isfinite(v).all():
            raise ExportError(f"{path}: {k} holds non-finite values")
    if fmt.method == "eagle3":
        d2t, t2d = tensors["d2t"], tensors["t2d"]
        if d2t.dtype != torch.int64 or t2d.dtype != torch.bool:
            raise ExportError(
                f"{path}: d2t must be int64 and t2d bool (got {d2t.dtype}, {t2d.dtype})"
            )
        if not d2t.any():
            raise ExportError(
                f"{path}: d2t is all zeros, the mapping of a head whose draft vocabulary was "
                "never chosen; engines would load it and silently propose wrong tokens"
            )
        ids = torch.arange(len(d2t)) + d2t
        V = t2d.numel()
        if ids.min() < 0 or ids.max() >= V or not (ids[1:] > ids[:-1]).all():
            raise ExportError(f"{path}: d2t maps to target ids outside 0..{V - 1} or repeats one")
        if int(t2d.sum()) != len(d2t) or not t2d[ids].all():
            raise ExportError(f"{path}: t2d does not mark exactly the tokens d2t maps to")
    return tensors


def check_config(folder: Path, fmt: Format, head: EagleHead) -> None:
    f = folder / "config.json"
    cfg = json.loads(f.read_text())
    tc = head.target.config
    layer = cfg.get("transformer_layer_config", cfg)
    for key in ("hidden_size", "intermediate_size", "num_attention_heads", "vocab_size"):
        if layer.get(key) != getattr(tc, key):
            raise ExportError(f"{f}: {key}={layer.get(key)}, the target has {getattr(tc, key)}")
    if layer.get("num_hidden_layers") != 1:
        raise ExportError(f"{f}: num_hidden_layers={layer.get('num_hidden_layers')}, expected 1")
    if fmt.method == "eagle3" and cfg.get("draft_vocab_size") != head.cfg.draft_vocab_size:
        raise ExportError(f"{f}: draft_vocab_size={cfg.get('draft_vocab_size')}")
    if fmt.name == "speculators":
        v = cfg.get("speculators_config", {}).get("verifier", {}).get("name_or_path")
        if not v:
            raise ExportError(f"{f}: speculators_config.verifier.name_or_path is empty")


@torch.no_grad()
def proposals(head: EagleHead, prompt: list[int], gamma: int = 6) -> dict[str, list[int]]:
    """The head's draft logits at every prompt position, and its greedy chain and dynamic-tree
    proposals after ``prompt`` (what the decoder would verify), for comparing two heads."""
    target = head.target
    ids = torch.tensor([prompt[:-1]], device=target.device)
    feats = target.features(ids, torch.ones_like(ids), tuple(head.feature_layers))[0]
    out: dict[str, Any] = {}
    catch = head.proposer()
    state = DecodeState(list(prompt), feats, Sampling(), None, target.device)
    catch.reset()  # not start(): that feeds the prompt's pairs already
    h = catch._catch_up(state, upto=len(prompt) - 1)  # the head over every committed pair
    out["logits"] = head.vocab_logits(h[0])  # (T - 1, V); -inf outside a draft vocabulary
    for name, prop in (
        ("chain", head.proposer()),
        ("tree", head.proposer(tree="dynamic", depth=4, top_k=4, total_tokens=16)),
    ):
        state = DecodeState(list(prompt), feats, Sampling(), None, target.device)
        prop.start(state)
        p = prop.propose(state, gamma)
        out[name] = p.tokens
        out[name + "_parents"] = p.parents
    return out


def compare_heads(a: EagleHead, b: EagleHead, prompt: list[int]) -> dict[str, Any]:
    """Draft logits over ``prompt`` and chain and tree proposals after it, of two heads;
    ``ExportError`` if they differ."""
    pa, pb = proposals(a, prompt), proposals(b, prompt)
    la, lb = pa.pop("logits"), pb.pop("logits")
    fa, fb = torch.isfinite(la), torch.isfinite(lb)
    diff = float((la[fa] - lb[fa]).abs().max()) if torch.equal(fa, fb) else float("inf")
    if diff > 1e-4 * max(1.0, float(la[fa].abs().max())):
        raise ExportError(
            f"the re-imported export's draft logits differ from the trained head's by up to "
            f"{diff:.3g} on a prompt (the layout or the layer ids were written wrongly)"
        )
    if pa != pb:
        raise ExportError(
            f"the re-imported export proposes {pb['chain']} where the trained head proposes "
            f"{pa['chain']} (trees equal: {pa['tree'] == pb['tree']})"
        )
    return {"chain": pa["chain"], "tree_nodes": len(pa["tree"])}


def default_prompt(target: Target) -> list[int]:
    tok = target.tokenizer
    msgs = [{"role": "user", "content": "Explain in two sentences why the sky is blue."}]
    text = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    # a few tokens of a reply, so the head has committed reply context to draft from
    return tok(text + "The sky looks blue because", add_special_tokens=False)["input_ids"]


# ---------------------------------------------------------------------------------------------
# The whole export


def export(
    head,
    fmt_name: str,
    out: str | Path,
    dtype: str = "bfloat16",
    force: bool = False,
    gamma: int = 3,
    merge: bool = False,
    log=print,
) -> dict[str, Any]:
    """Write ``head`` in ``fmt_name`` to ``out``, checked and re-imported first (see module
    docstring). Returns a summary. ``out`` is replaced only with ``force``. ``merge``
    (Medusa-2): also write the target with the adapter merged in, under ``out/base``."""
    if fmt_name not in FORMATS:
        raise ExportError(f"--format {fmt_name}: choose one of {sorted(FORMATS)}")
    fmt = FORMATS[fmt_name]
    dt = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}.get(dtype)
    if dt is None:
        raise ExportError(f"--dtype {dtype}: use bfloat16, float16 or float32")
    out = Path(out)
    if out.exists() and not force:
        raise ExportError(f"{out}: already exists (pass --force to replace it)")
    head = head.eval()
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}-", dir=out.parent))
    try:
        if fmt.method == "medusa":
            summary = _build_medusa(head, fmt, dt, tmp, out, merge)
        else:
            if merge:
                raise ExportError("--merge is for Medusa-2 drafts (a LoRA-adapted backbone)")
            summary = _build_eagle(head, fmt, dt, gamma, tmp)
        _readable_by_others(tmp)
        if out.exists():
            shutil.rmtree(out)
        os.rename(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    size = sum(f.stat().st_size for f in out.rglob("*") if f.is_file())
    log(
        f"exported {fmt.description} to {out} ({size / 1e6:.1f} MB, {dtype}); checked: keys and "
        f"shapes against {head.target.identity}'s config; re-imported: {summary['checked']}"
    )
    return {"out": str(out), "format": fmt_name, "bytes": size, **summary}


def _readable_by_others(folder: Path) -> None:
    """Give the export the modes a plain ``mkdir``/``open`` would have (0777/0666 less the
    umask): ``mkdtemp`` and safetensors' temporary files are private (0700/0600), which a
    serving engine running as another user could not read."""
    umask = os.umask(0)
    os.umask(umask)
    for p in [folder, *folder.rglob("*")]:
        p.chmod((0o777 if p.is_dir() else 0o666) & ~umask)


def _build_eagle(head: EagleHead, fmt: Format, dt: torch.dtype, gamma: int, tmp: Path) -> dict:
    target = head.target
    tensors = export_tensors(head, fmt, dt)
    config = export_config(head, fmt, dt, gamma)
    _, attn_bias, mlp_bias = _layer_state(head)
    _write(tmp, fmt, tensors, config)
    dv = head.cfg.draft_vocab_size if fmt.method == "eagle3" else None
    check_tensors(
        tmp, fmt, target, dv, attn_bias, mlp_bias, getattr(head.cfg, "norm_before_fc", False)
    )
    check_config(tmp, fmt, head)
    back = import_draft(tmp, target, fmt.name)
    # the in-memory head at the export's precision: what an engine would run
    ref = type(head)(target, head.cfg)
    ref.load_state_dict(head.state_dict())
    ref, back = ref.to(target.device, dt).eval(), back.to(dt)
    same = compare_heads(ref, back, default_prompt(target))
    (tmp / "README.md").write_text(_readme(fmt, head, config, same))
    same["checked"] = (
        f"identical draft logits, chain proposal {same['chain']} and tree "
        f"({same['tree_nodes']} nodes)"
    )
    return same


def _readme(fmt: Format, head: EagleHead, config: dict, same: dict) -> str:
    t = head.target
    lines = [
        f"# {fmt.description} exported by specdraft",
        "",
        f"- draft method: {head.cfg.name}; target: {t.identity} (serve with `{verifier_name(t)}`)",
        f"- weights: `{fmt.weights_file}`; config: `config.json`",
    ]
    if fmt.method == "eagle3":
        lines.append(
            f"- fused target layers (transformers hidden_states index): {head.cfg.fuse_layers}; "
            f"draft vocabulary {head.cfg.draft_vocab_size} of {t.config.vocab_size}"
        )
    lines += [
        f"- re-imported and checked: identical greedy chain proposal {same['chain']} on a "
        "fixed prompt",
        "",
    ]
    if fmt.name == "sglang":
        lines.append(
            "SGLang: `--speculative-algorithm EAGLE3 --speculative-draft-model-path <this dir>`"
        )
    elif fmt.name in ("vllm", "speculators"):
        lines.append(
            'vLLM: `--speculative-config \'{"method": "eagle3", "model": "<this dir>", '
            '"num_speculative_tokens": 3}\'`'
        )
    else:
        lines.append("EAGLE reference / vLLM / SGLang EAGLE-1 loaders: point them at this dir.")
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------------------------------------
# Medusa


def _medusa_names(fmt: Format, k: int, j: int | None, num_layers: int) -> tuple[str, str | None]:
    """(weight name, bias name) of head k's residual block j, or of its LM head (j None)."""
    if fmt.name == "medusa":
        if j is None:
            return f"{k}.{num_layers}.weight", None
        return f"{k}.{j}.linear.weight", f"{k}.{j}.linear.bias"
    if j is None:
        return f"lm_heads.{k}.weight", None
    return f"blocks.{k}.layers.{j}.weight", f"blocks.{k}.layers.{j}.bias"


def medusa_tensors(heads, fmt: Format, dt: torch.dtype) -> dict[str, torch.Tensor]:
    L = heads.cfg.num_layers
    out = {}
    for k, head in enumerate(heads.heads):
        for j in range(L):
            w, b = _medusa_names(fmt, k, j, L)
            out[w], out[b] = head[j].linear.weight, head[j].linear.bias
        out[_medusa_names(fmt, k, None, L)[0]] = head[L].weight
    return {k: v.detach().to(dt).contiguous().cpu() for k, v in out.items()}


def medusa_config(heads, fmt: Format, dt: torch.dtype, base: str) -> dict[str, Any]:
    tc = heads.target.config
    K, L = heads.cfg.num_heads, heads.cfg.num_layers
    tree = [list(p) for p in heads.candidate_tree()]
    if fmt.name == "medusa":
        return {
            "medusa_num_heads": K,
            "medusa_num_layers": L,
            "base_model_name_or_path": base,
            "hidden_size": tc.hidden_size,
            "vocab_size": tc.vocab_size,
            "medusa_choices": tree,  # our static candidate tree, as rank paths
            "torch_dtype": str(dt).removeprefix("torch."),
        }
    return {
        "architectures": ["MedusaModel"],
        "model_type": "medusa",
        "hidden_size": tc.hidden_size,
        "vocab_size": tc.vocab_size,
        "truncated_vocab_size": tc.vocab_size,
        "num_heads": K,
        "num_hidden_layers": L,
        "medusa_fc_bias": True,  # our residual blocks have a bias (vLLM's default is none)
        "max_paths": len(tree),
        "topk": heads.cfg.top_k,
        "medusa_choices": tree,
        "base_model_name_or_path": base,
        "torch_dtype": str(dt).removeprefix("torch."),
    }


def medusa_expected(fmt: Format, target_config: Any, K: int, L: int) -> dict[str, tuple]:
    H, V = target_config.hidden_size, target_config.vocab_size
    want = {}
    for k in range(K):
        for j in range(L):
            w, b = _medusa_names(fmt, k, j, L)
            want[w], want[b] = (H, H), (H,)
        want[_medusa_names(fmt, k, None, L)[0]] = (V, H)
    return want


def import_medusa(folder: Path, target: Target, fmt: Format, cfg: dict):
    """Medusa heads from an exported (or third-party) Medusa checkpoint, for ``target``."""
    from .medusa import Medusa1Config, MedusaHeads

    K = cfg.get("medusa_num_heads", cfg.get("num_heads"))
    L = cfg.get("medusa_num_layers", cfg.get("num_hidden_layers"))
    if not isinstance(K, int) or not isinstance(L, int):
        raise ExportError(f"{folder / 'config.json'}: needs the number of heads and layers")
    tensors = _load_tensors(folder / fmt.weights_file)
    want = medusa_expected(fmt, target.config, K, L)
    missing, unexpected = sorted(set(want) - set(tensors)), sorted(set(tensors) - set(want))
    if missing or unexpected:
        raise ExportError(
            f"{folder / fmt.weights_file}: missing keys {missing[:5]}, unexpected keys "
            f"{unexpected[:5]} for {K} heads of {L} layers on {target.identity}"
        )
    heads = MedusaHeads(target, Medusa1Config(num_heads=K, num_layers=L))
    with torch.no_grad():
        for k, head in enumerate(heads.heads):
            for j in range(L):
                w, b = _medusa_names(fmt, k, j, L)
                head[j].linear.weight.copy_(tensors[w])
                head[j].linear.bias.copy_(tensors[b])
            head[L].weight.copy_(tensors[_medusa_names(fmt, k, None, L)[0]])
    if cfg.get("medusa_choices"):
        heads.tree = [tuple(p) for p in cfg["medusa_choices"]]
    return heads.to(target.device).eval()


def _build_medusa(heads, fmt: Format, dt: torch.dtype, tmp: Path, out: Path, merge: bool) -> dict:
    from .medusa import MedusaHeads

    if not isinstance(heads, MedusaHeads):
        raise ExportError(f"--format {fmt.name} exports Medusa drafts; this is {heads.cfg.name}")
    target = heads.target
    adapted = heads.changes_target() is not None
    if adapted and not merge:
        raise ExportError(
            "this Medusa-2 draft trained a LoRA adapter on the backbone, so the heads need the "
            "adapted model as their base: pass --merge to write it beside them"
        )
    if merge and not adapted:
        raise ExportError("--merge: this draft has no adapter (Medusa-1 keeps the target)")
    base = verifier_name(target)
    merged = None
    if merge:
        base = str((out / "base").resolve())
        merged = _write_merged(heads, tmp / "base", dt)
    config = medusa_config(heads, fmt, dt, base)
    (tmp / "config.json").write_text(json.dumps(config, indent=2))
    save_file(medusa_tensors(heads, fmt, dt), str(tmp / fmt.weights_file), {"format": "pt"})
    tensors = _load_tensors(tmp / fmt.weights_file)
    want = medusa_expected(fmt, target.config, heads.cfg.num_heads, heads.cfg.num_layers)
    missing, unexpected = sorted(set(want) - set(tensors)), sorted(set(tensors) - set(want))
    if missing or unexpected:
        raise ExportError(f"{tmp / fmt.weights_file}: missing {missing}, unexpected {unexpected}")
    for k, shape in want.items():
        if tuple(tensors[k].shape) != shape or not torch.isfinite(tensors[k].float()).all():
            raise ExportError(
                f"{tmp / fmt.weights_file}: {k} has shape {tuple(tensors[k].shape)} (the "
                f"target's config implies {shape}) or non-finite values"
            )
    back = import_medusa(tmp, target, fmt, config)
    prompt = default_prompt(target)
    ids = torch.tensor([prompt], device=target.device)
    with torch.no_grad():
        h = target.features(ids, torch.ones_like(ids), (-1,))[0, -1, 0]
        ref = MedusaHeads(target, heads.cfg)  # the trained heads at the export's precision
        ref.load_state_dict(
            {k: v for k, v in heads.state_dict().items() if k.startswith("heads.")}, strict=False
        )
        ref, back = ref.to(target.device, dt).eval(), back.to(dt)
        for k in range(heads.cfg.num_heads):
            a, b = ref.head_logits(k, h), back.head_logits(k, h)
            if not torch.allclose(a, b, atol=1e-4 * max(1.0, float(a.abs().max()))):
                raise ExportError(f"re-imported head {k + 1} differs from the trained one")
        tree = heads.candidate_tree()
        ref.tree = tree
        from .base import DecodeState

        st = DecodeState(prompt, h[None, None], Sampling(), None, target.device)
        pa, pb = ref.proposer().propose(st, 99), back.proposer().propose(st, 99)
        if (pa.tokens, pa.parents) != (pb.tokens, pb.parents):
            raise ExportError("the re-imported heads propose a different candidate tree")
    if merge:
        _check_merged(heads, merged, tmp / "base", prompt, dt)
    (tmp / "README.md").write_text(
        f"# {fmt.description} exported by specdraft\n\n- {heads.cfg.num_heads} heads of "
        f"{heads.cfg.num_layers} residual block(s), for `{base}`\n- candidate tree "
        f"({len(tree)} nodes) in `medusa_choices` (rank paths)\n"
        + ("- `base/`: the target with the Medusa-2 LoRA adapter merged in\n" if merge else "")
    )
    return {
        "chain": pa.tokens[: heads.cfg.num_heads],
        "checked": f"identical head logits and candidate tree ({len(pa.tokens)} nodes)"
        + ("; merged base model gives the adapted logits" if merge else ""),
    }


def _write_merged(heads, folder: Path, dt: torch.dtype) -> torch.nn.Module:
    """The adapted target as a standalone HF model folder, in ``dt``. A copy is merged (the
    in-memory target keeps its adapter); returns that merged copy, in full precision."""
    import copy

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


# ---------------------------------------------------------------------------------------------
# CLI


def load_trained_head(path: str | Path, target: Target | None = None) -> EagleHead:
    """The saved draft behind a run dir, draft dir or checkpoint dir (its target loaded from
    the draft's config unless given)."""
    from . import METHODS
    from .target import TargetConfig, load_target

    p = Path(path)
    for cand in (p / "final", p / "draft", p):
        if (cand / "config.json").exists():
            try:
                cfg = read_draft_config(cand)
            except DraftError:
                continue
            method = cfg["specdraft"]["method"]
            if method not in METHODS:
                raise DraftError(f"{cand}: unknown draft kind {method!r}")
            if target is None:
                t = cfg["target"]
                tcfg = TargetConfig(name=t.get("name") or "hf", path=t.get("path"))
                target = load_target(tcfg)
                if target.identity != t.get("identity"):
                    raise DraftError(
                        f"{cand}: trained for target {t.get('identity')}, but loading "
                        f"{tcfg.path or tcfg.name} gives {target.identity} (weights changed?)"
                    )
            return METHODS[method].load_draft(cand, target)
    raise DraftError(f"{p}: no saved draft here (looked for final/, draft/ and config.json)")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(
        prog="specdraft-export",
        description="Export a trained draft in a layout serving engines load, checked and "
        "re-imported before it is written.",
    )
    ap.add_argument("draft", help="a training run dir, its final/ folder or a checkpoint")
    ap.add_argument("--format", required=True, choices=sorted(FORMATS))
    ap.add_argument("--out", help="output folder (default: <draft>/export-<format>)")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    ap.add_argument("--gamma", type=int, default=3, help="speculators: speculative_tokens")
    ap.add_argument("--force", action="store_true", help="replace --out if it exists")
    ap.add_argument(
        "--merge", action="store_true", help="Medusa-2: write the adapter-merged model in base/"
    )
    a = ap.parse_args(argv)
    from .target import TargetError

    try:
        head = load_trained_head(a.draft)
        out = a.out or str(Path(a.draft) / f"export-{a.format}")
        export(head, a.format, out, dtype=a.dtype, force=a.force, gamma=a.gamma, merge=a.merge)
    except (ExportError, DraftError, TargetError) as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
