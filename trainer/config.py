"""Structured config schemas for Hydra. YAML in ``conf/`` holds values; these hold types, so a
misspelled or mistyped override fails before any model loads."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING

from models import METHOD_CONFIGS
from models.target import TargetConfig


@dataclass
class DataConfig:
    name: str = "sharegpt"
    path: str | None = None  # file or folder; None with name=sharegpt: the packaged ShareGPT_V3
    max_length: int = 2048
    max_records: int | None = None  # stop after this many usable conversations (file order)
    skip_records: int = 0  # pass over this many usable conversations first (a later slice)
    val_fraction: float = 0.02
    # Validation: at most this many held-out conversations (a hash split, so the same ones in
    # every run with the same data and seed), each cut to val_max_length tokens: bounded cost,
    # comparable numbers across runs
    max_val_records: int = 128
    val_max_length: int | None = 512
    batch_size: int = 4
    group_by_length: bool = True
    num_proc: int = 1  # processes for tokenisation (datasets.map)
    num_workers: int = 0  # DataLoader workers
    cache_dir: str = "${target.cache_dir}"
    cache_features: bool = False  # compute target features once, store as safetensors shards
    feature_shard_tokens: int = 2_000_000  # tokens per feature shard
    feature_dtype: str = "bfloat16"  # storage dtype of cached features
    # assistant turns' reasoning traces (<think>...</think> or reasoning_content): keep (the
    # template renders them where it does) | drop (removed; a thinking template's answer-only
    # mode, enable_thinking=False), also for the prompts regeneration feeds the target
    reasoning: str = "keep"


@dataclass
class OptimConfig:
    name: str = "adamw"
    lr: float = 1e-4
    betas: tuple[float, float] = (0.9, 0.95)
    eps: float = 1e-8
    weight_decay: float = 0.0
    max_grad_norm: float = 1.0  # <= 0 turns clipping off
    schedule: str = "cosine"  # cosine | linear | constant
    warmup_steps: int = 50
    min_lr_ratio: float = 0.1  # final lr as a fraction of lr (cosine/linear)
    # optim=muon (trainer/optim.py): Muon on the hidden matrices, AdamW (the settings above) on
    # the rest; defaults are speculators' (muon_lr unset = lr)
    muon_lr: float | None = None
    muon_momentum: float = 0.95
    muon_weight_decay: float = 0.1
    muon_ns_steps: int = 5
    muon_adjust_lr_fn: str = "match_rms_adamw"  # match_rms_adamw | original


@dataclass
class LoggerConfig:
    name: str = "none"  # none | wandb
    project: str = "specdraft"
    mode: str = "offline"  # wandb mode; offline by default (no network here)
    entity: str | None = None
    run_name: str | None = None


@dataclass
class EvalAfterConfig:
    """After training: measure the new draft with the speculative decoder (what
    ``specdraft-eval`` does) on a few prompts, beside other drafts named in ``compare`` (e.g.
    the shipped head), and print tau / alpha / speedup for each."""

    enabled: bool = False
    bench: str = "mt_bench"
    num_prompts: int = 4
    max_new_tokens: int = 64
    temperature: float = 0.0
    compare: list[str] = field(default_factory=list)


@dataclass
class TrainConfig:
    max_steps: int = 1000  # optimizer steps; the run ends at max_steps, epochs or max_minutes
    epochs: int = 1
    max_minutes: float | None = None  # wall-clock budget for the training loop
    grad_accum: int = 1
    # auto: bf16 autocast with fp32 master weights on GPUs and on CPUs with native bf16, else
    # no (fp32) | no | bf16 | fp16
    mixed_precision: str = "auto"
    log_every: int = 10
    eval_every: int = 200  # 0: only at the end
    eval_batches: int | None = None  # cap on validation batches (None: all)
    save_every: int = 500  # 0: only at the end
    keep_checkpoints: int = 2
    seed: int = 0
    max_nonfinite: int = 10  # consecutive non-finite losses (each skipped) before the run stops
    threads: int | None = None  # torch CPU threads (None: torch's default)
    progress: bool = True
    record_samples: bool = False  # samples-rank{r}.jsonl: the sample indices of every step
    # start from a saved draft's weights (a run dir, saved draft or checkpoint folder, or a
    # shipped name such as smollm2-eagle3) instead of a fresh head; an EAGLE-3 draft keeps its
    # draft vocabulary. The optimizer starts fresh (``resume=`` continues a run exactly).
    init_from: str | None = None
    eval_after: EvalAfterConfig = field(default_factory=EvalAfterConfig)


@dataclass
class Config:
    target: TargetConfig = field(default_factory=TargetConfig)
    data: DataConfig = field(default_factory=DataConfig)
    method: Any = MISSING
    optim: OptimConfig = field(default_factory=OptimConfig)
    logger: LoggerConfig = field(default_factory=LoggerConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    output_dir: str = MISSING
    resume: Any = False  # false | true (latest checkpoint in output_dir) | path to a checkpoint


def register_configs() -> None:
    cs = ConfigStore.instance()
    cs.store(name="config_schema", node=Config)
    cs.store(group="target", name="target_schema", node=TargetConfig)
    cs.store(group="data", name="data_schema", node=DataConfig)
    cs.store(group="optim", name="optim_schema", node=OptimConfig)
    cs.store(group="logger", name="logger_schema", node=LoggerConfig)
    for name, node in METHOD_CONFIGS.items():
        cs.store(group="schema/method", name=name, node=node)
