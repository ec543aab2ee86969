"""Draft methods, one file each, and the frozen target. ``METHODS`` maps a method name (the
``method.name`` config value, also stored in every saved draft) to its module class."""

from .eagle import Eagle1Config, EagleHead

METHODS = {"eagle1": EagleHead}
METHOD_CONFIGS = {"eagle1": Eagle1Config}
