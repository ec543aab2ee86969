"""The window a draft reads within. A target whose every layer slides (Mistral's shape) reads
only its last ``sliding_window`` tokens, and vLLM hands that window to its drafts' attention
too; so does every EAGLE and DFlash proposer here, and so does their training. Each proposer
drafts what the unrolled training computes at the same start, past the window, and the window
changes what they compute (a draft reading the whole context would draft otherwise). The
batched and fixed-shape paths draft what these batch-1 ones do: tests/test_batch.py and
tests/test_compiled.py run their side-by-side tests on the same windowed target."""

from __future__ import annotations

import random

import pytest
import torch
from conftest import family_target

from models import METHODS
from models.base import DecodeSettings, DecodeState
from models.sampling import Sampling


@pytest.mark.parametrize(
    "family,window",
    [
        ("mistral", 24),  # every layer slides: the model-level window
        ("gemma3", None),  # windows interleaved with full layers: none a draft reads
        ("gemma2", None),
        ("gpt_oss", None),
        ("llama", None),
        ("qwen2", None),  # a sliding_window key, but no layer slides
    ],
)
def test_a_draft_reads_the_window_of_a_target_whose_every_layer_slides(family, window):
    assert family_target(family).draft_window == window


def _sequence(n: int = 30, seed: int = 0) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 250) for _ in range(n)]


def _features(target, layers, seq: list[int]) -> torch.Tensor:
    ids = torch.tensor([seq], device=target.device)
    with torch.no_grad():
        return target.features(ids, torch.ones_like(ids), tuple(layers))[0]


def _state(target, seq: list[int], feats: torch.Tensor, n: int) -> DecodeState:
    return DecodeState(seq[:n], feats[: n - 1], Sampling(), None, target.device)


def _head(target, method: str):
    torch.manual_seed(0)
    cls = METHODS[method]
    cfg = cls.config_class()
    if hasattr(cfg, "draft_vocab_size"):
        cfg.draft_vocab_size = 64
    if hasattr(cfg, "mask_token_id"):
        cfg.mask_token_id = 256
    head = cls(target, cfg).to(target.device).eval()
    head.vocab_chosen = True
    return head


def _unroll(head, seq: list[int], steps: int) -> list[torch.Tensor]:
    feats = _features(head.target, head.feature_layers, seq)
    with torch.no_grad():
        h0 = head.initial_hidden(feats)[None]
        ids = torch.tensor([seq], device=h0.device)
        return head.unroll(h0, ids, torch.ones_like(ids), steps=steps)


def _top(head, h: torch.Tensor) -> int:
    return int(head.top_tokens(h[None], 1)[1][0, 0])


@pytest.mark.parametrize("method", ["eagle1", "eagle3"])
def test_eagle_chains_draft_what_training_computes_past_the_window(
    windowed_target, method, monkeypatch
):
    """At contexts of 4 to 28 tokens (window 8), the chain drafted at decode time is what the
    unrolled training computes at the same start, fed the drafted tokens; the window changes
    what training computes past it (and nothing before it)."""
    target, seq = windowed_target, _sequence()
    head = _head(target, method)
    feats = _features(target, head.feature_layers, seq)
    prop = head.proposer(DecodeSettings(tree="chain"))
    for n in (5, 12, 20, 29):
        st = _state(target, seq, feats, n)
        prop.start(st)
        drafted = prop.propose(st, 3).tokens
        outs = _unroll(head, seq[:n] + drafted, 3)
        assert drafted == [_top(head, outs[j][0, n - 2]) for j in range(3)], n
    windowed = _unroll(head, seq, 3)
    monkeypatch.setitem(target.__dict__, "_draft_window", None)
    whole = _unroll(head, seq, 3)
    W = 8
    for a, b in zip(windowed, whole, strict=True):
        # step j at start s sits at s + j - 1: starts below W - 2 see every key at step 3
        torch.testing.assert_close(a[0, : W - 2], b[0, : W - 2])
        assert not torch.allclose(a[0, W:], b[0, W:], atol=1e-4)


def test_peagle_drafts_what_its_training_computes_past_the_window(windowed_target, monkeypatch):
    """P-EAGLE's one forward over the new pairs and its mask slots drafts what its unrolled
    training computes at the same start, each depth reading the window of its own position."""
    target, seq = windowed_target, _sequence(seed=1)
    head = _head(target, "peagle")
    K = head.cfg.ttt_steps
    feats = _features(target, head.feature_layers, seq)
    outs = _unroll(head, seq, K)
    prop = head.proposer(DecodeSettings(tree="chain"))
    for n in (5, 12, 20, 29):
        st = _state(target, seq, feats, n)
        prop.start(st)
        assert prop.propose(st, K).tokens == [_top(head, outs[j][0, n - 2]) for j in range(K)], n
    monkeypatch.setitem(target.__dict__, "_draft_window", None)
    whole = _unroll(head, seq, K)
    assert not torch.allclose(outs[0][0, 8:], whole[0][0, 8:], atol=1e-4)


@pytest.mark.parametrize("method", ["dflash", "dspark"])
def test_block_drafters_draft_what_training_computes_past_the_window(
    windowed_target, method, monkeypatch
):
    """A DFlash (or DSpark) block at decode time is the block training computes at the same
    anchor: each slot reads the context within its own position's window."""
    target, seq = windowed_target, _sequence(seed=2)
    draft = _head(target, method)
    S = draft.cfg.block_size
    feats = _features(target, draft.feature_layers, seq)
    anchors = torch.tensor([[3, 10, 18, 27]], device=target.device)
    ids = torch.tensor([seq], device=target.device)

    def blocks():
        with torch.no_grad():
            return draft.run_blocks(feats[None], ids, torch.ones_like(ids), anchors)

    h = blocks()
    prop = draft.proposer(DecodeSettings(tree="chain"))
    for a, n in enumerate((4, 11, 19, 28)):  # the block starts at the pending token, n - 1
        st = _state(target, seq, feats, n)
        prop.start(st)
        got = prop.propose(st, S - 1).tokens
        prev = torch.tensor([seq[n - 1]], device=target.device)
        ((want, _),) = draft.pick(h[:, a, 1:], prev, [S - 1], Sampling(), [None])
        assert got == want, n
    monkeypatch.setitem(target.__dict__, "_draft_window", None)
    whole = blocks()
    assert not torch.allclose(h[:, 2:], whole[:, 2:], atol=1e-4)
