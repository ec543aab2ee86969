"""The loop's last step: how to export and serve a draft just trained in an engine."""

from __future__ import annotations

from pathlib import Path


def serve_hint(method: str, run_dir: Path) -> str:
    """Lines telling how to export the draft of ``run_dir`` and serve it (llama.cpp for the
    EAGLE-3 family, which it runs on CPU; the export formats otherwise)."""
    if method in ("eagle3", "hass"):
        return "\n".join(
            [
                "",
                "serve it in llama.cpp (CPU; `bash scripts/install.sh engine` installs it once):",
                f"  specdraft-export {run_dir} --format gguf",
                f"  llama-server -m <target.gguf> -md {run_dir}/export-gguf/draft.gguf "
                "--spec-type draft-eagle3 --spec-draft-n-max 3",
                "  (add --no-repack where llama.cpp crashes with its repacked weights, as b11434 did "
                "on an AMX Xeon; specdraft-eval finds that by itself)",
                f"measure it there: specdraft-eval engine=llama.cpp draft={run_dir}",
                "serve it in vLLM (`bash scripts/install.sh vllm` installs it once):",
                f"  specdraft-export {run_dir} --format vllm      (prints the `vllm serve` line)",
                f"measure it there: specdraft-eval engine=vllm draft={run_dir}",
                f"SGLang: specdraft-export {run_dir} --format sglang",
            ]
        )
    from decoding.engines.vllm_eval import FORMAT_OF_METHOD as fmt

    if method in fmt:
        # Medusa-2's heads read the adapted backbone: the export writes it merged, as their base
        merge = " --merge" if method == "medusa2" else ""
        return "\n".join(
            [
                "",
                f"serve it in vLLM: specdraft-export {run_dir} --format {fmt[method]}{merge}      "
                "(prints the `vllm serve` line)",
                f"measure it there: specdraft-eval engine=vllm draft={run_dir}",
            ]
        )
    return f"\nexport it for an engine: specdraft-export {run_dir} --format <see README, Exports>"
