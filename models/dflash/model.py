"""DFlash (arXiv 2602.06036): a block drafter conditioned on the target's features.

A few decoder layers of the target's own architecture, with no embedding or LM head of their
own (the target's, frozen, never saved with the draft). Features of N target layers are fused
into one context vector per position, ``hidden_norm(fc([f_1; ...; f_N]))``, and in EVERY draft
layer their key/value projections (that layer's own ``k_proj``/``v_proj``, RoPE at the context
positions, no input norm) are prepended to the block's keys and values; queries come only from
the block. A block is ``[last accepted token, mask x (B - 1)]`` at positions p..p+B-1; it reads
the context strictly before p and itself bidirectionally, and slot k predicts the token at
p + k, so one forward drafts B - 1 tokens.

Training: random anchors on assistant positions, every block of a batch in one masked pass;
slot k's cross-entropy against the target's distribution at p + k - 1 (soft) or its argmax
(hard), weighted exp(-(k - 1) / decay), or another ``method.loss`` (the LK losses; D-PACE's
acceptance-length weights). The draft scores a reduced vocabulary: the frozen target LM head's
rows for the most frequent assistant tokens (``d2t``/``t2d`` as EAGLE-3's).

Domino (``method=domino``, ``method.correction=gru``): a GRU over the block's tokens so far and
a small MLP add a correction to each slot's logits from ``corrected_from`` on, so slot k reads
the tokens chosen at slots 0..k-1 and a block is drafted slot after slot (``sequential``), at
the cost of a GRU step per slot. DSpark (``models/dspark``) is the same shape with a Markov head.

Sections: attention, module, training, evaluation, decoding, save/load.
"""

from __future__ import annotations

from dataclasses import asdict
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
    read_draft_config,
    save_weights_draft,
)
from ..blocks import context_kv, layer_over_blocks, rope
from ..eagle.model import VOCAB_CHOSEN, assistant_token_counts, draft_vocab, saved_vocab_chosen
from ..losses import (
    acceptance_probs,
    check_head_loss,
    dpace_weights,
    head_loss,
    linear_soft_cross_entropy,
    soft_cross_entropy,
)
from ..quant import input_dtype, quantize_linears
from ..ragged import within_window
from ..sampling import sample, warp
from ..target import Target, TargetError, layer_shape
from .config import DFlashConfig, DominoConfig

# ---------------------------------------------------------------------------------------------
# Training helpers


def slot_weights(block_size: int, decay: float) -> torch.Tensor:
    """Loss weight of slots 1..B-1: exp(-(k - 1) / decay), (B - 1,) float32."""
    k = torch.arange(1, block_size, dtype=torch.float32)
    return torch.exp(-(k - 1) / decay)


def sample_anchors(
    ok: torch.Tensor, n: int, generator: torch.Generator | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Up to ``n`` random block starts per row among positions where ``ok`` (B, T) is True,
    sorted: (anchors (B, n') int64, valid (B, n') bool), n' = min(n, T); a row with fewer
    candidates has its extra anchors marked invalid."""
    B, T = ok.shape
    n = min(n, T)
    r = torch.rand(B, T, device=ok.device, generator=generator)
    r = r.masked_fill(~ok, -1.0)
    top = r.topk(n, dim=1)
    anchors, valid = top.indices, top.values >= 0
    order = anchors.masked_fill(~valid, T).argsort(dim=1)
    return anchors.gather(1, order), valid.gather(1, order)


# ---------------------------------------------------------------------------------------------
# Module


def qwen3_layer_config(target: Target, num_layers: int):
    """A Qwen3 config with the target's sizes and RoPE (the draft layers read positions as the
    target does): what DFlash's draft layers are built from and what an export declares."""
    return target.draft_layer_config("qwen3", num_layers)


class GRUCorrection(nn.Module):
    """Domino's logit correction: ``prefix_gru`` (H -> G, no biases) over the target embeddings
    of a block's tokens, and ``embed_proj`` = Linear(H + G -> E), SiLU, Linear(E -> Vd) of
    [normed slot state; GRU state], added to the slot's logits. The last projection starts at
    zero: an untrained correction drafts as the DFlash backbone does."""

    def __init__(self, hidden: int, draft_vocab: int, gru_hidden: int, dim: int):
        super().__init__()
        self.prefix_gru = nn.GRU(hidden, gru_hidden, num_layers=1, batch_first=True, bias=False)
        self.embed_proj = nn.Sequential(
            nn.Linear(hidden + gru_hidden, dim, bias=False),
            nn.SiLU(),
            nn.Linear(dim, draft_vocab, bias=False),
        )
        nn.init.zeros_(self.embed_proj[2].weight)

    def states(self, embeds: torch.Tensor) -> torch.Tensor:
        """(..., n, H) embeddings of a block's first n tokens -> (..., n, G) the GRU's state
        after each."""
        w = self.prefix_gru.weight_ih_l0
        lead = embeds.shape[:-2]
        x = embeds.reshape(-1, *embeds.shape[-2:]).to(w.dtype)
        out, _ = self.prefix_gru(x)
        return out.reshape(*lead, *out.shape[-2:])

    def forward(self, hn: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
        dt = input_dtype(self.embed_proj[0])
        return self.embed_proj(torch.cat([hn.to(dt), g.to(dt)], -1)).float()


class DFlashDraft(DraftMethod):
    """``fc`` + ``hidden_norm`` over the fused features, ``layers`` (the target's decoder
    layer class), a final ``norm``; the target's embedding and LM head by reference. Parameter
    names follow speculators' DFlash layout, so export is a rename-free copy."""

    config_class = DFlashConfig

    def __init__(self, target: Target, cfg: DFlashConfig):
        nn.Module.__init__(self)
        H, L, V = target.hidden_size, target.num_layers, target.config.vocab_size
        if cfg.block_size < 2:
            raise DraftError(
                f"method.block_size={cfg.block_size}: a block is [last token, mask x (B-1)], "
                "so B >= 2 (B - 1 tokens drafted per forward)"
            )
        if cfg.num_layers < 1:
            raise DraftError(f"method.num_layers={cfg.num_layers}: must be >= 1")
        if cfg.anchors < 1 or cfg.decay <= 0:
            raise DraftError(
                f"method.anchors={cfg.anchors}, method.decay={cfg.decay}: need anchors >= 1, "
                "decay > 0"
            )
        if cfg.layer_arch not in ("qwen3", "target"):
            raise DraftError(f"method.layer_arch={cfg.layer_arch!r}: use qwen3 or target")
        if cfg.targets not in ("soft", "hard"):
            raise DraftError(f"method.targets={cfg.targets!r}: use soft or hard")
        check_head_loss(cfg.loss, ("dpace",))
        if cfg.correction not in ("none", "gru"):
            raise DraftError(
                f"method.correction={cfg.correction!r}: use none (DFlash) or gru (Domino)"
            )
        if cfg.correction == "gru" and min(cfg.gru_hidden, cfg.correction_dim) < 1:
            raise DraftError(
                f"method.gru_hidden={cfg.gru_hidden}, method.correction_dim="
                f"{cfg.correction_dim}: both must be >= 1"
            )
        if not 1 <= cfg.corrected_from:
            raise DraftError(f"method.corrected_from={cfg.corrected_from}: slots start at 1")
        if cfg.fuse_layers is None:  # 5 spaced uniformly over 1..L-3 (fewer on tiny targets)
            hi = max(1, L - 3)
            fuse = sorted({round(1 + i * (hi - 1) / 4) for i in range(5)})
        else:
            fuse = list(cfg.fuse_layers)
            if not fuse:
                raise DraftError("method.fuse_layers=[]: fuse at least one target layer")
        try:
            fuse = sorted({target.layer_index(i) for i in fuse})
            mask_id = target.mask_token_id(cfg.mask_token_id)
        except TargetError as e:
            raise DraftError(str(e)) from None
        dv = cfg.draft_vocab_size or min(32768, max(1024, round(V / 4 / 1024) * 1024))
        dv = min(dv, V)
        if dv < 2:
            raise DraftError(f"method.draft_vocab_size={dv}: must be >= 2")
        self.cfg = cfg = type(cfg)(
            **{
                **asdict(cfg),
                "fuse_layers": fuse,
                "mask_token_id": mask_id,
                "draft_vocab_size": dv,
            }
        )
        # the fused layers, then the target's final (normed) state for the soft labels
        self.feature_layers = (*fuse, -1)
        self.fc = nn.Linear(len(fuse) * H, H, bias=False)
        from transformers.models.llama.modeling_llama import LlamaRMSNorm

        norm_cls = LlamaRMSNorm  # the engines' draft norm, whatever the target's (Gemma: 1 + w)
        eps = layer_shape(target.config)["eps"]
        self.hidden_norm = norm_cls(H, eps=eps)
        if cfg.layer_arch == "qwen3":
            from transformers.models.qwen3.modeling_qwen3 import Qwen3DecoderLayer

            lc = qwen3_layer_config(target, cfg.num_layers)
            self.layers = nn.ModuleList(Qwen3DecoderLayer(lc, i) for i in range(cfg.num_layers))
        else:
            self.layers = nn.ModuleList(target.new_decoder_layer(i) for i in range(cfg.num_layers))
        self.norm = norm_cls(H, eps=eps)
        if cfg.correction == "gru":
            self.correction = GRUCorrection(H, dv, cfg.gru_hidden, cfg.correction_dim)
        self.register_buffer("d2t", torch.zeros(dv, dtype=torch.long))
        self.register_buffer("t2d", torch.zeros(V, dtype=torch.bool))
        self.t2d[:dv] = True
        self.vocab_chosen = False  # as EAGLE-3's: only the record tells the identity apart
        object.__setattr__(self, "target", target)

    def init_from_data(self, train, log=print) -> None:
        """The draft vocabulary: the ``draft_vocab_size`` most frequent assistant tokens."""
        counts = assistant_token_counts(train, self.t2d.numel())
        d2t, t2d = draft_vocab(counts, len(self.d2t))
        covered = counts[d2t + torch.arange(len(d2t))].sum() / counts.sum().clamp_min(1)
        self.d2t.copy_(d2t)
        self.t2d.copy_(t2d)
        self.vocab_chosen = True
        log(
            f"dflash: draft vocabulary {len(d2t)} of {self.t2d.numel()} tokens, covering "
            f"{covered:.1%} of {int(counts.sum())} assistant tokens in the training split"
        )

    # -- pieces --------------------------------------------------------------------------

    def _compute_dtype(self) -> torch.dtype:
        dev = self.norm.weight.device.type
        if torch.is_autocast_enabled(dev):
            return torch.get_autocast_dtype(dev)
        return self.norm.weight.dtype

    def vocab_ids(self) -> torch.Tensor:
        """Target ids of the draft vocabulary, increasing: (Vd,) int64."""
        return torch.arange(len(self.d2t), device=self.d2t.device) + self.d2t

    def lm_rows(self) -> torch.Tensor:
        """The target LM head's rows for the draft vocabulary (Vd, H), frozen. Kept while the
        vocabulary, device and dtype stay the same (a CPU gather of a 12k x 576 block is a
        large part of a draft step)."""
        w = self.target.lm_head.weight
        key = (self.d2t.data_ptr(), int(self.d2t.sum()), w.device, w.dtype, w.data_ptr())
        cached = self.__dict__.get("_lm_rows")
        if cached is None or cached[0] != key:
            cached = (key, w[self.vocab_ids().to(w.device)].detach())
            object.__setattr__(self, "_lm_rows", cached)
        return cached[1]

    def draft_logits(self, h: torch.Tensor) -> torch.Tensor:
        """The draft's logits over its vocabulary (..., H) -> (..., Vd), float32."""
        return self.target.logits(self.norm(h), self.lm_rows())

    @property
    def sequential(self) -> bool:
        """Whether a slot's logits read the tokens drafted before it in its block (Domino's
        correction, DSpark's Markov head): then slots are chosen one after another."""
        return self.cfg.correction != "none"

    def prefix_states(self, tokens: torch.Tensor) -> torch.Tensor | None:
        """What each slot reads of the tokens before it: ``tokens`` (..., n) target ids of a
        block's slots 0..n-1 (slot 0: the last accepted token) -> (..., n, C), entry i read by
        slot i + 1 (causal: it depends on tokens 0..i only); None when slots read none."""
        if self.cfg.correction == "gru":
            return self.correction.states(self.embed(tokens))
        return None

    def slot_logits(
        self, h: torch.Tensor, state: torch.Tensor | None, slot: int | torch.Tensor
    ) -> torch.Tensor:
        """Logits over the draft vocabulary (..., Vd) of slots ``slot`` (1-based; an int or
        (...)) with states (..., H) and ``prefix_states`` entries ``state`` (..., C)."""
        z = self.draft_logits(h)
        if self.cfg.correction == "gru":
            c = self.correction(self.norm(h), state)
            on = torch.as_tensor(slot, device=z.device) >= self.cfg.corrected_from
            z = z + c * on[..., None].to(c.dtype) if on.dim() else (z + c if on else z)
        return z

    def extra_loss(self, hs, state, hit) -> tuple[torch.Tensor | None, dict]:
        """A subclass's own training term over the labelled slots (states ``hs`` (n, H), their
        ``prefix_states`` entries (n, C), whether each slot's argmax is the target's ``hit``
        (n,)), and its metrics; DFlash has none."""
        return None, {}

    @torch.no_grad()
    def pick(self, h: torch.Tensor, prev: torch.Tensor, ks: list[int], sampling, generators):
        """Draft the first ``ks[r]`` slots of each row: h (R, K, H) slot states, prev (R,) the
        token before slot 1. Returns per row (target ids, their distributions over the target
        vocabulary (k, V) at T > 0 else None). Slots are independent here; a ``sequential``
        draft scores slot i from the token chosen at slot i - 1."""
        R, K = h.shape[:2]
        if sampling.greedy and not self.sequential:  # every slot at once
            j, q_own = self.draft_logits(h).argmax(-1), None
        else:  # slot by slot, each row drawing its own slots only (its batch-1 stream)
            cols, qs, toks = [], [], prev[:, None]
            for i in range(K):
                st = self.prefix_states(toks)
                z = self.slot_logits(h[:, i], None if st is None else st[:, -1], i + 1)
                j, q = self._choose(z, sampling, generators, [ks[r] > i for r in range(R)])
                cols.append(j)
                qs.append(q)
                toks = torch.cat([toks, (j + self.d2t[j])[:, None]], 1)
            j = torch.stack(cols, 1)  # (R, K)
            q_own = None if qs[0] is None else torch.stack(qs, 1)
        ks = self.confident_lengths(h, prev, j, ks)
        ids = (j + self.d2t[j]).tolist()
        out = []
        for r in range(R):
            k = ks[r]
            q = None if q_own is None or k == 0 else self.to_target_vocab(q_own[r, :k])
            out.append((ids[r][:k], q))
        return out

    def confident_lengths(self, h, prev, j, ks: list[int]) -> list[int]:
        """How many of each row's drafted slots to propose: ``ks`` as asked, unless a
        confidence schedule is on (DSpark's ``confidence_stop``). h (R, K, H) slot states,
        prev (R,) the token before slot 1, j (R, K) the draft ids chosen."""
        return ks

    def _choose(self, z: torch.Tensor, sampling, generators, draw: list[bool]):
        """One slot for every row: (draft ids (R,), their warped distributions (R, Vd) at
        T > 0 else None); a row not to ``draw`` takes no sample (its stream stays its batch-1
        one) and gets the argmax as a placeholder."""
        if sampling.greedy:
            return z.argmax(-1), None
        q = warp(z, sampling)
        j = z.argmax(-1)
        for r, g in enumerate(generators):
            if draw[r]:
                j[r] = sample(q[r], g)
        return j, q

    def to_target_vocab(self, x: torch.Tensor, fill: float = 0.0) -> torch.Tensor:
        """Values over the draft vocabulary (..., Vd) laid out over the target's (..., V)."""
        out = x.new_full((*x.shape[:-1], self.t2d.numel()), fill)
        return out.index_copy_(-1, self.vocab_ids(), x)

    def target_logits(self, f_final: torch.Tensor, draft_only: bool) -> torch.Tensor:
        """Target LM head on its final hidden states (N, H) -> (N, Vd or V), float32."""
        return self.target.logits(f_final, self.lm_rows() if draft_only else None)

    def context(self, features: torch.Tensor) -> torch.Tensor:
        """The fused context (..., N+1, H) features -> (..., H): hidden_norm(fc(concat))."""
        n = len(self.feature_layers) - 1
        f = features[..., :n, :].to(self._compute_dtype()).flatten(-2)
        return self.hidden_norm(self.fc(f))

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        return self.target.embed_tokens(ids.to(self.target.device)).to(self._compute_dtype())

    def context_kv(
        self, ctx: torch.Tensor, pos: torch.Tensor
    ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Every layer's keys and values of the context (B, T, H) at positions ``pos`` (B, T):
        [(k, v)] with k, v (B, kvh, T, D), RoPE applied to k; no input norm (the fused context
        is already normed, as the reference reads it)."""
        cos, sin = rope(self.target.rotary_embedding(), ctx, pos)
        return [context_kv(layer, ctx, cos, sin) for layer in self.layers]

    def blocks(
        self,
        x: torch.Tensor,
        pos: torch.Tensor,
        kv: list[tuple[torch.Tensor, torch.Tensor]],
        ctx_allowed: torch.Tensor | None,
    ) -> torch.Tensor:
        """The draft layers over A blocks of S slots: x (B, A, S, H) slot embeddings, pos
        (B, A, S) their positions, ``kv`` the context's per-layer keys/values
        (``context_kv``), ``ctx_allowed`` (B, A, T) (None: all). Returns (B, A, S, H), pre-norm."""
        B, A, S, _ = x.shape
        cos, sin = rope(self.target.rotary_embedding(), x, pos.reshape(B, A * S))
        cos, sin = cos.view(B, A, S, -1), sin.view(B, A, S, -1)
        for layer, lkv in zip(self.layers, kv, strict=True):
            x = layer_over_blocks(layer, x, cos, sin, lkv, ctx_allowed)
        return x

    def run_blocks(
        self,
        features: torch.Tensor,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        anchors: torch.Tensor,
    ) -> torch.Tensor:
        """Draft every block of a batch in one pass. features (B, T, N+1, H); anchors (B, A)
        block starts. Block a reads context positions < anchors[a] (real ones). Returns the
        slots' states (B, A, S, H)."""
        B, T = input_ids.shape
        S = self.cfg.block_size
        dev = input_ids.device
        ctx = self.context(features)
        kv = self.context_kv(ctx, torch.arange(T, device=dev).expand(B, T))
        tok = torch.full((B, anchors.shape[1], S), self.cfg.mask_token_id, device=dev)
        tok[:, :, 0] = input_ids.gather(1, anchors)
        pos = anchors[..., None] + torch.arange(S, device=dev)
        allowed = (torch.arange(T, device=dev) < anchors[..., None]) & attention_mask[
            :, None, :
        ].bool()
        window = self.target.draft_window
        if window is not None:  # each slot reads the context within its window, as decoding
            near = within_window(pos, torch.arange(T, device=dev), window)  # (B, A, S, T)
            allowed = allowed[:, :, None, :] & near
        return self.blocks(self.embed(tok), pos, kv, allowed)

    # -- training ------------------------------------------------------------------------

    @staticmethod
    def predicts_reply(loss_mask: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """(B, T) bool: position p's next token is a real assistant token (p's target
        distribution is a training label)."""
        ok = loss_mask.bool() & attention_mask.bool()
        return torch.cat([ok[:, 1:], ok.new_zeros(ok.shape[0], 1)], 1)

    @classmethod
    def anchors_served(cls, loss_mask: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """(B, T) bool: where a block may start, as serving starts one: at a real assistant
        token whose next token is one too. Serving anchors a block at the last committed
        token, a reply's first token at the earliest (that token is the prefill's, never
        drafted), so no block starts at the prompt's last token."""
        ok = loss_mask.bool() & attention_mask.bool()
        return cls.predicts_reply(loss_mask, attention_mask) & ok

    def _slot_rows(self, anchors, valid, pred_ok):
        """Labelled slots: (b, a, k) indices (k = 1..S-1) and the position p = anchor + k - 1
        whose target distribution labels them."""
        B, T = pred_ok.shape
        k = torch.arange(1, self.cfg.block_size, device=anchors.device)
        p = anchors[..., None] + k - 1  # (B, A, S-1)
        ok = valid[..., None] & (p < T)
        ok &= pred_ok.gather(1, p.clamp(max=T - 1).flatten(1)).view_as(p)
        b, a, kk = ok.nonzero(as_tuple=True)
        return b, a, kk + 1, p[b, a, kk]

    def _dpace(self, ce, accept, b, a, k) -> torch.Tensor:
        """D-PACE over the labelled slots (rows (b, a, k) of their blocks): each slot's CE
        weighted by the acceptance length still to earn from it (``dpace_weights``), summed
        over a block's slots, averaged over blocks."""
        A, K = int(a.max()) + 1, self.cfg.block_size - 1
        blk = b * A + a
        grid = accept.new_zeros(int(blk.max()) + 1, K)
        ok = torch.zeros_like(grid, dtype=torch.bool)
        grid[blk, k - 1], ok[blk, k - 1] = accept, True
        w = dpace_weights(grid, ok)[blk, k - 1]
        return (ce * w).sum() / ok.any(-1).sum()

    def forward(self, batch: dict[str, torch.Tensor]) -> StepOutput:
        f = batch["features"]
        ids, attn, lm = batch["input_ids"], batch["attention_mask"], batch["loss_mask"]
        pred_ok = self.predicts_reply(lm, attn)
        anchors, valid = sample_anchors(self.anchors_served(lm, attn), self.cfg.anchors)
        h = self.run_blocks(f, ids, attn, anchors)
        b, a, k, p = self._slot_rows(anchors, valid, pred_ok)
        n = len(b)
        metrics: dict[str, torch.Tensor] = {}
        if n == 0:  # nothing to learn here: a zero loss with a graph
            return StepOutput(loss=h.sum() * 0.0, metrics={"acc": metric(0.0, 0)})
        with torch.no_grad():  # the target's distribution over the draft vocabulary
            t_logits = self.target_logits(f[b, p, -1], draft_only=True)
            t_arg = t_logits.argmax(-1)
            t_prob = (
                t_logits.softmax(-1)
                if self.cfg.targets == "soft"
                else F.one_hot(t_arg, t_logits.shape[-1]).float()
            )
            del t_logits
        w = slot_weights(self.cfg.block_size, self.cfg.decay).to(h.device)[k - 1]
        hs = h[b, a, k]
        r = torch.arange(n, device=h.device)
        state = None
        if self.sequential:  # what each slot reads of the block's tokens before it (the data's)
            S, T = self.cfg.block_size, ids.shape[1]
            pos = (anchors[..., None] + torch.arange(S - 1, device=h.device)).clamp(max=T - 1)
            st = self.prefix_states(ids.gather(1, pos.flatten(1)).view_as(pos))
            state = None if st is None else st[b, a, k - 1]
        kind = self.cfg.loss
        if kind == "ce" and not self.sequential and self.target.logit_softcap is None:
            # the frozen LM head rows and the soft CE, fused
            loss, rows, arg = linear_soft_cross_entropy(
                self.norm(hs), self.lm_rows(), t_prob, r, w / w.sum()
            )
        else:  # another loss, logits that read earlier slots, or a capped head: unfused
            z = self.slot_logits(hs, state, k)
            per_row = -(t_prob * z.log_softmax(-1)).sum(-1)
            if kind == "dpace":
                loss = self._dpace(per_row, acceptance_probs(z.detach(), t_prob), b, a, k)
            else:
                loss = head_loss(kind, z, t_prob, w / w.sum())
            rows, arg = per_row.detach(), z.argmax(-1)
        hit = (arg == t_arg).float()
        extra, more = self.extra_loss(hs, state, hit)
        if extra is not None:
            loss = loss + extra
        metrics.update(more)
        for s in range(1, min(self.cfg.block_size, 6)):
            m = k == s
            metrics[f"acc_slot{s}"] = metric(hit[m].sum(), m.sum())
            metrics[f"loss_slot{s}"] = metric(rows[m].sum(), m.sum())
        metrics["acc"] = metrics["acc_slot1"]
        return StepOutput(loss=loss, metrics=metrics)

    # -- evaluation ----------------------------------------------------------------------

    @torch.no_grad()
    def evaluate(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Agreement of each slot's token (mapped to target ids) with the target's argmax over
        its whole vocabulary, for a block at every assistant position (in chunks of
        ``method.anchors``): ``top1_pos{k}`` unconditional, ``alpha_pos{k}`` given slots
        1..k-1 agreed (the chain's acceptance at T = 0), and slot 1's soft CE."""
        f = batch["features"]
        ids, attn, lm = batch["input_ids"], batch["attention_mask"], batch["loss_mask"]
        B, T = ids.shape
        K = min(self.cfg.val_positions, self.cfg.block_size - 1)
        pred_ok = self.predicts_reply(lm, attn)
        start_ok = self.anchors_served(lm, attn)
        # every candidate anchor, as (B, A) padded with invalid ones
        counts = start_ok.sum(1)
        A = int(counts.max()) if B else 0
        out = {f"{m}_pos{j}": metric(0.0, 0) for m in ("top1", "alpha") for j in range(1, K + 1)}
        out["loss_cls"] = metric(0.0, 0)
        if A == 0:
            return out
        order = (~start_ok).float().argsort(dim=1, stable=True)[:, :A]
        valid = torch.arange(A, device=ids.device) < counts[:, None]
        c = self.cfg.anchors
        for i in range(0, A, c):
            anc, val = order[:, i : i + c], valid[:, i : i + c]
            h = self.run_blocks(f, ids, attn, anc)
            agree_so_far = val.clone()
            toks = ids.gather(1, anc)[..., None]  # slot 0; then the draft's own tokens
            for j in range(1, K + 1):
                p = anc + j - 1
                ok = val & (p < T)
                ok &= pred_ok.gather(1, p.clamp(max=T - 1))
                rows = ok.nonzero(as_tuple=True)
                agree = torch.zeros_like(ok)
                st = self.prefix_states(toks)
                state = None if st is None else st[..., -1, :]
                mine = self.slot_logits(h[:, :, j], state, j).argmax(-1)  # (B, A)
                last = mine + self.d2t[mine]
                if rows[0].numel():
                    d = last[rows]
                    fin = f[rows[0], p[rows], -1]
                    t = self.target_logits(fin, draft_only=False).argmax(-1)
                    agree[rows] = d == t
                    if j == 1:
                        ce = soft_cross_entropy(
                            self.slot_logits(
                                h[:, :, 1][rows], None if state is None else state[rows], 1
                            ),
                            self.target_logits(fin, draft_only=True),
                        )
                        out["loss_cls"] += metric(ce * len(fin), len(fin))
                toks = torch.cat([toks, last[..., None]], -1)
                cond = ok & agree_so_far
                out[f"top1_pos{j}"] += metric(agree[ok].float().sum(), ok.sum())
                out[f"alpha_pos{j}"] += metric(agree[cond].float().sum(), cond.sum())
                agree_so_far = cond & agree
        return out

    # -- decoding ------------------------------------------------------------------------

    def proposer(self, settings: DecodeSettings | None = None):
        """One forward per iteration drafts up to ``block_size - 1`` tokens, verified as a
        chain (``tree=chain`` or ``auto``)."""
        from .proposer import DFlashProposer

        s = settings or DecodeSettings()
        if s.tree not in ("chain", "auto"):
            raise ValueError(f"tree={s.tree!r}: a DFlash draft proposes a chain (tree=chain)")
        return DFlashProposer(self)

    def quantize_for_decoding(self, mode: str) -> int:
        # the decode path calls fc and the layers' linears as modules; the LM head rows are
        # the target's own (a plain tensor), left as they are
        return quantize_linears(self, mode)

    @torch.no_grad()
    def probe(self, prompt: list[int]) -> torch.Tensor:
        """Slot 1's draft logits (T - 1, V) for a block at every position of ``prompt`` (-inf
        outside the draft vocabulary), each reading the target's real features before it."""
        target = self.target
        ids = torch.tensor([prompt], device=target.device)
        T = ids.shape[1]
        feats = target.features(ids, torch.ones_like(ids), tuple(self.feature_layers))
        anchors = torch.arange(T - 1, device=ids.device)[None]
        h = self.run_blocks(feats, ids, torch.ones_like(ids), anchors)
        return self.to_target_vocab(self.draft_logits(h[0, :, 1]), fill=float("-inf"))

    # -- save / load ---------------------------------------------------------------------

    def start_from(self, src: DFlashDraft) -> None:
        super().start_from(src)
        self.vocab_chosen = src.vocab_chosen

    def save_draft(self, path: str | Path) -> None:
        save_weights_draft(self, path, 1, **{VOCAB_CHOSEN: self.vocab_chosen})

    @classmethod
    def load_draft(cls, path: str | Path, target: Target) -> DFlashDraft:
        draft = load_weights_draft(cls, path, target)
        draft.vocab_chosen = saved_vocab_chosen(read_draft_config(path), draft)
        return draft


class DominoDraft(DFlashDraft):
    """Domino (``method=domino``): DFlash with the GRU logit correction on, its own name in
    saved drafts; everything else is DFlash's."""

    config_class = DominoConfig
