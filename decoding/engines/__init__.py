"""Serving engines behind one contract (``base.py``): each takes token-id prompts and sampling
settings and gives tokens, its own acceptance counters and timings; ``specdraft-eval
engine=<name>`` runs the target alone and with the draft in it and writes the built-in
decoder's report from the engine's own figures.

``ENGINES`` maps an ``engine=`` name to the module whose ``evaluate(cfg, log)`` does that; a new
engine is one module here and one line below. The decoding core and the models never import
this package.
"""

from __future__ import annotations

import importlib
from typing import Any

ENGINES = {
    "llama.cpp": "decoding.engines.llama_cpp_eval",  # llama-server on loopback (GGUF)
    "vllm": "decoding.engines.vllm_eval",  # vLLM in its own environment, as a subprocess
}


def evaluate_in_engine(cfg, log=print) -> dict[str, Any]:
    """``specdraft-eval engine=<name>``'s report, from that engine's own figures."""
    return importlib.import_module(ENGINES[cfg.engine]).evaluate(cfg, log)
