"""Draft methods, one folder each, and the frozen target.

The registry: one line per method folder. ``METHODS`` maps a method name (the ``method.name``
config value, also stored in every saved draft) to its module class (its config dataclass is
``METHODS[name].config_class``); ``FORMATS`` maps an export format name (``--format``) to the
``ExportFormat`` that writes and reads it. ``draft=`` resolves saved drafts through ``METHODS``
and serving-layout checkpoints through ``FORMATS``.
"""

from . import dflash, distillspec, dspark, eagle, falcon, hass, medusa, mlp_speculator, peagle
from .base import DraftMethod, ExportFormat
from .dflash import export as dflash_export
from .dflash import gguf as dflash_gguf
from .dspark import export as dspark_export
from .dspark import gguf as dspark_gguf
from .eagle import export as eagle_export
from .medusa import export as medusa_export
from .mlp_speculator import export as mlp_speculator_export
from .peagle import export as peagle_export

METHODS: dict[str, type[DraftMethod]] = {
    "eagle1": eagle.EagleHead,
    "eagle3": eagle.Eagle3Head,
    "hass": hass.HassHead,
    "medusa1": medusa.MedusaHeads,
    "medusa2": medusa.Medusa2Heads,
    "distillspec": distillspec.DistillSpecStudent,
    "mlp_speculator": mlp_speculator.MLPSpeculator,
    "dflash": dflash.DFlashDraft,
    "domino": dflash.DominoDraft,
    "dspark": dspark.DSparkDraft,
    "peagle": peagle.PEagleHead,
    "falcon": falcon.FalconHead,
}
FORMATS: dict[str, ExportFormat] = {
    f.name: f
    for f in (
        *eagle_export.FORMATS,
        *dflash_export.FORMATS,
        *dspark_export.FORMATS,
        *dflash_gguf.FORMATS,
        *dspark_gguf.FORMATS,
        *medusa_export.FORMATS,
        *mlp_speculator_export.FORMATS,
        *peagle_export.FORMATS,
    )
}
METHOD_CONFIGS = {name: cls.config_class for name, cls in METHODS.items()}
