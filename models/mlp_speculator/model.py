"""MLP speculator (Wertheimer et al. 2024, "Accelerating Production LLMs with Combined
Token/Embedding Speculators", arXiv 2404.19124): ``n_predict`` small stages on the target's
last hidden state. Stage i mixes the previous state (the target's, for stage 0) with the
embedding of the token just predicted (for stage 0: the token the target itself just chose),

    s_i = GELU(Norm_i(P_i s_{i-1} + (w_e / w_s) E_i(x)))    logits_i = W_i s_i

with w_s = 0.5 ** (0.5 / n_predict) and w_e = sqrt((1 - w_s^2) * inner_dim / 2) (the
reference's fixed mixing weights; the norm takes care of the denominator), and predicts one
more token. Norm is the reference's RMS normalisation with a learned scale and shift. Trained
teacher-forced: at position t stage i reads x_{t+1..t+i+1} and predicts x_{t+i+2} (the
paper's stage 1: the data's tokens; its stage 2: the target's own answers, see the config).

Parameter names follow the layout vLLM and TGI load (``emb.i``, ``proj.i``, ``head.i``,
``ln.i``), so export is a copy. With ``tie_weights`` the stages after the first share one set
of weights (the modules are the same objects, as in the engines' loaders).

Sections: module, training, decoding, save/load.
"""

from __future__ import annotations

import math
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from torch import nn

from ..base import (
    DRAFT_WEIGHTS,
    DecodeSettings,
    DraftError,
    DraftMethod,
    StepOutput,
    check_hidden_size,
    metric,
    read_draft_config,
    read_draft_weights,
    served_chain,
    write_draft_config,
)
from ..losses import check_head_loss, hard_label_loss, head_loss, head_masks
from ..target import Target
from .config import MLPSpeculatorConfig
from .proposer import MLPSpeculatorProposer

# ---------------------------------------------------------------------------------------------
# Module


class SpeculatorNorm(nn.Module):
    """x / rms(x), then (``affine``) a learned scale and shift: the reference's "LayerNorm"
    (no mean subtraction), computed in float32."""

    def __init__(self, dim: int, affine: bool = True, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        if affine:
            self.weight = nn.Parameter(torch.ones(dim))
            self.bias = nn.Parameter(torch.zeros(dim))
        else:
            self.weight = self.bias = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        y = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).type_as(x)
        if self.weight is not None:
            y = self.weight.to(y.dtype) * y + self.bias.to(y.dtype)
        return y


class MLPSpeculator(DraftMethod):
    """``n_predict`` stages on the target's final (normed) hidden state. Registered parameters
    are exactly the trainable draft; the target is held by reference."""

    config_class = MLPSpeculatorConfig
    feature_layers: tuple[int, ...] = (-1,)

    def __init__(self, target: Target, cfg: MLPSpeculatorConfig):
        super().__init__()
        check_head_loss(cfg.loss)
        n = cfg.n_predict
        if n < 1 or cfg.inner_dim < 0:
            raise DraftError(
                f"method.n_predict={n}, method.inner_dim={cfg.inner_dim}: need n_predict >= 1 "
                "and inner_dim >= 0 (0: the target's hidden size)"
            )
        if cfg.tie_weights and n < 2:
            raise DraftError("method.tie_weights=true needs method.n_predict >= 2")
        self.cfg = cfg
        H, V = target.hidden_size, target.config.vocab_size
        D = cfg.inner_dim or H
        if cfg.tie_weights:
            emb, head, ln = nn.Embedding(V, D), nn.Linear(D, V, bias=False), SpeculatorNorm(D)
            first, tied = nn.Linear(H, D, bias=False), nn.Linear(D, D, bias=False)
            self.emb = nn.ModuleList([emb] * n)
            self.proj = nn.ModuleList([first] + [tied] * (n - 1))
            self.head = nn.ModuleList([head] * n)
            self.ln = nn.ModuleList([ln] * n)
        else:
            self.emb = nn.ModuleList([nn.Embedding(V, D) for _ in range(n)])
            self.proj = nn.ModuleList(
                [nn.Linear(H if i == 0 else D, D, bias=False) for i in range(n)]
            )
            self.head = nn.ModuleList([nn.Linear(D, V, bias=False) for _ in range(n)])
            self.ln = nn.ModuleList([SpeculatorNorm(D) for _ in range(n)])
        self.ln0 = SpeculatorNorm(H, affine=False) if cfg.scale_input else None
        self.state_weight = 0.5 ** (0.5 / n)
        self.emb_weight = math.sqrt((1 - self.state_weight**2) * (D / 2))
        with torch.no_grad():
            for p in self.proj:  # the reference's init
                nn.init.normal_(p.weight, std=1 / math.sqrt(p.in_features))
            for e, h in zip(self.emb, self.head, strict=True):
                if D == H:  # start from the target's own token embedding and LM head
                    e.weight.copy_(target.embed_tokens.weight.float())
                    h.weight.copy_(target.lm_head.weight.float())
                else:
                    nn.init.normal_(e.weight, std=1 / math.sqrt(D))
                    nn.init.normal_(h.weight, std=1 / math.sqrt(D))
        object.__setattr__(self, "target", target)

    def input_state(self, h: torch.Tensor) -> torch.Tensor:
        """The target's state (..., H) as stage 0 reads it."""
        return self.ln0(h) / math.sqrt(2) if self.ln0 is not None else h

    def stage(self, i: int, state: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        """Stage i: previous state (..., H or D) and the tokens (...) just predicted ->
        (..., D)."""
        w = self.proj[i].weight
        s = self.proj[i](state.to(w.dtype))
        s = s + self.emb[i](tokens).to(s.dtype) * (self.emb_weight / self.state_weight)
        return F.gelu(self.ln[i](s))

    def stage_logits(self, i: int, state: torch.Tensor) -> torch.Tensor:
        """(..., D) -> (..., V) float32."""
        w = self.head[i].weight
        return F.linear(state.to(w.dtype), w).float()

    def target_logits(self, h: torch.Tensor) -> torch.Tensor:
        return self.target.logits(h)

    def _states(self, batch: dict[str, torch.Tensor]):
        """Teacher-forced stage states (n_predict of (B, T, D)): at position t stage i reads
        x_{t+i+1}; ids past the end are padded (their rows are masked out)."""
        ids, h = batch["input_ids"], batch["features"][:, :, 0]
        s = self.input_state(h)
        out = []
        for i in range(self.cfg.n_predict):
            tok = F.pad(ids[:, i + 1 :], (0, i + 1))
            s = self.stage(i, s, tok)
            out.append(s)
        return h, out

    # -- training ----------------------------------------------------------------------------

    def forward(self, batch: dict[str, torch.Tensor]) -> StepOutput:
        ids, attn, lm = batch["input_ids"], batch["attention_mask"], batch["loss_mask"]
        h, states = self._states(batch)
        loss = h.new_zeros((), dtype=torch.float32)
        metrics: dict[str, torch.Tensor] = {}
        for i, mask in enumerate(head_masks(lm, attn, self.cfg.n_predict)):
            rows = mask.nonzero(as_tuple=True)
            n = rows[0].numel()
            if n == 0:
                loss = loss + 0.0 * states[i].sum()
                continue
            logits = self.stage_logits(i, states[i][rows])
            if self.cfg.soft_labels:
                with torch.no_grad():  # the target's distribution over x_{t+i+2}
                    t_logits = self.target_logits(h[rows[0], rows[1] + i + 1])
                ce = head_loss(self.cfg.loss, logits, t_logits.softmax(-1))
                labels = t_logits.argmax(-1)
            else:
                labels = ids[rows[0], rows[1] + i + 2]
                ce = hard_label_loss(self.cfg.loss, logits, labels)
            loss = loss + self.cfg.stage_decay**i * ce
            metrics[f"loss_stage{i + 1}"] = metric(ce.detach() * n, n)
            metrics[f"acc_stage{i + 1}"] = metric((logits.argmax(-1) == labels).float().sum(), n)
        metrics["acc"] = metrics.get("acc_stage1", metric(0.0, 0))
        return StepOutput(loss=loss, metrics=metrics)

    @torch.no_grad()
    def evaluate(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Per stage i, teacher-forced on the data: ``top1_stage{i}``, how often its argmax is
        the target's greedy token at that position, and ``alpha_pos{i}``, how often it is
        given that every earlier stage's was too (EAGLE's n-alpha, as the EAGLE heads report
        it: a chain's acceptance at position i, at T = 0), over the positions where stages
        1..i are all scored (``head_masks``: a chain is drafted inside a reply, from its
        first token on, and a stage whose label is not a reply's is not a rejection)."""
        attn, lm = batch["attention_mask"], batch["loss_mask"]
        h, states = self._states(batch)
        masks = head_masks(lm, attn, self.cfg.n_predict)
        out: dict[str, torch.Tensor] = {}
        scored = torch.ones_like(masks[0])  # stages 1..i all scored
        agreed = torch.ones_like(masks[0])  # stages 1..i-1 all agreed
        agrees = []
        for i, mask in enumerate(masks):
            rows = mask.nonzero(as_tuple=True)
            agree = torch.zeros_like(mask)
            if rows[0].numel():
                draft = self.stage_logits(i, states[i][rows]).argmax(-1)
                want = self.target_logits(h[rows[0], rows[1] + i + 1]).argmax(-1)
                agree[rows] = draft == want
            out[f"top1_stage{i + 1}"] = metric(agree[mask].float().sum(), mask.sum())
            scored = scored & mask
            m = scored & agreed
            out[f"alpha_pos{i + 1}"] = metric(agree[m].float().sum(), m.sum())
            agreed = agreed & agree
            agrees.append(agree)
        out.update(served_chain(agrees, masks))
        return out

    # -- decoding ----------------------------------------------------------------------------

    def proposer(self, settings: DecodeSettings | None = None) -> MLPSpeculatorProposer:
        tree = (settings or DecodeSettings()).tree
        if tree not in ("auto", "chain"):
            raise ValueError(f"tree={tree!r}: the MLP speculator proposes chains")
        return MLPSpeculatorProposer(self)

    @torch.no_grad()
    def probe(self, prompt: list[int]) -> torch.Tensor:
        """Every stage's logits (n_predict, V) along its greedy chain after ``prompt``."""
        t = self.target
        ids = torch.tensor([prompt[:-1]], device=t.device)
        h = t.features(ids, torch.ones_like(ids), (-1,))[0, -1:, 0]
        s, tok, out = self.input_state(h), torch.tensor([prompt[-1]], device=t.device), []
        for i in range(self.cfg.n_predict):
            s = self.stage(i, s, tok)
            out.append(self.stage_logits(i, s)[0])
            tok = out[-1].argmax()[None]
        return torch.stack(out)

    # -- save / load -------------------------------------------------------------------------

    def own_state(self) -> dict[str, torch.Tensor]:
        """Each parameter once (tied stages share tensors, which a safetensors file cannot hold
        twice): the names ``named_parameters`` gives, the engines' names too."""
        return {k: v.detach().contiguous().cpu() for k, v in self.named_parameters()}

    def save_draft(self, path: str | Path) -> None:
        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        save_file(self.own_state(), str(path / DRAFT_WEIGHTS), metadata={"format": "pt"})
        write_draft_config(path, self.cfg, self.target, 1, feature_layers=[-1])

    def load_own_state(self, state: dict[str, torch.Tensor], where: str | Path) -> None:
        want = dict(self.named_parameters())
        missing = sorted(set(want) - set(state))
        unexpected = sorted(set(state) - set(want))
        if missing or unexpected:
            raise DraftError(
                f"{where}: weights do not fit this MLP speculator (missing {missing[:5]}, "
                f"unexpected {unexpected[:5]})"
            )
        for k, v in state.items():
            if tuple(v.shape) != tuple(want[k].shape):
                raise DraftError(
                    f"{where}: {k} has shape {tuple(v.shape)}, expected {tuple(want[k].shape)}"
                )
            with torch.no_grad():
                want[k].copy_(v.to(want[k].dtype))

    @classmethod
    def load_draft(cls, path: str | Path, target: Target) -> MLPSpeculator:
        cfg = read_draft_config(path)
        check_hidden_size(cfg, path, target)
        model = cls(target, cls.config_class(**cfg["method"]))
        model.load_own_state(read_draft_weights(path), path)
        return model.to(target.device)
