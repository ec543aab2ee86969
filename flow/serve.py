"""The loop's last step: how to export and serve a draft just trained in an engine."""

from __future__ import annotations

from pathlib import Path


def llama_cpp_spec_type(method: str) -> str | None:
    """llama-server's ``--spec-type`` for the method's GGUF export (None: no GGUF layout)."""
    from models.export import formats
    from models.gguf import GGUFDraftFormat

    return next(
        (
            f.spec_type
            for f in formats().values()
            if isinstance(f, GGUFDraftFormat) and method in f.methods
        ),
        None,
    )


def _n_max(run_dir: Path) -> int:
    """The chain a llama.cpp server drafts for the run's draft: a DFlash-family block's
    ``block_size - 1`` (the block it was trained on), else 3."""
    from models.base import DraftError, read_draft_config

    try:
        block = read_draft_config(Path(run_dir) / "final")["method"].get("block_size")
    except DraftError:  # no draft saved (yet): the default chain
        return 3
    return int(block) - 1 if block else 3


def serve_hint(method: str, run_dir: Path) -> str:
    """Lines telling how to export the draft of ``run_dir`` and serve it: in llama.cpp (CPU)
    where it serves the method, in vLLM where it does, else the export formats."""
    from decoding.engines.vllm_eval import FORMAT_OF_METHOD as fmt

    lines = [""]
    spec_type = llama_cpp_spec_type(method)
    if spec_type:
        from models.export import default_out, resolve_format

        gguf = default_out(run_dir, resolve_format("gguf", method)) / "draft.gguf"
        lines += [
            "serve it in llama.cpp (CPU; `bash scripts/install.sh engine` installs it once):",
            f"  specdraft-export {run_dir} --format gguf",
            f"  llama-server -m <target.gguf> -md {gguf} --spec-type {spec_type} "
            f"--spec-draft-n-max {_n_max(run_dir)} --spec-draft-p-min 0",
            "  (add --no-repack where llama.cpp crashes with its repacked weights, as b11434 did "
            "on an AMX Xeon; specdraft-eval finds that by itself)",
            f"measure it there: specdraft-eval engine=llama.cpp draft={run_dir}",
        ]
    if method in ("eagle3", "hass"):
        lines += [
            "serve it in vLLM (`bash scripts/install.sh vllm` installs it once):",
            f"  specdraft-export {run_dir} --format vllm      (prints the `vllm serve` line)",
            f"measure it there: specdraft-eval engine=vllm draft={run_dir}",
            f"SGLang: specdraft-export {run_dir} --format sglang",
        ]
    elif method in fmt:
        # Medusa-2's heads read the adapted backbone: the export writes it merged, as their base
        merge = " --merge" if method == "medusa2" else ""
        lines += [
            f"serve it in vLLM: specdraft-export {run_dir} --format {fmt[method]}{merge}      "
            "(prints the `vllm serve` line)",
            f"measure it there: specdraft-eval engine=vllm draft={run_dir}",
        ]
        if method == "eagle1":  # vLLM's layout folds FC's bias; the reference keeps it
            lines.append(f"SGLang, the EAGLE code: specdraft-export {run_dir} --format eagle1")
    elif method == "distillspec":  # a plain causal LM: engines serve it as a draft model
        lines += [
            f"serve it as a draft model: its HF folder is {run_dir}/final/student",
            f"measure it in vLLM or llama.cpp: specdraft-eval engine=vllm draft={run_dir} "
            "(or engine=llama.cpp, which converts it)",
        ]
    elif method == "mlp_speculator":
        lines.append(f"serve it in TGI: specdraft-export {run_dir} --format mlp_speculator")
    if len(lines) == 1:  # Falcon, Domino: no engine here loads them
        lines.append(
            f"no serving engine loads {method} drafts; measure it in the built-in decoder: "
            f"specdraft-eval draft={run_dir}"
        )
    return "\n".join(lines)
