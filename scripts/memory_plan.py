"""Memory plan of a training run before it runs: bytes per device for the target (whole or
sharded), the draft, its optimizer state and gradients, the activations at the configured batch
and length, and the feature cache's size on disk. The target and the draft are built on
PyTorch's meta device from the target's ``config.json`` alone: no weights are read or
downloaded, so a 70B plan takes a second on a laptop.

    python scripts/memory_plan.py target.path=scripts/model_configs/llama-3.3-70b-instruct \\
        method=eagle3 world_size=8 target.shard=fsdp
    python scripts/memory_plan.py target.path=/models/Llama-3.1-8B-Instruct world_size=1 \\
        method=eagle3 data.batch_size=2 data.max_length=4096 gpu_memory_gb=80

Every other ``key=value`` is a training setting (``specdraft-train`` reads the same ones; the
method's own defaults come from conf/method/). Plan-only keys: ``world_size`` (processes, one
per GPU), ``gpu_memory_gb`` (per device, default 80).

What is counted (bf16 weights and activations unless the config says otherwise):
- target weights: all of them per process (``target.shard=none``); with ``fsdp``, 1/N between
  steps, plus during a step one gathered decoder layer and the gathered embedding / norm / LM
  head (trainer/shard.py);
- target forward (online features, no gradients): the hidden states of every layer, which the
  Hugging Face forward keeps when asked for hidden states, plus one layer's working set;
  ``data.cache_features=true`` moves this to the one-off cache build;
- draft: trainable parameters x 16 bytes (fp32 weights, fp32 gradients, Adam's two moments),
  replicated by DDP;
- draft activations: 34 x B x T x H bytes per decoder-layer pass with gradients (Korthikanti et
  al. 2022, bf16, flash/SDPA attention), one pass per training-time-test step (EAGLE-3, HASS),
  plus the logits' fp32 copies over the draft vocabulary and the target's distribution;
- a device is planned to fit when the total is at most 90% of its memory (CUDA context,
  allocator fragmentation and NCCL buffers take the rest).
These are estimates to plan with, not measurements: no GPU run has checked them yet (the
sharded weights' 1/N is measured on CPU, tests/test_shard.py).
"""

from __future__ import annotations

import math
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

PLAN_KEYS = {"world_size": 1, "gpu_memory_gb": 80.0}
USAGE = (
    "usage: python scripts/memory_plan.py [world_size=N] [gpu_memory_gb=G] [key=value ...] [--json]"
)
GIB = 2**30
DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4, "auto": 2}


class PlanError(ValueError):
    pass


@dataclass
class Plan:
    target: str
    method: str
    world_size: int
    shard: str
    params_target: int
    params_layers: int
    params_shared: int
    params_per_layer: int
    params_draft: int
    target_bytes_per_param: int
    target_weights: float  # bytes per device during a step (the peak)
    target_weights_at_rest: float
    target_forward: float
    draft_states: float
    draft_activations: float
    total: float
    gpu_bytes: float
    host_bytes_at_load: float
    cache_bytes_per_million_tokens: float
    experts: str = ""  # a mixture-of-experts target's routing, for the report

    @property
    def fits(self) -> bool:
        return self.total <= 0.9 * self.gpu_bytes


def split_args(argv: list[str]) -> tuple[dict, list[str]]:
    plan, rest = dict(PLAN_KEYS), []
    for a in argv:
        if a == "--json":
            continue
        k, sep, v = a.partition("=")
        if not sep:
            raise PlanError(f"{a}: expected key=value")
        if k in PLAN_KEYS:
            try:
                plan[k] = type(PLAN_KEYS[k])(v)
            except ValueError:
                raise PlanError(f"{k}={v}: not a number") from None
        else:
            rest.append(a)
    if plan["world_size"] < 1:
        raise PlanError(f"world_size={plan['world_size']}: must be >= 1")
    gb = plan["gpu_memory_gb"]
    if not (math.isfinite(gb) and gb > 0):
        raise PlanError(f"gpu_memory_gb={gb:g}: must be a number of GiB > 0")
    return plan, rest


def check_overrides(overrides: list[str]) -> None:
    """The trainer's own checks of its command line (flow/app.py ``main``): a group option
    that does not exist (``method=nope``) or a key that names no setting (``foo=1``) is one
    line, not Hydra's screen of traceback."""
    from conf.cli import check_command_line
    from flow.app import check_group_choices

    msg = check_group_choices(overrides) or check_command_line("train", overrides)
    if msg:
        raise PlanError(msg)


def compose(overrides: list[str]):
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    import trainer.train  # noqa: F401  registers the structured configs

    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        return hydra_compose("train", overrides=[*overrides, "output_dir=/tmp/plan"])


def meta_target(cfg):
    """The target as a ``models.target.Target`` on the meta device, from its config alone."""
    import torch
    from omegaconf import OmegaConf
    from transformers import AutoConfig, AutoModelForCausalLM

    from models.target import Target, TargetConfig

    tc: TargetConfig = OmegaConf.to_object(cfg.target)
    where = tc.path
    if where is None:
        if tc.name == "smollm2_135m":
            from models.target import smollm2_dir

            where = str(smollm2_dir(tc.cache_dir))
        else:
            raise PlanError(
                f"target={tc.name}: the plan needs target.path=<folder with config.json or hub id>"
            )
    p = Path(where).expanduser()
    try:
        config = AutoConfig.from_pretrained(
            str(p.parent if p.name == "config.json" else p), trust_remote_code=tc.trust_remote_code
        )
    except Exception as e:  # offline hub ids, missing folders: one line
        raise PlanError(
            f"target.path={where}: no config.json there and the hub cannot be reached "
            f"({type(e).__name__}); pass a folder that holds the model's config.json"
        ) from None
    dtype = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}.get(
        tc.dtype, torch.bfloat16
    )
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    return Target(model, None, f"plan:{where}", tc), where


def _experts(c) -> tuple[int, int, int, int]:
    """(routed experts, active per token, an expert's MLP width, shared experts) of a
    mixture-of-experts config (Qwen3-MoE, Mixtral, GPT-OSS, DeepSeek-V3 spell them
    differently); (0, 0, 0, 0) for a dense model."""
    n = (
        getattr(c, "num_experts", None)
        or getattr(c, "num_local_experts", None)
        or getattr(c, "n_routed_experts", None)
        or 0
    )
    k = getattr(c, "num_experts_per_tok", None) or getattr(c, "experts_per_token", None) or 0
    if not n or not k:
        return 0, 0, 0, 0
    width = getattr(c, "moe_intermediate_size", None) or c.intermediate_size
    return int(n), int(k), int(width), int(getattr(c, "n_shared_experts", None) or 0)


def mlp_width(c) -> int:
    """The MLP width one token's forward works through: the dense intermediate size, or for a
    mixture of experts the active experts' (and shared experts') widths together."""
    n, k, width, shared = _experts(c)
    if not n:
        return getattr(c, "intermediate_size", None) or 4 * c.hidden_size
    return (k + shared) * width


def experts(c) -> str:
    n, k, width, shared = _experts(c)
    if not n:
        return ""
    extra = f" + {shared} shared" if shared else ""
    return f"{n} experts of width {width}, {k} active per token{extra}"


def plan(argv: list[str]) -> Plan:
    import torch
    from omegaconf import OmegaConf

    from conf.cli import home_expanded
    from models import METHODS
    from trainer.train import ConfigError, check_config

    opts, overrides = split_args(home_expanded(argv))
    check_overrides(overrides)
    cfg = compose(overrides)
    try:  # the values specdraft-train refuses (data.batch_size=0, ...) are refused here too
        check_config(cfg)
    except ConfigError as e:
        raise PlanError(str(e)) from None
    N = opts["world_size"]
    shard = cfg.target.shard
    if shard not in ("none", "fsdp"):
        raise PlanError(f"target.shard={shard}: use none or fsdp")
    if shard == "fsdp" and N < 2:
        raise PlanError("target.shard=fsdp needs world_size >= 2")
    target, where = meta_target(cfg)
    mcfg = OmegaConf.to_object(cfg.method)
    with torch.device("meta"):
        method = METHODS[mcfg.name](target, mcfg)
    if shard == "fsdp" and method.changes_target():
        raise PlanError(f"target.shard=fsdp: method {mcfg.name} trains the target's weights")
    c = target.config
    H, L, V = c.hidden_size, c.num_hidden_layers, c.vocab_size
    inter = mlp_width(c)
    bt = DTYPE_BYTES.get(cfg.target.dtype, 2)
    B, T = cfg.data.batch_size, cfg.data.max_length

    from trainer.shard import outside_layers

    p_shared = sum(p.numel() for p in outside_layers(target.model))
    per_layer = [sum(p.numel() for p in x.parameters()) for x in target.model.get_decoder().layers]
    p_layers = sum(per_layer)
    p_target = p_layers + p_shared
    p_layer = max(per_layer)  # fsdp gathers one layer at a time: the largest (an MoE layer)
    p_draft = sum(p.numel() for p in method.parameters() if p.requires_grad)

    if shard == "fsdp":
        at_rest = p_target * bt / N
        step = at_rest + (p_layer + p_shared) * bt
    else:
        at_rest = step = p_target * bt
    cached = bool(cfg.data.cache_features)
    target_fwd = 0.0 if cached else B * T * ((L + 1) * H + 4 * H + 3 * inter) * bt

    ba = 2  # bf16 activations under autocast
    name = mcfg.name
    chunk_rows = min(B * T, getattr(mcfg, "lm_head_chunk", B * T))
    if name in ("eagle1", "eagle3", "hass", "peagle"):
        passes = getattr(mcfg, "ttt_steps", 1)
        dv = getattr(method.cfg, "draft_vocab_size", None) or V
        act = passes * (34 * B * T * H * ba + B * T * dv * (ba + 4 + 4)) + B * T * 3 * H * ba
        act += chunk_rows * V * 4  # the target's distribution, a chunk of positions at a time
    elif name in ("medusa1", "medusa2"):
        k = mcfg.num_heads
        act = k * (mcfg.num_layers * 4 * B * T * H * ba + B * T * V * (ba + 4)) + B * T * V * 4
        if name == "medusa2":
            act += L * 34 * B * T * H * ba  # the adapted backbone is in the graph
    elif name == "dflash":  # every anchor's block through the draft layers, one pass
        q = B * min(mcfg.anchors, T) * mcfg.block_size
        heads = c.num_attention_heads
        act = mcfg.num_layers * (34 * q * H * ba + q * (T + mcfg.block_size) * heads * 4)
        act += B * T * H * ba * 2 + q * method.cfg.draft_vocab_size * (ba + 4 + 4)
    elif name == "falcon":  # two passes (CSGD), each an LSTM and one layer over every position
        act = 2 * (B * T * H * ba * (34 + 8 * mcfg.lstm_layers) + B * T * V * (ba + 4 + 4))
    elif name == "mlp_speculator":
        k = mcfg.n_predict
        act = k * (6 * B * T * H * ba + B * T * V * (ba + 4))
    else:  # distillspec and anything else: a student of the target's width
        n = getattr(mcfg, "num_layers", 4)
        act = n * 34 * B * T * H * ba + B * T * V * (ba + 4 + 4)
    states = 16 * p_draft
    total = step + target_fwd + states + act
    feats = len(method.feature_layers) * H * DTYPE_BYTES.get(cfg.data.feature_dtype, 2)
    return Plan(
        target=where,
        method=name,
        world_size=N,
        shard=shard,
        params_target=p_target,
        params_layers=p_layers,
        params_shared=p_shared,
        params_per_layer=p_layer,
        params_draft=p_draft,
        target_bytes_per_param=bt,
        target_weights=step,
        target_weights_at_rest=at_rest,
        target_forward=target_fwd,
        draft_states=states,
        draft_activations=act,
        total=total,
        gpu_bytes=opts["gpu_memory_gb"] * GIB,
        host_bytes_at_load=p_target * bt,
        cache_bytes_per_million_tokens=feats * 1e6,
        experts=experts(c),
    )


def min_world_size(p: Plan) -> int | None:
    """The fewest processes with which the sharded target fits, or None if none does."""
    rest = p.total - p.target_weights
    gathered = (p.params_per_layer + p.params_shared) * p.target_bytes_per_param
    for n in range(2, 4097):
        if p.params_target * p.target_bytes_per_param / n + gathered + rest <= 0.9 * p.gpu_bytes:
            return n
    return None


def report(p: Plan) -> str:
    g = lambda b: f"{b / GIB:8.2f} GiB"  # noqa: E731
    sharded = p.shard == "fsdp"
    rows = [
        f"memory plan: {p.method} on {p.target}, {p.world_size} process(es), "
        f"target {'sharded (fsdp)' if sharded else 'whole on every process'}",
        f"  parameters: target {p.params_target / 1e9:.2f}B (decoder layers "
        f"{p.params_layers / 1e9:.2f}B, embedding/norm/head {p.params_shared / 1e9:.2f}B), "
        f"draft {p.params_draft / 1e6:.1f}M trainable",
        *([f"  mixture of experts: {p.experts}"] if p.experts else []),
        "  per device:",
        f"    target weights, during a step   {g(p.target_weights)}"
        + (f"   (between steps {g(p.target_weights_at_rest).strip()})" if sharded else ""),
        f"    target forward (online features){g(p.target_forward)}",
        f"    draft weights + grads + Adam     {g(p.draft_states)}",
        f"    draft activations                {g(p.draft_activations)}",
        f"    total                            {g(p.total)}  of {g(p.gpu_bytes).strip()} "
        f"({p.total / p.gpu_bytes:.0%})",
        f"  host RAM at load: {g(p.host_bytes_at_load).strip()} per process (each process "
        + (
            "reads the whole target, then keeps its share)"
            if sharded
            else "holds the whole target)"
        ),
        f"  feature cache on disk: {g(p.cache_bytes_per_million_tokens).strip()} per million "
        "tokens",
    ]
    if p.fits:
        rows.append("  verdict: fits (total <= 90% of the device)")
    else:
        rows.append("  verdict: DOES NOT FIT (total > 90% of the device)")
        n = min_world_size(p)
        shard = n is not None and (not sharded or n > p.world_size)
        if shard:
            rows.append(f"  advice: target.shard=fsdp with >= {n} processes")
        rows.append(
            f"  advice: {'or ' if shard else ''}lower data.batch_size / data.max_length "
            "(activations), or data.cache_features=true (no target forward while training)"
        )
    return "\n".join(rows)


def main() -> None:
    if {"-h", "--help"} & set(sys.argv[1:]):  # before anything heavy is imported
        print(f"{USAGE}\n\n{__doc__.strip()}")
        return
    try:
        p = plan(sys.argv[1:])
    except PlanError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    print(report(p))
    if "--json" in sys.argv:
        import json

        print(json.dumps(asdict(p)))


if __name__ == "__main__":
    main()
