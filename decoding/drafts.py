"""Turn a ``draft=...`` value into a proposer for the shared decoder.

none             plain autoregressive decoding (the baseline)
ngram            prompt lookup decoding (no model)
truncate:N       the target's embedding + first N layers + head, untrained
<run dir>        a training run (its final/ draft)
<draft dir>      a saved draft (config.json with a "specdraft" key), e.g. final/ or
                 checkpoints/step_N/draft/ (a checkpoint folder works too)
<HF model>       a causal LM folder or hub id with the target's tokenizer
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from models import METHODS
from models.base import DraftError, read_draft_config
from models.target import Target

from .decoder import NoDraft
from .proposers import DraftLMProposer, NGramProposer


def resolve_draft_dir(path: Path) -> Path | None:
    """The saved-draft folder behind a run dir, checkpoint dir or draft dir; None if ``path``
    is none of those."""
    for cand in (path / "final", path / "draft", path):
        f = cand / "config.json"
        if f.exists():
            try:
                if "specdraft" in json.loads(f.read_text()):
                    return cand
            except json.JSONDecodeError:
                raise DraftError(f"{f}: not valid JSON") from None
    return None


def check_same_vocabulary(target_tok, draft_tok, where: str) -> None:
    """Draft and target must share one tokenizer; name the first token that differs."""
    tv, dv = target_tok.get_vocab(), draft_tok.get_vocab()
    if tv == dv:
        return
    t_by_id = {i: t for t, i in tv.items()}
    d_by_id = {i: t for t, i in dv.items()}
    for i in range(max(len(t_by_id), len(d_by_id))):
        if t_by_id.get(i) != d_by_id.get(i):
            raise DraftError(
                f"{where}: the draft's tokenizer differs from the target's at id {i} "
                f"(target {t_by_id.get(i)!r}, draft {d_by_id.get(i)!r}); speculative decoding "
                "needs one vocabulary"
            )


def load_proposer(spec: str, target: Target, ngram_max: int = 3):
    """Proposer and a short description for reports."""
    if spec in ("none", "ar"):
        return NoDraft(), "none (plain autoregressive decoding)"
    if spec in ("ngram", "pld"):
        return NGramProposer(max_ngram=ngram_max), f"ngram (prompt lookup, n <= {ngram_max})"
    if spec.startswith("truncate:"):
        try:
            n = int(spec.split(":", 1)[1])
        except ValueError:
            raise DraftError(
                f"draft={spec}: expected truncate:N with N a number of layers"
            ) from None
        return DraftLMProposer(
            target.truncated(n)
        ), f"truncate:{n} (untrained, target layers 0..{n - 1})"
    path = Path(spec).expanduser()
    if path.exists():
        draft_dir = resolve_draft_dir(path)
        if draft_dir is not None:
            cfg = read_draft_config(draft_dir)
            method = cfg["specdraft"].get("method")
            if method not in METHODS:
                raise DraftError(
                    f"{draft_dir}: unknown draft kind {method!r} (known: {sorted(METHODS)})"
                )
            trained_for = cfg.get("target", {}).get("identity")
            if trained_for and trained_for != target.identity:
                print(
                    f"warning: {draft_dir} was trained for target {trained_for}, "
                    f"evaluating against {target.identity}"
                )
            head = METHODS[method].load_draft(draft_dir, target)
            return head.proposer(), f"{method} ({draft_dir})"
        if not (path / "config.json").exists():
            raise DraftError(
                f"draft={spec}: a folder that is neither a run, a saved draft nor an "
                "HF model (no config.json)"
            )
        try:
            model_type = json.loads((path / "config.json").read_text()).get("model_type")
        except json.JSONDecodeError:
            raise DraftError(f"{path / 'config.json'}: not valid JSON") from None
        if not model_type:
            raise DraftError(
                f"{path}: unknown checkpoint kind (config.json has neither "
                "'specdraft' nor 'model_type')"
            )
    return _hf_draft(spec, target)


def _hf_draft(spec: str, target: Target):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    try:
        tok = AutoTokenizer.from_pretrained(spec)
        model = AutoModelForCausalLM.from_pretrained(spec, dtype=target.dtype)
    except OSError as e:
        raise DraftError(
            f"draft={spec}: cannot load as an HF model ({str(e).splitlines()[0]})"
        ) from None
    check_same_vocabulary(target.tokenizer, tok, f"draft={spec}")
    model = model.to(target.device).eval().requires_grad_(False)
    return DraftLMProposer(model, vocab_size=target.config.vocab_size), f"draft LM ({spec})"


def draft_model_of(proposer) -> torch.nn.Module | None:
    """The HF model behind a draft-LM proposer (for transformers' assisted generation)."""
    return getattr(proposer, "model", None) if isinstance(proposer, DraftLMProposer) else None
