"""DistillSpec config: the one place its defaults live (``conf/method/distillspec.yaml`` only selects it)."""

from __future__ import annotations

from dataclasses import dataclass, field

from ..base import LORA_TARGETS


@dataclass
class DistillSpecConfig:
    name: str = "distillspec"
    student: str = "truncate"  # truncate (made from the target) | HF folder or hub id
    num_layers: int = 4  # truncate: keep the target's first N decoder layers ...
    student_layers: list[int] | None = None  # ... or exactly these (e.g. [0, 7, 14, 21, 29])
    lora: bool = False  # train a LoRA adapter instead of every weight (merged when saved)
    lora_r: int = 16
    lora_alpha: int = 32
    lora_dropout: float = 0.0
    lora_target_modules: list[str] = field(default_factory=lambda: list(LORA_TARGETS))
    divergence: str = "fkl"  # fkl | rkl | jsd | tvd
    jsd_beta: float = 0.5  # jsd: weight of the teacher in the mixture (0: fkl, 1: rkl)
    temperature: float = 1.0  # both distributions at this temperature
    chunk: int = 512  # positions per loss chunk: (chunk, V) logits live at a time
    on_policy: float = 0.0  # fraction of micro-batches whose replies the student writes
    gen_max_new_tokens: int = 128  # on-policy replies
    gen_temperature: float = 1.0  # 0: greedy; match the decoding the draft will serve
    gen_top_p: float = 1.0
    gen_top_k: int = 0
