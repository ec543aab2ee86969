"""What ``draft=`` becomes for llama.cpp: a GGUF and the speculative type llama-server runs it
with.

- ``draft=ngram``: llama.cpp's own n-gram speculation (``engine_ngram``), no model.
- an EAGLE-3/HASS, DFlash or DSpark run, saved draft or shipped name: exported once with
  ``specdraft-export --format gguf`` (checked, read back; cached under ``engine-drafts``).
- a standalone draft language model (a DistillSpec run's student, or any causal LM folder or
  hub id with the target's tokenizer): converted once by llama.cpp's own
  ``convert_hf_to_gguf.py`` (q8_0, cached) and served as a draft model (``draft-simple``).
- a ``.gguf`` file, or a folder holding ``draft.gguf``: used as it is.

The speculative type of a GGUF is read from the file, as llama.cpp decides it (``gguf_kind``).
"""

from __future__ import annotations

from pathlib import Path

from omegaconf import DictConfig

from models.base import DraftError

from .base import EngineError, cached_export, engine_draft_dir
from .llama_cpp import convert_hf

NGRAM_TYPES = ("ngram-simple", "ngram-mod", "ngram-map-k", "ngram-map-k4v", "ngram-cache")


def draft_gguf(
    cfg: DictConfig, target, log, target_gguf: Path | None = None
) -> tuple[str, Path | None, str, int | None]:
    """(spec type, draft GGUF or None, description, the draft's block size or None) for
    ``cfg.draft``; ``target_gguf``: the target's GGUF the server loads (a head's GGUF copies
    its tokenizer; default ``cfg.target_gguf``). A draft made for another target's weights is
    run with a warning, kept in its description."""
    from models.export import made_for, made_for_note, noted
    from models.shipped import shipped_draft

    kind, gguf, desc, block = _draft_gguf(cfg, target, log, target_gguf)
    p = shipped_draft(str(cfg.draft)) or Path(str(cfg.draft)).expanduser()
    note = made_for_note(made_for(p if p.is_dir() else p.parent), target) if gguf else None
    if note:
        log(f"warning: {p}: {note}")
        desc += noted(note)
    return kind, gguf, desc, block


def _draft_gguf(cfg: DictConfig, target, log, target_gguf: Path | None):
    from models.export import formats, load_trained_head, resolve_format
    from models.shipped import shipped_draft

    from ..drafts import standalone_lm

    d = str(cfg.draft)
    if d in ("none", "ar"):
        raise EngineError("engine=llama.cpp compares a draft with plain decoding: set draft=")
    if d in ("ngram", "pld"):
        kind = cfg.engine_ngram
        if kind not in NGRAM_TYPES:
            raise EngineError(f"engine_ngram={kind!r}: use one of {', '.join(NGRAM_TYPES)}")
        return kind, None, f"llama.cpp {kind} (n-gram speculation, no model)", None
    p = shipped_draft(d) or Path(d).expanduser()
    if p.is_file() and p.suffix == ".gguf":
        return _described(p, p)
    if (p / "draft.gguf").is_file():
        return _described(p / "draft.gguf", p / "draft.gguf")
    lm = standalone_lm(d, target)
    if lm is not None:  # a draft model: llama.cpp's draft-simple
        folder, desc = lm
        return "draft-simple", lm_gguf(folder, log), f"{desc} as GGUF q8_0", None
    if not p.exists():
        raise DraftError(f"draft={d}: no such file or folder")
    # a trained head: export it once (checked, re-imported) and cache the GGUF
    head = load_trained_head(p, target)
    fmt = resolve_format("gguf", head.cfg.name)
    if head.cfg.name not in formats()[fmt].methods:
        raise DraftError(
            f"draft={d}: a {head.cfg.name} draft; llama.cpp runs EAGLE-3/HASS, DFlash and "
            "DSpark drafts (--format gguf), draft language models (DistillSpec students, any "
            "causal LM with the target's tokenizer) and n-gram speculation (draft=ngram)"
        )
    suffix = "" if fmt == "gguf" else f"-{fmt}"
    tg = target_gguf or cfg.target_gguf
    out = cached_export(p, head, fmt, log, suffix, target_gguf_path=tg)
    kind, block = gguf_kind(out / "draft.gguf")
    return kind, out / "draft.gguf", f"{head.cfg.name} ({p}) as GGUF q8_0", block


def lm_gguf(folder: Path, log) -> Path:
    """The causal LM at ``folder`` (an HF folder with its tokenizer) as a GGUF: llama.cpp's
    converter, q8_0, once, cached under ``engine-drafts`` (``engine_draft_dir``)."""
    gguf = engine_draft_dir(folder, "-lm") / "draft.gguf"
    if not gguf.is_file():
        convert_hf(folder, gguf, "q8_0", log)
    return gguf


def _described(path: Path, shown: Path) -> tuple[str, Path, str, int | None]:
    kind, block = gguf_kind(path)
    return kind, path, f"{kind.removeprefix('draft-')} GGUF ({shown})", block


def gguf_kind(path: Path) -> tuple[str, int | None]:
    """(llama-server's --spec-type, block size or None) of the draft GGUF at ``path``: from
    its architecture (eagle3, dflash, or any language model: a standalone draft) and, for
    dflash, whether it holds DSpark's Markov head (as llama.cpp itself decides)."""
    from models.gguf import field, read

    r = read(path, DraftError)
    arch = field(r, "general.architecture")
    if arch == "eagle3":
        return "draft-eagle3", None
    if arch == "dflash":
        dspark = any(t.name == "markov_w1.weight" for t in r.tensors)
        return ("draft-dspark" if dspark else "draft-dflash"), int(
            field(r, "dflash.block_size") or 16
        )
    if arch and "tokenizer.ggml.tokens" in r.fields:  # a whole LM: a standalone draft model
        return "draft-simple", None
    raise DraftError(
        f"{path}: general.architecture={arch!r} and no tokenizer: not a draft llama.cpp serves "
        "(eagle3 or dflash GGUFs, or a language model with its tokenizer)"
    )
