"""The floor above trainer/ and decoding/ (flow/): the app trains, measures the new draft,
and says how to serve it; the trainer never imports the decoder."""

from __future__ import annotations

import json
import subprocess
import sys

from conftest import ROOT, run_module, tiny_overrides


def test_trainer_and_decoder_are_strangers():
    """Importing the whole trainer loads nothing of decoding/, and the reverse."""
    code = (
        "import sys, importlib; importlib.import_module(sys.argv[1]); "
        "bad = sorted(m for m in sys.modules if m.split('.')[0] == sys.argv[2]); "
        "print(bad); sys.exit(1 if bad else 0)"
    )
    for mod, other in (
        ("trainer.train", "decoding"),
        ("trainer.config", "decoding"),
        ("decoding.eval", "trainer"),
        ("decoding.engines.llama_cpp_eval", "trainer"),
    ):
        r = subprocess.run(
            [sys.executable, "-c", code, mod, other], cwd=ROOT, capture_output=True, text=True
        )
        assert r.returncode == 0, f"{mod} imports {other}: {r.stdout}{r.stderr[-500:]}"


def test_app_trains_measures_and_says_how_to_serve(data_file, tmp_path):
    out = tmp_path / "run"
    r = run_module(
        "flow",
        tiny_overrides(
            data_file,
            out,
            **{
                "method": "eagle3",
                "target.tiny_layers": 4,  # three distinct fused layers, as engines need
                "train.max_steps": 3,
                "train.eval_after.enabled": "true",
                "train.eval_after.num_prompts": 1,
                "train.eval_after.max_new_tokens": 6,
                "train.eval_after.compare": "[]",
            },
        ),
        timeout=300,
    )
    assert r.returncode == 0, r.stderr[-2000:]
    summary = json.loads((out / "summary.json").read_text())
    (row,) = summary["eval_after"]
    assert row["draft"] == "this run" and row["lossless"] is True
    assert json.loads((out / "eval-0.json").read_text())["new_tokens"] > 0
    assert f"specdraft-export {out} --format gguf" in r.stdout
    assert "this run" in r.stdout and "speedup" in r.stdout


def test_the_table_says_how_often_each_draft_was_drafted_for():
    """The end-of-run table's ``drafted`` column is the share of target forwards that verified
    a draft; a draft the adaptive controller rarely drafted for is named under the table (its
    tau near 1 is the controller's choice on this machine, not the head's acceptance), and a
    fixed gamma or a draft drafted for most forwards is not."""
    import math
    from collections import Counter
    from types import SimpleNamespace

    from decoding.report import stats_row
    from decoding.stats import Stats
    from flow.measure import table

    spec = Stats(gamma_used=Counter({0: 231, 1: 9, 4: 5}))
    assert stats_row(spec, Stats(), 0.1)["drafted_share"] == 14 / 245
    assert math.isnan(stats_row(Stats(), Stats(), 0.1)["drafted_share"])
    ea = SimpleNamespace(num_prompts=4, bench="mt_bench", max_new_tokens=64, temperature=0)

    def row(name, drafted, adaptive=True):
        return dict(draft=name, tau=1.03, alpha=0.47, speedup=0.97, lossless=True,
                    drafted=drafted, adaptive=adaptive)  # fmt: skip

    out = table([row("this run", 14 / 245), row("smollm2-eagle3", 0.9)], ea).splitlines()
    assert out[2].split() == ["draft", "tau", "alpha", "drafted", "speedup", "lossless"]
    assert out[3].split()[-3:] == ["6%", "0.97", "True"]
    assert out[4].split()[-3:] == ["90%", "0.97", "True"]
    assert out[5].startswith("  (this run: drafted for under a quarter") and len(out) == 6
    fixed = table([row("this run", 0.02, adaptive=False), row("x", math.nan)], ea).splitlines()
    assert len(fixed) == 5 and fixed[4].split()[-3] == "-"
    never = table([row("this run", 0.0)], ea).splitlines()
    assert never[-1].startswith("  (this run: drafted for under a quarter")


def test_old_module_path_says_where_the_app_went():
    r = run_module("trainer.train", ["debug=default"])
    assert r.returncode != 0 and "python -m flow" in r.stderr


def test_a_signal_while_measuring_says_the_draft_is_saved(data_file, tmp_path):
    """Ctrl-C during the measurement after training: one line naming the saved draft and the
    command that measures it later, exit 130 (it was a traceback)."""
    import signal

    out = tmp_path / "run"
    code = (
        "import os, signal, sys\n"
        "from decoding.decoder import SpeculativeDecoder\n"
        "def generate(self, *a, **k):\n"
        "    os.kill(os.getpid(), signal.SIGINT)\n"  # the first decode of the measurement
        "    return []\n"
        "SpeculativeDecoder.generate = generate\n"
        "from flow.app import main\n"
        "sys.argv = ['specdraft-train', *sys.argv[1:]]\n"
        "main()\n"
    )
    args = tiny_overrides(
        data_file,
        out,
        **{
            "train.max_steps": 2,
            "train.eval_after.enabled": "true",
            "train.eval_after.num_prompts": 1,
            "train.eval_after.compare": "[]",
        },
    )
    r = subprocess.run(
        [sys.executable, "-c", code, *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    assert r.returncode == 130, r.stderr[-2000:]
    final = out / "final"
    assert r.stderr.strip().splitlines()[-1] == (
        f"stopped by SIGINT while measuring: the draft is saved in {final}; measure it with: "
        f"specdraft-eval draft={final}"
    )
    assert (final / "config.json").exists() and "Traceback" not in r.stderr
