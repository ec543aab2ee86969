"""The decoder's fixed-shape path: the lean forward over a static cache
gives transformers' logits and features, its cache surgery keeps the accepted path, the graph
path's padded widths change nothing, and ``compile=`` picks and reports a runner."""

from __future__ import annotations

import pytest
import torch
from conftest import COMPILE, TEST_DEVICE, every_third_eagle3, family_target, make_runner
from transformers import DynamicCache

from decoding.decoder import NoDraft, SpeculativeDecoder
from decoding.runner import (
    HFRunner,
    Layout,
    RunnerError,
    StaticRunner,
    choose_runner,
)
from models.base import Proposal, cache_kw
from models.lean import LeanDecoder, StaticKV, lean_support, visible_columns
from models.sampling import Sampling
from models.target import Target, TargetConfig

PROMPT = [257, 72, 101, 108, 108, 111, 32, 72, 101, 108, 108, 111, 32, 119, 111, 114, 108, 100]


@pytest.fixture(scope="module")
def smollm2_target():
    from models.target import load_target

    return load_target(TargetConfig(name="smollm2_135m", device="cpu", dtype="bfloat16"))


def _tiny(kind: str, seed: int = 0):
    """A random 2-layer model of ``kind`` (hidden 64, 4 query / 2 kv heads), float32."""
    import transformers as tr

    common = dict(
        vocab_size=300,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
    )
    cfgs = {
        "llama": lambda: tr.LlamaConfig(**common, tie_word_embeddings=True),
        "qwen2": lambda: tr.Qwen2Config(**common, tie_word_embeddings=False),
        "qwen3": lambda: tr.Qwen3Config(**common, head_dim=16),
        "mistral": lambda: tr.MistralConfig(**common, sliding_window=None),
        # windows of 6 columns: the test's 17 tokens cross them
        "mistral_window": lambda: tr.MistralConfig(**common, sliding_window=6),
        "gemma": lambda: tr.GemmaConfig(**common, head_dim=16),
        "gemma2": lambda: tr.Gemma2Config(
            **common,
            head_dim=16,
            query_pre_attn_scalar=24,
            sliding_window=6,
            attn_logit_softcapping=5.0,
            final_logit_softcapping=3.0,
        ),
        "gemma3": lambda: tr.Gemma3TextConfig(
            **common,
            head_dim=16,
            query_pre_attn_scalar=24,
            sliding_window=6,
            layer_types=["sliding_attention", "sliding_attention", "full_attention"],
        ),
        "olmo2": lambda: tr.Olmo2Config(**common),
        "phi3": lambda: tr.Phi3Config(**common, partial_rotary_factor=0.5, pad_token_id=0),
        # LongRoPE past an original context of 8 positions (Phi-3-mini-128k's scheme)
        "phi3_longrope": lambda: tr.Phi3Config(
            **common,
            pad_token_id=0,
            original_max_position_embeddings=8,
            rope_parameters={
                "rope_type": "longrope",
                "rope_theta": 10000.0,
                "original_max_position_embeddings": 8,
                "short_factor": [1.0 + 0.1 * i for i in range(8)],
                "long_factor": [2.0 + 0.5 * i for i in range(8)],
            },
        ),
        # 4 experts, 2 a token: one token gathers its experts' weights, more run every expert
        "qwen3_moe": lambda: tr.Qwen3MoeConfig(
            **common,
            head_dim=16,
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            norm_topk_prob=False,
            mlp_only_layers=[1],
        ),
        "mixtral": lambda: tr.MixtralConfig(**common, num_local_experts=4, num_experts_per_tok=2),
        "gpt2": lambda: tr.GPT2Config(vocab_size=300, n_embd=64, n_layer=2, n_head=4),
    }
    cfg = cfgs[kind]()
    cfg._attn_implementation = "eager" if kind == "gemma2" else "sdpa"  # Gemma-2: soft-capping
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = tr.AutoModelForCausalLM.from_config(cfg)
        # biases that are not zero, where the architecture has them (Qwen2's q/k/v)
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.data.normal_(0, 0.5)
            if "norm" in name:
                p.data.uniform_(0.5, 1.5)
    return model.eval()


def _causal(n: int) -> torch.Tensor:
    return torch.tril(torch.ones(1, n, n, dtype=torch.bool))


def _lean_logits(lean: LeanDecoder, ids: list[int], base: int, states=()):
    n = len(ids)
    mask = visible_columns(torch.tensor(base), _causal(n), n, base + n)
    return lean.forward(
        torch.tensor([ids]),
        torch.arange(base, base + n)[None],
        torch.arange(base, base + n),
        mask,
        states,
    )


#: one tiny model of each layer the lean forward computes (models.lean_layers.ARCHS), and Mistral
#: with a window the test's tokens cross
LEAN_KINDS = ["llama", "qwen2", "qwen3", "mistral", "mistral_window", "gemma", "gemma2"]
LEAN_KINDS += ["gemma3", "olmo2", "phi3", "qwen3_moe", "mixtral"]


@pytest.mark.parametrize(
    "kind,fixed", [(k, False) for k in LEAN_KINDS] + [("qwen3_moe", True), ("mixtral", True)]
)
@torch.no_grad()
def test_lean_forward_gives_transformers_logits_step_by_step(kind, fixed):
    """Prefill, then one and then three tokens at a time: every logit row equals transformers'
    over its DynamicCache, and the hidden states at the first, a middle and the last index equal
    ``output_hidden_states``. Sliding-window layers (6 columns here) are crossed by the
    prompt and by every step after it. Routed experts both ways: transformers' loop, and on
    fixed shapes (``fixed``: the chosen experts gathered for one token, every expert for
    more)."""
    model = _tiny(kind)
    assert lean_support(model) is None
    lean = LeanDecoder(model, max_len=128, fixed_shapes=fixed)
    ids = PROMPT[:12]
    cache = DynamicCache(config=model.config)
    out = model(
        torch.tensor([ids]), **cache_kw(model, cache), use_cache=True, output_hidden_states=True
    )
    got, feats = _lean_logits(lean, ids, 0, states=(1, 2, 3))
    torch.testing.assert_close(got[0], out.logits[0], atol=1e-5, rtol=1e-5)
    for i, j in enumerate((1, 2, 3)):
        torch.testing.assert_close(feats[0, :, i], out.hidden_states[j][0], atol=1e-5, rtol=1e-5)
    base = len(ids)
    for step in ([5], [6, 7, 8], [9]):
        ref = model(torch.tensor([step]), **cache_kw(model, cache), use_cache=True).logits[0]
        got, _ = _lean_logits(lean, step, base)
        torch.testing.assert_close(got[0], ref, atol=1e-5, rtol=1e-5)
        base += len(step)


@torch.no_grad()
def test_an_activation_the_lean_forward_does_not_compute_is_named():
    """The activation is read from the MLP module, as the family's forward calls it: one the
    lean forward does not compute (GPT-2's tanh formula, ``gelu_new``) is refused by name."""
    import transformers as tr

    cfg = tr.Phi3Config(
        vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
        num_attention_heads=4, pad_token_id=0, hidden_act="gelu_new",
    )  # fmt: skip
    model = tr.AutoModelForCausalLM.from_config(cfg)
    why = lean_support(model)
    assert why is not None and "'NewGELUActivation'" in why and "gelu_pytorch_tanh" in why, why
    with pytest.raises(ValueError, match="NewGELUActivation"):
        LeanDecoder(model, max_len=16)


@torch.no_grad()
def test_longrope_turns_to_its_long_factors_where_transformers_does():
    """LongRoPE rotates a forward's tokens with the short factors while its last position is
    within the original context (8 here), else with the long ones, keys already cached keeping
    theirs: the lean forward step by step across it, and a graph-width runner whose padding
    sits past the real tokens (a padded forward must not turn early), equal transformers'."""
    model = _tiny("phi3_longrope")
    assert lean_support(model) is None
    lean = LeanDecoder(model, max_len=64)
    cache = DynamicCache(config=model.config)
    base = 0
    for step in (PROMPT[:5], [5], [6, 7], [8, 9, 10], [11]):  # last positions 4, 5, 7, 10, 11
        ref = model(torch.tensor([step]), **cache_kw(model, cache), use_cache=True).logits[0]
        got, _ = _lean_logits(lean, step, base)
        torch.testing.assert_close(got[0], ref, atol=1e-5, rtol=1e-5)
        base += len(step)
    target = Target(model, None, "tiny-phi3-longrope", TargetConfig(name="hf"))
    ref, run = make_runner("transformers", target), make_runner("graphs", target, widths=(1, 8))
    for r in (ref, run):
        r.prefill(PROMPT[:4])
    for lay in (  # a chain of 3 ending at position 7, padded to 8 (padding up to position 11)
        Layout(PROMPT[4], Proposal.chain([5, 6, 7])),
        Layout(8, Proposal.chain([9])),  # now past the original context
    ):
        torch.testing.assert_close(run.forward(lay)[0], ref.forward(lay)[0], atol=1e-5, rtol=1e-5)
        for r in (ref, run):
            r.commit(list(range(len(lay))))


@torch.no_grad()
def test_lean_forward_on_the_embedded_target_within_bf16_rounding(smollm2_target):
    """The embedded SmolLM2 in its own dtype: the prompt's logits are transformers' bit for bit
    (the same ops in the same order), the next tokens' within bf16 rounding of a 30-layer
    model, with the same argmax."""
    t = smollm2_target
    ids = torch.randint(0, t.config.vocab_size, (1, 48), generator=torch.Generator().manual_seed(0))
    cache = DynamicCache(config=t.config)
    ref = t.model(ids[:, :40], **cache_kw(t.model, cache), use_cache=True).logits[0]
    lean = LeanDecoder(t.model, max_len=128)
    got, _ = _lean_logits(lean, ids[0, :40].tolist(), 0)
    assert torch.equal(got[0], ref)
    ref2 = t.model(ids[:, 40:], **cache_kw(t.model, cache), use_cache=True).logits[0].float()
    got2 = _lean_logits(lean, ids[0, 40:].tolist(), 40)[0][0].float()
    assert (got2 - ref2).abs().max() < 1.0  # bf16: logits of ~20 carry ~0.1 of rounding
    assert torch.equal(got2.argmax(-1), ref2.argmax(-1))


@pytest.mark.parametrize("keep", [[0, 2, 5], [0, 1, 2], [3], [0, 4, 1]])
def test_static_cache_move_keeps_the_context_and_the_path_in_order(keep):
    start = 4  # committed entries; a tree of 6 after them
    kv = StaticKV(
        layers=2, batch=1, kv_heads=2, max_len=16, head_dim=3, dtype=torch.float32, device="cpu"
    )
    col = torch.arange(16, dtype=torch.float32)
    kv.kv[:] = col.view(1, 1, 1, 1, 16, 1)
    kv.kv[1] += 100  # layer 1 differs
    kv.kv[:, 1] *= -1  # values differ from keys
    kv.move(start, torch.tensor(keep))
    want = list(range(start)) + [start + i for i in keep]
    m = len(want)
    assert kv.kv[0, 0, 0, 1, :m, 2].tolist() == want
    assert kv.kv[1, 0, 0, 0, :m, 0].tolist() == [w + 100 for w in want]
    assert kv.kv[1, 1, 0, 1, :m, 1].tolist() == [-(w + 100) for w in want]


@pytest.mark.parametrize("kind", ["static", "graphs"])
@torch.no_grad()
def test_static_runners_give_transformers_logits_for_chains_trees_and_rollbacks(tiny_target, kind):
    """The same proposals (a chain, then a tree whose middle branch is kept) through
    transformers' runner and a static one: equal logits and features at every node, equal
    logits after each rollback. ``graphs`` pads every forward to a fixed width over the whole
    static cache, as a captured graph does."""
    _against_transformers(tiny_target, kind, PROMPT)


def _against_transformers(target, kind: str, prompt: list[int]) -> None:
    layers = (1, -1)
    ref, run = (
        make_runner("transformers", target, layers),
        make_runner(kind, target, layers),
    )
    for r in (ref, run):
        r.prefill(prompt[:-1])
    steps = [
        (Layout(prompt[-1], Proposal.chain([5, 6, 7])), [0, 1]),
        (Layout(6, Proposal([40, 41, 42, 43, 44], [-1, -1, 0, 1, 1])), [0, 2, 5]),
        (Layout(44, Proposal.chain([])), [0]),
        (Layout(9, Proposal([1, 2, 3], [-1, -1, -1])), [0, 3]),
        (Layout(3, Proposal.chain([8])), [0, 1]),
    ]
    for lay, keep in steps:
        a_logits, a_feats = ref.forward(lay)
        b_logits, b_feats = run.forward(lay)
        torch.testing.assert_close(b_logits, a_logits, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(b_feats, a_feats, atol=1e-5, rtol=1e-5)
        for r in (ref, run):
            r.commit(keep)
        assert ref.length == run.length


#: the families whose layers the lean forward computes beyond the Llama layout's (sliding
#: windows, Gemma's norms, soft-capping and two RoPEs, OLMo-2's post-norms, Phi-3's fused
#: projections, routed experts)
LEAN_FAMILIES = ["mistral", "gemma2", "gemma3", "olmo2", "phi3", "qwen3_moe", "mixtral"]


@pytest.mark.parametrize("family", LEAN_FAMILIES)
@torch.no_grad()
def test_static_runners_give_transformers_logits_and_rows_on_each_family(family):
    """Each family's tiny target (windows of 24 columns) on the static path with fixed widths
    as a captured graph runs them: a chain, trees and rollbacks past the window give
    transformers' logits and features; a ragged batch drafting for its rows gives each row its
    greedy output (on transformers' path: tests/test_families.py)."""
    from decoding.batch import BatchDecoder
    from models.target import GenRequest

    target = family_target(family, device=TEST_DEVICE)
    assert lean_support(target.model) is None
    _against_transformers(target, "graphs", list(range(40, 70)))
    prompts = [list(range(40, 60)), list(range(70, 75)), list(range(30, 62))]
    plain = SpeculativeDecoder(target, NoDraft(), Sampling(), calibrate=False, compile="false")
    refs = [plain.generate(p, 24) for p in prompts]
    # drafts of 3 a row: 4-wide verifications
    head = every_third_eagle3(target, noise=0.5).to(target.device)
    bdec = BatchDecoder(
        target, head.proposer(), Sampling(), batch_size=3, gamma=3, compile=COMPILE["graphs"]
    )
    assert bdec.runner.kind != "transformers"
    out = bdec.run([GenRequest(i, p) for i, p in enumerate(prompts)], 24)
    assert [out[i] for i in range(3)] == refs, f"{family}: static batch != greedy output"


def test_graph_widths_pad_and_a_wider_forward_runs_eagerly(tiny_target):
    run = make_runner("graphs", tiny_target, (), widths=(1, 4))
    ref = make_runner("transformers", tiny_target, ())
    for r in (run, ref):
        r.prefill(PROMPT[:-1])
    for toks in ([5, 6], [7, 8, 9, 10, 11, 12]):  # padded to 4; wider than any graph
        lay = Layout(PROMPT[-1], Proposal.chain(toks))
        torch.testing.assert_close(run.forward(lay)[0], ref.forward(lay)[0], atol=1e-5, rtol=1e-5)
        for r in (run, ref):
            r.commit([0])


def test_static_cache_grows_when_a_sequence_needs_more(tiny_target):
    graphs = "cuda" if tiny_target.device.type == "cuda" else "emulate"
    run = StaticRunner(tiny_target, (), (1, 5), graphs=graphs, max_len=32)
    cap = run.capacity
    dec = SpeculativeDecoder(tiny_target, NoDraft(), Sampling(), calibrate=False, compile="false")
    ref = dec.generate(PROMPT, 260)
    dec.runner = run
    assert dec.generate(PROMPT, 260) == ref
    assert run.capacity > cap >= 32


def test_compile_setting_picks_a_runner_and_says_why_not():
    model = _tiny("gpt2")
    why = lean_support(model)
    assert why is not None and "gpt2" in why
    tgt = Target(model, None, "tiny-gpt2", TargetConfig(name="tiny_random"))
    assert isinstance(choose_runner("auto", tgt, NoDraft(), (), (1,)), HFRunner)
    with pytest.raises(RunnerError, match="compile=true: target: model_type 'gpt2'"):
        choose_runner("true", tgt, NoDraft(), (), (1,))
    with pytest.raises(RunnerError, match="compile='maybe'"):
        choose_runner("maybe", tgt, NoDraft(), (), (1,))


def test_the_decoder_reports_which_runner_ran(tiny_target):
    auto = SpeculativeDecoder(tiny_target, NoDraft(), Sampling(), calibrate=False)
    off = SpeculativeDecoder(tiny_target, NoDraft(), Sampling(), calibrate=False, compile="false")
    # auto: the static path, with CUDA graphs where the target is on a GPU
    want = "static+cuda-graphs" if tiny_target.device.type == "cuda" else "static"
    assert auto.runner.kind == want and off.runner.kind == "transformers"
    assert auto.generate(PROMPT, 24) == off.generate(PROMPT, 24)


def test_a_self_drafter_that_copies_the_prefill_cache_keeps_transformers_path(tiny_target):
    from decoding.streaming import StreamingDraft

    prop = StreamingDraft(tiny_target, sinks=2, window=8)
    dec = SpeculativeDecoder(tiny_target, prop, Sampling(), gamma=2, calibrate=False)
    assert dec.runner.kind == "transformers"
    with pytest.raises(ValueError, match="copies transformers' prefill cache"):
        SpeculativeDecoder(tiny_target, prop, Sampling(), gamma=2, compile="true")


def _eagle3(target, seed=0):
    from models.eagle import Eagle3Config, Eagle3Head

    torch.manual_seed(seed)
    head = Eagle3Head(target, Eagle3Config(draft_vocab_size=min(64, target.config.vocab_size)))
    with torch.no_grad():  # a random head, made confident enough to draft varied tokens
        head.lm_head.weight.mul_(8.0)
    return head.eval()


@pytest.mark.parametrize("method", ["eagle1", "eagle3"])
def test_static_eagle_chain_drafts_what_the_eager_proposer_drafts(tiny_target, method):
    """Greedy, on the same target: the fixed-shape chain (one host read per proposal) and the
    eager proposer draft the same tokens every iteration, and decoding stays lossless."""
    from models.eagle import Eagle1Config, EagleHead
    from models.eagle.static import StaticEagleChain

    torch.manual_seed(1)
    head = EagleHead(tiny_target, Eagle1Config()) if method == "eagle1" else _eagle3(tiny_target)
    head = head.to(tiny_target.device).eval()
    runs = {}
    compile = COMPILE["graphs"]  # where chains draft on fixed shapes (eager on a CPU: not)
    for mode in ("false", compile):
        dec = SpeculativeDecoder(
            tiny_target, head.proposer(), Sampling(), gamma=3, adaptive=False, compile=mode
        )
        drafted: list[list[int]] = []
        inner = dec.proposer.propose
        dec.proposer.propose = lambda s, g, inner=inner, d=drafted: (
            d.append(inner(s, g).tokens) or Proposal.chain(d[-1])
        )
        runs[mode] = (dec.generate(PROMPT, 40), drafted, type(dec.proposer))
    assert runs[compile][2] is StaticEagleChain and runs["false"][2] is not StaticEagleChain
    eager_static = SpeculativeDecoder(
        tiny_target, head.proposer(), Sampling(), gamma=3, compile="true"
    )
    assert (type(eager_static.proposer) is StaticEagleChain) == (tiny_target.device.type == "cuda")
    assert runs[compile][0] == runs["false"][0]
    assert runs[compile][1] == runs["false"][1]


@pytest.mark.parametrize("sampling_where", [True], ids=["sample_on_device"], indirect=True)
def test_static_eagle_chain_sampling_follows_the_target(small_vocab_pair, sampling_where):
    """T = 1 with the static chain's on-device inverse-CDF draws: the first two tokens follow
    the target (chi-square, false-alarm rate 1e-3), and drafts are really rejected. Its
    acceptance on the device too, as on a GPU where the static chain runs as graphs (the host's
    acceptance of a chain: test_decoder.py)."""
    from conftest import assert_first_two_tokens_follow_the_target

    from models.eagle.static import StaticEagleChain

    target, _ = small_vocab_pair
    s = Sampling(1.0)
    dec = SpeculativeDecoder(
        target,
        _eagle3(target).to(target.device).proposer(),
        s,
        gamma=3,
        adaptive=False,
        seed=3,
        compile=COMPILE["graphs"],
    )
    assert isinstance(dec.proposer, StaticEagleChain)
    assert_first_two_tokens_follow_the_target(target, dec, [1, 2, 3], s, gen=3, n=2000)
    assert 0.05 < dec.stats.alpha < 0.95


def test_static_eagle_chain_catches_up_after_idle_iterations(tiny_target):
    """More committed pairs than one graph's width (the controller decoded plain for a while):
    the older pairs are fed eagerly, the rest by the fixed-shape call; still lossless."""
    from models.eagle import Eagle1Config, EagleHead

    head = EagleHead(tiny_target, Eagle1Config()).to(tiny_target.device).eval()
    dec = SpeculativeDecoder(
        tiny_target, head.proposer(), Sampling(), gamma=2, adaptive=False, compile=COMPILE["graphs"]
    )
    gammas = iter([2, 0, 0, 0, 0, 1, 0, 0, 0, 0, 0, 0, 2] + [2] * 100)
    dec.controller.choose = lambda limit, bucket=None: min(next(gammas), limit)
    ref = SpeculativeDecoder(tiny_target, NoDraft(), Sampling(), calibrate=False, compile="false")
    assert dec.generate(PROMPT, 40) == ref.generate(PROMPT, 40)


@pytest.mark.parametrize("windowed", [False, True], ids=["full", "windowed"])
@pytest.mark.parametrize("method", ["eagle1", "eagle3"])
@torch.no_grad()
def test_static_eagle_chain_feeds_several_committed_pairs_like_the_eager_one(
    request, method, windowed
):
    """Iterations that committed 1, 4, 2 and 3 tokens (accepted drafts + the correction): after
    each, both proposers are handed the same state and draft the same chain; ``windowed``: on
    a target whose every layer attends within 8 tokens (its drafts too), crossed by the
    context."""
    from models.base import DecodeState
    from models.eagle import Eagle1Config, EagleHead
    from models.eagle.static import StaticEagleChain

    tiny_target = request.getfixturevalue("windowed_target" if windowed else "tiny_target")

    torch.manual_seed(2)
    head = EagleHead(tiny_target, Eagle1Config()) if method == "eagle1" else _eagle3(tiny_target)
    head = head.to(tiny_target.device).eval()
    seq = PROMPT + [40, 41, 42, 43, 44, 45, 46, 47, 48, 49, 50]
    ids = torch.tensor([seq], device=tiny_target.device)
    feats = tiny_target.features(ids, torch.ones_like(ids), head.feature_layers)[0]
    eager, static = head.proposer(), StaticEagleChain(head, 3, "emulate")

    def state(n):
        return DecodeState(seq[:n], feats[: n - 1], Sampling(), None, tiny_target.device)

    n = len(PROMPT)
    for p in (eager, static):
        p.start(state(n))
    for step in (1, 4, 2, 3):
        n += step
        a, b = eager.propose(state(n), 3), static.propose(state(n), 3)
        assert a.tokens == b.tokens, (step, a.tokens, b.tokens)
        for p in (eager, static):
            p.rollback(state(n), 0)


# the random EAGLE-1 head is nearly flat over the tiny target's 300 tokens: its cut is lower
@pytest.mark.parametrize(
    "method,min_prob,windowed",
    [
        ("eagle1", 0.0, False),
        ("eagle1", 0.003, False),
        ("eagle3", 0.0, False),
        ("eagle3", 0.05, False),
        ("eagle3", 0.0, True),
    ],
)
@torch.no_grad()
def test_static_eagle_tree_grows_what_the_eager_tree_grows(request, method, min_prob, windowed):
    """EAGLE-2's tree on fixed shapes (every level computed, the frontier chosen on the device,
    one host read): after iterations that committed 1, 4, 2 and 3 tokens, the same tree as the
    eager proposer's (tokens and parents), its early stop by ``min_prob`` included;
    ``windowed``: on a target whose every layer attends within 8 tokens (its drafts too)."""
    from models.base import DecodeState
    from models.eagle import Eagle1Config, EagleHead, EagleTreeProposer
    from models.eagle.static import StaticEagleTree

    tiny_target = request.getfixturevalue("windowed_target" if windowed else "tiny_target")

    torch.manual_seed(3)
    head = EagleHead(tiny_target, Eagle1Config()) if method == "eagle1" else _eagle3(tiny_target)
    head = head.to(tiny_target.device).eval()
    seq = PROMPT + [40, 41, 42, 43, 44, 45, 46, 47, 48, 49, 50]
    ids = torch.tensor([seq], device=tiny_target.device)
    feats = tiny_target.features(ids, torch.ones_like(ids), head.feature_layers)[0]
    eager = EagleTreeProposer(head, depth=4, top_k=3, total_tokens=10, min_prob=min_prob)
    static = eager.fixed_shape(4, "emulate")
    assert isinstance(static, StaticEagleTree)

    def state(n):
        return DecodeState(seq[:n], feats[: n - 1], Sampling(), None, tiny_target.device)

    def never(*a):
        raise AssertionError("a tree within the graph's depth drafted the eager way")

    static._eager_propose = never  # a shallower tree (near a reply's budget) is the graph's too
    n = len(PROMPT)
    for p in (eager, static):
        p.start(state(n))
    sizes = set()
    for step, depth in ((1, 4), (4, 2), (2, 1), (3, 4), (1, 3)):
        n += step
        a, b = eager.propose(state(n), depth), static.propose(state(n), depth)
        assert (a.tokens, a.parents) == (b.tokens, b.parents), step
        assert max(_tree_depths(b.parents), default=0) <= depth
        assert eager.last_scores == pytest.approx(static.last_scores, abs=1e-4)
        if depth == 4:  # full-depth trees: where min_prob cuts, below the budget
            sizes.add(len(a))
        for p in (eager, static):
            p.rollback(state(n), 0)
    # trees of several nodes, and where min_prob cuts, smaller than the budget
    assert max(sizes) > 1 and (min_prob == 0 or min(sizes) < 10), sizes


def _tree_depths(parents: list[int]) -> list[int]:
    d: list[int] = []
    for p in parents:
        d.append(1 if p < 0 else d[p] + 1)
    return d


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_static_eagle_tree_decodes_losslessly(tiny_target, temperature):
    """The decoder with an EAGLE-2 tree on the graph path drafts with the fixed-shape tree and
    gives plain decoding's output at T = 0; at T = 1, the same tokens as the eager tree on the
    same seed (the tree is the draft's top-k either way, verified by the same rule)."""
    from models.base import DecodeSettings
    from models.eagle import Eagle1Config, EagleHead
    from models.eagle.static import StaticEagleTree

    torch.manual_seed(4)
    head = EagleHead(tiny_target, Eagle1Config()).to(tiny_target.device).eval()
    tree = DecodeSettings(tree="dynamic", depth=3, top_k=3, total_tokens=8)
    s = Sampling(temperature)
    outs = {}
    for mode in ("true", COMPILE["graphs"]):
        dec = SpeculativeDecoder(
            tiny_target, head.proposer(tree), s, gamma=3, adaptive=False, seed=5, compile=mode
        )
        if mode != "true":
            assert isinstance(dec.proposer, StaticEagleTree)
        outs[mode] = dec.generate(PROMPT, 40)
    assert outs["true"] == outs[COMPILE["graphs"]]
    if temperature == 0:
        ref = SpeculativeDecoder(tiny_target, NoDraft(), s, calibrate=False, compile="false")
        assert outs["true"] == ref.generate(PROMPT, 40)


def test_graph_discipline_names_what_a_cuda_graph_cannot_hold():
    """The emulated graph path runs its functions under a check (``Captured(emulate=True)``):
    a host read (``.item()``, or indexing with a 0-dim tensor, which broke the T > 0 EAGLE
    chain's first capture on an H100), a data-dependent shape or a tensor built from host data
    is refused on a CPU with the op named; the same function without them runs."""
    from models.lean import Captured, CaptureError

    t = torch.arange(10.0)
    j = torch.tensor(3)
    bad = {
        "_local_scalar_dense": lambda: t[j],
        "nonzero": lambda: t[t > 3],
        "lift_fresh": lambda: t + torch.tensor([1.0]),
    }
    for op, fn in bad.items():
        with pytest.raises(CaptureError, match=op):
            Captured(fn, emulate=True)()
    good = Captured(lambda: t.index_select(0, j.view(1)) + t.masked_fill(t > 3, 0).sum(), True)
    assert good().tolist() == [9.0]


def test_graph_discipline_checks_the_capture_runs_then_a_sample_of_later_calls():
    """The check runs on the first three calls (what a capture runs) and then on about one in
    eight: a function that starts reading a device value on the host after its capture runs
    is still caught within a few dozen calls, and clean calls are not all checked."""
    from models.lean import Captured, CaptureError

    t = torch.arange(10.0)
    clean = Captured(lambda: t * 2, emulate=True)
    for _ in range(400):
        clean()
    assert clean.checked >= Captured.CHECKED_FIRST
    assert 20 <= clean.checked - Captured.CHECKED_FIRST <= 80  # ~397 / 8 of the later calls

    calls = [0]

    def turns_bad():
        calls[0] += 1
        return t * 2 if calls[0] <= 10 else t * t[3].item()

    late = Captured(turns_bad, emulate=True)
    with pytest.raises(CaptureError, match="_local_scalar_dense"):
        for _ in range(200):
            late()
    assert 10 < calls[0] < 200


#: every branch of the layer functions: the three norm kinds and placements, per-head and
#: per-projection q/k norms, fused projections, both activations, routed experts
@pytest.mark.parametrize("kind", ["gemma3", "olmo2", "phi3", "qwen3_moe"])
@torch.no_grad()
def test_fused_layers_give_the_plain_layers_logits(kind):
    """``LeanDecoder(fuse=True)``: the layer functions compiled by torch.compile (inductor's C++
    kernels here, Triton's on a GPU) give the uncompiled ones' logits and features within
    float32 rounding, at a fixed width after a prefill."""
    model = _tiny(kind)
    plain, fused = LeanDecoder(model, max_len=64), LeanDecoder(model, max_len=64, fuse=True)
    ids = PROMPT[:8]
    for lean in (plain, fused):  # the same prefill into each cache, exact shapes
        _lean_logits(lean, ids, 0)
    step = [5, 6, 7]
    mask = visible_columns(torch.tensor(8), _causal(3), 3, 64)
    args = (torch.tensor([step]), torch.arange(8, 11)[None], torch.arange(8, 11), mask, (1, 2))
    want, want_f = plain.forward(*args)
    got, got_f = fused.forward(*args)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got_f, want_f, atol=1e-5, rtol=1e-5)


def test_compile_fused_decodes_exactly(tiny_target):
    """``compile=fused``: the runner says so, and greedy decoding with a drafter equals plain
    decoding on transformers' path."""
    from models.draft_lm import DraftLMProposer

    fused = SpeculativeDecoder(
        tiny_target,
        DraftLMProposer(tiny_target.truncated(1)),
        Sampling(),
        gamma=3,
        adaptive=False,
        compile="fused",
    )
    assert fused.runner.kind.endswith("+fused")
    ref = SpeculativeDecoder(tiny_target, NoDraft(), Sampling(), calibrate=False, compile="false")
    assert fused.generate(PROMPT, 24) == ref.generate(PROMPT, 24)


def test_a_prefill_is_padded_to_a_graph_width_where_graphs_run(tiny_target):
    """A 40-token prompt is prefilled through the 64-wide prefill graph (features only): its
    features, and the logits of the next forward over that cache, are transformers'; padding
    writes nothing a later query sees."""
    layers = (1, -1)
    run = make_runner("graphs", tiny_target, layers)
    ref = make_runner("transformers", tiny_target, layers)
    assert 64 in run._prefills
    used = []
    graph = run._prefills[64]
    run._prefills[64] = lambda base, lay: used.append(len(lay)) or graph(base, lay)
    prompt = (PROMPT * 3)[:40]
    got, want = run.prefill(prompt), ref.prefill(prompt)
    assert used == [40]
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    lay = Layout(7, Proposal.chain([8, 9]))
    torch.testing.assert_close(run.forward(lay)[0], ref.forward(lay)[0], atol=1e-5, rtol=1e-5)


def test_the_shaped_benchmark_times_a_one_token_forward_in_its_parts(tmp_path):
    """``bench_compiled.py --parts shaped`` (the 8B-shaped target's costs, run on a GPU) on a
    small Llama shape on the CPU: every projection kind, the attention and the LM head timed
    over every layer with the bytes each reads, their sum beside the whole forward."""
    import json
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
    import bench_compiled

    cfg = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "num_hidden_layers": 2,
        "vocab_size": 256,
        "max_position_embeddings": 1024,
        "tie_word_embeddings": False,
    }
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    res = bench_compiled.part_shaped("cpu", 1, str(tmp_path))
    parts = res["one_token_forward_in_parts"]
    kinds = [*bench_compiled.PROJECTIONS, "attention", "lm_head"]
    assert sorted(parts["ms"]) == sorted(kinds) and all(parts["ms"][k] > 0 for k in kinds)
    # bf16 weights: q (64 x 64) and down (64 x 128) of each of the 2 layers; the LM head once;
    # the attention reads both layers' keys and values over the cache's 768 columns
    assert parts["GB_read"]["q_proj"] == pytest.approx(2 * 64 * 64 * 2 / 1e9)
    assert parts["GB_read"]["down_proj"] == pytest.approx(2 * 64 * 128 * 2 / 1e9)
    assert parts["GB_read"]["lm_head"] == pytest.approx(256 * 64 * 2 / 1e9)
    assert parts["context_columns"] == 768
    assert parts["GB_read"]["attention"] == pytest.approx(2 * 2 * 2 * 768 * 16 * 2 / 1e9)
    assert parts["forward_ms"] == res["forward_ms"][1]
    assert parts["rest_ms"] == pytest.approx(parts["forward_ms"] - parts["sum_ms"])


@pytest.mark.parametrize(
    "model_type,extra",
    [("mixtral", {"num_local_experts": 4, "num_experts_per_tok": 2}), ("gpt2", {})],
)
def test_the_family_benchmark_times_both_paths_or_says_why_not(tmp_path, model_type, extra):
    """``bench_compiled.py --parts family`` on a tiny config of an architecture: a forward's ms
    at each width on both paths where the static path computes it, its one-line reason where
    not; the config's layers cut to the number asked."""
    import json
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
    import bench_compiled

    cfg = {"model_type": model_type, "vocab_size": 256, "num_hidden_layers": 3, **extra}
    if model_type == "gpt2":
        cfg.update(n_embd=64, n_head=4)
    else:
        cfg.update(hidden_size=64, intermediate_size=128, num_attention_heads=4)
        cfg.update(num_key_value_heads=2, max_position_embeddings=1024)
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    res = bench_compiled.part_family("cpu", 1, str(tmp_path), layers=2, widths=(1, 4))
    assert res["layers"] == 2
    if model_type == "gpt2":
        assert "model_type 'gpt2'" in res["static_path"]
        assert list(res["forward_ms"]) == ["transformers"]
    else:
        assert res["static_path"] == "eager"
        assert all(res["forward_ms"][r][w] > 0 for r in ("transformers", "static") for w in (1, 4))
        assert set(res["static_over_transformers"]) == {1, 4}


# -- a draft LM (DistillSpec students, truncate:N, HF drafts) on the static path ----------------


#: a static draft LM's graphs: captured on CUDA, their fixed shapes run eagerly on a CPU
DRAFT_GRAPHS = "cuda" if TEST_DEVICE.startswith("cuda") else "emulate"


@pytest.mark.parametrize("graphs", ["off", DRAFT_GRAPHS])
@pytest.mark.parametrize("s", [Sampling(), Sampling(0.9, top_k=8)], ids=["T0", "T0.9-k8"])
@torch.no_grad()
def test_static_draft_lm_proposes_what_transformers_forward_proposes(tiny_target, graphs, s):
    """Iterations that committed 1 to 6 tokens (accepted drafts + the correction; 6: more than a
    captured catch-up) drafting 1 to 5 (past the longest captured: the eager steps): handed the
    same states and random streams, the static draft LM and transformers' draft the same
    tokens with the same q; a proposal asking for signals (DISCO) takes the eager steps on the
    static cache and gives the same signals."""
    from models.base import DecodeState
    from models.draft_lm import DraftLMProposer
    from models.draft_lm.static import StaticDraftLM

    model = tiny_target.truncated(1)
    eager = DraftLMProposer(model, tiny_target.config.vocab_size)
    static = eager.fixed_shape(3, graphs)
    assert isinstance(static, StaticDraftLM) and static.graphs == graphs
    seq = PROMPT + [40 + i for i in range(40)]
    dev = tiny_target.device
    gens = [torch.Generator(device=dev).manual_seed(7) for _ in range(2)]

    def state(n, g, signals=False):
        return DecodeState(seq[:n], None, s, g, dev, signals=signals)

    n = len(PROMPT)
    for p, g in zip((eager, static), gens, strict=True):
        p.start(state(n, g))
    for step, gamma, accept, signals in [
        (1, 3, 2, False),
        (3, 1, 1, False),
        (6, 2, 0, False),  # 2 after the last proposal, 4 more decoded without drafting
        (1, 5, 3, False),
        (4, 3, 3, True),
        (4, 3, 1, False),
    ]:
        n += step
        a, b = (
            p.propose(state(n, g, signals), gamma)
            for p, g in zip((eager, static), gens, strict=True)
        )
        assert a.tokens == b.tokens and len(a.tokens) == gamma, (step, a.tokens, b.tokens)
        if not s.greedy:
            torch.testing.assert_close(b.q, a.q, atol=1e-5, rtol=1e-5)
        if signals:
            torch.testing.assert_close(b.signals, a.signals, atol=1e-5, rtol=1e-5)
        for p in (eager, static):
            p.rollback(state(n, None), accept)
        assert static.fed == eager.fed


@pytest.mark.parametrize("kind", ["static", "graphs"])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_the_decoder_drafts_with_a_draft_lm_on_the_static_path(tiny_target, kind, temperature):
    """``compile=true`` (a CPU: eager) and the graph path: a draft LM decodes on the lean
    forward, through iterations that skip drafting (catch-ups past a captured width), to the
    tokens and acceptance transformers' path gives, greedy and seeded at T = 1."""
    from models.draft_lm import DraftLMProposer
    from models.draft_lm.static import StaticDraftLM

    s = Sampling(temperature)
    out, alpha = {}, {}
    for mode in ("false", COMPILE[kind]):
        model = tiny_target.truncated(1)
        dec = SpeculativeDecoder(
            tiny_target, DraftLMProposer(model), s, gamma=3, adaptive=False, seed=3, compile=mode
        )
        gammas = iter([3, 0, 0, 0, 1, 0, 0, 3, 2] + [3] * 100)
        dec.controller.choose = lambda limit, bucket=None, it=gammas: min(next(it), limit)
        assert isinstance(dec.proposer, StaticDraftLM) == (mode != "false")
        out[mode] = [dec.generate(PROMPT, 40), dec.generate(PROMPT[:5], 12)]
        alpha[mode] = dec.stats.alpha
    assert out["false"] == out[COMPILE[kind]]
    assert alpha["false"] == pytest.approx(alpha[COMPILE[kind]])


def test_a_draft_lm_the_lean_forward_does_not_compute_keeps_transformers_forward():
    """A GPT-OSS draft (attention sinks): no static path for it, the eager proposer stays."""
    from models.draft_lm import DraftLMProposer

    draft = DraftLMProposer(family_target("gpt_oss").model)
    assert lean_support(draft.model) is not None
    assert draft.fixed_shape(3, "off") is None


@torch.no_grad()
def test_a_static_draft_lm_grows_its_cache_for_a_long_prompt(tiny_target):
    """A prompt past the columns allocated: ``start`` grows the cache, proposals still match."""
    from models.base import DecodeState
    from models.draft_lm import DraftLMProposer
    from models.draft_lm.static import StaticDraftLM

    model = tiny_target.truncated(1)
    static = StaticDraftLM(model, gamma_max=2, graphs=DRAFT_GRAPHS, max_len=16)
    small = static.capacity
    seq = (PROMPT * 20)[:300]
    st = DecodeState(seq, None, Sampling(), None, tiny_target.device)
    eager = DraftLMProposer(model)
    for p in (eager, static):
        p.start(st)
    assert static.capacity >= 300 > small
    assert static.propose(st, 2).tokens == eager.propose(st, 2).tokens
    assert static.fresh().lean is not static.lean  # another row's proposer: its own cache
    with pytest.raises(ValueError, match="past its static cache"):
        static._step(list(range(static.capacity)), tiny_target.device)
