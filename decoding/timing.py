"""Wall-clock timing of device work: what the decoders, their policies' cost models and the
benchmarks read. A CUDA kernel returns before it has run, so a clock read after queuing work
must first wait for the device (``sync``); on a CPU the work is done when the call returns."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch


def sync(device: torch.device) -> None:
    """Wait until ``device`` has run everything queued on it (a no-op on a CPU)."""
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def seconds(fn: Callable[[], object], device: torch.device) -> float:
    """Seconds ``fn()`` takes on ``device``, its queued work included."""
    sync(device)
    t = time.perf_counter()
    fn()
    sync(device)
    return time.perf_counter() - t


def median_seconds(fn: Callable[[], object], device: torch.device, reps: int) -> float:
    """The median of ``reps`` timings of ``fn()`` after one untimed warm-up call."""
    fn()
    return statistics.median(seconds(fn, device) for _ in range(reps))


def interleaved_medians(shapes, setup, device: torch.device, reps: int) -> dict:
    """Median seconds per shape over ``reps`` rounds after an untimed warm-up round, every
    shape timed in turn within each round, so that a slow spell of the machine (a 2-core VM
    drifts by 20% between runs) falls on every shape alike instead of on one. ``setup(shape)``
    prepares a call (untimed) and returns the callable that is timed."""
    times: dict = {s: [] for s in shapes}
    for i in range(reps + 1):
        for s in shapes:
            fn = setup(s)
            t = seconds(fn, device)
            if i:
                times[s].append(t)
    return {s: statistics.median(v) for s, v in times.items()}
