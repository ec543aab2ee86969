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
        return self.markov_w2(e.to(self.markov_w2.weight.dtype)).float()


class DSparkDraft(DFlashDraft):
    config_class = DSparkConfig
    sequential = True

    def __init__(self, target: Target, cfg: DSparkConfig):
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

    def slot_logits(self, h: torch.Tensor, prev: torch.Tensor) -> torch.Tensor:
        """The backbone's logits plus the Markov bias of the previous token (target ids)."""
        e = self.markov_head.embed(prev.to(self.markov_head.markov_w1.weight.device))
        return self.draft_logits(h) + self.markov_head.bias(e)

    def confidence_logits(self, h: torch.Tensor, prev: torch.Tensor) -> torch.Tensor:
        """Slots (..., H) with previous tokens (...) -> the logit of their acceptance (...)."""
        x = self.norm(h)
        if self.cfg.confidence_with_markov:
            x = torch.cat([x, self.markov_head.embed(prev).to(x.dtype)], -1)
        w = self.confidence.weight
        return self.confidence(x.to(w.dtype)).squeeze(-1).float()

    def extra_loss(self, hs, prev, hit):
        if not self.cfg.confidence_head:
            return None, {}
        z = self.confidence_logits(hs, prev)
        bce = F.binary_cross_entropy_with_logits(z, hit)
        with torch.no_grad():
            called = ((z > 0).float() == hit).float().sum()
        n = len(hit)
        return self.cfg.confidence_weight * bce, {
            "loss_conf": metric(bce.detach() * n, n),
            "conf_acc": metric(called, n),
        }
