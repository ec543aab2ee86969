"""DSpark config: the one place its defaults live (``conf/method/dspark.yaml`` only selects it)."""

from __future__ import annotations

from dataclasses import dataclass

from ..dflash.config import DFlashConfig


@dataclass
class DSparkConfig(DFlashConfig):
    """DFlash's settings (the parallel backbone) and DSpark's own heads."""

    name: str = "dspark"
    #: slots per block: [last accepted token, mask x 6]: 6 tokens drafted per forward (the
    #: paper's blocks are 5-7)
    block_size: int = 7
    #: rank r of the Markov head: the previous token's r-wide embedding (V x r) projected to a
    #: bias over the draft vocabulary (r x Vd), added to the backbone's logits slot by slot
    markov_rank: int = 64
    #: the confidence head: a per-slot estimate of the probability that the target accepts the
    #: slot's token given the slots before it were (a schedule reads it, as gamma or goodput)
    confidence_head: bool = True
    #: its input: the slot's state and the previous token's Markov embedding (True) or the
    #: state alone
    confidence_with_markov: bool = True
    #: weight of the confidence head's binary cross-entropy in the loss
    confidence_weight: float = 0.1
