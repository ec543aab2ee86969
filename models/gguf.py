"""What every GGUF draft layout shares (``models/eagle/gguf.py``: EAGLE-3 / HASS;
``models/dflash/gguf.py``: DFlash and DSpark): the ``gguf`` package, the tensor types a
``--dtype`` stores, the rounding a stored tensor goes through, the target GGUF a draft takes its
tokenizer from, and reading fields back.

A GGUF draft is written directly with the ``gguf`` package (no llama.cpp source tree is needed
to export); ``tests/test_engine.py`` compares each layout with what llama.cpp's own
``convert_hf_to_gguf.py`` writes for the same head.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from .base import ExportError
from .gguf_reader import read_gguf
from .target import TargetError, full_attention_rope, target_gguf

# what --dtype means for a GGUF draft: the type of its 2-D weights
QUANTS = ("q8_0", "float16", "bfloat16", "float32")
FILE_TYPE = {"float32": 0, "float16": 1, "q8_0": 7, "bfloat16": 32}  # llama_ftype


def gguf_module():
    try:
        import gguf
    except ImportError:  # pragma: no cover - a declared dependency
        raise ExportError("--format gguf needs the gguf package: pip install gguf") from None
    return gguf


def qtype(gguf, quant: str, arr: np.ndarray):
    """The GGML type a tensor is stored in: 1-D tensors float32 (as the converter keeps norms),
    2-D weights in ``quant`` (q8_0 needs rows that are whole 32-value blocks)."""
    T = gguf.GGMLQuantizationType
    if arr.ndim < 2:
        return T.F32
    if quant == "q8_0":
        return T.Q8_0 if arr.shape[-1] % 32 == 0 else T.F16
    return {"float32": T.F32, "float16": T.F16, "bfloat16": T.BF16}[quant]


def round_trip(t: torch.Tensor, gguf, qt) -> torch.Tensor:
    """``t`` as the engine holds it after storing it as ``qt`` (float32)."""
    a = t.detach().float().cpu().numpy()
    q = gguf.quants.quantize(a, qt)
    return torch.from_numpy(np.ascontiguousarray(gguf.quants.dequantize(q, qt)))


def add_weight(w, gguf, name: str, t: torch.Tensor, quant: str) -> None:
    """Store ``t`` under ``name`` in the type ``quant`` gives it (``qtype``)."""
    arr = t.detach().float().cpu().numpy()
    qt = qtype(gguf, quant, arr)
    if qt == gguf.GGMLQuantizationType.F32:
        w.add_tensor(name, arr)
    else:
        w.add_tensor(name, gguf.quants.quantize(arr, qt), raw_dtype=qt)


def read_weight(gguf, t) -> torch.Tensor:
    """A GGUF tensor as float32 in torch's shape (GGUF lists ne0 first)."""
    shape = tuple(int(n) for n in reversed(t.shape))
    arr = gguf.quants.dequantize(t.data, t.tensor_type).reshape(shape)
    return torch.from_numpy(np.array(arr, dtype=np.float32))  # a writable copy


def rounded_state(draft, names: dict[str, torch.Tensor], quant: str) -> dict[str, torch.Tensor]:
    """``names`` (state-dict name -> float32 tensor) rounded as ``add_weight`` stores them."""
    gguf = gguf_module()
    out = {}
    for name, p in names.items():
        if p.ndim < 2 or not p.is_floating_point():
            continue
        qt = qtype(gguf, quant, p.numpy())
        if qt != gguf.GGMLQuantizationType.F32:
            out[name] = round_trip(p, gguf, qt)
    return out


def field(r, key: str):
    f = r.fields.get(key)
    return None if f is None else f.contents()


def read(path: str | Path, error: type[Exception] = ExportError):
    """The GGUF at ``path`` (``models/gguf_reader.py``); a file that is not one is one
    ``error`` line naming it."""
    gguf_module()  # the package (its tensor types), or one clear line
    try:
        return read_gguf(path)
    except Exception as e:  # noqa: BLE001 - any unreadable file is one line
        raise error(f"{path}: not a readable GGUF ({type(e).__name__}: {e})") from None


def open_gguf(path: Path, arch: str):
    """A GGUF reader for ``path``, which must hold a ``general.architecture = arch`` model."""
    if not path.exists():
        raise ExportError(f"{path}: missing")
    r = read(path)
    got = field(r, "general.architecture")
    if got != arch:
        raise ExportError(f"{path}: general.architecture={got!r}, expected {arch!r}")
    return r


def target_source(draft, given) -> Path:
    """The target's GGUF (the file llama.cpp serves as the target), which a GGUF draft copies
    its tokenizer from."""
    try:
        src = target_gguf(draft.target, given)
    except TargetError as e:
        raise ExportError(str(e)) from None
    if src is None:
        raise ExportError(
            f"--format gguf copies the tokenizer from the target's own GGUF (the file "
            f"llama.cpp serves as the target); pass --target-gguf <file> for "
            f"{draft.target.identity}, or install llama.cpp (bash scripts/install.sh engine) "
            "and specdraft-export converts the target with its convert_hf_to_gguf.py"
        )
    return src


def check_target_gguf(r, path: Path, tc) -> None:
    """The target GGUF must be the target the head was trained for (same shape)."""
    arch = field(r, "general.architecture")
    for key, want in (
        ("embedding_length", tc.hidden_size),
        ("block_count", tc.num_hidden_layers),
    ):
        got = field(r, f"{arch}.{key}")
        if got is not None and int(got) != int(want):
            raise ExportError(
                f"{path}: {arch}.{key}={got}, but the head's target has {want}: this GGUF is "
                "not the target the head was trained for"
            )
    toks = r.fields.get("tokenizer.ggml.tokens")
    if toks is None:
        raise ExportError(f"{path}: holds no tokenizer (tokenizer.ggml.tokens)")
    if (n := len(toks.contents())) != tc.vocab_size:
        raise ExportError(
            f"{path}: its tokenizer has {n} tokens, the head's target {tc.vocab_size}"
        )


def copy_tokenizer(r, w, gguf, skip: tuple[str, ...] = ()) -> None:
    """Every ``tokenizer.*`` key of the target's GGUF (but ``skip``), with its type, into the
    draft's."""
    VT = gguf.GGUFValueType
    for key, f in r.fields.items():
        if not key.startswith("tokenizer.") or key in skip:
            continue
        vtype = VT(f.types[0])
        if vtype == VT.ARRAY:
            w.add_key_value(key, f.contents(), VT.ARRAY, sub_type=VT(f.types[-1]))
        else:
            w.add_key_value(key, f.contents(), vtype)


def target_hparams(tc) -> dict[str, Any]:
    """The attention and RoPE settings of the target's config that a draft layer shares."""
    heads = tc.num_attention_heads
    H = tc.hidden_size
    rope = full_attention_rope(tc)
    return {
        "heads": heads,
        "kv": getattr(tc, "num_key_value_heads", None) or heads,
        "H": H,
        "head_dim": getattr(tc, "head_dim", None) or H // heads,
        "theta": float(rope.get("rope_theta", getattr(tc, "rope_theta", 10000.0))),
        "eps": float(getattr(tc, "rms_norm_eps", 1e-6)),
        "context": int(getattr(tc, "max_position_embeddings", 8192)),
    }


#: the RoPE scalings a GGUF draft holds, as llama.cpp's converter writes them: none,
#: Llama-3's (a ``rope_freqs`` tensor), YaRN and linear (``rope.scaling.*`` keys)
GGUF_ROPE = ("default", "llama3", "yarn", "linear")


def rope_scaling(tc) -> tuple[str, dict[str, Any]]:
    """(kind, parameters) of the RoPE the draft layers share with the target (its full
    attention layers'); a kind a GGUF draft cannot hold is refused by name."""
    rope = full_attention_rope(tc)
    legacy = (
        {}
        if getattr(tc, "rope_parameters", None)
        else dict(getattr(tc, "rope_scaling", None) or {})
    )
    rope.update(legacy)  # an older config's name for the scaling, with "type" for its kind
    kind = legacy.get("rope_type", legacy.get("type")) or rope.get("rope_type") or "default"
    rope["rope_type"] = kind
    if kind not in GGUF_ROPE:
        raise ExportError(
            f"the target's RoPE scaling is {kind!r}: llama.cpp GGUF drafts hold plain, "
            "Llama-3, YaRN or linear RoPE"
        )
    if kind == "yarn" and any(rope.get(k) for k in ("mscale", "mscale_all_dim")):
        raise ExportError(
            "the target's RoPE is DeepSeek-style YaRN (mscale / mscale_all_dim): llama.cpp "
            "GGUF drafts hold YaRN without them"
        )
    return kind, rope


def add_rope_scaling(w, gguf, tc) -> None:
    """The ``rope.scaling.*`` keys of a YaRN or linear RoPE, the ones llama.cpp's converter
    writes from the same parameters (factor, original context; YaRN's extrapolation and
    attention factors and betas where the config sets them). llama.cpp rounds YaRN's
    correction range outwards to whole dimensions, as transformers does unless the config
    says ``truncate: false`` (GPT-OSS): there a few dimensions' frequencies differ a little."""
    kind, rope = rope_scaling(tc)
    if kind == "linear":
        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(float(rope["factor"]))
    elif kind == "yarn":
        w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        w.add_rope_scaling_factor(float(rope["factor"]))
        w.add_rope_scaling_orig_ctx_len(int(rope["original_max_position_embeddings"]))
        if (v := rope.get("extrapolation_factor")) is not None:
            w.add_rope_scaling_yarn_ext_factor(float(v))
        if (v := rope.get("attention_factor", rope.get("attn_factor"))) is not None:
            w.add_rope_scaling_yarn_attn_factor(float(v))
        if (v := rope.get("beta_fast")) is not None:
            w.add_rope_scaling_yarn_beta_fast(float(v))
        if (v := rope.get("beta_slow")) is not None:
            w.add_rope_scaling_yarn_beta_slow(float(v))


def rope_factors(tc) -> torch.Tensor | None:
    """``rope_freqs.weight`` for a target with Llama-3 RoPE scaling (the divisor of each
    frequency, as llama.cpp's converter computes it for Llama targets and its eagle3 and
    dflash drafts read it), None for the others (YaRN and linear are keys,
    ``add_rope_scaling``); a scaling a GGUF cannot hold is refused by name."""
    import math

    kind, rope = rope_scaling(tc)
    if kind != "llama3":
        return None
    hp = target_hparams(tc)
    dim, base = hp["head_dim"], hp["theta"]
    freqs = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
    factor = float(rope.get("factor", 8.0))
    low, high = float(rope.get("low_freq_factor", 1.0)), float(rope.get("high_freq_factor", 4.0))
    old = float(rope.get("original_max_position_embeddings", 8192))
    out = []
    for f in freqs.tolist():
        wavelen = 2 * math.pi / f
        if wavelen < old / high:
            out.append(1.0)
        elif wavelen > old / low:
            out.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return torch.tensor(out, dtype=torch.float32)


def vocab_maps(path: Path, t, V: int) -> dict[str, torch.Tensor]:
    """A GGUF's ``d2t`` (absolute target ids) as our ``d2t`` (offsets) and ``t2d`` (mask)."""
    ids = torch.from_numpy(np.array(t.data, dtype=np.int64)).reshape(-1)
    if ids.numel() and (ids.min() < 0 or ids.max() >= V):
        raise ExportError(f"{path}: d2t holds target ids outside 0..{V - 1}")
    t2d = torch.zeros(V, dtype=torch.bool)
    t2d[ids] = True
    return {"d2t": ids - torch.arange(ids.numel()), "t2d": t2d}


def write_draft_gguf(
    path: Path,
    arch: str,
    draft,
    target_gguf_path: str | Path,
    quant: str,
    num_layers: int,
    keys: Callable[[Any], None],
    weights: dict[str, torch.Tensor],
    token_ids: dict[str, int] | None = None,
) -> None:
    """One draft GGUF: the hyper-parameters every llama.cpp draft reads (the target's sizes,
    RoPE and norm epsilon, ``num_layers`` blocks), the architecture's own ``keys(w)``, the
    target's tokenizer copied from its GGUF (checked to be the draft's target), its
    ``token_ids`` keys set to the draft's (uint32), ``rope_freqs`` where the target's RoPE is scaled, and
    ``weights`` (GGUF name -> tensor; ``d2t`` as our offsets, stored as absolute int64 ids)."""
    gguf = gguf_module()
    tc = draft.target.config
    src_path = Path(target_gguf_path)
    src = read(src_path)
    check_target_gguf(src, src_path, tc)
    hp = target_hparams(tc)
    w = gguf.GGUFWriter(str(path), arch)
    w.add_type(gguf.GGUFType.MODEL)
    w.add_name(f"specdraft {draft.cfg.name} draft for {draft.target.identity}")
    w.add_context_length(hp["context"])
    w.add_embedding_length(hp["H"])
    w.add_block_count(num_layers)
    w.add_feed_forward_length(tc.intermediate_size)
    w.add_head_count(hp["heads"])
    w.add_head_count_kv(hp["kv"])
    w.add_rope_freq_base(hp["theta"])
    add_rope_scaling(w, gguf, tc)
    w.add_layer_norm_rms_eps(hp["eps"])
    w.add_key_length(hp["head_dim"])
    w.add_value_length(hp["head_dim"])
    w.add_file_type(FILE_TYPE[quant])
    keys(w)
    w.add_quantization_version(gguf.GGML_QUANT_VERSION)
    token_ids = token_ids or {}
    copy_tokenizer(src, w, gguf, skip=tuple(token_ids))
    for key, value in token_ids.items():
        w.add_uint32(key, int(value))
    if (factors := rope_factors(tc)) is not None:
        w.add_tensor("rope_freqs.weight", factors.numpy())
    for name, t in weights.items():
        if name == "d2t":
            ids = t.to(torch.int64) + torch.arange(t.numel())  # offsets -> absolute ids
            w.add_tensor("d2t", ids.numpy(), raw_dtype=gguf.GGMLQuantizationType.I64)
        else:
            add_weight(w, gguf, name, t, quant)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def read_draft_gguf(
    path: Path, r, V: int, to_hf: Callable[[str, torch.Tensor], tuple[str, torch.Tensor] | None]
) -> dict[str, torch.Tensor]:
    """The draft GGUF's tensors (reader ``r``) under our names: ``to_hf(gguf name, float32
    tensor)`` gives (name, tensor), or None for a tensor the layout has no place for;
    ``d2t`` as offsets and ``t2d`` rebuilt; ``rope_freqs`` (the target's RoPE) left out."""
    gguf = gguf_module()
    out: dict[str, torch.Tensor] = {}
    for t in r.tensors:
        if t.name == "d2t":
            out.update(vocab_maps(path, t, V))
            continue
        if t.name == "rope_freqs.weight":
            continue
        got = to_hf(t.name, read_weight(gguf, t))
        if got is None:
            raise ExportError(f"{path}: unexpected tensor {t.name}")
        out[got[0]] = got[1]
    return out


class GGUFDraftFormat:
    """The storage half of a GGUF layout, mixed in before the safetensors layout it is built
    on (whose ``tensors`` names it maps): one ``draft.gguf``, weights rounded from float32 to
    ``--dtype`` (q8_0 by default), a small ``config.json`` beside it naming the target GGUF."""

    weights_file = "draft.gguf"
    default_dtype = "q8_0"
    dtypes = QUANTS
    vllm_method = None  # llama.cpp's; vLLM does not read GGUF drafts
    spec_type = ""  # llama-server's --spec-type for the layout

    def torch_dtype(self, dtype: str) -> torch.dtype:
        # ``save`` stores the types itself, from float32; llama.cpp computes in float32
        return torch.float32

    def stored_weights(self, draft, ref) -> dict[str, torch.Tensor]:
        """The float tensors of ``ref`` (the export view) that the GGUF stores, by its state
        names: all of them by default."""
        return {k: v.float().cpu() for k, v in ref.state_dict().items() if k not in ("d2t", "t2d")}

    def reference(self, draft, quant: str):
        """The trained draft with every weight rounded as ``save`` stores it: what the engine
        (and ``read``) holds."""
        ref = draft.export_view(torch.float32)
        state = ref.state_dict()
        state.update(rounded_state(draft, self.stored_weights(draft, ref), quant))
        ref.load_state_dict(state)
        return ref.eval()

    def detect(self, folder: Path, config: dict) -> bool:
        return (folder / self.weights_file).exists() and config.get("format") == self.name

    def readme_lines(self, draft, config: dict) -> list[str]:
        return [
            *super().readme_lines(draft, config),
            f"- llama.cpp target: `{config['target_gguf']}` (the tokenizer was copied from it)",
        ]
