"""The shared decoder end to end on tiny models: lossless greedy decoding for every proposer,
exact sampling, draft == target, adaptive gamma, tree verification with cache surgery."""

from __future__ import annotations

import random
import time

import pytest
import torch
from conftest import COMPILE, RUNNERS, assert_first_two_tokens_follow_the_target, make_runner

from decoding.decoder import NoDraft, SpeculativeDecoder
from decoding.lookahead import LookaheadProposer
from decoding.proposers import DraftLMProposer, NGramProposer
from decoding.runner import Layout
from models.base import DecodeSettings, Proposal, Proposer
from models.eagle import Eagle1Config, EagleHead
from models.sampling import Sampling
from models.target import Target, TargetConfig
from models.tiny import build_tiny_target

PROMPT = [257, 72, 101, 108, 108, 111, 32, 72, 101, 108, 108, 111, 32, 119, 111, 114, 108, 100, 258]


def proposers(target):
    other, _ = build_tiny_target(seed=1)  # an unrelated random draft with the same vocabulary
    other = other.to(target.device)
    return {
        "ngram": NGramProposer(),
        "draft_lm": DraftLMProposer(other),
        "truncate:1": DraftLMProposer(target.truncated(1)),
        "eagle": EagleHead(target, Eagle1Config()).to(target.device).proposer(),
        "self": DraftLMProposer(target.model),
        "lookahead": LookaheadProposer(window=4, ngram=3, guesses=3),
    }


def ar_greedy(target, prompt, n, runner="static"):
    dec = SpeculativeDecoder(
        target, NoDraft(), Sampling(), calibrate=False, compile=COMPILE[runner]
    )
    return dec.generate(prompt, n)


def test_plain_decoding_equals_transformers_generate(tiny_target):
    ours = ar_greedy(tiny_target, PROMPT, 40)
    ref = tiny_target.model.generate(
        torch.tensor([PROMPT]), max_new_tokens=40, min_new_tokens=40, do_sample=False
    )[0, len(PROMPT) :].tolist()
    assert ours == ref


def speculative_run(target, name, runner, adaptive=False):
    """A speculative decoder of ``target`` with proposer ``name`` (gamma 4) on ``runner``."""
    return SpeculativeDecoder(
        target,
        proposers(target)[name],
        Sampling(),
        gamma=4,
        adaptive=adaptive,
        compile=COMPILE[runner],
    )


@pytest.mark.parametrize("runner", RUNNERS)
@pytest.mark.parametrize("adaptive", [False, True])
@pytest.mark.parametrize("name", ["ngram", "draft_lm", "truncate:1", "eagle", "self", "lookahead"])
def test_greedy_speculative_equals_greedy_autoregressive(tiny_target, name, adaptive, runner):
    torch.manual_seed(0)
    ref = ar_greedy(tiny_target, PROMPT, 48, runner)
    dec = speculative_run(tiny_target, name, runner, adaptive)
    assert dec.generate(PROMPT, 48) == ref
    assert dec.generate(PROMPT[:7], 20) == ar_greedy(tiny_target, PROMPT[:7], 20, runner)


@pytest.fixture(scope="module")
def varied_target():
    """A tiny Llama-3-shaped target (untied output layer) whose greedy text varies: the
    default tiny target repeats its last token, which every draft here guesses after the
    first, so its speculative runs reject nothing."""
    from conftest import family_target

    return family_target("llama3")


@pytest.mark.parametrize("runner", RUNNERS)
@pytest.mark.parametrize("name", ["ngram", "draft_lm", "truncate:1", "eagle", "lookahead"])
def test_greedy_speculative_equals_greedy_autoregressive_with_rejections(
    varied_target, name, runner
):
    """As above, on a target whose drafts are rejected: every rollback path runs."""
    prompt = [100, 3, 77, 12]
    ref = ar_greedy(varied_target, prompt, 40, runner)
    assert len(set(ref)) > 10  # the text varies
    dec = speculative_run(varied_target, name, runner)
    assert dec.generate(prompt, 40) == ref
    s = dec.stats
    assert sum(s.tested.values()) > sum(s.accepted.values()), "nothing was rejected"


@pytest.mark.parametrize("batch", [1, 3])
@pytest.mark.parametrize("policy", ["fixed", "adaptive", "goodput"])
def test_a_request_starts_as_engines_start_it(tiny_target, batch, policy):
    """The prefill chooses a request's first token and nothing drafts it (vLLM, SGLang and
    llama.cpp start so): the proposer is first asked once a reply token exists, the first
    token is counted apart (``first_tokens``) and is no verification, and tau counts the rest."""
    from decoding.batch import BatchDecoder
    from models.target import GenRequest

    asked = []

    class Spy(DraftLMProposer):
        def propose(self, state, gamma):
            asked.append(len(state.ids) - len(prompts[0]))  # reply tokens so far
            return super().propose(state, gamma)

        def fresh(self):
            return Spy(self.model)

        def batched(self):
            return None

    prompts = [PROMPT[:12], PROMPT[2:14], PROMPT[5:17]]  # of one length: ``asked`` reads it
    spy = Spy(tiny_target.model)
    dec = BatchDecoder(tiny_target, spy, Sampling(), batch, gamma=3, policy=policy, calibrate=False)
    out = dec.run([GenRequest(i, prompts[i]) for i in range(3)], 9)
    s = dec.stats.rows
    assert asked and min(asked) == 1, asked
    assert s.first_tokens == 3 and s.new_tokens == sum(len(o) for o in out.values()) == 27
    assert s.alpha == 1.0 and s.tau == s.decoded_tokens / s.target_calls
    if policy == "fixed":  # the draft is the target: 8 tokens after the first, 4 + 4
        assert s.target_calls == 6 and s.tau == 4.0


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_draft_identical_to_target_accepts_everything(tiny_target, temperature):
    dec = SpeculativeDecoder(
        tiny_target,
        DraftLMProposer(tiny_target.model),
        Sampling(temperature),
        gamma=3,
        adaptive=False,
    )
    dec.generate(PROMPT, 1 + 4 * 10)  # the prefill's first token, then 10 verifications
    s = dec.stats
    assert s.alpha == 1.0 and s.tau == 4.0 and s.target_calls == 10
    assert s.new_tokens == 41 and s.first_tokens == 1
    assert s.alpha_per_position() == [1.0, 1.0, 1.0]


def test_stop_token_ends_generation(tiny_target):
    ref = ar_greedy(tiny_target, PROMPT, 30)
    stop = ref[7]
    out = SpeculativeDecoder(
        tiny_target, DraftLMProposer(tiny_target.model), Sampling(), gamma=4, adaptive=False
    ).generate(PROMPT, 30, {stop})
    assert out == ref[: ref.index(stop) + 1]


def test_adaptive_gamma_stops_drafting_with_a_useless_draft(tiny_target):
    class Wrong(Proposer):
        """Always proposes a token the target never picks first: alpha = 0."""

        feature_layers = ()
        draft_calls = 0

        def start(self, state):
            pass

        def propose(self, state, gamma):
            time.sleep(0.003 * gamma)  # a draft step that costs something, like a real one
            return Proposal.chain([0] * gamma)

        def rollback(self, state, n):
            pass

    dec = SpeculativeDecoder(tiny_target, Wrong(), Sampling(), gamma=4, adaptive=True)
    out = dec.generate(PROMPT, 80)
    assert out == ar_greedy(tiny_target, PROMPT, 80)
    assert dec.stats.gamma_used[0] > 0.7 * dec.stats.target_calls
    fixed = SpeculativeDecoder(tiny_target, Wrong(), Sampling(), gamma=4, adaptive=False)
    fixed.generate(PROMPT, 20)
    # gamma is fixed but never drafts past max_new_tokens (each iteration here emits 1 token;
    # the first token is the prefill's, drafted for by no one)
    assert fixed.stats.gamma_used == {4: 15, 3: 1, 2: 1, 1: 1, 0: 1}


class OracleTree(Proposer):
    """Proposes, at each of ``depth`` levels, the token plain decoding will emit plus a wrong
    sibling, in random order (and a wrong branch under the wrong sibling): exercises tree
    attention, path selection and moving non-contiguous cache entries into place."""

    feature_layers = ()
    draft_calls = 0

    def __init__(self, reference, prompt_len, depth=3, seed=0):
        self.ref, self.n0, self.depth = reference, prompt_len, depth
        self.rng = random.Random(seed)

    def start(self, state):
        pass

    def propose(self, state, gamma):
        done = len(state.ids) - self.n0
        tokens, parents = [], []
        parent = -1
        for k in range(min(gamma, self.depth)):
            if done + k >= len(self.ref):
                break
            right = self.ref[done + k]
            wrong = (right + 1 + self.rng.randrange(50)) % 259
            order = [right, wrong] if self.rng.random() < 0.5 else [wrong, right]
            idx = {}
            for tok in order:
                tokens.append(tok)
                parents.append(parent)
                idx[tok] = len(tokens) - 1
            tokens.append((wrong + 7) % 259)  # a child of the wrong sibling
            parents.append(idx[wrong])
            parent = idx[right]
        return Proposal(tokens, parents)

    def rollback(self, state, n):
        pass


@pytest.mark.parametrize("runner", RUNNERS)
def test_tree_verification_keeps_the_accepted_path(tiny_target, runner):
    ref = ar_greedy(tiny_target, PROMPT, 41, runner)
    dec = SpeculativeDecoder(
        tiny_target,
        OracleTree(ref, len(PROMPT)),
        Sampling(),
        gamma=3,
        adaptive=False,
        compile=COMPILE[runner],
    )
    assert dec.generate(PROMPT, 41) == ref  # the prefill's token, then 10 trees
    assert dec.stats.tau == 4.0  # every level's right token is in the tree


@pytest.mark.parametrize(
    "s,sampling_where",
    [(Sampling(1.0), False), (Sampling(1.0, top_k=4), True), (Sampling(0.8, top_p=0.7), True)],
    ids=["T1-host", "T1-topk4-device", "T0.8-topp0.7-device"],
    indirect=["sampling_where"],
)
def test_sampled_speculative_output_follows_the_target(small_vocab_pair, s, sampling_where):
    """Chi-square on the first two generated tokens (false-alarm rate 1e-3 per test)."""
    target, draft = small_vocab_pair
    dec = SpeculativeDecoder(target, DraftLMProposer(draft), s, gamma=3, adaptive=False, seed=5)
    assert_first_two_tokens_follow_the_target(target, dec, [1, 2, 3], s)
    assert dec.stats.alpha < 0.95  # the draft really differs: rejections happen
    # every iteration's acceptance ran where it was asked to, and the counter says so
    on = dec.stats.sampled_on_device
    assert on == (dec.stats.target_calls if sampling_where else 0)


@pytest.mark.parametrize("runner", ["transformers", "graphs"])
def test_sampled_output_follows_the_target_on_every_runner(small_vocab_pair, runner):
    """The chi-square test above (the default runner) on the other target runners."""
    target, draft = small_vocab_pair
    s = Sampling(1.0)
    dec = SpeculativeDecoder(
        target, DraftLMProposer(draft), s, gamma=3, adaptive=False, seed=5, compile=COMPILE[runner]
    )
    assert_first_two_tokens_follow_the_target(target, dec, [1, 2, 3], s)


def test_lookahead_sampling_follows_the_target(small_vocab_pair, sampling_where):
    """Lookahead's candidates are deterministic n-grams verified as a tree with point-mass
    rejection; the prompt repeats its last token so the pool has candidates from the start."""
    target, _ = small_vocab_pair
    s = Sampling(1.0)
    dec = SpeculativeDecoder(
        target, LookaheadProposer(window=3, ngram=3, guesses=3), s, gamma=2, adaptive=False, seed=3
    )
    assert_first_two_tokens_follow_the_target(target, dec, [3, 5, 7, 3, 5, 9, 3], s, gen=4)
    assert sum(dec.stats.tested.values()) > 1000  # candidates were really verified
    assert dec.stats.alpha < 0.95  # and rejected at times


def test_a_stop_rule_keeps_sampling_exact(small_vocab_pair):
    """A learned stop rule decides how many tokens are drafted from what was drafted (here: stop
    after any token the draft gives less than 0.6); the output must still be the target's."""
    target, draft = small_vocab_pair
    s = Sampling(1.0)
    dec = SpeculativeDecoder(
        target,
        DraftLMProposer(draft),
        s,
        gamma=3,
        adaptive=False,
        seed=7,
        stop_rule=lambda sig: bool(sig[0] < 0.6),
    )
    assert_first_two_tokens_follow_the_target(target, dec, [1, 2, 3], s, gen=4)
    lengths = dec.stats.gamma_used
    assert lengths[1] > 0 and (lengths[2] + lengths[3]) > 0  # it stopped early, and not always


def test_tree_controller_drafts_only_while_trees_pay():
    from decoding.policies import TreeController

    # a tree that never gets a token accepted and costs 1.5 plain steps: stop drafting it,
    # apart from rare probes that back off
    c = TreeController(depth=4, adaptive=True, t_plain=0.05)
    drafted = 0
    for _ in range(400):
        g = c.choose(limit=100)
        drafted += g > 0
        c.update(g, 1, 0, None, 0.065 if g else 0.05, t_draft=0.01 if g else 0.0)
    assert drafted < 20
    # a tree that brings 2.5 tokens for 1.5 plain steps' time: keep drafting
    c = TreeController(depth=4, adaptive=True, t_plain=0.05)
    drafted = 0
    for _ in range(100):
        g = c.choose(limit=100)
        drafted += g > 0
        c.update(g, 3, 2 if g else 0, None, 0.065 if g else 0.05, t_draft=0.01 if g else 0.0)
    assert drafted == 100
    # a good tree whose first two iterations (the warm-up's, a prompt's start) accept nothing:
    # keep drafting (a first tree weighed as ten kept it from drafting for hundreds of steps)
    c = TreeController(depth=4, adaptive=True, t_plain=0.05)
    drafted = 0
    for i in range(200):
        g = c.choose(limit=100)
        drafted += g > 0
        acc = (0 if i < 2 else 3) if g else 0
        c.update(g, 4, acc, None, 0.065 if g else 0.05, t_draft=0.01 if g else 0.0)
    assert drafted >= 195
    # fixed: always the whole tree (within the tokens left)
    c = TreeController(depth=4, adaptive=False, t_plain=0.05)
    assert c.choose(limit=100) == 4 and c.choose(limit=2) == 2


def test_adaptive_tree_decoding_stays_lossless(tiny_target):
    torch.manual_seed(0)
    head = EagleHead(tiny_target, Eagle1Config()).eval()
    prop = head.proposer(DecodeSettings(tree="dynamic", depth=3, top_k=3, total_tokens=8))
    dec = SpeculativeDecoder(tiny_target, prop, Sampling(), gamma=3, adaptive=True)
    assert dec.generate(PROMPT, 48) == ar_greedy(tiny_target, PROMPT, 48)


@pytest.mark.parametrize("runner", RUNNERS)
@pytest.mark.parametrize("attn", ["eager", "sdpa"])
def test_tree_forward_equals_each_branch_alone(attn, runner):
    """The target's logits at every node of a verified tree are those of a plain forward over
    the prompt and that node's path: the tree mask hides every other branch, under eager
    attention too (which adds a boolean mask as a 0/1 bias and so masks nothing), and on every
    target runner."""
    model, tok = build_tiny_target(seed=0)
    model.set_attn_implementation(attn)
    target = Target(model.eval(), tok, f"tiny-{attn}", TargetConfig(name="tiny_random"))
    prompt = PROMPT[:10]
    prop = Proposal([40, 41, 42, 43, 44, 45], [-1, -1, 0, 0, 1, 2])
    run = make_runner(runner, target)
    run.prefill(prompt[:-1])
    logits, _ = run.forward(Layout(prompt[-1], prop))
    for node in range(-1, len(prop)):
        path, a = [], node
        while a >= 0:
            path.insert(0, prop.tokens[a])
            a = prop.parents[a]
        with torch.no_grad():
            ref = model(torch.tensor([prompt + path])).logits[0, -1]
        assert torch.allclose(logits[node + 1], ref, atol=1e-4), (attn, node)


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
def test_tree_decoding_is_lossless_with_every_attention_implementation(attn):
    """Tree verification must mask what it means to mask under any attention function: a
    boolean 4D mask is added as a 0/1 bias by eager attention (masking nothing), so the decoder
    hands the target an additive mask. EAGLE's own tree drafting is covered the same way."""
    model, tok = build_tiny_target(seed=3)
    model.set_attn_implementation(attn)
    target = Target(model.eval(), tok, f"tiny-{attn}", TargetConfig(name="tiny_random"))
    for seed in range(5):
        torch.manual_seed(seed)
        prompt = PROMPT[: 8 + seed]
        ref = ar_greedy(target, prompt, 30)
        tree = SpeculativeDecoder(
            target, OracleTree(ref, len(prompt), seed=seed), Sampling(), gamma=3, adaptive=False
        )
        assert tree.generate(prompt, 30) == ref, (attn, seed, "oracle tree")
        head = EagleHead(target, Eagle1Config())
        dec = SpeculativeDecoder(
            target,
            head.proposer(DecodeSettings(tree="dynamic", depth=3, top_k=3, total_tokens=8)),
            Sampling(),
            gamma=3,
            adaptive=False,
        )
        assert dec.generate(prompt, 30) == ref, (attn, seed, "eagle tree")


@pytest.mark.parametrize("tree", ["chain", "dynamic"])
def test_eagle_proposers_start_from_a_one_token_prompt(tiny_target, tree):
    """A one-token prompt has no prefill, so no features: the first step is a plain one."""
    prop = EagleHead(tiny_target, Eagle1Config()).proposer(
        DecodeSettings(tree=tree, depth=3, top_k=3)
    )
    dec = SpeculativeDecoder(tiny_target, prop, Sampling(), gamma=3, adaptive=False)
    assert dec.generate(PROMPT[:1], 16) == ar_greedy(tiny_target, PROMPT[:1], 16)
    assert sum(dec.stats.drafted.values()) > 0  # it drafted once a feature existed


@pytest.mark.parametrize(
    "kwargs,needle",
    [
        ({"top_p": 0.0}, "top_p=0.0"),
        ({"top_p": 1.5}, "top_p=1.5"),
        ({"temperature": -1.0}, "temperature=-1.0"),
        ({"top_k": -2}, "top_k=-2"),
        ({"temperature": float("nan")}, "temperature=nan"),
    ],
)
def test_out_of_range_sampling_settings_are_refused(kwargs, needle):
    with pytest.raises(ValueError, match=needle.replace(".", r"\.")):
        Sampling(**kwargs)


def test_lenience_accepts_more_and_says_how_far_it_moves(small_vocab_pair):
    """lenience < 1 (lossy): at T = 0 more drafted tokens are accepted than with exact
    verification and the accepted ones that are not the target's argmax are counted; at T > 0
    the per-token TVD from the target is measured. l = 1 is exact. (The 10-token pair: a tiny
    random target over the full vocabulary repeats its last token, which any draft guesses.)"""
    target, other = small_vocab_pair
    prompt = [1, 2, 3]
    runs = {}
    for len_ in (1.0, 0.1):
        dec = SpeculativeDecoder(
            target, DraftLMProposer(other), Sampling(), gamma=3, adaptive=False, lenience=len_
        )
        out = dec.generate(prompt, 48)
        runs[len_] = (out, dec.stats)
    assert runs[1.0][0] == ar_greedy(target, prompt, 48) and runs[1.0][1].off_argmax == 0
    exact, lenient = runs[1.0][1], runs[0.1][1]
    assert lenient.alpha > exact.alpha and lenient.off_argmax > 0
    dec = SpeculativeDecoder(
        target,
        DraftLMProposer(other),
        Sampling(1.0),
        gamma=3,
        adaptive=False,
        seed=1,
        lenience=0.3,
    )
    dec.generate(prompt, 48)
    assert dec.stats.tvd_tokens == dec.stats.new_tokens and dec.stats.mean_tvd > 0


@pytest.mark.parametrize(
    "kwargs,needle",
    [
        ({"lenience": 0.0}, "lenience=0.0"),
        ({"lenience": 1.5}, "lenience=1.5"),
        ({"lenience": 0.5, "acceptance": "typical"}, "two lossy"),
    ],
)
def test_out_of_range_lenience_is_refused(tiny_target, kwargs, needle):
    with pytest.raises(ValueError, match=needle):
        SpeculativeDecoder(tiny_target, NGramProposer(), Sampling(1.0), gamma=2, **kwargs)


def test_lenience_with_trees_at_t_above_zero_is_refused(tiny_target):
    prop = EagleHead(tiny_target, Eagle1Config()).proposer(
        DecodeSettings(tree="dynamic", depth=2, top_k=2, total_tokens=4)
    )
    with pytest.raises(ValueError, match="tree=chain"):
        SpeculativeDecoder(tiny_target, prop, Sampling(1.0), gamma=2, lenience=0.5)


@pytest.mark.parametrize(
    "keep", [[0, 2, 5], [0, 1, 2], [3], [0, 4, 1]], ids=["branch", "prefix", "one", "unordered"]
)
def test_keep_cache_positions_keeps_the_context_and_the_path_in_order(keep):
    from transformers import DynamicCache

    from decoding.runner import keep_cache_positions

    start, n = 4, 6  # 4 committed entries, then a verified tree of 6
    cache = DynamicCache()
    for layer in range(2):
        k = torch.arange(start + n, dtype=torch.float32).view(1, 1, -1, 1).expand(1, 2, -1, 3)
        cache.update(k.clone() + 100 * layer, -k.clone(), layer)
    keep_cache_positions(cache, start, keep)
    want = list(range(start)) + [start + i for i in keep]
    assert cache.get_seq_length() == len(want)
    for layer_idx, layer in enumerate(cache.layers):
        assert layer.keys[0, 1, :, 2].tolist() == [w + 100 * layer_idx for w in want]
        assert layer.values[0, 0, :, 0].tolist() == [-w for w in want]
