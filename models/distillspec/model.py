"""DistillSpec: a separate small draft LM distilled towards the target (Zhou et al. 2024).

The student is any causal LM with the target's tokenizer (checked token by token), or one made
from the target itself (``student=truncate``: its embedding, ``num_layers`` (or the chosen
``student_layers``) decoder layers, final norm and LM head: the usual way to get a
same-tokenizer draft when the family has no smaller member, as for the embedded SmolLM2).
It trains fully or through a LoRA adapter (``peft``, merged when saved).

The loss is a divergence between the target's (teacher's) and the student's next-token
distributions on assistant tokens, at temperature ``temperature``, chosen with
``divergence``: ``fkl`` (KL(p || q)), ``rkl`` (KL(q || p)), ``jsd`` (generalised JSD with
``jsd_beta``) or ``tvd`` (total variation). TVD is the one acceptance depends on directly:
at temperature 1 a draft token is accepted with probability sum_x min(p, q) = 1 - TVD(p, q).

Data: the fixed dataset; teacher-generated answers (``specdraft-prepare``, then
``data.path=``: sequence-level KD); student-generated answers (on-policy: the student writes
the reply to each prompt with the sampling settings it will draft with, then the target
scores it); or a mix: ``on_policy`` is the fraction of micro-batches that are on-policy
(lambda in the paper), spread evenly and deterministically over training.

Sections: config, module, pure loss functions, propose, save/load.
"""

from __future__ import annotations

import math
from pathlib import Path

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from ..base import (
    DecodeSettings,
    DraftError,
    DraftMethod,
    StepOutput,
    lora_modules,
    metric,
    read_draft_config,
    write_draft_config,
)
from ..draft_lm import DraftLMProposer, load_same_vocabulary_lm
from ..target import Target, TargetError
from .config import DistillSpecConfig

STUDENT_DIR = "student"  # the distilled draft LM, a standalone HF folder inside the draft folder
DIVERGENCES = ("fkl", "rkl", "jsd", "tvd")

# ---------------------------------------------------------------------------------------------
# Module


class DistillSpecStudent(DraftMethod):
    """The student LM as a method: its parameters (or its LoRA adapter's) are what trains.
    ``feature_layers = (-1,)``: the loop supplies the target's final hidden state, from which
    the teacher's logits come through the target's frozen LM head; on-policy micro-batches
    run the target themselves on the student's replies."""

    config_class = DistillSpecConfig
    feature_layers: tuple[int, ...] = (-1,)

    def __init__(self, target: Target, cfg: DistillSpecConfig, student: nn.Module | None = None):
        super().__init__()
        if cfg.divergence not in DIVERGENCES:
            raise DraftError(f"method.divergence={cfg.divergence!r}: use one of {DIVERGENCES}")
        if not 0.0 <= cfg.on_policy <= 1.0:
            raise DraftError(f"method.on_policy={cfg.on_policy}: must be within [0, 1]")
        if not 0.0 <= cfg.jsd_beta <= 1.0 or cfg.temperature <= 0:
            raise DraftError(
                f"method.jsd_beta={cfg.jsd_beta}, temperature={cfg.temperature}: need "
                "0 <= jsd_beta <= 1 and temperature > 0"
            )
        self.cfg = cfg
        if student is None:
            student = make_student(target, cfg)
        if cfg.lora and not hasattr(student, "peft_config"):
            from peft import LoraConfig, get_peft_model

            student = get_peft_model(
                student,
                LoraConfig(
                    r=cfg.lora_r,
                    lora_alpha=cfg.lora_alpha,
                    lora_dropout=cfg.lora_dropout,
                    target_modules=lora_modules(student, cfg.lora_target_modules),
                    bias="none",
                ),
            )
        elif not cfg.lora:
            student.requires_grad_(True)
        self.student = student
        self.register_buffer("micro_batches", torch.zeros((), dtype=torch.long))
        object.__setattr__(self, "target", target)

    def _lm(self) -> nn.Module:
        """The student's causal LM (under its peft wrapper, if any)."""
        s = self.student
        return s.get_base_model() if hasattr(s, "get_base_model") else s

    def student_hidden(self, ids: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
        out = self._lm().get_decoder()(input_ids=ids, attention_mask=attn, use_cache=False)
        return out.last_hidden_state

    def student_logits(self, h: torch.Tensor) -> torch.Tensor:
        """The student's next-token logits (..., H) -> (..., V) float32, as its own forward
        gives them when it drafts: soft-capped where its model caps them (Gemma-2/3's
        ``final_logit_softcapping``), so the distribution training distils and scores is the
        one decoding samples from."""
        lm = self._lm()
        z = lm.get_output_embeddings()(h).float()
        cap = getattr(lm.config, "final_logit_softcapping", None)
        return torch.tanh(z / cap) * cap if cap else z

    def teacher_logits(self, f: torch.Tensor) -> torch.Tensor:
        return self.target.logits(f)

    # -- training ----------------------------------------------------------------------------

    def on_policy_now(self) -> bool:
        """Whether this micro-batch is on-policy: a fraction ``on_policy`` of micro-batches,
        spread evenly (micro-batch i is on-policy when floor((i+1) l) > floor(i l))."""
        lam, i = self.cfg.on_policy, int(self.micro_batches)
        return math.floor((i + 1) * lam + 1e-9) > math.floor(i * lam + 1e-9)

    def forward(self, batch: dict[str, torch.Tensor]) -> StepOutput:
        policy = self.training and self.cfg.on_policy > 0 and self.on_policy_now()
        if self.training:
            self.micro_batches += 1
        if policy:
            batch = self.student_replies(batch)
        ids, attn, lm = batch["input_ids"], batch["attention_mask"], batch["loss_mask"]
        rows = next_token_rows(lm, attn)
        n = rows[0].numel()
        h = self.student_hidden(ids, attn)
        if n == 0:
            return StepOutput(loss=h.sum() * 0.0, metrics={})
        f = batch["features"][:, :, 0][rows]  # target's state at t: predicts x_{t+1}
        hs = h[rows]
        c, T = self.cfg.chunk, self.cfg.temperature
        total = h.new_zeros((), dtype=torch.float32)
        accept = torch.zeros((), device=h.device)
        for i in range(0, n, c):

            def chunk_loss(hs_i, f_i):
                s = self.student_logits(hs_i)
                with torch.no_grad():
                    t = self.teacher_logits(f_i)
                s, t = common_vocabulary(s, t)
                d = divergence(s, t, self.cfg.divergence, self.cfg.jsd_beta, T).sum()
                return d, acceptance_rate(s.detach(), t).sum()

            if self.training and torch.is_grad_enabled():
                # recompute each chunk's (chunk, V) logits in the backward: memory stays bounded
                d, a = checkpoint(chunk_loss, hs[i : i + c], f[i : i + c], use_reentrant=False)
            else:
                d, a = chunk_loss(hs[i : i + c], f[i : i + c])
            total = total + d
            accept += a.detach()
        loss = total / n
        metrics = {
            f"loss_{self.cfg.divergence}": metric(loss.detach() * n, n),
            "accept_T1": metric(accept, n),
            "on_policy": metric(float(policy), 1),
        }
        metrics["acc"] = metrics["accept_T1"]
        return StepOutput(loss=loss, metrics=metrics)

    @torch.no_grad()
    def evaluate(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """On held-out data (teacher-forced): the loss, the token-level acceptance estimate
        sum_x min(p, q) at temperature 1 (``accept_T1``, = 1 - TVD: what TVD optimises) and
        the greedy agreement (``accept_T0``: argmax q = argmax p, acceptance at T = 0)."""
        ids, attn, lm = batch["input_ids"], batch["attention_mask"], batch["loss_mask"]
        rows = next_token_rows(lm, attn)
        n = rows[0].numel()
        h = self.student_hidden(ids, attn)[rows]
        f = batch["features"][:, :, 0][rows]
        out = {k: torch.zeros((), device=h.device) for k in ("loss", "a1", "a0")}
        c = self.cfg.chunk
        for i in range(0, n, c):
            s, t = self.student_logits(h[i : i + c]), self.teacher_logits(f[i : i + c])
            s, t = common_vocabulary(s, t)
            out["loss"] += divergence(
                s, t, self.cfg.divergence, self.cfg.jsd_beta, self.cfg.temperature
            ).sum()
            out["a1"] += acceptance_rate(s, t).sum()
            out["a0"] += (s.argmax(-1) == t.argmax(-1)).float().sum()
        return {
            f"loss_{self.cfg.divergence}": metric(out["loss"], n),
            "accept_T1": metric(out["a1"], n),
            "accept_T0": metric(out["a0"], n),
        }

    @torch.no_grad()
    def student_replies(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """On-policy data: keep each sample's prompt (everything before its first assistant
        token), let the student write the reply with the generation settings, and return a new
        batch (reply tokens as the loss mask, end-of-turn included) with the target's features
        on it."""
        tok = self.target.tokenizer
        pad = self.target.pad_token_id
        eos = tok.eos_token_id
        ids, attn, lm = batch["input_ids"], batch["attention_mask"], batch["loss_mask"]
        dev = ids.device
        prompts = []
        for b in range(ids.shape[0]):
            first = int(lm[b].nonzero()[0]) if lm[b].any() else int(attn[b].sum())
            prompts.append(ids[b, :first].tolist())
        n = max(len(p) for p in prompts)
        left = torch.full((len(prompts), n), pad, dtype=torch.long, device=dev)
        left_attn = torch.zeros_like(left)
        for b, p in enumerate(prompts):
            left[b, n - len(p) :] = torch.tensor(p, device=dev)
            left_attn[b, n - len(p) :] = 1
        greedy = self.cfg.gen_temperature <= 0
        kw = {"do_sample": not greedy}
        if not greedy:
            kw.update(
                temperature=self.cfg.gen_temperature,
                top_p=self.cfg.gen_top_p,
                top_k=self.cfg.gen_top_k or None,
            )
        # a student whose embedding is padded past the target's ids writes none of them: the
        # target could not read its reply (and the proposer drafts none)
        v_s, v_t = self._lm().get_output_embeddings().weight.shape[0], self.target.config.vocab_size
        if v_s > v_t:
            kw["suppress_tokens"] = list(range(v_t, v_s))
        was = self.student.training
        self.student.eval()
        gen = self._lm().generate(
            input_ids=left,
            attention_mask=left_attn,
            max_new_tokens=self.cfg.gen_max_new_tokens,
            eos_token_id=eos,
            pad_token_id=pad,
            **kw,
        )[:, n:]
        self.student.train(was)
        seqs, masks = [], []
        for b, p in enumerate(prompts):
            reply = gen[b].tolist()
            if eos in reply:
                reply = reply[: reply.index(eos) + 1]
            seqs.append(p + reply)
            masks.append([0] * len(p) + [1] * len(reply))
        T = max(len(s) for s in seqs)
        out_ids = torch.full((len(seqs), T), pad, dtype=torch.long, device=dev)
        out_attn = torch.zeros_like(out_ids)
        out_lm = torch.zeros_like(out_ids)
        for b, (s, m) in enumerate(zip(seqs, masks, strict=True)):
            out_ids[b, : len(s)] = torch.tensor(s, device=dev)
            out_attn[b, : len(s)] = 1
            out_lm[b, : len(s)] = torch.tensor(m, device=dev)
        feats = self.target.features(out_ids, out_attn, (-1,))
        return {
            "input_ids": out_ids,
            "attention_mask": out_attn,
            "loss_mask": out_lm,
            "features": feats,
        }

    # -- decoding ----------------------------------------------------------------------------

    def proposer(self, settings: DecodeSettings | None = None) -> DraftLMProposer:
        tree = (settings or DecodeSettings()).tree
        if tree not in ("auto", "chain"):
            raise ValueError(f"tree={tree!r}: a draft LM proposes chains")
        vocab = self.target.config.vocab_size
        return DraftLMProposer(self.merged().eval(), vocab_size=vocab, method=self)

    def merged(self) -> nn.Module:
        """The student as a plain causal LM (a LoRA adapter merged into a copy)."""
        if hasattr(self.student, "peft_config"):
            import copy

            return copy.deepcopy(self.student).merge_and_unload()
        return self.student

    # -- save / load -------------------------------------------------------------------------

    def save_draft(self, path: str | Path) -> None:
        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        student = self.merged()
        student.save_pretrained(str(path / STUDENT_DIR))
        if self.target.tokenizer is not None:
            self.target.tokenizer.save_pretrained(str(path / STUDENT_DIR))
        write_draft_config(
            path,
            self.cfg,
            self.target,
            1,
            student={
                "layers": student.config.num_hidden_layers,
                "parameters": sum(p.numel() for p in student.parameters()),
            },
        )

    @classmethod
    def load_draft(cls, path: str | Path, target: Target) -> DistillSpecStudent:
        from transformers import AutoModelForCausalLM

        path = Path(path)
        cfg = read_draft_config(path)
        folder = path / STUDENT_DIR
        if not (folder / "config.json").exists():
            raise DraftError(f"{path}: no distilled student in {STUDENT_DIR}/")
        try:
            student = AutoModelForCausalLM.from_pretrained(str(folder), dtype=target.dtype)
        except (OSError, ValueError) as e:
            raise DraftError(f"{folder}: cannot load ({str(e).splitlines()[0]})") from None
        mcfg = {**cfg["method"], "lora": False}  # saved merged
        head = cls(target, cls.config_class(**mcfg), student=student.to(target.device))
        return head.eval()


def make_student(target: Target, cfg: DistillSpecConfig) -> nn.Module:
    """A fresh student: the target's chosen layers, or an HF model with the same tokenizer. Its
    weights are float32 whatever the target's dtype: they are the master weights that training
    updates (bf16 autocast computes with them)."""
    if cfg.student == "truncate":
        layers = cfg.student_layers if cfg.student_layers else cfg.num_layers
        try:
            return target.truncated(layers).float()
        except TargetError as e:
            if cfg.student_layers:
                key = f"method.student_layers={list(cfg.student_layers)}"
                raise DraftError(f"{key} (method.student=truncate): {e}") from None
            n = target.num_layers
            if n < 2:
                raise DraftError(
                    f"method.student=truncate: the target has {n} decoder layer, none to drop; "
                    "give method.student=<a smaller model of its tokenizer>"
                ) from None
            raise DraftError(
                f"method.num_layers={cfg.num_layers} (method.student=truncate): the target has "
                f"{n} decoder layers; a truncated student keeps 1..{n - 1} of them (e.g. "
                f"method.num_layers={max(1, min(cfg.num_layers, n - 1))})"
            ) from None
    return load_same_vocabulary_lm(cfg.student, target, f"method.student={cfg.student}").float()


# ---------------------------------------------------------------------------------------------
# Pure loss functions


def next_token_rows(loss_mask: torch.Tensor, attention_mask: torch.Tensor):
    """(batch, position) indices t where x_t and its next token x_{t+1} are both real
    assistant tokens: where the distributions are compared. Serving drafts from a reply's
    first token on (that token is the prefill's), so the student's proposal for the first
    one is neither trained nor scored. loss_mask, attention_mask: (B, T)."""
    ok = loss_mask.bool() & attention_mask.bool()
    m = ok[:, 1:] & ok[:, :-1]
    return m.nonzero(as_tuple=True)


def divergence(
    student_logits: torch.Tensor,
    teacher_logits: torch.Tensor,
    kind: str,
    beta: float = 0.5,
    temperature: float = 1.0,
) -> torch.Tensor:
    """Per-row divergence between p = softmax(teacher / T) and q = softmax(student / T).

    student_logits, teacher_logits: (N, V). Returns (N,) float32, >= 0, 0 where p = q.
    ``fkl``: KL(p || q) (mode-covering); ``rkl``: KL(q || p) (mode-seeking); ``jsd``:
    beta KL(p || m) + (1 - beta) KL(q || m) with m = beta p + (1 - beta) q (beta = 0 is
    fkl and beta = 1 is rkl, as in TRL's generalised JSD); ``tvd``: 0.5 sum |p - q|, whose
    complement sum min(p, q) is the acceptance probability of speculative sampling."""
    lq = (student_logits.float() / temperature).log_softmax(-1)
    lp = (teacher_logits.float() / temperature).log_softmax(-1)
    if kind == "fkl" or (kind == "jsd" and beta == 0.0):
        return _kl(lp, lq)
    if kind == "rkl" or (kind == "jsd" and beta == 1.0):
        return _kl(lq, lp)
    if kind == "jsd":
        lm = torch.logsumexp(torch.stack([lp + math.log(beta), lq + math.log(1.0 - beta)]), dim=0)
        return beta * _kl(lp, lm) + (1.0 - beta) * _kl(lq, lm)
    if kind == "tvd":
        return 0.5 * (lp.exp() - lq.exp()).abs().sum(-1)
    raise ValueError(f"divergence {kind!r}: use one of {DIVERGENCES}")


def _kl(la: torch.Tensor, lb: torch.Tensor) -> torch.Tensor:
    """KL(a || b) per row from log-probabilities; 0 * log 0 taken as 0."""
    a = la.exp()
    return torch.where(a > 0, a * (la - lb), torch.zeros_like(a)).sum(-1).clamp_min(0.0)


def common_vocabulary(
    student_logits: torch.Tensor, teacher_logits: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Both (N, V_s), (N, V_t) over the ids they share, (N, min(V_s, V_t)) each. The same
    tokenizer's embedding matrices are often padded to different sizes (Qwen2.5-0.5B's 151,936
    rows, 7B's 152,064); the ids past the tokenizer's are never produced, and the student drafts
    over the shared ones only (``DraftLMProposer`` cuts its logits to the target's size, or
    gives the target's extra ids no mass), so that is the distribution it is trained on."""
    v = min(student_logits.shape[-1], teacher_logits.shape[-1])
    return student_logits[..., :v], teacher_logits[..., :v]


def acceptance_rate(student_logits: torch.Tensor, teacher_logits: torch.Tensor) -> torch.Tensor:
    """sum_x min(p(x), q(x)) per row at temperature 1: the probability that speculative
    sampling accepts a token drawn from q. (N, V) -> (N,)."""
    p = teacher_logits.float().softmax(-1)
    q = student_logits.float().softmax(-1)
    return torch.minimum(p, q).sum(-1)
