"""HASS: harmonized objective distillation and context alignment on an EAGLE-3-style head
(config and module; proposers and export formats are EAGLE-3's)."""

from .config import HassConfig
from .model import HassHead

__all__ = ["HassConfig", "HassHead"]
