"""vLLM alone, no specdraft: speculative acceptance at T = 0 and at T = 1 on the same prompts.

A reproduction to hand to vLLM's authors when a build accepts far less at T > 0 than at T = 0
for every draft, model-free ones included (where exact speculative sampling accepts somewhat
less at T = 1, not nearly nothing). Run it with the Python of vLLM's environment:

    ~/.cache/specdraft/vllm-0.32.0/bin/python scripts/vllm_sampling_check.py \\
        --model <HF folder> [--draft <EAGLE-3 folder>] [--prompts 10] [--tokens 128] [--repair]

Without --draft it uses vLLM's n-gram (prompt lookup) speculation, so nothing of specdraft is
involved. Prints vLLM's own spec-decode counters: drafts, draft tokens, accepted per position.

It first says whether the build's CPU expand kernel (which spreads each request's temperature,
top-k and top-p over its draft positions) writes its output: vLLM 0.32's CPU build does not
(vLLM issue 55005), and that alone makes acceptance collapse at T > 0. ``--repair`` replaces
it with an exact torch version before loading (what ``specdraft-eval engine=vllm`` does by
default, from decoding/engines/vllm_worker.py, which imports vLLM and nothing of specdraft).
"""

from __future__ import annotations

import argparse
import os

PROMPTS = [
    "Tell me about your favourite holiday and why you liked it.",
    "What should I cook tonight? I have rice, eggs and some spinach.",
    "Explain to a child why the sky is blue.",
    "Write a short story about a cat who learns to fly.",
    "How do I keep my houseplants alive while I am travelling?",
    "Describe a perfect Sunday morning.",
    "What are three good habits for staying focused while studying?",
    "Tell me a joke about computers and then explain it.",
    "Summarise the plot of a famous fairy tale in a few sentences.",
    "Give me advice for my first day at a new job.",
]


def counters(llm) -> dict:
    out = {"drafts": 0, "draft_tokens": 0, "accepted_per_pos": []}
    for m in llm.get_metrics():
        if m.name == "vllm:spec_decode_num_drafts":
            out["drafts"] += int(m.value)
        elif m.name == "vllm:spec_decode_num_draft_tokens":
            out["draft_tokens"] += int(m.value)
        elif m.name == "vllm:spec_decode_num_accepted_tokens_per_pos":
            out["accepted_per_pos"] = [int(v) for v in m.values]
    return out


def _worker_module():
    """decoding/engines/vllm_worker.py, loaded by its path (it imports vLLM only)."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "decoding" / "engines" / "vllm_worker.py"
    spec = importlib.util.spec_from_file_location("specdraft_vllm_worker", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def expand_kernel_state(worker) -> str:
    """Whether this build's CPU expand kernel writes a float32 output (without changing it)."""
    try:
        from vllm.utils import cpu_triton_utils as cpu_tl
    except ImportError:
        return "expand kernel: Triton's (not a CPU build)"
    wrong = worker.cpu_expand_is_wrong(cpu_tl)  # the check alone: nothing is replaced
    return (
        "expand kernel: WRONG, per-token temperatures are never written (vLLM issue 55005); "
        "--repair replaces it"
        if wrong
        else "expand kernel: right"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True, help="the target: an HF folder or hub id")
    ap.add_argument("--draft", help="an EAGLE-3 draft folder (default: n-gram speculation)")
    ap.add_argument("--prompts", type=int, default=10)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--gamma", type=int, default=3)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument(
        "--repair", action="store_true", help="replace a CPU expand kernel found wrong first"
    )
    a = ap.parse_args()
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    import vllm
    from vllm import LLM, SamplingParams

    worker = _worker_module()
    if a.repair:
        print(worker.repair_cpu_expand() or "the expand kernel is right: nothing repaired")
    else:
        print(expand_kernel_state(worker))

    spec = (
        {"method": "eagle3", "model": a.draft, "num_speculative_tokens": a.gamma}
        if a.draft
        else {
            "method": "ngram",
            "num_speculative_tokens": a.gamma,
            "prompt_lookup_max": 3,
            "prompt_lookup_min": 1,
        }
    )
    llm = LLM(
        model=a.model,
        dtype=a.dtype,
        max_model_len=1024,
        enforce_eager=True,
        seed=0,
        speculative_config=spec,
        disable_log_stats=False,
    )
    msgs = [[{"role": "user", "content": p}] for p in (PROMPTS * 10)[: a.prompts]]
    print(f"vLLM {vllm.__version__}, {spec['method']}, {a.gamma} speculative tokens, {a.dtype}")
    for t in (0.0, 1.0):
        before = counters(llm)
        llm.chat(msgs, SamplingParams(max_tokens=a.tokens, temperature=t, seed=0), use_tqdm=False)
        after = counters(llm)
        drafts = after["drafts"] - before["drafts"]
        per = [
            x - (before["accepted_per_pos"] + [0] * 8)[i]
            for i, x in enumerate(after["accepted_per_pos"])
        ]
        rate = [round(x / drafts, 3) if drafts else None for x in per]
        mean_len = 1 + sum(per) / drafts if drafts else float("nan")
        print(
            f"T={t}: {drafts} drafts, accepted per position {per} "
            f"({rate} of drafts), mean acceptance length {mean_len:.2f}"
        )


if __name__ == "__main__":
    main()
