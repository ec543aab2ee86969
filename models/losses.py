"""Losses a draft head can train with against the target's distribution, chosen per method by
``method.loss`` (EAGLE-1, EAGLE-3, HASS, P-EAGLE, Medusa, the MLP speculator, DFlash, DSpark,
Domino):

- ``ce``: soft cross-entropy -sum_x p(x) log q(x), the heads' default (EAGLE, Medusa-2's
  self-distillation); minimised at q = p, with gradients everywhere.
- ``tvd``: total variation 0.5 sum_x |p(x) - q(x)| = 1 - sum_x min(p(x), q(x)), one minus
  the probability that speculative sampling at T = 1 accepts a token drawn from q: the
  acceptance rate itself, DistillSpec's best divergence on the embedded target.
- ``lk_alpha`` and ``lk_lambda``: the LK losses (arXiv 2602.23881), written on the expected
  acceptance a = sum_x min(p(x), q(x)) of each row. ``lk_alpha`` is -mean log a (the
  acceptance's log-likelihood: it pushes hardest where a row accepts least); ``lk_lambda``
  mixes the soft CE and 1 - mean a with a weight that decays as the acceptance grows,
  w = scale * exp(-decay * mean a) (detached): CE's gradients early, the acceptance itself
  once the head is close. Defaults scale = decay = 1, as SpecForge's.
- ``dpace`` (block and chain drafters, ``dpace_weights``): D-PACE (arXiv 2605.18810) weights
  each draft position's CE by the acceptance length it can still earn: the sum, over the
  positions from it to the block's end, of the product of the (smoothed, detached)
  acceptances up to each; at smoothing 0 these are exactly the derivatives of the expected
  accepted length with respect to each position's log-acceptance.

Pure functions of logits (N, V) and teacher probabilities (N, V), mean over rows (or weighted
by ``weights`` (N,) summing to 1), float32.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .base import DraftError

HEAD_LOSSES = ("ce", "tvd", "lk_alpha", "lk_lambda")
#: the LK-lambda mixing weight: scale * exp(-decay * mean acceptance)
LK_KL_SCALE, LK_KL_DECAY = 1.0, 1.0
#: D-PACE's smoothing: position k's acceptance enters the prefix product as
#: (1 - DPACE_ALPHA) * a_k + DPACE_ALPHA (its paper's and SpecForge's 0.5)
DPACE_ALPHA = 0.5


def soft_cross_entropy(student_logits: torch.Tensor, teacher_logits: torch.Tensor) -> torch.Tensor:
    """-sum_x p(x) log q(x) averaged over rows; logits (N, V), p = softmax(teacher).

    Equals KL(p || q) + H(p): minimised, for fixed p, exactly at q = p."""
    p = teacher_logits.float().softmax(-1)
    return -(p * student_logits.float().log_softmax(-1)).sum(-1).mean()


def soft_cross_entropy_probs(
    student_logits: torch.Tensor, teacher_probs: torch.Tensor
) -> torch.Tensor:
    """-sum_x p(x) log q(x) averaged over rows, through torch's fused cross-entropy with
    probability targets. student logits any float dtype; teacher rows sum to 1."""
    return F.cross_entropy(student_logits.float(), teacher_probs.float())


class _LinearSoftCE(torch.autograd.Function):
    """Soft cross-entropy of ``softmax(h @ weight.T)`` against teacher rows, loss and gradients
    in one pass over row chunks: the (N, V) logits exist one chunk at a time in float32, and
    what is kept for backward is the gradients of h and of the weight, computed at once by two
    large matmuls from the (N, V) gradient of the logits. See ``linear_soft_cross_entropy``."""

    @staticmethod
    def forward(ctx, h, weight, probs, rows, row_weights, chunk):
        with torch.autocast(h.device.type, enabled=False):
            n = h.shape[0]
            w = weight.to(h.dtype)
            # The gradients exist before any loss scaling, so float16 would underflow them
            # (rows weighted ~1/N): keep them in float32 there; bfloat16 has float32's range.
            gdt = torch.float32 if h.dtype == torch.float16 else h.dtype
            grad_logits = torch.empty(n, w.shape[0], dtype=gdt, device=h.device)
            losses = torch.empty(n, dtype=torch.float32, device=h.device)
            arg = torch.empty(n, dtype=torch.long, device=h.device)
            for i in range(0, n, chunk):
                z = F.linear(h[i : i + chunk], w).float()
                p = probs.index_select(0, rows[i : i + chunk]).float()
                lse = torch.logsumexp(z, -1)
                # -sum_x p log q = sum_x p (lse - z) = lse - p.z, for rows of p summing to 1
                losses[i : i + chunk] = lse - (p * z).sum(-1)
                arg[i : i + chunk] = z.argmax(-1)
                # d/dz of r * (the row's loss): r * (softmax(z) - p)
                g = z.sub_(lse[:, None]).exp_().sub_(p).mul_(row_weights[i : i + chunk, None])
                grad_logits[i : i + chunk] = g
            # only the gradients autograd will ask for (a frozen LM head needs none)
            grad_h = grad_logits @ w.to(gdt) if ctx.needs_input_grad[0] else None
            grad_w = (
                (grad_logits.t() @ h.to(gdt)).to(weight.dtype) if ctx.needs_input_grad[1] else None
            )
        ctx.save_for_backward(grad_h, grad_w)
        ctx.h_dtype = h.dtype
        ctx.mark_non_differentiable(losses, arg)
        return (losses * row_weights).sum(), losses, arg

    @staticmethod
    def backward(ctx, grad_loss, _grad_losses, _grad_arg):
        grad_h, grad_w = ctx.saved_tensors
        if not bool(grad_loss == 1):  # the usual case (the loss itself) needs no pass
            if grad_h is not None:
                grad_h = grad_h.float() * grad_loss
            if grad_w is not None:
                grad_w = grad_w * grad_loss.to(grad_w.dtype)
        if grad_h is not None:
            grad_h = grad_h.to(ctx.h_dtype)
        return grad_h, grad_w, None, None, None, None


def linear_soft_cross_entropy(
    h: torch.Tensor,
    weight: torch.Tensor,
    teacher_probs: torch.Tensor,
    rows: torch.Tensor,
    row_weights: torch.Tensor | None = None,
    chunk: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The soft cross-entropy ``-sum_x p(x) log q(x)`` of ``q = softmax(F.linear(h, weight))``
    against teacher rows ``p = teacher_probs[rows]``, weighted per row, with an LM head's
    product and its loss fused over chunks of rows: the (N, V) float32 logits, their
    log-softmax and the gathered teacher rows never exist whole, and the gradients are
    computed in the same pass (on a CPU the memory traffic of those (N, V) tensors, not their
    FLOPs, dominated a draft head's training step).

    h (N, H): the student's states (any float dtype; under autocast the matmuls run in the
    autocast dtype, as ``F.linear`` would); weight (V, H): the LM head's (gradients reach h and
    weight); teacher_probs (M, V) with rows summing to 1; rows (N,) int64 into them;
    row_weights (N,) float32, default 1/N (the mean). ``chunk``: rows per chunk (default about
    2**20 float32 logits on a CPU, 2**24 on an accelerator).

    Returns (sum_i row_weights[i] * loss_i: a float32 scalar, the per-row losses (N,) float32
    without gradient, the student's argmax (N,) int64)."""
    dev = h.device.type
    if torch.is_autocast_enabled(dev):
        h = h.to(torch.get_autocast_dtype(dev))
    n = h.shape[0]
    if row_weights is None:
        row_weights = torch.full((n,), 1.0 / max(n, 1), device=h.device)
    if chunk is None:
        chunk = max(1, (2**20 if dev == "cpu" else 2**24) // weight.shape[0])
    return _LinearSoftCE.apply(h, weight, teacher_probs, rows, row_weights.float(), chunk)


def total_variation_probs(
    student_logits: torch.Tensor, teacher_probs: torch.Tensor
) -> torch.Tensor:
    """0.5 sum_x |p(x) - q(x)| averaged over rows, in [0, 1]; 0 exactly where q = p."""
    q = student_logits.float().softmax(-1)
    return 0.5 * (teacher_probs.float() - q).abs().sum(-1).mean()


def _mean(x: torch.Tensor, weights: torch.Tensor | None) -> torch.Tensor:
    return x.mean() if weights is None else (x * weights).sum()


def acceptance_probs(student_logits: torch.Tensor, teacher_probs: torch.Tensor) -> torch.Tensor:
    """sum_x min(p(x), q(x)) per row (N,), float32, q = softmax(student): the probability that
    speculative sampling at T = 1 accepts the row's drafted token."""
    q = student_logits.float().softmax(-1)
    return torch.minimum(teacher_probs.float(), q).sum(-1)


def lk_loss(
    kind: str, ce: torch.Tensor, accept: torch.Tensor, weights: torch.Tensor | None = None
) -> torch.Tensor:
    """The LK losses from per-row soft CE ``ce`` (N,) and acceptance ``accept`` (N,):
    ``lk_alpha`` = -mean log a; ``lk_lambda`` = w CE + (1 - w)(1 - mean a), w = LK_KL_SCALE *
    exp(-LK_KL_DECAY * mean a) detached. A row with a = 0 adds nothing to ``lk_alpha`` (its
    log has no gradient to give), as the reference's."""
    if kind == "lk_alpha":
        safe = accept.clamp_min(torch.finfo(torch.float32).tiny)
        return -_mean(torch.where(accept > 0, safe.log(), torch.zeros_like(safe)), weights)
    if kind == "lk_lambda":
        a = _mean(accept, weights)
        w = LK_KL_SCALE * torch.exp(-LK_KL_DECAY * a.detach())
        return w * _mean(ce, weights) + (1 - w) * (1 - a)
    raise ValueError(f"method.loss={kind!r}: not an LK loss (lk_alpha, lk_lambda)")


def head_loss(
    kind: str,
    student_logits: torch.Tensor,
    teacher_probs: torch.Tensor,
    weights: torch.Tensor | None = None,
) -> torch.Tensor:
    """The ``method.loss`` named ``kind`` of logits (N, V) against teacher rows (N, V), the
    mean over rows or their ``weights`` (N,) summing to 1."""
    if kind == "ce":
        if weights is None:
            return soft_cross_entropy_probs(student_logits, teacher_probs)
        ce = -(teacher_probs.float() * student_logits.float().log_softmax(-1)).sum(-1)
        return (ce * weights).sum()
    if kind == "tvd":
        if weights is None:
            return total_variation_probs(student_logits, teacher_probs)
        return 1.0 - _mean(acceptance_probs(student_logits, teacher_probs), weights)
    if kind in ("lk_alpha", "lk_lambda"):
        ce = -(teacher_probs.float() * student_logits.float().log_softmax(-1)).sum(-1)
        return lk_loss(kind, ce, acceptance_probs(student_logits, teacher_probs), weights)
    raise ValueError(f"method.loss={kind!r}: use one of {', '.join(HEAD_LOSSES)}")


def hard_label_loss(kind: str, student_logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """``head_loss`` against one-hot targets (a head trained on the data's tokens): ``ce`` is
    cross-entropy, ``tvd`` is 1 - q(label), the LK losses read a = q(label), without building
    the (N, V) one-hot rows."""
    if kind == "ce":
        return F.cross_entropy(student_logits.float(), labels)
    logq = student_logits.float().log_softmax(-1).gather(-1, labels[:, None])[:, 0]
    if kind == "tvd":
        return 1.0 - logq.exp().mean()
    if kind in ("lk_alpha", "lk_lambda"):
        return lk_loss(kind, -logq, logq.exp())
    raise ValueError(f"method.loss={kind!r}: use one of {', '.join(HEAD_LOSSES)}")


def dpace_weights(
    accept: torch.Tensor, valid: torch.Tensor, alpha: float = DPACE_ALPHA
) -> torch.Tensor:
    """D-PACE's position weights (N, K) for N blocks (or chains) of K draft positions, from each
    position's acceptance ``accept`` (N, K) in [0, 1] and whether it is labelled ``valid``
    (N, K) bool: with s_k = (1 - alpha) a_k + alpha (1 where not valid) and P_j = prod_{i<=j}
    s_i, w_k = sum_{j >= k, valid} P_j, zero where not valid; detached. At alpha = 0, w_k is
    d E[accepted length] / d log a_k with E = sum_j P_j."""
    if not 0.0 <= alpha <= 1.0:
        raise ValueError(f"D-PACE smoothing alpha={alpha}: must be in [0, 1]")
    with torch.no_grad():
        v = valid.to(accept.dtype)
        s = torch.where(valid, (1.0 - alpha) * accept + alpha, torch.ones_like(accept))
        prefix = s.cumprod(-1)
        suffix = (prefix * v).flip(-1).cumsum(-1).flip(-1)
        return suffix * v


def top_k_distillation(
    student_logits: torch.Tensor, teacher_probs: torch.Tensor, k: int
) -> torch.Tensor:
    """HASS's harmonized objective: -sum_{x in top-k(p)} p(x) log q(x) averaged over rows,
    i.e. the soft cross-entropy restricted to the teacher's k most likely tokens (the ones a
    draft tree ranks and the verifier accepts). logits (N, V), teacher rows sum to 1. Equals
    ``soft_cross_entropy_probs`` when k >= V; non-negative; no gradient reaches the logit of a
    token outside the top k except through the normaliser."""
    k = min(k, teacher_probs.shape[-1])
    p, idx = teacher_probs.float().topk(k, dim=-1)
    logq = student_logits.float().log_softmax(-1).gather(-1, idx)
    return -(p * logq).sum(-1).mean()


def check_head_loss(kind: str, extra: tuple[str, ...] = ()) -> str:
    """``kind`` if it names a head loss (or one of a method's ``extra`` ones, as a block
    drafter's ``dpace``), else a one-line error naming ``method.loss``."""
    if kind not in HEAD_LOSSES + extra:
        raise DraftError(f"method.loss={kind!r}: use one of {', '.join(HEAD_LOSSES + extra)}")
    return kind


# Masks of heads that predict k + 2 tokens ahead (Medusa heads, MLP speculator stages)


def head_masks(
    loss_mask: torch.Tensor, attention_mask: torch.Tensor, heads: int
) -> list[torch.Tensor]:
    """Where head k (0-based) of a multi-token head is trained/scored: (B, T) bool each. Head k
    at position t predicts x_{t+k+2}; that token must be an assistant token, every position
    from t to t+k+2 real (not padding), and x_{t+1} an assistant token too: serving drafts
    from the state at t only once x_{t+1}, the token it chose there, is a reply's (a
    request's first token is the prefill's, never drafted). Positions whose label falls past
    the end are False."""
    B, T = loss_mask.shape
    real = attention_mask.bool()
    pad = lambda x: torch.cat([x, x.new_zeros(B, heads + 2)], dim=1)  # noqa: E731
    lm, real = pad(loss_mask.bool()), pad(real)
    out = []
    for k in range(heads):
        m = lm[:, k + 2 : k + 2 + T] & lm[:, 1 : 1 + T]
        for i in range(0, k + 3):
            m &= real[:, i : i + T]
        out.append(m)
    return out
