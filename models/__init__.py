"""Draft methods, one file each, and the frozen target. ``METHODS`` maps a method name (the
``method.name`` config value, also stored in every saved draft) to its module class."""

from .distillspec import DistillSpecConfig, DistillSpecStudent
from .eagle import Eagle1Config, Eagle3Config, Eagle3Head, EagleHead
from .medusa import Medusa1Config, Medusa2Config, Medusa2Heads, MedusaHeads

METHODS = {
    "eagle1": EagleHead,
    "eagle3": Eagle3Head,
    "medusa1": MedusaHeads,
    "medusa2": Medusa2Heads,
    "distillspec": DistillSpecStudent,
}
METHOD_CONFIGS = {
    "eagle1": Eagle1Config,
    "eagle3": Eagle3Config,
    "medusa1": Medusa1Config,
    "medusa2": Medusa2Config,
    "distillspec": DistillSpecConfig,
}
