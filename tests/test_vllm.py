"""vLLM as the engine: the worker protocol and the evaluator's handling of it (always, with a
stand-in worker), and, where vLLM is installed (`bash scripts/install.sh vllm`), every export
format vLLM serves loaded and decoding in vLLM, and `specdraft-eval engine=vllm` on the
embedded target with the shipped head, its acceptance beside the built-in decoder's."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from conftest import (
    ROOT,
    accepting_block_draft,
    needs_vllm,
    our_acceptance,
    run_module,
    vllm_acceptance,
)

from decoding.engines.base import EngineError, steps_from_positions


def test_steps_from_positions_rebuild_the_accepted_lengths():
    # 5 verifications of 3: accepted lengths 0, 1, 1, 2, 3 -> per position 4, 2, 1
    steps = steps_from_positions(5, 3, [4, 2, 1])
    assert sorted(a for a, _ in steps) == [0, 1, 1, 2, 3]
    assert all(d == 3 for _, d in steps)
    assert steps_from_positions(2, 2, []) == [(0, 2), (0, 2)]


def test_the_engine_is_flagged_where_it_accepts_far_less_than_ours_predicts():
    """400 drafts of 3: an engine accepting 0.02 at position 1 where ours predicts 0.45 under
    the same rule is the engine's, and so is one that accepts position 1 but never position 2
    (what vLLM 0.32's CPU build does at T = 1); 0.43 is within the noise."""
    from decoding.engines.base import EngineStats, engine_flag

    def pooled(per_pos: list[int]) -> EngineStats:
        st = EngineStats()
        st.steps = steps_from_positions(400, 3, per_pos)
        return st

    ours = {"alpha_per_position": [0.45, 0.4, 0.4]}
    assert "position 1 where" in engine_flag(ours, pooled([8, 3, 1]))
    assert "position 2 where" in engine_flag(ours, pooled([180, 0, 0]))
    assert engine_flag(ours, pooled([172, 70, 28])) is None


def test_a_format_vllm_does_not_serve_is_refused_in_one_line(tmp_path):
    from decoding.engines.vllm_eval import speculative_config

    with pytest.raises(EngineError, match=r"a gguf export; vLLM .* serves .*speculators"):
        speculative_config(tmp_path, "gguf", 3)


@pytest.mark.slow
def test_an_engine_format_of_another_method_is_refused_by_its_key():
    """``engine_format=`` naming another method's layout is refused before anything is
    exported, by the key the user typed (it said ``--format``, the export command's flag)."""
    from omegaconf import OmegaConf

    from decoding.engines.vllm_eval import vllm_draft
    from models.target import TargetConfig, load_target

    target = load_target(TargetConfig())
    cfg = OmegaConf.create(
        {
            "draft": "smollm2-eagle3",
            "engine_format": "medusa-vllm",
            "gamma": 3,
            "engine_rule": "greedy_draft",
            "ngram_max": 3,
        }
    )
    with pytest.raises(EngineError) as e:
        vllm_draft(cfg, target, print)
    assert str(e.value) == (
        "draft=smollm2-eagle3: engine_format=medusa-vllm exports medusa1 or medusa2 drafts; this "
        "is eagle3 (leave engine_format unset: vllm)"
    )


def test_engine_vllm_without_vllm_says_how_to_install_it(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECDRAFT_VLLM_PYTHON", str(tmp_path / "no-such-python"))
    r = run_module(
        "decoding.eval",
        [
            "engine=vllm",
            "target=tiny_random",
            "draft=ngram",
            "num_prompts=1",
            f"report={tmp_path / 'r.json'}",
        ],
    )
    assert r.returncode == 2
    (line,) = [x for x in r.stderr.splitlines() if x.startswith("error:")]
    assert "bash scripts/install.sh vllm" in line
    assert not (tmp_path / "r.json").exists()


FAKE_WORKER = textwrap.dedent(
    """
    import json, sys, time
    out = sys.stdout
    served = 0
    for line in sys.stdin:
        msg = json.loads(line)
        if msg["cmd"] == "init":
            spec = msg["llm"].get("speculative_config")
            out.write(json.dumps({"vllm": "0.0-fake", "seconds": 0.0}) + "\\n")
        elif msg["cmd"] == "exit":
            out.write(json.dumps({"bye": True}) + "\\n"); break
        else:
            n = msg["params"]["max_tokens"]
            served += 1
            if spec and served > DIE_AFTER:
                print("RuntimeError: the fake engine ran out of memory", file=sys.stderr)
                sys.exit(3)
            t = time.monotonic()
            spec_c = {"drafts": n // 2, "draft_tokens": 2 * (n // 2), "accepted": n // 2,
                      "accepted_per_pos": [n // 2, 0]} if spec else None
            o = {"tokens": [40 + (i % 7) for i in range(n)], "first_token_ts": t,
                 "last_token_ts": t + 0.001 * (n - 1), "finish_reason": "length", "logprobs": None}
            out.write(json.dumps({"outputs": [o], "seconds": 0.01, "spec": spec_c}) + "\\n")
        out.flush()
    """
)


def _fake_vllm(tmp_path: Path, die_after: int) -> Path:
    worker = tmp_path / "fake_worker.py"
    worker.write_text(FAKE_WORKER.replace("DIE_AFTER", str(die_after)))
    py = tmp_path / "python"
    py.write_text(f"#!/bin/sh\nexec {sys.executable} {worker}\n")
    py.chmod(py.stat().st_mode | stat.S_IEXEC)
    return py


def _eval_with(py: Path, tmp_path: Path, *extra: str, predict: str = "false"):
    env = {**os.environ, "SPECDRAFT_VLLM_PYTHON": str(py)}
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "decoding.eval",
            "engine=vllm",
            "target=tiny_random",
            "target.tiny_head_dim=64",
            "draft=ngram",
            "num_prompts=3",
            "max_new_tokens=8",
            "warmup_tokens=2",
            "engine_compare=false",
            f"predict={predict}",
            f"report={tmp_path / 'r.json'}",
            *extra,
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


@pytest.mark.parametrize("wrapped", [False, True], ids=["by-name", "wrapped-at-import"])
def test_the_expand_repair_reaches_the_kernel_the_sampler_calls(monkeypatch, wrapped):
    """vLLM's CPU builds hand the rejection sampler their expand kernel in two ways: by name,
    read when the platform registers its kernels (0.31, 0.32), or as an object wrapping the function
    since import (0.27 to 0.30; the model runner assigns that object to the sampler). A stand-in
    module with the broken kernel (it writes into an int64 copy) either way: after the repair,
    what the sampler would call spreads each request's value over its tokens."""
    import types

    from decoding.engines import vllm_worker

    def broken(output, input_val, cu_num_tokens, replace_from, replace_to, MAX_NUM_TOKENS=None):
        output.to(torch.int64).fill_(7)  # the copy, never written back

    class FuncWrapper:  # vLLM's ``_FuncWrapper``: ``kernel[grid](...)`` calls ``func``
        def __init__(self, func):
            self.func = func

        def __getitem__(self, grid):
            return self.func

    cpu_tl = types.ModuleType("vllm.utils.cpu_triton_utils")
    cpu_tl._expand_kernel_impl = broken
    if wrapped:
        cpu_tl.expand_kernel = FuncWrapper(broken)
    platforms = types.ModuleType("vllm.platforms")
    platforms.current_platform = types.SimpleNamespace(import_kernels=lambda: None)
    utils = types.ModuleType("vllm.utils")
    utils.cpu_triton_utils = cpu_tl
    vllm = types.ModuleType("vllm")
    vllm.utils, vllm.platforms = utils, platforms
    for name, mod in [("vllm", vllm), ("vllm.utils", utils), ("vllm.platforms", platforms),
                      ("vllm.utils.cpu_triton_utils", cpu_tl)]:  # fmt: skip
        monkeypatch.setitem(sys.modules, name, mod)

    assert vllm_worker.repair_cpu_expand() == vllm_worker.EXPAND_REPAIR
    called = cpu_tl.expand_kernel[(2,)] if wrapped else cpu_tl._expand_kernel_impl
    out = torch.full((5,), -1.0)
    called(out, torch.tensor([0.5, 2.0]), torch.tensor([2, 5], dtype=torch.int32), 0.0, 1.0)
    assert out.tolist() == [0.5, 0.5, 2.0, 2.0, 2.0]
    # a build whose kernel is right is left as it is
    cpu_tl._expand_kernel_impl = vllm_worker._expand
    assert vllm_worker.repair_cpu_expand() is None


def test_the_report_reads_the_engines_counters(tmp_path):
    """Through a stand-in worker that speaks the protocol: tokens/s from the request's own
    timestamps (first token to last), alpha per position from the spec-decode counters."""
    r = _eval_with(_fake_vllm(tmp_path, die_after=99), tmp_path, "gamma=2", predict="true")
    assert r.returncode == 0, r.stderr[-2000:]
    rep = json.loads((tmp_path / "r.json").read_text())
    assert rep["finished"] is True and rep["engine"].startswith("vLLM 0.0-fake")
    # 8 tokens, 4 verifications of 2 a request, each accepting 1: alpha 1.0 then 0.0
    assert rep["alpha_per_position"] == [1.0, 0.0]
    assert rep["tokens_per_second"] == pytest.approx(1000.0, rel=1e-6)  # 7 tokens in 7 ms
    assert rep["lossless"] is True  # the stand-in answers the same tokens plain and speculative
    assert rep["settings"]["speculative_config"]["method"] == "ngram"
    # the calibration prompt: 96 tokens in 95 ms a side; 48 speculative steps of 2 drafted, 1
    # accepted: a step costs 95 / 48 plain steps; here 7 tokens a request in 4 steps
    ratio = rep["costs"]["speculative_step_over_plain_step"]
    assert ratio == pytest.approx(95 / 48)
    assert rep["predicted_speedup"] == pytest.approx(1.75 / ratio)
    assert rep["ceiling_speedup"] == pytest.approx(3 / ratio)


def test_an_engine_that_dies_mid_run_leaves_a_report_of_what_finished(tmp_path):
    r = _eval_with(_fake_vllm(tmp_path, die_after=2), tmp_path)
    assert r.returncode == 1, r.stderr[-2000:]
    rep = json.loads((tmp_path / "r.json").read_text())
    assert rep["finished"] is False
    assert len(rep["outputs"]) == 1  # the warm-up and the first prompt were served
    assert "ran out of memory" in rep["engine_error"]
    assert "ran out of memory" in r.stderr


# -- with vLLM ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_served():
    """A 4-layer tiny random target whose heads are 64 wide (what vLLM's CPU attention
    takes), as the HF folder vLLM loads."""
    from models.target import TargetConfig, load_target, target_folder

    t = load_target(
        TargetConfig(name="tiny_random", tiny_layers=4, tiny_head_dim=64, dtype="float32")
    )
    return t, target_folder(t)


#: the prompts every served draft decodes (token ids of the tiny target)
PROMPTS = [[1, 40 + i, 50 + 2 * i, 60, 70 + i] for i in range(4)]


@pytest.fixture(scope="module")
def plain_ref(tiny_served):
    """vLLM's plain greedy outputs of ``PROMPTS`` (64 tokens each) on the tiny target: what
    every speculative run below must reproduce (one server for them all: its start is most of
    a test's time on a CPU)."""
    from decoding.engines.vllm_eval import VLLMWorker

    _, folder = tiny_served
    with VLLMWorker(folder, dtype="float32", max_model_len=256) as plain:
        return [plain.complete(p, 64).tokens for p in PROMPTS]


@needs_vllm
def test_a_worker_forked_from_the_zygote_answers_as_a_process_of_its_own(
    tiny_served, plain_ref, monkeypatch
):
    """The suite's engines are forked from a zygote that imported vLLM once (conftest.py): a
    worker started as a process of its own, as every user's is unless they name a zygote,
    gives the same outputs; and the zygote is really forking them (else the suite would check
    nothing but the fallback)."""
    from decoding.engines.vllm_eval import VLLMWorker
    from decoding.engines.vllm_zygote import ENV, Forked

    _, folder = tiny_served
    if not os.environ.get(ENV):
        pytest.skip(f"{ENV} is unset: every engine here is a process of its own already")
    with VLLMWorker(folder, dtype="float32", max_model_len=256) as forked:
        assert isinstance(forked.proc, Forked), "the zygote named did not fork the worker"
    monkeypatch.setenv(ENV, "")
    with VLLMWorker(folder, dtype="float32", max_model_len=256) as own:
        assert isinstance(own.proc, subprocess.Popen)
        assert [own.complete(p, 64).tokens for p in PROMPTS] == plain_ref


def _head(target, method: str):
    """A head of ``method`` for ``target`` as its method builds it (random, seeded), with a
    chosen draft vocabulary where it has one (every even token id)."""
    from models import METHODS

    torch.manual_seed(0)
    method, flags = VARIANTS.get(method, (method, {}))
    cls = METHODS[method]
    cfg = cls.config_class(**flags)
    if hasattr(cfg, "fuse_layers"):
        cfg.fuse_layers = [1, 2, 3]
    if hasattr(cfg, "draft_vocab_size"):
        cfg.draft_vocab_size = 64
    if hasattr(cfg, "mask_token_id"):
        cfg.mask_token_id = 256  # '<|endoftext|>': the tiny tokenizer has no spare id
    head = cls(target, cfg).eval()
    if getattr(head, "d2t", None) is not None and getattr(cfg, "draft_vocab_size", 0) == 64:
        with torch.no_grad():
            head.d2t.copy_(torch.arange(64))  # draft id i -> target id 2i
            head.t2d.zero_()
            head.t2d[torch.arange(64) * 2] = True
    lens = LENSES.get(method) or (medusa_lens if method.startswith("medusa") else None)
    return lens(head) if lens else head


def medusa_lens(heads):
    """Medusa heads are the identity at initialisation, a lens; biases in their blocks shift
    it, so an engine that dropped them drafts otherwise."""
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for h in heads.heads:
            for block in list(h)[:-1]:
                b = block.linear.bias
                b.copy_(torch.randn(b.shape, generator=g) * 2.0)
    return heads


def eagle3_lens(head):
    """An EAGLE-3 head (HASS's, EAGLE 3.1's) that drafts the target's logit lens, so that it
    accepts where the tiny target repeats itself: FC passes the last fused state through, the
    layer adds nothing (output projections zero), the final norm is the target's and the LM
    head the target's rows for the draft vocabulary (EAGLE 3.1's per-layer norms: uneven
    weights). An engine that loaded a weight wrongly, or left one unset, drafts otherwise."""
    t = head.target
    H = t.hidden_size
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in head.parameters():
            p.zero_()
        head.fc.weight[:, 2 * H :] = torch.eye(H)
        layer = head.midlayer
        for norm in (layer.input_layernorm, layer.hidden_norm, layer.post_attention_layernorm):
            norm.weight.fill_(1.0)
        if head.cfg.norm_before_fc:
            head.input_norm.weight.fill_(1.0)
        for norm in getattr(head, "fc_norm", None) or []:
            norm.weight.copy_(0.5 + torch.rand(H, generator=g))
        head.norm.weight.copy_(t.model.get_decoder().norm.weight.float())
        ids = torch.arange(len(head.d2t)) + head.d2t  # draft id -> target id
        head.lm_head.weight.copy_(t.lm_head.weight[ids].float())
    return head


def peagle_lens(head):
    """A P-EAGLE head whose deeper slots accept only where ``mask_hidden`` is served: the
    EAGLE-3 lens for the first slot, and ``mask_hidden``'s last fused part the target's LM head
    row of token 72 (a draft token), so the slots after the first draft 72, which the target
    repeats after the third prompt. Zero, or not read, they draft a constant token the target
    never repeats (the lens of nothing: 0 past the first slot)."""
    head = eagle3_lens(head)
    H = head.target.hidden_size
    with torch.no_grad():
        head.mask_hidden.zero_()
        head.mask_hidden[..., 2 * H :] = head.target.lm_head.weight[72].float()
    return head


def eagle1_lens(head):
    """An EAGLE-1 head whose acceptance says whether FC's bias is served: FC passes the
    target's feature through and adds a bias b, the layer adds nothing (output projections
    zero), so it drafts the target's LM head on (feature + b). Without b it would repeat the
    target's last token, which the tiny target accepts nearly always (1.00, 1.00, 0.98 per
    position); with it, 0.30, 0.10 and 0.09: an engine that drops b, or leaves a bias of its
    own unset, shows at once."""
    H = head.target.hidden_size
    with torch.no_grad():
        head.fc.weight.zero_()
        head.fc.weight[:, H:] = torch.eye(H)
        head.fc.bias.copy_(torch.randn(H, generator=torch.Generator().manual_seed(0)))
        head.layer.self_attn.o_proj.weight.zero_()
        head.layer.mlp.down_proj.weight.zero_()
    return head


#: heads that accept on the tiny target, by method (random ones accept nothing in either engine,
#: so comparing acceptance could not fail for them)
LENSES = {
    "eagle1": eagle1_lens,
    "eagle3": eagle3_lens,
    "hass": eagle3_lens,
    "peagle": peagle_lens,
    "dflash": lambda draft: accepting_block_draft(draft, PROMPTS),
}

#: a method's variants as options of its config: (method, options)
VARIANTS = {"eagle3_1": ("eagle3", {"fc_norm": True, "norm_output": True})}

#: (export format, method of the head exported) for every format vLLM serves
SERVED = [
    ("vllm", "eagle3"),
    ("speculators", "eagle3"),
    ("vllm", "eagle3_1"),
    ("speculators", "eagle3_1"),
    ("vllm", "hass"),
    ("eagle1-vllm", "eagle1"),
    ("medusa-vllm", "medusa1"),
    ("medusa", "medusa1"),
    ("dflash", "dflash"),
    ("peagle", "peagle"),
]


#: formats vLLM serves on GPUs only, with the reason its CPU build gives (pinned below)
GPU_ONLY = {"dspark": "Model Runner V1 does not support: dspark speculative decoding"}


def test_every_format_said_to_be_served_is_checked_in_vllm():
    from decoding.engines.vllm_eval import served_formats

    assert set(served_formats()) == {f for f, _ in SERVED} | set(GPU_ONLY)


@needs_vllm
@pytest.mark.parametrize("fmt,method", SERVED, ids=[f"{f}-{m}" for f, m in SERVED])
def test_vllm_serves_the_export_and_accepts_what_we_do(
    tiny_served, plain_ref, tmp_path, fmt, method
):
    """Exported, loaded by vLLM, decoding: its speculative outputs are its plain greedy ones
    (fp32), and its acceptance per position is the built-in decoder's on the same prompts
    with the same export read back (within 0.03). Both start a request
    alike (the prefill chooses the first token, drafting starts from the second), so drafters
    that draft every step verify as often in both: one step per draft in vLLM, one
    verification forward in ours."""
    from decoding.decoder import SpeculativeDecoder
    from decoding.engines.vllm_eval import VLLMWorker, speculative_config
    from models.base import DecodeSettings
    from models.export import export, import_draft
    from models.sampling import Sampling

    target, folder = tiny_served
    out = tmp_path / fmt
    export(_head(target, method), fmt, out, dtype="float32", log=lambda *_: None)
    prompts, ref = PROMPTS, plain_ref
    spec_cfg = speculative_config(out, fmt, 3)
    n = spec_cfg["num_speculative_tokens"]  # 3, or a DFlash block's 7 whatever gamma says
    with VLLMWorker(folder, speculative=spec_cfg, dtype="float32", max_model_len=256) as eng:
        outs = [eng.complete(p, 64) for p in prompts]
    assert not eng.log_path.exists()  # a clean run leaves no log behind
    assert [o.tokens for o in outs] == ref
    theirs = vllm_acceptance(outs, n)
    mine = import_draft(out, target).proposer(DecodeSettings(tree="chain"))
    dec = SpeculativeDecoder(target, mine, Sampling(), gamma=n, adaptive=False)
    got = [dec.generate(p, 64) for p in prompts]
    assert got == ref
    s = dec.stats
    ours = our_acceptance(s, n)
    assert ours[0] >= 0.05, ours  # a head that accepts: else no comparison could fail
    assert max(abs(a - b) for a, b in zip(theirs, ours, strict=True)) <= 0.03, (theirs, ours)
    decoded = sum(len(r) - 1 for r in ref)
    assert s.decoded_tokens == decoded == s.target_calls + sum(s.accepted.values())
    if not fmt.startswith("medusa"):  # vLLM's Medusa skips drafting in some steps
        # every step after the prefill drafts and emits its accepted tokens and one more, in
        # both: steps plus accepted tokens make the decoded tokens. The steps alone can differ
        # where a near-tie lets one engine accept a token the other does not (seen: 250 steps
        # and 2 accepted in vLLM, 252 and 0 in ours, on another CPU)
        # vLLM counts the tokens a request's last step accepted past its max_tokens (cut from
        # its output): up to n of them a request
        drafts = sum(o.timings["drafts"] for o in outs)
        acc_theirs = sum(sum(o.timings["accepted_per_pos"]) for o in outs)
        over = drafts + acc_theirs - decoded
        assert 0 <= over <= n * len(outs), (drafts, acc_theirs, decoded)


@needs_vllm
@pytest.mark.parametrize("method", ["dflash", "dspark"])
def test_vllm_reads_the_block_drafters_blocks_as_bidirectional(tiny_served, tmp_path, method):
    """Every slot of a DFlash or DSpark block reads the whole block (bidirectional; the GGUF
    says ``dflash.attention.causal = false`` to llama.cpp). vLLM resolves the export's config
    into ``dflash_config.causal`` for every draft layer, through its own config loader here: it
    must come out non-causal. From the speculators layout's ``sliding_window_non_causal``,
    which this export once wrote as false, vLLM made the draft layers causal (slot k reading
    slots <= k only)."""
    from decoding.engines.vllm_eval import vllm_python
    from models import METHODS
    from models.export import export

    target, _ = tiny_served
    cls = METHODS[method]
    cfg = cls.config_class(fuse_layers=[1, 2], draft_vocab_size=64, mask_token_id=256)
    head = cls(target, cfg).eval()
    head.vocab_chosen = True
    out = tmp_path / method
    export(head, method, out, dtype="float32", log=lambda *_: None)
    code = textwrap.dedent(
        """
        import json, sys
        from vllm.transformers_utils.config import get_config
        try:
            from vllm.model_executor.models.qwen3_dflash import dflash_has_any_non_causal
        except ImportError:
            print("NO-CAUSALITY-SETTING")
            sys.exit(0)
        config = get_config(sys.argv[1], trust_remote_code=False)
        print(json.dumps({"causal": (config.dflash_config or {}).get("causal"),
                          "any_non_causal": dflash_has_any_non_causal(config)}))
        """
    )
    r = subprocess.run(
        [str(vllm_python()), "-c", code, str(out)], capture_output=True, text=True, timeout=600
    )
    assert r.returncode == 0, r.stderr[-2000:]
    last = r.stdout.strip().splitlines()[-1]
    if last == "NO-CAUSALITY-SETTING":
        pytest.skip("this vLLM release has no DFlash causality setting: its blocks are as built")
    assert json.loads(last) == {"causal": False, "any_non_causal": True}


def test_an_eagle1_reference_export_is_refused_for_vllm_saying_which_layout_it_serves(
    tiny_served, tmp_path
):
    """vLLM's EAGLE-1 has no FC bias and drops the reference layout's without a word (it
    would serve another draft than the one trained): a reference export named as the draft is
    refused, naming the layout vLLM computes exactly; the training run goes through as that."""
    from omegaconf import OmegaConf

    from decoding.engines.vllm_eval import vllm_draft
    from models.export import export

    target, _ = tiny_served
    export(_head(target, "eagle1"), "eagle1", tmp_path / "ref", log=lambda *_: None)
    cfg = OmegaConf.create(
        {"draft": str(tmp_path / "ref"), "gamma": 3, "engine_rule": "greedy_draft"}
    )
    with pytest.raises(EngineError, match=r"an? eagle1 export, which vLLM does not serve as "
                       r"trained .* --format eagle1-vllm"):  # fmt: skip
        vllm_draft(cfg, target, log=lambda *_: None)


def test_a_peagle_export_is_served_with_parallel_drafting(tiny_served, tmp_path):
    """Given ``method: eagle3`` alone, vLLM drafts a P-EAGLE head sequentially as EAGLE-3 and
    skips its mask_hidden: the engine's speculative config and the export's ``vllm serve``
    line both spell out parallel drafting (the served test's P-EAGLE head accepts what ours
    does only with it)."""
    from decoding.engines.vllm_eval import speculative_config
    from models.export import export

    target, _ = tiny_served
    out = tmp_path / "peagle"
    summary = export(_head(target, "peagle"), "peagle", out, log=lambda *_: None)
    spec = speculative_config(out, "peagle", 3)
    assert spec["method"] == "eagle3" and spec["parallel_drafting"] is True
    assert '"parallel_drafting": true' in summary["vllm_serve"]


def test_a_medusa_folder_without_its_bias_flag_is_refused_for_vllm(tiny_served, tmp_path):
    """vLLM reads the Medusa reference layout too, but builds bias-free blocks unless the config
    says ``medusa_fc_bias`` (the reference's own configs do not): a folder whose blocks have
    biases and whose config lacks the key would be served as another draft, so it is refused,
    naming the key; our export writes it."""
    from omegaconf import OmegaConf

    from decoding.engines.vllm_eval import vllm_draft
    from models.export import export

    target, _ = tiny_served
    out = tmp_path / "medusa"
    export(_head(target, "medusa1"), "medusa", out, log=lambda *_: None)
    cfg = OmegaConf.create({"draft": str(out), "gamma": 3, "engine_rule": "greedy_draft"})
    spec, _, _ = vllm_draft(cfg, target, log=lambda *_: None)  # as exported: served
    assert spec["method"] == "medusa"
    c = json.loads((out / "config.json").read_text())
    del c["medusa_fc_bias"]  # as the Medusa reference writes its configs
    (out / "config.json").write_text(json.dumps(c))
    with pytest.raises(EngineError, match=r'no "medusa_fc_bias": true, while .* biases'):
        vllm_draft(cfg, target, log=lambda *_: None)


@needs_vllm
def test_vllm_serves_a_distillspec_student_as_a_draft_model(tiny_served, plain_ref, tmp_path):
    """`draft=<a DistillSpec run>` for engine=vllm: its merged student, served with vLLM's
    ``draft_model`` method (no export: the student is an ordinary causal LM with the target's
    tokenizer). Its speculative outputs are its plain greedy ones, and its acceptance per
    position is the built-in decoder's with the same student (within 0.1)."""
    from omegaconf import OmegaConf

    from decoding.decoder import SpeculativeDecoder
    from decoding.drafts import load_proposer
    from decoding.engines.vllm_eval import VLLMWorker, vllm_draft
    from models.distillspec import DistillSpecConfig, DistillSpecStudent
    from models.sampling import Sampling

    target, folder = tiny_served
    torch.manual_seed(0)
    student = DistillSpecStudent(target, DistillSpecConfig(num_layers=1)).eval()
    with torch.no_grad():  # a student that agrees with the target about half the time
        for name, w in student.merged().named_parameters():
            if "layers.0" in name and w.dim() == 2:
                w.add_(torch.randn_like(w) * 0.02)
    run = tmp_path / "run"
    student.save_draft(run / "final")
    cfg = OmegaConf.create({"draft": str(run), "gamma": 3, "engine_rule": "greedy_draft"})
    spec_cfg, desc, readback = vllm_draft(cfg, target, log=lambda *_: None)
    assert spec_cfg["method"] == "draft_model" and readback == str(run / "final" / "student")
    assert "distillspec student" in desc
    prompts, ref = PROMPTS, plain_ref
    with VLLMWorker(folder, speculative=spec_cfg, dtype="float32", max_model_len=256) as eng:
        outs = [eng.complete(p, 64) for p in prompts]
    assert [o.tokens for o in outs] == ref
    theirs = vllm_acceptance(outs, 3)
    prop, _ = load_proposer(readback, target)
    dec = SpeculativeDecoder(target, prop, Sampling(), gamma=3, adaptive=False)
    assert [dec.generate(p, 64) for p in prompts] == ref
    ours = our_acceptance(dec.stats, 3)
    assert max(abs(a - b) for a, b in zip(theirs, ours, strict=True)) <= 0.1, (theirs, ours)
    assert 0.2 < min(ours) and max(ours) < 0.9, ours  # accepted and rejected drafts both


@needs_vllm
def test_formats_vllm_refuses_are_pinned_to_its_reason(tiny_served, tmp_path):
    """The MLP speculator layout: vLLM 0.32 no longer registers MLPSpeculatorPreTrainedModel
    (the README's export table says so); a speculators EAGLE-3 folder passed as
    speculators' own docs show it, {"model": DIR}, is taken for a draft model and fails, which
    is why our export prints the line with "method": "eagle3"."""
    from decoding.engines.vllm_eval import VLLMWorker
    from models.export import export

    target, folder = tiny_served
    mlp = tmp_path / "mlp"
    export(_head(target, "mlp_speculator"), "mlp_speculator", mlp, log=lambda *_: None)
    spec = {"method": "mlp_speculator", "model": str(mlp), "num_speculative_tokens": 3}
    w = VLLMWorker(folder, speculative=spec, dtype="float32", max_model_len=256)
    with pytest.raises(EngineError, match="MLPSpeculatorPreTrainedModel'] are not supported"):
        w.start()
    assert w.proc is None  # the refused engine's process ended, not left waiting for requests
    assert w.log_path.is_file()  # and its log, which the error names, is kept
    sp = tmp_path / "sp"
    export(_head(target, "eagle3"), "speculators", sp, log=lambda *_: None)
    bare = {"model": str(sp), "num_speculative_tokens": 3}
    with pytest.raises(EngineError, match="hidden_states"):
        with VLLMWorker(folder, speculative=bare, dtype="float32", max_model_len=256) as w:
            w.complete([1, 2, 3], 4)
    assert '"method": "eagle3"' in (sp / "README.md").read_text()


@needs_vllm
@pytest.mark.parametrize("fmt", sorted(GPU_ONLY))
def test_formats_vllm_serves_on_gpus_only_are_refused_by_the_cpu_build(tiny_served, tmp_path, fmt):
    """DSpark lives in vLLM's V2 GPU model runner; the CPU build runs the V1 runner, which
    refuses the method by name (V2 needs Triton). The export is checked by reading it back;
    the folder's README says where vLLM serves it."""
    from decoding.engines.vllm_eval import VLLMWorker, speculative_config
    from models.export import export

    target, folder = tiny_served
    out = tmp_path / fmt
    head = _head(target, fmt)
    export(head, fmt, out, dtype="float32", log=lambda *_: None)
    spec = speculative_config(out, fmt, 3)
    assert spec["method"] == fmt and spec["num_speculative_tokens"] == head.cfg.block_size - 1
    with pytest.raises(EngineError, match=GPU_ONLY[fmt]):
        with VLLMWorker(folder, speculative=spec, dtype="float32", max_model_len=256) as w:
            w.complete([1, 2, 3], 4)
    assert "V2 GPU model runner" in (out / "README.md").read_text()


@needs_vllm
@pytest.mark.slow
@pytest.mark.parametrize("layout", ["vllm", "speculators"])
def test_the_shipped_head_in_vllm_accepts_what_our_evaluator_predicts(tmp_path, layout):
    """`specdraft-eval engine=vllm` on the embedded target with the shipped EAGLE-3 head, in
    fp32: vLLM's outputs are its plain greedy ones, and its acceptance per position is the
    built-in decoder's on the same prompts (within 0.08 on 2 x 48 tokens)."""
    r = run_module(
        "decoding.eval",
        [
            "engine=vllm",
            "draft=smollm2-eagle3",
            f"engine_format={layout}",
            "target.dtype=float32",
            "gamma=3",
            "num_prompts=2",
            "max_new_tokens=48",
            "predict=false",
            f"report={tmp_path / 'r.json'}",
        ],
        timeout=900,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    rep = json.loads((tmp_path / "r.json").read_text())
    assert rep["lossless"] is True and rep["divergences"] == 0
    diffs = rep["ours"]["difference_per_position"]
    assert len(diffs) == 3 and all(abs(d) <= 0.08 for d in diffs if d is not None), diffs
    assert rep["ours"]["same_text"] == [2, 2]  # fp32: both decode the target's own text
    assert rep["engine_flag"] is None
    assert "built-in decoder, same prompts and draft" in r.stdout


@needs_vllm
@pytest.mark.slow
def test_at_t1_vllms_samples_are_the_targets_and_a_broken_sampler_is_caught(tmp_path):
    """`specdraft-eval engine=vllm temperature=1` with the shipped head: the worker repairs the
    CPU build's expand kernel where it is wrong (its per-token temperatures were never
    written), the speculative samples then pass the sample check and the second draft
    position accepts; served as installed, a build with that defect is caught by the check
    and blamed on its speculative sampler, its plain samples being the target's."""

    def run(repair: bool, prompts: int) -> dict:
        out = tmp_path / f"r-{repair}.json"
        r = run_module(
            "decoding.eval",
            [
                "engine=vllm",
                "draft=smollm2-eagle3",
                "gamma=3",
                "temperature=1",
                f"num_prompts={prompts}",
                "max_new_tokens=64",
                "predict=false",
                "engine_compare=false",
                f"engine_repair={str(repair).lower()}",
                f"report={out}",
            ],
            timeout=900,
        )
        assert r.returncode == 0, r.stderr[-3000:]
        assert "sample check (T > 0" in r.stdout
        return json.loads(out.read_text())

    rep = run(True, 6)
    assert rep["sample_check"]["flag"] is None, rep["sample_check"]
    assert rep["sample_check"]["spec"]["tokens"] > 200
    assert rep["alpha_per_position"][1] and rep["alpha_per_position"][1] > 0.05
    if not rep["engine_repairs"]:
        pytest.skip("this vLLM build's expand kernel is right: nothing to repair")
    assert "expand kernel" in rep["engine_repairs"][0]
    # half the prompts: the defect moves z of log p to about -18 on three (2026-12-01)
    broken = run(False, 3)
    assert broken["engine_repairs"] == []
    assert "speculative sampler" in (broken["sample_check"]["flag"] or ""), broken["sample_check"]


def _prepare(data: Path, out: Path, engine: str, *extra: str):
    return run_module(
        "flow.regenerate",
        [
            "target=tiny_random",
            "target.tiny_layers=4",
            "target.tiny_head_dim=64",
            "target.dtype=float32",
            f"data.path={data}",
            f"out={out}",
            "max_new_tokens=16",
            f"engine={engine}",
            "progress=false",
            *extra,
        ],
        timeout=600,
    )


def test_prepare_with_vllm_missing_says_how_to_install_it(tmp_path, data_file, monkeypatch):
    monkeypatch.setenv("SPECDRAFT_VLLM_PYTHON", str(tmp_path / "no-such-python"))
    r = _prepare(data_file, tmp_path / "o.jsonl", "vllm")
    assert r.returncode == 2
    assert "bash scripts/install.sh vllm" in r.stderr.splitlines()[-1]


@needs_vllm
def test_prepare_through_vllm_writes_the_targets_greedy_answers(tmp_path, data_file, monkeypatch):
    """`specdraft-prepare engine=vllm`: the same file as the built-in batched decoder's where
    both are greedy in fp32 (multi-turn records turn by turn); resumed once finished, it writes
    nothing new and starts no engine; the engine is part of the settings a resumed run must
    keep; seeded T > 0 writes the same file twice."""
    lines = data_file.read_text().splitlines()[:10]
    data = tmp_path / "in.jsonl"
    data.write_text("\n".join(lines) + "\n")
    ours, theirs = tmp_path / "torch.jsonl", tmp_path / "vllm.jsonl"
    assert _prepare(data, ours, "torch").returncode == 0
    r = _prepare(data, theirs, "vllm")
    assert r.returncode == 0, r.stderr[-2000:]
    assert theirs.read_text() == ours.read_text()
    meta = json.loads(theirs.with_name("vllm.jsonl.meta.json").read_text())
    assert meta["settings"]["engine"] == "vllm" and meta["records"] == 10
    assert meta["replies"] > 10  # later turns were regenerated too
    # finished: resumed, nothing is left, so no engine starts (this one would fail at once)
    dead = tmp_path / "dead-python"
    dead.write_text("#!/bin/sh\nexit 1\n")
    dead.chmod(0o755)
    monkeypatch.setenv("SPECDRAFT_VLLM_PYTHON", str(dead))
    again = _prepare(data, theirs, "vllm")
    assert again.returncode == 0, again.stderr[-2000:]
    assert theirs.read_text() == ours.read_text()
    monkeypatch.delenv("SPECDRAFT_VLLM_PYTHON")
    mixed = _prepare(data, theirs, "torch")
    assert mixed.returncode == 2 and "engine='vllm', now engine='torch'" in mixed.stderr
    s1, s2 = tmp_path / "s1.jsonl", tmp_path / "s2.jsonl"
    for out in (s1, s2):
        assert _prepare(data, out, "vllm", "temperature=1.0", "seed=3").returncode == 0
    assert s1.read_text() == s2.read_text() != ours.read_text()


def test_a_layout_that_fixes_its_draft_length_is_reported_at_it(tmp_path):
    """A DFlash export drafts its block - 1 tokens a step in vLLM whatever gamma says: the
    report, its prediction and the built-in decoder's comparison are at that length (they
    said gamma's), and a line says so."""
    from models import METHODS
    from models.export import export
    from models.target import TargetConfig, load_target

    target = load_target(TargetConfig(name="tiny_random", tiny_head_dim=64))
    cls = METHODS["dflash"]
    torch.manual_seed(0)
    head = cls(target, cls.config_class(block_size=4, mask_token_id=256)).eval()
    export(head, "dflash", tmp_path / "x", dtype="float32", log=lambda *_: None)
    r = _eval_with(
        _fake_vllm(tmp_path, die_after=99), tmp_path, f"draft={tmp_path / 'x'}", "gamma=5"
    )
    assert r.returncode == 0, r.stderr[-2000:]
    assert "gamma=5: this draft drafts 3 tokens a step in vLLM" in r.stdout
    rep = json.loads((tmp_path / "r.json").read_text())
    assert rep["settings"]["n_max"] == 3
    assert rep["settings"]["speculative_config"]["num_speculative_tokens"] == 3
    assert "3 speculative tokens" in rep["settings"]["draft_description"]
