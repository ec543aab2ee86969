"""A target's identity names its weights and what it computes, not how or when it was loaded:
the shipped draft must be recognised as trained for the embedded target on a fresh machine
(which converts the GGUF again, so files get new mtimes) and at any dtype."""

from __future__ import annotations

import os
import shutil

import pytest

from models.families import FAMILIES
from models.target import (
    TargetConfig,
    TargetError,
    describe_target,
    load_target,
    target_folder,
    target_identity,
)

CONFIG = {
    "model_type": "llama",
    "hidden_size": 8,
    "dtype": "bfloat16",
    "transformers_version": "5.19.0",
}


def _folder(tmp_path, name, payload: bytes):
    d = tmp_path / name / "model"
    d.mkdir(parents=True)
    (d / "model.safetensors").write_bytes(payload)
    return d


def test_identity_ignores_mtime_dtype_and_library_version(tmp_path):
    payload = os.urandom(3 << 20)
    a = _folder(tmp_path, "a", payload)
    b = tmp_path / "b" / "model"
    shutil.copytree(a, b)
    os.utime(b / "model.safetensors", (1, 1))  # converted again: another mtime
    other = {**CONFIG, "dtype": "float32", "transformers_version": "5.23.0"}
    assert target_identity(str(a), CONFIG) == target_identity(str(b), other)
    assert target_identity(str(a), CONFIG).startswith("model:")


def test_identity_changes_with_weights_or_architecture(tmp_path):
    payload = bytearray(os.urandom(3 << 20))
    a = _folder(tmp_path, "a", bytes(payload))
    payload[len(payload) // 2] ^= 0xFF  # one byte in the middle of the file
    b = _folder(tmp_path, "b", bytes(payload))
    assert target_identity(str(a), CONFIG) != target_identity(str(b), CONFIG)
    assert target_identity(str(a), CONFIG) != target_identity(str(a), {**CONFIG, "hidden_size": 16})


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_described_and_loaded_targets_have_one_identity(tmp_path, family):
    """An engine's target is described without its weights (``describe_target``); a resumed
    regeneration or evaluation checks its files by that identity, so it must be the one the
    loaded target has, whatever the family's config looks like."""
    tiny = load_target(TargetConfig(name="tiny_random", family=family, cache_dir=str(tmp_path)))
    folder = target_folder(tiny)
    cfg = TargetConfig(path=str(folder), dtype="float32")
    tok, identity, described, eos = describe_target(cfg)
    loaded = load_target(cfg)
    assert identity == loaded.identity
    assert described == folder and tok.get_vocab() == loaded.tokenizer.get_vocab()
    assert loaded.tokenizer.eos_token_id in eos


def test_an_attention_the_architecture_lacks_is_one_line(tmp_path):
    tiny = load_target(TargetConfig(name="tiny_random", family="gpt_oss", cache_dir=str(tmp_path)))
    cfg = TargetConfig(path=str(target_folder(tiny)), attn_implementation="sdpa")
    with pytest.raises(TargetError) as e:
        load_target(cfg)
    msg = str(e.value)
    assert msg.startswith("target.attn_implementation=sdpa: GptOssForCausalLM does not support")
    assert "\n" not in msg and "attn_implementation=auto" in msg


def test_a_folder_that_is_not_a_model_is_one_line(tmp_path):
    """An empty folder, a file, a model folder without its tokenizer and a trained draft passed
    as the target are each refused in one line naming the path and what is missing."""
    import json

    tiny = load_target(TargetConfig(name="tiny_random", cache_dir=str(tmp_path / "cache")))
    model = tmp_path / "model"
    shutil.copytree(target_folder(tiny), model)
    for f in model.glob("tokenizer*"):
        f.unlink()
    (tmp_path / "empty").mkdir()
    (tmp_path / "file.bin").write_bytes(b"x")
    (tmp_path / "draft").mkdir()
    (tmp_path / "draft" / "config.json").write_text(json.dumps({"specdraft": {}, "target": {}}))
    cases = {
        "empty": "not a Hugging Face model folder (no config.json)",
        "file.bin": "a file, not a Hugging Face model folder",
        "model": "its tokenizer cannot be loaded (",
        "draft": "a draft trained by specdraft, not a target",
    }
    for name, why in cases.items():
        for load in (load_target, describe_target):
            with pytest.raises(TargetError) as e:
                load(TargetConfig(path=str(tmp_path / name)))
            msg = str(e.value)
            assert msg.startswith(f"target.path={tmp_path / name}") and why in msg, msg
            assert "\n" not in msg


def test_a_relative_target_path_is_kept_absolute(tmp_path, monkeypatch):
    """``target.path=models/t`` is loaded as the absolute folder, so a draft saved for it
    names the folder wherever it is later loaded from; the identity is the same either way."""
    tiny = load_target(TargetConfig(name="tiny_random", cache_dir=str(tmp_path / "cache")))
    shutil.copytree(target_folder(tiny), tmp_path / "models" / "t")
    monkeypatch.chdir(tmp_path)
    rel = load_target(TargetConfig(path="models/t", dtype="float32"))
    assert rel.cfg.path == str(tmp_path / "models" / "t")
    monkeypatch.chdir(tmp_path / "models")
    absolute = load_target(TargetConfig(path=str(tmp_path / "models" / "t"), dtype="float32"))
    assert rel.identity == absolute.identity == describe_target(absolute.cfg)[1]


def _hub(monkeypatch, tmp_path, endpoint="http://127.0.0.1:1", offline=False):
    """A Hugging Face cache in ``tmp_path`` and a hub at ``endpoint`` (port 1: refused at
    once, as an unreachable hub is), no proxy."""
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(constants, "ENDPOINT", endpoint)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", offline)
    for k in ("HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy"):
        monkeypatch.delenv(k, raising=False)


def test_a_hub_id_that_cannot_load_is_one_line_at_once(tmp_path, monkeypatch):
    """A hub id (or a mistyped folder with no slash) neither cached nor reachable is refused
    before transformers retries the hub for a minute; where the hub may answer, or the model
    is cached, it is left to load."""
    import time

    from models.target import hub_unreachable

    _hub(monkeypatch, tmp_path)
    t0 = time.perf_counter()
    with pytest.raises(TargetError) as e:
        load_target(TargetConfig(path="someorg/no-such-model"))
    assert time.perf_counter() - t0 < 30  # seconds, not a minute of retries
    assert str(e.value) == (
        "target.path=someorg/no-such-model: no such folder, not in the Hugging Face cache, and "
        "http://127.0.0.1:1 cannot be reached (offline?): pass the model's folder"
    )
    assert hub_unreachable("a b") == "no such folder, and not a valid hub id"
    _hub(monkeypatch, tmp_path, offline=True)
    assert "HF_HUB_OFFLINE is set" in hub_unreachable("someorg/no-such-model")
    # cached: loads from the cache, whatever the network
    snap = tmp_path / "hub" / "models--someorg--cached" / "snapshots" / "abc"
    snap.mkdir(parents=True)
    (snap / "config.json").write_text("{}")
    (snap.parent.parent / "refs").mkdir()
    (snap.parent.parent / "refs" / "main").write_text("abc")
    assert hub_unreachable("someorg/cached") is None
    # behind a proxy the hub is not probed
    _hub(monkeypatch, tmp_path)
    monkeypatch.setenv("HTTPS_PROXY", "http://proxy.invalid:3128")
    assert hub_unreachable("someorg/no-such-model") is None


def test_a_draft_hub_id_that_cannot_load_is_one_line(tmp_path, monkeypatch, tiny_target):
    from decoding.drafts import load_proposer
    from models.base import DraftError

    _hub(monkeypatch, tmp_path)
    with pytest.raises(DraftError) as e:
        load_proposer("someorg/no-such-draft", tiny_target)
    assert str(e.value).startswith("draft=someorg/no-such-draft: no such folder, not in the ")
    # what the engines fetch (a draft LM, a target to convert): the same line, no retries
    from decoding.drafts import _hub_folder

    with pytest.raises(DraftError, match="^target.path=someorg/t: no such folder, not in the "):
        _hub_folder("someorg/t", "target.path")


def test_a_hub_id_is_passed_to_the_hub_not_refused_as_a_folder(tmp_path, monkeypatch):
    """``target.path=Qwen/Qwen3-8B`` (the README's own example) goes to the hub where it may
    answer; ``runs/x`` where ``runs/`` is here, or a deeper path, is a folder that is not."""
    import socket

    from models.target import _where

    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen()
    try:
        _hub(monkeypatch, tmp_path, endpoint=f"http://127.0.0.1:{server.getsockname()[1]}")
        monkeypatch.chdir(tmp_path)
        assert _where(TargetConfig(path="Qwen/Qwen3-8B")) == "Qwen/Qwen3-8B"
        assert _where(TargetConfig(path="gpt2")) == "gpt2"
        (tmp_path / "runs").mkdir()
        for folder in ("runs/x", "a/b/c", "./x", "/no/such"):
            with pytest.raises(TargetError, match="no such folder$"):
                _where(TargetConfig(path=folder))
    finally:
        server.close()
