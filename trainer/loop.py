"""The training loop: one, for every method. The method supplies ``forward(batch) ->
StepOutput`` and ``evaluate(batch)``; this file owns features, accumulation, clipping, the
schedule, validation, logging, checkpoints and signals, and never names a method."""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm

from conf.cli import StopSignals
from models.base import add_metrics, metric, reduce_metrics

from .checkpoint import save_checkpoint
from .shard import equal_forwards, most_across_processes


@dataclass
class LoopState:
    """Everything needed to continue a run exactly where it stopped (saved with checkpoints)."""

    step: int = 0  # optimizer steps taken
    epoch: int = 0
    batch_in_epoch: int = 0  # micro-batches of this epoch already consumed (this process)
    elapsed: float = 0.0  # seconds of training so far, over every resumption of the run
    tokens: int = 0  # tokens seen by this process
    # training tokens so far, every process's (their batches differ in length), summed across
    # them when logged, validated or checkpointed; None: a checkpoint from before it was kept
    tokens_all: int | None = None
    nonfinite_skipped: int = 0
    #: optimizer steps the fp16 loss scaler skipped (inf/nan gradients): no update, so neither a
    #: step nor a move of the schedule
    scaler_skipped: int = 0
    world_size: int = 1
    last_val: dict[str, float] = field(default_factory=dict)
    last_val_step: int = -1
    planned_steps: int = 0  # min(max_steps, the steps the epochs allow); set by fit()
    data_source: str = ""  # the data trained on (``TokenizedData.source``): resumed only on it
    tokenizer: str = ""  # what tokenised it (``TokenizedData.tokenizer``): resumed only with it
    #: how it was split (``data.dataset.split_of``): 2 by id alone; a checkpoint without it
    #: split by position, and a run resuming it is told its validation set has changed
    data_split: int = 2


def tokens_so_far(state: LoopState) -> int:
    """Training tokens so far over every process and every resumption. A checkpoint from before
    ``tokens_all`` was kept counts this process's tokens times the processes (what its
    ``metrics.jsonl`` said then)."""
    if state.tokens_all is not None:
        return state.tokens_all
    return state.tokens * state.world_size


def sum_tokens(accelerator: Any, n: int) -> int:
    """``n`` (this process's tokens) summed over every process. It waits for every process, so
    it runs where they all meet anyway (logging, validation, checkpoints), not every step."""
    if accelerator.num_processes == 1:
        return n
    t = torch.tensor([n], dtype=torch.long, device=accelerator.device)
    return int(accelerator.gather(t).sum())


def make_schedule(cfg: Any, max_steps: int, max_seconds: float | None, state: LoopState):
    """lr multiplier for LambdaLR: linear warmup, then cosine/linear decay to ``min_lr_ratio``.
    Progress is the larger of step/planned steps and elapsed/max_minutes, so time-budgeted runs
    decay too; the planned steps are ``state.planned_steps`` (the fewer of ``max_steps`` and
    what the epochs allow, set by ``fit``) or ``max_steps`` before that. A plain function on
    purpose: LambdaLR saves (and on load overwrites) the attributes of callable objects, and the progress lives in ``state``, saved by the loop."""
    if cfg.schedule not in ("cosine", "linear", "constant"):
        raise ValueError(f"optim.schedule={cfg.schedule!r}: use cosine, linear or constant")

    def factor(step: int) -> float:
        if cfg.warmup_steps > 0 and step < cfg.warmup_steps:
            return (step + 1) / cfg.warmup_steps
        if cfg.schedule == "constant":
            return 1.0
        total = state.planned_steps or max_steps
        p = (step - cfg.warmup_steps) / max(1, total - cfg.warmup_steps)
        if max_seconds:
            p = max(p, state.elapsed / max_seconds)
        p = min(max(p, 0.0), 1.0)
        shape = 1.0 - p if cfg.schedule == "linear" else 0.5 * (1.0 + math.cos(math.pi * p))
        return cfg.min_lr_ratio + (1.0 - cfg.min_lr_ratio) * shape

    return factor


def progress(state: LoopState, total: int, max_seconds: float | None) -> float:
    """How far training is, in [0, 1]: the larger of steps over ``total`` and elapsed time
    over the time budget (what a method's curriculum reads, ``DraftMethod.set_progress``)."""
    p = state.step / max(1, total)
    if max_seconds:
        p = max(p, state.elapsed / max_seconds)
    return min(max(p, 0.0), 1.0)


def attach_features(batch: dict, method: Any, target: Any) -> dict:
    """Fill ``batch["features"]`` from the target when the batch has none (online mode)."""
    layers = method.feature_layers
    if layers and "features" not in batch:
        batch["features"] = target.features(batch["input_ids"], batch["attention_mask"], layers)
    return batch


def _stand_in_loss(method: Any, batch: dict, unwrapped: Any, target: Any, accelerator: Any):
    """A finite loss with zero gradients, through the draft's own forward on ``batch`` (a
    micro-batch of the window whose loss was finite).

    The window's last micro-batch came out non-finite: left out as any other, the window's
    finite micro-batches still make its update. Every backend finishes a window inside the
    backward of its last micro-batch: DDP all-reduces the accumulated gradients there,
    FSDP reduce-scatters them, DeepSpeed's engine steps. Without that backward the gradients
    would wait there (FSDP, DeepSpeed) and join the next window's, or be dropped (DDP), so the
    window's last backward is one of its good micro-batches again, weighted zero. None where
    that too comes out non-finite (no update then: under FSDP and DeepSpeed the window's
    gradients then join the next window's)."""
    batch = attach_features(dict(batch), unwrapped, target)
    with accelerator.autocast():
        loss = method(batch).loss
    return loss * 0.0 if _all_finite(accelerator, loss) else None


@torch.no_grad()
def evaluate(
    accelerator: Any, method: Any, target: Any, loader: Any, max_batches: int | None
) -> dict[str, float]:
    m = accelerator.unwrap_model(method)
    was_training = m.training
    m.eval()
    acc: dict[str, torch.Tensor] = {}
    n = len(loader) if max_batches is None else min(len(loader), max_batches)
    # a sharded target's forwards are collective: a rank with fewer batches runs stand-ins
    dataset = getattr(loader, "dataset", None)
    online = bool(m.feature_layers) and getattr(dataset, "features", None) is None
    # an FSDP-sharded draft's forwards gather from every process: a process with fewer batches
    # runs stand-ins (their target forwards included), whose metrics are dropped
    stand_ins = most_across_processes(n, accelerator.device) - n if is_sharded(m) else 0
    pad = equal_forwards(target, n if online and not is_sharded(m) else 0, tuple(m.feature_layers))
    with target.gathered():
        for i, batch in enumerate(loader):
            if i >= n:
                break
            batch = attach_features(batch, m, target)
            with accelerator.autocast():
                add_metrics(acc, m.evaluate(batch))
        for _ in range(stand_ins):
            batch = attach_features(loader.stand_in(), m, target)
            with accelerator.autocast():
                m.evaluate(batch)
        pad()
    m.train(was_training)
    return reduce_metrics(sum_across_processes(accelerator, acc))


def is_sharded(model: Any) -> bool:
    """Whether accelerate's FSDP (version 2) shards ``model``'s parameters."""
    from torch.distributed.fsdp import FSDPModule

    return isinstance(model, FSDPModule)


def sum_across_processes(accelerator: Any, acc: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Add up ``{name: [sum, count]}`` metrics over all processes. Processes may hold different
    names (a rank whose shard never reached draft position 5 has no ``alpha_pos5``), so the
    dictionaries are gathered as objects rather than reduced as one tensor."""
    if accelerator.num_processes == 1:
        return acc
    from accelerate.utils import gather_object

    total: dict[str, list[float]] = {}
    for part in gather_object([{k: v.detach().cpu().tolist() for k, v in acc.items()}]):
        for k, (s, c) in part.items():
            t = total.setdefault(k, [0.0, 0.0])
            t[0] += s
            t[1] += c
    return {k: torch.tensor(v) for k, v in total.items()}


_STOPS = [None, "steps", "time", "signal"]


def _agree_stop(accelerator: Any, stop: str | None) -> str | None:
    """Every process must stop at the same step (DDP would hang otherwise): take the most
    urgent reason any process has."""
    if accelerator.num_processes == 1:
        return stop
    code = torch.tensor([_STOPS.index(stop)], device=accelerator.device)
    return _STOPS[int(accelerator.gather(code).max())]


def _all_finite(accelerator: Any, loss: torch.Tensor) -> bool:
    """Whether the loss is finite on every process (all skip together or none does)."""
    ok = torch.isfinite(loss.detach()).float().reshape(1)
    if accelerator.num_processes > 1:
        ok = accelerator.gather(ok).min()
    return bool(ok)


def fit(
    *,
    cfg: Any,
    accelerator: Any,
    method: Any,
    target: Any,
    optimizer: Any,
    scheduler: Any,
    train_loader: Any,
    batch_sampler: Any,
    val_loader: Any,
    tracker: Any,
    state: LoopState,
    run_dir: Path,
    log=print,
    samples: Any = None,
) -> str:
    """Train until max_steps, epochs or max_minutes. Returns why it stopped:
    ``finished`` | ``time`` | ``signal`` | ``nonfinite``."""
    tc = cfg.train
    unwrapped = accelerator.unwrap_model(method)
    max_seconds = tc.max_minutes * 60 if tc.max_minutes else None
    window: dict[str, torch.Tensor] = {}
    state.tokens_all = tokens_so_far(state)
    unsummed = 0  # this process's tokens not yet in state.tokens_all
    window_from = state.tokens_all  # tokens_all where this logging window began
    window_start = time.perf_counter()
    consecutive_bad = 0
    #: the last micro-batch of this accumulation window whose loss was finite (as loaded)
    window_good: dict | None = None
    reason = "finished"
    try:  # the steps the epochs allow, when fewer than max_steps (a time budget may stop sooner)
        per_epoch = math.ceil(len(train_loader) / max(1, tc.grad_accum))
        total = min(tc.max_steps, per_epoch * tc.epochs)
    except TypeError:
        total = tc.max_steps
    state.planned_steps = total  # the lr schedule decays over these
    show = tc.progress and accelerator.is_main_process
    if max_seconds:  # a time budget: the bar counts its seconds (steps go in the postfix)
        bar = tqdm(
            total=round(max_seconds),
            initial=min(round(state.elapsed), round(max_seconds)),
            desc="train",
            unit="s",
            bar_format="{l_bar}{bar}| {n_fmt}/{total_fmt} s of budget [{elapsed}<{remaining}{postfix}]",
            dynamic_ncols=True,
            disable=not show,
        )
    else:
        bar = tqdm(
            total=total, initial=state.step, desc="train", dynamic_ncols=True, disable=not show
        )
    shown_elapsed = int(bar.n)

    def count_tokens():
        # every process calls this at the same points (log, validation and checkpoint steps)
        nonlocal unsummed
        state.tokens_all += sum_tokens(accelerator, unsummed)
        unsummed = 0

    def checkpoint():
        count_tokens()
        snapshot = {**state.__dict__, "last_val": dict(state.last_val)}
        path = save_checkpoint(
            accelerator,
            run_dir,
            state.step,
            snapshot,
            unwrapped,
            tc.keep_checkpoints,
            frozen=target.model.parameters(),
        )
        return path

    def validate():
        if val_loader is None:
            return
        count_tokens()
        res = evaluate(accelerator, method, target, val_loader, tc.eval_batches)
        state.last_val = res
        state.last_val_step = state.step
        tracker.log(
            state.step,
            {
                **{f"val/{k}": v for k, v in res.items()},
                "tokens": state.tokens_all,
                "elapsed_s": state.elapsed,
            },
        )
        if accelerator.is_main_process:
            shown = "  ".join(f"{k} {v:.4f}" for k, v in res.items() if not k.startswith("loss"))
            log(f"[step {state.step}] validation: {shown}")

    if tc.init_from and state.step == 0 and tc.eval_every:
        validate()  # where the weights it starts from stand: a continued curve's first point
    method.train()
    t_last = time.perf_counter()
    # one notice a launch (every process gets the terminal's Ctrl-C)
    notice = "stopping at the next step, with a checkpoint (again: at once)"
    with StopSignals(notice=notice if accelerator.is_main_process else "") as sig:
        # (a run resumed from its last step has none left)
        while state.epoch < tc.epochs and reason == "finished" and state.step < tc.max_steps:
            loader = train_loader
            if state.batch_in_epoch:
                loader = accelerator.skip_first_batches(train_loader, state.batch_in_epoch)
            # accelerate's loaders push their own epoch counter into the sampler when iterated;
            # set it on the loader we iterate (a fresh skip-loader starts at 0 otherwise).
            batch_sampler.set_epoch(state.epoch)
            if hasattr(loader, "set_epoch"):
                loader.set_epoch(state.epoch)
            for batch in loader:
                state.batch_in_epoch += 1
                if samples is not None:
                    samples.log(state.step + 1, state.epoch, batch["index"].tolist())
                ntok = int(batch["attention_mask"].sum())
                state.tokens += ntok
                unsummed += ntok
                updated = False  # an optimizer step happened (a skipped batch is no step)
                with accelerator.accumulate(method), target.gathered():
                    unwrapped.set_progress(progress(state, total, max_seconds))
                    raw = dict(batch)  # as loaded: what a stand-in pass below reads again
                    batch = attach_features(batch, unwrapped, target)
                    with accelerator.autocast():
                        out = method(batch)
                    finite = _all_finite(accelerator, out.loss)
                    loss = out.loss if finite else None
                    if finite:
                        consecutive_bad = 0
                        window_good = raw
                    else:
                        # Leave this micro-batch out: no backward of it, not a step (the data
                        # moves on; the schedule does not).
                        state.nonfinite_skipped += 1
                        consecutive_bad += 1
                        log(
                            f"warning: non-finite loss at step {state.step}; skipped "
                            f"({consecutive_bad} in a row)"
                        )
                        if consecutive_bad >= tc.max_nonfinite:
                            reason = "nonfinite"
                            break
                        if accelerator.sync_gradients and window_good is not None:
                            loss = _stand_in_loss(
                                method, window_good, unwrapped, target, accelerator
                            )
                    if loss is not None:
                        accelerator.backward(loss)
                        if accelerator.sync_gradients and cfg.optim.max_grad_norm > 0:
                            gn = accelerator.clip_grad_norm_(
                                method.parameters(), cfg.optim.max_grad_norm
                            )
                            add_metrics(window, {"grad_norm": metric(gn, 1)})
                        step_lr = scheduler.get_last_lr()[0]  # what this step used
                        optimizer.step()
                        if accelerator.sync_gradients and accelerator.optimizer_step_was_skipped:
                            # fp16: the loss scaler found inf/nan gradients, lowered its scale
                            # and left the weights as they were; not a step, and the schedule
                            # waits for the update it planned (as for a non-finite loss)
                            state.scaler_skipped += 1
                            if state.scaler_skipped <= 3 or state.scaler_skipped % 100 == 0:
                                log(
                                    f"fp16: the loss scaler skipped an update at step "
                                    f"{state.step} (inf/nan gradients; {state.scaler_skipped} "
                                    "so far); the step and the schedule wait for it"
                                )
                        elif accelerator.sync_gradients:
                            scheduler.step()
                            updated = True
                    optimizer.zero_grad(set_to_none=True)
                    if finite:
                        add_metrics(window, {"loss": metric(out.loss.detach(), 1), **out.metrics})
                    if accelerator.sync_gradients:
                        window_good = None  # the next micro-batch starts a window
                now = time.perf_counter()
                state.elapsed += now - t_last
                t_last = now
                if not updated:
                    continue
                state.step += 1
                if max_seconds:
                    now_s = int(min(state.elapsed, max_seconds))
                    bar.update(now_s - shown_elapsed)
                    shown_elapsed = now_s
                else:
                    bar.update(1)
                if state.step % tc.log_every == 0:
                    # every process's micro-batches: the loss of the global batch
                    row = reduce_metrics(sum_across_processes(accelerator, window))
                    count_tokens()
                    dt = max(now - window_start, 1e-9)
                    row["tokens_per_s"] = (state.tokens_all - window_from) / dt
                    row["lr"] = step_lr
                    row["epoch"] = state.epoch
                    # training tokens so far (all processes) and seconds of training: the
                    # x-axes of learning curves that survive resumes
                    row["tokens"] = state.tokens_all
                    row["elapsed_s"] = state.elapsed
                    tracker.log(state.step, row)
                    bar.set_postfix(
                        ({"step": state.step} if max_seconds else {})
                        | {
                            "loss": f"{row.get('loss', float('nan')):.3f}",
                            "acc": f"{row.get('acc', float('nan')):.3f}",
                            "lr": f"{row['lr']:.1e}",
                            "tok_s": f"{row['tokens_per_s']:.0f}",
                        }
                    )
                    window, window_from, window_start = {}, state.tokens_all, now
                paused = time.perf_counter()
                if tc.eval_every and state.step % tc.eval_every == 0:
                    validate()
                if tc.save_every and state.step % tc.save_every == 0:
                    checkpoint()
                # validation and checkpoint time is neither training time nor in tokens/s
                t_last = time.perf_counter()
                window_start += t_last - paused
                stop = _agree_stop(
                    accelerator,
                    "signal"
                    if sig.caught is not None
                    else "steps"
                    if state.step >= tc.max_steps
                    else "time"
                    if max_seconds is not None and state.elapsed >= max_seconds
                    else None,
                )
                if stop is not None:
                    reason = stop
                    break
            else:
                state.epoch += 1
                state.batch_in_epoch = 0
                continue
            break
    bar.close()
    count_tokens()  # the run's summary reads them
    if reason == "steps":
        reason = "finished"
    if reason in ("finished", "time") and state.last_val_step != state.step:
        validate()
    last = run_dir / "checkpoints" / f"step_{state.step}"
    if state.step > 0:
        ck = last if last.exists() else checkpoint()
        if accelerator.is_main_process and reason in ("signal", "nonfinite"):
            log(
                f"stopped ({reason}) at step {state.step}; checkpoint {ck}; "
                "continue with resume=true"
            )
    return reason
