"""Loading a draft into a target whose hidden size matches but whose layers do not (another
target's KV heads, head width, MLP width), and the token counts a run reports: after a resume,
and summed over several processes."""

from __future__ import annotations

import json
import re
import types

import pytest
import torch
from conftest import accelerate_launch, compose, read_metrics, tiny_overrides

from models import METHODS
from models.base import DraftError, ExportError
from models.target import TargetConfig, load_target

#: the method settings a draft of each method needs on the tiny targets (their tokenizer uses
#: every embedding row, so a mask-token method is told one)
SETTINGS = {"dflash": {"mask_token_id": 3}}


def _wide() -> object:
    """Hidden size 64 like the default tiny target, but Qwen3 layers with 64-wide heads."""
    return load_target(
        TargetConfig(
            name="tiny_random", tiny_layers=4, tiny_head_dim=64, family="qwen3", dtype="float32"
        )
    )


@pytest.fixture(scope="module")
def wide():
    return _wide()


@pytest.fixture(scope="module")
def narrow():
    return load_target(TargetConfig(name="tiny_random", tiny_layers=4, dtype="float32"))


def _draft(name: str, target):
    cls = METHODS[name]
    draft = cls(target, cls.config_class(**SETTINGS.get(name, {})))
    if hasattr(draft, "vocab_chosen"):
        draft.vocab_chosen = True  # an export refuses a placeholder vocabulary
    return draft


def _one_line_for_another_target(msg: str, where, wide, narrow, made_for: bool = True) -> None:
    assert "\n" not in msg and msg.startswith(str(where)), msg
    shapes = r"\S*k_proj\S* has shape \(\d+, \d+\), target (.+) implies \(\d+, \d+\)"
    m = re.search(shapes + ": the draft was made for another target", msg)
    assert m and m.group(1) == narrow.identity, msg
    if made_for:
        assert msg.endswith(f"({wide.identity})"), msg


@pytest.mark.parametrize("name", ["eagle1", "eagle3", "hass", "falcon", "dflash", "medusa2"])
def test_a_draft_for_other_layers_of_the_same_width_is_one_line(name, wide, narrow, tmp_path):
    """load_draft names the folder, the first tensor, its shape and the target's, and the
    target the draft was made for, where load_state_dict gave a traceback."""
    assert wide.hidden_size == narrow.hidden_size
    source = _wide() if name == "medusa2" else wide  # Medusa-2 adapts its target in place
    _draft(name, source).save_draft(tmp_path / name)
    model = narrow.model
    with pytest.raises(DraftError) as e:
        METHODS[name].load_draft(tmp_path / name, narrow)
    _one_line_for_another_target(str(e.value), tmp_path / name, wide, narrow)
    assert narrow.model is model  # Medusa-2: refused before peft adapts the target


def test_a_medusa2_adapter_for_more_layers_is_one_line(narrow, tmp_path):
    """The same layers, two more of them: the adapter names a layer this target lacks."""
    deeper = load_target(TargetConfig(name="tiny_random", tiny_layers=6, dtype="float32"))
    _draft("medusa2", deeper).save_draft(tmp_path / "d")
    model = narrow.model
    with pytest.raises(DraftError) as e:
        METHODS["medusa2"].load_draft(tmp_path / "d", narrow)
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith(str(tmp_path / "d" / "adapter"))
    assert re.search(r"adapts model\.layers\.[45]\.\S+, which target .+ has not: the draft", msg)
    assert msg.endswith(f"made for another target ({deeper.identity})")
    assert narrow.model is model


@pytest.mark.parametrize(
    "name,fmt,tensor",
    [
        ("eagle3", "vllm", "midlayer.self_attn.k_proj.weight"),
        ("eagle3", "speculators", "layers.0.self_attn.k_proj.weight"),  # as the file spells it
        ("eagle1", "eagle1", "layers.0.self_attn.k_proj.weight"),
        ("dflash", "dflash", "layers.0.self_attn.k_proj.weight"),
    ],
)
def test_an_export_for_other_layers_of_the_same_width_is_one_line(
    name, fmt, tensor, wide, narrow, tmp_path
):
    from decoding.drafts import load_proposer
    from models.export import export, import_draft

    out = tmp_path / fmt
    export(_draft(name, wide), fmt, out, log=lambda *_: None)
    with pytest.raises(ExportError) as e:
        import_draft(out, narrow)
    msg = str(e.value)
    _one_line_for_another_target(msg, out, wide, narrow, made_for=False)
    assert f": {tensor} has shape " in msg
    with pytest.raises(DraftError) as e:  # what specdraft-eval prints
        load_proposer(str(out), narrow)
    assert "\n" not in str(e.value) and f"{tensor} has shape " in str(e.value)


def test_init_from_a_draft_for_other_layers_is_refused_naming_the_tensor(wide, narrow, tmp_path):
    from models.eagle import Eagle3Config, Eagle3Head
    from trainer.train import init_from_draft

    _draft("eagle3", wide).save_draft(tmp_path / "d")
    method = Eagle3Head(narrow, Eagle3Config())
    with pytest.raises(DraftError) as e:
        init_from_draft(method, str(tmp_path / "d"), narrow, "eagle3")
    assert str(e.value).startswith(
        f"train.init_from={tmp_path / 'd'}: {tmp_path / 'd'}: midlayer.self_attn.k_proj.weight "
        f"has shape (64, 128), target {narrow.identity} implies (32, 128): the draft was made "
        f"for another target ({wide.identity})"
    )


def test_init_from_a_draft_trained_with_other_settings_names_the_overrides(narrow, tmp_path):
    """A draft of this target trained with other method settings (a smaller draft vocabulary,
    other fused layers) is refused naming the tensor, then the settings to pass, as the command
    line takes them; with them the run starts from its weights."""
    from models.eagle import Eagle3Config, Eagle3Head
    from trainer.train import init_from_draft

    saved = Eagle3Head(narrow, Eagle3Config(draft_vocab_size=64, fuse_layers=[0, 1, 2]))
    saved.vocab_chosen = True
    saved.save_draft(tmp_path / "d")
    method = Eagle3Head(narrow, Eagle3Config(draft_vocab_size=128, fuse_layers=[1, 2, 3]))
    with pytest.raises(DraftError) as e:
        init_from_draft(method, str(tmp_path / "d"), narrow, "eagle3")
    msg = str(e.value)
    assert "\n" not in msg and "does not fit this run's method settings" in msg, msg
    assert msg.endswith(
        "; it was trained with method.draft_vocab_size=64 method.fuse_layers=[0,1,2]: add that "
        "to train on from it"
    ), msg
    fitting = Eagle3Head(narrow, Eagle3Config(draft_vocab_size=64, fuse_layers=[0, 1, 2]))
    init_from_draft(fitting, str(tmp_path / "d"), narrow, "eagle3", log=lambda *_: None)
    assert torch.equal(fitting.fc.weight, saved.fc.weight)


# -- token counts --------------------------------------------------------------------------------


def _fake_clock(monkeypatch):
    """``trainer.train``'s clock (not the loop's) advances one second a reading: the summary's
    launch then lasts exactly one second."""
    import time

    import trainer.train

    t = iter(range(10**6))
    fake = types.SimpleNamespace(**{k: getattr(time, k) for k in dir(time) if k[0] != "_"})
    fake.perf_counter = lambda: float(next(t))
    monkeypatch.setattr(trainer.train, "time", fake)


def test_summary_tokens_per_s_after_a_resume_counts_this_launch_only(
    data_file, tmp_path, monkeypatch
):
    from trainer.train import run

    _fake_clock(monkeypatch)
    common = {"train.eval_every": 0, "train.save_every": 2}
    out = tmp_path / "run"
    first = run(compose(tiny_overrides(data_file, out, **{**common, "train.max_steps": 2})))
    at2 = {r["step"]: r["tokens"] for r in read_metrics(out) if "loss" in r}[2]
    assert first["tokens_per_s"] == at2  # a fresh run: every token, in its one second
    again = {**common, "train.max_steps": 4, "resume": "true"}
    second = run(compose(tiny_overrides(data_file, out, **again)))
    at4 = {r["step"]: r["tokens"] for r in read_metrics(out) if "loss" in r}[4]
    assert at4 > at2 and second["tokens_per_s"] == at4 - at2  # not all at4 over 1 s
    assert json.loads((out / "summary.json").read_text())["tokens_per_s"] == at4 - at2


def test_a_checkpoint_from_before_the_summed_count_resumes_at_its_estimate(data_file, tmp_path):
    """Older checkpoints hold this process's tokens only: resumed, the count goes on from what
    their metrics said (tokens x processes, one process here)."""
    from trainer.train import run

    common = {"train.eval_every": 0, "train.save_every": 2}
    out = tmp_path / "run"
    run(compose(tiny_overrides(data_file, out, **{**common, "train.max_steps": 2})))
    f = out / "checkpoints" / "step_2" / "trainer_state.json"
    state = json.loads(f.read_text())
    assert state["tokens_all"] == state["tokens"] > 0
    del state["tokens_all"]
    f.write_text(json.dumps(state))
    run(
        compose(
            tiny_overrides(data_file, out, **{**common, "train.max_steps": 3, "resume": "true"})
        )
    )
    rows = {r["step"]: r["tokens"] for r in read_metrics(out) if "loss" in r}
    assert rows[2] == state["tokens"] < rows[3]


def test_logged_tokens_are_the_batches_tokens(data_file, tmp_path, monkeypatch):
    """``tokens`` at each logged step is the sum of every micro-batch's tokens so far."""
    import trainer.loop
    from trainer.train import run

    seen: list[int] = []
    attach = trainer.loop.attach_features

    def counting(batch, method, target):
        seen.append(int(batch["attention_mask"].sum()))
        return attach(batch, method, target)

    monkeypatch.setattr(trainer.loop, "attach_features", counting)
    extra = {"train.max_steps": 3, "train.grad_accum": 2, "train.eval_every": 0}
    run(compose(tiny_overrides(data_file, tmp_path / "run", **extra)))
    rows = {r["step"]: r["tokens"] for r in read_metrics(tmp_path / "run") if "loss" in r}
    assert rows == {s: sum(seen[: 2 * s]) for s in (1, 2, 3)}


def test_two_processes_log_the_tokens_of_one_with_the_same_global_batch(data_file, tmp_path):
    """Each process's batches differ in length: the logged count is their sum, the same as one
    process accumulating the same global batch (not process 0's tokens x 2)."""
    from trainer.train import run

    common = {
        "train.max_steps": 3,
        "train.log_every": 2,
        # a validation and a checkpoint at a step that logs no training row: the processes sum
        # their tokens there too
        "train.eval_every": 3,
        "train.save_every": 3,
        "data.batch_size": 2,
        "train.threads": 1,
    }
    one, two = tmp_path / "one", tmp_path / "two"
    run(compose(tiny_overrides(data_file, one, **{**common, "train.grad_accum": 2})))
    r = accelerate_launch(2, tiny_overrides(data_file, two, **common))
    assert r.returncode == 0, r.stderr[-3000:]

    def tokens(run_dir):
        return [(r["step"], "loss" in r, r["tokens"]) for r in read_metrics(run_dir)]

    assert tokens(two) == tokens(one)
    assert [(s, train) for s, train, _ in tokens(one)] == [(2, True), (3, False)]
    saved = json.loads((two / "checkpoints" / "step_3" / "trainer_state.json").read_text())
    assert saved["tokens_all"] == tokens(one)[1][2] > tokens(one)[0][2]
