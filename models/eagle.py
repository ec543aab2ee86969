"""EAGLE draft heads: feature-level autoregression on the target's own hidden states.

EAGLE-1 (Li et al. 2024): at position t the head reads the target's final feature f_t and the
embedding of the next token x_{t+1}, projects [f_t; e(x_{t+1})] with FC(2H -> H), runs one
decoder layer of the target's architecture, and predicts f_{t+1}; the target's frozen LM head
turns predicted features into draft tokens. Loss = w_reg * SmoothL1(f_hat, f) + w_cls *
CE(target distribution, draft distribution), with uniform noise on input features.

Sections: config, module, pure loss functions, save/load.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from torch import nn
from transformers import DynamicCache

from .base import (
    DRAFT_CONFIG,
    DRAFT_WEIGHTS,
    DecodeState,
    DraftError,
    Proposal,
    StepOutput,
    crop_cache,
    metric,
    read_draft_config,
)
from .sampling import sample, warp
from .target import Target

# ---------------------------------------------------------------------------------------------
# Config


@dataclass
class Eagle1Config:
    name: str = "eagle1"
    w_reg: float = 1.0  # SmoothL1 on features
    w_cls: float = 0.1  # soft cross-entropy against the target's distribution
    noise: float = 0.2  # uniform feature noise, U(-noise/2, noise/2) per element
    val_positions: int = 5  # draft positions rolled out on the head's own features at validation
    lm_head_chunk: int = 2048  # rows per LM-head chunk (bounds memory for large vocabularies)


# ---------------------------------------------------------------------------------------------
# Module


class EagleHead(nn.Module):
    """FC(2H -> H) + one target-architecture decoder layer. Registered parameters are exactly
    the trainable draft; the target's embedding, rotary embedding and LM head are used by
    reference (frozen and shared, never saved with the draft)."""

    def __init__(self, target: Target, cfg: Eagle1Config):
        super().__init__()
        H = target.hidden_size
        self.cfg = cfg
        self.fc = nn.Linear(2 * H, H, bias=True)
        self.layer = target.new_decoder_layer(0)
        # Plain attribute, not a submodule: the target is frozen and must not be saved,
        # wrapped by DDP, or handed to the optimizer.
        object.__setattr__(self, "target", target)

    feature_layers: tuple[int, ...] = (-1,)

    def _embed(self, ids: torch.Tensor) -> torch.Tensor:
        return self.target.embed_tokens(ids.to(self.target.device)).to(self.fc.weight.dtype)

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """Target LM head on features (..., H) -> (..., V), in float32."""
        w = self.target.lm_head.weight
        return F.linear(h.to(w.dtype), w).float()

    def step(
        self,
        feats: torch.Tensor,
        token_embeds: torch.Tensor,
        position_ids: torch.Tensor,
        mask: torch.Tensor | None,
        cache: DynamicCache | None = None,
    ) -> torch.Tensor:
        """One pass of the head.

        feats, token_embeds: (B, Q, H); position_ids: (B, Q); mask: (B, 1, Q, K) bool with
        True = attend, K = keys in ``cache`` after this call (None: plain causal).
        Returns predicted next features (B, Q, H).
        """
        x = self.fc(torch.cat([feats.to(self.fc.weight.dtype), token_embeds], dim=-1))
        cos, sin = self.target.rotary_embedding()(x, position_ids)
        return self.layer(
            x,
            attention_mask=mask,
            position_ids=position_ids,
            past_key_values=cache,
            use_cache=cache is not None,
            position_embeddings=(cos.to(x.dtype), sin.to(x.dtype)),
        )

    def unroll(
        self, feats: torch.Tensor, input_ids: torch.Tensor, attention_mask: torch.Tensor, steps: int
    ) -> list[torch.Tensor]:
        """Run the head ``steps`` times, each step on its own previous outputs.

        Step 1 reads the target's features f_s and token x_{s+1} at every position s and
        predicts f_{s+1}. Step j reads step j-1's prediction for start s and token x_{s+j}; its
        query for start s attends to step-1 keys at positions <= s (real context) and to the
        keys of steps 2..j at start s only (its own drafted chain), at position id s+j-1. This
        is the attention pattern of drafting at decode time, for every start in parallel.

        feats: (B, T, H); input_ids, attention_mask: (B, T). Returns ``steps`` tensors
        (B, T-1, H); entry j-1 at start s predicts f_{s+j}.
        """
        B, T, H = feats.shape
        S = T - 1
        dev = feats.device
        valid = attention_mask[:, :S].bool()
        pos = torch.arange(S, device=dev)
        causal = pos[None, :] <= pos[:, None]  # (S, S) key <= query
        base = causal[None] & valid[:, None, :]  # (B, S, S)
        eye = torch.eye(S, dtype=torch.bool, device=dev)
        base = base | eye  # padded queries see themselves: no empty rows (NaN in SDPA)
        ids = torch.cat([input_ids, input_ids.new_zeros(B, steps)], dim=1)
        cache = DynamicCache() if steps > 1 else None
        outs: list[torch.Tensor] = []
        h = feats[:, :S]
        for j in range(1, steps + 1):
            emb = self._embed(ids[:, j : j + S])
            blocks = [base] + [eye[None].expand(B, S, S)] * (j - 1)
            mask = torch.cat(blocks, dim=-1)[:, None]
            position_ids = (pos + (j - 1)).expand(B, S)
            h = self.step(h, emb, position_ids, mask, cache)
            outs.append(h)
        return outs

    # -- training ------------------------------------------------------------------------

    def forward(self, batch: dict[str, torch.Tensor]) -> StepOutput:
        f = batch["features"][:, :, 0].to(self.fc.weight.dtype)  # (B, T, H)
        ids, attn, lm = batch["input_ids"], batch["attention_mask"], batch["loss_mask"]
        noisy = f + (torch.rand_like(f) - 0.5) * self.cfg.noise if self.cfg.noise > 0 else f
        (pred,) = self.unroll(noisy, ids, attn, steps=1)  # (B, T-1, H), predicts f[:, 1:]
        mask = position_mask(lm, attn, steps=1)[0]  # (B, T-1)
        rows = mask.nonzero(as_tuple=True)
        p_hat, f_next = pred[rows], f[:, 1:][rows]  # (N, H)
        reg = feature_regression_loss(p_hat, f_next)
        cls, acc = 0.0 * reg, None
        n = p_hat.shape[0]
        if n > 0:
            with torch.no_grad():
                t_logits = self.logits(f_next)
            d_logits = self.logits(p_hat)
            cls = soft_cross_entropy(d_logits, t_logits)
            acc = (d_logits.argmax(-1) == t_logits.argmax(-1)).float().sum()
        loss = self.cfg.w_reg * reg + self.cfg.w_cls * cls
        metrics = {
            "loss_reg": metric(reg * n, n),
            "loss_cls": metric(cls * n, n),
            "acc": metric(acc if acc is not None else 0.0, n),
        }
        return StepOutput(loss=loss, metrics=metrics)

    @torch.no_grad()
    def evaluate(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Top-1 agreement of the head's token with the target's argmax at draft positions
        1..k, rolling the head forward on its own features (teacher-forced on the data's
        tokens). ``top1_pos{k}`` is unconditional; ``alpha_pos{k}`` is conditional on
        positions 1..k-1 having agreed (EAGLE's n-alpha, the chain acceptance at T=0)."""
        f = batch["features"][:, :, 0].to(self.fc.weight.dtype)
        ids, attn, lm = batch["input_ids"], batch["attention_mask"], batch["loss_mask"]
        k = min(self.cfg.val_positions, f.shape[1] - 1)
        preds = self.unroll(f, ids, attn, steps=k)
        masks = position_mask(lm, attn, steps=k)
        out: dict[str, torch.Tensor] = {}
        agreed_so_far = torch.ones_like(masks[0])
        loss_total = torch.zeros((), device=f.device)
        for j, (pred, mask) in enumerate(zip(preds, masks, strict=True), start=1):
            target_f = f[:, j:]  # f_{s+j} for start s
            m = mask & agreed_so_far if j > 1 else mask
            agree = torch.zeros_like(mask)
            rows = mask.nonzero(as_tuple=True)
            if rows[0].numel():
                d = self._argmax_logits(pred[rows])
                t = self._argmax_logits(target_f[rows])
                agree[rows] = d == t
                if j == 1:
                    reg = feature_regression_loss(pred[rows], target_f[rows])
                    loss_total = reg * rows[0].numel()
            out[f"top1_pos{j}"] = metric(agree[mask].float().sum(), mask.sum())
            out[f"alpha_pos{j}"] = metric(agree[m].float().sum(), m.sum())
            agreed_so_far = agreed_so_far & agree
        out["loss_reg"] = metric(loss_total, masks[0].sum())
        return out

    def _argmax_logits(self, h: torch.Tensor) -> torch.Tensor:
        c = self.cfg.lm_head_chunk
        return torch.cat([self.logits(h[i : i + c]).argmax(-1) for i in range(0, len(h), c)])

    def proposer(self) -> EagleProposer:
        """This head as a chain proposer for the shared decoder."""
        return EagleProposer(self)

    # -- save / load ---------------------------------------------------------------------

    def save_draft(self, path: str | Path) -> None:
        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        state = {k: v.detach().contiguous().cpu() for k, v in self.state_dict().items()}
        save_file(state, str(path / DRAFT_WEIGHTS), metadata={"format": "pt"})
        t = self.target
        cfg = {
            "specdraft": {"method": self.cfg.name, "format_version": 1},
            "method": asdict(self.cfg),
            "target": {
                "identity": t.identity,
                "name": t.cfg.name,
                "path": t.cfg.path,
                "hidden_size": t.hidden_size,
                "num_hidden_layers": t.num_layers,
                "vocab_size": t.config.vocab_size,
            },
            "feature_layers": list(self.feature_layers),
        }
        (path / DRAFT_CONFIG).write_text(json.dumps(cfg, indent=2))

    @classmethod
    def load_draft(cls, path: str | Path, target: Target) -> EagleHead:
        cfg = read_draft_config(path)
        if cfg["target"]["hidden_size"] != target.hidden_size:
            raise DraftError(
                f"{path}: draft was trained for hidden size {cfg['target']['hidden_size']}, "
                f"target {target.identity} has {target.hidden_size}"
            )
        head = cls(target, Eagle1Config(**cfg["method"]))
        try:
            state = load_file(str(Path(path) / DRAFT_WEIGHTS))
        except Exception as e:  # safetensors raises several types for damaged files
            raise DraftError(f"{Path(path) / DRAFT_WEIGHTS}: cannot read weights ({e})") from None
        missing, unexpected = head.load_state_dict(state, strict=False)
        if missing or unexpected:
            raise DraftError(
                f"{path}: weights do not match (missing {missing}, unexpected {unexpected})"
            )
        return head.to(target.device)


# ---------------------------------------------------------------------------------------------
# Propose (decode time)


class EagleProposer:
    """Chain drafting with an EAGLE head for the shared decoder.

    The head keeps its own KV cache over (feature, next token) pairs. Pairs for committed
    tokens use the target's real features (from the verification forwards); each drafted step
    feeds the head's own predicted feature with the token just drafted. After verification the
    drafted entries are cut and the next call catches up on the newly committed pairs in one
    pass, so nothing is recomputed.
    """

    name = "eagle"

    def __init__(self, head: EagleHead):
        self.head = head.eval()
        self.feature_layers = tuple(head.feature_layers)
        self.draft_calls = 0
        self.cache: DynamicCache | None = None
        self.done = 0  # committed pairs held by the head's cache

    def start(self, state: DecodeState) -> None:
        self.cache = DynamicCache()
        self.done = 0
        self.last_step_seconds = None
        if len(state.ids) > 2:  # the prompt's pairs now, so drafting times only draft steps
            self._catch_up(state, upto=len(state.ids) - 2)

    def _choose(self, h: torch.Tensor, state: DecodeState, qs: list) -> int:
        logits = self.head.logits(h)
        if state.sampling.greedy:
            return int(logits.argmax())
        q = warp(logits, state.sampling)
        qs.append(q)
        return sample(q, state.generator)

    @torch.no_grad()
    def _catch_up(self, state: DecodeState, upto: int) -> torch.Tensor:
        """Feed committed pairs (f_t, x_{t+1}) for t = done..upto-1; returns the head's output
        (1, Q, H)."""
        head, dev = self.head, state.device
        f = state.features[:, 0]  # fed positions 0..len(ids)-2
        q_len = upto - self.done
        pos = torch.arange(self.done, upto, device=dev)[None]
        emb = head._embed(torch.tensor([state.ids[self.done + 1 : upto + 1]], device=dev))
        mask = None
        if self.done > 0 and q_len > 1:
            keys = torch.arange(upto, device=dev)
            mask = (keys[None, :] <= pos[0, :, None])[None, None]
        h = head.step(f[self.done : upto][None], emb, pos, mask, self.cache)
        self.done = upto
        self.draft_calls += 1
        return h

    @torch.no_grad()
    def propose(self, state: DecodeState, gamma: int) -> Proposal:
        head, dev = self.head, state.device
        n = len(state.ids)
        times: list[float] = []
        t = time.perf_counter()
        big = n - 1 - self.done > 8
        h = self._catch_up(state, upto=n - 1)[:, -1:]  # predicts the pending token's feature
        if not big:  # a long catch-up is not what one more draft step costs
            times.append(time.perf_counter() - t)
        tokens: list[int] = []
        qs: list[torch.Tensor] = []
        for i in range(gamma):
            t = time.perf_counter()
            x = self._choose(h[0, -1], state, qs)
            tokens.append(x)
            if i < gamma - 1:
                p = torch.tensor([[n - 1 + i]], device=dev)
                h = head.step(h, head._embed(torch.tensor([[x]], device=dev)), p, None, self.cache)
                self.draft_calls += 1
            times.append(time.perf_counter() - t)
        # each draft token costs one head step and one LM head; the catch-up step (when it
        # was short) stands for the step that produced the first token's feature
        self.last_step_seconds = sum(times) / gamma if gamma else None
        return Proposal.chain(tokens, torch.stack(qs) if qs else None)

    def rollback(self, state: DecodeState, n_accepted: int) -> None:
        crop_cache(self.cache, self.done)


# ---------------------------------------------------------------------------------------------
# Pure loss functions and masks


def position_mask(
    loss_mask: torch.Tensor, attention_mask: torch.Tensor, steps: int
) -> list[torch.Tensor]:
    """Where draft step j (1..steps) at start s is trained/scored: (B, T-1) bool each.

    Step j at start s reads token x_{s+j} and predicts x_{s+j+1}; both must be assistant tokens
    (the draft only ever runs inside a reply) and real (not padding). Positions past the end
    are False.
    """
    B, T = loss_mask.shape
    ok = loss_mask.bool() & attention_mask.bool()
    ok = torch.cat([ok, ok.new_zeros(B, steps + 1)], dim=1)
    S = T - 1
    out = []
    for j in range(1, steps + 1):
        m = torch.ones(B, S, dtype=torch.bool, device=loss_mask.device)
        for i in range(1, j + 2):
            m &= ok[:, i : i + S]
        out.append(m)
    return out


def feature_regression_loss(pred: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """SmoothL1 between predicted and true features (N, H) -> scalar mean over N and H.
    Returns 0 (with a graph) for N = 0."""
    if pred.shape[0] == 0:
        return pred.sum() * 0.0
    return F.smooth_l1_loss(pred.float(), target.float())


def soft_cross_entropy(student_logits: torch.Tensor, teacher_logits: torch.Tensor) -> torch.Tensor:
    """-sum_x p(x) log q(x) averaged over rows; logits (N, V), p = softmax(teacher).

    Equals KL(p || q) + H(p): minimised, for fixed p, exactly at q = p."""
    p = teacher_logits.float().softmax(-1)
    return -(p * student_logits.float().log_softmax(-1)).sum(-1).mean()
