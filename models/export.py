"""Exports that serving engines load, and the checks every export passes on the way out
(the ``specdraft-export`` command over it is ``flow/export.py``).

This module is the generic pipeline; each layout is an ``ExportFormat`` (``models/base.py``)
that lives with its method (``models/eagle/export.py``: sglang, vllm, speculators, eagle1;
``models/medusa/export.py``: medusa, medusa-vllm; ``models/mlp_speculator/export.py``:
mlp_speculator) and is registered in ``models/__init__.FORMATS``. The README has a table.

Every export is written to a temporary folder and checked before it is moved into place:
expected keys present and no others, every shape derived from the *target's* config and the
written config (never from the draft module), finite values and the format's own checks (e.g.
EAGLE-3's ``d2t``/``t2d`` consistent and chosen from data, not the placeholder of an untrained
head); then the folder is read back by the format's reader (the same one ``specdraft-eval`` uses
on exported or third-party checkpoints), and the read-back draft must give the same probe
logits and the same proposals as the trained draft at the export's precision. Any failure is
an ``ExportError``; nothing lands at ``--out``.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file

from .base import (
    DecodeState,
    DraftError,
    DraftMethod,
    ExportError,
    ExportFormat,
    read_draft_config,
    readable_by_others,
    resolve_draft_dir,
    run_files,
    unfinished_run,
    unwritable,
)
from .sampling import Sampling
from .target import Target

__all__ = [
    "ExportError",
    "compare_drafts",
    "default_prompt",
    "detect_format",
    "export",
    "exported_for",
    "exported_target",
    "import_draft",
    "load_trained_head",
    "made_for",
    "made_for_note",
    "noted",
    "proposals",
    "same_weights",
]

SMOLLM2_HUB_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"  # what the embedded target is a copy of


def formats() -> dict[str, ExportFormat]:
    from . import FORMATS  # the registry imports the method folders, which import this module

    return FORMATS


# ---------------------------------------------------------------------------------------------
# Helpers the formats share


def verifier_name(target: Target) -> str:
    """What a serving engine should load as the target."""
    if target.cfg.path:
        return target.cfg.path
    if target.cfg.name == "smollm2_135m":
        return SMOLLM2_HUB_ID
    from .target import target_folder

    return str(target_folder(target))  # a tiny random target, written once under the cache


def vllm_serve_line(fmt: ExportFormat, target: Target, folder: Path, config: dict, gamma: int = 3):
    """The ``vllm serve`` command that serves ``folder`` (a ``fmt`` export) on ``target``,
    or None where vLLM does not serve the layout."""
    if fmt.vllm_method is None:
        return None
    spec = {
        "method": fmt.vllm_method,
        "model": str(folder),
        "num_speculative_tokens": fmt.vllm_tokens(config, gamma),
        **fmt.vllm_options,
    }
    # the heads' own base where the layout names one (Medusa-2's merged backbone)
    base = config.get("base_model_name_or_path") or verifier_name(target)
    return f"vllm serve {base} --speculative-config '{json.dumps(spec)}'"


def sglang_launch_line(fmt: ExportFormat, target: Target, folder: Path, gamma: int = 3):
    """The SGLang command that serves ``folder`` as a chain of ``gamma`` drafts on ``target``
    (its EAGLE-3 flags: steps = gamma, top-k 1, gamma + 1 tokens verified), or None for the
    layouts SGLang is not the home of."""
    if fmt.name != "sglang":
        return None
    return (
        f"python -m sglang.launch_server --model-path {verifier_name(target)} "
        f"--speculative-algorithm EAGLE3 --speculative-draft-model-path {folder} "
        f"--speculative-num-steps {gamma} --speculative-eagle-topk 1 "
        f"--speculative-num-draft-tokens {gamma + 1}"
    )


def load_tensors(path: Path) -> dict[str, torch.Tensor]:
    if not path.exists():
        raise ExportError(f"{path}: missing")
    try:
        if path.suffix == ".safetensors":
            return load_file(str(path))
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # damaged files raise many types
        raise ExportError(f"{path}: cannot read ({type(e).__name__}: {e})") from None


def cast(tensors: dict[str, torch.Tensor], dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Floating tensors in ``dtype``, others as they are; detached, contiguous, on the CPU."""
    return {
        k: (v.detach().to(dtype) if v.is_floating_point() else v.detach()).contiguous().cpu()
        for k, v in tensors.items()
    }


def read_config(folder: Path) -> dict[str, Any]:
    f = folder / "config.json"
    try:
        cfg = json.loads(f.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ExportError(f"{f}: unreadable ({e})") from None
    if not isinstance(cfg, dict):
        raise ExportError(f"{f}: not a JSON object")
    return cfg


# ---------------------------------------------------------------------------------------------
# Reading: exported folders and third-party checkpoints


def detect_format(folder: Path) -> str | None:
    """The serving layout of ``folder`` from its config.json, or None if it is none we read."""
    if not (Path(folder) / "config.json").exists():
        return None
    try:
        cfg = read_config(Path(folder))
    except ExportError:
        return None
    for name, fmt in formats().items():
        if fmt.detect(Path(folder), cfg):
            return name
    return None


def import_draft(folder: str | Path, target: Target, fmt_name: str | None = None) -> DraftMethod:
    """Read an exported (or third-party) checkpoint in a serving layout into our draft module,
    for ``target``."""
    folder = Path(folder)
    fmt_name = fmt_name or detect_format(folder)
    if fmt_name not in formats():
        raise ExportError(f"{folder}: not a checkpoint in a known serving layout")
    fmt = formats()[fmt_name]
    from .target import TargetError

    try:
        return fmt.read(folder, target, fmt.read_config(folder)).to(target.device).eval()
    except TargetError as e:  # e.g. the layers it reads are not the target's
        raise ExportError(
            f"{folder}: a {fmt_name} export that does not fit target {target.identity} ({e}); "
            "was it made for another target?"
        ) from None


# ---------------------------------------------------------------------------------------------
# Checks


def check_written(folder: Path, fmt: ExportFormat, target: Target, draft) -> None:
    """Keys and shapes of the written weights against what the target's config and the written
    config imply, finite values, and the format's own checks."""
    config = fmt.read_config(folder)
    path = folder / fmt.weights_file
    tensors = fmt.load(path, config)
    want = fmt.expected(config, target.config)
    missing = sorted(set(want) - set(tensors))
    unexpected = sorted(set(tensors) - set(want))
    if missing or unexpected:
        raise ExportError(f"{path}: missing keys {missing}, unexpected keys {unexpected}")
    for k, shape in want.items():
        if tuple(tensors[k].shape) != tuple(shape):
            raise ExportError(
                f"{path}: {k} has shape {tuple(tensors[k].shape)}, the target's config "
                f"({target.identity}) implies {tuple(shape)}"
            )
    for k, v in tensors.items():
        if v.is_floating_point() and not torch.isfinite(v).all():
            raise ExportError(f"{path}: {k} holds non-finite values")
    fmt.check(path, tensors, config, draft)


@torch.no_grad()
def proposals(draft: DraftMethod, prompt: list[int], gamma: int = 6) -> dict[str, Any]:
    """The draft's probe logits on ``prompt`` (``"logits"``, or None) and, for each of its
    ``export_checks`` settings, the greedy proposal after ``prompt`` (tokens and parents): what
    the decoder would verify. For comparing a draft with its export read back."""
    target = draft.target
    out: dict[str, Any] = {"logits": draft.probe(prompt)}
    for name, settings in draft.export_checks().items():
        prop = draft.proposer(settings)
        feats = None
        if prop.feature_layers:
            ids = torch.tensor([prompt[:-1]], device=target.device)
            feats = target.features(ids, torch.ones_like(ids), tuple(prop.feature_layers))[0]
        state = DecodeState(list(prompt), feats, Sampling(), None, target.device)
        prop.start(state)
        p = prop.propose(state, gamma)
        out[name] = p.tokens
        out[name + "_parents"] = p.parents
    return out


def compare_drafts(a: DraftMethod, b: DraftMethod, prompt: list[int]) -> dict[str, Any]:
    """Probe logits and proposals of two drafts on ``prompt``; ``ExportError`` if they differ.
    Both read the same target states (``Target.features_held``): what is compared is the
    drafts, not two runs of the target."""
    with contextlib.ExitStack() as held:
        for t in {id(t): t for t in (a.target, b.target)}.values():
            if hasattr(t, "features_held"):  # a stand-in target in a test may lack it
                held.enter_context(t.features_held())
        pa, pb = proposals(a, prompt), proposals(b, prompt)
    la, lb = pa.pop("logits"), pb.pop("logits")
    if (la is None) != (lb is None):
        raise ExportError("the re-imported export has no probe where the trained draft has one")
    if la is not None:
        fa, fb = torch.isfinite(la), torch.isfinite(lb)
        diff = float((la[fa] - lb[fa]).abs().max()) if torch.equal(fa, fb) else float("inf")
        if diff > 1e-4 * max(1.0, float(la[fa].abs().max())):
            raise ExportError(
                f"the re-imported export's draft logits differ from the trained draft's by up "
                f"to {diff:.3g} on a prompt (the layout or the layer ids were written wrongly)"
            )
    if pa != pb:
        diffs = [k for k in pa if pa[k] != pb.get(k)]
        raise ExportError(
            f"the re-imported export proposes differently from the trained draft ({diffs}): "
            f"{[pb[k] for k in diffs][:2]} vs {[pa[k] for k in diffs][:2]}"
        )
    first = next((k for k in pa if not k.endswith("_parents")), None)
    return {
        "chain": pa.get("chain", pa.get(first, [])),
        "proposals": {k: len(v) for k, v in pa.items() if not k.endswith("_parents")},
        "probe": la is not None,
    }


def default_prompt(target: Target) -> list[int]:
    tok = target.tokenizer
    msgs = [{"role": "user", "content": "Explain in two sentences why the sky is blue."}]
    text = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    # a few tokens of a reply, so the draft has committed reply context to draft from
    return tok(text + "The sky looks blue because", add_special_tokens=False)["input_ids"]


# ---------------------------------------------------------------------------------------------
# The pipeline


def resolve_format(fmt_name: str, method: str) -> str:
    """The layout ``--format fmt_name`` means for a ``method`` draft: the format of that name,
    or, where it does not export the method, the one of its family that does (``gguf`` is
    EAGLE-3's GGUF, and DFlash's and DSpark's for those drafts)."""
    if fmt_name not in formats():
        raise ExportError(f"--format {fmt_name}: choose one of {sorted(formats())}")
    if method in formats()[fmt_name].methods:
        return fmt_name
    for name, f in formats().items():
        if f.family == fmt_name and method in f.methods:
            return name
    return fmt_name


def check_method(fmt_name: str, draft: DraftMethod, flag: str = "--format ") -> str:
    """The format ``fmt_name`` resolves to for ``draft``'s method; ExportError where that format
    does not export this method (checked before anything is converted or written), naming it
    as the user typed it (``flag``: ``--format `` here, ``engine_format=`` in an engine)."""
    fmt_name = resolve_format(fmt_name, draft.cfg.name)
    fmt = formats()[fmt_name]
    if draft.cfg.name not in fmt.methods:
        kin = [m for f in formats().values() if fmt_name in (f.name, f.family) for m in f.methods]
        hint = (
            " (a DistillSpec student is an ordinary model in <draft>/student: engines serve it "
            "as a draft model, and specdraft-eval engine=llama.cpp converts it itself)"
            if draft.cfg.name == "distillspec"
            else ""
        )
        kin = list(dict.fromkeys(kin))
        which = " or ".join([", ".join(kin[:-1]), kin[-1]] if len(kin) > 1 else kin)
        raise ExportError(
            f"{flag}{fmt_name} exports {which} drafts; this is {draft.cfg.name}{hint}"
        )
    return fmt_name


def check_out(out: Path, force: bool) -> None:
    """Refuse, before anything is written, an ``out`` that is a file or lies under one, that
    exists without ``force``, or that ``force`` would replace but is no earlier export: a
    training run, a trained draft or any folder of other files."""
    if out.exists() and not out.is_dir():
        raise ExportError(f"--out {out}: a file, not a folder; an export is a folder")
    why = unwritable(out)
    if why is not None:
        raise ExportError(f"--out {out}: {why}")
    if out.exists() and not force:
        raise ExportError(f"{out}: already exists (pass --force to replace it)")
    if out.is_dir():
        kept = _trained_files(out) or _other_files(out)
        if kept:
            raise ExportError(
                f"{out}: holds {kept}, which --force would delete; --force replaces an "
                "earlier export only: choose another --out"
            )


def export(
    draft: DraftMethod,
    fmt_name: str,
    out: str | Path,
    dtype: str | None = None,
    force: bool = False,
    log=print,
    **opts: Any,
) -> dict[str, Any]:
    """Write ``draft`` in ``fmt_name`` to ``out``, checked and re-imported first (see module
    docstring). Returns a summary. ``out`` is replaced only with ``force``. ``opts`` go to the
    format (``gamma``: speculators' speculative_tokens; ``merge``: Medusa-2's merged base)."""
    fmt_name = check_method(fmt_name, draft)
    fmt = formats()[fmt_name]
    dtype = dtype or fmt.default_dtype
    if dtype not in fmt.dtypes:
        raise ExportError(f"--dtype {dtype}: --format {fmt_name} takes {', '.join(fmt.dtypes)}")
    dt = fmt.torch_dtype(dtype)
    out = Path(out)
    check_out(out, force)
    draft = draft.eval()
    target = draft.target
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}-", dir=out.parent))
    except OSError as e:
        raise ExportError(f"--out {out}: cannot write there ({e.strerror or e})") from None
    opts = {**opts, "out": out}
    try:
        extra = fmt.extra(draft, tmp, dt, **opts)
        tensors = fmt.tensors(draft, dt)
        config = fmt.config(draft, dt, **opts)
        (tmp / "config.json").write_text(json.dumps(config, indent=2))
        fmt.save(tmp, tensors, config, draft, dtype)
        check_written(tmp, fmt, target, draft)
        back = import_draft(tmp, target, fmt.name).to(dt)
        same = compare_drafts(fmt.reference(draft, dtype), back, default_prompt(target))
        same["checked"] = (
            ("identical draft logits and " if same["probe"] else "identical ")
            + "proposals ("
            + ", ".join(f"{k}: {n} nodes" for k, n in same["proposals"].items())
            + ")"
            + (f"; {extra}" if extra else "")
        )
        vllm = vllm_serve_line(fmt, target, out.resolve(), config, opts.get("gamma") or 3)
        sglang = sglang_launch_line(fmt, target, out.resolve(), opts.get("gamma") or 3)
        evaluated_with = _export_target(draft.target, config, tmp)
        (tmp / "README.md").write_text(
            _readme(fmt, draft, config, same, vllm, sglang, evaluated_with)
        )
        readable_by_others(tmp)
        _replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    size = sum(f.stat().st_size for f in out.rglob("*") if f.is_file())
    log(
        f"exported {fmt.description} to {out} ({size / 1e6:.1f} MB, {dtype}); checked: keys and "
        f"shapes against {target.identity}'s config; re-imported: {same['checked']}"
    )
    if sglang:
        log(f"serve it in SGLang: {sglang}")
    if vllm:
        log(f"serve it in vLLM: {vllm}")
    return {
        "out": str(out),
        "format": fmt_name,
        "bytes": size,
        "vllm_serve": vllm,
        "sglang_serve": sglang,
        **same,
    }


def _replace(tmp: Path, out: Path) -> None:
    """Move the checked export ``tmp`` to ``out``: an earlier export there is moved aside
    first and deleted only once the new one is in place, so that a failure on the way (a file
    that cannot be deleted, an interruption) leaves the earlier export whole, never half of it."""
    if not out.exists():
        os.rename(tmp, out)
        return
    old = Path(tempfile.mkdtemp(prefix=f".{out.name}-old-", dir=out.parent)) / out.name
    os.rename(out, old)
    try:
        os.rename(tmp, out)
    except BaseException:
        os.rename(old, out)
        shutil.rmtree(old.parent, ignore_errors=True)
        raise
    shutil.rmtree(old.parent, ignore_errors=True)


#: the README line recording the target an export is evaluated against (JSON after it)
_TARGET_LINE = "- specdraft-eval target: "


def _export_target(target: Target, config: dict, tmp: Path) -> dict[str, Any]:
    """The target an export decodes with, as a draft's config records it (identity, name,
    path): the target, or where the export carries its own base model (Medusa-2's adapter
    merged into ``base/``) that one, its path relative to the export."""
    base = tmp / "base"
    if (base / "config.json").is_file():
        from transformers import AutoConfig

        from .target import target_identity

        config = AutoConfig.from_pretrained(str(base)).to_dict()
        return {"identity": target_identity(str(base), config), "name": "hf", "path": "base"}
    return {"identity": target.identity, "name": target.cfg.name, "path": target.cfg.path}


def exported_target(folder: str | Path) -> dict[str, Any] | None:
    """The target an export by specdraft was made for, as ``write_draft_config`` records a
    draft's (``identity``, ``name``, ``path``; a relative path is inside the export), or None
    (not ours). Exports written before the line was recorded: the identity, and the name where
    it tells (a tiny random target, the embedded one)."""
    ident = exported_for(folder)
    if ident is None:
        return None
    for line in (Path(folder) / "README.md").read_text(errors="replace").splitlines():
        if line.startswith(_TARGET_LINE):
            try:
                saved = json.loads(line[len(_TARGET_LINE) :])
            except json.JSONDecodeError:
                break
            if isinstance(saved, dict):
                return saved
    if ident.startswith("tiny_random("):
        return {"identity": ident, "name": "tiny_random", "path": None}
    if ident.startswith("smollm2-135m-instruct-q4_1:"):
        return {"identity": ident, "name": "smollm2_135m", "path": None}
    return {"identity": ident}


def _readme(
    fmt: ExportFormat,
    draft: DraftMethod,
    config: dict,
    same: dict,
    vllm=None,
    sglang=None,
    evaluated_with: dict[str, Any] | None = None,
) -> str:
    t = draft.target
    made = evaluated_with or {"identity": t.identity, "name": t.cfg.name, "path": t.cfg.path}
    lines = [
        f"# {fmt.description} exported by specdraft",
        "",
        f"- draft method: {draft.cfg.name}; target: {made['identity']} (serve with "
        f"`{config.get('base_model_name_or_path') or verifier_name(t)}`)",
        f"{_TARGET_LINE}{json.dumps(made)}",
        f"- weights: `{fmt.weights_file}`; config: `config.json`",
        *fmt.readme_lines(draft, config),
        f"- re-imported and checked: {same['checked']}; greedy proposal {same['chain']} on a "
        "fixed prompt",
        "",
    ]
    if sglang:
        lines += ["SGLang serves it with:", "", f"    {sglang}", ""]
    if vllm:
        lines += ["vLLM serves it with:", "", f"    {vllm}", ""]
    if fmt.serve_hint:
        lines.append(fmt.serve_hint)
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------------------------------------
# CLI


def _trained_files(folder: Path) -> str | None:
    """What in ``folder`` is a training run's or a trained draft's (None: nothing): the files
    an export must never replace."""
    held = run_files(folder)
    if held:
        return f"a training run ({', '.join(held)})"
    if (folder / "config.json").exists():
        try:
            read_draft_config(folder)
            return "a trained draft (config.json)"
        except DraftError:
            pass
    return None


def _other_files(folder: Path) -> str | None:
    """What in ``folder`` is not an earlier export (None: it is one, or it is empty): an
    export's README.md says so on its first line."""
    names = sorted(p.name for p in folder.iterdir())
    if not names:
        return None
    readme = folder / "README.md"
    try:
        first = readme.read_text(errors="replace").splitlines()[0] if readme.is_file() else ""
    except (OSError, IndexError):
        first = ""
    if first.startswith("# ") and first.endswith("exported by specdraft"):
        # an earlier export, but --force must not take files put in it since (the target's
        # GGUF beside the draft's, notes): only what an export writes
        written = {
            "config.json",
            "README.md",
            "base",
            *(f.weights_file for f in formats().values()),
        }
        added = [n for n in names if n not in written]
        if not added:
            return None
        shown = ", ".join(added[:3]) + (f", ... ({len(added)} in all)" if len(added) > 3 else "")
        return f"an earlier export with files it did not write ({shown})"
    shown = ", ".join(names[:3]) + (f", ... ({len(names)} in all)" if len(names) > 3 else "")
    return f"files that are not an earlier export ({shown})"


def check_saved_config(folder: Path, cfg: dict[str, Any]) -> str:
    """The method of the saved draft in ``folder`` (its parsed ``config.json``), after checking
    what loading it reads: a known method, its ``target`` section, and settings its method has
    (a draft saved by a newer specdraft may hold more); ``DraftError`` naming the field."""
    from dataclasses import fields

    from . import METHODS

    f = folder / "config.json"
    saved = cfg.get("specdraft")
    method = saved.get("method") if isinstance(saved, dict) else None
    if method not in METHODS:
        raise DraftError(f"{f}: unknown draft kind {method!r} (specdraft.method)")
    t = cfg.get("target")
    if not isinstance(t, dict) or "hidden_size" not in t:
        raise DraftError(
            f"{f}: no target section (the target the draft was trained for, with its "
            "hidden_size); the file is damaged or was not written by specdraft"
        )
    settings = cfg.get("method")
    if not isinstance(settings, dict):
        raise DraftError(f"{f}: no method section (the {method} draft's settings)")
    known = {x.name for x in fields(METHODS[method].config_class)}
    odd = sorted(set(settings) - known)
    if odd:
        raise DraftError(
            f"{f}: method.{odd[0]} is not a setting of {method} drafts in this specdraft "
            "(saved by a newer version? upgrade specdraft to load it)"
        )
    return method


def load_trained_head(
    path: str | Path, target: Target | None = None, target_path: str | None = None
) -> DraftMethod:
    """The saved draft behind a run dir, draft dir or checkpoint dir (its target loaded from
    the draft's config unless given; ``target_path``: from there instead, a folder or hub id,
    for a target that has moved). The target loaded must hold the weights the draft was
    trained for (its folder's name may differ)."""
    from . import METHODS
    from .target import TargetError, load_target, saved_target_config

    p = Path(path).expanduser()
    # a damaged config.json is named (DraftError), not passed over as "no saved draft here"
    cand = resolve_draft_dir(p) if p.is_dir() else None
    if cand is not None:
        cfg = read_draft_config(cand)
        method = check_saved_config(cand, cfg)
        if target is None:
            t = cfg["target"]
            tcfg = saved_target_config(t)  # tiny targets: the seed and layers it had
            if target_path:
                tcfg.path = target_path
            try:
                target = load_target(tcfg)
            except TargetError as e:
                if target_path:
                    raise
                raise TargetError(
                    f"{e} (the target {cand} was trained for; where it has moved, pass "
                    "--target <its folder or hub id>)"
                ) from None
            if not same_weights(target.identity, t.get("identity")):
                raise DraftError(
                    f"{cand}: trained for target {t.get('identity')}, but loading "
                    f"{tcfg.path or tcfg.name} gives {target.identity} (weights changed?)"
                )
        return METHODS[method].load_draft(cand, target)
    step = unfinished_run(p)
    if step is not None:
        raise DraftError(
            f"{p}: no final/ draft yet (the run did not finish); its newest checkpoint is "
            f"{step}: pass that folder"
        )
    if (p / "config.json").exists():
        raise DraftError(
            f"{p}/config.json is not a specdraft draft (an export or a model?): pass the "
            "training run, its final/ folder or a checkpoint"
        )
    raise DraftError(f"{p}: no saved draft here (looked for final/, draft/ and config.json)")


def default_out(draft: Path, fmt: str) -> Path:
    """Where ``specdraft-export <draft>`` writes without ``--out``: ``<run>/export-<fmt>`` for a
    run or its ``final/``, ``<run>/export-<fmt>-step_N`` for a checkpoint (or its ``draft/``),
    else ``<draft>/export-<fmt>``: never inside a folder training replaces."""
    p = Path(draft)
    if p.name == "draft" and p.parent.parent.name == "checkpoints":
        p = p.parent
    if p.parent.name == "checkpoints" and p.name.startswith("step_"):
        return p.parent.parent / f"export-{fmt}-{p.name}"
    if p.name == "final" and run_files(p.parent):
        return p.parent / f"export-{fmt}"
    return p / f"export-{fmt}"


def replaced_by_training(dest: Path) -> Path | None:
    """The run's ``final/`` or ``checkpoints/`` folder that holds ``dest`` (training replaces
    the one when a resumed run ends, and prunes the other), or None."""
    for anc in Path(dest).resolve().parents:
        if anc.name in ("final", "checkpoints") and run_files(anc.parent):
            return anc
    return None


def _weights_of(identity: str | None) -> str | None:
    """What an identity says of the weights, less the folder's name (``name:hash`` -> hash): a
    target moved or renamed is the same target."""
    return identity.rsplit(":", 1)[-1] if identity and ":" in identity else identity


def same_weights(a: str | None, b: str | None) -> bool:
    """Whether two target identities name the same weights (wherever the folders are)."""
    return _weights_of(a) == _weights_of(b)


def exported_for(folder: str | Path) -> str | None:
    """The identity of the target an export by specdraft was made for, from its README (None:
    not one of ours, or one that does not say): a third-party checkpoint records none."""
    readme = Path(folder) / "README.md"
    try:
        lines = readme.read_text(errors="replace").splitlines() if readme.is_file() else []
    except OSError:
        return None
    if not lines or not lines[0].endswith("exported by specdraft"):
        return None
    for line in lines[1:]:
        m = re.match(r"- draft method: [^;]+; target: (.+?) \(serve with `", line)
        if m:
            return m.group(1)
    return None


def made_for(folder: str | Path) -> str | None:
    """The identity of the target a draft was made for: a trained draft's (its run, final/ or
    checkpoint folder) from its config, an export by specdraft's from its README; None where
    nothing says (a third-party checkpoint, an HF model)."""
    draft_dir = resolve_draft_dir(Path(folder))
    if draft_dir is not None:
        return read_draft_config(draft_dir).get("target", {}).get("identity")
    return exported_for(folder)


def noted(note: str | None) -> str:
    """A made-for warning as a draft's description (a report's ``draft`` line) keeps it."""
    return f"; warning: {note}" if note else ""


def made_for_note(made_for: str | None, target: Target) -> str | None:
    """A warning where a draft was trained or exported for a target whose weights are not
    ``target``'s (None: the same weights, or nothing recorded): its acceptance here is not
    the acceptance it would have with the target it was made for."""
    if not made_for or same_weights(made_for, target.identity):
        return None
    return f"made for target {made_for}, evaluated against {target.identity}"
