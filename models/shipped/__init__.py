"""Drafts trained with this toolkit and shipped in the repository, loadable by a short name
(``draft=smollm2-eagle3``). Each folder is a saved draft (``config.json`` +
``model.safetensors``) with a README giving the exact data and training commands and its
evaluation figures."""

from __future__ import annotations

from pathlib import Path

HERE = Path(__file__).resolve().parent

# short name -> folder (a saved draft, as ``final/`` of a training run)
SHIPPED: dict[str, Path] = {
    "smollm2-eagle3": HERE / "smollm2-eagle3",
}


def shipped_draft(name: str) -> Path | None:
    """The folder of a shipped draft, or None when ``name`` is not one."""
    p = SHIPPED.get(name)
    return p if p is not None and (p / "config.json").exists() else None
