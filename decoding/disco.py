"""DISCO (Mamou et al. 2024, "Dynamic Speculation Lookahead Accelerates Speculative Decoding of
Large Language Models", arXiv 2405.04304): a small feed-forward classifier that decides, after
each drafted token, whether to keep drafting.

- **Traces.** ``specdraft-eval traces=t.jsonl adaptive=false`` records, for every drafting
  iteration at a fixed gamma, the draft's signals for each drafted token (``SIGNAL_NAMES``: the
  drafted token's probability, the top-4 probabilities, the entropy, the position) and how many
  tokens the target accepted. Token k is a training example when it was tested (tokens 1..k-1
  accepted); its label is whether it was accepted.
- **Training** (``specdraft-disco t.jsonl``): standardised signals -> Linear -> ReLU -> Linear ->
  P(accepted), fit with binary cross-entropy on a split of the iterations. The stop threshold is
  chosen on the held-out iterations by replaying them: stopping after token k where
  P(accepted) < threshold, an iteration emits min(accepted, kept) + 1 tokens at a cost of
  1 + kept * c target steps (c: the draft's measured cost per step, from the traces' eval), and
  the threshold with the most tokens per cost wins. The classifier is saved beside the draft
  (``<draft>/disco``).
- **Decoding** (``specdraft-eval stop=disco``): the decoder drafts up to gamma tokens and the
  proposer stops where the classifier says the token just drafted is likely rejected. It only
  decides how many tokens are drafted, never which, so the output distribution stays the
  target's (the decoder's distribution test covers it).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file
from torch import nn

from models.base import SIGNAL_NAMES, readable_by_others, resolve_draft_dir, unwritable

CONFIG, WEIGHTS = "config.json", "model.safetensors"


class DiscoError(ValueError):
    """Traces or a classifier that cannot be used; the message names the file and problem."""


# ---------------------------------------------------------------------------------------------
# traces


def write_traces(path: str | Path, rows: list[dict], report: dict, draft_desc: str) -> dict:
    """The eval's traces as JSONL: a ``{"meta": ...}`` line (what drafted them, at which
    temperature and gamma, and the draft's measured cost c), then one line per drafting
    iteration: ``{"signals": [[...] per drafted token], "accepted": A, "drafted": G}``."""
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    s = report["settings"]
    meta = {
        "draft": s["draft"],
        "draft_description": draft_desc,
        "target_identity": s["target_identity"],
        "temperature": s["temperature"],
        "gamma": s["gamma"],
        "bench": s["bench"],
        "c": report["draft_cost_ratio"],
        "signal_names": list(SIGNAL_NAMES),
        "date": datetime.now(timezone.utc).isoformat(),
    }
    with p.open("w") as f:
        f.write(json.dumps({"meta": meta}) + "\n")
        for r in rows:
            f.write(json.dumps(r) + "\n")
    return {"path": str(p), "iterations": len(rows), "drafted": sum(r["drafted"] for r in rows)}


def _count(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 0


def _number(v: object) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def read_traces(path: str | Path) -> tuple[dict, list[dict]]:
    p = Path(path).expanduser()
    if p.is_dir():
        raise DiscoError(f"{p}: a folder; name the traces file specdraft-eval traces=... wrote")
    if not p.is_file():
        raise DiscoError(f"{p}: no such traces file (write one with specdraft-eval traces=...)")
    if p.stat().st_size == 0:
        raise DiscoError(f"{p}: empty (write traces with specdraft-eval traces=... adaptive=false)")
    try:
        text = p.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise DiscoError(f"{p}: byte {e.start + 1} is not UTF-8 (not a traces file?)") from None
    meta, rows = None, []
    for n, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError as e:
            raise DiscoError(f"{p}:{n}: not valid JSON ({e})") from None
        if not isinstance(rec, dict) or not isinstance(rec.get("meta", {}), dict):
            raise DiscoError(f"{p}:{n}: not a JSON object of a traces file ({line.strip()[:40]})")
        if "meta" in rec:
            meta = rec["meta"]
            continue
        for key in ("signals", "accepted", "drafted"):
            if key not in rec:
                raise DiscoError(f"{p}:{n}: no '{key}' field")
        for key in ("accepted", "drafted"):
            if not _count(rec[key]):
                raise DiscoError(f"{p}:{n}: {key}={rec[key]!r}: must be a whole number >= 0")
        sig = rec["signals"]
        if (
            not isinstance(sig, list)
            or len(sig) != rec["drafted"]
            or any(not isinstance(s, list) or len(s) != len(SIGNAL_NAMES) for s in sig)
        ):
            raise DiscoError(
                f"{p}:{n}: 'signals' must hold {rec['drafted']} rows of {len(SIGNAL_NAMES)} "
                f"values ({', '.join(SIGNAL_NAMES)})"
            )
        # a NaN would turn the standardisation, and so every prediction, into NaN
        if not all(_number(v) for s in sig for v in s):
            raise DiscoError(f"{p}:{n}: 'signals' must be finite numbers")
        if not rec["accepted"] <= rec["drafted"]:
            raise DiscoError(f"{p}:{n}: accepted={rec['accepted']} outside 0..{rec['drafted']}")
        rows.append(rec)
    if meta is None:
        raise DiscoError(f"{p}: no meta line (not written by specdraft-eval traces=...)")
    if meta.get("signal_names") != list(SIGNAL_NAMES):
        raise DiscoError(
            f"{p}: signals {meta.get('signal_names')} differ from this version's "
            f"{list(SIGNAL_NAMES)}"
        )
    if not rows:
        raise DiscoError(f"{p}: no drafting iteration recorded")
    return meta, rows


def examples(rows: list[dict]) -> tuple[torch.Tensor, torch.Tensor]:
    """(X (n, F), y (n,)): every tested drafted token and whether it was accepted."""
    xs, ys = [], []
    for r in rows:
        tested = min(r["accepted"] + 1, r["drafted"])
        for k in range(tested):
            xs.append(r["signals"][k])
            ys.append(1.0 if k < r["accepted"] else 0.0)
    return torch.tensor(xs, dtype=torch.float32), torch.tensor(ys)


# ---------------------------------------------------------------------------------------------
# the classifier


class DiscoClassifier(nn.Module):
    """P(accepted) of a drafted token from its signals: standardise -> Linear -> ReLU ->
    Linear -> logit."""

    def __init__(self, n_features: int = len(SIGNAL_NAMES), hidden: int = 32):
        super().__init__()
        self.register_buffer("mean", torch.zeros(n_features))
        self.register_buffer("std", torch.ones(n_features))
        self.net = nn.Sequential(nn.Linear(n_features, hidden), nn.ReLU(), nn.Linear(hidden, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x (..., F) -> logits (...)."""
        return self.net((x - self.mean) / self.std).squeeze(-1)


def replay(rows: list[dict], probs: list[torch.Tensor] | None, threshold: float, c: float):
    """Tokens per unit of cost (one plain target step = 1) had the iterations in ``rows``
    stopped after the first token whose P(accepted) is below ``threshold`` (``probs[i]``: per
    drafted token of row i; None: never stop). Returns (tokens per cost, mean tokens drafted)."""
    tokens = cost = drafted = 0.0
    for i, r in enumerate(rows):
        kept = r["drafted"]
        if probs is not None:
            below = (probs[i] < threshold).nonzero()
            if len(below):
                kept = int(below[0]) + 1
        tokens += min(r["accepted"], kept) + 1
        cost += 1.0 + kept * c
        drafted += kept
    return tokens / cost, drafted / len(rows)


def replay_fixed(rows: list[dict], gamma: int, c: float) -> float:
    """Tokens per cost had every iteration drafted ``gamma`` tokens (or what it drafted, where
    that was fewer: the end of a generation)."""
    tokens = cost = 0.0
    for r in rows:
        kept = min(gamma, r["drafted"])
        tokens += min(r["accepted"], kept) + 1
        cost += 1.0 + kept * c
    return tokens / cost


def train_disco(
    rows: list[dict],
    c: float,
    hidden: int = 32,
    epochs: int = 400,
    lr: float = 1e-2,
    val_fraction: float = 0.25,
    seed: int = 0,
    log=print,
) -> tuple[DiscoClassifier, float, dict[str, Any]]:
    """Fit the classifier on a split of the iterations and choose the stop threshold on the
    rest by replay. Returns (classifier, threshold, summary)."""
    if not (_number(c) and c >= 0):
        raise DiscoError(f"draft cost c={c!r}: must be a number >= 0")
    g = torch.Generator().manual_seed(seed)
    order = torch.randperm(len(rows), generator=g).tolist()
    n_val = max(1, int(len(rows) * val_fraction)) if len(rows) > 1 else 0
    val = [rows[i] for i in order[:n_val]]
    train = [rows[i] for i in order[n_val:]] or val
    x, y = examples(train)
    if len(y) == 0 or y.min() == y.max():
        raise DiscoError(
            f"{len(y)} training tokens, all {'accepted' if len(y) and y[0] else 'rejected'}: "
            "a classifier needs both outcomes (record more prompts)"
        )
    torch.manual_seed(seed)
    model = DiscoClassifier(x.shape[1], hidden)
    model.mean.copy_(x.mean(0))
    model.std.copy_(x.std(0).clamp_min(1e-6))
    opt = torch.optim.Adam(model.parameters(), lr=lr, weight_decay=1e-4)
    loss_fn = nn.BCEWithLogitsLoss()
    for _ in range(epochs):  # full batch: a few thousand rows of 7 features
        opt.zero_grad()
        loss = loss_fn(model(x), y)
        loss.backward()
        opt.step()
    model.eval()
    with torch.no_grad():
        xv, yv = examples(val)
        pv = torch.sigmoid(model(xv))
        acc = float(((pv >= 0.5).float() == yv).float().mean()) if len(yv) else float("nan")
        probs = [torch.sigmoid(model(torch.tensor(r["signals"]))) for r in val]
    grid = [i / 40 for i in range(0, 39)]
    scores = {t: replay(val, probs, t, c) for t in grid}
    best = max(grid, key=lambda t: scores[t][0])
    gmax = max(r["drafted"] for r in rows)
    fixed = {k: replay_fixed(val, k, c) for k in range(1, gmax + 1)}
    summary = {
        "train_iterations": len(train),
        "val_iterations": len(val),
        "train_tokens": len(y),
        "train_accept_rate": float(y.mean()),
        "val_accuracy": acc,
        "final_train_loss": float(loss.detach()),
        "threshold": best,
        "c": c,
        "val_tokens_per_cost": {
            "disco": scores[best][0],
            "disco_mean_drafted": scores[best][1],
            "never_stop": replay(val, None, 1.0, c)[0],
            **{f"fixed_gamma_{k}": v for k, v in fixed.items()},
        },
    }
    log(
        f"disco: {len(y)} tokens from {len(train)} iterations (accept rate "
        f"{summary['train_accept_rate']:.2f}); held-out accuracy {acc:.3f}; threshold {best:.3f}"
    )
    log(
        "held-out replay, tokens per target-step of cost: DISCO "
        f"{scores[best][0]:.3f} (drafts {scores[best][1]:.2f} tokens on average); "
        + ", ".join(f"gamma {k}: {v:.3f}" for k, v in fixed.items())
    )
    return model, best, summary


def save_disco(model: DiscoClassifier, threshold: float, summary: dict, meta: dict, out) -> Path:
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(out / WEIGHTS))
    cfg = {
        "disco": {
            "threshold": threshold,
            "hidden": model.net[0].out_features,
            "signal_names": list(SIGNAL_NAMES),
        },
        "trained_on": meta,
        "summary": summary,
    }
    (out / CONFIG).write_text(json.dumps(cfg, indent=1))
    readable_by_others(out)  # safetensors writes 0600; a server may run as another user
    return out


class DiscoStop:
    """The stop rule the decoder hands to a proposer: True (stop drafting) when the classifier
    gives the token just drafted P(accepted) < threshold."""

    def __init__(self, model: DiscoClassifier, threshold: float, path: str = "", trained_on=None):
        self.model, self.threshold, self.path = model.eval().requires_grad_(False), threshold, path
        #: what the traces it was fit on came from (draft, target, temperature, gamma)
        self.trained_on: dict = dict(trained_on or {})

    @torch.no_grad()
    def __call__(self, signals: torch.Tensor) -> bool:
        return bool(torch.sigmoid(self.model(signals.float())) < self.threshold)

    def describe(self) -> str:
        return f"threshold {self.threshold:.3f}, {self.path}"


def load_disco(path: str | Path, threshold: float | None = None) -> DiscoStop:
    p = Path(path)
    f = p / CONFIG
    if not f.is_file() or not (p / WEIGHTS).is_file():
        raise DiscoError(f"{p}: no DISCO classifier ({CONFIG} and {WEIGHTS} expected)")
    try:
        whole = json.loads(f.read_text())
        cfg = whole["disco"]
    except (json.JSONDecodeError, KeyError, TypeError) as e:
        raise DiscoError(f"{f}: not a DISCO classifier config ({e})") from None
    if cfg.get("signal_names") != list(SIGNAL_NAMES):
        raise DiscoError(f"{f}: trained on signals {cfg.get('signal_names')}, not these")
    model = DiscoClassifier(len(SIGNAL_NAMES), cfg["hidden"])
    model.load_state_dict(load_file(str(p / WEIGHTS)))
    thr = cfg["threshold"] if threshold is None else threshold
    return DiscoStop(model, thr, str(p), whole.get("trained_on"))


def is_classifier(folder: Path) -> bool:
    """Whether ``folder`` holds a classifier ``specdraft-disco`` wrote (and nothing it may not
    replace: a trained draft's ``config.json`` is not one)."""
    try:
        cfg = json.loads((folder / CONFIG).read_text())
    except (OSError, ValueError):
        return False
    return isinstance(cfg, dict) and "disco" in cfg and "specdraft" not in cfg


def default_disco_dir(draft: str) -> Path | None:
    """``<draft folder>/disco`` for a draft given as a run, saved draft or shipped name."""
    from models.shipped import shipped_draft

    base = shipped_draft(draft) or Path(draft).expanduser()
    if not base.exists():
        return None
    d = resolve_draft_dir(base) or base
    return d / "disco"


def load_stop_rule(path: str | None, draft: str, proposer) -> DiscoStop:
    """The classifier at ``path`` (default: the draft's own ``disco`` folder)."""
    from models.base import DraftError

    where = Path(path) if path else default_disco_dir(draft)
    if where is None:
        raise DraftError(
            f"stop=disco: draft={draft} has no folder to hold a classifier; pass disco=<folder>"
        )
    if where.exists() and not where.is_dir():
        raise DraftError(f"disco={where}: a file, not a folder written by specdraft-disco")
    if not proposer.gives_signals:
        tree = proposer.tree_depth is not None
        raise DraftError(
            "stop=disco with a tree: the stop rule decides a chain's length; use tree=chain"
            if tree
            else f"stop=disco: draft={draft} does not report per-token signals (EAGLE chains "
            "and draft LMs do)"
        )
    inside = resolve_draft_dir(where) if where.is_dir() else None
    if inside is not None:  # disco=<a trained draft>: its classifier is in its disco/ folder
        where = inside / "disco"
    try:
        stop = load_disco(where)
    except DiscoError as e:
        raise DraftError(
            f"stop=disco: {e}. Train one: specdraft-eval draft={draft} adaptive=false "
            f"traces=t.jsonl, then specdraft-disco t.jsonl --out {where}"
        ) from None
    fit_for = stop.trained_on.get("draft")
    if fit_for is not None and not _same_draft(str(fit_for), draft):
        print(
            f"warning: disco={where} was fit on traces of draft={fit_for}, not draft={draft}: "
            "its stop rule reads another draft's signals"
        )
    return stop


def _same_draft(a: str, b: str) -> bool:
    """Whether two ``draft=`` values name the same draft (a run, its final/ folder or the same
    shipped name)."""
    if a == b:
        return True
    da, db = default_disco_dir(a), default_disco_dir(b)
    return da is not None and db is not None and da.resolve() == db.resolve()


# ---------------------------------------------------------------------------------------------
# CLI


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(
        prog="specdraft-disco",
        description="Train DISCO's stop classifier from acceptance traces (specdraft-eval "
        "traces=...) and save it beside the draft.",
    )
    ap.add_argument("traces", help="JSONL written by specdraft-eval traces=... adaptive=false")
    ap.add_argument("--out", help="folder to write (default: <the traced draft>/disco)")
    ap.add_argument("--hidden", type=int, default=32)
    ap.add_argument("--epochs", type=int, default=400)
    ap.add_argument("--lr", type=float, default=1e-2)
    ap.add_argument("--val-fraction", type=float, default=0.25)
    ap.add_argument("--c", type=float, help="draft cost per step (default: the traces' own)")
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args(argv)
    try:
        for key, v, ok in (
            ("--hidden", a.hidden, a.hidden >= 1),
            ("--epochs", a.epochs, a.epochs >= 1),
            ("--lr", a.lr, a.lr > 0),
            ("--val-fraction", a.val_fraction, 0 < a.val_fraction < 1),
        ):
            if not ok:
                raise DiscoError(f"{key}={v}: out of range")
        meta, rows = read_traces(a.traces)
        draft = meta.get("draft")
        # no draft named: "" would be the current folder, and its disco/ the default
        default = default_disco_dir(str(draft)) if draft else None
        out = Path(a.out).expanduser() if a.out else default  # --out=~/x: no shell expands it
        if out is None:
            raise DiscoError(
                f"{a.traces}: the traced draft {draft!r} is not a folder here; pass --out"
            )
        from models.shipped import HERE as shipped_home

        if not a.out and out.resolve().is_relative_to(shipped_home):
            raise DiscoError(
                f"{a.traces}: traces of the shipped draft {draft}, whose classifier is part of "
                "the package and is not written over; pass --out DIR (then disco=DIR)"
            )
        if out.exists() and not out.is_dir():
            raise DiscoError(f"--out {out}: a file, not a folder; name a folder for the classifier")
        why = unwritable(out)
        if why is not None:
            raise DiscoError(f"--out {out}: {why}")
        if out.is_dir() and any(out.iterdir()) and not is_classifier(out):
            inside = resolve_draft_dir(out)
            where = f" (its classifier's folder is {inside / 'disco'})" if inside else ""
            raise DiscoError(
                f"--out {out}: a folder holding something else than a DISCO classifier"
                f"{' (a trained draft)' if inside else ''}; choose another{where}; an earlier "
                "classifier there is replaced"
            )
        c = a.c if a.c is not None else meta.get("c")
        if c is None:
            raise DiscoError(f"{a.traces}: the meta line has no draft cost 'c'; pass --c")
        model, thr, summary = train_disco(rows, c, a.hidden, a.epochs, a.lr, a.val_fraction, a.seed)
        path = save_disco(model, thr, summary, meta, out)
    except DiscoError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    where = "" if default is not None and out.resolve() == default.resolve() else f" disco={out}"
    print(f"saved: {path}  (use: specdraft-eval draft={draft or '<draft>'} stop=disco{where})")


if __name__ == "__main__":
    main()
