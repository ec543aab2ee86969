"""EAGLE draft heads: feature-level autoregression on the target's own hidden states.

EAGLE-1 (Li et al. 2024): at position t the head reads the target's final feature f_t and the
embedding of the next token x_{t+1}, projects [e(x_{t+1}); f_t] with FC(2H -> H), runs one
decoder layer of the target's architecture (without its input norm, as the reference), and
predicts f_{t+1}; the target's frozen LM head
turns predicted features into draft tokens. Loss = w_reg * SmoothL1(f_hat, f) + w_cls *
CE(target distribution, draft distribution), with uniform noise on input features.

EAGLE-3 (Li et al. 2025): no feature regression. The head fuses three target layers (low, mid,
high) with FC(3H -> H); its one decoder layer attends over [norm(e(x_{t+1})); norm(g_t)] (2H in
its q/k/v projections) and keeps g_t as the residual stream; a final norm and a draft LM head
over a reduced draft vocabulary (the most frequent assistant tokens; ``d2t``/``t2d`` map draft
ids to target ids) give the draft distribution. Trained with "training-time test": the head is
unrolled on its own hidden states for several steps with the decode-time attention pattern,
step i weighted 0.8^i, each a soft cross-entropy against the target's distribution restricted
to the draft vocabulary.

EAGLE-2 (Li et al. 2024b) is decode-time only: ``EagleTreeProposer`` grows a context-aware
dynamic draft tree with either head.

Sections: config, module, pure loss functions, propose, save/load.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from transformers import DynamicCache

from ..base import (
    DecodeSettings,
    DecodeState,
    DraftError,
    DraftMethod,
    StepOutput,
    cache_kw,
    check_hidden_size,
    fit_weights,
    metric,
    read_draft_config,
    read_draft_weights,
    save_weights_draft,
    served_chain,
)
from ..losses import check_head_loss, head_loss, linear_soft_cross_entropy, soft_cross_entropy
from ..quant import Int8Linear, int8_linear, quantize_linears
from ..ragged import within_window
from ..sampling import Sampling
from ..target import Target, layer_shape
from .config import Eagle1Config, Eagle3Config
from .proposer import EagleProposer, EagleTreeProposer

# ---------------------------------------------------------------------------------------------
# Attention of the unrolled head (training-time test)

EAGLE_ATTENTION = "specdraft_eagle"


@dataclass
class TTTLayout:
    """How the keys of an unrolled head are laid out: ``span`` (S) positions of the first step
    (the real context, attended causally), then S keys per later step, of which a query at
    start s sees only its own start's (its drafted chain). ``key_valid`` (B, S) bool marks
    non-padding positions of the first step; ``window``: the target's ``draft_window`` (step
    j's query for start s sees first-step key t while ``s + j - 1 - t < window``, as at
    decode time), None: no window."""

    span: int
    key_valid: torch.Tensor
    window: int | None = None


def ttt_attention_core(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    layout: TTTLayout,
    scaling: float,
) -> torch.Tensor:
    """Attention of unrolled step j for every start at once, without a (S x jS) mask.

    query: (B, h, S, D); key, value: (B, kvh, j*S, D) (step 1's keys, then one block per later
    step); h a multiple of kvh (grouped-query attention, no key copy). Query s attends to
    first-step keys 0..s (valid ones) and to key s of every later block. Returns (B, h, S, D).
    Scores are O(S^2 + jS) instead of O(j S^2). They stay in the compute dtype (as a bf16
    matmul returns them; the scale is applied to the (S, D) queries, not to the scores) and the
    softmax runs in float32: each pass over the (B, h, S, S) scores is a pass over memory, and
    those passes, not the matmuls, are what this function costs on a CPU."""
    B, h, S, D = query.shape
    kvh = key.shape[1]
    g = h // kvh
    j = key.shape[2] // S
    query = query * scaling
    q = query.reshape(B, kvh, g * S, D)
    base = torch.matmul(q, key[:, :, :S].transpose(-1, -2)).view(B, kvh, g, S, S)
    pos = torch.arange(S, device=query.device)
    allowed = (pos[None, :] <= pos[:, None])[None] & layout.key_valid[:, None, :]  # (B, S, S)
    if layout.window is not None:
        # step j's query for start s sits at position s + j - 1: the window is its own. A
        # padded query past the window may see no real key: it sees itself (never read)
        eye = torch.eye(S, dtype=torch.bool, device=pos.device)
        allowed = (allowed & within_window(pos + j - 1, pos, layout.window)[None]) | eye[None]
    scores = base.masked_fill(~allowed[:, None, None], float("-inf"))
    if j > 1:
        # each query against its own start's key in every later block: one small matmul per
        # position, (g, D) @ (D, j-1), batched over (B, kvh, S)
        kd = key[:, :, S:].reshape(B, kvh, j - 1, S, D).permute(0, 1, 3, 4, 2)  # (.., S, D, j-1)
        qd = query.reshape(B, kvh, g, S, D).transpose(2, 3)  # (B, kvh, S, g, D)
        diag = torch.matmul(qd, kd).transpose(2, 3)  # (B, kvh, g, S, j-1)
        scores = torch.cat([scores, diag], dim=-1)
    p = torch.softmax(scores, -1, dtype=torch.float32).to(value.dtype)
    out = torch.matmul(p[..., :S].reshape(B, kvh, g * S, S), value[:, :, :S])
    out = out.view(B, kvh, g, S, D)
    if j > 1:
        vd = value[:, :, S:].reshape(B, kvh, j - 1, S, D).transpose(2, 3)  # (B, kvh, S, j-1, D)
        pd = p[..., S:].transpose(2, 3)  # (B, kvh, S, g, j-1)
        out = out + torch.matmul(pd, vd).transpose(2, 3)  # (B, kvh, g, S, D)
    return out.reshape(B, h, S, D)


def eagle_attention(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    ttt: TTTLayout | None = None,
    **kwargs,
):
    """The draft layer's attention function (transformers' ``AttentionInterface``): the
    training-time-test layout when ``ttt`` is given, else SDPA (decode time: causal, or the
    boolean tree mask the proposers build, which SDPA reads as True = attend whatever the
    target's own attention implementation is)."""
    if ttt is None:
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
        )
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    out = ttt_attention_core(query, key, value, ttt, scale)
    return out.transpose(1, 2).contiguous(), None


def eagle_layer(target: Target) -> nn.Module:
    """A fresh decoder layer of the target's sizes whose attention is ``eagle_attention``
    (registered with transformers' ``AttentionInterface`` here, on first use: importing
    transformers' modeling code at import time costs every command seconds)."""
    from transformers import AttentionInterface

    AttentionInterface.register(EAGLE_ATTENTION, eagle_attention)
    return target.new_decoder_layer(0, EAGLE_ATTENTION)


# ---------------------------------------------------------------------------------------------
# Module


class EagleHead(DraftMethod):
    """FC(2H -> H) + one target-architecture decoder layer. Registered parameters are exactly
    the trainable draft; the target's embedding, rotary embedding and LM head are used by
    reference (frozen and shared, never saved with the draft)."""

    def __init__(self, target: Target, cfg: Eagle1Config):
        super().__init__()
        H = target.hidden_size
        check_head_loss(cfg.loss)
        self.cfg = cfg
        self.fc = nn.Linear(2 * H, H, bias=True)
        self.layer = eagle_layer(target)
        if not cfg.input_norm:
            self.layer.input_layernorm = nn.Identity()
        # Plain attribute, not a submodule: the target is frozen and must not be saved,
        # wrapped by DDP, or handed to the optimizer.
        object.__setattr__(self, "target", target)

    feature_layers: tuple[int, ...] = (-1,)
    config_class = Eagle1Config

    def _compute_dtype(self) -> torch.dtype:
        """The dtype the head computes in: autocast's when it is on (inputs cast to it once,
        not to float32 and back at every layer), else its weights'."""
        fc = self.fc  # an Int8Linear at decode time with int8 draft weights (models/quant.py)
        w = fc.scales if isinstance(fc, Int8Linear) else fc.weight
        if torch.is_autocast_enabled(w.device.type):
            return torch.get_autocast_dtype(w.device.type)
        return w.dtype

    def _embed(self, ids: torch.Tensor) -> torch.Tensor:
        """The target's embedding rows for ``ids``, looked up as every engine's EAGLE draft
        looks them up: the table as it is, without the scale a target's own forward may apply
        (Gemma's sqrt(H), inside its transformers embedding module; vLLM and SGLang apply it
        in the target's forward, and their drafts share the bare table). EAGLE-1's FC reads the
        embedding unnormed, so a head trained on scaled rows drafts otherwise when served (an
        EAGLE-1 head of a tiny Gemma-3 target: 0.37 / 0.20 / 0.13 a position in ours, 0.25 /
        0.03 / 0.02 in vLLM); EAGLE-3 norms it first."""
        w = self.target.embed_tokens.weight
        return F.embedding(ids.to(w.device), w).to(self._compute_dtype())

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """Target LM head on features (..., H) -> (..., V), in float32 (through the draft's
        int8 copy of it once ``quantize_for_decoding`` made one)."""
        lm = self.__dict__.get("_draft_lm_head")
        if lm is not None:
            return self.target.cap(lm(h).float())
        return self.target.logits(h)

    def vocab_logits(self, h: torch.Tensor) -> torch.Tensor:
        """The draft's logits over the target's vocabulary, (..., H) -> (..., V) float32."""
        return self.logits(h)

    def own_logits(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The draft's logits over its own vocabulary, (..., H) -> (..., V_draft), and the
        offsets that map a draft id to a target id (target = draft + offset; None: the same
        vocabulary). Cheaper than ``vocab_logits`` where the draft vocabulary is reduced."""
        return self.logits(h), None

    def to_target_vocab(self, x: torch.Tensor, fill: float = 0.0) -> torch.Tensor:
        """Values over the draft vocabulary (..., V_draft) laid out over the target's (..., V),
        ``fill`` elsewhere: the identity here, where the two vocabularies are one."""
        return x

    def top_tokens(self, h: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The draft's ``k`` most likely tokens after each row of h (N, H): their
        log-probabilities (N, k) and target-vocabulary ids (N, k), best first."""
        top = self.logits(h).log_softmax(-1).topk(k, dim=-1)
        return top.values, top.indices

    def initial_hidden(self, features: torch.Tensor) -> torch.Tensor:
        """What the first step reads from the target's features (..., L, H) -> (..., H)."""
        return features[..., 0, :].to(self._compute_dtype())

    def step(
        self,
        feats: torch.Tensor,
        token_embeds: torch.Tensor,
        position_ids: torch.Tensor,
        mask: torch.Tensor | None,
        cache: DynamicCache | None = None,
        ttt: TTTLayout | None = None,
    ) -> torch.Tensor:
        """One pass of the head.

        feats, token_embeds: (B, Q, H); position_ids: (B, Q); mask: (B, 1, Q, K) bool with
        True = attend, K = keys in ``cache`` after this call (None: plain causal); ``ttt``:
        the unrolled-training key layout instead of a mask (see ``ttt_attention_core``).
        Returns predicted next features (B, Q, H).
        """
        # [embedding; feature], the reference's order, so its checkpoints map one to one
        x = self.fc(torch.cat([token_embeds, feats.to(token_embeds.dtype)], dim=-1))
        cos, sin = self.target.rotary_embedding()(x, position_ids)
        return self.layer(
            x,
            attention_mask=mask,
            position_ids=position_ids,
            **cache_kw(self.layer, cache),
            use_cache=cache is not None,
            position_embeddings=(cos.to(x.dtype), sin.to(x.dtype)),
            ttt=ttt,
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
        # padded keys are masked; padded queries still see key 0, so no row is empty
        layout = TTTLayout(S, attention_mask[:, :S].bool(), self.target.draft_window)
        pos = torch.arange(S, device=dev)
        ids = torch.cat([input_ids, input_ids.new_zeros(B, steps)], dim=1)
        cache = DynamicCache() if steps > 1 else None
        outs: list[torch.Tensor] = []
        h = feats[:, :S]
        for j in range(1, steps + 1):
            emb = self._embed(ids[:, j : j + S])
            position_ids = (pos + (j - 1)).expand(B, S)
            h = self.step(h, emb, position_ids, None, cache, ttt=layout)
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
                t_prob, t_arg = t_logits.softmax(-1), t_logits.argmax(-1)
                del t_logits
            if self.cfg.loss == "ce" and self.target.logit_softcap is None:
                # the frozen LM head and the soft CE, fused (a capped head goes unfused)
                w = self.target.lm_head.weight
                rows_n = torch.arange(n, device=p_hat.device)
                cls, _, d_arg = linear_soft_cross_entropy(p_hat.to(w.dtype), w, t_prob, rows_n)
            else:
                d_logits = self.logits(p_hat)
                cls, d_arg = head_loss(self.cfg.loss, d_logits, t_prob), d_logits.argmax(-1)
            acc = (d_arg == t_arg).float().sum()
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
        agreed_so_far, agrees = torch.ones_like(masks[0]), []
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
            agrees.append(agree)
        out["loss_reg"] = metric(loss_total, masks[0].sum())
        out.update(served_chain(agrees, masks))
        return out

    def _argmax_logits(self, h: torch.Tensor) -> torch.Tensor:
        c = self.cfg.lm_head_chunk
        return torch.cat([self.logits(h[i : i + c]).argmax(-1) for i in range(0, len(h), c)])

    def proposer(self, settings: DecodeSettings | None = None) -> EagleProposer:
        """This head as a proposer for the shared decoder: a chain (``tree="chain"`` or
        ``"auto"``), or (``tree="dynamic"``) EAGLE-2's dynamic draft tree with ``depth``,
        ``top_k``, ``total_tokens`` and ``min_prob``."""
        s = settings or DecodeSettings()
        if s.tree == "dynamic":
            return EagleTreeProposer(self, s.depth, s.top_k, s.total_tokens, s.min_prob)
        if s.tree not in ("chain", "auto"):
            raise ValueError(f"tree={s.tree!r}: EAGLE drafts use chain or dynamic")
        return EagleProposer(self)

    def quantize_for_decoding(self, mode: str) -> int:
        # the decode path only calls the head's layers (FC and decoder layer). EAGLE-1 drafts
        # through the target's LM head (V x H: the largest read of a draft step), so the draft
        # gets its own int8 copy of it; the target keeps its own weights for verification.
        n = quantize_linears(self, mode)
        lm = int8_linear(self.target.lm_head, mode) if n else None
        if lm is not None:
            object.__setattr__(self, "_draft_lm_head", lm)  # decode-time only, never saved
        return n + (lm is not None)

    @torch.no_grad()
    def probe(self, prompt: list[int]) -> torch.Tensor:
        """Draft logits (T - 1, V) at every position of ``prompt`` (-inf outside an EAGLE-3
        draft vocabulary), fed the target's real features as at decode time."""
        target = self.target
        ids = torch.tensor([prompt[:-1]], device=target.device)
        feats = target.features(ids, torch.ones_like(ids), tuple(self.feature_layers))[0]
        prop = EagleProposer(self)
        prop.reset()  # not start(): that would feed the prompt's pairs already
        state = DecodeState(list(prompt), feats, Sampling(), None, target.device)
        h = prop._catch_up(state, upto=len(prompt) - 1)  # the head over every committed pair
        return self.vocab_logits(h[0])

    def export_checks(self) -> dict[str, DecodeSettings]:
        return {
            "chain": DecodeSettings(tree="chain"),
            "tree": DecodeSettings(tree="dynamic", depth=4, top_k=4, total_tokens=16),
        }

    # -- save / load ---------------------------------------------------------------------

    def save_draft(self, path: str | Path, **extra) -> None:
        """The draft folder; ``extra``: keys a subclass adds to its ``config.json``."""
        save_weights_draft(self, path, 2, **extra)

    @classmethod
    def load_draft(cls, path: str | Path, target: Target) -> EagleHead:
        cfg = read_draft_config(path)
        # EAGLE-1 drafts saved before format 2 kept the layer's input norm and read
        # [feature; embedding]; they load as they were trained.
        legacy = cfg["specdraft"]["method"] == "eagle1" and "input_norm" not in cfg["method"]
        if legacy:
            cfg["method"]["input_norm"] = True
        check_hidden_size(cfg, path, target)
        head = cls(target, cls.config_class(**cfg["method"]))
        state = read_draft_weights(path)
        if legacy and "fc.weight" in state:
            H = target.hidden_size
            state["fc.weight"] = torch.cat(
                [state["fc.weight"][:, H:], state["fc.weight"][:, :H]], 1
            )
        fit_weights(head, state, path, cfg)
        return head.to(target.device)


class Eagle3Head(EagleHead):
    """EAGLE-3: FC(3H -> H) over three target layers, one decoder layer whose attention reads
    [norm(embedding); norm(hidden)] (2H), a final norm and a draft LM head over ``draft_vocab``
    tokens. Parameter names follow the EAGLE-3 serving layout (``fc``, ``midlayer.*``,
    ``norm``, ``lm_head``, buffers ``d2t``, ``t2d``), so export is a rename-free copy.

    ``feature_layers`` = the three fused layers + the target's final (normed) hidden state,
    from which the soft labels are computed through the target's LM head."""

    config_class = Eagle3Config

    def __init__(self, target: Target, cfg: Eagle3Config):
        nn.Module.__init__(self)
        check_head_loss(cfg.loss)
        H, L, V = target.hidden_size, target.num_layers, target.config.vocab_size
        fuse = list(cfg.fuse_layers) if cfg.fuse_layers is not None else default_fuse_layers(L)
        if len(fuse) != 3:
            raise DraftError(f"method.fuse_layers={fuse}: EAGLE-3 fuses exactly three layers")
        # Non-negative and ascending: serving engines collect the fused states in layer order,
        # so FC's input blocks must come in that order for an export to mean the same thing.
        fuse = sorted(target.layer_index(i) for i in fuse)  # range check names a bad index
        dv = cfg.draft_vocab_size or min(32768, max(1024, round(V / 4 / 1024) * 1024))
        dv = min(dv, V)
        if dv < 2:
            raise DraftError(f"method.draft_vocab_size={dv}: must be >= 2")
        self.cfg = cfg = type(cfg)(  # a subclass's config (HASS) keeps its own fields
            **{**asdict(cfg), "fuse_layers": fuse, "draft_vocab_size": dv}
        )
        self.feature_layers = (*fuse, -1)
        self.fc = nn.Linear(3 * H, H, bias=False)
        self.midlayer = layer = eagle_layer(target)
        attn = layer.self_attn
        for name in ("q_proj", "k_proj", "v_proj"):  # attention reads [embedding; hidden]
            old = getattr(attn, name)
            setattr(attn, name, nn.Linear(2 * H, old.out_features, bias=old.bias is not None))
        from transformers.models.llama.modeling_llama import LlamaRMSNorm

        norm_cls = LlamaRMSNorm  # the engines' draft norm, whatever the target's (Gemma: 1 + w)
        eps = layer_shape(target.config)["eps"]
        layer.hidden_norm = norm_cls(H, eps=eps)
        self.norm = norm_cls(H, eps=eps)
        if cfg.norm_before_fc:
            self.input_norm = norm_cls(3 * H, eps=eps)
        if cfg.fc_norm:
            self.fc_norm = nn.ModuleList(norm_cls(H, eps=eps) for _ in range(3))
        self.lm_head = nn.Linear(H, dv, bias=False)
        # Identity mapping until init_from_data picks the frequent tokens (or a load fills it).
        self.register_buffer("d2t", torch.zeros(dv, dtype=torch.long))
        self.register_buffer("t2d", torch.zeros(V, dtype=torch.bool))
        self.t2d[:dv] = True
        # whether d2t/t2d hold a chosen vocabulary: the placeholder above is also the identity
        # that a full-vocabulary head chooses, so only the record tells the two apart
        self.vocab_chosen = False
        with torch.no_grad():  # start the draft head from the target's rows for its tokens
            self.lm_head.weight.copy_(target.lm_head.weight[:dv].float())
        object.__setattr__(self, "target", target)

    def serving_problem(self) -> str | None:
        """Serving engines (vLLM, SGLang, TensorRT-LLM, llama.cpp) capture three distinct
        hidden states at the outputs of decoder layers 1..L-1 (a layer's input, in llama.cpp's
        terms); a head fusing any other set exports nowhere."""
        fuse = list(self.cfg.fuse_layers)
        L = self.target.num_layers
        if len(set(fuse)) == 3 and all(1 <= i < L for i in fuse):
            return None
        why = (
            f"this {L}-layer target has too few layers (at least 4)"
            if L < 4
            else "choose three distinct layers in that range"
        )
        return (
            f"method.fuse_layers={fuse}: serving engines take EAGLE-3 heads that fuse three "
            f"distinct layers in 1..{L - 1}; {why}"
        )

    def init_from_data(self, train, log=print) -> None:
        """Choose the draft vocabulary: the ``draft_vocab_size`` most frequent assistant tokens
        of the training split (ties: lower id), and start the draft LM head from the target's
        rows for them. ``train``: a tokenised split with ``input_ids`` and ``loss_mask``."""
        counts = assistant_token_counts(train, self.t2d.numel())
        d2t, t2d = draft_vocab(counts, self.lm_head.out_features)
        covered = counts[d2t + torch.arange(len(d2t))].sum() / counts.sum().clamp_min(1)
        self.d2t.copy_(d2t)
        self.t2d.copy_(t2d)
        self.vocab_chosen = True
        with torch.no_grad():
            ids = (torch.arange(len(d2t)) + d2t).to(self.target.lm_head.weight.device)
            self.lm_head.weight.copy_(self.target.lm_head.weight[ids].float())
        log(
            f"{self.cfg.name}: draft vocabulary {len(d2t)} of {self.t2d.numel()} tokens, covering "
            f"{covered:.1%} of {int(counts.sum())} assistant tokens in the training split"
        )

    def start_from(self, src: EagleHead) -> None:
        super().start_from(src)
        self.vocab_chosen = src.vocab_chosen

    def save_draft(self, path: str | Path, **extra) -> None:
        super().save_draft(path, **{VOCAB_CHOSEN: self.vocab_chosen}, **extra)

    @classmethod
    def load_draft(cls, path: str | Path, target: Target) -> EagleHead:
        head = super().load_draft(path, target)
        head.vocab_chosen = saved_vocab_chosen(read_draft_config(path), head)
        return head

    # -- the head ------------------------------------------------------------------------

    def initial_hidden(self, features: torch.Tensor) -> torch.Tensor:
        f = features[..., :3, :].to(self._compute_dtype())
        if self.cfg.norm_before_fc:  # one norm over the concatenation (speculators')
            f = self.input_norm(f.flatten(-2)).unflatten(-1, f.shape[-2:])
        if self.cfg.fc_norm:  # one per fused layer (EAGLE 3.1), after it as vLLM applies them
            f = torch.stack([norm(f[..., i, :]) for i, norm in enumerate(self.fc_norm)], -2)
        return self.fc(f.flatten(-2))

    def step(self, h, token_embeds, position_ids, mask, cache=None, ttt=None):
        """One pass: h, token_embeds (B, Q, H) -> the head's hidden state (B, Q, H), pre-norm
        (the next step's input)."""
        layer = self.midlayer
        hn = layer.hidden_norm(h)
        x = torch.cat([layer.input_layernorm(token_embeds), hn], dim=-1)
        if self.cfg.norm_before_residual:
            h = hn
        cos, sin = self.target.rotary_embedding()(h, position_ids)
        a, _ = layer.self_attn(
            hidden_states=x,
            attention_mask=mask,
            position_ids=position_ids,
            **cache_kw(layer.self_attn, cache),
            use_cache=cache is not None,
            position_embeddings=(cos.to(h.dtype), sin.to(h.dtype)),
            ttt=ttt,
        )
        h = h + a
        h = h + layer.mlp(layer.post_attention_layernorm(h))
        return self.norm(h) if self.cfg.norm_output else h

    def draft_logits(self, h: torch.Tensor, float32: bool = True) -> torch.Tensor:
        """(..., H) -> (..., draft_vocab), float32 unless ``float32=False`` (the compute
        dtype, for a loss that reads them once). ``h`` is what ``step`` returns (already normed
        when ``norm_output``)."""
        z = self.lm_head(h if self.cfg.norm_output else self.norm(h))
        return z.float() if float32 else z

    def own_logits(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        return self.draft_logits(h), self.d2t

    def quantize_for_decoding(self, mode: str) -> int:
        # EAGLE-3 drafts through its own (quantized) LM head: no copy of the target's
        return quantize_linears(self, mode)

    def top_tokens(self, h: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        # over the draft vocabulary only, then mapped to target ids (no V-wide tensor)
        top = self.draft_logits(h).log_softmax(-1).topk(min(k, self.lm_head.out_features), dim=-1)
        return top.values, top.indices + self.d2t[top.indices]

    def vocab_logits(self, h: torch.Tensor) -> torch.Tensor:
        return self.to_target_vocab(self.draft_logits(h), fill=float("-inf"))

    def to_target_vocab(self, x: torch.Tensor, fill: float = 0.0) -> torch.Tensor:
        """Values over the draft vocabulary (..., draft_vocab) laid out over the target's
        (..., V), ``fill`` elsewhere (0 for probabilities, -inf for logits)."""
        out = x.new_full((*x.shape[:-1], self.t2d.numel()), fill)
        # target ids of the draft tokens (increasing, so the t2d order): an index, not the
        # boolean t2d, which torch would turn into indices again on every call
        ids = torch.arange(len(self.d2t), device=self.d2t.device) + self.d2t
        return out.index_copy_(-1, ids, x)

    def target_logits(self, f_final: torch.Tensor, draft_only: bool) -> torch.Tensor:
        """Target LM head on its final hidden states (N, H): over the draft vocabulary
        (N, draft_vocab) or the whole vocabulary (N, V), float32."""
        w = self.target.lm_head.weight
        return self.target.logits(f_final, w[self.t2d] if draft_only else None)

    # -- training ------------------------------------------------------------------------

    def forward(self, batch: dict[str, torch.Tensor]) -> StepOutput:
        f = batch["features"]  # (B, T, 4, H)
        ids, attn, lm = batch["input_ids"], batch["attention_mask"], batch["loss_mask"]
        k = min(self.cfg.ttt_steps, f.shape[1] - 1)
        preds = self.unroll(self.initial_hidden(f), ids, attn, steps=k)
        masks = self.train_masks(position_mask(lm, attn, steps=k))
        weights = [self.cfg.step_decay**i for i in range(k)]
        # Soft labels once per position: every unrolled step reads the same target positions
        # shifted, so computing them per step would repeat the (N, draft_vocab) product k times.
        labelled = lm.bool() & attn.bool()
        row_of = torch.full(lm.shape, -1, dtype=torch.long, device=lm.device)
        row_of[labelled] = torch.arange(int(labelled.sum()), device=lm.device)
        with torch.no_grad():  # (N, draft_vocab): the target's distribution, once per position
            t_logits = self.target_logits(f[:, :, 3][labelled], draft_only=True)
            t_prob, t_arg = t_logits.softmax(-1), t_logits.argmax(-1)
            del t_logits
        # the rows each step is trained on: its head states and the teacher rows they predict
        hs, idxs, ws = [], [], []
        for j, (pred, mask, w) in enumerate(zip(preds, masks, weights, strict=True), start=1):
            rows = mask.nonzero(as_tuple=True)
            hs.append(pred[rows])
            idxs.append(row_of[rows[0], rows[1] + j])  # position_mask: s + j is labelled
            ws.append(w)
        metrics: dict[str, torch.Tensor] = {}
        loss, ces, args = self.steps_loss(hs, t_prob, idxs, ws, metrics)
        if not any(len(x) for x in idxs):  # nothing to learn here: a zero loss with a graph
            loss = loss + 0.0 * sum(p.sum() for p in preds)
        for j, (ce, arg, idx) in enumerate(zip(ces, args, idxs, strict=True), start=1):
            n = len(idx)
            if n:
                acc = (arg == t_arg.index_select(0, idx)).float().sum()
                metrics[f"loss_step{j}"] = metric(ce * n, n)
                metrics[f"acc_step{j}"] = metric(acc, n)
        metrics["acc"] = metrics.get("acc_step1", metric(0.0, 0))
        return StepOutput(loss=loss, metrics=metrics)

    def train_masks(self, masks: list[torch.Tensor]) -> list[torch.Tensor]:
        """Where each unrolled step is trained, from ``position_mask``'s (B, T-1) bool per
        step: all of it here; P-EAGLE keeps a random share of the deeper ones."""
        return masks

    # The steps' soft CE fused with the draft LM head (``linear_soft_cross_entropy``): the
    # (N, draft_vocab) logits are never held whole, and one call covers every unrolled step.
    # A subclass whose step loss reads the logits (HASS) sets False and overrides
    # ``logits_loss``.
    fused_step_ce = True

    def steps_loss(
        self,
        hs: list[torch.Tensor],
        t_prob: torch.Tensor,
        idxs: list[torch.Tensor],
        weights: list[float],
        metrics: dict,
    ) -> tuple[torch.Tensor, list[torch.Tensor], list[torch.Tensor]]:
        """The training loss of the unrolled steps: sum_j weights[j] * (step j's mean loss).
        Step j's head states hs[j] (n_j, H) are scored against the target's distribution over
        the draft vocabulary, rows ``idxs[j]`` (n_j,) of ``t_prob`` (M, draft_vocab). Returns
        (loss, each step's mean loss (detached; 0 for an empty step), each step's draft
        argmax (n_j,)). A subclass's ``logits_loss`` may add its own terms to ``metrics``."""
        ns = [len(i) for i in idxs]
        if self.cfg.loss == "ce" and self.fused_step_ce:
            h = torch.cat(hs)
            r = torch.cat(
                [
                    torch.full((n,), w / max(n, 1), device=h.device)
                    for n, w in zip(ns, weights, strict=True)
                ]
            )
            loss, rows, arg = linear_soft_cross_entropy(
                h if self.cfg.norm_output else self.norm(h),
                self.lm_head.weight,
                t_prob,
                torch.cat(idxs),
                r,
            )
            ces = [x.mean() if len(x) else x.sum() for x in rows.split(ns)]
            return loss, ces, list(arg.split(ns))
        loss, ces, args = t_prob.new_zeros(()), [], []
        for h, idx, w, n in zip(hs, idxs, weights, ns, strict=True):
            if n == 0:
                ces.append(t_prob.new_zeros(()))
                args.append(idx)
                continue
            d_logits = self.draft_logits(h, float32=False)
            ce = self.logits_loss(d_logits, t_prob.index_select(0, idx), metrics, n)
            loss = loss + w * ce
            ces.append(ce.detach())
            args.append(d_logits.detach().argmax(-1))
        return loss, ces, args

    def logits_loss(
        self, d_logits: torch.Tensor, t_prob: torch.Tensor, metrics: dict, n: int
    ) -> torch.Tensor:
        """One step's loss from the draft logits (n, draft_vocab) and the teacher rows (n,
        draft_vocab), when it is not fused. HASS adds to it."""
        return head_loss(self.cfg.loss, d_logits, t_prob)

    @torch.no_grad()
    def evaluate(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """As EAGLE-1's: agreement of the draft's token (mapped to target ids) with the
        target's argmax over its whole vocabulary, per draft position, rolled on its own
        hidden states; plus the step-1 soft CE on the draft vocabulary."""
        f = batch["features"]
        ids, attn, lm = batch["input_ids"], batch["attention_mask"], batch["loss_mask"]
        k = min(self.cfg.val_positions, f.shape[1] - 1)
        preds = self.unroll(self.initial_hidden(f), ids, attn, steps=k)
        masks = position_mask(lm, attn, steps=k)
        out: dict[str, torch.Tensor] = {}
        agreed_so_far, agrees = torch.ones_like(masks[0]), []
        c = self.cfg.lm_head_chunk
        for j, (pred, mask) in enumerate(zip(preds, masks, strict=True), start=1):
            m = mask & agreed_so_far if j > 1 else mask
            agree = torch.zeros_like(mask)
            rows = mask.nonzero(as_tuple=True)
            if rows[0].numel():
                ph, tf = pred[rows], f[:, j:, 3][rows]
                d = torch.cat(
                    [self.draft_logits(ph[i : i + c]).argmax(-1) for i in range(0, len(ph), c)]
                )
                d = d + self.d2t[d]
                t = torch.cat(
                    [
                        self.target_logits(tf[i : i + c], False).argmax(-1)
                        for i in range(0, len(tf), c)
                    ]
                )
                agree[rows] = d == t
                if j == 1:
                    ce = soft_cross_entropy(
                        self.draft_logits(ph), self.target_logits(tf, draft_only=True)
                    )
                    out["loss_cls"] = metric(ce * rows[0].numel(), rows[0].numel())
            out[f"top1_pos{j}"] = metric(agree[mask].float().sum(), mask.sum())
            out[f"alpha_pos{j}"] = metric(agree[m].float().sum(), m.sum())
            agreed_so_far = agreed_so_far & agree
            agrees.append(agree)
        out.update(served_chain(agrees, masks))
        return out


# ---------------------------------------------------------------------------------------------
# Pure loss functions and masks


def default_fuse_layers(num_layers: int) -> list[int]:
    """EAGLE-3's fused layers when none are given: the reference's low, middle and high layers
    (2, L // 2, L - 3), kept three distinct layers in 1..L-1 (what serving engines take) wherever
    the target has at least 4 layers; a smaller target gets the nearest in range (such a head
    decodes here, but no engine takes it, and training refuses it: ``serving_problem``)."""
    L = num_layers
    if L < 4:  # no three distinct layers in range: the reference's, clamped, as before
        return sorted(min(max(i, 1), L) for i in (2, L // 2, L - 3))
    fuse = sorted({min(max(i, 1), L - 1) for i in (2, L // 2, L - 3)})
    return fuse if len(fuse) == 3 else [1, L // 2, L - 1]


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


#: records read at a time when counting a split's assistant tokens: a few MB of token ids
#: (records hold up to data.max_length tokens), where the whole ShareGPT split holds 22.7M
COUNT_CHUNK_RECORDS = 1024


def assistant_token_counts(
    split, vocab_size: int, chunk_records: int = COUNT_CHUNK_RECORDS
) -> torch.Tensor:
    """How often each token id below ``vocab_size`` occurs on assistant (loss-mask) positions:
    (V,) int64. ``split``: a tokenised ``datasets`` split with ``input_ids`` and ``loss_mask``
    columns, read ``chunk_records`` records at a time (a running count, so memory stays that
    of one chunk however large the split)."""
    import numpy as np

    counts = np.zeros(vocab_size, dtype=np.int64)
    rows = split.with_format("arrow", columns=["input_ids", "loss_mask"])
    for table in rows.iter(batch_size=chunk_records):  # Arrow tables, indices applied
        ids = np.asarray(table.column("input_ids").combine_chunks().flatten())
        mask = np.asarray(table.column("loss_mask").combine_chunks().flatten()).astype(bool)
        counts += np.bincount(ids[mask], minlength=vocab_size)[:vocab_size]
    return torch.from_numpy(counts)


#: ``config.json`` key of a saved draft with a draft vocabulary (EAGLE-3 and the heads built on
#: it, DFlash): whether its ``d2t``/``t2d`` were chosen from the training data
VOCAB_CHOSEN = "draft_vocab_chosen"


def saved_vocab_chosen(config: dict, draft) -> bool:
    """Whether a saved draft's vocabulary mapping was chosen from data, as its ``config.json``
    records. Drafts saved before the record: chosen if ``d2t`` moves any id (only a choice
    does) or the draft vocabulary is the whole vocabulary (the one mapping there is)."""
    if VOCAB_CHOSEN in config:
        return bool(config[VOCAB_CHOSEN])
    return bool(draft.d2t.any()) or draft.d2t.numel() == draft.t2d.numel()


def draft_vocab(counts: torch.Tensor, size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``size`` most frequent token ids (ties: lower id first) as EAGLE-3's mappings.

    counts: (V,). Returns d2t (size,) int64 with target_id = draft_id + d2t[draft_id], draft
    ids ordered by target id; and t2d (V,) bool, True for tokens in the draft vocabulary."""
    V = counts.numel()
    if not 1 <= size <= V:
        raise ValueError(f"draft vocabulary size {size} must be within 1..{V}")
    # stable sort on -count keeps lower ids first among equal counts
    order = torch.sort(-counts, stable=True).indices[:size]
    chosen = torch.sort(order).values
    t2d = torch.zeros(V, dtype=torch.bool)
    t2d[chosen] = True
    return chosen - torch.arange(size), t2d
