"""Our `--format speculators` export, read by vLLM speculators' own loader
(`Eagle3DraftModel.from_pretrained`), computes the same draft logits as our head. Runs where
`speculators` is installed (scripts/compare_speculators.sh builds such an environment; it pins
its own torch), skipped with a message elsewhere."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.slow

speculators = pytest.importorskip(
    "speculators",
    reason="speculators not installed: `pip install speculators==0.9.0` (or run "
    "scripts/compare_speculators.sh, whose venv has it) to check our export with its loader",
)


@pytest.mark.parametrize(
    "flags", [{}, {"norm_before_fc": True, "norm_before_residual": True, "norm_output": True}]
)
def test_speculators_loads_our_export_and_gives_our_logits(tmp_path, flags):
    from speculators.models.eagle3 import Eagle3DraftModel, Eagle3SpeculatorConfig

    from models.eagle import Eagle3Config, Eagle3Head
    from models.export import default_prompt, export, proposals
    from models.target import TargetConfig, load_target, smollm2_dir

    target = load_target(TargetConfig(name="smollm2_135m", device="cpu", dtype="float32"))
    torch.manual_seed(0)
    head = Eagle3Head(target, Eagle3Config(draft_vocab_size=4096, **flags)).eval()
    with torch.no_grad():  # a chosen vocabulary (every other token) and lively weights
        head.t2d.zero_()
        head.t2d[torch.arange(4096) * 2] = True
        head.d2t.copy_(torch.arange(4096))
        for name, p in head.named_parameters():
            if name != "lm_head.weight":
                p.add_(torch.randn_like(p) * 0.02)
        ids = torch.arange(4096) * 2
        head.lm_head.weight.copy_(target.lm_head.weight[ids])
    out = tmp_path / "spec"
    export(head, "speculators", out, dtype="float32", log=lambda *_: None)

    config = Eagle3SpeculatorConfig.from_pretrained(str(out))
    config.speculators_config.verifier.name_or_path = str(smollm2_dir(target.cfg.cache_dir))
    config.transformer_layer_config._attn_implementation = "sdpa"  # CPU: no flex attention
    theirs = Eagle3DraftModel.from_pretrained(str(out), config=config).float().eval()

    prompt = default_prompt(target)
    ours = proposals(head, prompt)["logits"]  # (T-1, V), -inf outside the draft vocabulary
    x = torch.tensor([prompt])
    feats = target.features(x[:, :-1], torch.ones_like(x[:, :-1]), tuple(head.feature_layers))
    hs = feats[0, :, :3, :].flatten(-2)[None].float()  # (1, T-1, 3H), the fused layers
    seen = {}
    hook = theirs.lm_head.register_forward_hook(lambda m, i, o: seen.setdefault("z", o))
    with torch.no_grad():
        theirs(hs, x[:, 1:], torch.zeros_like(x[:, 1:]), ttt_steps=1)
    hook.remove()
    z = seen["z"][0].float()  # (T-1, draft vocab) over speculators' draft indices
    to_target = torch.arange(z.shape[-1]) + theirs.d2t.cpu()
    assert torch.equal(to_target, ids)
    torch.testing.assert_close(z, ours[:, to_target], atol=2e-4, rtol=1e-4)


def test_speculators_loads_our_dflash_export_weight_for_weight(tmp_path):
    """speculators' own DFlash loader (``DFlashDraftModel.from_pretrained``) reads our
    ``--format dflash`` export: every parameter it builds comes from the file (none left at its
    initial value) and equals ours, and it reads the block size, mask token and fused layers
    we wrote."""
    from speculators.models.dflash import DFlashDraftModel, DFlashSpeculatorConfig

    from models.dflash import DFlashConfig, DFlashDraft
    from models.export import export
    from models.target import TargetConfig, load_target, smollm2_dir

    target = load_target(TargetConfig(name="smollm2_135m", device="cpu", dtype="float32"))
    torch.manual_seed(0)
    d = DFlashDraft(
        target, DFlashConfig(draft_vocab_size=4096, mask_token_id=16, num_layers=2)
    ).eval()
    with torch.no_grad():
        d.t2d.zero_()
        d.t2d[torch.arange(4096) * 2] = True
        d.d2t.copy_(torch.arange(4096))
        for p in d.parameters():
            p.add_(torch.randn_like(p) * 0.02)
    out = tmp_path / "dflash"
    export(d, "dflash", out, dtype="float32", log=lambda *_: None)

    config = DFlashSpeculatorConfig.from_pretrained(str(out))
    config.speculators_config.verifier.name_or_path = str(smollm2_dir(target.cfg.cache_dir))
    config.transformer_layer_config._attn_implementation = "sdpa"  # CPU: no flex attention
    theirs = DFlashDraftModel.from_pretrained(str(out), config=config).float().eval()
    assert theirs.block_size == d.cfg.block_size
    assert theirs.config.mask_token_id == 16
    assert list(theirs.target_layer_ids) == list(d.cfg.fuse_layers)
    ours = {k: v for k, v in d.state_dict().items() if k not in ("d2t", "t2d")}
    ours["lm_head.weight"] = d.lm_rows()
    ours["embed_tokens.weight"] = target.embed_tokens.weight
    mine = dict(theirs.named_parameters())
    for k, v in ours.items():
        assert k in mine, f"speculators has no {k}"
        assert torch.equal(mine[k].detach().float(), v.float()), k
    assert torch.equal(theirs.d2t.cpu(), d.d2t.cpu())
