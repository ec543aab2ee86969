"""optim= is a real group: AdamW or Muon (+ AdamW for what Muon should not touch), one
optimizer object to the loop, the scheduler and checkpoints."""

from __future__ import annotations

import copy
import json
import re
import shutil

import pytest
import torch
from conftest import compose, read_metrics, tiny_overrides
from torch import nn

from trainer.config import OptimConfig
from trainer.optim import Combined, OptimizerError, build_optimizer, goes_to_muon
from trainer.train import run


class Head(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed_tokens = nn.Embedding(64, 8)
        self.fc = nn.Linear(24, 8, bias=False)
        self.mlp = nn.Linear(8, 16)
        self.norm = nn.LayerNorm(8)
        self.out = nn.Linear(8, 64, bias=False)  # a vocabulary projection under another name

    def forward(self, x):
        h = self.embed_tokens(x)
        h = self.fc(torch.cat([h, h, h], -1))
        h = self.norm(h + self.mlp(h)[..., :8])
        return self.out(h)


def _loss(m):
    x = torch.arange(12).reshape(3, 4)
    return nn.functional.cross_entropy(m(x).flatten(0, 1), (x + 1).flatten() % 64)


def test_muon_takes_hidden_matrices_and_leaves_the_rest_to_adamw():
    m = Head()
    kinds = {n: goes_to_muon(n, p) for n, p in m.named_parameters()}
    assert [n for n, k in kinds.items() if k] == ["fc.weight", "mlp.weight"]
    opt = build_optimizer(OptimConfig(name="muon", lr=1e-3), m, list(m.parameters()))
    assert isinstance(opt, Combined)
    muon, adamw = opt.optimizers
    assert isinstance(muon, torch.optim.Muon) and isinstance(adamw, torch.optim.AdamW)
    in_muon = {id(p) for g in muon.param_groups for p in g["params"]}
    assert in_muon == {id(m.fc.weight), id(m.mlp.weight)}
    assert len(opt.param_groups) == len(muon.param_groups) + len(adamw.param_groups)


def test_adamw_is_one_fused_adamw():
    m = Head()
    opt = build_optimizer(OptimConfig(name="adamw"), m, list(m.parameters()))
    assert type(opt) is torch.optim.AdamW and opt.defaults["fused"]


def test_scheduler_reaches_both_optimizers_and_group_lr_multiples_carry_over():
    m = Head()
    groups = [
        {"params": [m.fc.weight, m.embed_tokens.weight], "lr": 2e-3},  # 2x the base lr
        {
            "params": [
                p for n, p in m.named_parameters() if n not in ("fc.weight", "embed_tokens.weight")
            ]
        },
    ]
    cfg = OptimConfig(name="muon", lr=1e-3, muon_lr=0.02)
    opt = build_optimizer(cfg, m, groups)
    muon = opt.optimizers[0]
    assert sorted(g["lr"] for g in muon.param_groups) == pytest.approx([0.02, 0.04])
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 0.5)
    assert sorted(g["lr"] for g in muon.param_groups) == pytest.approx([0.01, 0.02])
    assert sorted(g["lr"] for g in opt.optimizers[1].param_groups) == pytest.approx([5e-4, 1e-3])
    del sched


def test_muon_trains_and_its_state_round_trips():
    torch.manual_seed(0)
    a = Head()
    b = Head()
    b.load_state_dict(a.state_dict())
    cfg = OptimConfig(name="muon", lr=1e-2)
    oa = build_optimizer(cfg, a, list(a.parameters()))
    first = _loss(a).item()
    for _ in range(20):
        oa.zero_grad()
        _loss(a).backward()
        oa.step()
    w0 = b.fc.weight.detach().clone()  # b still holds the starting weights
    assert _loss(a).item() < 0.6 * first and not torch.equal(a.fc.weight, w0)  # Muon stepped
    # b takes a's weights and optimizer state; both continue identically
    b.load_state_dict(a.state_dict())
    ob = build_optimizer(cfg, b, list(b.parameters()))
    ob.load_state_dict(copy.deepcopy(oa.state_dict()))  # as a checkpoint file would
    for m, o in ((a, oa), (b, ob)):
        o.zero_grad()
        _loss(m).backward()
        o.step()
    for (n, pa), pb in zip(a.named_parameters(), b.parameters(), strict=True):
        assert torch.equal(pa, pb), n
    # after load_state_dict (which replaces each optimizer's group dicts) a scheduler still
    # sets the lr the optimizers use
    torch.optim.lr_scheduler.LambdaLR(ob, lambda step: 0.25)
    assert all(g["lr"] == pytest.approx(2.5e-3) for o in ob.optimizers for g in o.param_groups)
    with pytest.raises(OptimizerError, match="another optim.name"):
        build_optimizer(cfg, b, list(b.parameters())).load_state_dict(
            build_optimizer(OptimConfig(), b, list(b.parameters())).state_dict()
        )


@pytest.mark.parametrize(
    "cfg,needle",
    [
        (OptimConfig(name="sgd"), "optim.name='sgd'"),
        (OptimConfig(lr=0.0), "optim.lr=0.0"),
        # torch refused these at the first step, as a traceback
        (OptimConfig(weight_decay=-1.0), "optim.weight_decay=-1.0: must be >= 0"),
        (OptimConfig(betas=(0.9, 1.5)), "optim.betas=[0.9, 1.5]: two values in [0, 1)"),
        (OptimConfig(eps=-1e-8), "optim.eps=-1e-08"),
        # these trained silently with a rising lr or no orthogonalisation
        (OptimConfig(min_lr_ratio=2.0), "optim.min_lr_ratio=2.0: must be in [0, 1]"),
        (OptimConfig(name="muon", muon_ns_steps=0), "optim.muon_ns_steps=0"),
        (OptimConfig(name="muon", muon_adjust_lr_fn="rms"), "optim.muon_adjust_lr_fn=rms"),
    ],
)
def test_bad_optim_settings_are_named(cfg, needle):
    m = Head()
    with pytest.raises(OptimizerError, match=re.escape(needle)):
        build_optimizer(cfg, m, list(m.parameters()))


def test_a_bad_optim_setting_is_refused_before_the_target_loads(tmp_path):
    from trainer.train import ConfigError, check_config

    cfg = compose(tiny_overrides(tmp_path / "d.jsonl", tmp_path / "o", **{"optim.eps": -1}))
    with pytest.raises(ConfigError, match=r"^optim\.eps=-1\.0: must be >= 0$"):
        check_config(cfg)


def test_a_run_trains_and_resumes_with_muon(data_file, tmp_path):
    """optim=muon through the real loop (EAGLE-1 on the tiny target): the combined state is
    checkpointed whole, so a run resumed at step 3 gives the uninterrupted run's losses."""
    extra = {
        "optim": "muon",
        "optim.lr": 1e-3,
        "train.max_steps": 6,
        "train.save_every": 3,
        "train.eval_every": 0,
    }
    out = tmp_path / "run"
    assert run(compose(tiny_overrides(data_file, out, **extra)))["step"] == 6
    a = {r["step"]: r["loss"] for r in read_metrics(out) if "loss" in r}
    assert sorted(a) == list(range(1, 7))
    assert (
        json.loads((out / "final" / "config.json").read_text())["specdraft"]["method"] == "eagle1"
    )
    part = tmp_path / "part"
    shutil.copytree(out / "checkpoints" / "step_3", part / "checkpoints" / "step_3")
    run(compose(tiny_overrides(data_file, part, resume="true", **extra)))
    b = {r["step"]: r["loss"] for r in read_metrics(part) if "loss" in r}
    for step in (4, 5, 6):
        assert b[step] == pytest.approx(a[step], rel=1e-5, abs=1e-6), step
