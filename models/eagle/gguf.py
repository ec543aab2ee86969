"""EAGLE-3 (and HASS) heads as llama.cpp GGUF drafts (``--format gguf``).

    specdraft-export runs/eagle3-x --format gguf            # -> runs/eagle3-x/export-gguf/draft.gguf
    llama-server -m target.gguf -md draft.gguf --spec-type draft-eagle3 --spec-draft-n-max 3

The file is what llama.cpp's own converter (``convert_hf_to_gguf.py <sglang export>
--target-model-dir <target>``, b11434) writes for an EAGLE-3 draft, written here directly with
the ``gguf`` package so that exporting needs no llama.cpp source tree:

- ``general.architecture = eagle3``; the usual Llama hyper-parameters under ``eagle3.*``;
  ``eagle3.target_layers`` = the fused layers as transformers ``hidden_states`` indices (llama.cpp
  takes the *input* of decoder layer k, which is ``hidden_states[k]``: our index unchanged);
  ``eagle3.target_hidden_size``; ``eagle3.norm_before_residual``; ``eagle3.norm_before_fc``;
  the target's tokenizer, copied key by key from the target's own GGUF.
- tensors ``fc.weight``; ``d2t`` as int64 *absolute* target ids (ours are offsets);
  ``blk.0.{attn_norm, attn_norm_2 (the hidden-state norm), attn_q, attn_k, attn_v, attn_output,
  ffn_norm, ffn_gate, ffn_up, ffn_down}``, ``output_norm``, ``output`` (the draft-vocabulary
  LM head); ``rope_freqs`` for a target with Llama-3 RoPE scaling (YaRN and
  linear scaling are ``rope.scaling.*`` keys, ``models.gguf.add_rope_scaling``). ``t2d`` is not stored
  (llama.cpp does not read it; it is rebuilt from ``d2t``).
  ``attn_q``/``attn_k`` rows are permuted the way the converter permutes every Llama's (GGUF's
  RoPE pairs adjacent dimensions, transformers' pairs halves).
- weights in ``q8_0`` by default: on a CPU without native bf16 llama.cpp ran the q8_0 draft
  fastest of the types tried (docs/benchmarks.md); 1-D tensors stay float32 as the
  converter keeps them.

Reading a GGUF back (``read``) undoes all of this, so the generic export pipeline checks keys,
shapes and proposals exactly as for the safetensors layouts, against the trained head with its
weights rounded the same way (``reference``).
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
    target_hparams,
    target_source,
    write_draft_gguf,
)
from .export import EAGLE3_LIKE, VLLMEagle3, layer_state

# GGUF tensor name <- the HF (vLLM layout) name of the same tensor
NAMES = {
    "fc.weight": "fc.weight",
    "norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
    "midlayer.input_layernorm.weight": "blk.0.attn_norm.weight",
    "midlayer.hidden_norm.weight": "blk.0.attn_norm_2.weight",
    "midlayer.self_attn.q_proj.weight": "blk.0.attn_q.weight",
    "midlayer.self_attn.k_proj.weight": "blk.0.attn_k.weight",
    "midlayer.self_attn.v_proj.weight": "blk.0.attn_v.weight",
    "midlayer.self_attn.o_proj.weight": "blk.0.attn_output.weight",
    "midlayer.post_attention_layernorm.weight": "blk.0.ffn_norm.weight",
    "midlayer.mlp.gate_proj.weight": "blk.0.ffn_gate.weight",
    "midlayer.mlp.up_proj.weight": "blk.0.ffn_up.weight",
    "midlayer.mlp.down_proj.weight": "blk.0.ffn_down.weight",
}


def permute(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """transformers' q/k row order -> GGUF's (llama.cpp's converter: ``LlamaModel.permute``)."""
    r = w.shape[0]
    return w.reshape(n_head, 2, r // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def unpermute(w: torch.Tensor, n_head: int) -> torch.Tensor:
    r = w.shape[0]
    return w.reshape(n_head, r // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


class GGUFEagle3(GGUFDraftFormat, VLLMEagle3):
    """EAGLE-3 / HASS heads for llama.cpp (``--spec-type draft-eagle3``)."""

    name, methods, description = "gguf", EAGLE3_LIKE, "EAGLE-3 GGUF for llama.cpp"
    omits_identity = False  # llama.cpp's converter writes d2t for every EAGLE-3 head
    spec_type = "draft-eagle3"
    serve_hint = (
        "llama.cpp: `llama-server -m <target.gguf> -md <this dir>/draft.gguf --spec-type "
        "draft-eagle3 --spec-draft-n-max 3 --spec-draft-p-min 0` (or `specdraft-eval "
        "engine=llama.cpp draft=<this dir>` to measure it inside llama.cpp)"
    )

    # -- writing ---------------------------------------------------------------------------

    def extra(self, draft, tmp: Path, dtype, merge: bool = False, target_gguf_path=None, **_):
        super().extra(draft, tmp, dtype, merge=merge)
        _, attn_bias, mlp_bias = layer_state(draft)
        if attn_bias or mlp_bias:
            raise ExportError(
                "llama.cpp's eagle3 draft has no attention or MLP biases; this head has them "
                f"(attention_bias={attn_bias}, mlp_bias={mlp_bias})"
            )
        L = draft.target.num_layers
        bad = [i for i in draft.cfg.fuse_layers if not 1 <= i < L]
        if bad:
            raise ExportError(
                f"fused layers {list(draft.cfg.fuse_layers)}: llama.cpp reads the input of a "
                f"decoder layer, so each must be in 1..{L - 1} for this {L}-layer target "
                f"(got {bad})"
            )
        rope_factors(draft.target.config)  # a scaling the file cannot hold is refused here
        target_source(draft, target_gguf_path)  # refused here, before anything is written
        return None

    def config(self, draft, dtype, target_gguf_path=None, **_: Any) -> dict[str, Any]:
        """config.json beside the GGUF: what the folder is (everything llama.cpp needs is in
        the GGUF itself) and the target GGUF ``save`` copies the tokenizer from."""
        return {
            "format": "gguf",
            "architecture": "eagle3",
            "file": self.weights_file,
            "method": draft.cfg.name,
            "target_identity": draft.target.identity,
            "target_gguf": str(target_source(draft, target_gguf_path)),
            "target_layers": list(draft.cfg.fuse_layers),
            "draft_vocab_size": draft.cfg.draft_vocab_size,
        }

    def save(self, tmp: Path, tensors: dict[str, torch.Tensor], config: dict, draft, quant: str):
        hp = target_hparams(draft.target.config)
        weights: dict[str, torch.Tensor] = {}
        for name, t in tensors.items():
            if name in ("d2t", "t2d"):
                if name == "d2t":
                    weights["d2t"] = t
                continue
            if name not in NAMES:
                raise ExportError(f"{name}: no place for it in llama.cpp's eagle3 layout")
            if name.endswith("q_proj.weight"):
                t = permute(t, hp["heads"])
            elif name.endswith("k_proj.weight"):
                t = permute(t, hp["kv"])
            weights[NAMES[name]] = t

        def keys(w):
            w.add_vocab_size(draft.target.config.vocab_size)
            w.add_rope_dimension_count(hp["head_dim"])
            w.add_array("eagle3.target_layers", [int(i) for i in draft.cfg.fuse_layers])
            w.add_uint32("eagle3.target_hidden_size", hp["H"])
            w.add_bool("eagle3.norm_before_residual", bool(draft.cfg.norm_before_residual))
            w.add_bool("eagle3.norm_before_fc", False)

        write_draft_gguf(
            tmp / self.weights_file, "eagle3", draft, config["target_gguf"], quant, 1, keys, weights
        )

    def stored_weights(self, draft, ref) -> dict[str, torch.Tensor]:
        # blocks of a quantized type run along a row, and the q/k permutation only reorders
        # rows: rounding before or after it is the same
        return {
            k: v for k, v in self.tensors(draft, torch.float32).items() if k not in ("d2t", "t2d")
        }

    # -- reading ---------------------------------------------------------------------------

    def load(self, path: Path, config: dict | None = None) -> dict[str, torch.Tensor]:
        """The GGUF's tensors under their HF (vLLM layout) names, dequantized to float32, q/k
        rows in transformers' order, ``d2t`` as offsets and ``t2d`` rebuilt."""
        r = open_gguf(path, "eagle3")
        heads = int(field(r, "eagle3.attention.head_count"))
        kv = int(field(r, "eagle3.attention.head_count_kv") or heads)
        back = {v: k for k, v in NAMES.items()}

        def to_hf(name: str, x: torch.Tensor):
            if name not in back:
                return None
            hf = back[name]
            if hf.endswith("q_proj.weight"):
                x = unpermute(x, heads)
            elif hf.endswith("k_proj.weight"):
                x = unpermute(x, kv)
            return hf, x

        return read_draft_gguf(path, r, int(field(r, "eagle3.vocab_size")), to_hf)

    def read_config(self, folder: Path) -> dict[str, Any]:
        """The settings the GGUF itself holds, in the vLLM config's words (what ``expected``,
        ``check`` and ``read`` look at); a GGUF folder needs no config.json."""
        r = open_gguf(folder / self.weights_file, "eagle3")
        d2t = next((t for t in r.tensors if t.name == "d2t"), None)
        return {
            "hidden_size": int(field(r, "eagle3.embedding_length")),
            "intermediate_size": int(field(r, "eagle3.feed_forward_length")),
            "num_attention_heads": int(field(r, "eagle3.attention.head_count")),
            "num_hidden_layers": int(field(r, "eagle3.block_count")),
            "vocab_size": int(field(r, "eagle3.vocab_size")),
            "draft_vocab_size": int(d2t.n_elements) if d2t is not None else None,
            "eagle_aux_hidden_state_layer_ids": [int(i) for i in field(r, "eagle3.target_layers")],
            "norm_before_residual": bool(field(r, "eagle3.norm_before_residual") or False),
            "attention_bias": False,
            "mlp_bias": False,
        }
