"""The frozen target sharded over processes (target.shard=fsdp, trainer/shard.py), run as a
person runs it: ``accelerate launch`` with 2 CPU processes over gloo, a 4-layer tiny target."""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch
from conftest import (
    ROOT,
    accelerate_cmd,
    accelerate_launch,
    compose,
    free_port,
    read_metrics,
    tiny_overrides,
)

from trainer.checkpoint import latest_checkpoint
from trainer.shard import ShardError, check_shard
from trainer.train import run

STEPS = 20
COMMON = {
    "method": "eagle3",
    "target.tiny_layers": 4,
    "train.max_steps": STEPS,
    "train.eval_every": 10,
    "train.log_every": 1,
    "train.threads": 1,
    "data.batch_size": 2,
    "optim.lr": 1e-3,
}


def _curve(run_dir):
    return {r["step"]: r["loss"] for r in read_metrics(run_dir) if "loss" in r}


def _rel_diff(a: dict, b: dict) -> float:
    """Largest relative difference of two loss curves (the losses here are ~22: EAGLE-3 sums
    7 unrolled steps; the order of floating-point reductions, DDP's all-reduce against
    accumulation, moves them by ~1e-6 relative, which Adam carries on)."""
    return max(abs(a[s] - b[s]) / abs(a[s]) for s in a)


CACHED = {"data.cache_features": "true", "data.feature_dtype": "float32"}


@pytest.fixture(scope="module")
def reference(data_file, tmp_path_factory):
    """One process, the whole target, the same global batch (2 x 2 accumulated); its fp32
    feature cache (the same values as online features) in its own cache folder."""
    base = tmp_path_factory.mktemp("shard")
    out = base / "one"
    run(compose(tiny_overrides(data_file, out, **{**COMMON, **CACHED, "train.grad_accum": 2})))
    return out


def test_sharded_target_trains_like_one_process_from_its_own_feature_cache(
    data_file, reference, tmp_path
):
    from trainer.features import FeatureStore

    two = tmp_path / "two"
    cache = tmp_path / "cache"
    r = accelerate_launch(
        2, tiny_overrides(data_file, two, **{**COMMON, **CACHED, "target.shard": "fsdp"})
    )
    assert r.returncode == 0, r.stderr[-3000:]
    # each process held half of the target's weights (the embedding and head as rows too)
    sh = json.loads((two / "summary.json").read_text())["target_shard"]
    print("target bytes per process:", sh["bytes_per_rank"], "of", sh["full_bytes"])
    assert sh["world_size"] == 2
    for b in sh["bytes_per_rank"]:
        assert abs(b / sh["full_bytes"] - 0.5) <= 0.05, sh

    # the cache both processes wrote equals the whole target's, sample by sample
    ref_stores = {p.name: p for p in (reference.parent / "cache" / "features").iterdir()}
    stores = {p.name: p for p in (cache / "features").iterdir()}
    assert len(stores) == 2 and set(stores) == set(ref_stores)  # train, val; same keys
    worst, n = 0.0, 0
    for key, d in stores.items():
        meta = json.loads((d / "done.json").read_text())
        assert {s.split("_")[1] for s in meta["index"].values()} == {"r0", "r1"}
        mine, ref = FeatureStore(d), FeatureStore(ref_stores[key])
        assert set(mine.index) == set(ref.index)
        for i in ref.index:
            worst = max(worst, (mine.get(i) - ref.get(i)).abs().max().item())
            n += 1
    print(f"features of {n} samples, sharded vs whole target: max abs diff {worst:.2e}")
    assert worst <= 1e-6

    # and the loss curve is the single process's
    a, b = _curve(reference), _curve(two)
    assert sorted(a) == sorted(b) == list(range(1, STEPS + 1))
    diff = _rel_diff(a, b)
    print(f"loss curves, sharded 2 processes vs 1: max relative diff {diff:.2e}")
    assert diff <= 1e-4

    # a cache written by 2 processes is read by 1 (nothing rebuilt), with the same curve
    before = {p: p.stat().st_mtime_ns for p in cache.rglob("*.safetensors")}
    one = tmp_path / "one-from-cache"
    run(compose(tiny_overrides(data_file, one, **{**COMMON, **CACHED, "train.grad_accum": 2})))
    assert {p: p.stat().st_mtime_ns for p in cache.rglob("*.safetensors")} == before
    c = _curve(one)
    assert _rel_diff(a, c) <= 1e-4


def test_sharded_target_killed_and_resumed_reproduces_the_curve(data_file, reference, tmp_path):
    out = tmp_path / "killed"
    args = tiny_overrides(
        data_file,
        out,
        **{**COMMON, "target.shard": "fsdp", "train.save_every": 5, "train.keep_checkpoints": 10},
    )
    cmd = accelerate_cmd(2, args)
    p = subprocess.Popen(
        cmd,
        cwd=ROOT,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    deadline = time.time() + 240
    while time.time() < deadline and not (out / "checkpoints" / "step_5").is_dir():
        time.sleep(0.02)
    assert p.poll() is None, "the run finished before it could be killed"
    os.killpg(p.pid, signal.SIGKILL)  # the launcher and both processes, no handler runs
    p.wait(timeout=30)
    ck = latest_checkpoint(out)
    assert ck is not None, "training never reached its first checkpoint"
    killed_at = int(ck.name.split("_")[1])
    assert 5 <= killed_at < STEPS

    r = accelerate_launch(2, [*args, "resume=true"])
    assert r.returncode == 0 and "resumed from" in r.stdout, r.stderr[-3000:]
    a, b = _curve(reference), _curve(out)
    assert sorted(b) == list(range(1, STEPS + 1))
    diff = _rel_diff(a, b)
    print(f"killed at step {killed_at}, resumed: loss curve vs 1 process, max rel diff {diff:.2e}")
    assert diff <= 1e-4


def test_sharding_settings_that_cannot_work_are_one_line_errors(data_file, tmp_path):
    with pytest.raises(ShardError, match="needs >= 2 processes"):
        check_shard("fsdp", 1, None)
    with pytest.raises(ShardError, match="target.shard=zero9: use one of none, fsdp, zero3"):
        check_shard("zero9", 2, None)
    with pytest.raises(ShardError, match="trains the target's own weights"):
        check_shard("fsdp", 2, "LoRA adapters on the target")
    check_shard("none", 1, None)
    check_shard("fsdp", 3, None)  # any world size: FSDP2 pads rows that do not divide
    # from the command line, before anything loads
    from conftest import run_module

    r = run_module("flow", tiny_overrides(data_file, tmp_path / "o", **{"target.shard": "fsdp"}))
    assert r.returncode == 2
    lines = [x for x in r.stderr.splitlines() if x.strip()]
    assert lines[-1].startswith("error: target.shard=fsdp needs >= 2 processes"), r.stderr[-1500:]


def test_two_machines_on_localhost_train_and_save_once(data_file, tmp_path):
    """scripts/accelerate/cpu_2machines.yaml started twice, machine_rank 0 and 1, as on two
    nodes: one process each, the target sharded across them; the run finishes and saves once."""
    out = tmp_path / "mm"
    args = tiny_overrides(
        data_file, out, **{**COMMON, "train.max_steps": 4, "target.shard": "fsdp"}
    )
    port = str(free_port())
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "accelerate.commands.launch",
                "--config_file",
                str(ROOT / "scripts" / "accelerate" / "cpu_2machines.yaml"),
                "--machine_rank",
                str(rank),
                "--main_process_port",
                port,
                "-m",
                "flow",
                *args,
            ],
            cwd=ROOT,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for rank in (0, 1)
    ]
    logs = [p.communicate(timeout=300)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], logs[0][-2000:] + logs[1][-2000:]
    assert "processes: 2" in logs[0] and "target sharded over 2 processes" in logs[0]
    assert [p.name for p in (out / "checkpoints").iterdir()] == ["step_4"]
    assert (out / "final" / "model.safetensors").exists()
    assert json.loads((out / "summary.json").read_text())["step"] == 4


# -- the memory plan (scripts/memory_plan.py): built on the meta device, no weights -----------


def _plan(*args):
    sys.path.insert(0, str(ROOT / "scripts"))
    import memory_plan

    return memory_plan, memory_plan.plan(list(args))


def test_memory_plan_for_70b_on_eight_80gb_devices_fits_only_sharded():
    cfg = f"target.path={ROOT / 'scripts' / 'model_configs' / 'llama-3.3-70b-instruct'}"
    common = [cfg, "method=eagle3", "world_size=8", "data.batch_size=1", "data.max_length=2048"]
    mp, whole = _plan(*common)
    _, sharded = _plan(*common, "target.shard=fsdp")
    assert abs(whole.params_target / 1e9 - 70.55) < 0.01  # Llama-3.3-70B's 70.55B
    assert not whole.fits and sharded.fits
    # 1/8 of the target between steps, plus one layer and the embedding/head during a step
    assert sharded.target_weights_at_rest == pytest.approx(whole.target_weights / 8)
    assert sharded.target_weights > sharded.target_weights_at_rest
    text = mp.report(whole)
    assert "DOES NOT FIT" in text and "advice" in text
    assert "verdict: fits" in mp.report(sharded)


def test_memory_plan_counts_llama_8b_and_names_a_missing_config(tmp_path):
    cfg = f"target.path={ROOT / 'scripts' / 'model_configs' / 'llama-3.1-8b-instruct'}"
    _, p = _plan(cfg, "method=eagle3", "world_size=1")
    assert abs(p.params_target / 1e9 - 8.03) < 0.01  # Llama-3.1-8B's 8.03B
    assert p.fits
    mp, _ = _plan(cfg, "method=eagle3")
    with pytest.raises(mp.PlanError, match="no config.json there"):
        mp.plan([f"target.path={tmp_path / 'nothing'}", "method=eagle3"])
    with pytest.raises(mp.PlanError, match="needs world_size >= 2"):
        mp.plan([cfg, "method=eagle3", "target.shard=fsdp"])


@pytest.mark.skipif(
    importlib.util.find_spec("deepspeed") is None,
    reason="target.shard=zero3 needs DeepSpeed: bash scripts/install.sh dev installs it",
)
def test_zero3_target_trains_like_one_process(data_file, reference, tmp_path):
    """target.shard=zero3: DeepSpeed ZeRO-3 over the decoder layers (where deepspeed runs)."""
    out = tmp_path / "z3"
    r = accelerate_launch(2, tiny_overrides(data_file, out, **{**COMMON, "target.shard": "zero3"}))
    assert r.returncode == 0, r.stderr[-3000:]
    sh = json.loads((out / "summary.json").read_text())["target_shard"]
    layers_half = (sh["full_bytes"] - sh["shared_bytes"]) / 2 + sh["shared_bytes"]
    for b in sh["bytes_per_rank"]:  # half the layers, the embedding and head whole
        assert abs(b - layers_half) / sh["full_bytes"] <= 0.02, sh
    diff = _rel_diff(_curve(reference), _curve(out))
    print(f"loss curves, ZeRO-3 target on 2 processes vs 1: max relative diff {diff:.2e}")
    assert diff <= 1e-4


def test_a_feature_cache_build_interrupted_per_rank_resumes_with_another_world_size(
    data_file, tmp_path
):
    """Rank 0 of 2 finishes its share and rank 1 never runs (a lost machine): no index is
    written. A later single process computes only the samples nobody wrote, keeps rank 0's
    shards, and indexes both."""
    from data.dataset import prepare_tokenized
    from models.target import TargetConfig, load_target
    from trainer.features import build_feature_store

    target = load_target(TargetConfig(name="tiny_random", device="cpu", tiny_layers=4))
    data = prepare_tokenized(
        str(data_file),
        target.tokenizer,
        max_length=256,
        val_fraction=0.1,
        max_val_records=8,
        max_records=None,
        seed=0,
        cache_root=str(tmp_path / "c"),
        log=lambda *_: None,
    )
    kw = dict(batch_size=4, shard_tokens=500, dtype="float32", progress=False)
    args = (target, data.train, (1, 2, 3), str(tmp_path / "c"), "k")
    with pytest.raises(RuntimeError, match="missing"):
        build_feature_store(*args, rank=0, world_size=2, **kw)
    store = tmp_path / "c" / "features" / "k"
    r0 = {p.name: p.stat().st_mtime_ns for p in store.glob("shard_r0_*.safetensors")}
    assert r0 and not (store / "done.json").exists()
    done = build_feature_store(*args, rank=0, world_size=1, **kw)
    assert len(done.index) == len(data.train)
    kept = {p.name: p.stat().st_mtime_ns for p in store.glob("shard_r0_*.safetensors")}
    assert all(kept.get(n) == t for n, t in r0.items())  # rank 0's shards untouched
    new = sorted(set(kept) - set(r0))
    assert new  # the missing half, in new shards
    by_new = [i for i, s in done.index.items() if s in new]
    assert sorted(by_new) == [i for i in range(len(data.train)) if i % 2 == 1]
    want = target.features(*_one(data.train, 1), (1, 2, 3))[0]
    assert (done.get(1) - want).abs().max() <= 1e-6


def _one(ds, i):
    ids = torch.tensor(ds[i]["input_ids"])[None]
    return ids, torch.ones_like(ids)


@pytest.mark.parametrize("family", ["qwen3_moe", "deepseek_v3"])
def test_a_mixture_of_experts_target_sharded_trains_like_one_process(family, data_file, tmp_path):
    """Qwen3-MoE (routed experts in every layer) and DeepSeek-V3 (a dense first layer, then
    shared and routed experts, latent attention), each layer's stacked experts sharded by
    FSDP2 over 2 processes with online features: about half the weights a process, and the
    loss curve of one process with the whole target."""
    common = {
        **COMMON,
        "train.max_steps": 4,
        "train.eval_every": 4,
        "target.family": family,
        "method.draft_vocab_size": 64,
        "method.fuse_layers": "[1,2,3]",
        "data.max_length": 128,
    }
    one = tmp_path / "one"
    run(compose(tiny_overrides(data_file, one, **{**common, "train.grad_accum": 2})))
    two = tmp_path / "two"
    r = accelerate_launch(2, tiny_overrides(data_file, two, **{**common, "target.shard": "fsdp"}))
    assert r.returncode == 0, r.stderr[-3000:]
    sh = json.loads((two / "summary.json").read_text())["target_shard"]
    for b in sh["bytes_per_rank"]:
        assert abs(b / sh["full_bytes"] - 0.5) <= 0.05, sh
    a, b = _curve(one), _curve(two)
    assert sorted(a) == sorted(b) == [1, 2, 3, 4]
    assert _rel_diff(a, b) <= 1e-4, (a, b)
