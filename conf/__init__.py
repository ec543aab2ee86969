"""Hydra configuration (YAML). A package so that the files ship with the install; importing it
registers ``${specdraft_groups:a,b}``, which each command's ``--help`` template uses to list
the groups that command composes and their options (Hydra's own list, ``$APP_CONFIG_GROUPS``,
names every group of the folder for every command, the typed schemas among them)."""

from __future__ import annotations

from pathlib import Path

from omegaconf import OmegaConf

_DIR = Path(__file__).resolve().parent


def help_groups(*groups: str) -> str:
    """``group: option, option, ...`` for each of ``groups``, its options the YAML files of
    ``conf/<group>/``."""
    lines = []
    for g in groups:
        options = sorted(p.stem for p in (_DIR / g).glob("*.yaml"))
        lines.append(f"{g}: {', '.join(options)}")
    return "\n".join(lines)


OmegaConf.register_new_resolver("specdraft_groups", help_groups, replace=True)
