"""A target's identity names its weights and what it computes, not how or when it was loaded:
the shipped draft must be recognised as trained for the embedded target on a fresh machine
(which converts the GGUF again, so files get new mtimes) and at any dtype."""

from __future__ import annotations

import os
import shutil

from models.target import target_identity

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
