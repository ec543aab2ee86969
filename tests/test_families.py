"""The model families people train drafts for (``models/families.py``), each end to end on a tiny
random target of its architecture: every method trains a few steps, decodes losslessly through
the one decoder, and exports to each of its formats and reads back; per family once, EAGLE-3
with chains and trees, batched, at T > 0, on the static path where the family has one, and in
vLLM and llama.cpp where each serves EAGLE-3 for the architecture.

Where ``SPECDRAFT_FAMILY_MATRIX`` names a file, each test appends the cells it measured to it
(one JSON line per cell: family, method, column, value); ``scripts/family_matrix.py`` runs
these tests that way and writes the table in docs/families.md from the cells."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest
import torch
from conftest import (
    compose,
    family_target,
    needs_engine,
    needs_vllm,
    our_acceptance,
    steps_acceptance,
    tiny_overrides,
    tiny_target_gguf,
    vllm_acceptance,
)
from test_methods import SMALL

from models import FORMATS, METHODS
from models.base import ExportError
from models.families import FAMILIES

#: the families of the matrix (the default, Llama, is every other test's target)
NAMES = [f for f in FAMILIES if f != "llama"]
#: settings a family needs for a method, each with why (the cell says so)
NEEDS = {
    ("deepseek_v3", "medusa2"): (
        ["method.lora_dropout=0"],
        "method.lora_dropout=0: peft puts the adapter on the stacked experts too (it maps the "
        "MLP names onto them), and there it takes no dropout; the default is refused in one "
        "line that says so",
    ),
}
PROMPT = list(range(40, 60))
NEW = 40  # 20 + 40 tokens: past the sliding windows (24 columns)


def record(family: str, method: str, column: str, value: str) -> None:
    path = os.environ.get("SPECDRAFT_FAMILY_MATRIX")
    if path:
        line = {"family": family, "method": method, "column": column, "value": value}
        with open(path, "a") as f:
            f.write(json.dumps(line) + "\n")


def train(family: str, method: str, data_file: Path, run_dir: Path) -> None:
    from trainer.train import run

    over = tiny_overrides(data_file, run_dir, **{"train.max_steps": 3, "method": method})
    over += [
        "target.device=cpu",
        "target.dtype=float32",
        "target.tiny_layers=4",
        f"target.family={family}",
    ]
    run(compose(over + SMALL[method] + NEEDS.get((family, method), ([], ""))[0]))


def plain_greedy(target, prompt=PROMPT, n=NEW) -> list[int]:
    from decoding.decoder import NoDraft, SpeculativeDecoder
    from models.sampling import Sampling

    dec = SpeculativeDecoder(target, NoDraft(), Sampling(), calibrate=False, compile="false")
    return dec.generate(prompt, n)  # transformers' forward: the reference


@pytest.mark.parametrize("method", sorted(METHODS))
@pytest.mark.parametrize("family", NAMES)
def test_each_method_trains_decodes_and_exports_on_each_family(family, method, data_file, tmp_path):
    from decoding.decoder import SpeculativeDecoder
    from decoding.drafts import load_proposer
    from models.base import DecodeSettings
    from models.export import export, import_draft, proposals
    from models.sampling import Sampling

    run_dir = tmp_path / "run"
    train(family, method, data_file, run_dir)
    need = NEEDS.get((family, method), (None, ""))[1]
    record(family, method, "trains", f"Y ({need})" if need else "Y")

    target = family_target(family)
    prop, _ = load_proposer(str(run_dir), target, tree=DecodeSettings())
    ref = plain_greedy(target)
    dec = SpeculativeDecoder(target, prop, Sampling(), gamma=prop.tree_depth or 3, adaptive=False)
    assert dec.generate(PROMPT, NEW) == ref, f"{family}/{method}: speculative != plain greedy"
    assert dec.stats.draft_calls > 0
    record(family, method, "exact", "Y")

    trained = METHODS[method].load_draft(run_dir / "final", family_target(family))
    done = []
    for f in [f for f, fmt in FORMATS.items() if method in fmt.methods]:
        out = tmp_path / f"export-{f}"
        opts = {"target_gguf_path": tiny_target_gguf(tmp_path / "t.gguf", target)}
        gguf = "gguf" in (f, FORMATS[f].family)
        try:
            export(
                trained,
                f,
                out,
                dtype="float32",
                merge=trained.changes_target() is not None,
                log=lambda *_: None,
                **(opts if gguf else {}),
            )
        except ExportError as e:
            # llama.cpp's layouts cannot hold every family's layers (biases): refused by name
            assert gguf and "llama.cpp" in str(e) and "\n" not in str(e), str(e)
            record(family, method, "refused", f"{f}: {e}")
            continue
        back = import_draft(out, trained.target)
        a, b = proposals(trained.export_view(torch.float32), PROMPT), proposals(back, PROMPT)
        a.pop("logits"), b.pop("logits")
        assert a == b, f"{family}/{method} -> {f}: proposals differ after the round trip"
        done.append(f)
    record(family, method, "exports", ", ".join(done))


@pytest.mark.parametrize("family", NAMES)
def test_eagle3_chains_trees_batches_and_samples_exactly_on_each_family(
    family, data_file, tmp_path
):
    """Once per family, an EAGLE-3 head trained a few steps: greedy chains and EAGLE-2 trees
    give the target's greedy output; a batch of ragged rows gives each row's batch-1 output
    (rollback and holes on the windowed layers' cache); at T = 1 every token is chosen from the
    target's own distribution (the rows the decoder sampled from equal a fresh forward's over
    the sequence it produced: the acceptance rule's exactness is family-blind and tested in
    tests/test_verify.py); all of it on transformers' forward, and chains, trees and the batch
    again on the static path (the lean forward) where the family has one."""
    from decoding.batch import BatchDecoder
    from decoding.decoder import SpeculativeDecoder
    from decoding.drafts import load_proposer
    from models.base import DecodeSettings
    from models.lean import lean_support
    from models.sampling import Sampling
    from models.target import GenRequest

    run_dir = tmp_path / "run"
    train(family, "eagle3", data_file, run_dir)
    target = family_target(family)
    ref = plain_greedy(target)
    tree = DecodeSettings(tree="dynamic", depth=3, top_k=3, total_tokens=8)
    for how, settings in (("chain", DecodeSettings(tree="chain")), ("tree", tree)):
        prop, _ = load_proposer(str(run_dir), target, tree=settings)
        dec = SpeculativeDecoder(target, prop, Sampling(), gamma=3, adaptive=False, compile="false")
        assert dec.generate(PROMPT, NEW) == ref, f"{family}: {how} != plain greedy"
    record(family, "eagle3", "trees", "Y")

    prompts = [PROMPT, list(range(70, 75)), list(range(30, 62))]
    refs = [plain_greedy(target, p) for p in prompts]
    prop, _ = load_proposer(str(run_dir), target, tree=DecodeSettings(tree="chain"))
    bdec = BatchDecoder(target, prop, Sampling(), batch_size=3, gamma=3, compile="false")
    out = bdec.run([GenRequest(i, p) for i, p in enumerate(prompts)], NEW)
    assert [out[i] for i in range(3)] == refs, f"{family}: batched rows != their greedy output"
    record(family, "eagle3", "batched", "Y")

    s = Sampling(temperature=1.0)
    for how, settings in (("chain", DecodeSettings(tree="chain")), ("tree", tree)):
        prop, _ = load_proposer(str(run_dir), target, tree=settings)
        dec = SpeculativeDecoder(
            target, prop, s, gamma=3, adaptive=False, record_logits=True, compile="false"
        )
        torch.manual_seed(0)
        got = dec.generate(PROMPT, 24)
        used = torch.stack([r.float().cpu() for r in dec.last_logits])
        with torch.no_grad():
            full = target.model(torch.tensor([PROMPT + got])).logits[0].float()
        fresh = full[len(PROMPT) - 1 : len(PROMPT) - 1 + len(got)]
        torch.testing.assert_close(used, fresh, atol=2e-4, rtol=1e-4, msg=f"{family} {how}")
    record(family, "eagle3", "sampling", "Y")

    why = lean_support(target.model)
    if why is None:  # chains, trees and a ragged batch on the lean forward's static cache
        for how, settings in (("chain", DecodeSettings(tree="chain")), ("tree", tree)):
            prop, _ = load_proposer(str(run_dir), target, tree=settings)
            dec = SpeculativeDecoder(
                target, prop, Sampling(), gamma=3, adaptive=False, compile="true"
            )
            assert dec.runner.kind != "transformers"
            assert dec.generate(PROMPT, NEW) == ref, f"{family}: static {how} != plain greedy"
        prop, _ = load_proposer(str(run_dir), target, tree=DecodeSettings(tree="chain"))
        bdec = BatchDecoder(target, prop, Sampling(), batch_size=3, gamma=3, compile="true")
        out = bdec.run([GenRequest(i, p) for i, p in enumerate(prompts)], NEW)
        assert [out[i] for i in range(3)] == refs, f"{family}: static batch != greedy output"
    record(family, "eagle3", "static", "Y" if why is None else f"falls back: {why}")


def test_medusa2_on_stacked_experts_says_what_to_set(data_file, tmp_path):
    """DeepSeek-V3's MLP names are also its stacked experts' for peft, whose LoRA takes no
    dropout: the default refused in one line that says what to set."""
    from trainer.train import run

    over = tiny_overrides(
        data_file, tmp_path / "run", **{"train.max_steps": 1, "method": "medusa2"}
    )
    over += ["target.device=cpu", "target.tiny_layers=4", "target.family=deepseek_v3"]
    with pytest.raises(Exception, match="set method.lora_dropout=0") as e:
        run(compose(over + SMALL["medusa2"]))
    assert "\n" not in str(e.value)


def test_an_unknown_family_is_refused_before_anything_loads():
    from models.target import TargetError

    with pytest.raises(TargetError, match=r"target.family='bloom': not a known family \(llama"):
        family_target("bloom")


def test_draft_layers_take_the_targets_sizes_not_its_architecture():
    """Experts, latent attention, fused projections, windows: a draft layer of any family is
    the Llama layer every engine builds EAGLE heads from, with the target's sizes; norms are
    plain RMS norms (Gemma's 1 + w would load as w in an engine)."""
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRMSNorm

    from models.eagle import Eagle3Config, Eagle3Head

    for family in ("gemma2", "phi3", "deepseek_v3", "qwen3_moe"):
        t = family_target(family)
        head = Eagle3Head(t, Eagle3Config(fuse_layers=[1, 2, 3], draft_vocab_size=64))
        assert type(head.midlayer) is LlamaDecoderLayer
        assert type(head.norm) is LlamaRMSNorm
        assert head.midlayer.self_attn.o_proj.in_features == (
            t.config.num_attention_heads * t.draft_layer_config().head_dim
        )


def test_soft_capped_heads_cap_wherever_the_draft_reads_the_targets_head():
    """Gemma-2 caps its logits (30 tanh(z / 30)): the target's head read by a draft (EAGLE-1,
    Medusa's teacher, DFlash's rows, ...) gives the capped logits the target's own forward
    gives; the embedding the draft reads is the scaled one the first layer reads."""
    t = family_target("gemma2")
    assert t.logit_softcap == 30.0
    ids = torch.tensor([PROMPT])
    with torch.no_grad():
        out = t.model(ids, output_hidden_states=True)
        assert torch.allclose(t.logits(out.hidden_states[-1]), out.logits, atol=1e-5)
        rows = t.lm_head.weight[:10]
        assert torch.allclose(
            t.logits(out.hidden_states[-1], rows), out.logits[..., :10], atol=1e-5
        )
        assert torch.allclose(t.embed_tokens(ids), out.hidden_states[0])
    assert out.logits.abs().max() <= 30.0


# -- in vLLM ----------------------------------------------------------------------------------

#: what vLLM 0.32 (its CPU build) does with a tiny target of each family and our EAGLE-3
#: export for it: None where it serves the head, else its own error message (a regex).
#: DeepSeek-V3's latent attention is refused in fp32 by the CPU build in one of two places,
#: by the CPU: on AMD Zen 3 to 5 its cache block size matches no other layer's; on an Intel
#: Xeon with AMX its weights must be bf16 or narrower
VLLM = {
    "llama3": None,
    "qwen2": None,
    "qwen3": None,
    "qwen3_moe": None,
    "mixtral": "Model does not support EAGLE3 interface",
    "mistral": None,
    "gemma2": "Model does not support EAGLE3 interface",
    "gemma3": "Model does not support EAGLE3 interface",
    "phi3": None,
    "gpt_oss": None,
    "deepseek_v3": "No common block size|expect weight to be bfloat16, float16",
    "olmo2": None,
}


def lens_head(target):
    """An EAGLE-3 head that drafts what the target's logit lens says: FC passes the last fused
    state (the input of the last layer) through, the layer adds nothing (its output
    projections are zero), the target's final norm and LM head read it; later steps repeat the
    first token. It accepts often where the tiny target repeats itself, so the engines'
    acceptance per position can be compared, and every engine computes it the same way."""
    from models.eagle import Eagle3Config, Eagle3Head

    H, V = target.hidden_size, target.config.vocab_size
    head = Eagle3Head(target, Eagle3Config(fuse_layers=[1, 2, 3], draft_vocab_size=V)).eval()
    head.vocab_chosen = True  # the whole vocabulary, chosen
    with torch.no_grad():
        for p in head.parameters():
            p.zero_()
        head.fc.weight[:, 2 * H :] = torch.eye(H)
        for norm in (head.midlayer.input_layernorm, head.midlayer.hidden_norm):
            norm.weight.fill_(1.0)
        head.midlayer.post_attention_layernorm.weight.fill_(1.0)
        head.norm.weight.copy_(target.model.get_decoder().norm.weight.float())
        head.lm_head.weight.copy_(target.lm_head.weight.float())
    return head


def test_the_engines_expectations_name_every_family():
    assert set(VLLM) == set(NAMES) and set(LLAMA_CPP) == set(NAMES)


def served_in_vllm(target, out: Path, spec: dict, prompts: list[list[int]], what: str):
    """The export in ``out`` served by vLLM beside ``target`` (``spec``: its speculative
    config) and read back into the built-in decoder, chains of 3, 64 tokens a prompt: their
    outputs must be the same up to the first end of reply (where vLLM stops); (vLLM's
    acceptance by position, ours)."""
    from decoding.decoder import SpeculativeDecoder
    from decoding.engines.vllm_eval import VLLMWorker
    from models.base import DecodeSettings
    from models.export import import_draft
    from models.sampling import Sampling
    from models.target import target_folder

    eos = {target.tokenizer.eos_token_id}
    with VLLMWorker(target_folder(target), speculative=spec, dtype="float32",
                    max_model_len=256) as eng:  # fmt: skip
        outs = [eng.complete(p, 64) for p in prompts]
    mine = import_draft(out, target).proposer(DecodeSettings(tree="chain"))
    dec = SpeculativeDecoder(target, mine, Sampling(), gamma=3, adaptive=False)
    got = [[t for t in dec.generate(p, 64, stop_ids=eos) if t not in eos] for p in prompts]
    theirs_tokens = [[t for t in o.tokens if t not in eos] for o in outs]
    assert theirs_tokens == got, f"{what}: vLLM's speculative output != the target's greedy"
    return vllm_acceptance(outs, 3), our_acceptance(dec.stats, 3)


@needs_vllm
@pytest.mark.parametrize("family", NAMES)
def test_vllm_serves_our_eagle3_export_for_each_family_it_supports(family, tmp_path):
    """vLLM loads the tiny target (heads 64 wide, what its CPU attention takes) and our
    EAGLE-3 export, and decodes: its speculative output is the target's greedy output (up to
    the first end of reply, where vLLM stops) and its acceptance per position is ours within
    0.03 (both draft from a request's second token; counting a first proposal, as the built-in
    decoder once did, moved it by 0.06 where acceptance is high). Where vLLM does not serve
    EAGLE-3 for the architecture, its own message is pinned."""
    from decoding.engines.base import EngineError
    from decoding.engines.vllm_eval import VLLMWorker, speculative_config
    from models.export import export
    from models.target import target_folder

    target = family_target(family, tiny_head_dim=64)
    folder = target_folder(target)
    out = tmp_path / "vllm"
    export(lens_head(target), "vllm", out, dtype="float32", log=lambda *_: None)
    prompts = [[1, 40 + i, 50 + 2 * i, 60, 70 + i] for i in range(4)]
    spec = speculative_config(out, "vllm", 3)
    if VLLM[family] is not None:
        with pytest.raises(EngineError, match=VLLM[family]) as e:
            with VLLMWorker(folder, speculative=spec, dtype="float32", max_model_len=256) as w:
                w.complete(prompts[0], 8)
        why = str(e.value).split("(log:")[0].removeprefix("vLLM: ").strip()
        record(family, "eagle3", "vllm", f"no: {why}")
        return
    theirs, ours = served_in_vllm(target, out, spec, prompts, family)
    assert max(abs(a - b) for a, b in zip(theirs, ours, strict=True)) <= 0.03, (theirs, ours)
    record(
        family,
        "eagle3",
        "vllm",
        "Y (" + " / ".join(f"{a:.2f} vs {b:.2f}" for a, b in zip(theirs, ours, strict=True)) + ")",
    )


@pytest.mark.parametrize("method", ["eagle1", "eagle3", "peagle"])
def test_eagle_drafts_read_the_targets_embedding_table_as_engines_do(method):
    """Gemma's transformers embedding module multiplies its rows by sqrt(H); vLLM and SGLang
    apply that scale in the target's forward, and the EAGLE drafts they serve share the bare
    table. The heads read the bare rows too: an EAGLE-1 head's FC reads them unnormed, so a
    head trained on scaled rows drafts otherwise when served (tested in vLLM below)."""
    target = family_target("gemma3")
    module = target.embed_tokens
    ids = torch.tensor([[1, 40, 250]])
    assert float(module.embed_scale) == target.hidden_size**0.5  # the target's module scales
    cfg = METHODS[method].config_class()
    if hasattr(cfg, "fuse_layers"):
        cfg.fuse_layers = [1, 2, 3]
    if hasattr(cfg, "mask_token_id"):
        cfg.mask_token_id = 256
    got = METHODS[method](target, cfg)._embed(ids)
    assert torch.equal(got, module.weight[ids].to(got.dtype))
    assert not torch.allclose(got, module(ids).to(got.dtype))


@needs_vllm
def test_vllm_serves_an_eagle1_head_of_a_target_that_scales_its_embedding(tmp_path):
    """An EAGLE-1 head of a tiny Gemma-3 target whose FC reads the token's embedding (and a
    bias: it accepts part of the time), exported as ``eagle1-vllm``: vLLM's output is the
    target's greedy one and it accepts what ours does (within 0.03). Trained on the scaled
    rows, ours accepted 0.37 / 0.20 / 0.13 a position where vLLM accepted 0.25 / 0.03 / 0.02."""
    from decoding.engines.vllm_eval import speculative_config
    from models.export import export

    target = family_target("gemma3", tiny_head_dim=64)
    H = target.hidden_size
    torch.manual_seed(0)
    head = METHODS["eagle1"](target, METHODS["eagle1"].config_class()).eval()
    with torch.no_grad():  # FC: embedding + feature + a bias; the layer adds nothing
        head.fc.weight.copy_(torch.cat([torch.eye(H), torch.eye(H)], dim=1))
        head.fc.bias.copy_(torch.randn(H, generator=torch.Generator().manual_seed(0)))
        head.layer.self_attn.o_proj.weight.zero_()
        head.layer.mlp.down_proj.weight.zero_()
    out = tmp_path / "e1"
    export(head, "eagle1-vllm", out, dtype="float32", log=lambda *_: None)
    prompts = [[1, 40 + i, 50 + 2 * i, 60, 70 + i] for i in range(4)]
    spec = speculative_config(out, "eagle1-vllm", 3)
    theirs, ours = served_in_vllm(target, out, spec, prompts, "gemma3")
    assert ours[0] >= 0.05, ours  # it accepts: else the comparison could not fail
    assert max(abs(a - b) for a, b in zip(theirs, ours, strict=True)) <= 0.03, (theirs, ours)


def attending(head, o: float = 0.03, seed: int = 0):
    """``head`` with random attention weights in its draft layer (q and k at 4/sqrt(fan-in), v
    at 1/sqrt(fan-in), o at ``o``/sqrt(fan-in), seeded), so that what it drafts depends on
    which positions its attention reads."""
    g = torch.Generator().manual_seed(seed)
    attn = head.midlayer.self_attn if hasattr(head, "midlayer") else head.layer.self_attn
    with torch.no_grad():
        for name, scale in (("q_proj", 4.0), ("k_proj", 4.0), ("v_proj", 1.0), ("o_proj", o)):
            w = getattr(attn, name).weight
            w.copy_(torch.randn(w.shape, generator=g) * scale / w.shape[1] ** 0.5)
    return head


@needs_vllm
@pytest.mark.parametrize("method", ["eagle3", "peagle"])
def test_vllm_and_ours_read_the_window_of_a_target_whose_every_layer_slides(method, tmp_path):
    """A Mistral-shaped target (every layer slides, window 24): vLLM gives its draft's layers
    that window, and so does the built-in decoder. A head whose attention weighs in on what it
    drafts, 64-token answers (past the window): vLLM's acceptance by position is ours within
    0.015. EAGLE-3: 0.983 / 0.148 / 0.061 against 0.991 / 0.153 / 0.064 (reading the whole
    context, ours was 0.982 / 0.191 / 0.075); P-EAGLE (one forward, mask slots at the next
    positions): 0.454 / 0.105 / 0.105 against 0.460 / 0.109 / 0.104 (whole: 0.422 / 0.106 /
    0.101)."""
    from test_vllm import peagle_lens

    from decoding.engines.vllm_eval import speculative_config
    from models.export import export

    target = family_target("mistral", tiny_head_dim=64)
    assert target.draft_window == 24
    if method == "eagle3":
        head, fmt = attending(lens_head(target), o=0.02), "vllm"
    else:
        cls, V = METHODS["peagle"], target.config.vocab_size
        cfg = cls.config_class(
            fuse_layers=[1, 2, 3], draft_vocab_size=V, mask_token_id=256, ttt_steps=3
        )
        torch.manual_seed(0)
        head = cls(target, cfg).eval()
        head.vocab_chosen = True
        head, fmt = attending(peagle_lens(head), o=0.03), "peagle"
    out = tmp_path / "x"
    export(head, fmt, out, dtype="float32", log=lambda *_: None)
    prompts = [[1, 40 + i, 50 + 2 * i, 60, 70 + i] for i in range(4)]
    theirs, ours = served_in_vllm(target, out, speculative_config(out, fmt, 3), prompts, "mistral")
    assert ours[1] >= 0.05, ours  # it accepts past position 1: else the test could not fail
    assert max(abs(a - b) for a, b in zip(theirs, ours, strict=True)) <= 0.015, (theirs, ours)


# -- in llama.cpp -----------------------------------------------------------------------------

#: what llama.cpp b11434 does with a tiny target of each family (converted by its own
#: converter) and our EAGLE-3 GGUF for it: None where it serves the head, else the start of the
#: line that refuses it (ours, before a server starts, where the architecture gives the draft
#: no layer inputs; the converter's, where it cannot convert the tiny target)
LLAMA_CPP = {
    "llama3": None,
    "qwen2": "a 'qwen2' target: llama.cpp b11434 feeds eagle3 drafts",
    "qwen3": None,
    "qwen3_moe": None,
    "mixtral": None,
    "mistral": None,
    "gemma2": "llama.cpp's converter failed .*tokenizer.model",
    "gemma3": "a 'gemma3' target: llama.cpp b11434 feeds eagle3 drafts",
    "phi3": "llama.cpp's converter failed .*tokenizer.model",
    "gpt_oss": None,
    "deepseek_v3": "a 'deepseek2' target: llama.cpp b11434 feeds eagle3 drafts",
    "olmo2": "a 'olmo2' target: llama.cpp b11434 feeds eagle3 drafts",
}


@needs_engine
@pytest.mark.parametrize("family", NAMES)
def test_llama_cpp_serves_our_eagle3_gguf_for_each_family_it_supports(family, tmp_path):
    """llama.cpp's converter turns the tiny target into the GGUF its server loads, our EAGLE-3
    GGUF goes beside it, and the server decodes: its speculative output is its plain one, and
    its acceptance per position is ours within 0.03 over the tokens where its output is the
    target's greedy one (at least a quarter of them). Where llama.cpp cannot serve the pair,
    the line that says so is pinned."""
    from decoding.decoder import SpeculativeDecoder
    from decoding.engines.base import EngineError
    from decoding.engines.llama_cpp import LlamaServer, check_feature_target, converted_target
    from models.base import DecodeSettings
    from models.export import export, import_draft
    from models.sampling import Sampling

    target = family_target(family)
    out = tmp_path / "gguf"
    prompts = [[1, 40 + i, 50 + 2 * i, 60, 70 + i] for i in range(4)]
    eos = {target.tokenizer.eos_token_id}
    try:
        tg = converted_target(target, log=lambda *_: None)
        check_feature_target(tg, "draft-eagle3")  # as the evaluator: before any server
        export(lens_head(target), "gguf", out, dtype="float32", log=lambda *_: None,
               target_gguf_path=tg)  # fmt: skip
        with (
            LlamaServer(tg) as plain,
            LlamaServer(tg, out / "draft.gguf", spec_type="draft-eagle3", n_max=3) as spec,
        ):
            plains = [plain.complete(p, 64) for p in prompts]
            specs = [spec.complete(p, 64) for p in prompts]
    except EngineError as e:
        why = str(e).split(" (log:")[0]
        assert LLAMA_CPP[family] is not None, f"{family}: {why}"
        assert re.search(LLAMA_CPP[family], why), why
        short = re.sub(r"^\S+: ", "", why).split(" (on this one")[0]
        short = re.sub(r" on /\S+: \w+: .*Missing /\S+/| on /\S+: \w+: .*not found: /\S+/",
                       " here: it needs a SentencePiece ", short)  # fmt: skip
        short = re.sub(r"feeds eagle3 drafts the layer inputs of .* targets only",
                       "gives EAGLE-3 drafts no layer inputs for it", short)  # fmt: skip
        record(family, "eagle3", "llama.cpp", f"no: {short}")
        return
    assert LLAMA_CPP[family] is None, f"{family}: served, but expected {LLAMA_CPP[family]!r}"
    theirs_tokens = [[t for t in o.tokens if t not in eos] for o in specs]
    assert theirs_tokens == [[t for t in o.tokens if t not in eos] for o in plains], family
    mine = import_draft(out, target).proposer(DecodeSettings(tree="chain"))

    def ours(n: list[int]):
        dec = SpeculativeDecoder(target, mine, Sampling(), gamma=3, adaptive=False)
        got = [[t for t in dec.generate(p, k, stop_ids=eos) if t not in eos]
               for p, k in zip(prompts, n, strict=True)]  # fmt: skip
        return got, dec.stats

    got, _ = ours([64] * len(prompts))
    # the engine's target is its converter's: where its output parts from ours (a near-tie of a
    # random target, or a layer the engine computes otherwise), compare up to there
    same = [common_prefix(x, y) for x, y in zip(theirs_tokens, got, strict=True)]
    assert sum(same) >= 64, f"{family}: llama.cpp's output parts from the target's at {same}"
    _, s = ours(same)
    steps = []
    for o, n in zip(specs, same, strict=True):
        pos = 1  # the first token comes from the prompt's prefill
        for a, d in o.steps:
            if pos >= n:
                break
            steps.append((min(a, n - pos), d))
            pos += a + 1
    assert steps
    theirs = steps_acceptance(steps, 3)
    mine_acc = our_acceptance(s, 3)
    assert max(abs(a - b) for a, b in zip(theirs, mine_acc, strict=True)) <= 0.03, (
        theirs,
        mine_acc,
    )
    total = sum(len(x) for x in got)
    part = (
        "" if sum(same) == total else f"; outputs equal to ours for {sum(same)} of {total} tokens"
    )
    pairs = " / ".join(f"{a:.2f} vs {b:.2f}" for a, b in zip(theirs, mine_acc, strict=True))
    record(family, "eagle3", "llama.cpp", f"Y ({pairs}{part})")


def common_prefix(a: list[int], b: list[int]) -> int:
    """How many tokens ``a`` and ``b`` share from the start."""
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def test_a_target_no_draft_can_be_built_against_stops_before_its_weights(tmp_path):
    """A state-space model (Mamba: no attention heads) and an encoder-decoder (T5) are refused
    from their config.json alone, in one line naming what is missing: the folders hold no
    weights, so a load that got that far would fail otherwise."""
    from transformers import MambaConfig, T5Config

    from models.target import TargetConfig, TargetError, load_target
    from models.tiny import build_tiny_tokenizer

    for name, config, what in [
        (
            "mamba",
            MambaConfig(vocab_size=259, hidden_size=64, num_hidden_layers=2),
            "no num_attention_heads",
        ),
        ("t5", T5Config(vocab_size=259, d_model=64), "no decoder-only architecture"),
    ]:
        folder = tmp_path / name
        build_tiny_tokenizer().save_pretrained(str(folder))
        config.save_pretrained(str(folder))
        with pytest.raises(TargetError, match=what) as e:
            load_target(TargetConfig(name="hf", path=str(folder), device="cpu"))
        assert "\n" not in str(e.value) and "cannot load" not in str(e.value)
