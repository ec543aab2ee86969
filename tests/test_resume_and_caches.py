"""Caches and resumption never train on something other than what the run asks for: a checkpoint
resumes only for its own method, target and tokenizer, with the run's own optimizer settings;
pruning keeps the checkpoint just written; a damaged or half-copied cache is built again, not
read."""

from __future__ import annotations

import json
import shutil

import pytest
from conftest import compose, read_metrics, tiny_overrides

from data.dataset import prepare_tokenized
from trainer.checkpoint import CheckpointError, latest_checkpoint, list_checkpoints
from trainer.train import run

STEPS = {"train.max_steps": 4, "train.save_every": 2, "train.eval_every": 0}
EAGLE3 = {"target.tiny_layers": 4, "method.draft_vocab_size": 128, "method.ttt_steps": 2}


def _run(data_file, out, **extra):
    return run(compose(tiny_overrides(data_file, out, **extra)))


def test_resume_as_another_method_of_the_same_shapes_is_refused(data_file, tmp_path):
    """An EAGLE-3 checkpoint has HASS's weight names and shapes: resuming it as HASS loaded
    without a word and went on with another loss."""
    out = tmp_path / "run"
    _run(data_file, out, method="eagle3", **EAGLE3, **STEPS)
    more = {**STEPS, "train.max_steps": 6, "resume": "true"}
    with pytest.raises(
        CheckpointError, match="a checkpoint of a eagle3 draft; this run trains hass"
    ):
        _run(data_file, out, method="hass", **EAGLE3, **more)


def test_resume_on_another_target_is_refused(data_file, tmp_path):
    """Another target of the same architecture (other weights) fits the draft's shapes."""
    out = tmp_path / "run"
    _run(data_file, out, **STEPS)
    more = {**STEPS, "train.max_steps": 6, "resume": "true"}
    with pytest.raises(CheckpointError, match=r"trained for target tiny_random\(seed=0\)"):
        _run(data_file, out, **{**more, "target.seed": 1})


def test_resume_with_another_lr_trains_at_that_lr(data_file, tmp_path, capsys):
    """The optimizer's saved param groups and the scheduler's base lr replaced the configured
    lr on load: ``resume=true optim.lr=...`` went on at the old lr without a word."""
    out = tmp_path / "run"
    const = {"optim.schedule": "constant", **STEPS}
    _run(data_file, out, **const, **{"optim.lr": 1e-3})
    capsys.readouterr()
    _run(data_file, out, **{**const, "optim.lr": 1e-2, "train.max_steps": 6, "resume": "true"})
    lr = {r["step"]: r["lr"] for r in read_metrics(out) if "lr" in r}
    assert lr[4] == pytest.approx(1e-3)
    assert lr[5] == pytest.approx(1e-2) and lr[6] == pytest.approx(1e-2)
    said = capsys.readouterr().out
    assert "optimizer settings differ" in said and "0.001 -> 0.01" in said


def test_resume_with_unchanged_settings_says_nothing_of_settings(data_file, tmp_path, capsys):
    out = tmp_path / "run"
    _run(data_file, out, **STEPS)
    capsys.readouterr()
    _run(data_file, out, **{**STEPS, "train.max_steps": 6, "resume": "true"})
    said = capsys.readouterr().out
    assert "resumed from" in said and "differ" not in said


def test_resume_from_an_earlier_checkpoint_keeps_the_ones_it_writes(data_file, tmp_path):
    """Resumed from step 6 of a run that reached step 8 (keep 2): saving step 7 pruned step 6
    and kept the old step 8, so the next resume=true went back to the abandoned history (and
    each later save pruned the new history's checkpoints first)."""
    out = tmp_path / "run"
    _run(data_file, out, **{**STEPS, "train.max_steps": 8})
    assert [p.name for p in list_checkpoints(out)] == ["step_6", "step_8"]
    _run(
        data_file,
        out,
        **{
            **STEPS,
            "train.max_steps": 7,
            "train.save_every": 1,
            "resume": str(out / "checkpoints" / "step_6"),
        },
    )
    assert [p.name for p in list_checkpoints(out)] == ["step_6", "step_7"]
    assert latest_checkpoint(out) == out / "checkpoints" / "step_7"


def test_resume_after_the_chat_template_changed_is_refused(data_file, tmp_path, monkeypatch):
    """Same weights, other chat template (or tokenizer files): the checkpoint's batches were
    tokenised another way, and the run continued on the new ids without a word."""
    import models.tiny

    out = tmp_path / "run"
    _run(data_file, out, **STEPS)
    template = models.tiny.CHATML_TEMPLATE.replace("<|im_start|>", "<|im_start|> ")
    monkeypatch.setattr(models.tiny, "CHATML_TEMPLATE", template)
    more = {**STEPS, "train.max_steps": 6, "resume": "true"}
    with pytest.raises(CheckpointError, match="another tokenizer or chat template"):
        _run(data_file, out, **more)
    monkeypatch.undo()  # the template it was trained with resumes
    _run(data_file, out, **more)
    assert latest_checkpoint(out) == out / "checkpoints" / "step_6"


def _conv(i: int, reply: str) -> str:
    msgs = [{"from": "human", "value": f"question {i}"}, {"from": "gpt", "value": reply}]
    return json.dumps({"id": f"c{i}", "conversations": msgs}) + "\n"


KW = dict(max_length=512, val_fraction=0.0, max_val_records=0, max_records=None, seed=0)


def test_a_tokenised_cache_folder_without_its_done_file_is_not_read(tmp_path):
    """A cache folder left without ``done.json`` (a copy cut short) under this data's key: the
    data was tokenised again, the rename onto the folder failed, and the folder's stale rows
    were read as if another process had just written them."""
    from models.tiny import build_tiny_tokenizer

    tok = build_tiny_tokenizer()
    a_file, b_file = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    a_file.write_text("".join(_conv(i, "apple") for i in range(8)))
    b_file.write_text("".join(_conv(i, "river stone") for i in range(3)))
    root = str(tmp_path / "c")
    a = prepare_tokenized(str(a_file), tok, cache_root=root, **KW)
    b = prepare_tokenized(str(b_file), tok, cache_root=root, **KW)
    want = list(b.train["input_ids"])
    (b.cache_dir / "done.json").unlink()
    shutil.rmtree(b.cache_dir / "train")
    shutil.copytree(a.cache_dir / "train", b.cache_dir / "train")
    again = prepare_tokenized(str(b_file), tok, cache_root=root, **KW)
    assert list(again.train["input_ids"]) == want
    assert (again.cache_dir / "done.json").exists()


def test_a_damaged_tokenised_cache_is_tokenised_again(tmp_path):
    from models.tiny import build_tiny_tokenizer

    tok = build_tiny_tokenizer()
    f = tmp_path / "a.jsonl"
    f.write_text("".join(_conv(i, "apple") for i in range(8)))
    root = str(tmp_path / "c")
    a = prepare_tokenized(str(f), tok, cache_root=root, **KW)
    want = list(a.train["input_ids"])
    for arrow in (a.cache_dir / "train").glob("*.arrow"):
        arrow.unlink()
    said = []
    again = prepare_tokenized(str(f), tok, cache_root=root, log=said.append, **KW)
    assert list(again.train["input_ids"]) == want
    assert "damaged" in said[0] and str(a.cache_dir) in said[0]


def test_a_feature_cache_that_lost_a_shard_is_built_again(tmp_path, data_file, tiny_target):
    """A finished feature cache whose shard was deleted or cut short since was reused, and the
    run failed mid-training with a safetensors traceback when it reached those samples."""
    import torch

    from trainer.features import build_feature_store

    data = prepare_tokenized(
        str(data_file), tiny_target.tokenizer, cache_root=str(tmp_path / "c"), **KW
    )
    kw = dict(batch_size=4, shard_tokens=400, dtype="float32", progress=False)
    root = str(tmp_path / "c")
    store = build_feature_store(tiny_target, data.train, (-1,), root, "k", **kw)
    want = {i: store.get(i).clone() for i in range(len(data.train))}
    shards = sorted(store.path.glob("shard_*.safetensors"))
    assert len(shards) > 2
    shards[1].unlink()
    shards[2].write_bytes(shards[2].read_bytes()[:100])  # cut short
    again = build_feature_store(tiny_target, data.train, (-1,), root, "k", **kw)
    for i, t in want.items():
        torch.testing.assert_close(again.get(i), t)


def test_a_resume_value_naming_nothing_is_refused_before_the_target_loads(
    data_file, tmp_path, monkeypatch
):
    """``resume=yes`` (or a mistyped checkpoint folder) failed only after the target and the
    data had loaded, minutes in on a large target."""
    import trainer.train as train

    def no_load(*_):
        raise AssertionError("the target was loaded")

    monkeypatch.setattr(train, "_load_target", no_load)
    for value in ("yes", str(tmp_path / "no_such_run")):
        with pytest.raises(CheckpointError, match=f"resume={value}: no such checkpoint folder"):
            _run(data_file, tmp_path / "run", resume=value)
