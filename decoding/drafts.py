"""Turn a ``draft=...`` value into a proposer for the shared decoder.

none             plain autoregressive decoding (the baseline)
ngram            prompt lookup decoding (no model)
lookahead        lookahead decoding: Jacobi n-grams from the target itself (no model)
streaming        MagicDec self-speculation: the target over a StreamingLLM cache (no model)
truncate:N       the target's embedding + first N layers + head, untrained
<run dir>        a training run (its final/ draft)
<draft dir>      a saved draft (config.json with a "specdraft" key), e.g. final/ or
                 checkpoints/step_N/draft/ (a checkpoint folder works too)
<export dir>     an EAGLE checkpoint in a serving layout (``specdraft-export`` output or a
                 third-party one: SGLang/vLLM EAGLE-3, speculators, EAGLE-1 reference)
<HF model>       a causal LM folder or hub id with the target's tokenizer
<short name>     a draft shipped in the repository (``models/shipped``), e.g. smollm2-eagle3
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from models import METHODS
from models.base import (
    DecodeSettings,
    DraftError,
    ExportError,
    read_draft_config,
    resolve_draft_dir,
    unfinished_run,
)
from models.draft_lm import load_same_vocabulary_lm
from models.export import (
    check_saved_config,
    detect_format,
    import_draft,
    made_for,
    made_for_note,
    noted,
)
from models.quant import check_mode
from models.shipped import SHIPPED, shipped_draft
from models.target import Target, looks_like_a_path

from .decoder import NoDraft
from .lookahead import LookaheadProposer
from .proposers import DraftLMProposer, NGramProposer

#: ``draft=`` values that name no model (``truncate:N`` is the target's own layers)
NO_MODEL = ("none", "ar", "ngram", "pld", "lookahead", "streaming")

#: the evaluator settings a draft's saved ``decode`` section may set (and that, given on the
#: command line, turn it off)
DECODE_KEYS = ("tree", "depth", "top_k", "total_tokens", "min_prob", "gamma", "adaptive")


def machine_kind(device: torch.device) -> str:
    """The decode-settings key of this machine: ``cuda``, ``cpu_bf16`` (native bf16) or
    ``cpu_fp32``: the best settings differ between them (verification is ~free on a GPU and
    on bf16 CPUs, ~2 one-token steps on fp32 CPUs)."""
    from models.target import cpu_has_bf16

    if device.type == "cuda":
        return "cuda"
    return "cpu_bf16" if cpu_has_bf16() else "cpu_fp32"


def saved_decode_settings(spec: str, kind: str) -> dict | None:
    """The decode settings a saved draft carries for machines of ``kind`` (its config.json's
    ``decode`` section, measured when it was shipped), or None."""
    path = shipped_draft(spec) or Path(spec).expanduser()
    folder = resolve_draft_dir(path) if path.is_dir() else None
    if folder is None:
        return None
    found = read_draft_config(folder).get("decode", {}).get(kind)
    if found is None:
        return None
    bad = sorted(set(found) - set(DECODE_KEYS))
    if bad:
        raise DraftError(
            f"{folder / 'config.json'}: decode.{kind} has {bad}; it may set {list(DECODE_KEYS)}"
        )
    return dict(found)


def load_proposer(
    spec: str,
    target: Target,
    ngram_max: int = 3,
    tree: DecodeSettings | None = None,
    lookahead: tuple[int, int, int] = (5, 4, 5),
    streaming: tuple[int, int] = (4, 256),
):
    """Proposer and a short description for reports. ``tree``: how a trained draft proposes
    (chain, EAGLE-2 dynamic tree, Medusa static tree; see ``DecodeSettings``). ``lookahead``:
    lookahead decoding's (window W, n-gram size N, guesses G); ``streaming``: the streaming
    self-draft's (sinks, window)."""
    tree = tree or DecodeSettings()
    if tree.tree not in ("auto", "chain") and (spec in NO_MODEL or spec.startswith("truncate:")):
        raise DraftError(f"draft={spec}: tree={tree.tree} needs a trained draft (EAGLE or Medusa)")
    if tree.draft_weights == "int8" and (spec in NO_MODEL or spec.startswith("truncate:")):
        raise DraftError(f"draft={spec}: {_NO_INT8}")
    if spec in ("none", "ar"):
        return NoDraft(), "none (plain autoregressive decoding)"
    if spec in ("ngram", "pld"):
        return NGramProposer(max_ngram=ngram_max), f"ngram (prompt lookup, n <= {ngram_max})"
    if spec == "lookahead":
        w, n, g = lookahead
        try:
            prop = LookaheadProposer(window=w, ngram=n, guesses=g)
        except ValueError as e:
            raise DraftError(str(e)) from None
        return prop, f"lookahead (W={w}, N={n}, G={g})"
    if spec == "streaming":
        from .streaming import StreamingDraft

        try:
            prop = StreamingDraft(target, *streaming)
        except ValueError as e:
            raise DraftError(str(e)) from None
        return prop, prop.describe()
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
    shipped = shipped_draft(spec)
    if spec in SHIPPED and shipped is None:
        raise DraftError(f"draft={spec}: the shipped draft is missing from {SHIPPED[spec]}")
    path = shipped if shipped is not None else Path(spec).expanduser()
    if not path.exists() and looks_like_a_path(spec):
        raise DraftError(f"draft={spec}: no such folder")
    if path.is_file():
        raise DraftError(
            f"draft={spec}: a file; name the folder that holds it (a run, its final/ folder, a "
            "checkpoint, an export or an HF model)"
        )
    if path.exists():
        draft_dir = resolve_draft_dir(path)
        if draft_dir is not None:
            # its method, target section and settings, each named where missing or unknown
            method = check_saved_config(draft_dir, read_draft_config(draft_dir))
            note = made_for_note(made_for(draft_dir), target)
            if note:
                print(f"warning: {draft_dir}: {note}")
            head = METHODS[method].load_draft(draft_dir, target)
            return _head_proposer(head, tree, f"{method} ({draft_dir}" + noted(note) + ")")
        fmt = detect_format(path)
        if fmt is not None:  # an exported or third-party EAGLE checkpoint (serving layout)
            note = made_for_note(made_for(path), target)
            try:
                head = import_draft(path, target, fmt)
            except (ExportError, DraftError) as e:  # made for another target: say that first
                raise DraftError(
                    f"{path}: {note}; it does not fit ({e})" if note else str(e)
                ) from None
            if note:
                print(f"warning: {path}: {note}")
            return _head_proposer(
                head, tree, f"{head.cfg.name} ({path}, {fmt} layout" + noted(note) + ")"
            )
        if not (path / "config.json").exists():
            step = unfinished_run(path)
            if step is not None:
                raise DraftError(
                    f"draft={spec}: no final/ draft yet (the run did not finish); its newest "
                    f"checkpoint is {step}: pass draft=<that folder>"
                )
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
    if tree.draft_weights == "int8":
        raise DraftError(f"draft={spec}: a draft language model; {_NO_INT8}")
    return _hf_draft(spec, target)


#: draft_weights=int8 on a draft with no head to quantize
_NO_INT8 = (
    "draft_weights=int8 quantizes a trained head's layers (EAGLE family); this draft has none "
    "(use draft_weights=auto or full)"
)


def _head_proposer(head, tree: DecodeSettings, desc: str):
    # a draft decodes in its target's dtype (bf16 where the machine has it), whatever precision
    # its weights were trained or saved in
    dtype = head.target.dtype
    head = head.to(dtype=dtype)
    try:
        check_mode(tree.draft_weights)  # a method that does not opt in would ignore a bad value
    except ValueError as e:
        raise DraftError(str(e)) from None
    n = head.quantize_for_decoding(tree.draft_weights)
    if n:
        desc += f", int8 weights ({n} layers)"
    elif tree.draft_weights == "int8":
        raise DraftError(
            f"{desc}: draft_weights=int8, but no layer of this draft can take int8 weights "
            f"here ({type(head).__name__} on {head.target.device}, {dtype}: torch's int8 "
            "kernel runs on CPUs, and only EAGLE-family heads opt in); use draft_weights=full"
        )
    try:
        prop = head.proposer(tree)
    except ValueError as e:
        raise DraftError(f"{desc}: {e}") from None
    if prop.tree_depth is None:
        return prop, desc
    if tree.tree == "dynamic":
        args = ", ".join(f"{k}={getattr(tree, k)}" for k in ("depth", "top_k", "total_tokens"))
        if tree.min_prob > 0:
            args += f", min_prob={tree.min_prob:g}"
        return prop, f"{desc}, dynamic tree ({args})"
    return prop, f"{desc}, static tree ({len(prop.tree)} nodes, depth {prop.tree_depth})"


def check_draft_folder(spec: str) -> None:
    """``DraftError`` where ``draft=`` cannot name a draft: a folder that is not there, a shipped
    draft's name mistyped, or a hub id neither cached nor reachable. Said before the target
    loads (minutes for a large one), not after."""
    from models.shipped import shipped_draft
    from models.target import hub_unreachable, looks_like_a_path

    if spec in NO_MODEL or spec.startswith("truncate:") or spec in SHIPPED:
        return
    if shipped_draft(spec) is not None or Path(spec).expanduser().exists():
        return
    if looks_like_a_path(spec):
        raise DraftError(f"draft={spec}: no such folder")
    check_shipped_name(spec)
    why = hub_unreachable(spec)
    if why:
        raise DraftError(f"draft={spec}: {why}")


def check_shipped_name(spec: str) -> None:
    """``DraftError`` where ``draft=spec`` (not a folder here) is a shipped draft's name
    mistyped: said before the hub is asked for a model of that name."""
    import difflib

    near = difflib.get_close_matches(spec, list(SHIPPED), n=1, cutoff=0.8)
    if near and "/" not in spec and not Path(spec).expanduser().exists():
        raise DraftError(
            f"draft={spec}: no such folder, shipped draft or model; did you mean {near[0]}? "
            f"(shipped: {', '.join(sorted(SHIPPED))})"
        )


def _hf_draft(spec: str, target: Target):
    check_shipped_name(spec)
    model = load_same_vocabulary_lm(spec, target, f"draft={spec}")
    model = model.eval().requires_grad_(False)
    return DraftLMProposer(model, vocab_size=target.config.vocab_size), f"draft LM ({spec})"


def draft_model_of(proposer) -> torch.nn.Module | None:
    """The HF model behind a draft-LM proposer (for transformers' assisted generation)."""
    return proposer.model if isinstance(proposer, DraftLMProposer) else None


def standalone_lm(spec: str, target: Target) -> tuple[Path, str] | None:
    """(HF folder, description) when ``draft=spec`` names a standalone draft language model,
    which serving engines load as a draft model: a DistillSpec run or saved draft (its
    merged ``student/``), or a causal LM folder with the target's tokenizer. None for
    anything else (heads, exports, n-gram drafts). Refused in one line: an LM whose
    vocabulary is not the target's, a DistillSpec draft without its student. A hub id is
    fetched (or read from the hub's cache) into a local folder."""
    from models.distillspec.model import STUDENT_DIR

    if spec in NO_MODEL or spec.startswith("truncate:"):
        return None
    path = shipped_draft(spec) or Path(spec).expanduser()
    if not path.exists():
        if looks_like_a_path(spec) or spec.count("/") != 1:
            return None  # the caller says what is missing
        path = _hub_folder(spec)
    if not path.is_dir():
        return None
    draft_dir = resolve_draft_dir(path)
    if draft_dir is not None:
        if read_draft_config(draft_dir)["specdraft"].get("method") != "distillspec":
            return None
        student = draft_dir / STUDENT_DIR
        if not (student / "config.json").is_file():
            raise DraftError(
                f"{draft_dir}: a DistillSpec draft without its student ({STUDENT_DIR}/)"
            )
        return student, f"distillspec student ({draft_dir})"
    if detect_format(path) is not None or not (path / "config.json").is_file():
        return None
    try:
        config = json.loads((path / "config.json").read_text())
    except json.JSONDecodeError:
        raise DraftError(f"{path / 'config.json'}: not valid JSON") from None
    if not any(str(a).endswith("ForCausalLM") for a in config.get("architectures") or []):
        return None
    from transformers import AutoTokenizer

    from models.target import TargetError, check_same_vocabulary

    try:
        tok = AutoTokenizer.from_pretrained(str(path))
    except (OSError, ValueError) as e:
        raise DraftError(
            f"draft={spec}: no tokenizer in {path} ({str(e).splitlines()[0]})"
        ) from None
    try:
        check_same_vocabulary(target.tokenizer, tok, f"draft={spec}")
    except TargetError as e:
        raise DraftError(str(e)) from None
    return path, f"draft LM ({spec})"


def _hub_folder(repo_id: str, what: str = "draft") -> Path:
    """A hub model's local snapshot (downloaded, or from the hub's cache offline); ``what``:
    the setting that named it, for the error."""
    from huggingface_hub import snapshot_download

    from models.target import hub_unreachable

    why = hub_unreachable(repo_id)
    if why:
        raise DraftError(f"{what}={repo_id}: {why}")
    try:
        return Path(snapshot_download(repo_id))
    except Exception as e:  # offline, gated, missing: one line
        raise DraftError(
            f"{what}={repo_id}: no such folder, and not on the hub here ({type(e).__name__}: "
            f"{str(e).splitlines()[0] if str(e) else ''})"
        ) from None
