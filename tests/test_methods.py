"""The method contract, checked for every registered method: it trains a few steps through the
one loop, saves, reloads, proposes through the one decoder losslessly at T = 0, and exports to
each of its formats and reads back. A new method registered in ``models.METHODS`` is picked up
here; one that forgets a required hook cannot even be built, and the error names the hook."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from conftest import tiny_target_gguf

from models import FORMATS, METHODS
from models.base import DecodeSettings, DraftMethod, Proposer

# Small settings per method, so each trains in seconds on the tiny target. A method missing
# here fails the test with a message saying so.
SMALL = {
    "eagle1": [],
    "eagle3": ["method.draft_vocab_size=64", "method.fuse_layers=[1,2,3]"],
    "hass": ["method.draft_vocab_size=64", "method.fuse_layers=[1,2,3]", "method.topk=4"],
    "medusa1": ["method.num_heads=2", "method.tree_nodes=6"],
    "medusa2": ["method.num_heads=2", "method.tree_nodes=6", "method.lora_r=4"],
    "distillspec": ["method.num_layers=1"],
    "mlp_speculator": [],
    "dflash": [
        "method.draft_vocab_size=64",
        "method.mask_token_id=5",
        "method.block_size=4",
        "method.num_layers=1",
        "method.fuse_layers=[1,3]",
    ],
    "domino": [
        "method.draft_vocab_size=64",
        "method.mask_token_id=5",
        "method.block_size=4",
        "method.num_layers=1",
        "method.fuse_layers=[1,3]",
        "method.gru_hidden=16",
        "method.correction_dim=8",
    ],
    "dspark": [
        "method.draft_vocab_size=64",
        "method.mask_token_id=5",
        "method.block_size=4",
        "method.num_layers=1",
        "method.fuse_layers=[1,3]",
        "method.markov_rank=8",
    ],
    "peagle": [
        "method.draft_vocab_size=64",
        "method.fuse_layers=[1,2,3]",
        "method.mask_token_id=5",
        "method.ttt_steps=3",
    ],
    "falcon": ["method.lstm_layers=1"],
}
TINY4 = {"name": "tiny_random", "device": "cpu", "dtype": "float32", "tiny_layers": 4}


def fresh_target():
    """A 4-layer tiny target (EAGLE-3 fuses three distinct layers), loaded afresh: a Medusa-2
    draft puts its adapter into the target it is loaded for."""
    from models.target import TargetConfig, load_target

    return load_target(TargetConfig(**TINY4))


def test_every_registered_method_has_its_pieces():
    from hydra.core.config_store import ConfigStore

    from trainer.config import register_configs

    register_configs()
    conf = Path(__file__).resolve().parent.parent / "conf" / "method"
    store = ConfigStore.instance().repo["schema"]["method"]
    for name, cls in METHODS.items():
        assert issubclass(cls, DraftMethod), f"{name}: {cls.__name__} is not a DraftMethod"
        assert cls.config_class().name == name, f"{name}: its config's name is not {name!r}"
        assert (conf / f"{name}.yaml").exists(), f"{name}: no conf/method/{name}.yaml"
        assert f"{name}.yaml" in store, f"{name}: its config is not in the ConfigStore"
    for fname, fmt in FORMATS.items():
        assert fmt.name == fname and fmt.methods, fname
        assert all(m in METHODS for m in fmt.methods), f"{fname} names an unknown method"


def test_a_method_that_forgets_a_hook_is_refused_by_name(tiny_target):
    from models.eagle import Eagle1Config

    class Forgetful(DraftMethod):
        config_class = Eagle1Config

        def forward(self, batch):
            raise NotImplementedError

        def save_draft(self, path):
            pass

        @classmethod
        def load_draft(cls, path, target):
            raise NotImplementedError

        def proposer(self, settings=None):
            raise NotImplementedError

    with pytest.raises(TypeError, match="evaluate"):
        Forgetful()

    class NoPropose(Proposer):
        pass

    with pytest.raises(TypeError, match="propose"):
        NoPropose()


@pytest.mark.parametrize("name", sorted(METHODS))
def test_method_trains_saves_reloads_decodes_and_exports(name, data_file, tmp_path):
    from conftest import compose, tiny_overrides

    from decoding.decoder import NoDraft, SpeculativeDecoder
    from decoding.drafts import load_proposer
    from models.export import export, import_draft, proposals
    from models.sampling import Sampling
    from trainer.train import run

    assert name in SMALL, f"method {name!r} is registered but not in the contract test's SMALL"
    run_dir = tmp_path / "run"
    over = tiny_overrides(data_file, run_dir, **{"train.max_steps": 3, "method": name})
    over += [f"target.{k}={v}" for k, v in TINY4.items() if k != "name"] + SMALL[name]
    run(compose(over))

    # save -> reload: the same weights
    trained = METHODS[name].load_draft(run_dir / "final", fresh_target())
    assert isinstance(trained, METHODS[name])
    again = METHODS[name].load_draft(run_dir / "final", fresh_target())
    for (k, a), (_, b) in zip(
        trained.state_dict().items(), again.state_dict().items(), strict=True
    ):
        assert torch.equal(a, b), f"{name}: {k} differs between two loads"

    # propose and decode through the one decoder: greedy output is the target's own
    target4 = fresh_target()
    prop, desc = load_proposer(str(run_dir), target4, tree=DecodeSettings())
    assert isinstance(prop, Proposer) and prop.method is not None, desc
    prompt = list(range(40, 60))
    # after loading: a Medusa-2 draft's verifier is the adapted target, which plain decoding
    # then uses too
    plain = SpeculativeDecoder(target4, NoDraft(), Sampling(), calibrate=False)
    ref = plain.generate(prompt, 16)
    dec = SpeculativeDecoder(target4, prop, Sampling(), gamma=prop.tree_depth or 3, adaptive=False)
    assert dec.generate(prompt, 16) == ref, f"{name}: greedy speculative != greedy plain"
    assert dec.stats.draft_calls > 0, f"{name}: the proposer was never asked"

    # export to every format of the method, read back, same proposals
    fmts = [f for f, fmt in FORMATS.items() if name in fmt.methods]
    for f in fmts:
        out = tmp_path / f"export-{f}"
        merge = trained.changes_target() is not None
        opts = (
            {"target_gguf_path": tiny_target_gguf(tmp_path / "t.gguf", target4)}
            if "gguf" in (f, FORMATS[f].family)
            else {}
        )
        export(trained, f, out, dtype="float32", merge=merge, log=lambda *_: None, **opts)
        back = import_draft(out, trained.target)
        ref_props = proposals(trained.export_view(torch.float32), prompt)
        back_props = proposals(back, prompt)
        la, lb = ref_props.pop("logits"), back_props.pop("logits")
        assert (la is None) == (lb is None)
        assert ref_props == back_props, f"{name} -> {f}: proposals differ after the round trip"


def test_mlp_speculator_alpha_is_conditional_on_the_earlier_stages(tiny_target):
    """``alpha_pos{i}`` is EAGLE's n-alpha (agreement at stage i given stages 1..i-1 agreed),
    as every head reports it, not the joint rate."""
    from models.mlp_speculator import MLPSpeculator

    cfg = MLPSpeculator.config_class()
    # weights of a fixed seed: drawn from whatever state earlier tests left, a stage agreeing
    # only at a row's last scored start (where no later stage is scored) failed the count below
    torch.manual_seed(0)
    m = MLPSpeculator(tiny_target, cfg).eval()
    ids = torch.randint(0, 250, (3, 32), generator=torch.Generator().manual_seed(0))
    attn = torch.ones_like(ids)
    batch = {"input_ids": ids, "attention_mask": attn, "loss_mask": torch.ones_like(ids)}
    batch["features"] = tiny_target.features(ids, attn, m.feature_layers)
    with torch.no_grad():
        out = m.evaluate(batch)
    assert out["alpha_pos1"][0] > 0  # the target's own head: stage 1 agrees at times
    for i in range(2, cfg.n_predict + 1):
        assert out[f"alpha_pos{i}"][1] == out[f"alpha_pos{i - 1}"][0]


@pytest.mark.parametrize("method", sorted(METHODS))
def test_the_hint_after_training_names_formats_the_method_exports(method, tmp_path):
    """Every `--format X` the end of training suggests exports this method's drafts (Medusa-2
    with --merge), and llama.cpp's spec type is named wherever a GGUF is suggested."""
    import re

    from flow.serve import serve_hint
    from models.export import formats, resolve_format
    from models.gguf import GGUFDraftFormat

    ggufs = [f for f in formats().values() if isinstance(f, GGUFDraftFormat)]
    spec_type = next((f.spec_type for f in ggufs if method in f.methods), None)

    hint = serve_hint(method, tmp_path / "run")
    for fmt in re.findall(r"--format (\S+)", hint):
        assert method in formats()[resolve_format(fmt, method)].methods, (method, fmt)
    assert ("--format gguf" in hint) == (spec_type is not None)
    if spec_type is not None:
        assert spec_type.startswith("draft-") and f"--spec-type {spec_type}" in hint
        # the file the export writes (a DFlash draft's went to export-gguf-dflash/, the hint
        # said export-gguf/), and a DFlash-family block's own length
        fmt = resolve_format("gguf", method)
        assert f"-md {tmp_path / 'run' / f'export-{fmt}' / 'draft.gguf'} " in hint
        assert "--spec-draft-n-max 3 " in hint  # no run there: the default chain
        from dataclasses import asdict

        final = tmp_path / "run" / "final"
        final.mkdir(parents=True)
        saved = asdict(METHODS[method].config_class())
        if "block_size" in saved:
            saved["block_size"] = 8
        (final / "config.json").write_text(
            json.dumps({"specdraft": {"method": method}, "method": saved})
        )
        n = 7 if "block_size" in saved else 3
        assert f"--spec-draft-n-max {n} --spec-draft-p-min 0" in serve_hint(
            method, tmp_path / "run"
        )
    assert ("--merge" in hint) == (method == "medusa2")
