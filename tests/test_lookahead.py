"""Lookahead decoding: the Jacobi window's attention pattern, the side branch in the shared
verification forward, the n-gram pool, and its settings' errors. (Lossless greedy decoding and
exact sampling are in test_decoder.py with every other proposer.)"""

from __future__ import annotations

import pytest
import torch
from conftest import RUNNERS, make_runner

from decoding.decoder import SpeculativeDecoder
from decoding.drafts import load_proposer
from decoding.lookahead import LookaheadProposer
from decoding.runner import Layout
from models.base import DecodeState, DraftError, Proposal
from models.sampling import Sampling

PROMPT = [257, 72, 101, 108, 108, 111, 32, 72, 101, 108, 108, 111, 32, 119, 111, 114, 108, 100, 258]


@pytest.mark.parametrize("w,n", [(1, 2), (4, 3), (5, 4)])
def test_each_window_column_is_a_contiguous_trajectory(w, n):
    """Token (level l, column j) sits l + 1 + j after the root and sees exactly one token at
    each offset 1..l + 1 + j (itself last): the sequence a Jacobi iteration conditions on."""
    la = LookaheadProposer(window=w, ngram=n)
    m, offs = la._allowed, la._offsets
    assert m.shape == (w * (n - 1), w * (n - 1))
    for r in range(m.shape[0]):
        seen = sorted(offs[c] for c in m[r].nonzero().flatten().tolist())
        assert seen == list(range(1, offs[r] + 1)), (r, seen)


@pytest.mark.parametrize("runner", RUNNERS)
@torch.no_grad()
def test_side_branch_logits_equal_a_plain_forward_over_each_trajectory(tiny_target, runner):
    """In one forward with a proposal tree and the window, every window token's logits are what
    the target gives after the context, the root and that token's trajectory, and the tree's
    are what they would be without the window (on every target runner)."""
    t = tiny_target
    la = LookaheadProposer(window=3, ngram=4)
    g = torch.Generator().manual_seed(0)
    la.levels = [torch.randint(0, 250, (3,), generator=g).tolist() for _ in range(3)]
    side = la.side_branch(None)
    ctx, root = PROMPT[:-1], PROMPT[-1]
    prop = Proposal([5, 6, 7], [-1, 0, -1])
    run = make_runner(runner, t, widths=(1, 16))
    run.prefill(ctx)
    logits, _ = run.forward(Layout(root, prop, side))
    assert logits.shape[0] == 1 + 3 + 9

    def plain(seq):
        ids = torch.tensor([ctx + [root] + seq], device=t.device)
        return t.model(input_ids=ids).logits[0, -1]

    for i, path in enumerate([[5], [5, 6], [7]]):
        torch.testing.assert_close(logits[1 + i], plain(path), atol=1e-4, rtol=1e-4)
    for lvl in range(3):
        for j in range(3):
            traj = la.levels[0][: j + 1] + [la.levels[k][j] for k in range(1, lvl + 1)]
            got = logits[1 + 3 + lvl * 3 + j]
            torch.testing.assert_close(got, plain(traj), atol=1e-4, rtol=1e-4)


def test_window_outputs_become_ngrams_and_the_window_moves_up():
    la = LookaheadProposer(window=2, ngram=3, guesses=2)
    state = DecodeState([1, 2, 3], None, Sampling(), None, torch.device("cpu"))
    la.start(state)
    la.levels = [[10, 11], [20, 21]]
    logits = torch.full((4, 50), -1.0)
    logits[2, 30] = logits[3, 31] = 1.0  # the top level's next tokens: 30, 31
    la.side_logits(state, logits)
    assert la.levels == [[20, 21], [30, 31]]
    assert (20, 30) in la.pool[10] and (21, 31) in la.pool[11]
    # the prompt's own 3-grams are in the pool too, and the newest `guesses` are kept per key
    assert (2, 3) in la.pool[1]
    for x in range(5):
        la._add([10, 40 + x, 0])
    assert list(la.pool[10]) == [(43, 0), (44, 0)]


def test_candidates_are_merged_into_a_trie_and_cut_to_gamma():
    la = LookaheadProposer(window=2, ngram=4, guesses=4)
    state = DecodeState([9], None, Sampling(), None, torch.device("cpu"))
    la.start(state)
    for gram in ([9, 1, 2, 3], [9, 1, 2, 4], [9, 5, 6, 7]):
        la._add(gram)
    p = la.propose(state, 3)
    paths = set()
    for i in range(len(p)):
        path, j = [], i
        while j >= 0:
            path.append(p.tokens[j])
            j = p.parents[j]
        paths.add(tuple(reversed(path)))
    assert {(5, 6, 7), (1, 2, 4), (1, 2, 3)} <= paths
    assert len(p) == 7  # 1 -> 2 shared by two candidates
    assert all(par < i for i, par in enumerate(p.parents))
    assert max(len(x) for x in paths) == 3
    assert len(la.propose(state, 1)) == 2  # depth 1: the two distinct first tokens


def test_lookahead_finds_repeats_in_a_greedy_loop(tiny_target):
    """The tiny random target falls into loops under greedy decoding: the pool catches them and
    more than one token is emitted per forward, with the output unchanged."""
    from decoding.decoder import NoDraft

    ref = SpeculativeDecoder(tiny_target, NoDraft(), Sampling(), calibrate=False).generate(
        PROMPT, 96
    )
    dec = SpeculativeDecoder(
        tiny_target,
        LookaheadProposer(window=4, ngram=3, guesses=3),
        Sampling(),
        adaptive=False,
        gamma=2,
    )
    assert dec.generate(PROMPT, 96) == ref
    assert dec.stats.tau > 1.2, dec.stats.tau


@pytest.mark.parametrize(
    "la,needle",
    [((0, 4, 5), "window=0"), ((5, 1, 5), "ngram=1"), ((5, 4, 0), "guesses=0")],
)
def test_out_of_range_settings_are_one_line_errors(tiny_target, la, needle):
    with pytest.raises(DraftError, match=needle):
        load_proposer("lookahead", tiny_target, lookahead=la)


def test_lookahead_drafts_every_iteration_even_with_adaptive_on(tiny_target):
    """Lookahead's pool fills from the window each drafting iteration carries: it declares
    itself non-adaptive, and the decoder verifies its proposals every iteration."""
    la = LookaheadProposer(window=3, ngram=3, guesses=3)
    dec = SpeculativeDecoder(tiny_target, la, Sampling(), gamma=2, adaptive=True)
    assert not dec.adaptive and not dec.controller.adaptive
    windows = []
    side = la.side_branch
    la.side_branch = lambda state: windows.append(1) or side(state)
    assert len(dec.generate(PROMPT, 30)) == 30
    # every verification but the last (one token left: nothing to draft) carried the window
    # (the request's first token, the prefill's, drafts nothing and is no verification)
    assert len(windows) >= dec.stats.target_calls - 1 >= 10
