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
  LM head). ``t2d`` is not stored (llama.cpp does not read it; it is rebuilt from ``d2t``).
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

import numpy as np
import torch

from ..base import ExportError
from ..target import TargetError, target_gguf
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
# what --dtype means for a GGUF draft: the type of its 2-D weights
QUANTS = ("q8_0", "float16", "bfloat16", "float32")
FILE_TYPE = {"float32": 0, "float16": 1, "q8_0": 7, "bfloat16": 32}  # llama_ftype


def _gguf():
    try:
        import gguf
    except ImportError:  # pragma: no cover - a declared dependency
        raise ExportError("--format gguf needs the gguf package: pip install gguf") from None
    return gguf


def permute(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """transformers' q/k row order -> GGUF's (llama.cpp's converter: ``LlamaModel.permute``)."""
    r = w.shape[0]
    return w.reshape(n_head, 2, r // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def unpermute(w: torch.Tensor, n_head: int) -> torch.Tensor:
    r = w.shape[0]
    return w.reshape(n_head, r // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _qtype(gguf, quant: str, arr: np.ndarray):
    """The GGML type a tensor is stored in: 1-D tensors float32 (as the converter keeps norms),
    2-D weights in ``quant`` (q8_0 needs rows that are whole 32-value blocks)."""
    T = gguf.GGMLQuantizationType
    if arr.ndim < 2:
        return T.F32
    if quant == "q8_0":
        return T.Q8_0 if arr.shape[-1] % 32 == 0 else T.F16
    return {"float32": T.F32, "float16": T.F16, "bfloat16": T.BF16}[quant]


def round_trip(t: torch.Tensor, gguf, qtype) -> torch.Tensor:
    """``t`` as the engine holds it after storing it as ``qtype`` (float32)."""
    a = t.detach().float().cpu().numpy()
    q = gguf.quants.quantize(a, qtype)
    return torch.from_numpy(np.ascontiguousarray(gguf.quants.dequantize(q, qtype)))


class GGUFEagle3(VLLMEagle3):
    """EAGLE-3 / HASS heads for llama.cpp (``--spec-type draft-eagle3``)."""

    name, methods, description = "gguf", EAGLE3_LIKE, "EAGLE-3 GGUF for llama.cpp"
    weights_file = "draft.gguf"
    default_dtype = "q8_0"
    dtypes = QUANTS
    vllm_method = None  # llama.cpp's; vLLM does not read GGUF drafts
    omits_identity = False  # llama.cpp's converter writes d2t for every EAGLE-3 head
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
        self._source(draft, target_gguf_path)  # refused here, before anything is written
        return None

    @staticmethod
    def _source(draft, given) -> Path:
        """The target's GGUF, which the draft takes its tokenizer from."""
        try:
            src = target_gguf(draft.target, given)
        except TargetError as e:
            raise ExportError(str(e)) from None
        if src is None:
            raise ExportError(
                f"--format gguf copies the tokenizer from the target's own GGUF (the file "
                f"llama.cpp serves as the target); pass --target-gguf <file> for "
                f"{draft.target.identity} (an HF target converts with llama.cpp's "
                "convert_hf_to_gguf.py)"
            )
        return src

    def config(self, draft, dtype, target_gguf_path=None, **_: Any) -> dict[str, Any]:
        """config.json beside the GGUF: what the folder is (everything llama.cpp needs is in
        the GGUF itself) and the target GGUF ``save`` copies the tokenizer from."""
        return {
            "format": "gguf",
            "architecture": "eagle3",
            "file": self.weights_file,
            "method": draft.cfg.name,
            "target_identity": draft.target.identity,
            "target_gguf": str(self._source(draft, target_gguf_path)),
            "target_layers": list(draft.cfg.fuse_layers),
            "draft_vocab_size": draft.cfg.draft_vocab_size,
        }

    def save(self, tmp: Path, tensors: dict[str, torch.Tensor], config: dict, draft, quant: str):
        gguf = _gguf()
        tc = draft.target.config
        src_path = Path(config["target_gguf"])
        src = gguf.GGUFReader(str(src_path))
        check_target_gguf(src, src_path, tc)
        heads = tc.num_attention_heads
        kv = getattr(tc, "num_key_value_heads", None) or heads
        H = tc.hidden_size
        hd = getattr(tc, "head_dim", None) or H // heads
        rope = dict(getattr(tc, "rope_parameters", None) or {})
        theta = rope.get("rope_theta", getattr(tc, "rope_theta", 10000.0))
        w = gguf.GGUFWriter(str(tmp / self.weights_file), "eagle3")
        w.add_type(gguf.GGUFType.MODEL)
        w.add_name(f"specdraft {draft.cfg.name} draft for {draft.target.identity}")
        w.add_context_length(int(getattr(tc, "max_position_embeddings", 8192)))
        w.add_embedding_length(H)
        w.add_block_count(1)
        w.add_feed_forward_length(tc.intermediate_size)
        w.add_head_count(heads)
        w.add_head_count_kv(kv)
        w.add_rope_freq_base(float(theta))
        w.add_layer_norm_rms_eps(float(getattr(tc, "rms_norm_eps", 1e-6)))
        w.add_file_type(FILE_TYPE[quant])
        w.add_vocab_size(tc.vocab_size)
        w.add_rope_dimension_count(hd)
        w.add_key_length(hd)
        w.add_value_length(hd)
        w.add_array("eagle3.target_layers", [int(i) for i in draft.cfg.fuse_layers])
        w.add_uint32("eagle3.target_hidden_size", H)
        w.add_bool("eagle3.norm_before_residual", bool(draft.cfg.norm_before_residual))
        w.add_bool("eagle3.norm_before_fc", False)
        w.add_quantization_version(gguf.GGML_QUANT_VERSION)
        copy_tokenizer(src, w, gguf)
        for name, t in tensors.items():
            if name == "t2d":
                continue
            if name == "d2t":
                ids = t.to(torch.int64) + torch.arange(t.numel())  # offsets -> absolute ids
                w.add_tensor("d2t", ids.numpy(), raw_dtype=gguf.GGMLQuantizationType.I64)
                continue
            if name not in NAMES:
                raise ExportError(f"{name}: no place for it in llama.cpp's eagle3 layout")
            if name.endswith("q_proj.weight"):
                t = permute(t, heads)
            elif name.endswith("k_proj.weight"):
                t = permute(t, kv)
            arr = t.detach().float().cpu().numpy()
            qt = _qtype(gguf, quant, arr)
            if qt == gguf.GGMLQuantizationType.F32:
                w.add_tensor(NAMES[name], arr)
            else:
                w.add_tensor(NAMES[name], gguf.quants.quantize(arr, qt), raw_dtype=qt)
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()

    def torch_dtype(self, dtype: str) -> torch.dtype:
        # ``save`` stores the types itself, from float32; llama.cpp computes in float32
        return torch.float32

    def reference(self, draft, quant: str):
        """The trained head with every weight rounded as ``save`` stores it: what the engine
        (and ``read``) holds."""
        gguf = _gguf()
        ref = draft.export_view(torch.float32)
        state = ref.state_dict()
        # blocks of a quantized type run along a row, and the q/k permutation only reorders
        # rows: rounding before or after it is the same
        for name, p in self.tensors(draft, torch.float32).items():
            if name in ("d2t", "t2d") or p.ndim < 2:
                continue
            qt = _qtype(gguf, quant, p.numpy())
            if qt != gguf.GGMLQuantizationType.F32:
                state[name] = round_trip(p, gguf, qt)
        ref.load_state_dict(state)
        return ref.eval()

    # -- reading ---------------------------------------------------------------------------

    def load(self, path: Path, config: dict | None = None) -> dict[str, torch.Tensor]:
        """The GGUF's tensors under their HF (vLLM layout) names, dequantized to float32, q/k
        rows in transformers' order, ``d2t`` as offsets and ``t2d`` rebuilt."""
        gguf = _gguf()
        if not path.exists():
            raise ExportError(f"{path}: missing")
        try:
            r = gguf.GGUFReader(str(path))
        except Exception as e:
            raise ExportError(f"{path}: not a readable GGUF ({type(e).__name__}: {e})") from None
        arch = _field(r, "general.architecture")
        if arch != "eagle3":
            raise ExportError(f"{path}: general.architecture={arch!r}, expected 'eagle3'")
        heads = int(_field(r, "eagle3.attention.head_count"))
        kv = int(_field(r, "eagle3.attention.head_count_kv") or heads)
        V = int(_field(r, "eagle3.vocab_size"))
        back = {v: k for k, v in NAMES.items()}
        out: dict[str, torch.Tensor] = {}
        for t in r.tensors:
            if t.name == "d2t":
                ids = torch.from_numpy(np.array(t.data, dtype=np.int64)).reshape(-1)
                out["d2t"] = ids - torch.arange(ids.numel())
                t2d = torch.zeros(V, dtype=torch.bool)
                if ids.numel() and (ids.min() < 0 or ids.max() >= V):
                    raise ExportError(f"{path}: d2t holds target ids outside 0..{V - 1}")
                t2d[ids] = True
                out["t2d"] = t2d
                continue
            if t.name not in back:
                raise ExportError(f"{path}: unexpected tensor {t.name}")
            shape = tuple(int(n) for n in reversed(t.shape))  # GGUF lists ne0 first
            arr = gguf.quants.dequantize(t.data, t.tensor_type).reshape(shape)
            x = torch.from_numpy(np.array(arr, dtype=np.float32))  # a writable copy
            name = back[t.name]
            if name.endswith("q_proj.weight"):
                x = unpermute(x, heads)
            elif name.endswith("k_proj.weight"):
                x = unpermute(x, kv)
            out[name] = x
        return out

    def read_config(self, folder: Path) -> dict[str, Any]:
        """The settings the GGUF itself holds, in the vLLM config's words (what ``expected``,
        ``check`` and ``read`` look at); a GGUF folder needs no config.json."""
        gguf = _gguf()
        path = folder / self.weights_file
        r = gguf.GGUFReader(str(path))
        d2t = next((t for t in r.tensors if t.name == "d2t"), None)
        return {
            "hidden_size": int(_field(r, "eagle3.embedding_length")),
            "intermediate_size": int(_field(r, "eagle3.feed_forward_length")),
            "num_attention_heads": int(_field(r, "eagle3.attention.head_count")),
            "num_hidden_layers": int(_field(r, "eagle3.block_count")),
            "vocab_size": int(_field(r, "eagle3.vocab_size")),
            "draft_vocab_size": int(d2t.n_elements) if d2t is not None else None,
            "eagle_aux_hidden_state_layer_ids": [int(i) for i in _field(r, "eagle3.target_layers")],
            "norm_before_residual": bool(_field(r, "eagle3.norm_before_residual") or False),
            "attention_bias": False,
            "mlp_bias": False,
        }

    def detect(self, folder: Path, config: dict) -> bool:
        return (folder / self.weights_file).exists() and config.get("format") == "gguf"

    def readme_lines(self, draft, config: dict) -> list[str]:
        return [
            *super().readme_lines(draft, config),
            f"- llama.cpp target: `{config['target_gguf']}` (the tokenizer was copied from it)",
        ]


def _field(r, key: str):
    f = r.fields.get(key)
    return None if f is None else f.contents()


def check_target_gguf(r, path: Path, tc) -> None:
    """The target GGUF must be the target the head was trained for (same shape)."""
    arch = _field(r, "general.architecture")
    for key, want in (
        ("embedding_length", tc.hidden_size),
        ("block_count", tc.num_hidden_layers),
    ):
        got = _field(r, f"{arch}.{key}")
        if got is not None and int(got) != int(want):
            raise ExportError(
                f"{path}: {arch}.{key}={got}, but the head's target has {want}: this GGUF is "
                "not the target the head was trained for"
            )
    toks = r.fields.get("tokenizer.ggml.tokens")
    if toks is None:
        raise ExportError(f"{path}: holds no tokenizer (tokenizer.ggml.tokens)")
    if len(toks.data) != tc.vocab_size:
        raise ExportError(
            f"{path}: its tokenizer has {len(toks.data)} tokens, the head's target {tc.vocab_size}"
        )


def copy_tokenizer(r, w, gguf) -> None:
    """Every ``tokenizer.*`` key of the target's GGUF, with its type, into the draft's."""
    VT = gguf.GGUFValueType
    for key, f in r.fields.items():
        if not key.startswith("tokenizer."):
            continue
        vtype = VT(f.types[0])
        if vtype == VT.ARRAY:
            w.add_key_value(key, f.contents(), VT.ARRAY, sub_type=VT(f.types[-1]))
        else:
            w.add_key_value(key, f.contents(), vtype)
