"""P-EAGLE (arXiv 2602.01469): an EAGLE-3 head that drafts K tokens in one forward.

Slot 0 is EAGLE-3's step (the fused target features with the next token); slots 1..K-1 read
the mask token's embedding and one learned vector ``mask_hidden`` (3H, fused by ``fc`` like real
features) in place of the token and features they have not seen, at the next K-1 positions,
causal within the group. One head forward over [committed pairs, K-1 mask slots] gives K draft
tokens. Training runs the K depths with the decode-time attention pattern (EAGLE-3's
training-time-test layout, each depth reading the mask inputs instead of the previous depth's
output), with depth d trained on a random share max(r^d, r_min) of its positions (the paper's
depth sampling; here it thins the loss, the forward still covers every position).

Everything else (fused layers, draft vocabulary, soft CE) is EAGLE-3's. Exported in vLLM
speculators' ``peagle`` layout, which vLLM serves as EAGLE-3 with ``parallel_drafting``.
"""

from __future__ import annotations

import torch
from torch import nn
from transformers import DynamicCache

from ..base import DecodeSettings, DraftError
from ..eagle.model import Eagle3Head, TTTLayout
from ..target import TargetError
from .config import PEagleConfig


class PEagleHead(Eagle3Head):
    config_class = PEagleConfig

    def __init__(self, target, cfg: PEagleConfig):
        if cfg.ttt_steps < 2:
            raise DraftError(
                f"method.ttt_steps={cfg.ttt_steps}: P-EAGLE drafts K = ttt_steps tokens per "
                "forward; K >= 2 (K = 1 is EAGLE-3)"
            )
        if not (0 < cfg.depth_keep <= 1 and 0 < cfg.depth_keep_min <= 1):
            raise DraftError(
                f"method.depth_keep={cfg.depth_keep}, method.depth_keep_min="
                f"{cfg.depth_keep_min}: both must be in (0, 1]"
            )
        try:
            mask_id = target.mask_token_id(cfg.mask_token_id)
        except TargetError as e:
            raise DraftError(str(e)) from None
        # validation scores the K positions one forward drafts
        val = min(cfg.val_positions, cfg.ttt_steps)
        cfg = type(cfg)(**{**cfg.__dict__, "mask_token_id": mask_id, "val_positions": val})
        super().__init__(target, cfg)
        H = target.hidden_size
        self.mask_hidden = nn.Parameter(torch.randn(1, 1, 3 * H) * 0.02)

    def mask_inputs(self, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """What an unseen slot reads: (hidden (n, H), token embedding (n, H))."""
        h = self.initial_hidden(self.mask_hidden.view(1, 3, -1)).expand(n, -1)
        dev = self.mask_hidden.device
        e = self._embed(torch.full((1,), self.cfg.mask_token_id, device=dev)).expand(n, -1)
        return h, e

    def unroll(self, feats, input_ids, attention_mask, steps):
        """Depth 1 at start s reads (f_s, x_{s+1}) and predicts x_{s+2}; depth j reads the mask
        inputs at position s + j - 1 and predicts x_{s+j+1}, attending to the real context up
        to s and to its own group's earlier depths. Returns ``steps`` tensors (B, T-1, H)."""
        B, T, H = feats.shape
        S = T - 1
        layout = TTTLayout(S, attention_mask[:, :S].bool(), self.target.draft_window)
        pos = torch.arange(S, device=feats.device)
        cache = DynamicCache() if steps > 1 else None
        emb = self._embed(input_ids[:, 1 : 1 + S])
        outs = [self.step(feats[:, :S], emb, pos.expand(B, S), None, cache, ttt=layout)]
        if steps > 1:
            hm, em = self.mask_inputs(1)
            hm, em = hm.expand(B, S, H), em.to(hm.dtype).expand(B, S, H)
            for j in range(2, steps + 1):
                outs.append(self.step(hm, em, (pos + j - 1).expand(B, S), None, cache, ttt=layout))
        return outs

    def train_masks(self, masks: list[torch.Tensor]) -> list[torch.Tensor]:
        out = [masks[0]]
        r, r_min = self.cfg.depth_keep, self.cfg.depth_keep_min
        for d, m in enumerate(masks[1:], start=1):
            keep = max(r**d, r_min)
            out.append(m & (torch.rand(m.shape, device=m.device) < keep) if keep < 1 else m)
        return out

    def export_checks(self) -> dict[str, DecodeSettings]:
        return {"chain": DecodeSettings(tree="chain")}

    def proposer(self, settings: DecodeSettings | None = None):
        """One head forward drafts up to K = ``ttt_steps`` tokens, verified as a chain."""
        from .proposer import PEagleProposer

        s = settings or DecodeSettings()
        if s.tree not in ("chain", "auto"):
            raise ValueError(
                f"tree={s.tree!r}: a P-EAGLE head drafts its K tokens in one forward (a "
                "chain); it was not trained to draft a tree step by step"
            )
        return PEagleProposer(self)
