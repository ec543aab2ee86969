"""Falcon (Gao et al. 2024, arXiv 2412.12639): a semi-autoregressive feature-level drafter.

The head reads, at each position t, the target's feature f_t and the next token x_{t+1}
([f_t; e(x_{t+1})], 2H), runs them through a 2-layer LSTM, then one decoder layer of the
target's architecture whose attention is *relaxed causal*: positions come in blocks of k,
and a block reads the context before it and its whole self. The output at t predicts the
feature f_{t+k}; the target's frozen LM head turns it into a token, so the block that ends at
the last committed position drafts k tokens in one forward, and the next forward reads those
k predicted (feature, token) pairs as its block: k tokens per draft forward.

Training is CSGD (Coupled Sequential Glancing Distillation), both passes trained:

- pass 1 reads the real features and tokens (uniform feature noise), blocks at a random
  offset so every alignment is trained (decoding puts a block boundary wherever the
  committed text ends);
- pass 2 reads, in each block, what pass 1 predicted for it (the previous block's
  predicted features and their argmax tokens: what the second draft forward reads at
  decode time) after the real context, except that the first round(lambda * mismatches)
  inputs of a block are revealed from the data (glancing: the more pass 1 got wrong, the
  more is revealed), lambda = glance * (1 - training progress).

Loss per pass: w_reg * SmoothL1(f_hat, f) + w_cls * (kl_share * KL(target || draft) +
(1 - kl_share) * CE(data token)), the token terms fused into one soft cross-entropy against
the mixture of the target's distribution and the data token.

Where this departs from the reference code (Bestpay-inc/Falcon, read for its facts): there the
LSTM is an ``nn.LSTM`` without ``batch_first``, so over a (1, T, 2H) input it recurs over the
batch axis and each position passes two gated steps from a zero state; here it recurs over
positions, as the paper describes ("retains information about past tokens"), stepped in Python
(LSTMCell) so pass 2 can start each block from pass 1's state. The reference's glanced pass
substitutes ground truth at sampled single positions and never feeds the first pass's
predictions as inputs; here pass 2 feeds them, as the second draft forward reads them at
decode time, and glancing reveals data instead. Its input is [embedding; feature], its first
layer has no input norm, and its tree combines per-slot top-k ranks from a fixed list; here the
first slot of each block branches. No serving engine reads Falcon heads (the reference's own
forward does not run as published: ``self.lstm(...)`` lacks its ``[0]``), so there is no export.
"""

from __future__ import annotations

import math
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from ..base import (
    DecodeSettings,
    DraftError,
    DraftMethod,
    StepOutput,
    load_weights_draft,
    metric,
    save_weights_draft,
)
from ..blocks import context_kv, layer_over_blocks, rope
from ..losses import linear_soft_cross_entropy, soft_cross_entropy_probs
from ..target import Target
from .config import FalconConfig

LSTMState = list[tuple[torch.Tensor, torch.Tensor]]  # per layer (h, c), each (N, H)


class FalconHead(DraftMethod):
    """``lstm`` (LSTM cells, 2H -> H then H -> H) + ``layer`` (the target's decoder layer
    class, relaxed-causal attention); the target's embedding and LM head by reference."""

    config_class = FalconConfig
    feature_layers = (-1,)

    def __init__(self, target: Target, cfg: FalconConfig):
        super().__init__()
        if cfg.k < 1 or cfg.lstm_layers < 1:
            raise DraftError(
                f"method.k={cfg.k}, method.lstm_layers={cfg.lstm_layers}: both must be >= 1 "
                "(k: tokens per draft forward)"
            )
        if not (0 <= cfg.glance <= 1 and 0 <= cfg.kl_share <= 1):
            raise DraftError(
                f"method.glance={cfg.glance}, method.kl_share={cfg.kl_share}: both in [0, 1]"
            )
        H = target.hidden_size
        self.cfg = cfg
        self.lstm = nn.ModuleList(
            nn.LSTMCell(2 * H if i == 0 else H, H) for i in range(cfg.lstm_layers)
        )
        self.layer = target.new_decoder_layer(0)
        object.__setattr__(self, "target", target)
        object.__setattr__(self, "_lam", cfg.glance)

    def set_progress(self, fraction: float) -> None:
        object.__setattr__(self, "_lam", self.cfg.glance * (1.0 - min(max(fraction, 0.0), 1.0)))

    # -- pieces --------------------------------------------------------------------------

    def _dtype(self) -> torch.dtype:
        w = self.lstm[0].weight_ih
        if torch.is_autocast_enabled(w.device.type):
            return torch.get_autocast_dtype(w.device.type)
        return w.dtype

    def inputs(self, feats: torch.Tensor, next_ids: torch.Tensor) -> torch.Tensor:
        """[f_t; e(x_{t+1})]: feats (..., H), next_ids (...) -> (..., 2H)."""
        e = self.target.embed_tokens(next_ids.to(self.target.device))
        dt = self._dtype()
        return torch.cat([feats.to(dt), e.to(dt)], -1)

    def run_lstm(
        self, x: torch.Tensor, state: LSTMState | None = None, real: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, list[tuple[torch.Tensor, torch.Tensor]]]:
        """The LSTM over x (N, L, 2H) from ``state`` (zeros: None). ``real`` (N, L) bool: a
        step where it is False is padding, the row's states pass it unchanged (None: all
        real). Returns its output (N, L, H) and every layer's states at every step
        [(h (N, L, H), c (N, L, H))]."""
        N, L, _ = x.shape
        H = self.lstm[0].hidden_size
        every = []
        for i, cell in enumerate(self.lstm):
            h, c = state[i] if state is not None else (x.new_zeros(N, H), x.new_zeros(N, H))
            hs, cs = [], []
            for t in range(L):
                h1, c1 = cell(x[:, t], (h.to(x.dtype), c.to(x.dtype)))
                if real is not None:
                    keep = real[:, t, None]
                    h1, c1 = (
                        torch.where(keep, h1, h.to(h1.dtype)),
                        torch.where(keep, c1, c.to(c1.dtype)),
                    )
                h, c = h1, c1
                hs.append(h)
                cs.append(c)
            x = torch.stack(hs, 1)
            every.append((x, torch.stack(cs, 1)))
        return x, every

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """Target LM head on features (..., H) -> (..., V), float32."""
        return self.target.logits(h)

    def argmax(self, h: torch.Tensor) -> torch.Tensor:
        c = self.cfg.lm_head_chunk
        flat = h.reshape(-1, h.shape[-1])
        out = [self.logits(flat[i : i + c]).argmax(-1) for i in range(0, len(flat), c)]
        return torch.cat(out).view(h.shape[:-1]) if out else flat.new_zeros(0, dtype=torch.long)

    def context(self, xs: torch.Tensor, pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The layer's keys/values of LSTM outputs xs (B, T, H) at positions pos (B, T)."""
        cos, sin = rope(self.target.rotary_embedding(), xs, pos)
        return context_kv(self.layer, self.layer.input_layernorm(xs), cos, sin)

    def attend(self, xb, posb, kv, allowed, blk_valid=None) -> torch.Tensor:
        """The layer over blocks xb (B, A, S, H) at positions posb (B, A, S)."""
        B, A, S, _ = xb.shape
        cos, sin = rope(self.target.rotary_embedding(), xb, posb.reshape(B, A * S))
        cos, sin = cos.view(B, A, S, -1), sin.view(B, A, S, -1)
        return layer_over_blocks(self.layer, xb, cos, sin, kv, allowed, blk_valid)

    # -- the two passes ----------------------------------------------------------------------

    def passes(
        self,
        f: torch.Tensor,
        ids: torch.Tensor,
        attn: torch.Tensor,
        off: int,
        lam: float,
        noise: float,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Pass 1 and the glanced pass 2 over every block, blocks starting at positions
        = off (mod k). f (B, T, H); ids, attn (B, T). Returns (out1, out2) (B, S, H), S = T - 1,
        out[t] predicting f_{t+k}, and pass 1's argmax tokens (B, S) (the token after
        f_{t+k})."""
        B, T, H = f.shape
        S, k, dev = T - 1, self.cfg.k, f.device
        pad = (k - off) % k
        nb = math.ceil((S + pad) / k)
        tot = nb * k
        x_in = f[:, :S].to(self._dtype())
        if noise > 0:
            x_in = x_in + (torch.rand_like(x_in) - 0.5) * noise
        xs, states = self.run_lstm(self.inputs(x_in, ids[:, 1:]))
        pos = torch.arange(S, device=dev)
        kv = self.context(xs, pos.expand(B, S))
        slot = torch.arange(tot, device=dev) - pad  # the position of each block slot
        in_range = (slot >= 0) & (slot < S)
        posb = slot.clamp(0, S - 1).view(nb, k).expand(B, nb, k)
        starts = torch.arange(nb, device=dev) * k - pad
        allowed = (pos < starts[:, None])[None] & attn[:, None, :S].bool()  # (B, nb, S)
        blk_valid = in_range.view(1, nb, k).expand(B, nb, k)

        def blocks(x):  # (B, S, ...) -> (B, nb, k, ...)
            z = x.new_zeros(B, tot, *x.shape[2:])
            z[:, pad : pad + S] = x
            return z.view(B, nb, k, *x.shape[2:])

        def unblock(y):
            return y.reshape(B, tot, -1)[:, pad : pad + S]

        out1 = unblock(self.attend(blocks(xs), posb, kv, allowed, blk_valid))
        # pass 2: block inputs at u >= k are pass 1's prediction for u, (f_hat_u, x_hat_{u+1})
        with torch.no_grad():
            pred_tok = self.argmax(out1)  # (B, S): after f_hat_{t+k}, i.e. x_hat_{t+k+1}
        f2 = torch.cat([f[:, :k].to(out1.dtype), out1[:, : S - k].detach()], 1)[:, :S]
        t2 = torch.cat([ids[:, 1 : k + 1], pred_tok[:, : S - k]], 1)[:, :S]
        predicted = torch.zeros(B, S, dtype=torch.bool, device=dev)
        predicted[:, k:] = True
        miss = predicted & (t2 != ids[:, 1:]) & attn[:, 1:].bool()
        # glancing: reveal the first round(lam * mismatches) inputs of each block
        missb = blocks(miss.long()).sum(-1)  # (B, nb)
        reveal = torch.round(lam * missb.float()).long()
        rank = torch.arange(k, device=dev).expand(B, nb, k)
        real = unblock((rank < reveal[..., None]).float()[..., None])[..., 0] > 0
        use_pred = predicted & ~real
        f2 = torch.where(use_pred[..., None], f2, f[:, :S].to(f2.dtype))
        t2 = torch.where(use_pred, t2, ids[:, 1:])
        # each block's LSTM starts from pass 1's state just before it (the real context)
        prev = (starts - 1).clamp(min=0)
        init = []
        for h_all, c_all in states:
            h0, c0 = h_all[:, prev], c_all[:, prev]  # (B, nb, H)
            zero = (starts < 1)[None, :, None]
            init.append(
                (h0.masked_fill(zero, 0.0).flatten(0, 1), c0.masked_fill(zero, 0.0).flatten(0, 1))
            )
        xb2, _ = self.run_lstm(blocks(self.inputs(f2, t2)).flatten(0, 1), init)
        out2 = unblock(self.attend(xb2.view(B, nb, k, -1), posb, kv, allowed, blk_valid))
        return out1, out2, pred_tok

    def targets_ok(self, ids, attn, lm) -> torch.Tensor:
        """(B, S) bool: out[t] is trained/scored (f_{t+k} exists and the token after it is a
        real assistant token)."""
        B, T = ids.shape
        k, S = self.cfg.k, T - 1
        ok = torch.zeros(B, S, dtype=torch.bool, device=ids.device)
        if S - k > 0:
            nxt = lm.bool() & attn.bool()
            ok[:, : S - k] = nxt[:, k + 1 :] & attn[:, : S - k].bool()
        return ok

    def pass_loss(self, h, f_next, x_next, metrics, tag):
        """w_reg * SmoothL1 + w_cls * soft CE against kl_share * p_target + (1 - kl_share) *
        onehot(data token). h, f_next (n, H); x_next (n,)."""
        n = h.shape[0]
        reg = F.smooth_l1_loss(h.float(), f_next.float())
        w = self.target.lm_head.weight
        with torch.no_grad():
            t_logits = self.logits(f_next)
            t_arg = t_logits.argmax(-1)
            p = t_logits.softmax(-1).mul_(self.cfg.kl_share)
            p[torch.arange(n, device=p.device), x_next] += 1.0 - self.cfg.kl_share
            del t_logits
        if self.target.logit_softcap is None:  # the frozen LM head and the soft CE, fused
            cls, _, d_arg = linear_soft_cross_entropy(
                h.to(w.dtype), w, p, torch.arange(n, device=h.device)
            )
        else:  # a capped head goes unfused
            d_logits = self.logits(h)
            cls, d_arg = soft_cross_entropy_probs(d_logits, p), d_logits.argmax(-1)
        metrics[f"loss_reg{tag}"] = metric(reg.detach() * n, n)
        metrics[f"loss_cls{tag}"] = metric(cls.detach() * n, n)
        metrics[f"acc{tag}"] = metric((d_arg == t_arg).float().sum(), n)
        return self.cfg.w_reg * reg + self.cfg.w_cls * cls

    def forward(self, batch: dict[str, torch.Tensor]) -> StepOutput:
        f = batch["features"][:, :, 0]
        ids, attn, lm = batch["input_ids"], batch["attention_mask"], batch["loss_mask"]
        k = self.cfg.k
        off = int(torch.randint(k, ()))
        out1, out2, _ = self.passes(f, ids, attn, off, self._lam, self.cfg.noise)
        ok = self.targets_ok(ids, attn, lm)
        b, t = ok.nonzero(as_tuple=True)
        metrics: dict[str, torch.Tensor] = {"glance": metric(self._lam, 1)}
        if len(b) == 0:
            return StepOutput(loss=(out1.sum() + out2.sum()) * 0.0, metrics=metrics)
        f_next, x_next = f[b, t + k], ids[b, t + k + 1]
        loss = self.pass_loss(out1[b, t], f_next, x_next, metrics, "1")
        loss = loss + self.pass_loss(out2[b, t], f_next, x_next, metrics, "2")
        metrics["acc"] = metrics["acc1"]
        return StepOutput(loss=loss, metrics=metrics)

    # -- evaluation ----------------------------------------------------------------------

    @torch.no_grad()
    def evaluate(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Agreement with the target's argmax at draft positions 1..val_positions, as a greedy
        chain drafts them: positions 1..k from the block that ends at the last committed
        position (pass 1), k+1..2k from the next forward reading those predictions (pass 2
        without glancing); every block alignment is run, so every position is a start."""
        f = batch["features"][:, :, 0]
        ids, attn, lm = batch["input_ids"], batch["attention_mask"], batch["loss_mask"]
        B, T = ids.shape
        k, S = self.cfg.k, T - 1
        K = min(self.cfg.val_positions, 2 * k)
        out = {f"{m}_pos{j}": metric(0.0, 0) for m in ("top1", "alpha") for j in range(1, K + 1)}
        t_arg = self.argmax(f)  # (B, T): the target's next token after each position
        ok_tok = lm.bool() & attn.bool()
        for off in range(k):
            out1, out2, _ = self.passes(f, ids, attn, off, 0.0, 0.0)
            d1, d2 = self.argmax(out1), self.argmax(out2)
            # a start e = the last position of a block (e + 1 = off mod k, e >= k - 1)
            e = torch.arange(S, device=ids.device)
            starts = e[((e + 1 - off) % k == 0) & (e >= k - 1)]
            agree_so_far = None
            for j in range(1, K + 1):
                # draft j predicts x_{e+1+j}: slot (j-1) % k of block (j-1)//k after e
                src = e_pos = starts - (k - 1) + (j - 1) % k + (k if j > k else 0)
                d = d1 if j <= k else d2
                inside = (src < S) & (starts + j + 1 < T)
                e_pos = e_pos.clamp(max=S - 1)
                tgt = (starts + j).clamp(max=T - 1)  # f_{e+j} gives x_{e+j+1}
                valid = inside[None] & ok_tok[:, (starts + j + 1).clamp(max=T - 1)]
                if j == 1:  # the draft starts inside a reply
                    valid &= ok_tok[:, (starts + 1).clamp(max=T - 1)]
                    agree_so_far = valid.clone()
                    first_valid = valid
                valid &= first_valid
                agree = d[:, e_pos] == t_arg[:, tgt]
                cond = valid & agree_so_far
                out[f"top1_pos{j}"] += metric(agree[valid].float().sum(), valid.sum())
                out[f"alpha_pos{j}"] += metric(agree[cond].float().sum(), cond.sum())
                agree_so_far = cond & agree
        return out

    # -- decoding ------------------------------------------------------------------------

    def proposer(self, settings: DecodeSettings | None = None):
        """A chain of ceil(gamma / k) forwards (``tree=chain``/``auto``), or Falcon's tree
        (``tree=dynamic``: ``depth`` forwards, the first slot of each block branching into its
        ``top_k`` tokens, the best ``total_tokens`` nodes verified)."""
        from .proposer import FalconProposer, FalconTreeProposer

        s = settings or DecodeSettings()
        if s.tree == "dynamic":
            return FalconTreeProposer(self, s.depth, s.top_k, s.total_tokens)
        if s.tree not in ("chain", "auto"):
            raise ValueError(f"tree={s.tree!r}: a Falcon head drafts a chain or tree=dynamic")
        return FalconProposer(self)

    def export_checks(self) -> dict[str, DecodeSettings]:
        return {
            "chain": DecodeSettings(tree="chain"),
            "tree": DecodeSettings(tree="dynamic", depth=3, top_k=3, total_tokens=12),
        }

    # -- save / load ---------------------------------------------------------------------

    def save_draft(self, path: str | Path) -> None:
        save_weights_draft(self, path, 1)

    @classmethod
    def load_draft(cls, path: str | Path, target: Target) -> FalconHead:
        return load_weights_draft(cls, path, target)
