"""The MLP speculator's serving layout, driven by the generic pipeline in ``models/export.py``.

``mlp_speculator``  what vLLM (``MLPSpeculator``, ``model_type: mlp_speculator``) and TGI load:
                    ``model.safetensors`` with ``emb.i.weight`` (V, D), ``proj.i.weight``
                    (D, H for stage 0, else D, D), ``head.i.weight`` (V, D), ``ln.i.weight`` /
                    ``ln.i.bias`` (D); with ``tie_weights`` only stage 0's (and ``proj.1``), as
                    the loaders' shared modules name them. Config keys ``emb_dim``,
                    ``inner_dim``, ``n_predict``, ``top_k_tokens_per_head``, ``n_candidates``,
                    ``vocab_size``, ``tie_weights``, ``scale_input`` (vLLM's
                    ``MLPSpeculatorConfig``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from ..base import DraftError, ExportError, ExportFormat
from ..export import cast, load_tensors
from .config import MLPSpeculatorConfig
from .model import MLPSpeculator


def _names(n: int, tied: bool) -> list[tuple[str, str]]:
    """(kind, index) of every stored parameter group: one per stage, or stage 0 (and the tied
    projection) only."""
    stages = range(1 if tied else n)
    out = [(k, str(i)) for k in ("emb", "head", "ln") for i in stages]
    out += [("proj", str(i)) for i in (range(min(2, n)) if tied else range(n))]
    return out


class MLPSpeculatorFormat(ExportFormat):
    name = "mlp_speculator"
    methods = ("mlp_speculator",)
    weights_file = "model.safetensors"
    description = "MLP speculator (vLLM, TGI)"
    # vLLM 0.32 no longer registers MLPSpeculatorPreTrainedModel (tests/test_vllm.py pins its
    # message); TGI and earlier vLLM releases load this layout
    serve_hint = "TGI, and vLLM releases that register MLPSpeculator: this dir as the model"

    def extra(self, draft, tmp: Path, dtype, merge: bool = False, **_: Any) -> None:
        if merge:
            raise ExportError("--merge is for Medusa-2 drafts (a LoRA-adapted backbone)")
        return None

    def tensors(self, draft: MLPSpeculator, dtype: torch.dtype) -> dict[str, torch.Tensor]:
        return cast(draft.own_state(), dtype)

    def config(self, draft: MLPSpeculator, dtype: torch.dtype, **_: Any) -> dict[str, Any]:
        c, tc = draft.cfg, draft.target.config
        n = c.n_predict
        top_k = list(c.top_k_tokens_per_head or [max(1, 5 - i) for i in range(n)])
        if len(top_k) != n:
            raise ExportError(
                f"method.top_k_tokens_per_head={top_k}: needs one entry per stage ({n})"
            )
        return {
            "architectures": ["MLPSpeculatorPreTrainedModel"],
            "model_type": "mlp_speculator",
            "emb_dim": tc.hidden_size,
            "inner_dim": c.inner_dim,
            "n_predict": n,
            "top_k_tokens_per_head": top_k,
            "n_candidates": c.n_candidates,
            "vocab_size": tc.vocab_size,
            "tie_weights": c.tie_weights,
            "scale_input": c.scale_input,
            "torch_dtype": str(dtype).removeprefix("torch."),
        }

    def expected(self, config: dict, target_config: Any) -> dict[str, tuple]:
        H, V = target_config.hidden_size, target_config.vocab_size
        D = config.get("inner_dim") or H
        want: dict[str, tuple] = {}
        for kind, i in _names(int(config["n_predict"]), bool(config.get("tie_weights"))):
            if kind == "emb":
                want[f"emb.{i}.weight"] = (V, D)
            elif kind == "head":
                want[f"head.{i}.weight"] = (V, D)
            elif kind == "ln":
                want[f"ln.{i}.weight"] = want[f"ln.{i}.bias"] = (D,)
            else:
                want[f"proj.{i}.weight"] = (D, H if i == "0" else D)
        return want

    def check(self, path: Path, tensors: dict, config: dict, draft) -> None:
        f = path.parent / "config.json"
        tc = draft.target.config
        if (config.get("emb_dim"), config.get("vocab_size")) != (tc.hidden_size, tc.vocab_size):
            raise ExportError(
                f"{f}: emb_dim={config.get('emb_dim')}, vocab_size={config.get('vocab_size')}; "
                f"the target has {tc.hidden_size}, {tc.vocab_size}"
            )
        if len(config.get("top_k_tokens_per_head") or []) != config.get("n_predict"):
            raise ExportError(f"{f}: top_k_tokens_per_head needs n_predict entries")

    def read(self, folder: Path, target, config: dict) -> MLPSpeculator:
        keys = ("n_predict", "inner_dim", "tie_weights", "scale_input")
        if not isinstance(config.get("n_predict"), int):
            raise ExportError(f"{folder / 'config.json'}: needs n_predict")
        cfg = MLPSpeculatorConfig(
            **{k: config[k] for k in keys if k in config},
            top_k_tokens_per_head=config.get("top_k_tokens_per_head"),
            n_candidates=config.get("n_candidates", 5),
        )
        tensors = load_tensors(folder / self.weights_file)
        # TGI-style checkpoints prefix the names with "speculator." (vLLM strips it too)
        tensors = {k.removeprefix("speculator."): v for k, v in tensors.items()}
        try:
            model = MLPSpeculator(target, cfg)
            model.load_own_state(tensors, folder / self.weights_file)
        except DraftError as e:
            raise ExportError(str(e)) from None
        return model

    def detect(self, folder: Path, config: dict) -> bool:
        return config.get("model_type") == "mlp_speculator"

    def readme_lines(self, draft, config: dict) -> list[str]:
        c = draft.cfg
        return [
            f"- {c.n_predict} stages, inner dimension {config['inner_dim'] or config['emb_dim']}, "
            f"tie_weights={c.tie_weights}, scale_input={c.scale_input}"
        ]


FORMATS = (MLPSpeculatorFormat(),)
