"""A KV cache shared by rows of different lengths, for batched decoding with ragged acceptance
(``decoding/batch.py``) and batched drafting (``BatchedProposer``s).

One transformers ``DynamicCache`` of shape (B, heads, L, d) plus a boolean ``valid`` (B, L):
the columns each row attends to. Appending a forward's n columns to every row and then masking
the ones a row rejects (``keep_columns``) is the whole rollback: keys carry their rotary
positions already, so a row's kept columns need be neither contiguous nor in order. ``tidy``
cuts columns no row uses at the ends and compacts a cache that is mostly holes; ``join_rows``
stacks newly prefilled rows under the running ones (left-padded with masked columns).
``prefill_groups`` splits newcomers of very different lengths into a few left-padded prefills
(on a CPU, padding costs as much as real tokens); ``prefill_in_groups`` stacks them back in order.
"""

from __future__ import annotations

import math

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from .target import _GrowingLayer, _join_caches, _stack_caches, _trim_cache

# prefill_groups' default: the share of a group's tokens that may be padding. On a CPU a
# padded token costs as much as a real one (16 MT-bench prompts of 43-232 tokens: 9.7 s in one
# padded forward, 3.3 s in 3 groups, 4.8 s one by one; docs/benchmarks.md); on a GPU a small
# prefill leaves the device idle, so one padded forward is the cheaper there.
CPU_PREFILL_WASTE = 0.25


def prefill_waste(device: torch.device) -> float:
    """How much padding a prefill of several prompts may carry on ``device``."""
    return CPU_PREFILL_WASTE if torch.device(device).type == "cpu" else math.inf


def prefill_groups(lengths: list[int], waste: float = CPU_PREFILL_WASTE) -> list[list[int]]:
    """Split prompts of ``lengths`` into groups, each prefilled by one left-padded forward:
    longest first, a group takes the next prompt while padding to its longest stays at most
    ``waste`` of its tokens (``math.inf``: one group). Returns the groups' indices."""
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    groups: list[list[int]] = []
    cur: list[int] = []
    total = 0
    for i in order:
        n = max(1, lengths[i])
        if cur and (len(cur) + 1) * max(1, lengths[cur[0]]) > (1 + waste) * (total + n):
            groups.append(cur)
            cur, total = [], 0
        cur.append(i)
        total += n
    if cur:
        groups.append(cur)
    return groups


def group_order(groups: list[list[int]]) -> list[int]:
    """For rows stacked group after group: which stacked row holds prompt i, for each i."""
    where = {i: k for k, i in enumerate(i for g in groups for i in g)}
    return [where[i] for i in range(len(where))]


def prefill_in_groups(lengths: list[int], waste: float, prefill):
    """Prefill prompts of ``lengths`` in ``prefill_groups``: ``prefill(group)`` (the group's
    indices) returns its (cache, valid); the groups' caches are stacked back in the prompts'
    original order. Returns (cache, valid)."""
    groups = prefill_groups(lengths, waste)
    cache, valid = _stack_caches([prefill(g) for g in groups], group_order(groups))
    return cache, valid.bool()


def additive_mask(allowed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A boolean attention pattern (True = attend) as the additive float mask that every
    attention implementation reads the same way: 0 where allowed, the dtype's most negative
    value elsewhere. (A boolean 4D mask is read as True = attend by SDPA but added as a 0/1 bias
    by eager attention, which then masks nothing.)"""
    m = torch.zeros(allowed.shape, dtype=dtype)
    return m.masked_fill(~allowed, torch.finfo(dtype).min)


def window_layers(config) -> tuple[int | None, list[bool]]:
    """(the window, which layers attend only within it) of a transformers config: Mistral's
    every layer, Gemma-2/3's and GPT-OSS's sliding ones by ``layer_types``; (None, []) for a
    model without sliding-window attention."""
    from transformers.cache_utils import DynamicSlidingWindowLayer

    window = getattr(config, "sliding_window", None)
    if not window:
        return None, []
    sliding = [type(x) is DynamicSlidingWindowLayer for x in DynamicCache(config=config).layers]
    return (int(window), sliding) if any(sliding) else (None, [])


def within_window(qpos: torch.Tensor, kpos: torch.Tensor, window: int) -> torch.Tensor:
    """(..., Q, K) bool: which keys at positions ``kpos`` (..., K) a query at ``qpos`` (..., Q)
    sees through a sliding window (``q - k < window``: transformers' and vLLM's rule)."""
    return (qpos[..., :, None] - kpos[..., None, :]) < window


def causal_window(qpos: torch.Tensor, keys: torch.Tensor, window: int | None) -> torch.Tensor:
    """(Q, K) bool: which keys a query sees in a cache whose columns hold positions ``keys``
    (K,) (a single sequence's: its columns are its positions): those at or before its own
    position ``qpos`` (Q,), and within ``window`` of it where the target gives drafts one
    (``Target.draft_window``; None: no window)."""
    mask = keys[None, :] <= qpos[:, None]
    return mask & within_window(qpos, keys, window) if window is not None else mask


def column_positions(valid: torch.Tensor) -> torch.Tensor:
    """(R, L) the position of the key each column holds, for caches whose valid columns hold a
    row's positions 0, 1, ... in column order (the batched drafters' committed pairs and
    drafted chains): a row's count of valid columns before it. Only what a valid column holds
    is meaningful."""
    return valid.long().cumsum(1) - 1


def layer_masks(
    windows: tuple[int | None, list[bool]],
    allowed: torch.Tensor,
    qpos: torch.Tensor,
    kpos: torch.Tensor,
    dtype: torch.dtype,
):
    """The ``attention_mask`` argument of a forward with an explicit pattern: ``allowed``
    (B, Q, K) bool (True = attend), as an additive (B, 1, Q, K) mask, with the sliding-window
    layers' window (``windows``: ``window_layers(config)``, taken once per target) applied from
    the query and key positions ``qpos`` (B, Q), ``kpos`` (B, K) (a key is seen while
    ``q - k < window``, transformers' rule). A model mixing window and full layers gets one
    mask per layer type, as its forward takes them."""
    window, sliding = windows
    full = additive_mask(allowed, dtype)[:, None]
    if window is None:
        return full
    near = (qpos[:, :, None] - kpos[:, None, :]) < window
    windowed = additive_mask(allowed & near, dtype)[:, None]
    if all(sliding):
        return windowed
    return {"full_attention": full, "sliding_attention": windowed}


def on(mask, device):
    """A mask from ``layer_masks`` (a tensor or one per layer type) on ``device``."""
    if isinstance(mask, dict):
        return {k: v.to(device) for k, v in mask.items()}
    return mask.to(device)


def left_padded(feeds: list[list[int]], starts: list[int]):
    """Each row's tokens ``feeds[b]`` at positions ``starts[b]..``, right-aligned in one
    (R, n) block (n >= 1: a row with nothing gets one masked query). Returns (ids, positions,
    real), real marking the tokens that are not padding."""
    R, n = len(feeds), max(1, max((len(f) for f in feeds), default=0))
    ids = torch.zeros(R, n, dtype=torch.long)
    pos = torch.zeros(R, n, dtype=torch.long)
    real = torch.zeros(R, n, dtype=torch.bool)
    for b, (f, s) in enumerate(zip(feeds, starts, strict=True)):
        if f:
            ids[b, n - len(f) :] = torch.tensor(f)
            pos[b, n - len(f) :] = torch.arange(s, s + len(f))
            real[b, n - len(f) :] = True
    return ids, pos, real


def causal_mask(valid: torch.Tensor, real: torch.Tensor) -> torch.Tensor:
    """(R, n, L + n) boolean attention of n new queries per row after a cache whose columns
    ``valid`` (R, L) marks: each real query sees its row's valid columns and the real queries
    up to itself; a padding query sees only itself (a row of -inf would give NaN)."""
    R, n = real.shape
    causal = torch.ones(n, n, dtype=torch.bool).tril()
    inner = (causal[None] & real[:, None, :]) | torch.eye(n, dtype=torch.bool)[None]
    return torch.cat([valid[:, None, :].expand(R, n, valid.shape[1]).cpu(), inner], dim=2)


def join_rows(cache, valid: torch.Tensor | None, new, new_valid: torch.Tensor):
    """The running rows (``cache`` None: none yet) and new ones in one cache, the shorter side
    left-padded with masked columns; returns (cache, valid)."""
    if cache is None:
        return new, new_valid
    cache, valid = _join_caches(cache, valid, new, new_valid)
    return cache, valid.bool()


def keep_rows(cache, valid: torch.Tensor, keep: list[int]):
    """Only the rows at ``keep``, in that order; returns (cache, valid), (None, None) when no
    row is left."""
    if not keep:
        return None, None
    cache.batch_select_indices(torch.tensor(keep, device=valid.device))
    return cache, valid[keep]


def keep_columns(valid: torch.Tensor, start: int, keeps: list[list[int]]) -> None:
    """Ragged rollback: after a forward that appended columns ``start..`` to every row, row b
    keeps (attends to from now on) the appended columns ``start + k`` for k in ``keeps[b]`` and
    none of the others. ``valid`` (B, L) is updated in place."""
    valid[:, start:] = False
    for b, ks in enumerate(keeps):
        if ks:
            valid[b, torch.tensor(ks, device=valid.device) + start] = True


def compaction(valid: torch.Tensor, m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Where each row's valid columns (``valid`` (R, L)) go when gathered, in order, to the
    right end of m columns (m: the most any row has): the source column of each of the m
    (R, m; a padding one points at column 0) and the new ``valid`` (R, m)."""
    b, length = valid.shape
    order = torch.arange(length, device=valid.device).expand(b, length)
    key = torch.where(valid, order, order - length)  # invalid columns sort first
    idx = key.sort(dim=1).values[:, length - m :]
    return idx.clamp_min(0), idx >= 0


def compact(cache: DynamicCache, valid: torch.Tensor) -> torch.Tensor:
    """Gather each row's valid columns to the right end of a cache as long as the row with the
    most, left-padding the others with masked columns; returns the new ``valid``."""
    m = int(valid.sum(1).max()) if valid.numel() else 0
    idx, new_valid = compaction(valid, m)
    for layer in cache.layers:
        for name in ("keys", "values"):
            t = getattr(layer, name)
            g = idx[:, None, :, None].expand(t.shape[0], t.shape[1], m, t.shape[3])
            setattr(layer, name, t.gather(2, g.to(t.device)))
    return new_valid


def tidy(cache: DynamicCache, valid: torch.Tensor, holes: float = 0.5, slack: int = 64):
    """Cut columns no row attends to at either end of the cache; compact when more than
    ``holes`` of the rest (and over ``slack`` columns) are holes. Returns the new ``valid``."""
    if valid.shape[1] == 0:
        return valid
    used = valid.any(0)
    if not bool(used.any()):
        last = 0
    else:
        last = int(used.nonzero().max()) + 1
    if last < valid.shape[1]:
        for layer in cache.layers:
            layer.keys = layer.keys[..., :last, :]
            layer.values = layer.values[..., :last, :]
        valid = valid[:, :last]
    if valid.shape[1] == 0:
        return valid
    first = int(valid.any(0).float().argmax())
    if first > 0:
        _trim_cache(cache, first)
        valid = valid[:, first:]
    length = valid.shape[1]
    need = int(valid.sum(1).max())
    if length - need > slack and (length - need) > holes * length:
        valid = compact(cache, valid)
    return valid


def new_cache(config) -> DynamicCache:
    """A batch's cache: every attention layer a growing full layer, sliding-window ones too
    (their window is applied by ``layer_masks``, so rows can roll back and leave holes)."""
    from transformers.cache_utils import DynamicSlidingWindowLayer

    c = DynamicCache(config=config)
    full = (DynamicLayer, DynamicSlidingWindowLayer)
    c.layers = [_GrowingLayer() if type(x) in full else x for x in c.layers]
    return c
