"""The T > 0 sample check (decoding/sample_check.py): its two martingale z-scores are near 0
for tokens drawn from the target's own distributions, and far from 0, with the sign of the
fault, for a sampler that sharpens or flattens them; the verdict blames the speculative
sampler only where the plain samples are calm."""

from __future__ import annotations

import torch

from decoding.sample_check import SampleCheck, check_run, verdict
from models.sampling import Sampling, warp


def _draws(temperature_used: float, n: int = 3000, v: int = 50, seed: int = 0):
    """n positions of random target distributions at T = 1, and one token at each drawn at
    ``temperature_used`` (1: exactly the target's)."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(n, v, generator=g) * 2.0
    probs = logits.softmax(-1)
    drawn = torch.multinomial((logits / temperature_used).softmax(-1), 1, generator=g)[:, 0]
    return probs, drawn


def _check(probs, tokens) -> SampleCheck:
    c = SampleCheck()
    for i in range(0, len(tokens), 100):  # as outputs of 100 tokens each
        c.add_probs(probs[i : i + 100], tokens[i : i + 100])
    return c


def test_exact_samples_give_z_scores_near_zero():
    for seed in range(3):
        c = _check(*_draws(1.0, seed=seed))
        assert abs(c.z_hit) < 4 and abs(c.z_logp) < 4, (c.z_hit, c.z_logp)
        assert c.tokens == 3000 and c.outside == 0 and c.outputs == 30


def test_a_sharpening_sampler_pushes_both_up_and_a_flattening_one_both_down():
    sharp = _check(*_draws(0.8))
    flat = _check(*_draws(1.25))
    assert sharp.z_hit > 4 and sharp.z_logp > 4, (sharp.z_hit, sharp.z_logp)
    assert flat.z_hit < -4 and flat.z_logp < -4, (flat.z_hit, flat.z_logp)


def test_tokens_the_scorer_gives_no_probability_are_counted_apart():
    probs = torch.tensor([[0.5, 0.5, 0.0], [0.2, 0.3, 0.5]])
    c = SampleCheck()
    c.add_probs(probs, torch.tensor([2, 2]))
    assert c.outside == 1 and c.tokens == 1


def test_the_verdict_names_the_speculative_sampler_only_where_plain_is_calm():
    bad = {"z_argmax": 9.0, "z_logp": 6.5, "tokens": 2000}
    calm = {"z_argmax": 0.4, "z_logp": -1.1, "tokens": 2000}
    assert "speculative sampler" in verdict(bad, calm)
    assert "not speculation" in verdict(bad, bad)
    assert verdict(calm, calm) is None and verdict(calm, bad) is None
    alone = verdict(bad, {"z_argmax": float("nan"), "z_logp": float("nan"), "tokens": 0})
    assert alone.endswith("over 2000 tokens)")


def test_the_targets_own_samples_pass_the_check_scored_through_the_model(tiny_target):
    """End to end through ``check_run``: outputs sampled from the tiny target itself at T = 0.7
    with top-k 20 pass; the same outputs scored as if drawn at T = 1 do not (the check sees a
    sampler sharper than the one claimed)."""
    s = Sampling(temperature=0.7, top_k=20)
    g = torch.Generator().manual_seed(0)
    samples = []
    with torch.no_grad():
        for i in range(24):
            ids = [1, 30 + i, 40 + 2 * i]
            prompt, out = list(ids), []
            for _ in range(40):
                logits = tiny_target.model(input_ids=torch.tensor([ids])).logits[0, -1]
                x = int(torch.multinomial(warp(logits, s), 1, generator=g))
                out.append(x)
                ids.append(x)
            samples.append((prompt, out))
    ok = check_run(tiny_target, {"spec": samples, "ar": samples}, s)
    assert ok["flag"] is None, ok
    assert ok["spec"]["tokens"] == 24 * 40
    wrong = check_run(tiny_target, {"spec": samples, "ar": []}, Sampling(temperature=1.0))
    assert wrong["spec"]["z_argmax"] > 4 or wrong["spec"]["z_logp"] > 4, wrong
