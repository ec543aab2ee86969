"""Any causal LM with the target's tokenizer as a drafter: loading one (refused unless its
vocabulary is the target's) and proposing with it. Shared by DistillSpec students, ``truncate:N``
(the target's own first N layers) and any HF draft model."""

from __future__ import annotations

import time
from pathlib import Path

import torch
from torch import nn
from transformers import DynamicCache

from ..base import (
    BatchedProposer,
    DecodeState,
    DraftError,
    Proposal,
    Proposer,
    cache_kw,
    crop_cache,
    draft_signals,
    keep_last,
    rollback_cache,
)
from ..sampling import greedy_tokens, sample, warp
from ..target import Target, TargetError, check_same_vocabulary, hub_unreachable


def load_same_vocabulary_lm(path: str, target: Target, what: str) -> nn.Module:
    """An HF causal LM (folder or hub id) on the target's device and dtype, refused unless its
    tokenizer's vocabulary is the target's (named after ``what`` in errors)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    why = None if Path(path).expanduser().exists() else hub_unreachable(path)
    if why:
        raise DraftError(f"{what}: {why}")
    try:
        tok = AutoTokenizer.from_pretrained(path)
        model = AutoModelForCausalLM.from_pretrained(path, dtype=target.dtype)
    except OSError as e:
        raise DraftError(f"{what}: cannot load as an HF model ({str(e).splitlines()[0]})") from None
    try:
        check_same_vocabulary(target.tokenizer, tok, what)
    except TargetError as e:
        raise DraftError(str(e)) from None
    return model.to(target.device)


def _full_attention(model: nn.Module) -> bool:
    from transformers.cache_utils import DynamicLayer

    return all(type(x) is DynamicLayer for x in DynamicCache(config=model.config).layers)


class DraftLMProposer(Proposer):
    """A causal LM with the target's tokenizer, drafting autoregressively with its own KV cache
    (standard speculative sampling). At T > 0 it samples from its warped distribution and
    hands the distributions to the verifier; at T = 0 it drafts argmax tokens. Used for
    DistillSpec students, ``truncate:N`` and any HF draft model."""

    name = "draft_lm"
    measures_steps = True
    gives_signals = True

    def __init__(
        self, model: torch.nn.Module, vocab_size: int | None = None, method: object = None
    ):
        self.model = model.eval()
        self.method = method  # a DistillSpec student (None: an HF draft or truncate:N)
        # Same tokenizer, but embedding matrices are often padded to different sizes: compare
        # distributions over the target's vocabulary.
        self.vocab_size = vocab_size
        self.draft_calls = 0
        self.cache: DynamicCache | None = None
        self.fed = 0  # committed tokens held by the draft's cache
        self.last_step_seconds: float | None = None

    def batched(self) -> BatchedDraftLM | None:
        """Every row of a batch drafted in one forward per step, where the draft model's cache
        is full attention (a sliding-window draft drafts row by row)."""
        if type(self) is not DraftLMProposer or not _full_attention(self.model):
            return None
        return BatchedDraftLM(self.model, self.vocab_size)

    def fixed_shape(self, gamma: int, graphs: str) -> Proposer | None:
        """This draft on the lean forward over a static cache (``static.StaticDraftLM``)
        wherever the lean forward computes the draft model: eager on a CPU, a whole proposal
        captured as one CUDA graph where graphs run. None for another family (transformers'
        forward, as always)."""
        from ..lean import lean_support

        if type(self) is not DraftLMProposer or lean_support(self.model) is not None:
            return None
        from .static import StaticDraftLM

        return StaticDraftLM(self.model, self.vocab_size, self.method, max(gamma, 1), graphs)

    def start(self, state: DecodeState) -> None:
        self.cache = rollback_cache(self.model.config)
        self.fed = 0
        self.last_step_seconds = None
        if len(state.ids) > 1:  # prefill the prompt now, so drafting times only draft steps
            self._step(state.ids[:-1], state.device)
            self.fed = len(state.ids) - 1

    @torch.no_grad()
    def _step(self, tokens: list[int], device: torch.device) -> torch.Tensor:
        self.draft_calls += 1
        ids = torch.tensor([tokens], device=device)
        logits = self.model(
            input_ids=ids,
            **cache_kw(self.model, self.cache),
            use_cache=True,
            logits_to_keep=keep_last(len(tokens), device),
        ).logits[0, -1]
        return _fit_vocab(logits, self.vocab_size)

    def propose(self, state: DecodeState, gamma: int) -> Proposal:
        # Time the steps that feed a few tokens; a long catch-up (after the decoder skipped
        # drafting for a while) is not what one more draft token costs.
        times: list[float] = []
        n_feed = len(state.ids) - self.fed
        t = time.perf_counter()
        logits = self._step(state.ids[self.fed :], state.device)
        if n_feed <= 2 or gamma == 1 and n_feed <= 4:
            times.append(time.perf_counter() - t)
        self.fed = len(state.ids)
        prop = chain_from(state, gamma, logits, lambda x, i: self._step([x], state.device), times)
        self.last_step_seconds = sum(times) / len(times) if times else None
        return prop

    def rollback(self, state: DecodeState, n_accepted: int) -> None:
        # The cache holds the old committed tokens plus the drafted tokens fed after them; the
        # accepted ones are still valid.
        held = self.cache.get_seq_length()
        keep = min(held, self.fed + n_accepted)
        crop_cache(self.cache, keep)
        self.fed = keep


def chain_from(state: DecodeState, gamma: int, logits: torch.Tensor, step, times: list) -> Proposal:
    """Up to ``gamma`` tokens drafted one at a time from ``logits`` (the draft's next-token
    logits): the argmax at T = 0, else a draw from q (kept for the test), a learned stop rule
    (DISCO) read after each where the decoder asks for signals. ``step(x, i)`` feeds the i-th
    drafted token and returns the next logits; its seconds are appended to ``times``. Shared
    by every drafter that is a causal LM fed token by token."""
    tokens: list[int] = []
    qs: list[torch.Tensor] = []
    sigs: list[torch.Tensor] = []
    for i in range(gamma):
        if state.sampling.greedy:
            x = int(greedy_tokens(logits))
        else:
            q = warp(logits, state.sampling)
            x = sample(q, state.generator)
            qs.append(q)
        tokens.append(x)
        if state.signals:  # acceptance traces / a learned stop rule (DISCO)
            sigs.append(draft_signals(logits, x, i + 1))
            if state.stop is not None and state.stop(sigs[-1]):
                break
        if i < gamma - 1:
            t = time.perf_counter()
            logits = step(x, i)
            times.append(time.perf_counter() - t)
    return Proposal.chain(
        tokens, torch.stack(qs) if qs else None, signals=torch.stack(sigs) if sigs else None
    )


def _fit_vocab(logits: torch.Tensor, v: int | None) -> torch.Tensor:
    """Logits (..., V') over the target's vocabulary (V): cut, or padded with -inf."""
    if v is None or logits.shape[-1] == v:
        return logits
    if logits.shape[-1] > v:
        return logits[..., :v]
    pad = logits.new_full((*logits.shape[:-1], v - logits.shape[-1]), float("-inf"))
    return torch.cat([logits, pad], dim=-1)


class BatchedDraftLM(BatchedProposer):
    """A draft LM drafting for every row of the batched decoder in one forward per step.

    The rows share one ragged KV cache (``models/ragged.py``): each forward feeds every row its
    own tokens at its own positions, left-padded, with an explicit mask. After verification a
    row keeps the columns of the drafted tokens it accepted (as the batch-1 proposer crops to
    them) and masks the rest. Its proposals are the batch-1 ``DraftLMProposer``'s
    (tests/test_batch.py). ``_evict`` is the hook a windowed drafter (the streaming
    self-draft) uses to drop columns before a row drafts."""

    def __init__(self, model: nn.Module, vocab_size: int | None = None):
        self.model, self.vocab_size = model, vocab_size
        self.cache = None
        self.valid: torch.Tensor | None = None
        self.fed: list[int] = []  # committed tokens each row's cache holds
        self.pending: tuple | None = None  # the last proposal, until rollback
        self.draft_calls = 0
        self.last_step_seconds = None

    @torch.no_grad()
    def _forward(self, cache, valid, feeds: list[list[int]], starts: list[int], device):
        """Feed ``feeds[b]`` at positions ``starts[b]..`` to every row; returns the logits at
        each row's last query (R, V) and the new ``valid``."""
        from ..ragged import additive_mask, causal_mask, left_padded

        ids, pos, real = left_padded(feeds, starts)
        allowed = causal_mask(valid, real)
        dtype = next(self.model.parameters()).dtype
        out = self.model(
            input_ids=ids.to(device),
            attention_mask=additive_mask(allowed, dtype)[:, None].to(device),
            position_ids=pos.to(device),
            **cache_kw(self.model, cache),
            use_cache=True,
            logits_to_keep=keep_last(ids.shape[1], device),
        )
        self.draft_calls += 1
        logits = _fit_vocab(out.logits[:, -1], self.vocab_size)
        return logits, torch.cat([valid, real.to(valid.device)], dim=1)

    def _start_rows(self, states: list[DecodeState]):
        """The newcomers' own cache (as the batch-1 proposer's ``start``): their sequences but
        the last token prefilled. Returns (cache, valid, fed)."""
        from ..ragged import new_cache, prefill_in_groups, prefill_waste

        dev = states[0].device
        feeds = [s.ids[:-1] for s in states]

        def prefill(g: list[int]):
            cache = new_cache(self.model.config)
            valid = torch.zeros(len(g), 0, dtype=torch.bool, device=dev)
            _, valid = self._forward(cache, valid, [feeds[i] for i in g], [0] * len(g), dev)
            return cache, valid

        cache, valid = prefill_in_groups([len(f) for f in feeds], prefill_waste(dev), prefill)
        return cache, valid, [len(f) for f in feeds]

    def join(self, states: list[DecodeState]) -> None:
        from ..ragged import join_rows

        cache, valid, fed = self._start_rows(states)
        self.fed.extend(fed)
        self.cache, self.valid = join_rows(self.cache, self.valid, cache, valid)

    def select(self, keep: list[int]) -> None:
        from ..ragged import keep_rows

        self.fed = [self.fed[i] for i in keep]
        if self.pending is not None:
            start, lens, drafted = self.pending
            self.pending = (start, [lens[i] for i in keep], [drafted[i] for i in keep])
        if not keep:
            self.pending = None
        self.cache, self.valid = keep_rows(self.cache, self.valid, keep)

    def _evict(self, states: list[DecodeState]) -> None:  # noqa: B027 (a no-op default)
        """Drop cache columns before the rows draft (a windowed drafter); none by default."""

    @torch.no_grad()
    def propose(self, states: list[DecodeState], gammas: list[int]) -> list[Proposal]:
        top = max(gammas, default=0)
        self.pending = None
        if top == 0:
            self.last_step_seconds = None
            return [Proposal([], []) for _ in states]
        self._evict(states)
        dev, sampling = states[0].device, states[0].sampling
        R = len(states)
        times: list[float] = []
        feeds = [s.ids[f:] for s, f in zip(states, self.fed, strict=True)]
        t = time.perf_counter()
        logits, self.valid = self._forward(self.cache, self.valid, feeds, self.fed, dev)
        if max(len(f) for f in feeds) <= 2:  # a long catch-up is not one more draft step
            times.append(time.perf_counter() - t)
        self.fed = [len(s.ids) for s in states]
        start = self.valid.shape[1]
        tokens: list[list[int]] = [[] for _ in range(R)]
        qs: list[list[torch.Tensor]] = [[] for _ in range(R)]
        for i in range(top):
            t = time.perf_counter()
            if sampling.greedy:
                xs = greedy_tokens(logits).tolist()
            else:
                q = warp(logits, sampling)
                xs = [0] * R
                for b in range(R):
                    if i < gammas[b]:  # each row from its own random stream
                        xs[b] = sample(q[b], states[b].generator)
                        qs[b].append(q[b])
            for b in range(R):
                if i < gammas[b]:
                    tokens[b].append(xs[b])
            if i < top - 1:
                starts = [f + i for f in self.fed]
                logits, self.valid = self._forward(
                    self.cache, self.valid, [[x] for x in xs], starts, dev
                )
            times.append(time.perf_counter() - t)
        self.last_step_seconds = sum(times) / len(times)
        self.pending = (start, [len(s.ids) for s in states], tokens)
        return [Proposal.chain(tokens[b], torch.stack(qs[b]) if qs[b] else None) for b in range(R)]

    def rollback(self, states: list[DecodeState], accepted: list[int]) -> None:
        """Each row keeps the columns of the drafted tokens it committed (read from
        ``states[b].ids``: the batched decoder may have dropped finished rows first) that its
        batch-1 proposer would have fed: all but its last drafted token. (The batch fed that
        one too, for rows that drafted fewer than the longest; it is fed again next time, so
        that each row's cache holds what its batch-1 cache holds.)"""
        from ..ragged import keep_columns, tidy

        if self.valid is None:
            return
        if self.pending is not None:
            start, lens, drafted = self.pending
            keeps = []
            for b, s in enumerate(states):
                a = 0
                while a < len(drafted[b]) and lens[b] + a < len(s.ids):
                    if s.ids[lens[b] + a] != drafted[b][a]:
                        break
                    a += 1
                k = min(a, len(drafted[b]) - 1) if drafted[b] else 0
                keeps.append(list(range(k)))
                self.fed[b] += k
            keep_columns(self.valid, start, keeps)
            self.pending = None
        self.valid = tidy(self.cache, self.valid)
