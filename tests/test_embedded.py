"""Integration on the embedded SmolLM2-135M-Instruct target and the real ShareGPT file."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from conftest import CONVERSATION, ROOT, compose, read_metrics

from data.chat import tokenize_conversation
from data.conversations import normalise_record
from models.base import cache_kw

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def smollm2():
    from models.target import TargetConfig, load_target

    return load_target(TargetConfig(name="smollm2_135m", device="cpu", dtype="float32"))


# CONVERSATION rendered by SmolLM2's ChatML template (default system turn injected).
SMOLLM2_GOLDEN = [
    1,
    9690,
    198,
    2683,
    359,
    253,
    5356,
    5646,
    11173,
    3365,
    3511,
    308,
    34519,
    28,
    7018,
    411,
    407,
    19712,
    8182,
    2,
    198,
    1,
    4093,
    198,
    1780,
    314,
    260,
    3575,
    282,
    4649,
    47,
    2,
    198,
    1,
    520,
    9531,
    198,
    504,
    3575,
    282,
    4649,
    314,
    7042,
    30,
    2,
    198,
    1,
    4093,
    198,
    3528,
    282,
    7158,
    47,
    2,
    198,
    1,
    520,
    9531,
    198,
    46292,
    314,
    260,
    3575,
    282,
    7158,
    30,
    2,
    198,
]


def test_smollm2_golden_ids_and_assistant_mask(smollm2):
    tok = smollm2.tokenizer
    enc = tokenize_conversation(tok, normalise_record({"conversations": CONVERSATION}), 4096)
    assert enc["input_ids"] == SMOLLM2_GOLDEN
    masked = [i for i, m in zip(enc["input_ids"], enc["loss_mask"], strict=True) if m]
    assert masked == [
        504,
        3575,
        282,
        4649,
        314,
        7042,
        30,
        2,
        46292,
        314,
        260,
        3575,
        282,
        7158,
        30,
        2,
    ]
    assert tok.decode(masked[:8]) == "The capital of France is Paris.<|im_end|>"
    assert tok.decode(masked[8:]) == "Rome is the capital of Italy.<|im_end|>"
    # <|im_end|> is both EOS and PAD here: only the attention mask tells padding apart.
    assert tok.eos_token_id == tok.pad_token_id == 2


def test_smollm2_target_is_frozen_llama_with_expected_shape(smollm2):
    c = smollm2.config
    assert (c.num_hidden_layers, c.hidden_size, c.vocab_size) == (30, 576, 49152)
    assert smollm2.dtype == torch.float32
    assert not any(p.requires_grad for p in smollm2.model.parameters())
    ids = torch.tensor([SMOLLM2_GOLDEN[:20]])
    f = smollm2.features(ids, torch.ones_like(ids), (2, 15, -1))
    assert f.shape == (1, 20, 3, 576) and torch.isfinite(f).all()
    # the last feature index is what the LM head reads
    logits = smollm2.model(ids).logits
    assert torch.allclose(smollm2.lm_head(f[:, :, 2]), logits, atol=1e-4)


def test_forward_features_are_the_hidden_states_transformers_gives(smollm2, tiny_target):
    """The decoders read the drafter's features through hooks on just the layers it reads:
    the very tensors ``output_hidden_states`` gives (index 0 and other layouts take that path),
    and nothing is kept outside the call."""
    from transformers import DynamicCache

    for t in (smollm2, tiny_target):
        n = t.num_layers
        ids = torch.tensor([SMOLLM2_GOLDEN[:12], SMOLLM2_GOLDEN[3:15]]) % t.config.vocab_size
        ref = t.model(input_ids=ids, output_hidden_states=True).hidden_states
        for layers in ((2, n // 2, -1), (1, n - 1, n), (0, 1), (n,)):
            out, f = t.forward_features(layers, input_ids=ids)
            want = torch.stack([ref[t.layer_index(i)] for i in layers], dim=2)
            assert torch.equal(f, want), (t.identity, layers)
            assert out.hidden_states is None or 0 in layers
        assert t._captured is None
        # with a cache, a step at a time, as the decoders call it
        c1, c2 = DynamicCache(), DynamicCache()
        t.forward_features((2, -1), input_ids=ids[:, :8], **cache_kw(t.model, c1), use_cache=True)
        t.model(input_ids=ids[:, :8], **cache_kw(t.model, c2), use_cache=True)
        _, f = t.forward_features(
            (2, -1), input_ids=ids[:, 8:], **cache_kw(t.model, c1), use_cache=True
        )
        hs = t.model(
            input_ids=ids[:, 8:], **cache_kw(t.model, c2), use_cache=True, output_hidden_states=True
        ).hidden_states
        assert torch.equal(f, torch.stack([hs[2], hs[n]], dim=2))
        # the training features: the decoder alone, with a padding mask
        mask = torch.ones_like(ids)
        mask[1, :3] = 0
        want = t.model.get_decoder()(
            input_ids=ids, attention_mask=mask, output_hidden_states=True, use_cache=False
        ).hidden_states
        got = t.features(ids, mask, (1, n // 2, -1))
        assert torch.equal(got, torch.stack([want[1], want[n // 2], want[n]], dim=2))
        plain = t.model(input_ids=ids)  # hooks idle outside the call
        assert t._captured is None and torch.isfinite(plain.logits).all()
    assert tiny_target.forward_features((), input_ids=ids)[1] is None


def test_train_eagle1_few_steps_on_embedded_target_and_sharegpt(tmp_path, smollm2):
    from models.eagle import EagleHead
    from trainer.train import run

    out = tmp_path / "run"
    s = run(
        compose(
            [
                "target=smollm2_135m",
                "method=eagle1",
                f"output_dir={out}",
                "data.max_records=40",
                "data.max_length=128",
                "data.batch_size=2",
                "train.max_steps=3",
                "train.log_every=1",
                "train.eval_every=0",
                "train.save_every=0",
                "train.progress=false",
                "data.max_val_records=4",
                "data.val_fraction=0.2",
                "target.device=cpu",
            ]
        )
    )
    assert s["reason"] == "finished" and s["step"] == 3
    rows = read_metrics(out)
    assert all(r["loss"] > 0 for r in rows if "loss" in r)
    assert "top1_pos1" in s["val"]
    head = EagleHead.load_draft(out / "final", smollm2)
    assert sum(p.numel() for p in head.parameters()) > 4_000_000


_PUBLISH = """
import sys, time
from pathlib import Path
from models.target import publish_folder

dest, me = Path(sys.argv[1]), sys.argv[2]
def write(tmp):
    (dest.parent / f"started-{me}").touch()
    while len(list(dest.parent.glob("started-*"))) < 2:  # both are writing at once
        time.sleep(0.01)
    (tmp / "config.json").write_text(me)
    time.sleep(0.2)
    (tmp / "model.safetensors").write_text(me)
print(publish_folder(dest, write))
"""


def test_concurrent_conversion_is_safe(tmp_path):
    """Two processes writing the same cached folder at once (as two training runs converting
    the embedded target do, ``smollm2_dir``): both get one whole folder, one writer's, and the
    loser's private copy is gone; a writer that fails leaves nothing."""
    from models.target import publish_folder

    dest = tmp_path / "targets" / "smollm2"
    dest.parent.mkdir(parents=True)
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", _PUBLISH, str(dest), name],
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for name in ("a", "b")
    ]
    outs = [p.communicate(timeout=120) for p in procs]
    assert all(p.returncode == 0 for p in procs), [o[1][-1500:] for o in outs]
    assert {o[0].strip().splitlines()[-1] for o in outs} == {str(dest)}
    winner = (dest / "config.json").read_text()
    assert (dest / "model.safetensors").read_text() == winner in ("a", "b")
    leftovers = [p.name for p in dest.parent.iterdir() if not p.name.startswith("started-")]
    assert leftovers == ["smollm2"]  # the loser's temp folder was cleaned up

    def fails(tmp):
        (tmp / "config.json").write_text("half")
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        publish_folder(tmp_path / "other", fails)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["targets"]


def test_greedy_speculative_equals_autoregressive_on_smollm2(smollm2):
    from data.chat import prompt_ids
    from decoding.decoder import NoDraft, SpeculativeDecoder
    from decoding.drafts import load_proposer
    from decoding.proposers import NGramProposer
    from models.eagle import Eagle1Config, EagleHead
    from models.sampling import Sampling

    prompt = prompt_ids(
        smollm2.tokenizer,
        [{"role": "user", "content": "List three fruits, then list them again in the same order."}],
    )
    stop = {smollm2.tokenizer.eos_token_id}
    ref = SpeculativeDecoder(smollm2, NoDraft(), Sampling(), calibrate=False).generate(
        prompt, 40, stop
    )
    hf = smollm2.model.generate(torch.tensor([prompt]), max_new_tokens=40, do_sample=False)
    assert ref == hf[0, len(prompt) :].tolist()
    assert len(ref) > 10
    torch.manual_seed(0)
    props = {
        "ngram": NGramProposer(),
        "truncate:4": load_proposer("truncate:4", smollm2)[0],
        "eagle": EagleHead(smollm2, Eagle1Config()).proposer(),
    }
    for name, prop in props.items():
        dec = SpeculativeDecoder(smollm2, prop, Sampling(), gamma=3, adaptive=False)
        assert dec.generate(prompt, 40, stop) == ref, name


@pytest.mark.parametrize(
    "method,extra,formats",
    [
        (
            "eagle3",
            ["method.draft_vocab_size=2048", "method.ttt_steps=3"],
            ["sglang", "speculators"],
        ),
        ("medusa1", ["method.num_heads=3"], ["medusa"]),
        ("medusa2", ["method.num_heads=2", "method.lora_r=4"], ["medusa"]),
        (
            "distillspec",
            ["method.num_layers=2", "method.on_policy=0.5", "method.gen_max_new_tokens=8"],
            [],
        ),
    ],
)
def test_each_method_trains_decodes_losslessly_and_exports_on_smollm2(
    tmp_path, smollm2, method, extra, formats
):
    """A few steps of every method on the real target and ShareGPT; the draft then decodes
    greedily token for token like the target (a fresh target for Medusa-2, whose adapter
    changes the verifier) and exports in its serving layouts."""
    from data.chat import prompt_ids
    from decoding.decoder import NoDraft, SpeculativeDecoder
    from decoding.drafts import load_proposer
    from models.export import export
    from models.sampling import Sampling
    from models.target import TargetConfig, load_target
    from trainer.train import run

    out = tmp_path / "run"
    s = run(
        compose(
            [
                "target=smollm2_135m",
                f"method={method}",
                f"output_dir={out}",
                "data.max_records=24",
                "data.max_length=96",
                "data.batch_size=2",
                "train.max_steps=2",
                "train.eval_every=0",
                "train.save_every=0",
                "train.progress=false",
                "data.max_val_records=2",
                "data.val_fraction=0.2",
                "target.device=cpu",
                *extra,
            ]
        )
    )
    assert s["reason"] == "finished" and s["step"] == 2 and s["val"]
    target = (
        load_target(TargetConfig(name="smollm2_135m", device="cpu"))
        if method == "medusa2"
        else smollm2
    )
    prompt = prompt_ids(target.tokenizer, [{"role": "user", "content": "Name two colours."}])
    stop = {target.tokenizer.eos_token_id}
    prop, desc = load_proposer(str(out), target)
    ref = SpeculativeDecoder(target, NoDraft(), Sampling(), calibrate=False).generate(
        prompt, 24, stop
    )
    dec = SpeculativeDecoder(target, prop, Sampling(), gamma=prop.tree_depth or 3, adaptive=False)
    assert dec.generate(prompt, 24, stop) == ref, desc
    head = prop.method  # the loaded draft
    for fmt in formats:
        export(head, fmt, tmp_path / fmt, merge=method == "medusa2", log=lambda *_: None)
        assert (tmp_path / fmt / "config.json").exists()
