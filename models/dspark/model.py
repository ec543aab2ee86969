"""DSpark (2026): a semi-autoregressive drafter. DFlash's parallel backbone drafts a whole block
in one forward; a small Markov head restores the dependency inside the block (slot i's logits
gain a low-rank bias from the token drafted at slot i - 1, so the slots are chosen one after
another at almost no cost); a confidence head predicts each slot's acceptance.

Loss (on DFlash's random anchors and slot weights): soft cross-entropy of the backbone's
logits plus the Markov bias of the previous token (the data's, teacher-forced) against the
target's distribution over the draft vocabulary, plus ``confidence_weight`` times the binary
cross-entropy of the confidence head against whether the slot's argmax is the target's. The
Markov projection starts at zero, so an untrained DSpark drafts as its DFlash backbone does.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..base import DraftError, metric
from ..dflash.model import DFlashDraft
from ..quant import input_dtype
from ..target import Target
from .config import DSparkConfig


class MarkovHead(nn.Module):
    """``markov_w1`` (V, r): the previous token's embedding; ``markov_w2`` (r -> Vd): its bias
    over the draft vocabulary (the names vLLM's DSpark loader reads)."""

    def __init__(self, vocab_size: int, draft_vocab_size: int, rank: int):
        super().__init__()
        self.markov_w1 = nn.Embedding(vocab_size, rank)
        self.markov_w2 = nn.Linear(rank, draft_vocab_size, bias=False)
        nn.init.normal_(self.markov_w1.weight, std=rank**-0.5)
        nn.init.zeros_(self.markov_w2.weight)

    def embed(self, prev: torch.Tensor) -> torch.Tensor:
        return self.markov_w1(prev)

    def bias(self, e: torch.Tensor) -> torch.Tensor:
        return self.markov_w2(e.to(input_dtype(self.markov_w2))).float()


class DSparkDraft(DFlashDraft):
    config_class = DSparkConfig
    sequential = True  # every slot reads the token drafted before it
    #: the confidence schedule (``stop=confidence``): None (off), or the least running product
    #: of the slots' acceptance estimates a proposed slot may have
    stop_threshold: float | None = None

    def __init__(self, target: Target, cfg: DSparkConfig):
        if cfg.correction != "none":
            raise DraftError(
                f"method.correction={cfg.correction!r}: DSpark's slots read the previous token "
                "through its Markov head; Domino's GRU correction is method=domino"
            )
        super().__init__(target, cfg)
        if cfg.markov_rank < 1:
            raise DraftError(f"method.markov_rank={cfg.markov_rank}: must be >= 1")
        if cfg.confidence_weight < 0:
            raise DraftError(f"method.confidence_weight={cfg.confidence_weight}: must be >= 0")
        V, H = target.config.vocab_size, target.hidden_size
        self.markov_head = MarkovHead(V, self.cfg.draft_vocab_size, cfg.markov_rank)
        if cfg.confidence_head:
            width = H + (cfg.markov_rank if cfg.confidence_with_markov else 0)
            self.confidence = nn.Linear(width, 1, bias=True)

    def prefix_states(self, tokens: torch.Tensor) -> torch.Tensor:
        """Each token's Markov embedding (..., n, r): slot i + 1 reads token i's."""
        return self.markov_head.embed(tokens.to(self.markov_head.markov_w1.weight.device))

    def slot_logits(self, h: torch.Tensor, state: torch.Tensor, slot=None) -> torch.Tensor:
        """The backbone's logits plus the Markov bias of the previous token's embedding."""
        return self.draft_logits(h) + self.markov_head.bias(state)

    def confidence_logits(self, h: torch.Tensor, state: torch.Tensor) -> torch.Tensor:
        """Slots (..., H) with their previous tokens' Markov embeddings (..., r) -> the logit
        of their acceptance (...)."""
        x = self.norm(h)
        if self.cfg.confidence_with_markov:
            x = torch.cat([x, state.to(x.dtype)], -1)
        return self.confidence(x.to(input_dtype(self.confidence))).squeeze(-1).float()

    def confidence_stop(self, threshold: float | None) -> None:
        """Propose each block's slots only while the product of their estimated acceptance
        probabilities (given the slots before them accepted) stays >= ``threshold``; None: off.
        A stop that reads only the draft's own outputs keeps decoding exact."""
        if threshold is not None and not self.cfg.confidence_head:
            raise DraftError(
                "this DSpark draft was trained without a confidence head "
                "(method.confidence_head=false)"
            )
        self.stop_threshold = threshold

    def confident_lengths(self, h, prev, j, ks):
        if self.stop_threshold is None:
            return ks
        toks = j + self.d2t[j]  # (R, K) target ids
        before = torch.cat([prev[:, None].to(toks.device), toks[:, :-1]], 1)
        c = torch.sigmoid(self.confidence_logits(h, self.prefix_states(before)))
        keep = (c.cumprod(-1) >= self.stop_threshold).sum(-1).tolist()  # a leading run
        return [min(k, m) for k, m in zip(ks, keep, strict=True)]

    def extra_loss(self, hs, state, hit):
        if not self.cfg.confidence_head:
            return None, {}
        z = self.confidence_logits(hs, state)
        bce = F.binary_cross_entropy_with_logits(z, hit)
        with torch.no_grad():
            called = ((z > 0).float() == hit).float().sum()
        n = len(hit)
        return self.cfg.confidence_weight * bce, {
            "loss_conf": metric(bce.detach() * n, n),
            "conf_acc": metric(called, n),
        }
