"""``specdraft-export``: a trained draft in a layout serving engines load.

    specdraft-export runs/eagle3-x --format sglang            # -> runs/eagle3-x/export-sglang
    specdraft-export runs/eagle3-x --format vllm --out /models/my-eagle3 --dtype bfloat16
    specdraft-export runs/medusa2-x --format medusa --merge
    specdraft-export runs/eagle3-x --format gguf              # llama.cpp: beside the target's GGUF

The command over the export pipeline (``models/export.py``, which writes, checks and reads back
every layout): its arguments, the draft it names, where the export goes, and for llama.cpp's
GGUF the target's file, converted by llama.cpp's own converter where none is given. That needs
the engine, so it lives here, on the floor above both, not in ``models/``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from models.base import DraftError, ExportError
from models.export import (
    check_method,
    check_out,
    default_out,
    export,
    formats,
    load_trained_head,
    replaced_by_training,
)
from models.target import Target


def cli_target_gguf(target: Target) -> Path | None:
    """``--format gguf`` without ``--target-gguf``: the embedded target's packaged GGUF; for any
    other target, where llama.cpp is installed, the target converted once by llama.cpp's own
    converter in its dtype (cached; the file to serve as the target beside the draft, the same
    one ``specdraft-eval engine=llama.cpp`` converts and serves); else None, and the export
    says what to pass. The engine is imported here only, by the command, so that this module's
    export pipeline (models/export.py) never depends on an engine being present."""
    from models.target import target_gguf

    known = target_gguf(target)
    if known is not None:
        return known
    from decoding.engines.llama_cpp import EngineError, converted_target, engine_source

    if engine_source() is None:
        return None
    try:
        out = converted_target(target, log=print)
    except EngineError as e:
        raise ExportError(f"{e}; or pass --target-gguf <file>") from None
    print(f"target GGUF (llama.cpp's conversion of {target.identity}): {out}")
    return out


def warn_if_unfed(target_gguf_path, draft_gguf: Path) -> None:
    """Every GGUF draft (EAGLE-3, DFlash, DSpark) reads the target's layer inputs, which
    llama.cpp records for some architectures only: say so where the target's is not one (the
    file is right; the engine would abort at its first draft). The draft's kind is read from
    the written file, as the evaluator reads it."""
    from decoding.engines.llama_cpp import EngineError, check_feature_target
    from decoding.engines.llama_cpp_drafts import gguf_kind

    try:
        check_feature_target(target_gguf_path, gguf_kind(draft_gguf)[0])
    except EngineError as e:
        print(f"warning: {e}", file=sys.stderr)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(
        prog="specdraft-export",
        description="Export a trained draft in a layout serving engines load, checked and "
        "re-imported before it is written.",
    )
    ap.add_argument("draft", help="a training run dir, its final/ folder or a checkpoint")
    ap.add_argument("--format", required=True, choices=sorted(formats()))
    ap.add_argument(
        "--out",
        help="output folder (default: <run>/export-<format>; for a checkpoint "
        "<run>/export-<format>-step_N)",
    )
    ap.add_argument(
        "--dtype",
        choices=sorted({d for f in formats().values() for d in f.dtypes}),
        help="weights' type (default: bfloat16; gguf: q8_0, the fastest on a CPU)",
    )
    ap.add_argument(
        "--target-gguf",
        help="gguf: the target's GGUF (llama.cpp serves it; the draft copies its tokenizer); "
        "default: the embedded SmolLM2's packaged file, or any other target converted once by "
        "llama.cpp's converter where llama.cpp is installed (cached)",
    )
    ap.add_argument(
        "--gamma",
        type=int,
        default=3,
        help="draft tokens a step in the printed serve lines (and speculators: speculative_tokens)",
    )
    ap.add_argument(
        "--target",
        help="the target's HF folder or hub id, where it is no longer where the draft's "
        "config.json says (moved, or trained on another machine); its weights must be the same",
    )
    ap.add_argument(
        "--force", action="store_true", help="replace --out where it holds an earlier export"
    )
    ap.add_argument(
        "--merge", action="store_true", help="Medusa-2: write the adapter-merged model in base/"
    )
    a = ap.parse_args(argv)
    from models.shipped import SHIPPED, shipped_draft
    from models.target import TargetError

    # a shipped draft by its short name, as specdraft-eval takes it; ``~`` expanded in every
    # path (--out=~/x and the like reach us as typed: no shell expands them)
    draft = shipped_draft(a.draft) or Path(a.draft).expanduser()
    out = a.out or a.draft
    try:
        if a.gamma < 1:
            raise ExportError(f"--gamma {a.gamma}: must be >= 1 (draft tokens a step)")
        if not a.out and draft.resolve() in {d.resolve() for d in SHIPPED.values()}:
            raise ExportError(
                f"{a.draft}: a draft shipped with specdraft, whose folder is part of the "
                "package: pass --out <folder> for its export"
            )
        head = load_trained_head(draft, target_path=a.target)
        fmt = check_method(a.format, head)
        out = str(Path(a.out).expanduser()) if a.out else str(default_out(draft, fmt))
        src, dest = draft.resolve(), Path(out).resolve()
        if dest == src or dest in src.parents:
            raise ExportError(f"--out {out}: holds the draft being exported ({a.draft})")
        kept_by = replaced_by_training(dest)
        if kept_by is not None:
            raise ExportError(
                f"--out {out}: inside {kept_by}, which training replaces (final/ on a resumed "
                "run, checkpoints as they are pruned) and the export with it; choose a folder "
                "beside it"
            )
        check_out(Path(out), a.force)  # before a target is converted for --format gguf
        is_gguf = "gguf" in (fmt, formats()[fmt].family)
        if a.target_gguf and not is_gguf:
            raise ExportError("--target-gguf is for --format gguf")
        # absolute: the export's config.json and README name the file wherever they are read
        given = str(Path(a.target_gguf).expanduser().resolve()) if a.target_gguf else None
        opts = {"target_gguf_path": given or cli_target_gguf(head.target)} if is_gguf else {}
        export(head, fmt, out, dtype=a.dtype, force=a.force, gamma=a.gamma, merge=a.merge, **opts)
        if is_gguf:
            warn_if_unfed(opts["target_gguf_path"], Path(out) / "draft.gguf")
    except (ExportError, DraftError, TargetError) as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    except OSError as e:  # the disk filled, a folder became unwritable: nothing was replaced
        print(f"error: export of {a.draft} to {out} failed: {e}", file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    main()
