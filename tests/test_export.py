"""specdraft-export: every format round-trips through our reader; broken exports are errors."""

from __future__ import annotations

import json
import os
import shutil
import stat

import pytest
import torch
from conftest import every_third_eagle3, run_module
from safetensors.torch import load_file, save_file

from models import FORMATS
from models import export as ex
from models.eagle import Eagle1Config, Eagle3Config, Eagle3Head, EagleHead
from models.export import ExportError, detect_format, export, import_draft
from models.target import Target, TargetConfig
from models.tiny import build_tiny_target


@pytest.fixture(scope="module")
def target4():
    """A 4-layer tiny target, so that EAGLE-3 can fuse three distinct layers."""
    model, tok = build_tiny_target(seed=1, num_layers=4)
    return Target(model, tok, "tiny4", TargetConfig(name="tiny_random"))


def eagle1(target, seed=0):
    torch.manual_seed(seed)
    return EagleHead(target, Eagle1Config()).eval()


@pytest.mark.parametrize("fmt", ["sglang", "vllm", "speculators", "eagle1", "eagle1-vllm"])
def test_export_round_trips(target4, tmp_path, fmt):
    head = eagle1(target4) if fmt.startswith("eagle1") else every_third_eagle3(target4)
    out = tmp_path / fmt
    summary = export(head, fmt, out, dtype="float32", log=lambda *_: None)
    assert detect_format(out) == fmt
    back = import_draft(out, target4)
    prompt = ex.default_prompt(target4)
    a, b = ex.proposals(head, prompt), ex.proposals(back, prompt)
    assert torch.equal(a.pop("logits"), b.pop("logits"))  # bit for bit at equal precision
    assert a == b and summary["chain"] == a["chain"]
    cfg = json.loads((out / "config.json").read_text())
    names = (
        set(load_file(str(out / "model.safetensors")))
        if fmt != "eagle1"
        else set(torch.load(out / "pytorch_model.bin", weights_only=True))
    )
    if fmt == "eagle1":
        # no "bias" key: the reference reads its absence as FC's bias, Llama loaders (vLLM's)
        # its presence as attention biases, left unset since the layout holds none
        assert "bias" not in cfg and "layers.0.input_layernorm.weight" not in names
        assert {"fc.bias", "embed_tokens.weight"} <= names
    elif fmt == "eagle1-vllm":
        assert "bias" not in cfg and cfg["attention_bias"] is True
        assert "fc.bias" not in names and "embed_tokens.weight" in names
        assert {f"layers.0.self_attn.{n}_proj.bias" for n in "qkvo"} <= names
    else:
        # speculators' loader reads the embedding from the checkpoint (zeros if absent)
        assert ("embed_tokens.weight" in names) == (fmt == "speculators")
        assert {"d2t", "t2d", "fc.weight"} <= names
        prefix = "layers.0." if fmt == "speculators" else "midlayer."
        assert f"{prefix}hidden_norm.weight" in names
    if fmt == "sglang":  # SGLang counts layer outputs: our hidden_states index minus one
        assert cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [0, 1, 2]
    if fmt == "vllm":
        assert cfg["eagle_aux_hidden_state_layer_ids"] == [1, 2, 3]
        assert cfg["norm_before_residual"] is False
    if fmt == "speculators":
        assert cfg["speculators_config"]["verifier"]["name_or_path"]
        assert cfg["transformer_layer_config"]["num_hidden_layers"] == 1
    umask = os.umask(0)
    os.umask(umask)
    for p in [out, *out.iterdir()]:  # readable by a serving engine running as another user
        assert stat.S_IMODE(p.stat().st_mode) == (0o777 if p.is_dir() else 0o666) & ~umask, p


SPECULATORS_FLAGS = {"norm_before_fc": True, "norm_before_residual": True, "norm_output": True}


def test_speculators_layout_variants_round_trip(target4, tmp_path):
    """Heads in the layout speculators' trainer writes (a norm over the fused features, a
    normed residual, normed outputs fed forward) export and read back identically, and the
    config says so explicitly; formats that cannot express them refuse with a message."""
    head = every_third_eagle3(target4, **SPECULATORS_FLAGS)
    assert "input_norm.weight" in head.state_dict()
    out = tmp_path / "spec"
    export(head, "speculators", out, dtype="float32", log=lambda *_: None)
    cfg = json.loads((out / "config.json").read_text())
    assert all(cfg[k] is True for k in SPECULATORS_FLAGS) and cfg["fc_norm"] is False
    back = import_draft(out, target4)
    assert all(getattr(back.cfg, k) for k in SPECULATORS_FLAGS)
    prompt = ex.default_prompt(target4)
    a, b = ex.proposals(head, prompt), ex.proposals(back, prompt)
    assert torch.equal(a.pop("logits"), b.pop("logits")) and a == b
    # the flags change what the head computes (a loader that ignored them would differ)
    plain = every_third_eagle3(target4)
    plain.load_state_dict({k: v for k, v in head.state_dict().items() if "input_norm" not in k})
    assert not torch.equal(
        ex.proposals(plain, prompt)["logits"], ex.proposals(head, prompt)["logits"]
    )
    with pytest.raises(ExportError, match="speculators"):
        export(head, "sglang", tmp_path / "sg", dtype="float32", log=lambda *_: None)


def test_a_normed_residual_head_is_refused_by_name_where_the_layout_cannot_record_it(
    target4, tmp_path
):
    """``norm_before_residual`` alone: the SGLang config has no place for it, and the export
    failed only at its read-back, saying the layer ids might be written wrongly."""
    head = every_third_eagle3(target4, norm_before_residual=True)
    with pytest.raises(ExportError, match="norm_before_residual=True"):
        export(head, "sglang", tmp_path / "sg", dtype="float32", log=lambda *_: None)
    assert not (tmp_path / "sg").exists()
    export(head, "vllm", tmp_path / "v", dtype="float32", log=lambda *_: None)
    assert json.loads((tmp_path / "v" / "config.json").read_text())["norm_before_residual"]


@pytest.mark.parametrize("fmt", ["vllm", "speculators"])
def test_eagle3_1_round_trips_where_vllm_reads_it(target4, tmp_path, fmt):
    """EAGLE 3.1 (a norm per fused layer, normed outputs fed forward) exports to both vLLM
    layouts with its flags and fc_norm.{0,1,2}, reads back identically, and differs from the
    head without the norms; the layouts no engine reads them from refuse in one line."""
    flags = {"fc_norm": True, "norm_output": True}
    head = every_third_eagle3(target4, **flags)
    with torch.no_grad():
        for i, n in enumerate(head.fc_norm):
            n.weight.mul_(1.0 + 0.5 * i)  # distinct, so a swapped or dropped norm shows
    out = tmp_path / fmt
    export(head, fmt, out, dtype="float32", log=lambda *_: None)
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["fc_norm"] is True and cfg["norm_output"] is True
    names = set(load_file(str(out / "model.safetensors")))
    assert {f"fc_norm.{i}.weight" for i in range(3)} <= names
    back = import_draft(out, target4)
    assert back.cfg.fc_norm and back.cfg.norm_output
    prompt = ex.default_prompt(target4)
    a, b = ex.proposals(head, prompt), ex.proposals(back, prompt)
    assert torch.equal(a.pop("logits"), b.pop("logits")) and a == b
    plain = every_third_eagle3(target4, norm_output=True)
    plain.load_state_dict({k: v for k, v in head.state_dict().items() if "fc_norm" not in k})
    assert not torch.equal(
        ex.proposals(plain, prompt)["logits"], ex.proposals(head, prompt)["logits"]
    )
    with pytest.raises(ExportError, match="fc_norm=True.*--format vllm or --format speculators"):
        export(head, "sglang", tmp_path / "sg", dtype="float32", log=lambda *_: None)


def test_eagle3_1_fused_state_ignores_each_layers_scale(target4):
    """With a norm per fused layer, scaling one layer's features (the drift EAGLE 3.1 fixes)
    leaves the fused state as it was; without, it moves it."""
    g = torch.Generator().manual_seed(0)
    f = torch.randn(5, 4, target4.hidden_size, generator=g)
    scaled = f.clone()
    scaled[:, 2] *= 40.0
    h31, h3 = every_third_eagle3(target4, fc_norm=True), every_third_eagle3(target4)
    with torch.no_grad():
        assert torch.allclose(h31.initial_hidden(f), h31.initial_hidden(scaled), atol=1e-4)
        assert not torch.allclose(h3.initial_hidden(f), h3.initial_hidden(scaled), atol=1e-2)


def test_bf16_export_is_compared_at_its_own_precision(target4, tmp_path):
    export(every_third_eagle3(target4), "vllm", tmp_path / "v", log=lambda *_: None)
    w = load_file(str(tmp_path / "v" / "model.safetensors"))
    assert w["fc.weight"].dtype == torch.bfloat16 and w["d2t"].dtype == torch.int64


def test_untrained_vocabulary_mapping_is_refused(target4, tmp_path):
    head = Eagle3Head(target4, Eagle3Config(fuse_layers=[1, 2, 3], draft_vocab_size=64))
    with pytest.raises(ExportError, match="d2t is all zeros.*never chosen"):
        export(head, "sglang", tmp_path / "x", log=lambda *_: None)
    assert not (tmp_path / "x").exists() and list(tmp_path.iterdir()) == []  # no debris


def assistant_split(vocab_size: int):
    """A tokenised split whose assistant tokens cover every id (counts vary, so the choice is
    a real one)."""
    from datasets import Dataset

    ids = [list(range(vocab_size)), list(range(0, vocab_size, 3))]
    return Dataset.from_dict({"input_ids": ids, "loss_mask": [[1] * len(r) for r in ids]})


EAGLE3_D2T_FORMATS = ["sglang", "vllm", "speculators", "gguf", "peagle"]


@pytest.mark.parametrize("fmt", EAGLE3_D2T_FORMATS)
def test_full_vocabulary_head_exports_its_identity_mapping(target4, tmp_path, fmt):
    """When the draft vocabulary is the whole vocabulary, the chosen mapping is the identity
    (d2t all zeros): saved by training and loaded back, the head exports in every format that
    checks d2t; the same head never given its vocabulary is refused."""
    from conftest import tiny_target_gguf

    from models import METHODS

    method = "peagle" if fmt == "peagle" else "eagle3"
    cls = METHODS[method]
    extra = {"mask_token_id": 256} if method == "peagle" else {}
    cfg = cls.config_class(fuse_layers=[1, 2, 3], **extra)
    head = cls(target4, cfg).eval()
    V = target4.config.vocab_size
    assert head.cfg.draft_vocab_size == V  # the default, capped at the vocabulary
    opts = (
        {"target_gguf_path": tiny_target_gguf(tmp_path / "t.gguf", target4)}
        if fmt == "gguf"
        else {}
    )
    with pytest.raises(ExportError, match="never chosen"):
        export(head, fmt, tmp_path / "untrained", dtype="float32", log=lambda *_: None, **opts)
    head.init_from_data(assistant_split(V), log=lambda *_: None)
    assert not head.d2t.any()
    head.save_draft(tmp_path / "draft")
    trained = ex.load_trained_head(tmp_path / "draft", target4)
    export(trained, fmt, tmp_path / fmt, dtype="float32", log=lambda *_: None, **opts)
    assert not import_draft(tmp_path / fmt, target4).d2t.any()
    if fmt != "gguf":  # the identity is left out: vLLM refuses a d2t it did not register
        from safetensors import safe_open

        with safe_open(str(tmp_path / fmt / "model.safetensors"), "pt") as f:
            assert not {"d2t", "t2d"} & set(f.keys())


def test_the_chosen_vocabulary_survives_init_from_and_older_saves(target4, tmp_path):
    """A head started from a saved full-vocabulary head (``train.init_from``) keeps the record
    that its identity mapping was chosen; a draft saved before the record was kept counts as
    chosen where its vocabulary is the whole one (the one mapping there is), and not where it
    is a reduced one left at the placeholder."""
    import json

    cfg = Eagle3Config(fuse_layers=[1, 2, 3])
    head = Eagle3Head(target4, cfg).eval()
    head.init_from_data(assistant_split(target4.config.vocab_size), log=lambda *_: None)
    head.save_draft(tmp_path / "a")
    fresh = Eagle3Head(target4, cfg).eval()
    fresh.start_from(Eagle3Head.load_draft(tmp_path / "a", target4))
    export(fresh, "vllm", tmp_path / "v", dtype="float32", log=lambda *_: None)

    f = tmp_path / "a" / "config.json"
    saved = json.loads(f.read_text())
    f.write_text(json.dumps({k: v for k, v in saved.items() if k != "draft_vocab_chosen"}))
    assert Eagle3Head.load_draft(tmp_path / "a", target4).vocab_chosen
    small = Eagle3Head(target4, Eagle3Config(fuse_layers=[1, 2, 3], draft_vocab_size=64))
    small.save_draft(tmp_path / "b")
    f = tmp_path / "b" / "config.json"
    saved = json.loads(f.read_text())
    assert saved["draft_vocab_chosen"] is False
    f.write_text(json.dumps({k: v for k, v in saved.items() if k != "draft_vocab_chosen"}))
    assert not Eagle3Head.load_draft(tmp_path / "b", target4).vocab_chosen


def test_dflash_vocabulary_never_chosen_is_refused(target4, tmp_path):
    """A DFlash draft over a reduced vocabulary exports once training chose its vocabulary,
    and is refused while its mapping is the placeholder it was built with."""
    from models.dflash import DFlashConfig, DFlashDraft

    cfg = DFlashConfig(draft_vocab_size=64, mask_token_id=256, block_size=4, fuse_layers=[1, 2])
    d = DFlashDraft(target4, cfg).eval()
    with pytest.raises(ExportError, match="d2t is all zeros.*never chosen"):
        export(d, "dflash", tmp_path / "x", dtype="float32", log=lambda *_: None)
    d.init_from_data(assistant_split(target4.config.vocab_size), log=lambda *_: None)
    export(d, "dflash", tmp_path / "y", dtype="float32", log=lambda *_: None)


def test_wrong_keys_and_shapes_are_named(target4, tmp_path, monkeypatch):
    head = every_third_eagle3(target4)
    fmt = FORMATS["vllm"]
    real = fmt.tensors

    def extra_key(*a):
        t = real(*a)
        t["embed_tokens.weight"] = target4.embed_tokens.weight.detach().clone()
        return t

    monkeypatch.setattr(fmt, "tensors", extra_key)
    with pytest.raises(ExportError, match=r"unexpected keys \['embed_tokens.weight'\]"):
        export(head, "vllm", tmp_path / "a", log=lambda *_: None)

    def bad_shape(*a):
        t = real(*a)
        t["lm_head.weight"] = t["lm_head.weight"][:-1]
        return t

    monkeypatch.setattr(fmt, "tensors", bad_shape)
    with pytest.raises(ExportError, match="lm_head.weight has shape"):
        export(head, "vllm", tmp_path / "b", log=lambda *_: None)
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()


def test_wrong_layer_ids_are_caught_by_the_re_import(target4, tmp_path, monkeypatch):
    """An SGLang config written with our index unshifted loads, but fuses other layers: the
    comparison with the in-memory head must catch it."""
    fmt = FORMATS["sglang"]
    real = fmt.config

    def unshifted(head, *a, **kw):
        cfg = real(head, *a, **kw)
        cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] = [0, 1, 1]
        return cfg

    monkeypatch.setattr(fmt, "config", unshifted)
    with pytest.raises(ExportError, match="logits differ"):
        export(every_third_eagle3(target4), "sglang", tmp_path / "s", log=lambda *_: None)


def test_the_re_import_is_compared_on_one_run_of_the_target(tmp_path, monkeypatch):
    """A target whose low-precision forward takes another kernel path from one call to the
    next (states a unit in the last place apart) does not fail the comparison: both drafts
    read the same states. Layer ids written wrongly are still caught (the test above)."""
    model, tok = build_tiny_target(seed=1, num_layers=4)
    target = Target(model, tok, "tiny4", TargetConfig(name="tiny_random"))
    real = Target.forward_features
    calls = {"n": 0}

    def drifting(self, *a, **kw):
        out = real(self, *a, **kw)
        calls["n"] += 1
        return (out[0], out[1] + 0.05 * calls["n"])  # another result on every call

    monkeypatch.setattr(Target, "forward_features", drifting)
    ids, mask = torch.tensor([[5, 6, 7]]), torch.ones(1, 3, dtype=torch.long)
    assert not torch.equal(target.features(ids, mask, (1,)), target.features(ids, mask, (1,)))
    with target.features_held():
        first = target.features(ids, mask, (1,))
        kept = first.clone()
        first.add_(1.0)  # a caller's in-place change does not reach the next caller
        again = target.features(ids, mask, (1,))
        assert torch.equal(again, kept)
        assert not torch.equal(target.features(ids, mask, (2,)), again)  # other layers: computed
    assert not torch.equal(target.features(ids, mask, (1,)), again)  # outside: computed afresh
    for fmt in ("vllm", "sglang"):
        export(every_third_eagle3(target), fmt, tmp_path / fmt, dtype="float32", log=print)


def test_the_serve_line_names_a_target_vllm_can_load(tmp_path):
    """A tiny random target exists only in memory: the serve line names its folder under the
    cache (the one engine=vllm serves), not its identity."""
    from models.export import verifier_name
    from models.target import load_target, target_folder

    t = load_target(TargetConfig(name="tiny_random", tiny_layers=4, cache_dir=str(tmp_path)))
    said = []
    export(every_third_eagle3(t), "vllm", tmp_path / "v", log=said.append)
    folder = target_folder(t)
    assert verifier_name(t) == str(folder) and (folder / "config.json").exists()
    assert said[-1].startswith(f"serve it in vLLM: vllm serve {folder} ")
    assert not any("SGLang" in line for line in said)  # not SGLang's layout


def _vllm_reads_layer_ids(config: dict) -> list[int] | None:
    """The layer ids vLLM 0.32 fuses for an EAGLE-3 draft's config, as its model runner reads
    them (``_get_eagle3_aux_layers_from_config``): the top-level
    ``eagle_aux_hidden_state_layer_ids``, else ``eagle_config``'s, both as they are, each the
    input of decoder layer k (our ``hidden_states`` index k)."""
    ids = config.get("eagle_aux_hidden_state_layer_ids")
    if not ids:
        ids = (config.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    return list(ids) if ids else None


def test_every_eagle3_layout_vllm_serves_fuses_the_trained_layers_there(target4, tmp_path):
    """A random head accepts next to nothing whichever layers an engine fuses, so the engine
    tests cannot see fused layers shifted by one: the SGLang layout (ids counted as layer
    outputs) was offered for vLLM, which reads those ids as its own and fuses the layers
    below the trained ones."""
    head = every_third_eagle3(target4)
    served = [f for f in FORMATS.values() if f.vllm_method == "eagle3" and "eagle3" in f.methods]
    assert {f.name for f in served} == {"vllm", "speculators"}
    for fmt in served:
        out = tmp_path / fmt.name
        export(head, fmt.name, out, dtype="float32", log=lambda *_: None)
        config = json.loads((out / "config.json").read_text())
        assert _vllm_reads_layer_ids(config) == [1, 2, 3], fmt.name
    assert FORMATS["sglang"].vllm_method is None  # its ids read by vLLM: [0, 1, 2]


def test_an_sglang_export_says_how_sglang_serves_it(target4, tmp_path):
    """``--format sglang`` prints (and writes in its README) SGLang's launch line for a chain
    of gamma, and no vLLM line (vLLM would fuse other layers from it)."""
    said = []
    out = tmp_path / "sg"
    r = export(every_third_eagle3(target4), "sglang", out, log=said.append, gamma=4)
    line = r["sglang_serve"]
    assert line.startswith("python -m sglang.launch_server --model-path ")
    assert f"--speculative-algorithm EAGLE3 --speculative-draft-model-path {out.resolve()} " in line
    assert line.endswith(
        "--speculative-num-steps 4 --speculative-eagle-topk 1 --speculative-num-draft-tokens 5"
    )
    assert f"serve it in SGLang: {line}" in said and r["vllm_serve"] is None
    assert line in (out / "README.md").read_text()


def test_existing_output_is_kept_without_force(target4, tmp_path):
    out = tmp_path / "o"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    with pytest.raises(ExportError, match="already exists"):
        export(every_third_eagle3(target4), "vllm", out, log=lambda *_: None)
    assert (out / "keep.txt").read_text() == "mine"
    # nor with --force: it replaces an earlier export only, never files of the user's
    with pytest.raises(ExportError, match=r"not an earlier export \(keep.txt\)"):
        export(every_third_eagle3(target4), "vllm", out, force=True, log=lambda *_: None)
    assert (out / "keep.txt").read_text() == "mine"
    (out / "keep.txt").unlink()
    export(
        every_third_eagle3(target4), "vllm", out, force=True, log=lambda *_: None
    )  # an empty folder
    export(every_third_eagle3(target4), "speculators", out, force=True, log=lambda *_: None)
    assert detect_format(out) == "speculators"  # an earlier export, replaced


def test_an_out_that_is_a_file_is_refused_even_with_force(target4, tmp_path):
    data = tmp_path / "data.jsonl"
    data.write_text("mine")
    for out in (data, data / "export"):
        with pytest.raises(ExportError, match="a file, not a folder"):
            export(every_third_eagle3(target4), "vllm", out, force=True, log=lambda *_: None)
    assert data.read_text() == "mine"
    with pytest.raises(ExportError, match="nothing can be written in /proc"):  # no file goes in
        export(every_third_eagle3(target4), "vllm", "/proc/specdraft/v", log=lambda *_: None)


def test_checkpoint_without_d2t_is_refused_on_import(target4, tmp_path):
    export(every_third_eagle3(target4), "vllm", tmp_path / "v", log=lambda *_: None)
    f = tmp_path / "v" / "model.safetensors"
    w = load_file(str(f))
    del w["d2t"]
    save_file(w, str(f))
    with pytest.raises(ExportError, match="no d2t"):
        import_draft(tmp_path / "v", target4)


def test_eagle1_for_vllm_folds_fcs_bias_into_the_layer_exactly(target4, tmp_path):
    """vLLM's EAGLE-1 FC has no bias: the layout moves it into the decoder layer (q/k/v biases
    W b, an o_proj bias b), which computes the same layer output. The folded layer, run as a
    plain Llama layer with biases on the bias-free FC's output, gives the head's own output;
    bf16 files read back within rounding; a file whose q/k/v biases are not W b is refused."""
    from safetensors.torch import load_file, save_file
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    head = eagle1(target4)
    with torch.no_grad():
        head.fc.bias.normal_(0, 1.0)  # a bias that matters
    out = tmp_path / "v"
    export(head, "eagle1-vllm", out, dtype="float32", log=lambda *_: None)
    w = load_file(str(out / "model.safetensors"))
    cfg = target4.draft_layer_config()
    cfg.attention_bias = True  # what vLLM builds from the written config
    layer = LlamaDecoderLayer(cfg, 0).eval()
    layer.input_layernorm = torch.nn.Identity()
    layer.load_state_dict(
        {k.removeprefix("layers.0."): v for k, v in w.items() if "layers.0." in k}
    )
    x = torch.randn(1, 7, 2 * target4.hidden_size)
    pos = torch.arange(7)[None]
    rope = target4.rotary_embedding()(x, pos)
    with torch.no_grad():
        ours = head.layer(head.fc(x), position_embeddings=rope, position_ids=pos)
        theirs = layer(x @ w["fc.weight"].T, position_embeddings=rope, position_ids=pos)
    ours, theirs = (o[0] if isinstance(o, tuple) else o for o in (ours, theirs))
    assert torch.allclose(ours, theirs, atol=1e-5), (ours - theirs).abs().max()
    export(head, "eagle1-vllm", tmp_path / "b", dtype="bfloat16", log=lambda *_: None)
    back = import_draft(tmp_path / "b", target4)
    assert torch.allclose(back.fc.bias, head.fc.bias, atol=1e-2)
    w["layers.0.self_attn.k_proj.bias"] += 0.1  # an attention bias of its own
    save_file(w, str(out / "model.safetensors"))
    with pytest.raises(ExportError, match=r"k_proj.bias is not FC's bias folded in"):
        import_draft(out, target4)


def test_eagle1_head_exports_only_as_eagle1(target4, tmp_path):
    with pytest.raises(ExportError, match="exports eagle3 or hass drafts; this is eagle1"):
        export(eagle1(target4), "sglang", tmp_path / "x", log=lambda *_: None)
    with pytest.raises(ExportError, match="exports eagle1 drafts"):
        export(every_third_eagle3(target4), "eagle1", tmp_path / "y", log=lambda *_: None)


def test_cli_export_then_evaluate_the_export(data_file, tmp_path):
    """Train on the tiny target, export with the CLI, then specdraft-eval the exported
    folder: the decoder reads the serving layout and stays lossless."""
    from conftest import compose, tiny_overrides

    from trainer.train import run

    run_dir = tmp_path / "run"
    run(compose(tiny_overrides(data_file, run_dir, **{"train.max_steps": 2})))
    r = run_module("flow.export", [str(run_dir), "--format", "eagle1"])
    assert r.returncode == 0, r.stderr[-2000:]
    assert "re-imported: identical draft logits" in r.stdout
    out = run_dir / "export-eagle1"
    rep = tmp_path / "r.json"
    r = run_module(
        "decoding.eval",
        [
            "target=tiny_random",
            f"draft={out}",
            "num_prompts=2",
            "max_new_tokens=12",
            f"report={rep}",
        ],
        300,
    )
    assert r.returncode == 0, r.stderr[-2000:]
    report = json.loads(rep.read_text())
    assert report["lossless"] is True and "eagle1 layout" in report["settings"]["draft_description"]
    r = run_module("flow.export", [str(run_dir), "--format", "eagle1"])
    assert r.returncode == 2 and "already exists" in r.stderr
    r = run_module("flow.export", [str(tmp_path), "--format", "vllm"])
    assert r.returncode == 2 and "no saved draft" in r.stderr


def test_force_never_replaces_the_run_or_the_draft_it_exports(
    data_file, tmp_path, capsys, monkeypatch
):
    """--force replaces an earlier export only: an --out that is the run, its draft, a folder
    above them, its checkpoints or any folder of other files is refused in one line and
    nothing is deleted; so are a bad --gamma, an --out nothing can be written to, a format of
    another method (before a target is converted for it), an export passed as the draft and
    a run that has not written final/ yet (which names its newest checkpoint)."""
    from conftest import compose, tiny_overrides

    from flow.export import main
    from trainer.train import run

    run_dir = tmp_path / "run"
    run(
        compose(tiny_overrides(data_file, run_dir, **{"train.max_steps": 2, "train.save_every": 1}))
    )
    before = sorted(str(p.relative_to(run_dir)) for p in run_dir.rglob("*"))
    capsys.readouterr()  # the training's own output

    def refused(*argv: str) -> str:
        with pytest.raises(SystemExit) as e:
            main([*map(str, argv), "--format", "eagle1"])
        assert e.value.code == 2
        err = capsys.readouterr().err.strip()
        assert err.startswith("error: ") and "\n" not in err, err
        return err

    assert "holds the draft being exported" in refused(
        run_dir / "final", "--out", run_dir, "--force"
    )
    assert "holds the draft being exported" in refused(run_dir, "--out", tmp_path, "--force")
    assert "holds a trained draft" in refused(run_dir, "--out", run_dir / "final", "--force")
    other = tmp_path / "other"
    shutil.copytree(run_dir, other)
    assert "holds a training run (final, checkpoints, metrics.jsonl)" in refused(
        run_dir, "--out", other, "--force"
    )
    assert "--gamma 0: must be >= 1" in refused(run_dir, "--gamma", "0")
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("kept")
    assert "holds files that are not an earlier export (notes.txt)" in refused(
        run_dir, "--out", mine, "--force"
    )
    assert (mine / "notes.txt").read_text() == "kept"
    assert "not an earlier export (step_1, step_2)" in refused(
        run_dir, "--out", run_dir / "checkpoints", "--force"
    )
    if os.path.isdir("/proc/self"):
        assert "nothing can be written in /proc" in refused(
            run_dir, "--out", "/proc/specdraft-x/out"
        )

    def converted(*_):
        raise AssertionError("a target was converted for a format this draft has not")

    monkeypatch.setattr("flow.export.cli_target_gguf", converted)
    with pytest.raises(SystemExit):
        main([str(run_dir), "--format", "gguf"])
    assert "--format gguf exports eagle3, hass, dflash or dspark drafts; this is eagle1" in (
        capsys.readouterr().err
    )
    assert sorted(str(p.relative_to(run_dir)) for p in run_dir.rglob("*")) == before
    main([str(run_dir), "--format", "eagle1"])
    main([str(run_dir), "--format", "eagle1", "--force"])  # an earlier export is replaced
    assert "is not a specdraft draft" in refused(run_dir / "export-eagle1")
    shutil.rmtree(other / "final")
    assert f"newest checkpoint is {other / 'checkpoints' / 'step_2'}" in refused(other)


@pytest.mark.parametrize("fmt", ["medusa", "medusa-vllm"])
def test_medusa_export_round_trips(target4, tmp_path, fmt):
    from models.medusa import Medusa1Config, MedusaHeads

    torch.manual_seed(0)
    heads = MedusaHeads(target4, Medusa1Config(num_heads=3, num_layers=2, top_k=4, tree_nodes=9))
    with torch.no_grad():
        for p in heads.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    out = tmp_path / fmt
    summary = export(heads, fmt, out, dtype="float32", gamma=5, log=lambda *_: None)
    assert detect_format(out) == fmt
    # either layout is served with one token a head, whatever --gamma says
    assert '"num_speculative_tokens": 3' in summary["vllm_serve"]
    cfg = json.loads((out / "config.json").read_text())
    if fmt == "medusa":
        assert (cfg["medusa_num_heads"], cfg["medusa_num_layers"]) == (3, 2)
        assert cfg["medusa_fc_bias"] is True  # else vLLM drops the blocks' biases
        names = set(load_file(str(out / "medusa_lm_head.safetensors")))
        assert {"0.0.linear.weight", "2.1.linear.bias", "1.2.weight"} <= names
    else:
        assert (cfg["num_heads"], cfg["num_hidden_layers"], cfg["medusa_fc_bias"]) == (3, 2, True)
    back = import_draft(out, target4)
    h = torch.randn(2, target4.hidden_size)
    assert torch.equal(back.head_logits(2, h), heads.head_logits(2, h))
    assert back.tree == heads.candidate_tree()
    with pytest.raises(ExportError, match="--merge"):
        export(heads, fmt, tmp_path / "m", merge=True, log=lambda *_: None)


def test_a_draft_whose_target_moved_is_exported_with_target(data_file, tmp_path, capsys):
    """A draft names its target's folder (absolute, however it was typed); where the folder has
    moved, export says to pass --target, and --target loads it there (the same weights under
    another name are the same target; other weights are refused)."""
    from conftest import compose, tiny_overrides

    from flow.export import main
    from models.target import TargetConfig, load_target, target_folder
    from trainer.train import run

    tiny = load_target(TargetConfig(name="tiny_random", cache_dir=str(tmp_path / "cache")))
    shutil.copytree(target_folder(tiny), tmp_path / "tgt")
    run_dir = tmp_path / "run"
    cwd = os.getcwd()
    os.chdir(tmp_path)
    try:  # typed relative to where training ran
        run(
            compose(
                tiny_overrides(data_file, run_dir, **{"train.max_steps": 2, "target.path": "tgt"})
            )
        )
    finally:
        os.chdir(cwd)
    saved = json.loads((run_dir / "final" / "config.json").read_text())["target"]["path"]
    assert saved == str(tmp_path / "tgt")
    (tmp_path / "tgt").rename(tmp_path / "moved")
    capsys.readouterr()
    with pytest.raises(SystemExit) as e:
        main([str(run_dir), "--format", "eagle1"])
    err = capsys.readouterr().err.strip()
    assert e.value.code == 2 and "\n" not in err
    assert f"target.path={tmp_path / 'tgt'}: no such folder" in err and "--target" in err
    main([str(run_dir), "--format", "eagle1", "--target", str(tmp_path / "moved")])
    assert (run_dir / "export-eagle1" / "config.json").is_file()
    other = load_target(TargetConfig(name="tiny_random", seed=1, cache_dir=str(tmp_path / "c1")))
    with pytest.raises(SystemExit):
        main([str(run_dir), "--format", "eagle1", "--force", "--target", str(target_folder(other))])
    assert "weights changed?" in capsys.readouterr().err


def test_an_export_for_another_target_is_named_as_such(target4, tiny_target, tmp_path):
    """An EAGLE-3 export read against a target whose layers it cannot take (made for another
    target) is one line naming the export and the target, not a bare index error."""
    export(every_third_eagle3(target4), "vllm", tmp_path / "v", log=lambda *_: None)
    with pytest.raises(ExportError) as e:
        import_draft(tmp_path / "v", tiny_target)
    msg = str(e.value)
    assert msg.startswith(f"{tmp_path / 'v'}: a vllm export that does not fit target ")
    assert "was it made for another target?" in msg and "\n" not in msg


def test_a_draft_made_for_other_weights_is_evaluated_with_a_warning(target4, tmp_path, capsys):
    """An export whose shapes fit a target whose weights are not the ones it was made for
    decodes (a base model's head on its fine-tune is a fair question), but with a warning that
    the report keeps; the same weights in another folder are the same target."""
    from decoding.drafts import load_proposer

    made = Target(target4.model, target4.tokenizer, "/a/smol:abc123", TargetConfig(name="x"))
    moved = Target(target4.model, target4.tokenizer, "/b/copy:abc123", TargetConfig(name="x"))
    other = Target(target4.model, target4.tokenizer, "/a/tuned:def456", TargetConfig(name="x"))
    export(every_third_eagle3(made), "vllm", tmp_path / "v", log=lambda *_: None)
    assert ex.exported_for(tmp_path / "v") == "/a/smol:abc123"
    assert ex.made_for_note(ex.made_for(tmp_path / "v"), moved) is None
    _, desc = load_proposer(str(tmp_path / "v"), moved)
    assert "warning" not in desc and "warning" not in capsys.readouterr().out
    _, desc = load_proposer(str(tmp_path / "v"), other)
    note = "made for target /a/smol:abc123, evaluated against /a/tuned:def456"
    assert note in desc and note in capsys.readouterr().out
    # the same in the engine's report: the export as vLLM is given it
    from omegaconf import OmegaConf

    from decoding.engines.vllm_eval import vllm_draft

    cfg = OmegaConf.create(
        {"draft": str(tmp_path / "v"), "gamma": 3, "engine_rule": "greedy_draft"}
    )
    logged = []
    assert note in vllm_draft(cfg, other, logged.append)[1] and note in logged[0]
    assert "warning" not in vllm_draft(cfg, moved, logged.append)[1] and len(logged) == 1
    # a third-party checkpoint (no README of ours) records no target: nothing to compare
    (tmp_path / "v" / "README.md").unlink()
    assert ex.exported_for(tmp_path / "v") is None
    assert "warning" not in load_proposer(str(tmp_path / "v"), other)[1]


def test_a_trained_draft_for_a_moved_target_is_not_warned_about(target4, tmp_path, capsys):
    """A saved draft's recorded target is compared by its weights, not its folder's name."""
    from decoding.drafts import load_proposer

    made = Target(target4.model, target4.tokenizer, "/a/smol:abc123", TargetConfig(name="x"))
    head = every_third_eagle3(made)
    head.save_draft(tmp_path / "final")
    assert ex.made_for(tmp_path) == "/a/smol:abc123"
    moved = Target(target4.model, target4.tokenizer, "/b/copy:abc123", TargetConfig(name="x"))
    assert "warning" not in load_proposer(str(tmp_path), moved)[1]
    assert "warning" not in capsys.readouterr().out  # it was, by the folder's name alone
    other = Target(target4.model, target4.tokenizer, "/a/tuned:def456", TargetConfig(name="x"))
    assert "made for target /a/smol:abc123" in load_proposer(str(tmp_path), other)[1]


def test_a_distillspec_student_for_other_weights_is_warned_about_in_vllms_report(
    target4, tmp_path, capsys
):
    """vLLM serves a DistillSpec run's student as a draft model, with no export in between:
    the warning that the student was distilled from other weights is in its description too,
    as it is in the built-in decoder's."""
    from omegaconf import OmegaConf

    from decoding.drafts import load_proposer
    from decoding.engines.vllm_eval import vllm_draft
    from models.distillspec import DistillSpecConfig, DistillSpecStudent

    made = Target(target4.model, target4.tokenizer, "/a/smol:abc123", TargetConfig(name="x"))
    other = Target(target4.model, target4.tokenizer, "/a/tuned:def456", TargetConfig(name="x"))
    moved = Target(target4.model, target4.tokenizer, "/b/copy:abc123", TargetConfig(name="x"))
    DistillSpecStudent(made, DistillSpecConfig(num_layers=1)).save_draft(tmp_path / "final")
    note = "made for target /a/smol:abc123, evaluated against /a/tuned:def456"
    assert note in load_proposer(str(tmp_path), other)[1]
    cfg = OmegaConf.create({"draft": str(tmp_path), "gamma": 3, "engine_rule": "greedy_draft"})
    logged: list[str] = []
    spec, desc, _ = vllm_draft(cfg, other, logged.append)
    assert spec["method"] == "draft_model" and note in desc and note in logged[0]
    spec, desc, _ = vllm_draft(cfg, moved, logged.append)
    assert "warning" not in desc and len(logged) == 1


def test_an_export_is_evaluated_against_the_target_it_was_made_for(tmp_path):
    """`specdraft-eval draft=<export>` with no target= used the embedded target, and an export
    of a head for another one did not fit; it takes the target the export records, as a run's
    draft does (an export written before the record: by its identity, where that tells)."""
    from omegaconf import OmegaConf

    from decoding.eval import EvalConfig
    from decoding.settings import apply_saved_target
    from models.target import load_target

    t4 = load_target(TargetConfig(name="tiny_random", tiny_layers=4, dtype="float32"))
    export(every_third_eagle3(t4), "vllm", tmp_path / "v", log=lambda *_: None)
    assert ex.exported_target(tmp_path / "v")["name"] == "tiny_random"
    cfg = OmegaConf.structured(EvalConfig(draft=str(tmp_path / "v")))
    assert "made for" in apply_saved_target(cfg, set())
    assert cfg.target.name == "tiny_random" and cfg.target.tiny_layers == 4
    cfg = OmegaConf.structured(EvalConfig(draft=str(tmp_path / "v")))
    assert apply_saved_target(cfg, {"target"}) is None and cfg.target.name == "smollm2_135m"
    # an export written before the record
    readme = tmp_path / "v" / "README.md"
    readme.write_text(
        "\n".join(x for x in readme.read_text().splitlines() if "specdraft-eval target" not in x)
    )
    cfg = OmegaConf.structured(EvalConfig(draft=str(tmp_path / "v")))
    apply_saved_target(cfg, set())
    assert cfg.target.name == "tiny_random" and cfg.target.tiny_layers == 4
    # a third-party checkpoint says nothing: the default stays
    readme.unlink()
    cfg = OmegaConf.structured(EvalConfig(draft=str(tmp_path / "v")))
    assert apply_saved_target(cfg, set()) is None and cfg.target.name == "smollm2_135m"


def test_an_export_of_final_or_a_checkpoint_lands_beside_the_run_never_inside(
    data_file, tmp_path, capsys
):
    """``specdraft-export <run>/final`` wrote into final/, which a resumed run replaces (and
    the export with it); a checkpoint's export went where pruning deletes it. By default they
    land beside the run, and an --out inside those folders is refused."""
    from conftest import compose, tiny_overrides

    from flow.export import main
    from models.export import default_out
    from trainer.train import run

    run_dir = tmp_path / "run"
    kw = {"train.max_steps": 2, "train.save_every": 2, "train.eval_every": 0}
    run(compose(tiny_overrides(data_file, run_dir, **kw)))
    step = run_dir / "checkpoints" / "step_2"
    assert default_out(run_dir, "vllm") == run_dir / "export-vllm"
    assert default_out(run_dir / "final", "vllm") == run_dir / "export-vllm"
    assert default_out(step, "vllm") == run_dir / "export-vllm-step_2"
    assert default_out(step / "draft", "vllm") == run_dir / "export-vllm-step_2"
    assert default_out(tmp_path / "somedraft", "vllm") == tmp_path / "somedraft" / "export-vllm"
    main([str(run_dir / "final"), "--format", "eagle1"])
    assert (run_dir / "export-eagle1" / "config.json").is_file()
    assert not (run_dir / "final" / "export-eagle1").exists()
    main([str(step), "--format", "eagle1"])
    assert (run_dir / "export-eagle1-step_2" / "config.json").is_file()
    for inside in (run_dir / "final" / "e", step.parent / "e"):
        with pytest.raises(SystemExit) as e:
            main([str(run_dir), "--format", "eagle1", "--out", str(inside)])
        assert e.value.code == 2 and not inside.exists()
        assert "which training replaces" in capsys.readouterr().err
