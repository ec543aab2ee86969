"""DFlash drafts as llama.cpp GGUF (``--format gguf``; DSpark's builds on it in
``models/dspark/gguf.py``).

    specdraft-export runs/dflash-x --format gguf           # -> runs/dflash-x/export-gguf-dflash/
    llama-server -m target.gguf -md draft.gguf --spec-type draft-dflash --spec-draft-n-max <B - 1>

llama.cpp (b11434) serves DFlash and DSpark drafts as one architecture, ``dflash``: the target
hands the draft the *inputs* of its decoder layers ``dflash.target_layers`` (``hidden_states``
indices: our fused layers unchanged), the draft projects them with ``fc`` and ``hidden_norm``
(``enc.output_norm``) into each layer's context keys and values, and runs the block
``[last token, mask x n_max]`` non-causally against them; slot i's argmax is the draft for
position i. The block has ``n_max + 1`` tokens, not ``dflash.block_size``: serve with
``--spec-draft-n-max <block_size - 1>`` to run the block the draft was trained on
(``specdraft-eval engine=llama.cpp`` does).

What is written (the keys and tensors llama.cpp's ``convert_hf_to_gguf.py`` writes for the same
draft, minus ``token_embd``):

- ``general.architecture = dflash``; the draft layers' Qwen3 hyper-parameters under
  ``dflash.*`` (the target's sizes and RoPE); ``dflash.block_size``; ``dflash.target_layers``;
  ``dflash.attention.causal = false``; ``dflash.embedding_scale`` where the target scales its
  embeddings (Gemma's sqrt(H), which llama.cpp applies to the block's); the target's
  tokenizer, copied key by key from the target's own GGUF, plus
  ``tokenizer.ggml.mask_token_id``.
- tensors ``fc``, ``enc.output_norm`` (``hidden_norm``), ``blk.i.{attn_norm, attn_q, attn_k,
  attn_v, attn_output, attn_q_norm, attn_k_norm, ffn_norm, ffn_gate, ffn_up, ffn_down}``,
  ``output_norm``; ``rope_freqs`` for a target with Llama-3 RoPE scaling (YaRN and
  linear scaling are ``rope.scaling.*`` keys, ``models.gguf.add_rope_scaling``); for a reduced draft
  vocabulary ``output`` (the target's LM head rows the draft scores with) and ``d2t`` (int64 *absolute* target ids). No ``token_embd``: the engine
  then embeds the block with the target's own table, which is what the draft was trained with
  (the converter copies it, rounded to the file's type). A full-vocabulary draft stores no
  ``output`` either and scores with the target's own head.
- no q/k row permutation: the Qwen3 layers use NeoX RoPE, as transformers does.
- weights in ``q8_0`` by default (as for EAGLE-3 GGUF drafts), 1-D tensors float32.

Reading back (``read``) undoes this; the export's check compares the read-back draft with the
trained one rounded the same way (``reference``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from ..base import ExportError
from ..gguf import (
    GGUFDraftFormat,
    field,
    open_gguf,
    read_draft_gguf,
    rope_factors,
    target_source,
    write_draft_gguf,
)
from .export import SpeculatorsDFlash

ARCH = "dflash"
MASK_KEY = "tokenizer.ggml.mask_token_id"

#: GGUF tensor name <- the HF (speculators layout) name, for the non-layer tensors
NAMES = {
    "fc.weight": "fc.weight",
    "hidden_norm.weight": "enc.output_norm.weight",
    "norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}
#: per draft layer i: ``layers.{i}.<key>`` -> ``blk.{i}.<value>``
LAYER = {
    "input_layernorm.weight": "attn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_norm.weight": "attn_q_norm.weight",
    "self_attn.k_norm.weight": "attn_k_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}


def gguf_name(name: str, extra: dict[str, str]) -> str | None:
    """The GGUF name of the HF tensor ``name`` (None: not stored)."""
    if name in NAMES:
        return NAMES[name]
    if name in extra:
        return extra[name]
    if name.startswith("layers."):
        _, i, rest = name.split(".", 2)
        if rest in LAYER:
            return f"blk.{i}.{LAYER[rest]}"
    return None


def hf_name(name: str, extra: dict[str, str]) -> str | None:
    back = {v: k for k, v in {**NAMES, **extra}.items()}
    if name in back:
        return back[name]
    if name.startswith("blk."):
        _, i, rest = name.split(".", 2)
        for k, v in LAYER.items():
            if v == rest:
                return f"layers.{i}.{k}"
    return None


class DFlashGGUF(GGUFDraftFormat):
    """The GGUF half of the DFlash-family layouts, mixed in before the safetensors layout whose
    ``tensors``, ``expected``, ``check`` and ``read`` it reuses (``read_config`` gives those the
    settings the GGUF holds, in that layout's words)."""

    #: HF name -> GGUF name of the tensors a subclass adds (DSpark's Markov and confidence heads)
    extra_names: dict[str, str] = {}
    spec_type = "draft-dflash"  # llama-server's --spec-type for this layout

    # -- writing ---------------------------------------------------------------------------

    def extra(self, draft, tmp: Path, dtype, target_gguf_path=None, **_):
        c = draft.cfg
        if c.layer_arch != "qwen3":
            raise ExportError(
                f"llama.cpp's dflash draft has Qwen3 layers (per-head q/k norms); this draft's "
                f"are the target's own (method.layer_arch={c.layer_arch}): train with "
                "method.layer_arch=qwen3 to serve it in llama.cpp"
            )
        tc = draft.target.config
        biased = sorted({k.split(".", 2)[2] for k, _ in draft.layers.named_parameters(prefix="l")
                         if k.endswith(".bias")})  # fmt: skip
        if biased:
            raise ExportError(
                "llama.cpp's dflash draft has no attention or MLP biases; this draft's layers "
                f"have them (as the target's do: {', '.join(biased[:3])})"
            )
        rope_factors(tc)  # a scaling the file cannot hold is refused here
        L = draft.target.num_layers
        bad = [i for i in c.fuse_layers if not 0 <= i < L]
        if bad:
            raise ExportError(
                f"fused layers {list(c.fuse_layers)}: llama.cpp reads the input of a decoder "
                f"layer, so each must be in 0..{L - 1} for this {L}-layer target (got {bad})"
            )
        if c.mask_token_id is None:
            raise ExportError("this draft has no mask_token_id; llama.cpp's block needs one")
        target_source(draft, target_gguf_path)  # refused here, before anything is written
        return None

    def config(self, draft, dtype, target_gguf_path=None, **_: Any) -> dict[str, Any]:
        """config.json beside the GGUF: what the folder is (everything llama.cpp needs is in
        the GGUF itself) and the target GGUF ``save`` copies the tokenizer from."""
        c = draft.cfg
        return {
            "format": self.name,
            "architecture": ARCH,
            "spec_type": self.spec_type,
            "file": self.weights_file,
            "method": c.name,
            "target_identity": draft.target.identity,
            "target_gguf": str(target_source(draft, target_gguf_path)),
            "target_layers": list(c.fuse_layers),
            "block_size": c.block_size,
            "draft_vocab_size": c.draft_vocab_size,
        }

    def gguf_keys(self, w, draft) -> None:
        """Keys a subclass adds."""

    def save(self, tmp: Path, tensors: dict[str, torch.Tensor], config: dict, draft, quant: str):
        c = draft.cfg
        full = c.draft_vocab_size == draft.target.config.vocab_size
        weights: dict[str, torch.Tensor] = {}
        for name, t in tensors.items():
            if name in ("t2d", "embed_tokens.weight") or (full and name == "lm_head.weight"):
                continue
            g = "d2t" if name == "d2t" else gguf_name(name, self.extra_names)
            if g is None:
                raise ExportError(f"{name}: no place for it in llama.cpp's dflash layout")
            weights[g] = t

        def keys(w):
            w.add_uint32(f"{ARCH}.block_size", int(c.block_size))
            w.add_array(f"{ARCH}.target_layers", [int(i) for i in c.fuse_layers])
            w.add_bool(f"{ARCH}.attention.causal", False)
            scale = getattr(draft.target.embed_tokens, "embed_scale", None)  # Gemma's sqrt(H)
            if scale is not None and float(scale) != 1.0:
                w.add_float32(f"{ARCH}.embedding_scale", float(scale))
            self.gguf_keys(w, draft)

        write_draft_gguf(
            tmp / self.weights_file, ARCH, draft, config["target_gguf"], quant, c.num_layers,
            keys, weights, token_ids={MASK_KEY: c.mask_token_id},
        )  # fmt: skip

    # -- reading ---------------------------------------------------------------------------

    def load(self, path: Path, config: dict | None = None) -> dict[str, torch.Tensor]:
        """The GGUF's tensors under their HF names, dequantized to float32, ``d2t`` as
        offsets and ``t2d`` rebuilt."""
        r = open_gguf(path, ARCH)
        V = len(r.fields["tokenizer.ggml.tokens"].contents())

        def to_hf(name: str, x: torch.Tensor):
            hf = hf_name(name, self.extra_names)
            return None if hf is None else (hf, x)

        return read_draft_gguf(path, r, V, to_hf)

    def gguf_settings(self, folder: Path) -> dict[str, Any]:
        """The settings the GGUF holds, by our names."""
        path = folder / self.weights_file
        r = open_gguf(path, ARCH)
        d2t = next((t for t in r.tensors if t.name == "d2t"), None)
        V = len(r.fields["tokenizer.ggml.tokens"].contents())
        shapes = {t.name: tuple(int(n) for n in reversed(t.shape)) for t in r.tensors}
        try:
            return {
                "num_layers": int(field(r, f"{ARCH}.block_count")),
                "block_size": int(field(r, f"{ARCH}.block_size")),
                "fuse_layers": [int(i) for i in field(r, f"{ARCH}.target_layers")],
                "mask_token_id": int(field(r, MASK_KEY)),
                "draft_vocab_size": int(d2t.n_elements) if d2t is not None else V,
                "vocab_size": V,
                "causal": bool(field(r, f"{ARCH}.attention.causal") or False),
                "shapes": shapes,
                "sample_from_anchor": field(r, f"{ARCH}.sample_from_anchor"),
                "has_confidence_head": field(r, f"{ARCH}.has_confidence_head"),
            }
        except TypeError:  # a key is missing (field() gave None)
            missing = [
                k
                for k in (
                    f"{ARCH}.block_count",
                    f"{ARCH}.block_size",
                    f"{ARCH}.target_layers",
                    MASK_KEY,
                )  # fmt: skip
                if field(r, k) is None
            ]
            raise ExportError(f"{path}: no {', '.join(missing)}") from None

    def check(self, path: Path, tensors: dict, config: dict, draft) -> None:
        if config.get("causal"):
            raise ExportError(
                f"{path}: dflash.attention.causal=true; specdraft's DFlash blocks are non-causal"
            )
        super().check(path, tensors, config, draft)

    def expected(self, config: dict, target_config: Any) -> dict[str, tuple]:
        s = super().expected(config, target_config)
        s.pop("embed_tokens.weight", None)  # the engine embeds with the target's table
        if config.get("draft_vocab_size") == target_config.vocab_size:
            s.pop("lm_head.weight", None)  # and scores with the target's head
        return s


class GGUFDFlash(DFlashGGUF, SpeculatorsDFlash):
    """DFlash drafts for llama.cpp (``--spec-type draft-dflash``)."""

    name, methods, description = "gguf-dflash", ("dflash",), "DFlash GGUF for llama.cpp"
    family = "gguf"
    serve_hint = (
        "llama.cpp: `llama-server -m <target.gguf> -md <this dir>/draft.gguf --spec-type "
        "draft-dflash --spec-draft-n-max <block_size - 1> --spec-draft-p-min 0` (or "
        "`specdraft-eval engine=llama.cpp draft=<this dir>` to measure it inside llama.cpp)"
    )

    def read_config(self, folder: Path) -> dict[str, Any]:
        """The GGUF's settings in the speculators config's words."""
        g = self.gguf_settings(folder)
        return {
            "transformer_layer_config": {
                "num_hidden_layers": g["num_layers"],
                "model_type": "qwen3",
                "attention_bias": False,
            },
            "block_size": g["block_size"],
            "mask_token_id": g["mask_token_id"],
            "aux_hidden_state_layer_ids": g["fuse_layers"],
            "draft_vocab_size": g["draft_vocab_size"],
            "causal": g["causal"],
        }


FORMATS = (GGUFDFlash(),)
