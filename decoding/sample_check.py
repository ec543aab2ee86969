"""Are an engine's samples the target's at T > 0? Two martingale z-scores from its outputs.

At T = 0 an engine's speculative outputs are checked token for token against its plain ones.
At T > 0 outputs are samples and cannot be compared, yet a sampler that verifies drafts wrongly
still leaves a trace: its tokens are not distributed as the target's warped distribution p_t
(temperature, top-k, top-p) at each position. Scored by the target (one teacher-forced forward
per output), each sampled token x_t gives two terms whose expectation given the past is zero
under exact sampling, whatever the prompt, the length or where the output stopped:

    hit_t  = 1[x_t = argmax p_t] - max p_t              variance max p_t (1 - max p_t)
    logp_t = log p_t(x_t) + H(p_t)                      variance Var_{x ~ p_t}(log p_t(x))

Summed over every token of every output and divided by the square root of the summed
variances, each is approximately standard normal (the martingale central limit theorem). A
sampler that sharpens the distribution (verifies too leniently, or draws its corrections too
greedily) pushes both up; one that flattens it pushes both down. ``|z| > 4`` is flagged.

Run on the engine's plain samples as well, the same statistics are the control: the scorer
(the built-in target, perhaps in another dtype than the engine's) reads both alike, so a
mismatch of numerics moves both, and a faulty speculative sampler moves only its own.

Tokens the scorer gives probability 0 (outside its top-k / top-p set: the engine's numerics
drew a token at the edge of the set) are counted apart and left out of the sums.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from models.sampling import Sampling, warp

#: |z| above this is flagged: a sampler that is not the target's
Z_FLAG = 4.0


@dataclass
class SampleCheck:
    """Running sums of the two martingales over the outputs added."""

    tokens: int = 0
    outside: int = 0  # tokens the scorer gives probability 0
    hit: float = 0.0
    hit_var: float = 0.0
    logp: float = 0.0
    logp_var: float = 0.0
    hits: int = 0
    expected_hits: float = 0.0
    outputs: int = 0

    def add_probs(self, probs: torch.Tensor, tokens: torch.Tensor) -> None:
        """``probs`` (n, V) the target's warped distributions before each of ``tokens`` (n,)."""
        probs = probs.double()
        top, arg = probs.max(-1)
        px = probs.gather(-1, tokens[:, None]).squeeze(-1)
        ok = px > 0
        self.outside += int((~ok).sum())
        probs, top, arg, px, tokens = probs[ok], top[ok], arg[ok], px[ok], tokens[ok]
        logs = torch.where(probs > 0, probs.log(), torch.zeros_like(probs))
        neg_h = (probs * logs).sum(-1)  # E[log p(x)]
        second = (probs * logs * logs).sum(-1)
        hit = (tokens == arg).double()
        self.tokens += int(ok.sum())
        self.hits += int(hit.sum())
        self.expected_hits += float(top.sum())
        self.hit += float((hit - top).sum())
        self.hit_var += float((top * (1 - top)).sum())
        self.logp += float((px.log() - neg_h).sum())
        self.logp_var += float((second - neg_h * neg_h).clamp_min(0).sum())
        self.outputs += 1

    @property
    def z_hit(self) -> float:
        return self.hit / math.sqrt(self.hit_var) if self.hit_var > 0 else float("nan")

    @property
    def z_logp(self) -> float:
        return self.logp / math.sqrt(self.logp_var) if self.logp_var > 0 else float("nan")

    def row(self) -> dict[str, Any]:
        return {
            "outputs": self.outputs,
            "tokens": self.tokens,
            "tokens_outside_support": self.outside,
            "argmax_hits": self.hits,
            "argmax_hits_expected": self.expected_hits,
            "z_argmax": self.z_hit,
            "z_logp": self.z_logp,
        }


@torch.no_grad()
def score(target, samples: list[tuple[list[int], list[int]]], sampling: Sampling) -> SampleCheck:
    """The two statistics of ``samples`` ((prompt ids, sampled ids) each) under ``target``'s
    distributions warped by ``sampling`` (T > 0)."""
    if sampling.greedy:
        raise ValueError("the sample check is for T > 0; at T = 0 compare outputs directly")
    check = SampleCheck()
    for prompt, out in samples:
        if not out:
            continue
        ids = torch.tensor([list(prompt) + list(out)], device=target.device)
        logits = target.model(input_ids=ids, use_cache=False).logits[0, -len(out) - 1 : -1]
        check.add_probs(warp(logits, sampling), torch.tensor(out, device=target.device))
    return check


def verdict(spec: dict[str, Any], plain: dict[str, Any] | None = None) -> str | None:
    """A line where the speculative samples are not the target's (|z| > 4 on either statistic)
    and the plain ones, where given, are: else None."""
    bad = [
        (k, spec[k])
        for k in ("z_argmax", "z_logp")
        if spec.get(k) is not None and not math.isnan(spec[k]) and abs(spec[k]) > Z_FLAG
    ]
    if not bad:
        return None
    if plain is not None and not plain.get("tokens"):
        plain = None  # no plain samples: no control
    calm = plain is not None and all(
        plain.get(k) is not None and abs(plain[k]) <= Z_FLAG for k, _ in bad
    )
    where = (
        "while the plain samples are not (the speculative sampler)"
        if calm
        else "and so are the plain samples (the sampling or the numerics, not speculation)"
        if plain is not None
        else ""
    )
    zs = ", ".join(f"{k} {z:+.1f}" for k, z in bad)
    return (
        f"the speculative samples are not distributed as the target's ({zs}; |z| > {Z_FLAG:g} "
        f"over {spec['tokens']} tokens) {where}".rstrip()
    )


def check_run(target, samples: dict[str, list], sampling: Sampling, log=None) -> dict[str, Any]:
    """An engine run's T > 0 samples scored: ``{"spec": row, "plain": row, "flag": line|None}``
    (``samples``: ``{"spec": [...], "ar": [...]}`` as ``run_bench`` collects them)."""
    if log:
        n = len(samples.get("spec", [])) + len(samples.get("ar", []))
        log(f"scoring the engine's {n} T > 0 outputs with the target (decoding/sample_check.py)")
    spec = score(target, samples.get("spec", []), sampling).row()
    plain = score(target, samples.get("ar", []), sampling).row()
    return checked(spec, plain)


def checked(spec: dict[str, Any], plain: dict[str, Any]) -> dict[str, Any]:
    """The report entry of two scored rows (``SampleCheck.row()``): both, and the verdict."""
    return {"spec": spec, "plain": plain, "flag": verdict(spec, plain), "z_flag": Z_FLAG}
