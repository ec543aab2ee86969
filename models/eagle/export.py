"""EAGLE's serving layouts, driven by the generic pipeline in ``models/export.py``.

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
                 ``layers.0.*`` instead of ``midlayer.*``, with the target's ``embed_tokens``
                 (speculators' loader leaves it zero when a checkpoint lacks it).
``eagle1``       the EAGLE-1 reference layout (SafeAILab/EAGLE; SGLang's EAGLE-1 loader):
                 ``pytorch_model.bin`` with ``embed_tokens``, ``fc`` (with bias), ``layers.0.*``
                 without an input norm; a one-layer ``config.json`` of the target's
                 architecture. No ``"bias"`` key: the reference gives FC a bias when the key is
                 absent, while Llama loaders (vLLM's, SGLang's) read ``"bias": true`` as
                 attention biases, which this layout does not hold (they would stay unset).
``eagle1-vllm``  EAGLE-1 as vLLM's ``EagleLlamaForCausalLM`` computes it: vLLM's FC has no bias
                 (it drops ``fc.bias`` without a word), so the bias is folded into the layer,
                 exactly: attention input ``h + b`` gives q/k/v biases ``W b``, and the residual
                 ``h + b`` an o_proj bias ``b``; ``"attention_bias": true``; safetensors.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from ..base import ExportError, ExportFormat, fit_export_weights
from ..export import cast, load_tensors, verifier_name
from ..target import layer_shape
from .config import Eagle1Config, Eagle3Config
from .model import Eagle3Head, EagleHead

# Methods whose drafts are EAGLE-3 heads at serving time (HASS trains one differently)
EAGLE3_LIKE = ("eagle3", "hass")

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


def target_dims(tc: Any) -> dict[str, int]:
    d = layer_shape(tc)
    return {k: d[k] for k in ("H", "head_dim", "heads", "kv", "I", "V")}


def llama_config(target, dtype: torch.dtype) -> dict[str, Any]:
    """A one-layer Llama config with the target's dimensions (what the engines' EAGLE loaders
    build their draft layer from). Rope settings are written in both the old (``rope_theta``,
    ``rope_scaling``) and the new (``rope_parameters``) spelling, for old and new loaders."""
    tc = target.config
    d = layer_shape(tc)
    rope = d["rope"]
    theta = rope["rope_theta"]
    scaling = {k: v for k, v in rope.items() if k != "rope_theta"} or None
    if scaling and scaling.get("rope_type", "default") == "default":
        scaling = None
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": d["H"],
        "intermediate_size": d["I"],
        "num_attention_heads": d["heads"],
        "num_key_value_heads": d["kv"],
        "head_dim": d["head_dim"],
        "num_hidden_layers": 1,
        "hidden_act": d["act"],
        "max_position_embeddings": d["max_pos"],
        "rms_norm_eps": d["eps"],
        "rope_theta": theta,
        "rope_scaling": scaling,
        "rope_parameters": {"rope_theta": theta, **(scaling or {"rope_type": "default"})},
        "attention_bias": d["attention_bias"],
        "mlp_bias": bool(getattr(tc, "mlp_bias", False)),
        "vocab_size": d["V"],
        "tie_word_embeddings": False,
        "bos_token_id": getattr(tc, "bos_token_id", None),
        "eos_token_id": getattr(tc, "eos_token_id", None),
        "pad_token_id": getattr(tc, "pad_token_id", None),
        "torch_dtype": str(dtype).removeprefix("torch."),
        "use_cache": True,
    }


def layer_state(head: EagleHead) -> tuple[dict[str, torch.Tensor], bool, bool]:
    """The head's decoder layer parameters, keyed relative to the layer, and whether it has
    attention / MLP biases. Refuses layers with parameters the Llama layout has no place for."""
    layer = head.midlayer if isinstance(head, Eagle3Head) else head.layer
    state = dict(layer.state_dict())
    allowed = {f"{k}.{w}" for k in LAYER_KEYS for w in ("weight", "bias")}
    allowed |= {"input_layernorm.weight", "post_attention_layernorm.weight", "hidden_norm.weight"}
    odd = sorted(k for k in state if k not in allowed)
    if odd:
        raise ExportError(
            f"the draft's decoder layer ({type(layer).__name__}) has parameters the Llama "
            f"EAGLE layout has no place for: {odd[:5]}"
        )
    return state, "self_attn.q_proj.bias" in state, "mlp.gate_proj.bias" in state


def check_vocab_chosen(path: Path, d2t: torch.Tensor, draft) -> None:
    """Refuse the placeholder mapping of a draft whose vocabulary was never chosen (engines
    would load it and silently propose wrong tokens). Training records the choice
    (``draft.vocab_chosen``), which tells it from the identity a full-vocabulary draft
    chooses; a ``d2t`` that moves any id was chosen whatever the record."""
    if not draft.vocab_chosen and not d2t.any():
        raise ExportError(
            f"{path}: d2t is all zeros and this draft's vocabulary ({len(d2t)} tokens) was "
            "never chosen from training data; engines would load it and silently propose "
            "wrong tokens"
        )


def _layer_config(config: dict) -> dict:
    return config.get("transformer_layer_config", config)


def full_vocabulary(dv: int | None, V: int) -> bool:
    """A draft vocabulary that is the target's whole vocabulary: its mapping is the identity,
    which the engines' EAGLE-3 layouts leave out (vLLM registers no ``d2t`` then and refuses
    one)."""
    return dv is not None and dv == V


class EagleFormat(ExportFormat):
    """What the EAGLE layouts share: one Llama decoder layer under ``layer_prefix``, FC, and
    for EAGLE-3 the draft vocabulary and its mapping."""

    layer_prefix = "midlayer."
    weights_file = "model.safetensors"
    eagle3 = True  # an EAGLE-3 head (fused layers, draft vocabulary); False: EAGLE-1
    embeds = False  # carries the target's input embedding (frozen) for its loader
    omits_identity = True  # a full-vocabulary head's identity d2t/t2d left out (vLLM's rule)
    #: the layout variants (``Eagle3Config`` flags) this layout's loaders read; a head using
    #: another is refused, since an engine would silently compute something else
    layout_flags: tuple[str, ...] = ()

    # -- writing ---------------------------------------------------------------------------

    def extra(self, draft, tmp: Path, dtype, merge: bool = False, **_: Any) -> None:
        if merge:
            raise ExportError("--merge is for Medusa-2 drafts (a LoRA-adapted backbone)")
        return None

    def tensors(self, draft: EagleHead, dtype: torch.dtype) -> dict[str, torch.Tensor]:
        layer, _, _ = layer_state(draft)
        out = {self.layer_prefix + k: v for k, v in layer.items()}
        out.update(self.head_tensors(draft))
        if self.embeds:
            out["embed_tokens.weight"] = draft.target.embed_tokens.weight
        return cast(out, dtype)

    def head_tensors(self, draft) -> dict[str, torch.Tensor]:
        c = draft.cfg
        fuse = c.fuse_layers
        if len(set(fuse)) != 3 or min(fuse) < 1:
            raise ExportError(
                f"fused layers {fuse}: serving engines need three distinct layers >= 1 "
                "(they capture each once, from the first decoder layer's output on)"
            )
        used = [f for f in ("norm_before_fc", "norm_output", "fc_norm") if getattr(c, f, False)]
        if any(f not in self.layout_flags for f in used):
            raise ExportError(
                f"--format {self.name}: this head uses the layout variants "
                f"{', '.join(f'{f}=True' for f in used)}, which {self.description} cannot "
                "express; export it with --format vllm or --format speculators (vLLM reads them)"
            )
        out = {
            "fc.weight": draft.fc.weight,
            "norm.weight": draft.norm.weight,
            "lm_head.weight": draft.lm_head.weight,
            "d2t": draft.d2t.to(torch.int64),
            "t2d": draft.t2d.to(torch.bool),
        }
        if self.omits_identity and full_vocabulary(len(draft.d2t), draft.t2d.numel()):
            del out["d2t"], out["t2d"]
        if c.norm_before_fc:
            out["input_norm.weight"] = draft.input_norm.weight
        if getattr(c, "fc_norm", False):
            for i, norm in enumerate(draft.fc_norm):
                out[f"fc_norm.{i}.weight"] = norm.weight
        return out

    def base_config(self, draft, dtype) -> dict[str, Any]:
        base = llama_config(draft.target, dtype)
        _, base["attention_bias"], base["mlp_bias"] = layer_state(draft)
        return base

    # -- checking --------------------------------------------------------------------------

    def expected(self, config: dict, target_config: Any) -> dict[str, tuple]:
        """Every tensor and its shape, from the target's config and the written config (its
        biases, draft vocabulary size and norm flags)."""
        d = target_dims(target_config)
        H, hd, V = d["H"], d["head_dim"], d["V"]
        layer = _layer_config(config)
        eagle3 = self.eagle3
        attn_in = 2 * H if eagle3 else H  # EAGLE-3 attends over [emb; hidden]
        p = self.layer_prefix
        s: dict[str, tuple] = {
            f"{p}self_attn.q_proj.weight": (d["heads"] * hd, attn_in),
            f"{p}self_attn.k_proj.weight": (d["kv"] * hd, attn_in),
            f"{p}self_attn.v_proj.weight": (d["kv"] * hd, attn_in),
            f"{p}self_attn.o_proj.weight": (H, d["heads"] * hd),
            f"{p}mlp.gate_proj.weight": (d["I"], H),
            f"{p}mlp.up_proj.weight": (d["I"], H),
            f"{p}mlp.down_proj.weight": (H, d["I"]),
            f"{p}post_attention_layernorm.weight": (H,),
        }
        if layer.get("attention_bias"):
            for n in ("q", "k", "v"):
                s[f"{p}self_attn.{n}_proj.bias"] = (s[f"{p}self_attn.{n}_proj.weight"][0],)
        if layer.get("mlp_bias"):
            for n in ("gate", "up", "down"):
                s[f"{p}mlp.{n}_proj.bias"] = (s[f"{p}mlp.{n}_proj.weight"][0],)
        if eagle3:
            dv = config.get("draft_vocab_size")
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
            if self.omits_identity and full_vocabulary(dv, V):
                del s["d2t"], s["t2d"]
            if config.get("norm_before_fc"):
                s["input_norm.weight"] = (3 * H,)
            if config.get("fc_norm"):
                s.update({f"fc_norm.{i}.weight": (H,) for i in range(3)})
        else:
            s.update({"fc.weight": (H, 2 * H), "fc.bias": (H,)})
        if self.embeds:
            s["embed_tokens.weight"] = (V, H)
        return s

    def check(self, path: Path, tensors: dict, config: dict, draft) -> None:
        f = path.parent / "config.json"
        tc = draft.target.config
        layer = _layer_config(config)
        for key in ("hidden_size", "intermediate_size", "num_attention_heads", "vocab_size"):
            if layer.get(key) != getattr(tc, key):
                raise ExportError(f"{f}: {key}={layer.get(key)}, the target has {getattr(tc, key)}")
        if layer.get("num_hidden_layers") != 1:
            raise ExportError(
                f"{f}: num_hidden_layers={layer.get('num_hidden_layers')}, expected 1"
            )
        if not self.eagle3:
            return
        if config.get("draft_vocab_size") != draft.cfg.draft_vocab_size:
            raise ExportError(f"{f}: draft_vocab_size={config.get('draft_vocab_size')}")
        if "d2t" not in tensors:  # the whole vocabulary (``expected`` allowed no mapping)
            check_vocab_chosen(path, draft.d2t, draft)
            return
        d2t, t2d = tensors["d2t"], tensors["t2d"]
        if d2t.dtype != torch.int64 or t2d.dtype != torch.bool:
            raise ExportError(
                f"{path}: d2t must be int64 and t2d bool (got {d2t.dtype}, {t2d.dtype})"
            )
        check_vocab_chosen(path, d2t, draft)
        ids = torch.arange(len(d2t)) + d2t
        V = t2d.numel()
        if ids.min() < 0 or ids.max() >= V or not (ids[1:] > ids[:-1]).all():
            raise ExportError(f"{path}: d2t maps to target ids outside 0..{V - 1} or repeats one")
        if int(t2d.sum()) != len(d2t) or not t2d[ids].all():
            raise ExportError(f"{path}: t2d does not mark exactly the tokens d2t maps to")

    # -- reading ---------------------------------------------------------------------------

    def fused_layers(self, config: dict) -> list[int] | None:
        return config.get("eagle_aux_hidden_state_layer_ids")

    def read(self, folder: Path, target, config: dict) -> EagleHead:
        tensors = self.load(folder / self.weights_file, config)
        L = target.num_layers
        fuse = self.fused_layers(config) or [2, L // 2, L - 3]  # the engines' default
        V = target.config.vocab_size
        if "d2t" not in tensors and not full_vocabulary(config.get("draft_vocab_size"), V):
            raise ExportError(
                f"{folder / self.weights_file}: no d2t and draft_vocab_size="
                f"{config.get('draft_vocab_size')} (the target has {V}); without the "
                "draft-to-target mapping an EAGLE-3 draft proposes the wrong tokens"
            )
        if "d2t" not in tensors:  # the whole vocabulary: the identity mapping
            tensors["d2t"] = torch.zeros(V, dtype=torch.int64)
            tensors["t2d"] = torch.ones(V, dtype=torch.bool)
        dv = config.get("draft_vocab_size") or int(tensors["d2t"].numel())
        flags = {
            k: bool(config.get(k, False))
            for k in ("norm_before_residual", "norm_before_fc", "norm_output", "fc_norm")
        }
        head = self.build(target, config, fuse_layers=fuse, draft_vocab_size=dv, **flags)
        head.vocab_chosen = True  # the mapping a checkpoint holds is the one it was trained with
        tensors.pop("embed_tokens.weight", None)  # ours is the target's
        return self._load(head, tensors, "midlayer.", folder)

    def build(self, target, config: dict, **settings: Any) -> EagleHead:
        """The (untrained) head the weights are read into, from the settings read off the
        folder; P-EAGLE's format builds its own."""
        return Eagle3Head(target, Eagle3Config(**settings))

    def _load(self, head: EagleHead, tensors: dict, dst: str, folder: Path) -> EagleHead:
        p = self.layer_prefix
        spelled = {(dst + k[len(p) :] if k.startswith(p) else k): k for k in tensors}
        renamed = {ours: tensors[theirs] for ours, theirs in spelled.items()}
        fit_export_weights(
            head, renamed, folder / self.weights_file, f"an {head.cfg.name} head", names=spelled
        )
        return head

    def readme_lines(self, draft, config: dict) -> list[str]:
        if not self.eagle3:
            return []
        t = draft.target
        return [
            f"- fused target layers (transformers hidden_states index): "
            f"{draft.cfg.fuse_layers}; draft vocabulary {draft.cfg.draft_vocab_size} of "
            f"{t.config.vocab_size}"
        ]


class SGLangEagle3(EagleFormat):
    name, methods, description = "sglang", EAGLE3_LIKE, "EAGLE-3 for SGLang"
    # not served through vLLM: vLLM reads ``eagle_config.eagle_aux_hidden_state_layer_ids`` as
    # its own layer ids (the input of decoder layer k), SGLang as layer outputs (k + 1), so
    # vLLM would fuse the layers below the trained ones; the ``vllm`` layout is vLLM's
    vllm_method = None
    vllm_refusal = "it reads the fused layer ids one lower: --format vllm is vLLM's layout"
    serve_hint = (
        "SGLang: `--speculative-algorithm EAGLE3 --speculative-draft-model-path <this dir>`"
    )

    def config(self, draft, dtype, **_: Any) -> dict:
        return {
            **self.base_config(draft, dtype),
            "architectures": ["LlamaForCausalLMEagle3"],
            "draft_vocab_size": draft.cfg.draft_vocab_size,
            "eagle_config": {
                "eagle_aux_hidden_state_layer_ids": [i - 1 for i in draft.cfg.fuse_layers],
                "use_aux_hidden_state": True,
            },
        }

    def head_tensors(self, draft) -> dict[str, torch.Tensor]:
        if draft.cfg.norm_before_residual:
            raise ExportError(
                "--format sglang: this head uses norm_before_residual=True, which the SGLang "
                "layout's config cannot record; export it with --format vllm or --format "
                "speculators (both write the flag)"
            )
        return super().head_tensors(draft)

    def fused_layers(self, config: dict) -> list[int] | None:
        ids = (config.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
        return [i + 1 for i in ids] if ids else None  # SGLang counts layer outputs

    def detect(self, folder: Path, config: dict) -> bool:
        archs = config.get("architectures") or []
        return (
            any("Eagle3" in a for a in archs)
            and "eagle_aux_hidden_state_layer_ids" not in config
            and "speculators_model_type" not in config
        )


class VLLMEagle3(EagleFormat):
    name, methods, description = "vllm", EAGLE3_LIKE, "EAGLE-3 for vLLM"
    vllm_method = "eagle3"
    # vLLM's LlamaForCausalLMEagle3 reads each from the config (EAGLE 3.1's fc_norm too)
    layout_flags = ("norm_before_fc", "norm_output", "fc_norm")

    def config(self, draft, dtype, **_: Any) -> dict:
        c = draft.cfg
        out = {
            **self.base_config(draft, dtype),
            "architectures": ["LlamaForCausalLMEagle3"],
            "draft_vocab_size": c.draft_vocab_size,
            "eagle_aux_hidden_state_layer_ids": list(c.fuse_layers),
            "norm_before_residual": c.norm_before_residual,
        }
        for f in self.layout_flags:  # written only where set: the plain layout stays as it was
            if getattr(c, f, False):
                out[f] = True
        return out

    def detect(self, folder: Path, config: dict) -> bool:
        archs = config.get("architectures") or []
        return (
            any("Eagle3" in a for a in archs)
            and "eagle_aux_hidden_state_layer_ids" in config
            and "speculators_model_type" not in config
        )


class SpeculatorsEagle3(EagleFormat):
    name, methods, description = "speculators", EAGLE3_LIKE, "EAGLE-3, vLLM speculators"
    layout_flags = ("norm_before_fc", "norm_output", "fc_norm")
    layer_prefix = "layers.0."
    embeds = True
    # vLLM 0.32 needs the method spelled out for this layout: given {"model": <dir>} alone (as
    # speculators' own docs show it) it takes the folder for a draft model and fails
    vllm_method = "eagle3"

    def config(self, draft, dtype, gamma: int = 3, **_: Any) -> dict:
        base = self.base_config(draft, dtype)
        target, c = draft.target, draft.cfg
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
            "draft_vocab_size": c.draft_vocab_size,
            # written out: speculators' own defaults for these differ between its config class
            # and its trainer, so a loader must not guess
            "norm_before_residual": c.norm_before_residual,
            "norm_before_fc": c.norm_before_fc,
            "norm_output": c.norm_output,
            "fc_norm": c.fc_norm,
            "embed_requires_grad": False,
            "target_hidden_size": None,
            "eagle_aux_hidden_state_layer_ids": list(c.fuse_layers),
            "torch_dtype": str(dtype).removeprefix("torch."),
        }

    def check(self, path: Path, tensors: dict, config: dict, draft) -> None:
        super().check(path, tensors, config, draft)
        v = config.get("speculators_config", {}).get("verifier", {}).get("name_or_path")
        if not v:
            raise ExportError(f"{path.parent / 'config.json'}: verifier.name_or_path is empty")

    def detect(self, folder: Path, config: dict) -> bool:
        return config.get("speculators_model_type") == "eagle3"


class Eagle1Reference(EagleFormat):
    name, methods, description = "eagle1", ("eagle1",), "EAGLE-1 reference layout"
    eagle3 = False
    weights_file = "pytorch_model.bin"
    layer_prefix = "layers.0."
    embeds = True
    serve_hint = "EAGLE reference / SGLang EAGLE-1 loaders: point them at this dir."
    vllm_method = None
    vllm_refusal = (
        "its EAGLE-1 FC has no bias, and it drops the layout's without a word; --format "
        "eagle1-vllm folds the bias into the layer, or pass the training run"
    )

    def head_tensors(self, draft) -> dict[str, torch.Tensor]:
        if draft.cfg.input_norm:
            raise ExportError(
                "this EAGLE-1 head keeps an input norm on its decoder layer (method.input_norm="
                "true), which the reference layout has no place for; retrain with the default"
            )
        return {"fc.weight": draft.fc.weight, "fc.bias": draft.fc.bias}

    def config(self, draft, dtype, **_: Any) -> dict:
        # no "bias" key: the reference reads its absence as FC's bias (its default), Llama
        # loaders its presence as attention biases this layout does not hold
        return self.base_config(draft, dtype)

    def read(self, folder: Path, target, config: dict) -> EagleHead:
        tensors = load_tensors(folder / self.weights_file)
        tensors.pop("embed_tokens.weight", None)  # ours is the target's
        head = EagleHead(target, Eagle1Config(input_norm=False))
        return self._load(
            head, self.head_state(tensors, folder / self.weights_file), "layer.", folder
        )

    def head_state(self, tensors: dict, path: Path) -> dict[str, torch.Tensor]:
        """The file's tensors as our head's (this layout: as they are)."""
        return tensors

    def detect(self, folder: Path, config: dict) -> bool:
        # a one-layer config beside weights holding FC over [emb; feature] and the layer
        if config.get("num_hidden_layers") != 1:
            return False
        shapes = _weight_shapes(folder / self.weights_file)
        return shapes is not None and self.holds(shapes, config)

    def holds(self, shapes: dict[str, list[int]], config: dict) -> bool:
        return "fc.weight" in shapes and f"{self.layer_prefix}mlp.up_proj.weight" in shapes


class Eagle1Vllm(Eagle1Reference):
    """EAGLE-1 for vLLM: FC without its bias, the bias folded exactly into the decoder layer
    (q/k/v biases ``W b``, an o_proj bias ``b``), which vLLM builds from
    ``"attention_bias": true``."""

    name, description = "eagle1-vllm", "EAGLE-1 for vLLM"
    weights_file = "model.safetensors"
    serve_hint = ""  # the export prints and writes the `vllm serve` line itself
    vllm_method = "eagle"

    def tensors(self, draft, dtype: torch.dtype) -> dict[str, torch.Tensor]:
        # (the draft layer has no attention biases of its own: ``layer_shape``)
        out = super().tensors(draft, torch.float32)
        b = out.pop("fc.bias").double()
        p = self.layer_prefix
        for n in ("q", "k", "v"):
            out[f"{p}self_attn.{n}_proj.bias"] = out[f"{p}self_attn.{n}_proj.weight"].double() @ b
        out[f"{p}self_attn.o_proj.bias"] = b
        return cast(out, dtype)

    def config(self, draft, dtype, **_: Any) -> dict:
        return {**self.base_config(draft, dtype), "attention_bias": True}

    def expected(self, config: dict, target_config: Any) -> dict[str, tuple]:
        s = super().expected(config, target_config)
        del s["fc.bias"]
        if _layer_config(config).get("attention_bias"):  # vLLM's Llama: o_proj's bias too
            s[f"{self.layer_prefix}self_attn.o_proj.bias"] = (target_dims(target_config)["H"],)
        return s

    def head_state(self, tensors: dict, path: Path) -> dict[str, torch.Tensor]:
        """FC's bias unfolded: o_proj's bias is it, and q/k/v's must be ``W b`` (our draft
        layer has no attention biases of its own); a checkpoint whose are not is refused
        rather than read as something else."""
        p = self.layer_prefix
        w_o = tensors[f"{p}self_attn.o_proj.weight"]
        b = tensors.pop(f"{p}self_attn.o_proj.bias", None)
        b = torch.zeros(w_o.shape[0]) if b is None else b.float()
        for n in ("q", "k", "v"):
            got = tensors.pop(f"{p}self_attn.{n}_proj.bias", None)
            if got is None:
                continue
            w = tensors[f"{p}self_attn.{n}_proj.weight"].float()
            # what rounding to the file's dtype leaves of W b (a few ulps of its terms)
            tol = 8 * torch.finfo(got.dtype).eps * (w.abs() @ b.abs()) + 1e-6
            if ((got.float() - w @ b).abs() > tol).any():
                raise ExportError(
                    f"{path}: {p}self_attn.{n}_proj.bias is not FC's bias folded in (W b); an "
                    "EAGLE-1 head with attention biases of its own, which ours has no place for"
                )
        return {**tensors, "fc.bias": b}

    def holds(self, shapes: dict[str, list[int]], config: dict) -> bool:
        # FC(2H -> H) without a bias, and nothing but it, the embedding and the layer (an
        # EAGLE-3 or DFlash-family draft has more)
        if "speculators_model_type" in config or any(
            "Eagle3" in a for a in config.get("architectures") or []
        ):
            return False
        H = config.get("hidden_size")
        own = {"fc.weight", "embed_tokens.weight"}
        return (
            shapes.get("fc.weight") == [H, 2 * H]
            and f"{self.layer_prefix}mlp.up_proj.weight" in shapes
            and all(k in own or k.startswith(self.layer_prefix) for k in shapes)
        )


def _weight_shapes(f: Path) -> dict[str, list[int]] | None:
    """Each tensor's shape in the weights file ``f`` (safetensors or ``torch.save``), read
    without its data; None where there is no such file or it does not read."""
    if not f.is_file():
        return None
    try:
        if f.suffix == ".safetensors":
            from safetensors import safe_open

            with safe_open(str(f), "pt") as st:
                return {k: list(st.get_slice(k).get_shape()) for k in st.keys()}
        state = torch.load(f, map_location="cpu", mmap=True, weights_only=True)
    except Exception:
        return None
    if not isinstance(state, dict):
        return None
    return {k: list(getattr(v, "shape", ())) for k, v in state.items()}


def _formats():
    from .gguf import GGUFEagle3  # beside the others; it builds on the vLLM layout

    return (
        SGLangEagle3(),
        VLLMEagle3(),
        SpeculatorsEagle3(),
        Eagle1Reference(),
        Eagle1Vllm(),
        GGUFEagle3(),
    )


FORMATS = _formats()
