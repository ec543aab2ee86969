"""Medusa heads: extra LM heads on the target's last hidden state, each guessing one more token.

Medusa-1 (Cai et al. 2024): K heads on the frozen target's final (normed) hidden state h_t;
head k (0-based) predicts token x_{t+k+2}, one past the token the target's own LM head predicts.
Each head is ``num_layers`` residual blocks (x + SiLU(Wx + b), zero-initialised so a fresh head
starts as the target's head) and an LM head initialised from the target's. Loss: cross-entropy
per head against the shifted labels, head k weighted ``head_decay ** k``.

Medusa-2: the heads train jointly with a LoRA adapter on the backbone (``peft``). To keep the
target's quality the backbone learns the *original* model's next-token distribution (the same
network with its adapters disabled: no second copy in memory), by KL(original || adapted),
weighted by ``backbone_weight`` after a sine warm-up; the heads learn the original model's
distributions too (self-distillation). The saved draft holds the heads and the adapter (peft
format); at decode time the adapted model is the verifier, so the output follows the *adapted*
model, and ``specdraft-eval`` says so and measures how far it moved from the original.

Decoding: one evaluation of all heads on the last verified hidden state gives each head's top
tokens; a static candidate tree (``build_tree``: the node set maximising the expected accepted
length under a node budget, from validation's per-head rank accuracies) picks which
combinations to verify. The tree is saved with the draft and overridable at evaluation.

Sections: config, module, pure loss functions and tree construction, propose, save/load.
"""

from __future__ import annotations

import heapq
import json
import math
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from torch import nn

from ..base import (
    DRAFT_WEIGHTS,
    DecodeSettings,
    DraftError,
    DraftMethod,
    StepOutput,
    fit_weights,
    lora_modules,
    metric,
    read_draft_config,
    read_draft_weights,
    write_draft_config,
)
from ..losses import check_head_loss, hard_label_loss, head_loss, head_masks
from ..target import Target
from .config import Medusa1Config, Medusa2Config
from .proposer import MedusaProposer

ADAPTER_DIR = "adapter"  # Medusa-2's LoRA adapter, peft format, inside the draft folder

# ---------------------------------------------------------------------------------------------
# Module


class ResBlock(nn.Module):
    """x + SiLU(W x + b), W and b zero-initialised: a fresh block is exactly the identity
    (the reference zeroes W only, which leaves a constant SiLU(b) offset)."""

    def __init__(self, hidden: int):
        super().__init__()
        self.linear = nn.Linear(hidden, hidden)
        nn.init.zeros_(self.linear.weight)
        nn.init.zeros_(self.linear.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + F.silu(self.linear(x))


class MedusaHeads(DraftMethod):
    """Medusa-1: K heads on the frozen target's last hidden state. Parameters ``heads.{k}.{j}``
    (residual block j) and ``heads.{k}.{num_layers}`` (LM head): the Medusa checkpoint layout
    with a ``heads.`` prefix. Buffers ``rank_hits`` (K, top_k) and ``rank_total`` (K,) count,
    over validation, how often head k's rank-r token was the target's next token."""

    config_class = Medusa1Config
    feature_layers: tuple[int, ...] = (-1,)

    def __init__(self, target: Target, cfg: Medusa1Config):
        super().__init__()
        check_head_loss(cfg.loss)
        if cfg.num_heads < 1 or cfg.num_layers < 0 or cfg.top_k < 1:
            raise DraftError(
                f"method.num_heads={cfg.num_heads}, num_layers={cfg.num_layers}, "
                f"top_k={cfg.top_k}: need num_heads >= 1, num_layers >= 0, top_k >= 1"
            )
        self.cfg = cfg
        H, V = target.hidden_size, target.config.vocab_size
        w = target.lm_head.weight.detach().float()
        heads = []
        for _ in range(cfg.num_heads):
            lm = nn.Linear(H, V, bias=False)
            with torch.no_grad():
                lm.weight.copy_(w)
            heads.append(nn.Sequential(*[ResBlock(H) for _ in range(cfg.num_layers)], lm))
        self.heads = nn.ModuleList(heads)
        self.register_buffer("rank_hits", torch.zeros(cfg.num_heads, cfg.top_k))
        self.register_buffer("rank_total", torch.zeros(cfg.num_heads))
        self.tree: list[tuple[int, ...]] | None = None  # set by load_draft / build
        object.__setattr__(self, "target", target)

    # -- the heads ---------------------------------------------------------------------------

    def head_logits(self, k: int, h: torch.Tensor) -> torch.Tensor:
        """Head k on hidden states (..., H) -> logits (..., V) float32."""
        w = self.heads[k][-1].weight
        return self.heads[k](h.to(w.dtype)).float()

    def target_logits(self, h: torch.Tensor) -> torch.Tensor:
        return self.target.logits(h)

    def hidden(
        self, batch: dict[str, torch.Tensor], teacher: bool = True
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(student hidden states the heads read, teacher hidden states for soft labels, or
        None without ``teacher``), (B, T, H). Medusa-1: both the frozen target's."""
        f = batch["features"][:, :, 0]
        return f, f

    # -- training ----------------------------------------------------------------------------

    def forward(self, batch: dict[str, torch.Tensor]) -> StepOutput:
        ids, attn, lm = batch["input_ids"], batch["attention_mask"], batch["loss_mask"]
        self._new_validation = True  # the next validation measures the heads afresh
        h, teacher = self.hidden(batch)
        masks = head_masks(lm, attn, self.cfg.num_heads)
        loss = self.extra_loss(batch, h, teacher, metrics := {})
        for k, mask in enumerate(masks):
            rows = mask.nonzero(as_tuple=True)
            n = rows[0].numel()
            if n == 0:
                loss = loss + 0.0 * sum(p.sum() for p in self.heads[k].parameters())
                continue
            logits = self.head_logits(k, h[rows])
            label_pos = (rows[0], rows[1] + k + 2)
            if self.cfg.soft_labels:
                with torch.no_grad():  # the target's distribution over x_{t+k+2}
                    t_logits = self.target_logits(teacher[rows[0], rows[1] + k + 1])
                ce = head_loss(self.cfg.loss, logits, t_logits.softmax(-1))
                labels = t_logits.argmax(-1)
            else:
                labels = ids[label_pos]
                ce = hard_label_loss(self.cfg.loss, logits, labels)
            loss = loss + self.cfg.head_decay**k * ce
            metrics[f"loss_head{k + 1}"] = metric(ce.detach() * n, n)
            metrics[f"acc_head{k + 1}"] = metric((logits.argmax(-1) == labels).float().sum(), n)
        metrics["acc"] = metrics.get("acc_head1", metric(0.0, 0))
        return StepOutput(loss=loss, metrics=metrics)

    def extra_loss(self, batch, h, teacher, metrics) -> torch.Tensor:
        """Loss terms besides the heads' (Medusa-2: the backbone's distillation)."""
        return h.new_zeros((), dtype=torch.float32)

    @torch.no_grad()
    def evaluate(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Per head k: how often its rank-r token (r < top_k) is the verifier's greedy next
        token at that position (teacher-forced on the data; for Medusa-2 the verifier is the
        adapted model): ``top1_head{k}`` and ``top{top_k}_head{k}`` (cumulative). The counts
        also go to ``rank_hits`` (reset at the first validation batch after training steps),
        from which the candidate tree is built."""
        attn, lm = batch["attention_mask"], batch["loss_mask"]
        if getattr(self, "_new_validation", False):  # counts describe the current heads only
            self.rank_hits.zero_()
            self.rank_total.zero_()
            self._new_validation = False
        h, _ = self.hidden(batch, teacher=False)
        out: dict[str, torch.Tensor] = {}
        K, R, c = self.cfg.num_heads, self.cfg.top_k, self.cfg.lm_head_chunk
        for k, mask in enumerate(head_masks(lm, attn, K)):
            rows = mask.nonzero(as_tuple=True)
            n = rows[0].numel()
            hits = torch.zeros(R, device=h.device)
            for i in range(0, n, c):
                r0, r1 = rows[0][i : i + c], rows[1][i : i + c]
                top = self.head_logits(k, h[r0, r1]).topk(R, dim=-1).indices  # (n, R)
                want = self.target_logits(h[r0, r1 + k + 1]).argmax(-1)  # the verifier's
                hits += (top == want[:, None]).float().sum(0)
            self.rank_hits[k] += hits.to(self.rank_hits.device)
            self.rank_total[k] += n
            out[f"top1_head{k + 1}"] = metric(hits[0], n)
            out[f"top{R}_head{k + 1}"] = metric(hits.sum(), n)
        return out

    def rank_accuracy(self) -> list[list[float]]:
        """(K, top_k) measured P(head k's rank-r token is the target's token); before any
        validation, a prior that halves per rank and per head."""
        if float(self.rank_total.min()) <= 0:
            K, R = self.cfg.num_heads, self.cfg.top_k
            return [[0.5 ** (k + 1) * 0.5**r for r in range(R)] for k in range(K)]
        return (self.rank_hits / self.rank_total[:, None]).tolist()

    # -- decoding ----------------------------------------------------------------------------

    def candidate_tree(self, nodes: int | None = None) -> list[tuple[int, ...]]:
        if self.tree is not None and nodes is None:
            return self.tree
        return build_tree(self.rank_accuracy(), nodes or self.cfg.tree_nodes)

    def proposer(self, settings: DecodeSettings | None = None) -> MedusaProposer:
        """This draft as a proposer: ``tree="static"`` (or ``"auto"``: the saved candidate tree;
        ``tree_nodes``: one of that many nodes built from the measured accuracies;
        ``tree_file``: a JSON list of rank paths) or ``"chain"`` (each head's top-1; gamma
        picks the depth)."""
        s = settings or DecodeSettings()
        if s.tree == "chain":
            return MedusaProposer(self, None)
        if s.tree not in ("static", "auto"):
            raise ValueError(f"tree={s.tree!r}: Medusa drafts use static (the default) or chain")
        paths = read_tree_file(s.tree_file, self.cfg) if s.tree_file else None
        return MedusaProposer(self, paths or self.candidate_tree(s.tree_nodes))

    @torch.no_grad()
    def probe(self, prompt: list[int]) -> torch.Tensor:
        """Every head's logits (K, V) on the target's state at the last fed position of
        ``prompt`` (where the decoder's proposer reads it)."""
        h = self._prompt_state(prompt)
        return torch.stack([self.head_logits(k, h) for k in range(self.cfg.num_heads)])

    def _prompt_state(self, prompt: list[int]) -> torch.Tensor:
        ids = torch.tensor([prompt[:-1]], device=self.target.device)
        return self.target.features(ids, torch.ones_like(ids), (-1,))[0, -1, 0]

    def export_checks(self) -> dict[str, DecodeSettings]:
        return {"chain": DecodeSettings(tree="chain"), "tree": DecodeSettings(tree="static")}

    def export_view(self, dtype: torch.dtype) -> MedusaHeads:
        """The heads alone (a Medusa-2 adapter is exported as a merged base model, if at all),
        with this draft's candidate tree, at ``dtype``."""
        ref = MedusaHeads(
            self.target,
            Medusa1Config(
                **{
                    k: getattr(self.cfg, k)
                    for k in Medusa1Config.__dataclass_fields__
                    if k != "name"
                }
            ),
        )
        ref.load_state_dict(
            {k: v for k, v in self.state_dict().items() if k.startswith("heads.")}, strict=False
        )
        ref.tree = self.candidate_tree()
        return ref.to(self.target.device, dtype).eval()

    # -- save / load -------------------------------------------------------------------------

    def save_draft(self, path: str | Path) -> None:
        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        state = {
            k: v.detach().contiguous().cpu()
            for k, v in self.state_dict().items()
            if k.startswith(("heads.", "rank_"))
        }
        save_file(state, str(path / DRAFT_WEIGHTS), metadata={"format": "pt"})
        write_draft_config(
            path,
            self.cfg,
            self.target,
            1,
            feature_layers=list(self.feature_layers),
            rank_accuracy=self.rank_accuracy(),
            tree=[list(p) for p in self.candidate_tree()],
        )
        self._save_extra(path)

    def _save_extra(self, path: Path) -> None:
        pass

    @classmethod
    def load_draft(cls, path: str | Path, target: Target) -> MedusaHeads:
        path = Path(path)
        cfg = read_draft_config(path)
        t = cfg["target"]
        if t["hidden_size"] != target.hidden_size or t["vocab_size"] != target.config.vocab_size:
            raise DraftError(
                f"{path}: heads were trained for hidden size {t['hidden_size']} and vocabulary "
                f"{t['vocab_size']}; target {target.identity} has {target.hidden_size} and "
                f"{target.config.vocab_size}"
            )
        head = cls._construct(target, cls.config_class(**cfg["method"]), path)
        # the heads' and the adapter's weights: the backbone's are the target's, not the file's
        fit_weights(
            head, read_draft_weights(path), path, cfg, lambda k: k.startswith(("heads.", "rank_"))
        )
        head.tree = [tuple(p) for p in cfg.get("tree") or []] or None
        return head.to(target.device).eval()

    @classmethod
    def _construct(cls, target: Target, cfg: Medusa1Config, path: Path) -> MedusaHeads:
        return cls(target, cfg)


class Medusa2Heads(MedusaHeads):
    """Medusa-2: the heads plus a LoRA adapter on the target's backbone, trained jointly with
    self-distillation. The adapter is injected into ``target.model`` in place (peft), so the
    target becomes the adapted model wherever it is used; ``original()`` is a context in which
    the adapters are off (the original model, for teacher distributions and comparisons)."""

    config_class = Medusa2Config
    feature_layers: tuple[int, ...] = ()  # the backbone runs inside forward (it trains)

    def __init__(self, target: Target, cfg: Medusa2Config, adapter: str | Path | None = None):
        super().__init__(target, cfg)
        from peft import LoraConfig, PeftModel, get_peft_model

        if isinstance(target.model, PeftModel):
            raise DraftError("the target already carries a peft adapter; load a fresh target")
        if adapter is None:
            lora = LoraConfig(
                r=cfg.lora_r,
                lora_alpha=cfg.lora_alpha,
                lora_dropout=cfg.lora_dropout,
                target_modules=lora_modules(target.model, cfg.lora_target_modules),
                bias="none",
            )
            try:
                peft_model = get_peft_model(target.model, lora)
            except ValueError as e:
                hint = (
                    f"; peft maps this {target.config.model_type} target's MLP names onto its "
                    "stacked experts, whose adapter takes none: set method.lora_dropout=0"
                    if "lora_dropout" in str(e)
                    else ""
                )
                raise DraftError(f"method.lora_target_modules: {e}{hint}") from None
        else:  # a trained draft, for decoding: merge the adapter so the verifier runs at
            # full speed (``original()`` unmerges again while it is active)
            peft_model = PeftModel.from_pretrained(target.model, str(adapter), is_trainable=False)
            peft_model.merge_adapter()
        self.backbone = peft_model  # registered: the LoRA parameters train with the heads
        target.model = peft_model
        self.register_buffer("micro_batches", torch.zeros((), dtype=torch.long))

    def param_groups(self, lr: float) -> list[dict]:
        """The heads train at ``head_lr_ratio`` x the adapter's learning rate."""
        heads = [p for p in self.heads.parameters() if p.requires_grad]
        lora = [p for p in self.backbone.parameters() if p.requires_grad]
        return [
            {"params": heads, "lr": lr * self.cfg.head_lr_ratio},
            {"params": lora, "lr": lr},
        ]

    def original(self):
        """A context in which the target is the original model (adapters off)."""
        return self.backbone.disable_adapter()

    def changes_target(self) -> str | None:
        return (
            f"the verifier is the target with this draft's LoRA adapter (r={self.cfg.lora_r}), "
            "not the original target: outputs follow the adapted model"
        )

    def _decoder(self):
        return self.backbone.get_base_model().get_decoder()

    def hidden(self, batch, teacher: bool = True):
        ids = batch["input_ids"].to(self.target.device)
        attn = batch["attention_mask"].to(self.target.device)
        t = None
        if teacher:
            with torch.no_grad(), self.original():
                t = self._decoder()(input_ids=ids, attention_mask=attn, use_cache=False)
            t = t.last_hidden_state.detach()
        student = self._decoder()(input_ids=ids, attention_mask=attn, use_cache=False)
        return student.last_hidden_state, t

    def extra_loss(self, batch, h, teacher, metrics):
        """The backbone's self-distillation: KL(original || adapted) of the next-token
        distribution on assistant positions, weighted by the warmed-up backbone weight."""
        lm, attn = batch["loss_mask"], batch["attention_mask"]
        m = lm[:, 1:].bool() & attn[:, 1:].bool() & attn[:, :-1].bool()
        rows = m.nonzero(as_tuple=True)  # position t predicts the assistant token t + 1
        if self.training:
            self.micro_batches += 1
        w = self.cfg.backbone_weight * warmup_factor(
            int(self.micro_batches), self.cfg.backbone_warmup
        )
        n = rows[0].numel()
        if n == 0:
            return h.sum() * 0.0
        kl = kl_divergence(self.target_logits(teacher[rows]), self.target_logits(h[rows]))
        metrics["loss_backbone"] = metric(kl.detach() * n, n)
        metrics["backbone_weight"] = metric(w * n, n)
        return w * kl

    def _save_extra(self, path: Path) -> None:
        self.backbone.save_pretrained(str(path / ADAPTER_DIR))

    @classmethod
    def _construct(cls, target: Target, cfg: Medusa2Config, path: Path) -> Medusa2Heads:
        adapter = path / ADAPTER_DIR
        if not (adapter / "adapter_config.json").exists():
            raise DraftError(f"{path}: a medusa2 draft needs its LoRA adapter in {ADAPTER_DIR}/")
        check_adapter_shapes(target, adapter, read_draft_config(path)["target"].get("identity"))
        return cls(target, cfg, adapter=adapter)


def check_adapter_shapes(target: Target, adapter: Path, made_for: str | None = None) -> None:
    """Before peft loads ``adapter`` into the target (in place: a failed load leaves the target
    half-adapted, and peft's error is a traceback): ``DraftError`` naming the first LoRA tensor
    whose layer the target lacks or whose shape the target's layer does not imply
    (lora_A: (r, in_features), lora_B: (out_features, r))."""
    from peft import PeftModel
    from safetensors import safe_open

    f = adapter / "adapter_model.safetensors"
    if not f.exists() or isinstance(target.model, PeftModel):
        return  # an older peft's .bin: peft checks it (an adapted target: refused after this)
    layers = dict(target.model.named_modules())
    made = f" ({made_for})" if made_for and made_for != target.identity else ""
    try:
        with safe_open(str(f), "pt") as st:
            shapes = {k: tuple(st.get_slice(k).get_shape()) for k in st.keys()}
    except Exception as e:  # safetensors raises several types for damaged files
        raise DraftError(f"{f}: cannot read the adapter ({e})") from None
    for k, shape in shapes.items():
        if ".lora_A." not in k and ".lora_B." not in k:
            continue
        name = k.removeprefix("base_model.model.").rsplit(".lora_", 1)[0]
        # peft nests a module adapted in several parameters (an MoE's fused experts) as
        # ``.base_layer`` wrappers: the target's module is the one under them
        name = name.replace(".base_layer", "")
        layer = layers.get(name)
        if layer is None:
            raise DraftError(
                f"{f}: {k} adapts {name}, which target {target.identity} has not: the draft "
                f"was made for another target{made}"
            )
        if not isinstance(layer, nn.Linear):
            continue  # not a layer whose shape this reads: peft checks it
        want = (shape[0], layer.in_features) if ".lora_A." in k else (layer.out_features, shape[1])
        if shape != want:
            raise DraftError(
                f"{f}: {k} has shape {shape}, target {target.identity} implies {want}: the "
                f"draft was made for another target{made}"
            )


# ---------------------------------------------------------------------------------------------
# Pure functions: masks, losses, schedule, tree


def kl_divergence(teacher_logits: torch.Tensor, student_logits: torch.Tensor) -> torch.Tensor:
    """KL(p || q) averaged over rows, p = softmax(teacher), q = softmax(student); (N, V)."""
    lp = teacher_logits.float().log_softmax(-1)
    lq = student_logits.float().log_softmax(-1)
    return (lp.exp() * (lp - lq)).sum(-1).mean()


def warmup_factor(step: int, warmup: int) -> float:
    """0 -> 1 over ``warmup`` steps along a sine quarter-wave (then 1)."""
    if warmup <= 0 or step >= warmup:
        return 1.0
    return math.sin(0.5 * math.pi * step / warmup)


def build_tree(acc: list[list[float]], nodes: int) -> list[tuple[int, ...]]:
    """The candidate tree maximising the expected number of accepted tokens under a budget.

    ``acc[d][r]``: probability that head d's rank-r token is the target's token at depth
    d + 1 (given the path so far was accepted). A node is a path of ranks (r_1, ..., r_d): head
    1's rank-r_1 token, then head 2's rank-r_2 token, ... Its path is accepted with probability
    prod_i acc[i][r_i] (siblings exclude each other, so expectations add up), and the expected
    accepted length of a tree is the sum over its nodes. Since a child's value never exceeds
    its parent's, the ``nodes`` highest-valued paths are ancestor-closed and optimal; they are
    found best-first. Returns paths ordered by depth, then value (parents before children).
    """
    if nodes < 1 or not acc:
        return []
    depth, ranks = len(acc), len(acc[0])
    heap = [(-acc[0][r], (r,)) for r in range(ranks)]
    heapq.heapify(heap)
    chosen: list[tuple[float, tuple[int, ...]]] = []
    while heap and len(chosen) < nodes:
        neg, path = heapq.heappop(heap)
        chosen.append((-neg, path))
        if len(path) < depth:
            for r in range(ranks):
                heapq.heappush(heap, (neg * acc[len(path)][r], (*path, r)))
    chosen.sort(key=lambda vp: (len(vp[1]), -vp[0], vp[1]))
    return [p for _, p in chosen]


def read_tree_file(path: str, cfg: Medusa1Config) -> list[tuple[int, ...]]:
    """A candidate tree from a JSON list of rank paths, e.g. [[0], [1], [0, 0], [0, 1]]."""
    try:
        raw = json.loads(Path(path).expanduser().read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise DraftError(f"tree_file={path}: cannot read ({e})") from None
    paths = []
    for i, p in enumerate(raw if isinstance(raw, list) else [None]):
        if not (
            isinstance(p, list)
            and 1 <= len(p) <= cfg.num_heads
            and all(isinstance(r, int) and 0 <= r for r in p)
        ):
            raise DraftError(
                f"tree_file={path}: entry {i} must be a list of 1..{cfg.num_heads} ranks >= 0"
            )
        paths.append(tuple(p))
    have = set(paths)
    for p in paths:
        if len(p) > 1 and p[:-1] not in have:
            raise DraftError(f"tree_file={path}: {list(p)} has no parent {list(p[:-1])}")
    return sorted(set(paths), key=lambda p: (len(p), p))


def expected_length(acc: list[list[float]], tree: list[tuple[int, ...]]) -> float:
    """Expected accepted draft tokens per verification of ``tree`` (greedy, independent heads)."""
    return sum(math.prod(acc[i][r] for i, r in enumerate(p)) for p in tree)
