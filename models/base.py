"""The named contracts between the shared machinery and a draft method.

Three contracts, each a small base class whose optional hooks have no-op defaults and whose
required hooks are abstract (a method that forgets one cannot be instantiated, and the error
names the hook):

- ``DraftMethod``: what the training loop (trainer/), the evaluator (decoding/eval.py) and the
  exporter (models/export.py) call on a trained draft.
- ``Proposer``: what the shared decoder (decoding/decoder.py) calls at decode time.
- ``ExportFormat``: what the generic export pipeline (models/export.py) calls to write, check
  and read back one serving layout.

Nothing outside these classes is looked up by ``getattr``. Each method lives in its own folder
(``models/eagle/``, ``models/medusa/``, ...) and is made known by one line in ``models/__init__``.

Metrics are ``{name: tensor([sum, count])}``, detached, so that they add up across steps and
processes and are divided only when logged (no ``.item()`` in the hot path).
"""

from __future__ import annotations

import abc
import contextlib
import json
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import torch
from torch import nn

DRAFT_CONFIG = "config.json"
DRAFT_WEIGHTS = "model.safetensors"


@dataclass
class StepOutput:
    loss: torch.Tensor
    metrics: dict[str, torch.Tensor] = field(default_factory=dict)


def metric(total: torch.Tensor | float, count: torch.Tensor | float) -> torch.Tensor:
    """A summable metric: stack([sum, count]) as a detached float32 tensor."""
    t = torch.as_tensor(total, dtype=torch.float32).detach()
    c = torch.as_tensor(count, dtype=torch.float32, device=t.device).detach()
    return torch.stack([t.float(), c])


#: the chain a served draft most often runs (vLLM's ``num_speculative_tokens=3``): validation
#: also reports what decoding its text with such a chain would accept (``served_chain``)
SERVED_CHAIN = 3


def served_chain(
    agrees: list[torch.Tensor], masks: list[torch.Tensor], gamma: int = SERVED_CHAIN
) -> dict[str, torch.Tensor]:
    """What a chain of ``gamma`` drafts would accept decoding the validation text at T = 0:
    ``chain{gamma}_tau`` (tokens an iteration, the bonus counted) and ``chain{gamma}_alpha``
    (accepted / tested drafts), as summable metrics.

    ``agrees[j-1][b, s]``: draft position j from start s (reading token s+1, the tokens before
    it the text's own) agrees with the target's greedy token; ``masks[j-1][b, s]``: it is
    scored (inside a reply). At T = 0 an accepted draft is the text's own token, so these are
    exactly the tests a decoder makes; but it makes them only at the starts its iterations
    reach (one past each iteration's last accepted draft and its bonus token, often just after
    a miss), where the mean agreement over every start, ``top1_pos1``, counts them all. Each
    reply is decoded from its first scored start (its first token is the prompt's prefill's,
    scored by no draft, as in ``specdraft-eval`` and vLLM)."""
    g = min(gamma, len(agrees))
    a = torch.stack([x.bool() for x in agrees[:g]], -1).cpu()  # (B, S, g)
    m = torch.stack([x.bool() for x in masks[:g]], -1).cpu()
    iterations = tokens = tested = accepted = 0
    for b in range(a.shape[0]):
        valid = m[b, :, 0].tolist()
        row_a, row_m = a[b].tolist(), m[b].tolist()
        s, S = 0, len(valid)
        while s < S:
            if not valid[s]:
                s += 1
                continue
            n = 0
            while n < g and row_m[s][n] and row_a[s][n]:
                n += 1
            tested += n + (n < g and row_m[s][n])
            accepted += n
            iterations += 1
            tokens += n + 1
            s += n + 1
    return {
        f"chain{gamma}_tau": metric(float(tokens), float(iterations)),
        f"chain{gamma}_alpha": metric(float(accepted), float(tested)),
    }


def add_metrics(acc: dict[str, torch.Tensor], new: dict[str, torch.Tensor]) -> None:
    for k, v in new.items():
        acc[k] = acc[k] + v.to(acc[k].device) if k in acc else v.clone()


def reduce_metrics(acc: dict[str, torch.Tensor]) -> dict[str, float]:
    out = {}
    for k, v in acc.items():
        s, c = v.tolist()
        if c > 0:
            out[k] = s / c
    return out


class DraftError(ValueError):
    """A draft checkpoint that cannot be used; the message names the folder and the problem."""


class ExportError(RuntimeError):
    """An export that failed a check; the message names the file, key and problem."""


# The modules LoRA adapts by default (Llama-family names; any HF decoder's names work).
LORA_TARGETS = (
    "q_proj",
    "k_proj",
    "v_proj",
    "o_proj",
    "gate_proj",
    "up_proj",
    "down_proj",
    "qkv_proj",  # Phi-3's fused projections
    "gate_up_proj",
)


def lora_modules(model: nn.Module, names, key: str = "method.lora_target_modules") -> list[str]:
    """The full names of ``model``'s linear layers whose last name is one of ``names``: what a
    LoRA adapter goes on. Experts that a mixture-of-experts layer keeps as one stacked weight
    (Qwen3-MoE, DeepSeek-V3, GPT-OSS) are not linear layers and keep their weights; the
    attention projections and dense MLPs take the adapter. ``DraftError`` (one line) where no
    layer matches."""
    want = set(names)
    found = [
        n
        for n, m in model.named_modules()
        if isinstance(m, nn.Linear) and n.rsplit(".", 1)[-1] in want
    ]
    found = [n for n in found if not n.endswith("lm_head")]
    if not found:
        raise DraftError(f"{key}={sorted(want)}: no linear layer of the model has these names")
    return found


def write_draft_config(
    path: Path, method_cfg: object, target, format_version: int, **extra
) -> None:
    """``config.json`` of a saved draft: the method and its settings, the target it was trained
    for (checked when it is loaded or evaluated), and any method-specific ``extra`` keys."""
    from dataclasses import asdict

    t = target
    cfg = {
        "specdraft": {"method": method_cfg.name, "format_version": format_version},
        "method": asdict(method_cfg),
        "target": {
            "identity": t.identity,
            "name": t.cfg.name,
            "path": t.cfg.path,
            "hidden_size": t.hidden_size,
            "num_hidden_layers": t.num_layers,
            "vocab_size": t.config.vocab_size,
        },
        **extra,
    }
    (Path(path) / DRAFT_CONFIG).write_text(json.dumps(cfg, indent=1))


def readable_by_others(folder: Path) -> None:
    """Give a written folder the modes a plain ``mkdir``/``open`` would have (0777/0666 less
    the umask): ``mkdtemp`` and safetensors' files are private (0700/0600), which a serving
    engine running as another user could not read."""
    umask = os.umask(0)
    os.umask(umask)
    for p in [folder, *folder.rglob("*")]:
        p.chmod((0o777 if p.is_dir() else 0o666) & ~umask)


def save_weights_draft(draft, path: str | Path, format_version: int, **extra) -> None:
    """A draft folder for a module whose state dict is exactly its draft: ``model.safetensors``
    and ``config.json`` (with its ``feature_layers`` and any method-specific ``extra`` keys)."""
    from safetensors.torch import save_file

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().contiguous().cpu() for k, v in draft.state_dict().items()}
    save_file(state, str(path / DRAFT_WEIGHTS), metadata={"format": "pt"})
    write_draft_config(
        path,
        draft.cfg,
        draft.target,
        format_version,
        feature_layers=list(draft.feature_layers),
        **extra,
    )


def load_weights_draft(cls, path: str | Path, target):
    """The draft ``save_weights_draft`` wrote, for ``target``; ``DraftError`` naming the folder
    for another hidden size, unreadable weights or weights that do not fit."""
    cfg = read_draft_config(path)
    check_hidden_size(cfg, path, target)
    draft = cls(target, cls.config_class(**cfg["method"]))
    fit_weights(draft, read_draft_weights(path), path, cfg)
    return draft.to(target.device)


def check_hidden_size(cfg: dict, path: str | Path, target) -> None:
    """``DraftError`` naming the folder where its draft was trained for another hidden size."""
    if cfg["target"]["hidden_size"] != target.hidden_size:
        raise DraftError(
            f"{path}: draft was trained for hidden size {cfg['target']['hidden_size']}, "
            f"target {target.identity} has {target.hidden_size}"
        )


def read_draft_weights(path: str | Path) -> dict[str, torch.Tensor]:
    """A draft folder's weights file; ``DraftError`` naming it where it cannot be read."""
    from safetensors.torch import load_file

    try:
        return load_file(str(Path(path) / DRAFT_WEIGHTS))
    except Exception as e:  # safetensors raises several types for damaged files
        raise DraftError(f"{Path(path) / DRAFT_WEIGHTS}: cannot read weights ({e})") from None


def fit_weights(
    draft: nn.Module,
    state: dict[str, torch.Tensor],
    path: str | Path,
    cfg: dict,
    owed: Callable[[str], bool] = lambda name: True,
) -> None:
    """Load ``state`` into ``draft``: ``DraftError`` naming the folder for a tensor of another
    shape (and the target the draft was made for), or for names missing (those ``owed`` says
    the file must hold) or unexpected."""
    check_shapes(draft, state, path, made_for=cfg["target"].get("identity"))
    missing, unexpected = draft.load_state_dict(state, strict=False)
    missing = [k for k in missing if owed(k)]
    if missing or unexpected:
        raise DraftError(
            f"{path}: weights do not match (missing {missing}, unexpected {unexpected})"
        )


def fit_export_weights(
    module: nn.Module,
    tensors: dict[str, torch.Tensor],
    file: Path,
    what: str,
    names: dict[str, str] | None = None,
) -> None:
    """Load an export's ``tensors`` (each cast to the module's dtype) into ``module``, built for
    its target: ``ExportError`` naming ``file`` for a tensor of another shape (as the file
    spells it: ``names``), or naming its folder for names missing or unexpected (``what``: the
    kind of draft, "an eagle3 head")."""
    own = module.state_dict()
    tensors = {k: v.to(own[k].dtype) if k in own else v for k, v in tensors.items()}
    # another target's layer shapes (same hidden size): one line, not load_state_dict's traceback
    check_shapes(module, tensors, file, error=ExportError, names=names)
    missing, unexpected = module.load_state_dict(tensors, strict=False)
    if missing or unexpected:
        raise ExportError(
            f"{file.parent}: weights do not fit {what} for {module.target.identity} "
            f"(missing {missing[:5]}, unexpected {unexpected[:5]})"
        )


def check_shapes(
    module: nn.Module,
    state: dict[str, torch.Tensor],
    where: str | Path,
    made_for: str | None = None,
    error: type[Exception] = DraftError,
    names: dict[str, str] | None = None,
) -> None:
    """Before ``module.load_state_dict(state)``: ``error`` (one line naming ``where``) for the
    first tensor, in the module's order, whose saved shape is not the one ``module`` (built for
    its target) has. A hidden size can match while the layers' shapes do not (another target's
    KV heads, head width or MLP width), which ``load_state_dict`` reports as a traceback.
    ``made_for``: the target the draft was saved for, named in the message when known;
    ``names``: how the file spells a key, where not as the module does (an export's layout)."""
    target = getattr(module, "target", None)
    mine = f"target {target.identity}" if target is not None else "this target"
    for k, v in module.state_dict().items():
        if k in state and tuple(state[k].shape) != tuple(v.shape):
            name = (names or {}).get(k, k)
            made = f" ({made_for})" if made_for and mine != f"target {made_for}" else ""
            raise error(
                f"{where}: {name} has shape {tuple(state[k].shape)}, {mine} implies "
                f"{tuple(v.shape)}: the draft was made for another target{made}"
            )


def read_draft_config(path: str | Path) -> dict:
    p = Path(path)
    f = p / DRAFT_CONFIG
    if not f.exists():
        raise DraftError(f"{p}: not a draft folder (no {DRAFT_CONFIG})")
    try:
        cfg = json.loads(f.read_text())
    except json.JSONDecodeError as e:
        raise DraftError(f"{f}: not valid JSON ({e})") from None
    if not isinstance(cfg, dict) or "specdraft" not in cfg:
        raise DraftError(f"{f}: not a specdraft draft config (no 'specdraft' key)")
    return cfg


# What a training run writes in its folder: the draft, its checkpoints, its metrics
RUN_FILES = ("final", "checkpoints", "metrics.jsonl")


def run_files(folder: Path) -> list[str]:
    """Which of a training run's files ``folder`` holds."""
    return [name for name in RUN_FILES if (folder / name).exists()]


def unfinished_run(path: Path) -> Path | None:
    """The newest checkpoint holding a saved draft, of a run that stopped before writing
    ``final/`` (None where there is none): what to pass instead of the run."""
    steps = [
        c
        for c in (path / "checkpoints").glob("step_*")
        if c.name[5:].isdigit() and resolve_draft_dir(c) is not None
    ]
    return max(steps, key=lambda c: int(c.name[5:])) if steps else None


def unwritable(path: Path) -> str | None:
    """Why nothing can be written at ``path`` (a file or folder a command is about to write),
    in a few words, or None. Checked before any work, so that a run does not end in a
    traceback at its first write, or lose its results at its last: the nearest existing
    parent is a file, or the folder that would hold ``path`` takes no new file (no
    permission, a read-only or special filesystem); tried by creating and dropping a
    nameless file there."""
    import tempfile

    path = Path(path)
    here = next((p for p in (path, *path.parents) if p.exists()), None)
    if here is None:
        return None
    if here != path and not here.is_dir():
        return f"{here} is a file, not a folder"
    if not here.is_dir():  # an existing file to be replaced: its folder takes the new one
        here = here.parent
    try:
        tempfile.TemporaryFile(dir=here).close()
    except OSError as e:
        return f"nothing can be written in {here} ({e.strerror or e})"
    return None


def resolve_draft_dir(path: Path) -> Path | None:
    """The saved-draft folder behind a run dir, checkpoint dir or draft dir; None if ``path``
    is none of those."""
    for cand in (path / "final", path / "draft", path):
        f = cand / DRAFT_CONFIG
        if f.exists():
            try:
                if "specdraft" in json.loads(f.read_text()):
                    return cand
            except json.JSONDecodeError:
                raise DraftError(f"{f}: not valid JSON") from None
    return None


# ---------------------------------------------------------------------------------------------
# Decode-time contract (shared by every proposer; the decoder lives in decoding/)


@dataclass
class Proposal:
    """Draft tokens as a tree. ``parents[i]`` is the index of node i's parent (-1: the root, i.e.
    the last committed token); a chain has parents [-1, 0, 1, ...]. ``q[i]`` is the (warped)
    draft distribution node i was sampled from, (N, V); None for deterministic proposers (a
    point mass on the token) and for greedy decoding."""

    tokens: list[int]
    parents: list[int]
    q: torch.Tensor | None = None
    bucket: str | None = None  # a confidence class; acceptance is tracked per bucket
    #: (N, F) the draft's own signals about each node (``draft_signals``), when the decoder
    #: asked for them (``DecodeState.signals``); None otherwise or for model-free drafters
    signals: torch.Tensor | None = None

    @staticmethod
    def chain(
        tokens: list[int],
        q: torch.Tensor | None = None,
        bucket: str | None = None,
        signals: torch.Tensor | None = None,
    ) -> Proposal:
        return Proposal(list(tokens), list(range(-1, len(tokens) - 1)), q, bucket, signals)

    @property
    def is_chain(self) -> bool:
        """Each node the child of the one before it (an empty proposal too)."""
        return all(par == i - 1 for i, par in enumerate(self.parents))

    def ancestors(self) -> list[list[bool]]:
        """(N + 1) x (N + 1): row i + 1 marks node i's ancestors and itself, row 0 the root
        (which sees itself); built as lists (one tensor a caller makes of it, not a clone a
        node: ~100 tensor operations for a 32-node tree)."""
        rows = [[True] + [False] * len(self.tokens)]
        for i, par in enumerate(self.parents):
            row = list(rows[par + 1])
            row[i + 1] = True
            rows.append(row)
        return rows

    def truncated(self, k: int) -> Proposal:
        """The first ``k`` nodes (for a chain: the first k tokens)."""
        if k >= len(self.tokens):
            return self
        if any(p >= k for p in self.parents[:k]):
            raise ValueError("truncating a tree must keep every kept node's parent")
        q = self.q[:k] if self.q is not None else None
        sig = self.signals[:k] if self.signals is not None else None
        return Proposal(self.tokens[:k], self.parents[:k], q, self.bucket, sig)

    def __len__(self) -> int:
        return len(self.tokens)


@dataclass
class DecodeState:
    """What a proposer may read. ``ids``: committed tokens (prompt + generated) as a list; the
    last one is not yet fed to the target. ``features``: (len(ids) - 1, L, H) target hidden
    states at the proposer's ``feature_layers`` for every fed position (None if it needs none).
    """

    ids: list[int]
    features: torch.Tensor | None
    sampling: object  # decoding.sampling.Sampling
    generator: torch.Generator | None
    device: torch.device
    #: the decoder wants ``Proposal.signals`` (acceptance traces, a learned stop rule)
    signals: bool = False
    #: a learned stop rule (DISCO): called with a drafted token's signals (F,), True = stop
    #: drafting after that token. None: draft the gamma tokens asked for.
    stop: Callable[[torch.Tensor], bool] | None = None
    #: during ``Proposer.start`` only: the target's KV cache right after the prompt's prefill
    #: (its first ``get_seq_length()`` positions of ``ids``: the batched decoder starts a row's
    #: proposer when the row first drafts, by which time it may have decoded more), for a
    #: self-drafter to copy from; read it, never change it. Given only to a proposer with
    #: ``reads_prefill_cache``; None where the decoder has none to give.
    prefill_cache: object | None = None


#: what ``draft_signals`` returns, per drafted token
SIGNAL_NAMES = ("p_chosen", "p_top1", "p_top2", "p_top3", "p_top4", "entropy", "position")


def draft_signals(logits: torch.Tensor, chosen: int, position: int) -> torch.Tensor:
    """A drafted token's signals (``SIGNAL_NAMES``), from the draft's raw logits (V,) at that
    step (temperature 1, so they mean the same at every sampling setting): the probability of
    the token drafted, the four largest probabilities, the entropy (nats) and the draft
    position (1-based). DISCO's classifier reads these to decide whether to keep drafting."""
    logp = logits.float().log_softmax(-1)
    p = logp.exp()
    top = p.topk(min(4, p.numel())).values
    top = torch.cat([top, top.new_zeros(4 - top.numel())])
    ent = -(p * logp).nan_to_num().sum()
    return torch.cat(
        [p[chosen].reshape(1), top, ent.reshape(1), torch.tensor([float(position)])]
    ).cpu()


@dataclass
class SideBranch:
    """Tokens a proposer adds to the verification forward beside its proposal, to compute
    something for itself, never verified nor committed (lookahead decoding's Jacobi window).
    Each branch token attends to the committed context, the root (the last committed token)
    and the branch tokens ``allowed`` marks; it sits at position root + ``offsets[i]``. The
    decoder hands the target's logits for them back through ``Proposer.side_logits`` and drops
    their cache entries."""

    tokens: list[int]
    offsets: list[int]  # >= 1: position after the root
    allowed: torch.Tensor  # (m, m) bool: branch token i attends to branch token j (i itself too)


_CACHE_KW: dict[type, str] = {}


def keep_last(n: int, device) -> int | torch.Tensor:
    """transformers' ``logits_to_keep`` for the last of ``n`` fed positions. The int form slices
    the hidden states, and for n > 1 (or several rows) that slice is not contiguous: PyTorch's
    matmul then does not fold it into one matrix product but broadcasts the LM head's weight
    into a batched product, copying the whole (vocabulary x hidden) matrix on every call (0.6 s
    for a 151,936 x 896 head on a 2-core CPU, against 0.02 s for the product itself). An index
    tensor gathers a contiguous copy of the last position instead: the same logits, bit for
    bit."""
    return 1 if n == 1 else torch.tensor([n - 1], device=device)


def cache_kw(module, cache) -> dict:
    """``{name: cache}`` for a transformers module's forward: transformers 5.24 renamed
    ``past_key_values`` to ``cache`` (warning on every call with the old name, to be removed in
    5.40); older releases take only the old name. Looked up once per module class."""
    kind = type(module)
    name = _CACHE_KW.get(kind)
    if name is None:
        import inspect

        try:
            params = inspect.signature(module.forward).parameters
        except (TypeError, ValueError):
            params = {}
        name = _CACHE_KW[kind] = "cache" if "cache" in params else "past_key_values"
    return {name: cache}


def rollback_cache(config):
    """A transformers ``DynamicCache`` for ``config`` in which a rejected draft can be rolled
    back: its sliding-window layers (Mistral, Gemma-2/3, GPT-OSS) keep every column, as full
    layers do (transformers' window layer drops the columns that leave the window, so it cannot
    be cropped once the window is full). The window itself is still applied, by the attention
    mask the model builds from the positions; logits are the same as without a cache. Other
    layers (linear attention, ...) are left as the config makes them."""
    from transformers import DynamicCache
    from transformers.cache_utils import DynamicLayer, DynamicSlidingWindowLayer

    cache = DynamicCache(config=config)
    cache.layers = [
        DynamicLayer() if type(x) is DynamicSlidingWindowLayer else x for x in cache.layers
    ]
    return cache


def crop_cache(cache, length: int) -> None:
    """Cut a transformers KV cache back to its first ``length`` positions."""
    n = cache.get_seq_length()
    if n > length:
        cache.crop(-(n - length))


@dataclass
class DecodeSettings:
    """How a trained draft proposes (``specdraft-eval``'s tree settings): ``tree`` is auto (the
    method's default), chain, dynamic (EAGLE-2's tree: ``depth``, ``top_k``, ``total_tokens``,
    ``min_prob``) or static (Medusa's candidate tree: ``tree_nodes`` or ``tree_file``). A method
    reads the fields it uses and rejects a ``tree`` it does not draft. ``draft_weights`` is
    applied by the loader (``decoding/drafts.py``) before the proposer is built."""

    tree: str = "auto"
    depth: int = 5
    top_k: int = 8
    total_tokens: int = 32
    #: dynamic tree: verify and expand only nodes whose cumulative draft probability is at least
    #: this (the tree then sizes itself by confidence, up to depth and total_tokens); 0: off
    min_prob: float = 0.0
    tree_nodes: int | None = None
    tree_file: str | None = None
    #: the draft's weights while decoding: auto (int8 for a bf16 draft on a CPU, where it is
    #: faster; else as loaded), int8 or full (see models/quant.py); proposals stay lossless
    draft_weights: str = "auto"


# ---------------------------------------------------------------------------------------------
# The contracts


class Proposer(abc.ABC):
    """Decode-time contract: everything the shared decoder reads from a drafter.

    ``propose`` is required; the rest have defaults a simple drafter keeps."""

    name: str = "proposer"
    #: target hidden-state indices the decoder passes in ``DecodeState.features``
    feature_layers: tuple[int, ...] = ()
    #: draft forwards run so far (the decoder reports the difference per sequence)
    draft_calls: int = 0
    #: costs nothing (a lookup): the decoder asks for a proposal first, then decides how much of
    #: it to verify, instead of sizing gamma before drafting
    free: bool = False
    #: one draft forward gives every token of a proposal (DFlash, P-EAGLE): drafting costs the
    #: same for any gamma >= 1, and ``last_step_seconds`` measures that forward
    parallel: bool = False
    #: not None: proposes trees of this depth, verified whole (no adaptive gamma)
    tree_depth: int | None = None
    #: not None: the most nodes such a tree holds (the goodput cost model is calibrated on
    #: forwards of up to this many tokens + 1 instead of extrapolating from depth + 1)
    tree_nodes: int | None = None
    #: seconds spent capturing CUDA graphs (a fixed-shape drafter's; reported by the evaluator)
    capture_seconds: float = 0.0
    #: True: ``last_step_seconds`` is this proposer's own measure of one draft step (None after
    #: a propose call with nothing clean to measure); False: the decoder divides drafting time
    #: by tokens drafted
    measures_steps: bool = False
    last_step_seconds: float | None = None
    #: ``start`` reads ``DecodeState.prefill_cache`` (a self-drafter copying the target's cache)
    reads_prefill_cache: bool = False
    #: the trained draft behind the proposer (the evaluator asks it whether it changes the
    #: target), None for model-free drafters
    method: DraftMethod | None = None

    def start(self, state: DecodeState) -> None:  # noqa: B027 (a no-op default)
        """A new sequence begins (``state.ids`` is the prompt)."""

    def batched(self) -> BatchedProposer | None:
        """This draft drafting for all rows of a batch in one forward per step
        (``BatchedProposer``), or None (the default): the batched decoder then gives each row
        its own ``fresh`` copy, drafting row by row."""
        return None

    def batched_fixed_shape(
        self, batch_size: int, gamma: int, graphs: str
    ) -> BatchedProposer | None:
        """``batched`` on fixed shapes, for the batched decoder's static path where graphs
        run (``cuda``; ``emulate``: the same shapes eagerly, for tests): one host read per
        proposal for the whole batch. None (the default): ``batched()`` as it is."""
        return None

    def fixed_shape(self, gamma: int, graphs: str) -> Proposer | None:
        """This drafter for the decoder's static path (``compile=true``): fixed shapes, one
        host read per proposal, captured as CUDA graphs where ``graphs`` is ``cuda``
        (``emulate``: the same shapes run eagerly; ``off``: eager). None (the default): the
        decoder drafts with this proposer as it is."""
        return None

    def reserve(self, total: int) -> None:  # noqa: B027 (a no-op default)
        """Room for sequences of up to ``total`` tokens (a drafter with preallocated caches
        allocates it now, before anything is timed)."""

    def fresh(self) -> Proposer:
        """Another proposer of the same draft for another sequence decoded at the same time
        (a row of the batched decoder): shares the weights, holds its own per-sequence state.
        The default is a shallow copy, right for every proposer whose ``start`` assigns its
        per-sequence state anew (caches, pools) instead of mutating objects in place."""
        import copy

        other = copy.copy(self)
        other.draft_calls = 0
        other.last_step_seconds = None
        return other

    @abc.abstractmethod
    def propose(self, state: DecodeState, gamma: int) -> Proposal:
        """Draft up to ``gamma`` tokens (a chain) or a tree of depth ``gamma`` after
        ``state.ids``."""

    def rollback(self, state: DecodeState, n_accepted: int) -> None:  # noqa: B027 (a no-op default)
        """``state.ids`` now holds the committed tokens; cut any draft cache back to them."""

    #: False: verify every proposal, whatever ``adaptive`` says. For a drafter whose later
    #: proposals depend on drafting now (lookahead's n-gram pool fills from the Jacobi window
    #: it carries in each drafting iteration), a controller that judges iterations one by one
    #: switches it off before the pool fills, and it never recovers (docs/benchmarks.md)
    adaptive: bool = True

    #: fills ``Proposal.signals`` when ``DecodeState.signals`` is set and honours
    #: ``DecodeState.stop`` (a learned stop rule) while drafting a chain
    gives_signals: bool = False

    def side_branch(self, state: DecodeState) -> SideBranch | None:
        """Extra tokens for this iteration's verification forward (``SideBranch``), asked for
        after ``propose``; None (the default): none."""
        return None

    def side_logits(self, state: DecodeState, logits: torch.Tensor) -> None:  # noqa: B027 (a no-op default)
        """The target's logits (m, V) for the tokens of this iteration's ``side_branch``
        (called after verification, ``state.ids`` already holding the committed tokens)."""


class BatchedProposer(abc.ABC):
    """A drafter for every row of the batched decoder at once (``decoding/batch.py``): one
    draft forward per step for the whole batch instead of one per row. Rows are the decoder's,
    in its order: ``join`` appends the newly admitted ones, ``select`` keeps a subset."""

    draft_calls: int = 0
    #: seconds of one draft step for the whole batch, measured by the last ``propose`` (None:
    #: nothing clean to measure)
    last_step_seconds: float | None = None

    @abc.abstractmethod
    def join(self, states: list[DecodeState]) -> None:
        """Rows appended at the end of the batch (``state.ids``: prompt, features filled)."""

    @abc.abstractmethod
    def select(self, keep: list[int]) -> None:
        """Only the rows at these indices stay, in this order."""

    @abc.abstractmethod
    def propose(self, states: list[DecodeState], gammas: list[int]) -> list[Proposal]:
        """Up to ``gammas[b]`` draft tokens (a chain) for each row b."""

    @abc.abstractmethod
    def rollback(self, states: list[DecodeState], accepted: list[int]) -> None:
        """After verification: ``states[b].ids`` holds row b's committed tokens."""

    def reserve(self, total: int) -> None:  # noqa: B027 (a no-op default)
        """Room for rows of up to ``total`` tokens (a drafter with preallocated caches)."""

    def reset(self) -> None:  # noqa: B027 (a no-op default)
        """No rows: a new run (a drafter kept from run to run)."""

    def prepare(self, sampling) -> None:  # noqa: B027 (a no-op default)
        """Whatever is built at first use for ``sampling`` (graphs), built now."""


class DraftMethod(nn.Module, abc.ABC):
    """Training-, evaluation- and export-time contract of a draft method.

    An ``nn.Module`` whose registered parameters are exactly what it trains (the frozen target
    is held by reference, never registered). ``config_class`` is its config dataclass, the one
    place its defaults live (``conf/method/*.yaml`` only selects it); the loop fills
    ``batch["features"]`` (B, T, len(feature_layers), H) from the target or the on-disk cache
    before calling ``forward``."""

    config_class: ClassVar[type]
    feature_layers: tuple[int, ...] = ()

    # -- training (trainer/) -------------------------------------------------------------

    @abc.abstractmethod
    def forward(self, batch: dict[str, torch.Tensor]) -> StepOutput:
        """Training loss and metrics for one batch."""

    @abc.abstractmethod
    def evaluate(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Validation metrics for one batch (called under no_grad)."""

    def tie_weights(self) -> None:
        """Tie again what the Hugging Face models inside this draft tie (a student's LM head to
        its embedding). accelerate's FSDP calls it on the draft it shards after moving it to the
        meta device, which unties them: the two would then train apart."""
        from transformers import PreTrainedModel

        for m in self.modules():
            if isinstance(m, PreTrainedModel):
                m.tie_weights()

    def init_from_data(self, train, log=print) -> None:  # noqa: B027 (a no-op default)
        """Once, before training from scratch (not on resume or ``train.init_from``): settings
        chosen from the training split, e.g. EAGLE-3's draft vocabulary."""

    def start_from(self, src: DraftMethod) -> None:
        """Start from ``src``, a saved draft of the same method with the same shapes
        (``train.init_from``): its weights, and what it chose from its training data (EAGLE-3's
        record that its draft vocabulary was chosen)."""
        self.load_state_dict(src.state_dict())

    def serving_problem(self) -> str | None:
        """Why no serving engine would load this draft once trained (one line), or None.
        Checked before training starts: a run must not train for hours into a head no engine
        takes."""
        return None

    def set_progress(self, fraction: float) -> None:  # noqa: B027 (a no-op default)
        """Before each training step: how far training is, in [0, 1] (the larger of steps
        and minutes over their budgets), for a method with a curriculum (Falcon's glancing)."""

    def param_groups(self, lr: float) -> list:
        """What the optimizer trains: parameters, or param-group dicts (e.g. Medusa-2's heads at
        a multiple of the LoRA learning rate)."""
        return [p for p in self.parameters() if p.requires_grad]

    # -- saving (a draft folder: config.json with a "specdraft" key + weights) ------------

    @abc.abstractmethod
    def save_draft(self, path: str | Path) -> None:
        """The draft's own weights and config, loadable without any training state."""

    @classmethod
    @abc.abstractmethod
    def load_draft(cls, path: str | Path, target) -> DraftMethod:
        """The draft saved at ``path``, for ``target``; ``DraftError`` naming the folder."""

    # -- decoding (decoding/) -------------------------------------------------------------

    @abc.abstractmethod
    def proposer(self, settings: DecodeSettings | None = None) -> Proposer:
        """This draft as a proposer for the shared decoder; ``ValueError`` for settings it does
        not support (e.g. a tree shape it cannot draft)."""

    def quantize_for_decoding(self, mode: str) -> int:
        """Swap this draft's linear layers for int8 ones for decoding (``models/quant.py``;
        ``mode``: auto, int8 or full) and return how many were swapped. The default swaps
        nothing: a method opts in when its decode path only calls its layers (never reads
        their ``weight``). Never called on a draft that will train again."""
        return 0

    def changes_target(self) -> str | None:
        """None if the verifier is the original target; else what changed it (Medusa-2's and a
        LoRA student's adapters): the evaluator then compares against the original."""
        return None

    def original(self) -> contextlib.AbstractContextManager:
        """Inside it, the target computes as the original (adapters disabled)."""
        return contextlib.nullcontext()

    # -- exporting (models/export.py) -----------------------------------------------------

    def probe(self, prompt: list[int]) -> torch.Tensor | None:
        """Draft logits on a fixed prompt that an export, read back, must reproduce (beside
        identical proposals); None: proposals only."""
        return None

    def export_view(self, dtype: torch.dtype) -> DraftMethod:
        """This draft as an export holds it, at ``dtype`` (what a serving engine runs): by
        default a copy of the module in that dtype."""
        ref = type(self)(self.target, self.cfg)
        ref.start_from(self)
        return ref.to(self.target.device, dtype).eval()

    def export_checks(self) -> dict[str, DecodeSettings]:
        """The decode settings (by a short name) whose proposals an export must reproduce."""
        return {"chain": DecodeSettings(tree="chain")}


class ExportFormat(abc.ABC):
    """One serving layout of one or more methods, as the generic export pipeline
    (``models/export.py``) drives it: write ``tensors`` + ``config`` to a temporary folder;
    check every key and shape against ``expected`` (derived from the *target's* config and the
    written config, never from the draft module) and ``check``; ``read`` the folder back;
    compare the read-back draft's probe and proposals with the trained one; move into place."""

    name: str
    methods: tuple[str, ...]  # the ``method.name`` values it exports
    weights_file: str
    description: str
    serve_hint: str = ""  # a README line: how an engine serves it
    #: the ``--format`` name this layout also answers to, for the methods it exports (every
    #: llama.cpp layout answers to ``gguf``, the EAGLE-3 one's own name)
    family: str | None = None
    #: the speculative method vLLM serves this layout with (its ``speculative_config``'s
    #: "method"), None where vLLM does not serve it; checked against vLLM in tests/test_vllm.py
    vllm_method: str | None = None
    #: more of vLLM's ``speculative_config`` this layout needs spelled out (where the method
    #: alone leaves vLLM computing another draft)
    vllm_options: dict[str, Any] = {}  # noqa: RUF012 (read only)
    #: why vLLM, which loads this layout, does not serve it as trained ("" where it does, or
    #: where it does not load it)
    vllm_refusal: str = ""

    def vllm_mismatch(self, folder: Path, config: dict[str, Any]) -> str | None:
        """Why vLLM would serve this folder (of a layout it serves) as another draft than the
        one in it, or None."""
        return None

    def vllm_tokens(self, config: dict[str, Any], gamma: int) -> int:
        """vLLM's ``num_speculative_tokens`` for a folder with this ``config``: ``gamma``
        unless the layout fixes it (Medusa's heads, DFlash's block)."""
        return gamma

    @abc.abstractmethod
    def tensors(self, draft: DraftMethod, dtype: torch.dtype) -> dict[str, torch.Tensor]: ...

    @abc.abstractmethod
    def config(self, draft: DraftMethod, dtype: torch.dtype, **opts: Any) -> dict[str, Any]: ...

    @abc.abstractmethod
    def expected(self, config: dict[str, Any], target_config: Any) -> dict[str, tuple]:
        """Every tensor name the folder must hold, and its shape."""

    @abc.abstractmethod
    def read(self, folder: Path, target, config: dict[str, Any]) -> DraftMethod:
        """The draft in ``folder`` (an export, or a third-party checkpoint in this layout)."""

    @abc.abstractmethod
    def detect(self, folder: Path, config: dict[str, Any]) -> bool:
        """Whether ``folder`` (with its parsed config.json) is in this layout."""

    def check(self, path: Path, tensors: dict[str, torch.Tensor], config: dict, draft) -> None:  # noqa: B027 (a no-op default)
        """Checks beyond keys, shapes and finiteness (e.g. a consistent vocabulary mapping)."""

    def extra(self, draft: DraftMethod, tmp: Path, dtype, **opts: Any) -> str | None:
        """Write and check anything beside the weights (Medusa-2's merged base model) in
        ``tmp``; refuse options the format has no use for. Returns a line for the summary, or
        None. ``opts`` holds ``out`` (the final folder) and the CLI's format options."""
        return None

    def readme_lines(self, draft: DraftMethod, config: dict[str, Any]) -> list[str]:
        """Format-specific lines for the export's README (``config``: as written)."""
        return []

    # -- storage: safetensors (or torch.save) + config.json unless a format says otherwise --

    default_dtype: str = "bfloat16"  # --dtype when none is given
    dtypes: tuple[str, ...] = ("bfloat16", "float16", "float32")  # --dtype values it takes

    def save(
        self, tmp: Path, tensors: dict[str, torch.Tensor], config: dict, draft, dtype: str
    ) -> None:
        """Write the weights (``tensors``, already cast) into ``tmp``; config.json is written
        by the pipeline."""
        from safetensors.torch import save_file

        if self.weights_file.endswith(".safetensors"):
            save_file(tensors, str(tmp / self.weights_file), metadata={"format": "pt"})
        else:
            torch.save(tensors, tmp / self.weights_file)

    def load(self, path: Path, config: dict | None = None) -> dict[str, torch.Tensor]:
        """The weights file's tensors, under the names ``expected`` uses."""
        from .export import load_tensors

        return load_tensors(path)

    def read_config(self, folder: Path) -> dict[str, Any]:
        """The settings ``expected``, ``check`` and ``read`` look at."""
        from .export import read_config

        return read_config(folder)

    def torch_dtype(self, dtype: str) -> torch.dtype:
        """The dtype ``tensors`` are cast to and the read-back draft is compared in."""
        return getattr(torch, dtype)

    def reference(self, draft: DraftMethod, dtype: str) -> DraftMethod:
        """The trained draft as the export holds it (its read-back must match this exactly)."""
        return draft.export_view(getattr(torch, dtype))
