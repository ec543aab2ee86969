"""How busy the rest of the machine was while a measurement ran.

On a CPU a second busy process takes cores from PyTorch's forwards and makes small-shape ones
many times slower: tokens/s and speedups measured beside another job are not the machine's
own. ``OtherLoad`` reads, around a run, the CPU time every core the process may use spent busy
(``/proc/stat``, only those cores: a container's cpuset counts, not the host's) and the CPU time
of this process and its descendants (reaped ones included, through ``os.times``; live ones read
from ``/proc``); the difference is the other processes' (and the hypervisor's ``steal``). A
report carries it, and says so in one line where others kept more than a quarter of a core busy.

Linux only (elsewhere nothing is measured and nothing said). Not counted as this run's own: a
worker a long-lived process forked for it (the vLLM zygote of the test suite), which then reads
as another process. A training run is measured where it is one process (``specdraft-train``
without a multi-process launch: the other ranks of a launch would read as other processes).
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

#: others' mean busy cores above which a report says its timings are not the machine's own
BUSY_CORES = 0.25

_PROC = Path("/proc")


def _cores() -> set[int]:
    try:
        return set(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return set(range(os.cpu_count() or 1))


def _busy_seconds(cores: set[int], text: str | None = None) -> float | None:
    """Busy CPU seconds so far of ``cores`` (user, nice, system, irq, softirq, steal), from
    ``/proc/stat``'s per-core lines (``text``: its content, for tests)."""
    try:
        text = text if text is not None else (_PROC / "stat").read_text()
    except OSError:
        return None
    tick = os.sysconf("SC_CLK_TCK")  # /proc/stat's unit (Linux: read only there)
    busy = 0
    seen = False
    for line in text.splitlines():
        name, *vals = line.split()
        if not name.startswith("cpu") or name == "cpu" or int(name[3:]) not in cores:
            continue
        v = [int(x) for x in vals[:8]] + [0] * max(0, 8 - len(vals))
        user, nice, system, _idle, _iowait, irq, softirq, steal = v[:8]
        busy += user + nice + system + irq + softirq + steal
        seen = True
    return busy / tick if seen else None


def _descendants_seconds(root: int) -> float:
    """CPU seconds so far of ``root``'s live descendants (each with its reaped children)."""
    tick = os.sysconf("SC_CLK_TCK")
    parent: dict[int, int] = {}
    times: dict[int, float] = {}
    for d in _PROC.iterdir():
        if not d.name.isdigit():
            continue
        try:
            stat = (d / "stat").read_text()
        except OSError:
            continue
        # "pid (comm) state ppid ... utime stime cutime cstime ...": comm may hold spaces
        f = stat[stat.rfind(")") + 2 :].split()
        pid = int(d.name)
        parent[pid] = int(f[1])
        times[pid] = (int(f[11]) + int(f[12]) + int(f[13]) + int(f[14])) / tick
    total, todo = 0.0, [root]
    children: dict[int, list[int]] = {}
    for pid, pp in parent.items():
        children.setdefault(pp, []).append(pid)
    while todo:
        for c in children.get(todo.pop(), []):
            total += times[c]
            todo.append(c)
    return total


def _own_seconds() -> float:
    t = os.times()
    return (
        t.user + t.system + t.children_user + t.children_system + _descendants_seconds(os.getpid())
    )


class OtherLoad:
    """``with OtherLoad() as load: ...``; then ``load.summary()``: the mean number of cores
    other processes kept busy during the block, or None where it cannot be read."""

    def __init__(self) -> None:
        self.cores = _cores()
        self.start: tuple[float, float, float] | None = None
        self.end: tuple[float, float, float] | None = None

    def _read(self) -> tuple[float, float, float] | None:
        busy = _busy_seconds(self.cores)
        if busy is None:
            return None
        try:
            own = _own_seconds()
        except (OSError, ValueError, IndexError):
            return None
        return time.monotonic(), busy, own

    def __enter__(self) -> OtherLoad:
        self.start = self._read()
        return self

    def __exit__(self, *exc) -> None:
        self.end = self._read() if self.start is not None else None

    def summary(self) -> dict[str, Any] | None:
        if self.start is None or self.end is None:
            return None
        wall = self.end[0] - self.start[0]
        if wall <= 0:
            return None
        others = (self.end[1] - self.start[1]) - (self.end[2] - self.start[2])
        return {
            "cores": len(self.cores),
            "seconds": round(wall, 1),
            "others_busy_cores": round(max(0.0, others / wall), 2),
        }


#: what a busy machine makes unreliable, and what it leaves alone, in a measurement's report
EVAL_TIMINGS = (
    "its timings (tok/s, speedups, step costs) are not the machine's own; acceptance and "
    "losslessness are unaffected"
)


def busy_note(load: dict[str, Any] | None, timings: str = EVAL_TIMINGS) -> str | None:
    """The report's line where other processes kept the machine busy, else None."""
    if not load or load.get("others_busy_cores", 0) <= BUSY_CORES:
        return None
    return (
        f"BUSY MACHINE: other processes kept {load['others_busy_cores']:.2f} of this run's "
        f"{load['cores']} cores busy on average over its {load['seconds']:.0f} s: {timings}. "
        "Run it alone for timings."
    )


def measured(main) -> None:
    """Run a benchmark's ``main()`` and say, last, how busy other processes kept the machine
    meanwhile (its figures are the machine's own only where they kept it idle); ``--help``
    and a refused command say nothing of it."""
    with OtherLoad() as load:
        main()
    s = load.summary()
    if s is None:
        return
    print(
        busy_note(s)
        or f"machine load: other processes kept {s['others_busy_cores']:.2f} of {s['cores']} "
        f"cores busy on average over these {s['seconds']:.0f} s (timings are the machine's own)"
    )
