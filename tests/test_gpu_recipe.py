"""The GPU scripts, run end to end on the CPU with the tiny target: the training recipe
(``scripts/gpu_train.sh``) makes a draft that loads and decodes and a summary, and the offline
bundle (``scripts/offline_bundle.py``) goes over in parts and comes back whole."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))


def _run(cmd, env=None, check=True):
    r = subprocess.run(
        cmd, cwd=ROOT, env={**os.environ, **(env or {})}, capture_output=True, text=True
    )
    if check and r.returncode != 0:
        raise AssertionError(f"{cmd} -> {r.returncode}\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}")
    return r


TINY = {
    "DEVICE": "cpu",
    "TARGET": "tiny_random",
    "TARGET_ARGS": "target.tiny_layers=4",
    "NO_INSTALL": "1",
    "COUNT": "12",
    "REGEN_MIN": "0.1",
    "REGEN_T": "1",  # the random target's greedy replies decode to nothing
    "REGEN_BATCH": "4",
    "TRAIN_MIN": "0.1",
    "PROMPTS": "2",
    "TOKENS": "8",
    "EXTRA_TRAIN": "data.batch_size=4 data.num_proc=1 data.max_length=128 "
    "method.draft_vocab_size=64 train.eval_every=0 train.log_every=1",
}


def test_the_gpu_training_recipe_runs_end_to_end_on_the_cpu(tmp_path):
    out = tmp_path / "gpu"
    # two user turns a conversation: the second follows the target's own first reply
    r = _run(
        ["bash", "scripts/gpu_train.sh", str(out)], {**TINY, "INIT": "null", "REGEN_TURNS": "2"}
    )
    for name in ("regen.jsonl", "eval_chain.json", "summary.json", "train.log", "slice.json"):
        assert (out / name).is_file(), name
    s = json.loads((out / "summary.json").read_text())
    assert s["method"] == "eagle3" and s["slice"]["count"] == 12 and s["slice"]["skip"] == 0
    assert s["regenerated"]["records"] >= 1
    assert s["regenerated"]["settings"]["max_turns"] == 2
    assert s["regenerated"]["replies"] > s["regenerated"]["records"]  # later turns answered
    assert s["train"]["tokens"] > 0 and s["train"]["tokens_per_s_median"] > 0
    assert s["train"]["model_flops_per_token"] == (
        2 * s["train"]["target_params"]
        + 6 * s["train"]["head_trainable_params"] * s["train"]["ttt_steps"]
    )
    assert s["mt_bench_chain3_t0"]["lossless"] is True
    from models.base import read_draft_config

    assert read_draft_config(out / "run" / "final")["specdraft"]["method"] == "eagle3"
    # the next slice, from these weights
    assert f"REGEN_TURNS=2 SKIP=12 COUNT=12 INIT={out}/run/final" in r.stdout
    curves = json.loads((out / "run" / "lineage.json").read_text())["curves"]
    assert [Path(p).name for p, _ in curves] == ["metrics.jsonl"] and curves[0][1] == 0
    # no validation logged, no weights it began from: no curve to offer
    assert "curve:" not in r.stdout
    # a later run starts from these replies (as carried to another machine): it writes only
    # what this one did not reach (here nothing) and trains on them all, from these weights
    first = (out / "regen.jsonl").read_text()
    again = tmp_path / "again"
    r = _run(
        ["bash", "scripts/gpu_train.sh", str(again)],
        {
            **TINY,
            "INIT": f"{out}/run/final",
            "REGEN_FROM": str(out),
            "REGEN_TURNS": "2",
            "ONLY": "regen train",
        },
    )
    assert f"regeneration starts from the {len(first.splitlines())} conversations" in r.stdout
    # ... copied, not written again (the output carried without its parts folder): the
    # target decoded nothing (its account line is printed where it did)
    log = (again / "train.log").read_text().split("== train", 1)[0]
    reached = json.loads((out / "regen.jsonl.meta.json").read_text())["index"]
    assert f"continuing from the {len(reached)} conversations of" in log, log
    assert "decoding:" not in log, log
    assert (again / "regen.jsonl").read_text() == first
    assert json.loads((again / "summary.json").read_text())["regenerated"]["records"] == len(
        first.splitlines()
    )
    from omegaconf import OmegaConf

    assert OmegaConf.load(again / "run" / "config.yaml").train.epochs == 3  # EPOCHS' default
    assert (again / "run" / "final" / "config.json").is_file()


def test_a_run_continues_the_learning_curve_of_the_weights_it_started_from(tmp_path):
    """The shipped head's phases (five on a CPU, one on a GPU), then the new run, each after
    the tokens of those before it; plot_curves draws the whole line from the lineage file."""
    from gpu_train_summary import write_lineage
    from plot_curves import lineage

    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text(
        "\n".join(
            json.dumps({"step": s, "tokens": 1000 * s, "val/alpha_pos1": 0.4 + s / 100})
            for s in (1, 2, 3)
        )
    )
    write_lineage(run, lineage(ROOT / "models" / "shipped" / "smollm2-eagle3"))
    curves = json.loads((run / "lineage.json").read_text())["curves"]
    assert [Path(p).name for p, _ in curves] == [
        *(f"curve_phase{i}.jsonl" for i in range(1, 7)),
        "metrics.jsonl",
    ]
    offsets = [o for _, o in curves]
    assert offsets[0] == 0 and all(a < b for a, b in zip(offsets, offsets[1:], strict=False))
    # the shipped head's training tokens: ~13.2M on a CPU, then ~13.5M on a GPU
    assert 26e6 < offsets[-1] < 27.5e6 and 13e6 < offsets[-2] < 14e6
    png = tmp_path / "curves.png"
    _run(
        [
            sys.executable,
            "scripts/plot_curves.py",
            "--lineage",
            str(run / "lineage.json"),
            "--metric",
            "alpha",
            "--out",
            str(png),
        ]
    )
    assert png.stat().st_size > 10_000


def test_the_recipe_refuses_weights_it_cannot_start_from(tmp_path):
    out = tmp_path / "gpu"
    r = _run(
        ["bash", "scripts/gpu_train.sh", str(out)], {**TINY, "INIT": str(tmp_path)}, check=False
    )
    assert r.returncode == 2
    assert f"INIT={tmp_path}: not a saved draft" in r.stderr
    assert not (out / "regen.jsonl").exists()  # refused before anything ran
    r = _run(
        ["bash", "scripts/gpu_train.sh", str(out)],
        {**TINY, "INIT": "null", "REGEN_FROM": str(tmp_path)},
        check=False,
    )
    assert r.returncode == 2 and f"REGEN_FROM={tmp_path}: no regen.jsonl" in r.stderr
    assert not (out / "regen.jsonl").exists()


def test_an_offline_bundle_travels_in_parts_and_comes_back_whole(tmp_path):
    bundle, into = tmp_path / "bundle", tmp_path / "there"
    draft = ROOT / "models" / "shipped" / "smollm2-eagle3"
    _run(
        [
            sys.executable,
            "scripts/offline_bundle.py",
            "pack",
            "--out",
            str(bundle),
            "--wheels",
            "none",
            "--target",
            "none",
            "--no-source",
            "--data-slice",
            "5:3",
            "--init",
            str(draft),
            "--part-size",
            "8M",
        ]
    )
    m = json.loads((bundle / "bundle.json").read_text())
    parts = [p["name"] for p in m["parts"]]
    assert len(parts) >= 3 and all(p["bytes"] <= 8 * 2**20 for p in m["parts"])
    assert set(m["contents"]) == {"data", "init"}

    # the first part and the manifest arrive alone: it waits, saying what is missing
    def unpack(*given, check=True):
        cmd = [sys.executable, "scripts/offline_bundle.py", "unpack", *map(str, given)]
        return _run([*cmd, "--into", str(into)], check=check)

    r = unpack(bundle / parts[0], bundle / "bundle.json", check=False)
    assert r.returncode == 3 and f"missing: {parts[1]}" in r.stdout
    # a part damaged on the way is named and dropped, not unpacked
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / parts[1]).write_bytes(b"\0" * m["parts"][1]["bytes"])
    r = unpack(bad, check=False)
    assert r.returncode == 3 and "sha256 did not match" in r.stdout
    r = unpack(*[bundle / p for p in parts[1:]])
    assert "export DATA=" in r.stdout and "COUNT=3" in r.stdout
    prompts = (into / "content" / "data" / "prompts.jsonl").read_text().splitlines()
    assert len(prompts) == 3
    init = into / "content" / "init"
    assert (init / "model.safetensors").read_bytes() == (draft / "model.safetensors").read_bytes()
    # a part of it given again (a call that repeats its carry): no "missing", nothing changes
    r = unpack(bundle / parts[0], bundle / "bundle.json")
    assert "already unpacked" in r.stdout and "export DATA=" in r.stdout
    assert not (into / "parts").exists()
    assert (into / "content" / "data" / "prompts.jsonl").read_text().splitlines() == prompts
    r = _run(
        [
            sys.executable,
            "scripts/offline_bundle.py",
            "pack",
            "--part-size",
            "lots",
            "--out",
            str(tmp_path / "b2"),
        ],
        check=False,
    )
    assert r.returncode == 2 and "--part-size 'lots'" in r.stderr
    assert not (tmp_path / "b2").exists()


def _bundle_module():
    import importlib.util

    spec = importlib.util.spec_from_file_location(
        "offline_bundle", ROOT / "scripts" / "offline_bundle.py"
    )
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_light_wheels_made_for_one_python_are_fetched_for_the_other_machines(
    tmp_path, monkeypatch, capsys
):
    """A light wheel tagged for this Python alone (multiprocess: py311) is fetched again for
    --python-version; py3 wheels stay; without --python-version pack names them."""
    ob = _bundle_module()
    assert {"datasets", "dill", "multiprocess"} <= set(ob.LIGHT)  # training needs datasets
    calls = []
    monkeypatch.setattr(ob, "_pip", lambda cmd, kind: calls.append(cmd))
    here = f"{sys.version_info.major}.{sys.version_info.minor}"
    pins = ["multiprocess==0.70.19", "dill==0.4.1"]
    for version in (None, here):
        dest = tmp_path / f"w{version}"
        dest.mkdir()
        (dest / "multiprocess-0.70.19-py311-none-any.whl").touch()
        (dest / "dill-0.4.1-py3-none-any.whl").touch()
        ob._for_python(dest, pins, None, version)
        assert len(list(dest.iterdir())) == 2 and not calls
        assert "multiprocess" in capsys.readouterr().out
    dest = tmp_path / "other"
    dest.mkdir()
    (dest / "multiprocess-0.70.19-py311-none-any.whl").touch()
    (dest / "dill-0.4.1-py3-none-any.whl").touch()
    ob._for_python(dest, pins, "manylinux2014_x86_64", "3.99")
    assert [w.name for w in dest.iterdir()] == ["dill-0.4.1-py3-none-any.whl"]
    (cmd,) = calls
    assert cmd[cmd.index("--python-version") + 1] == "3.99" and "multiprocess==0.70.19" in cmd
    assert cmd[cmd.index("--platform") + 1] == "manylinux2014_x86_64"
