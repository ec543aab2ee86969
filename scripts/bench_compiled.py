"""The compiled decoder's costs on this device: what a target forward costs at each
verification width on transformers' path, the static path eager and (CUDA) its captured graphs;
plain decoding's tokens/s on both paths beside transformers' own ``generate`` (static cache and
``torch.compile``, CUDA only); and a Llama-3.1-8B-shaped target with random weights built on
the device (no weights carried: costs only) against the memory-bandwidth limit, its one-token
forward in parts (each projection kind, the attention, the LM head, each against the bytes it
reads; the rest), with an EAGLE-3 draft step (random weights too) against a target step. Run it
alone on the machine.

    python scripts/bench_compiled.py --parts forward,plain,draft [--device cuda] [--out r.json]
    python scripts/bench_compiled.py --parts draft_lm   # a draft LM's proposal on both paths
    python scripts/bench_compiled.py --parts shaped --device cuda     # the 8B-shaped costs
    python scripts/bench_compiled.py --parts hf_compile --device cuda # transformers' compiled
    python scripts/bench_compiled.py --parts family --layers 2 \
        --config scripts/model_configs/qwen3-30b-a3b   # any architecture: both paths, per width

Every figure is a median of ``--reps`` after a warm-up; the JSON holds them with the device,
versions and the date, for docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from decoding.timing import interleaved_medians, median_seconds, sync  # noqa: E402

WIDTHS = (1, 2, 4, 8, 16, 32)
PROMPT = "Write a short story about a robot who learns to paint, in three paragraphs."


def forward_costs(target, runners: dict, widths, reps: int, prefix: int = 256) -> dict:
    """ms of a forward over w new tokens after a ``prefix``-token context, per runner and
    width: the median of ``reps`` rounds, each round timing every runner at every width in
    turn (a machine whose speed drifts then weighs on all alike)."""
    from decoding.runner import Layout
    from models.base import Proposal

    g = torch.Generator().manual_seed(0)
    ctx = torch.randint(0, target.config.vocab_size, (prefix + max(widths),), generator=g).tolist()
    lays = {w: Layout(ctx[prefix], Proposal.chain(ctx[prefix + 1 : prefix + w])) for w in widths}
    for r in runners.values():
        r.reserve(prefix + 2 * max(widths))
        r.prefill(ctx[:prefix])

    def setup(shape):
        r = runners[shape[0]]
        r.commit([])  # nothing kept: every call writes the same columns
        return lambda: r.forward(lays[shape[1]])

    shapes = [(name, w) for name in runners for w in widths]
    med = interleaved_medians(shapes, setup, target.device, reps)
    return {name: {w: 1e3 * med[(name, w)] for w in widths} for name in runners}


def part_forward(target, widths, reps) -> dict:
    from decoding.runner import HFRunner, StaticRunner

    dev = target.device
    runners = {
        "transformers": HFRunner(target, ()),
        "static eager": StaticRunner(target, (), (1,), "off"),
    }
    if dev.type == "cuda":
        runners["static + CUDA graphs"] = StaticRunner(target, (), widths, "cuda")
    res = forward_costs(target, runners, widths, reps)
    for name, r in runners.items():
        if r.capture_seconds:
            res[f"{name} capture_s"] = r.capture_seconds
    return res


def plain_rates(target, modes, tokens: int, reps: int) -> dict[str, float]:
    """Plain greedy decoding of one chat prompt under each ``compile=`` mode: tokens/s after
    the prefill, medians of ``reps`` interleaved runs (a drifting machine weighs on all alike),
    keyed ``compile=<mode> (<runner>)``."""
    from data.chat import prompt_ids
    from decoding.decoder import NoDraft, SpeculativeDecoder
    from models.sampling import Sampling

    p = prompt_ids(target.tokenizer, [{"role": "user", "content": PROMPT}])
    decs = {m: SpeculativeDecoder(target, NoDraft(), Sampling(), compile=m) for m in modes}
    for d in decs.values():
        d.generate(p, 16)
    runs: dict[str, list[float]] = {m: [] for m in decs}
    for _ in range(reps):
        for m, d in decs.items():
            d.generate(p, tokens)
            s = d.last
            runs[m].append(s.decoded_tokens / (s.t_total - s.t_prefill))  # after the first
    return {f"compile={m} ({d.runner.kind})": statistics.median(runs[m]) for m, d in decs.items()}


def part_plain(target, tokens: int, reps: int) -> dict:
    """Plain greedy decoding of one chat prompt: tokens/s on each path of our decoder."""
    rates = plain_rates(target, ("false", "true"), tokens, reps)
    return {f"ours {k} tok/s": v for k, v in rates.items()}


def part_fused(target, tokens: int, reps: int, widths=(1, 4)) -> dict:
    """``compile=fused`` against ``compile=true``: a forward at each of ``widths`` (interleaved
    medians), what compiling cost, and plain decoding's tokens/s on both (on a CPU: eager at exact
    shapes, as the decoder runs there)."""
    from decoding.runner import StaticRunner

    graphs = "cuda" if target.device.type == "cuda" else "off"
    t = time.perf_counter()
    runners = {
        "graphs": StaticRunner(target, (), widths, graphs),
        "graphs + fused": StaticRunner(target, (), widths, graphs, fuse=True),
    }
    res: dict = {"build_and_capture_s": time.perf_counter() - t}
    res["forward_ms"] = forward_costs(target, runners, widths, reps)
    del runners
    for k, v in plain_rates(target, ("true", "fused"), tokens, reps).items():
        res[f"plain {k} tok/s"] = v
    return res


def part_draft(target, reps: int, gamma: int = 3) -> dict:
    """The shipped EAGLE-3 head drafting a chain of ``gamma`` after ``gamma`` newly committed
    tokens: ms per proposal with the eager proposer (a device read per drafted token) and the
    fixed-shape chain (one read per proposal), eager over the columns in use, and over the
    whole static cache as a captured graph computes it (CUDA: captured)."""
    from data.chat import prompt_ids
    from decoding.drafts import load_proposer
    from models.base import DecodeSettings, DecodeState
    from models.eagle.static import StaticEagleChain
    from models.sampling import Sampling

    prop, _ = load_proposer("smollm2-eagle3", target, tree=DecodeSettings(tree="chain"))
    p = prompt_ids(target.tokenizer, [{"role": "user", "content": PROMPT}])
    ids = p + list(range(28, 33)) * 40
    n = len(ids)
    mask = torch.ones(1, n, dtype=torch.long)
    feats = target.features(torch.tensor([ids]), mask, prop.feature_layers)[0]
    state = DecodeState(ids, feats[: n - 1], Sampling(), None, target.device)
    graphs = "cuda" if target.device.type == "cuda" else "emulate"
    props = {
        "eager proposer": prop,
        "fixed-shape chain, eager": StaticEagleChain(prop.head, gamma, "off"),
        f"fixed-shape chain, {'CUDA graph' if graphs == 'cuda' else 'graph shapes'}": (
            StaticEagleChain(prop.head, gamma, graphs)
        ),
    }
    back = DecodeState(ids[: n - gamma + 1], feats[: n - gamma], Sampling(), None, target.device)

    def setup(name):
        q = props[name]
        q.start(back)  # untimed: the sequence gamma tokens back
        return lambda: q.propose(state, gamma)

    with torch.no_grad():
        med = interleaved_medians(list(props), setup, target.device, reps)
    res = {f"{name}: ms per proposal of {gamma}": 1e3 * s for name, s in med.items()}
    res["tree"] = part_tree(prop.head, ids, feats, target.device, reps)
    return res


def part_draft_lm(target, reps: int, layers: int = 4, gamma: int = 3) -> dict:
    """A draft LM (the target's first ``layers`` layers, ``truncate:N``: a DistillSpec
    student's shape) drafting a chain of ``gamma`` after two newly committed tokens, ms per
    proposal: transformers' forward over a DynamicCache, the lean forward over a static cache
    eager at exact shapes, and the whole proposal as one graph (CUDA: captured; a CPU: the
    graph's fixed shapes run eagerly, attending over the whole cache)."""
    from data.chat import prompt_ids
    from models.base import DecodeState
    from models.draft_lm import DraftLMProposer
    from models.draft_lm.static import StaticDraftLM
    from models.sampling import Sampling

    model = target.truncated(layers)
    v = target.config.vocab_size
    p = prompt_ids(target.tokenizer, [{"role": "user", "content": PROMPT}])
    ids = p + list(range(28, 33)) * 40
    graphs = "cuda" if target.device.type == "cuda" else "emulate"
    props = {
        "transformers": DraftLMProposer(model, v),
        "static, eager": StaticDraftLM(model, v, gamma_max=gamma, graphs="off"),
        f"static, {'CUDA graph' if graphs == 'cuda' else 'graph shapes'}": (
            StaticDraftLM(model, v, gamma_max=gamma, graphs=graphs)
        ),
    }

    def state(n):
        return DecodeState(ids[:n], None, Sampling(), None, target.device)

    def setup(name):
        q = props[name]
        q.start(state(len(ids) - 2))  # untimed: the sequence two tokens back
        return lambda: q.propose(state(len(ids)), gamma)

    with torch.no_grad():
        med = interleaved_medians(list(props), setup, target.device, reps)
    res = {f"{name}: ms per proposal of {gamma}": 1e3 * s for name, s in med.items()}
    res["draft"] = f"the target's first {layers} layers, a {len(ids)}-token context"
    return res


def part_tree(head, ids, feats, device, reps: int, depth=5, top_k=8, nodes=32) -> dict:
    """The EAGLE-2 tree of ``scripts/gpu_check.sh``'s ``tree`` step (depth 5, top_k 8, 32
    nodes), one proposal after ``depth`` newly committed tokens, in parts: the eager tree
    proposer (a device read per level), the fixed-shape tree's whole proposal (its graph on
    CUDA), its graph alone (the replay and one sync) and its host part alone (the read of
    every node and the choice of the best ``nodes``). An H100 measured 4.85 ms a proposal
    inside the decoder where the chain of 3 took 0.81 (docs/benchmarks.md, part 4)."""
    from models.base import DecodeSettings, DecodeState
    from models.eagle.static import StaticEagleTree
    from models.sampling import Sampling

    n = len(ids)
    eager = head.proposer(
        DecodeSettings(tree="dynamic", depth=depth, top_k=top_k, total_tokens=nodes)
    )
    graphs = "cuda" if device.type == "cuda" else "emulate"
    fixed = StaticEagleTree(head, depth, top_k, nodes, 0.0, graphs)
    state = DecodeState(ids, feats[: n - 1], Sampling(), None, device)
    back = DecodeState(ids[: n - depth + 1], feats[: n - depth], Sampling(), None, device)
    props = {"eager tree proposer": eager, "fixed-shape tree, whole proposal": fixed}

    def setup(name):
        q = props[name]
        q.start(back)
        return lambda: q.propose(state, depth)

    with torch.no_grad():
        med = interleaved_medians(list(props), setup, device, reps)
        fixed.start(back)
        fixed.propose(state, depth)  # captured, its inputs set
        cap = fixed._graph(depth, state.sampling)
        replay = median_seconds(cap, device, reps)
        out = cap()
        host = median_seconds(lambda: fixed._proposal(out), device, reps)
    res = {f"{k}, ms": 1e3 * v for k, v in med.items()}
    res[
        f"fixed-shape tree, {'graph replay' if graphs == 'cuda' else 'its shapes run eagerly'}, ms"
    ] = 1e3 * replay
    res["fixed-shape tree, host part (read and choice), ms"] = 1e3 * host
    res["capture_s"] = fixed.capture_seconds
    return res


def part_batch(target, tokens: int, reps: int, sizes=(1, 4, 16)) -> dict:
    """The batched decoder's target runners (``decoding/batch_runner.py``): transformers'
    ragged cache and the static one (CUDA graphs per row bucket and width on CUDA, eager on a
    CPU): ms of a verification of 1 and 4 tokens per row after 256 columns at each batch size,
    and plain batched decoding's tokens/s (``2 * max(sizes)`` requests of ``tokens`` tokens,
    continuous batching at the largest size; medians of ``reps`` interleaved runs)."""
    from data.chat import prompt_ids
    from decoding.batch import BatchDecoder
    from decoding.batch_runner import RaggedRunner, StaticBatchRunner, batch_widths
    from decoding.decoder import NoDraft
    from models.ragged import prefill_waste
    from models.sampling import Sampling
    from models.target import GenRequest

    dev = target.device
    big = max(sizes)
    graphs = "cuda" if dev.type == "cuda" else "off"
    t = time.perf_counter()
    runners = {
        "transformers": RaggedRunner(target, (), prefill_waste(dev), False),
        "static" + (" + CUDA graphs" if graphs == "cuda" else ""): StaticBatchRunner(
            target, (), big, batch_widths(4), graphs, max_len=1024, waste=prefill_waste(dev)
        ),
    }
    res: dict = {"build_and_capture_s": time.perf_counter() - t, "verify_ms": {}}
    for b in sizes:
        for name, r in runners.items():
            med = r.verify_costs(b, (1, 4), 256, reps)
            res["verify_ms"][f"{name}, {b} rows"] = {k: 1e3 * v for k, v in med.items()}
    topics = ["a robot who learns to paint", "the history of tea", "how rainbows form"]
    reqs = [
        GenRequest(
            i,
            prompt_ids(
                target.tokenizer,
                [{"role": "user", "content": f"Write about {topics[i % 3]} (part {i})."}],
            ),
        )
        for i in range(2 * big)
    ]
    decs = {
        name: BatchDecoder(target, NoDraft(), Sampling(), big, gamma=0, runner=r)
        for name, r in runners.items()
    }
    for d in decs.values():
        d.run(reqs[:big], 8)
    rates: dict[str, list[float]] = {n: [] for n in decs}
    outs = {}
    for _ in range(reps):
        for name, d in decs.items():
            outs[name] = d.run(reqs, tokens)
            rates[name].append(d.stats.tokens_per_second)
    res[f"plain tok/s at batch {big}, {len(reqs)} requests x {tokens}"] = {
        n: statistics.median(v) for n, v in rates.items()
    }
    first = next(iter(outs.values()))
    res["outputs identical across runners"] = sum(
        o[k] == first[k] for o in outs.values() for k in first
    ) / (len(outs) * len(first))
    del decs, runners
    res[f"draft_ms, shipped head, chain of 3, {big} rows"] = batched_draft_costs(target, big, reps)
    res[f"draft_ms, shipped head, tree (depth 5, top_k 8, 32 nodes), {big} rows"] = (
        batched_draft_costs(target, big, reps, gamma=5, tree=True)
    )
    return res


def batched_draft_costs(target, rows: int, reps: int, gamma: int = 3, tree: bool = False) -> dict:
    """ms of one proposal of ``gamma`` for ``rows`` rows by the shipped EAGLE-3 head, after
    each row committed 2 new tokens: the eager batched drafter (a device read per step, a
    tree's per level) and the fixed-shape one (one read; CUDA: one graph replay; a CPU: its
    eager shapes). ``tree``: EAGLE-2 trees of depth ``gamma``, top_k 8, 32 nodes."""
    from decoding.drafts import load_proposer
    from models.base import DecodeSettings, DecodeState
    from models.sampling import Sampling

    settings = (
        DecodeSettings(tree="dynamic", depth=gamma, top_k=8, total_tokens=32)
        if tree
        else DecodeSettings(tree="chain")
    )
    prop, _ = load_proposer("smollm2-eagle3", target, tree=settings)
    g = torch.Generator().manual_seed(2)
    n = 160
    states = []
    for _ in range(rows):
        ids = torch.randint(0, target.config.vocab_size, (n,), generator=g).tolist()
        x = torch.tensor([ids], device=target.device)
        f = target.features(x, torch.ones_like(x), prop.feature_layers)[0]
        states.append(DecodeState(ids, f[: n - 1], Sampling(), None, target.device))
    graphs = "cuda" if target.device.type == "cuda" else "emulate"
    drafters = {
        "eager batched": prop.batched(),
        "fixed shapes" + (" (CUDA graph)" if graphs == "cuda" else ""): prop.batched_fixed_shape(
            rows, gamma, graphs
        ),
    }
    for bp in drafters.values():
        bp.join(states)

    def setup(name):
        bp = drafters[name]
        bp.rollback(states, [])
        bp.done = [n - 3] * rows  # the same 2 new pairs to catch up on each time
        return lambda: bp.propose(states, [gamma] * rows)

    with torch.no_grad():
        med = interleaved_medians(list(drafters), setup, target.device, reps)
        # the fixed-shape drafter's function alone (its graph's replay on CUDA): the rest of
        # its proposal is the host's (the block of committed pairs, the inputs' copies)
        fixed = drafters[next(k for k in drafters if k.startswith("fixed"))]
        bucket = next(b for b in fixed.buckets if b >= rows)
        replay = median_seconds(
            fixed._graph(bucket, gamma, None if tree else states[0].sampling), target.device, reps
        )
    res = {k: 1e3 * v for k, v in med.items()}
    res["fixed shapes, its function alone" + (" (graph replay)" if graphs == "cuda" else "")] = (
        1e3 * replay
    )
    return res


def part_hf_compile(target, tokens: int, reps: int) -> dict:
    """transformers' generate with its static cache, the forward under torch.compile
    (``reduce-overhead``: CUDA graphs), greedy: the reference a compiled decoder is held to."""
    from data.chat import prompt_ids

    p = prompt_ids(target.tokenizer, [{"role": "user", "content": PROMPT}])
    ids = torch.tensor([p], device=target.device)
    m = target.model
    m.generation_config.cache_implementation = "static"
    m.forward = torch.compile(m.forward, mode="reduce-overhead", fullgraph=True)
    kw = dict(max_new_tokens=tokens, min_new_tokens=tokens, do_sample=False)
    t = time.perf_counter()
    m.generate(ids, **kw)
    m.generate(ids, **kw)
    compile_s = time.perf_counter() - t
    rates = []
    for _ in range(reps):
        sync(target.device)
        t = time.perf_counter()
        m.generate(ids, **kw)
        sync(target.device)
        rates.append(tokens / (time.perf_counter() - t))
    return {
        "transformers generate static+compile tok/s": statistics.median(rates),
        "compile_s": compile_s,
    }


def copy_bandwidth(dev, nbytes: int = 1 << 30) -> float:
    """Bytes per second a device-to-device copy moves (read + write counted)."""
    a = torch.empty(nbytes // 2, dtype=torch.bfloat16, device=dev)
    b = torch.empty_like(a)
    s = median_seconds(lambda: b.copy_(a), dev, 10)
    return 2 * nbytes / s


def graph_seconds(fn, dev, reps: int) -> float:
    """Median seconds of ``fn``: on CUDA captured once into a graph and replayed (no host
    launch between its kernels, as in the decoder's captured forward), else called."""
    if dev.type != "cuda":
        fn()
        return median_seconds(fn, dev, reps)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()  # warm-up off the capture: library workspaces, autotuning
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return median_seconds(graph.replay, dev, reps)


PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "up_proj", "gate_proj", "down_proj")


def part_family(device: str, reps: int, config: str, layers: int, widths=(1, 4, 8)) -> dict:
    """A target shaped like ``config`` (any HF config folder: a mixture of experts, Gemma,
    ...) with random weights and its first ``layers`` layers (0: all of them), built on the
    device (labelled: costs only): a forward's ms at each width on transformers' path and on
    the static path (eager on a CPU, CUDA graphs on a GPU), or the one-line reason the static
    path does not compute it."""
    from transformers import AutoConfig

    from decoding.runner import HFRunner, StaticRunner
    from models.lean import lean_support
    from models.target import Target, TargetConfig, cpu_has_bf16

    dev = torch.device(device)
    cfg = AutoConfig.from_pretrained(config)
    if layers:
        cfg.num_hidden_layers = layers
        if getattr(cfg, "layer_types", None):
            cfg.layer_types = cfg.layer_types[:layers]
    dtype = torch.bfloat16 if dev.type == "cuda" or cpu_has_bf16() else torch.float32
    model, build_s = random_model(cfg, dev, dtype)
    name = Path(config).name
    target = Target(model, None, f"{name}-shaped-random", TargetConfig(name="hf"))
    res: dict = {
        "config": name,
        "layers": cfg.num_hidden_layers,
        "dtype": str(model.dtype).replace("torch.", ""),
        "weights_GB": sum(p.numel() * p.element_size() for p in model.parameters()) / 1e9,
        "build_s": build_s,
    }
    runners = {"transformers": HFRunner(target, ())}
    why = lean_support(model)
    if why is None:
        graphs = "cuda" if dev.type == "cuda" else "off"
        runners["static"] = StaticRunner(target, (), widths, graphs, max_len=512)
    res["static_path"] = why or ("CUDA graphs" if dev.type == "cuda" else "eager")
    res["forward_ms"] = forward_costs(target, runners, widths, reps)
    if why is None:
        f = res["forward_ms"]
        res["static_over_transformers"] = {w: f["static"][w] / f["transformers"][w] for w in widths}
    return res


def component_costs(model, dev, reps: int, context: int, copy_bw: float) -> dict:
    """A one-token forward of ``model`` (Llama-shaped) in its parts, each timed over every
    layer's own weights in turn, as the forward reads them (no weight is read twice, so no
    cache holds it): each projection kind's matrix products, the attention over ``context``
    cached columns (grouped-query, as the static path calls it), and the LM head. Each with the
    bytes it must read and its fraction of the copy bandwidth ``copy_bw``; what a whole
    forward costs beyond their sum is the norms, RoPE, cache writes, residuals and the gaps
    between kernels."""
    import torch.nn.functional as F

    layers = model.model.layers
    a0 = layers[0].self_attn
    cfg = model.config
    H, inter = cfg.hidden_size, cfg.intermediate_size
    n_heads, n_kv = cfg.num_attention_heads, cfg.num_key_value_heads
    D = getattr(cfg, "head_dim", None) or H // n_heads
    g = n_heads // n_kv
    dt = a0.q_proj.weight.dtype
    x = torch.randn(1, 1, H, dtype=dt, device=dev)
    xi = torch.randn(1, 1, inter, dtype=dt, device=dev)
    xo = torch.randn(1, 1, n_heads * D, dtype=dt, device=dev)
    ms: dict[str, float] = {}
    nbytes: dict[str, float] = {}
    for kind in PROJECTIONS:
        part = "mlp" if kind in ("up_proj", "gate_proj", "down_proj") else "self_attn"
        mod = [getattr(getattr(lay, part), kind) for lay in layers]
        inp = xi if kind == "down_proj" else xo if kind == "o_proj" else x

        def run(mod=mod, inp=inp):
            for m in mod:
                F.linear(inp, m.weight, m.bias)

        ms[kind] = 1e3 * graph_seconds(run, dev, reps)
        nbytes[kind] = sum(m.weight.numel() * m.weight.element_size() for m in mod)
    kv = [
        (
            torch.randn(1, n_kv, context, D, dtype=dt, device=dev),
            torch.randn(1, n_kv, context, D, dtype=dt, device=dev),
        )
        for _ in layers
    ]
    q = torch.randn(1, n_kv, g, D, dtype=dt, device=dev)  # g query heads per kv head, one token

    def attend():
        for k, v in kv:
            F.scaled_dot_product_attention(q, k, v)

    ms["attention"] = 1e3 * graph_seconds(attend, dev, reps)
    nbytes["attention"] = sum(2 * k.numel() * k.element_size() for k, _ in kv)
    head = model.lm_head.weight
    ms["lm_head"] = 1e3 * graph_seconds(lambda: F.linear(x, head), dev, reps)
    nbytes["lm_head"] = head.numel() * head.element_size()
    return {
        "context_columns": context,
        "ms": ms,
        "GB_read": {k: v / 1e9 for k, v in nbytes.items()},
        "fraction_of_copy_bandwidth": {k: nbytes[k] / copy_bw / (ms[k] / 1e3) for k in ms},
        "sum_ms": sum(ms.values()),
    }


def random_model(cfg, dev: torch.device, dtype: torch.dtype):
    """The causal LM of transformers config ``cfg`` built on ``dev`` in ``dtype`` (not the
    config's own) with random weights (normal, std 0.02), in eval mode, and the seconds it
    took: costs only, no weights carried."""
    from transformers import AutoModelForCausalLM

    t = time.perf_counter()
    with torch.device(dev):
        model = AutoModelForCausalLM.from_config(cfg, dtype=dtype)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.02)
    return model.eval(), time.perf_counter() - t


def part_shaped(device: str, reps: int, config: str, fuse: bool = False) -> dict:
    """A Llama-3.1-8B-shaped target with random weights, built on the device (labelled: costs
    only), on the static path with graphs: forward ms per width against the bandwidth limit,
    and an EAGLE-3 head's draft step (random weights) against a target step. ``fuse``: the
    forward's layers through torch.compile (``compile=fused``), at widths 1 and 8 only (each
    width compiles), and no draft step."""
    from transformers import AutoConfig

    from decoding.runner import StaticRunner
    from models.base import DecodeState
    from models.eagle import Eagle3Config, Eagle3Head
    from models.eagle.static import StaticEagleChain
    from models.sampling import Sampling
    from models.target import Target, TargetConfig

    dev = torch.device(device)
    cfg = AutoConfig.from_pretrained(config)
    model, build_s = random_model(cfg, dev, torch.bfloat16)
    target = Target(model, None, "llama-3.1-8b-shaped-random", TargetConfig(name="hf"))
    widths = (1, 8) if fuse else (1, 8, 16, 32)
    graphs = "cuda" if dev.type == "cuda" else "off"
    runner = StaticRunner(target, (), widths, graphs, max_len=512, fuse=fuse)
    fwd = forward_costs(target, {"static": runner}, widths, reps)["static"]
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    # a step reads every weight but the embedding table (one row of it)
    read = weight_bytes - model.get_input_embeddings().weight.numel() * 2
    bw = copy_bandwidth(dev)
    limit_ms = 1e3 * read / bw
    res = {
        "build_s": build_s,
        "capture_s": runner.capture_seconds,
        "forward_ms": fwd,
        "verify_over_one_step": {w: fwd[w] / fwd[1] for w in widths},
        "weight_GB_read_per_step": read / 1e9,
        "copy_bandwidth_GB_s": bw / 1e9,
        "bandwidth_limit_ms": limit_ms,
        "fraction_of_bandwidth_limit": limit_ms / fwd[1],
    }
    del runner
    if fuse:
        return res
    # the one-token forward in its parts: where the time beyond the bandwidth limit goes (the
    # captured forward attends over every column of the static cache, masked: as many here)
    from models.lean import round_up

    parts = component_costs(model, dev, reps, round_up(512 + max(widths)), copy_bw=bw)
    parts["forward_ms"] = fwd[1]
    parts["rest_ms"] = fwd[1] - parts["sum_ms"]
    res["one_token_forward_in_parts"] = parts
    head = Eagle3Head(target, Eagle3Config()).to(dev, torch.bfloat16).eval()
    L = len(head.feature_layers)
    n = 256
    ids = torch.randint(0, cfg.vocab_size, (n,)).tolist()
    feats = torch.randn(n - 1, L, cfg.hidden_size, dtype=torch.bfloat16, device=dev) * 0.1
    for gamma in (1, 3):
        chain = StaticEagleChain(head, gamma, graphs, max_len=512)
        state = DecodeState(ids, feats, Sampling(), None, dev)
        chain.start(DecodeState(ids[: n - 4], feats[: n - 5], Sampling(), None, dev))

        def draft(chain=chain, state=state, gamma=gamma):
            chain.done = n - 1 - gamma  # the same gamma new pairs to catch up on each time
            chain.propose(state, gamma)

        s = median_seconds(draft, dev, reps)
        res[f"eagle3 draft gamma={gamma} ms"] = 1e3 * s
        res[f"eagle3 draft step over target step (gamma={gamma})"] = 1e3 * s / gamma / fwd[1]
        res[f"eagle3 capture_s gamma={gamma}"] = chain.capture_seconds
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--parts",
        default="forward,plain",
        help="forward,plain,draft,draft_lm,fused,batch,hf_compile,shaped,shaped_fused,family",
    )
    ap.add_argument(
        "--layers",
        type=int,
        default=2,
        help="family: the first N layers of --config's target (0: all of them)",
    )
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--widths", default=",".join(map(str, WIDTHS)))
    ap.add_argument(
        "--config", default=str(Path(__file__).parent / "model_configs" / "llama-3.1-8b-instruct")
    )
    ap.add_argument("--out", default=None)
    ap.add_argument(
        "--merge",
        action="store_true",
        help="add this run's parts to the --out file's (one report from several runs)",
    )
    a = ap.parse_args()
    import transformers

    from models.target import TargetConfig, load_target

    parts = a.parts.split(",")
    known = ("forward", "plain", "draft", "draft_lm", "fused", "batch", "hf_compile", "shaped")
    known += ("shaped_fused", "family")
    for part in parts:
        if part not in known:
            ap.error(f"--parts: no part {part!r} (use {', '.join(known)})")
    report: dict = {
        "device": torch.cuda.get_device_name(0)
        if a.device.startswith("cuda")
        else platform.processor() or platform.machine(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "threads": torch.get_num_threads(),
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
    }
    if a.merge and a.out and Path(a.out).is_file():
        report = {**json.loads(Path(a.out).read_text()), **report}
    widths = tuple(int(w) for w in a.widths.split(","))
    target = None
    if {"forward", "plain", "draft", "draft_lm", "fused", "batch", "hf_compile"} & set(parts):
        target = load_target(TargetConfig(device=a.device))
        report["target"] = f"{target.identity} ({str(target.dtype).replace('torch.', '')})"
    few = max(3, a.reps // 2)
    runs = {
        "forward": ("forward_ms", lambda: part_forward(target, widths, a.reps)),
        "plain": ("plain", lambda: part_plain(target, a.tokens, few)),
        "draft": ("draft", lambda: part_draft(target, 2 * a.reps + 1)),
        "draft_lm": ("draft_lm", lambda: part_draft_lm(target, 2 * a.reps + 1)),
        "fused": ("fused", lambda: part_fused(target, a.tokens, few)),
        "batch": ("batch", lambda: part_batch(target, a.tokens, few)),
        "hf_compile": ("hf_compile", lambda: part_hf_compile(target, a.tokens, few)),
        "shaped": (
            "llama_3.1_8b_shaped_random",
            lambda: part_shaped(a.device, a.reps, a.config),
        ),
        "shaped_fused": (
            "llama_3.1_8b_shaped_random_fused",
            lambda: part_shaped(a.device, a.reps, a.config, fuse=True),
        ),
        "family": (
            f"{Path(a.config).name}_shaped_random",
            lambda: part_family(a.device, a.reps, a.config, a.layers),
        ),
    }
    for part in runs:  # in this order; the report is written after each part (a part cut
        if part not in parts:  # off by a time limit leaves the earlier ones)
            continue
        if part.startswith("shaped") or part == "family":
            target = None  # the embedded target's memory back before an 8B-shaped one
        key, run = runs[part]
        report[key] = run()
        text = json.dumps(report, indent=1)
        if a.out:
            Path(a.out).write_text(text)
    print(text)


if __name__ == "__main__":
    from decoding.contention import measured

    measured(main)
