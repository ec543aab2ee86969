"""The decoding loop: B requests in flight, each accepting its own number of tokens.

One loop for batch 1 and batch B (``BatchDecoder.run``: admit, draft, verify, accept, book,
retire). The batch-1 decoder (``decoder.py``) runs it with one row on its own runner
(``batch_runner.SequenceRunner``) and adds what only batch 1 offers (lossy acceptance rules, a
side branch, a stop rule, recorded logits: the attributes ``_OneSequence`` sets); here it serves
a queue of requests the way a server does: up to ``batch_size`` rows decode together, a
finished row leaves at once and a waiting request takes its place (continuous batching: the
newcomers are prefilled in groups of similar lengths and joined to the running cache).

**Ragged acceptance without moving the cache ("holes").** The rows share one KV cache with a
boolean ``valid`` (B, L): the columns each row attends to. A verification forward appends
n = 1 + (largest proposal in the batch) columns to every row (a row with a shorter proposal pads
with masked tokens); afterwards each row keeps the columns of its last committed token and of
its accepted nodes and the rest become holes. Keys already carry their rotary position, so a
row's kept columns need be neither contiguous nor in order: nothing is copied at rollback, a
tree's accepted path included; a cache that is mostly holes is compacted once in a while. Every
forward gets an explicit mask and per-row position ids, so padding and holes never shift a
row's positions. The cache and the forwards over it are the target runner's
(``batch_runner.py``): transformers' ``DynamicCache`` (``compile=false``), or the lean forward
over a static cache of ``batch_size`` rows, captured as CUDA graphs per row bucket and width on
a GPU (``compile=auto``/``true``); this module is the loop, the same for both.

**Drafting.** A proposer that has a batched form (``Proposer.batched``: EAGLE chains and
EAGLE-2 trees, P-EAGLE, DFlash, Falcon chains, Medusa, draft LMs, the streaming self-draft)
drafts for every row in one forward per step (a tree: per level; P-EAGLE and DFlash: one per
iteration), over a ragged cache of its own; it reads a newcomer's sequence when the batch next
drafts, so while a policy decodes plain, newcomers cost it nothing. Any other proposer (n-gram
and prompt lookup, which cost no forward; Falcon's tree) is copied per row
(``Proposer.fresh``: same weights, its own caches and state) and drafts at batch 1. Verification, the cost that grows with the batch, is one forward. How many tokens
each row drafts is decided per iteration by a *policy*:

- ``fixed``: gamma (or the proposer's tree) every iteration;
- ``adaptive``: today's batch-1 gamma controller, one per request, blind to the batch;
- ``goodput`` (SmartSpec, Liu et al. 2024): one length for the whole batch, the one that
  maximises goodput = expected accepted tokens of all rows / predicted iteration time, with each
  request's acceptance tracked online and the step time from ``StepCostModel`` (a linear model
  of a forward's seconds in tokens and tokens x cache length, fitted to forwards timed on this
  machine and refitted as iterations run).

Exactness is per row: at T = 0 a row's output is its batch-1 greedy output (up to near-ties of
a k-token vs 1-token forward); at T > 0 each request has its own random stream (seeded by
``GenRequest.seed``), so what it samples does not depend on which requests share its batch.
"""

from __future__ import annotations

import math
import time
from collections import deque
from dataclasses import dataclass, field

import torch

from models.base import BatchedProposer, DecodeState, Proposal, Proposer
from models.ragged import prefill_waste
from models.sampling import Sampling
from models.target import GenRequest, Target

from .batch_checks import BatchError, check_batchable, side_branch_refusal
from .batch_runner import BatchRunner, choose_batch_runner
from .costs import StepCostModel, drafting_cost
from .policies import (
    POLICIES,
    GammaController,
    GoodputPolicy,
    TreeController,
    _Acceptance,
)
from .runner import RunnerError
from .stats import BatchStats, count_iteration, depths
from .timing import sync
from .verify import AcceptRule, accept_rows, samples_on_device, until_stop


@dataclass
class _Row:
    key: object
    prompt: list[int]
    state: DecodeState
    proposer: Proposer
    controller: object | None
    acc: _Acceptance
    new: list[int] = field(default_factory=list)
    t_admit: float = 0.0
    t_arrive: float = 0.0  # when the request arrived (the run's start + its ``arrival``)
    t_first: float | None = None  # when its first new token came out
    budget: int = 0  # the request's own max_new_tokens
    calls0: int = 0
    started: bool = False
    read: int = 0  # tokens of the sequence its drafter has read (0: none yet)
    fbuf: torch.Tensor | None = None  # room for the features, grown by doubling
    drafted: int = 0  # this iteration: tokens its proposer drafted (before a policy's cut)
    side: object | None = None  # this iteration's side branch (batch 1: lookahead's window)
    step_logits: list = field(default_factory=list)  # the target rows that chose its tokens

    def append_features(self, new: torch.Tensor) -> None:
        """Add target features for newly committed positions. ``state.features`` is a view
        of a buffer that doubles when full: a copy of the whole history per iteration and
        row (what ``torch.cat`` does) churns enough memory at batch 16 to slow the target's
        forwards by ~15% on a CPU."""
        f = self.state.features
        n = 0 if f is None else f.shape[0]
        k = new.shape[0]
        if (
            self.fbuf is None
            or n + k > self.fbuf.shape[0]
            or (f is not None and f.data_ptr() != self.fbuf.data_ptr())
        ):
            buf = new.new_empty(max(2 * (n + k), 64), *new.shape[1:])
            if n:
                buf[:n] = f
            self.fbuf = buf
        self.fbuf[n : n + k] = new
        self.state.features = self.fbuf[: n + k]


@dataclass
class _Run:
    """One ``BatchDecoder.run``'s moving parts: the requests waiting, the rows in flight (the
    first ``joined`` of them read by the batched drafter), the finished outputs."""

    queue: deque
    max_new_tokens: int
    stop_ids: set[int] | frozenset[int]
    rows: list[_Row] = field(default_factory=list)
    joined: int = 0
    done: dict = field(default_factory=dict)
    t0: float = field(default_factory=time.perf_counter)
    t_start: float = 0.0  # this iteration's drafter reading (prefill), in seconds
    on_done: object = None  # a data generator's hook (``run``): finished replies go there
    longest: int = 0  # tokens (and 8 spare) the caches hold for one request
    firsts: int = 0  # this iteration: rows that took their first token (the prefill's)


class BatchDecoder:
    """Continuous-batching speculative decoding of ``target`` with one proposer per row.

    ``proposer``: a template; each row gets ``proposer.fresh()``. ``policy``: fixed, adaptive or
    goodput (module docstring). ``run`` decodes a list of ``GenRequest`` and returns
    {key: new tokens}; ``stats`` holds the last run's ``BatchStats``."""

    def __init__(
        self,
        target: Target,
        proposer: Proposer,
        sampling: Sampling,
        batch_size: int,
        gamma: int = 4,
        policy: str = "fixed",
        calibrate: bool = True,
        cost: StepCostModel | None = None,
        admit: int = 1,
        compile: str = "auto",
        max_len: int = 2048,
        runner: BatchRunner | None = None,
        drafter: BatchedProposer | None = None,
        race: bool = False,
        rule: AcceptRule | None = None,
    ):
        if batch_size < 1:
            raise BatchError(f"batch_size={batch_size}: must be >= 1")
        if not 1 <= admit <= batch_size:
            raise BatchError(f"admit={admit}: must be between 1 and the batch size ({batch_size})")
        if gamma < 0:
            raise BatchError(f"gamma={gamma}: must be >= 0")
        if policy not in POLICIES:
            raise BatchError(f"policy {policy!r}: use one of {', '.join(POLICIES)}")
        if runner is None:
            check_batchable(target, proposer)
        self.target, self.template, self.sampling = target, proposer, sampling
        # exact: lenience and typical run at batch 1 only; ``race``: plain steps at T > 0 draw
        # by torch.multinomial (``AcceptRule.race``: what a resumable regeneration needs)
        self.rule = rule or AcceptRule(sampling, race=race)
        # what the proposers draft with: the target's sampling, or argmax drafts (point masses)
        self.draft_sampling = Sampling() if self.rule.draft == "greedy" else sampling
        self.batch_size, self.policy = batch_size, policy
        # waiting requests join once this many slots are free (each join is a prefill forward,
        # grouped by length, and a copy of the running cache)
        self.admit = admit
        self.tree = proposer.tree_depth is not None
        self.gamma = proposer.tree_depth if self.tree else gamma
        self.device = target.device
        self.prefill_waste = prefill_waste(self.device)
        self.layers = tuple(proposer.feature_layers)
        # the target's cache and forwards: transformers' ragged cache, or the static one
        # (CUDA graphs per row bucket and width on a GPU); ``compile`` as at batch 1. A
        # ``runner`` given is reused (one static cache and one set of graphs for a sweep's
        # decoders of one batch size)
        widest = 1 + (proposer.tree_nodes or self.gamma) if self.gamma else 1
        if runner is None:
            try:
                runner = choose_batch_runner(
                    compile,
                    target,
                    proposer,
                    self.layers,
                    batch_size,
                    widest,
                    self.prefill_waste,
                    max_len,
                )
            except RunnerError as e:
                raise BatchError(str(e)) from None
        elif runner.layers != self.layers or getattr(runner, "batch_size", batch_size) < batch_size:
            raise BatchError(
                f"runner for feature layers {runner.layers}: this draft reads {self.layers} "
                f"at batch {batch_size}"
            )
        self.runner: BatchRunner = runner
        # the batched drafter on fixed shapes where the runner's graphs run (given: shared by a
        # sweep's decoders of one batch size), its graphs captured now, before any timing
        self.fixed_drafter = drafter
        graphs = getattr(runner, "graphs", "off")
        if drafter is None and graphs != "off" and self.gamma:
            self.fixed_drafter = proposer.batched_fixed_shape(batch_size, self.gamma, graphs)
        if self.fixed_drafter is not None:
            self.fixed_drafter.prepare(self.draft_sampling)
        self.t_verify1: list[float] | None = None
        if policy == "adaptive" and self.gamma and calibrate:
            # today's controller, as at batch 1: the cost of each verification size for one
            # row, on this decoder's own forward
            ks = range(1, self.gamma + 2)
            med = runner.verify_costs(1, ks, 256, reps=5)
            self.t_verify1 = [med[k] for k in ks]
        self.cost = cost
        if policy == "goodput" and self.gamma:
            if self.cost is None:
                self.cost = (
                    StepCostModel.for_proposer(runner, proposer, gamma, batch_size)
                    if calibrate
                    else StepCostModel()
                )
        # a drafter that drafts for all rows in one forward per step, where the proposer has one
        self.batched_drafting = proposer.batched() is not None
        self.bp = None
        if (
            policy == "goodput"
            and self.gamma
            and calibrate
            and not proposer.free
            and self.cost.read_s_per_token is None
        ):
            (
                self.cost.read_s_fixed,
                self.cost.read_s_per_token,
                self.cost.draft_step_s,
            ) = drafting_cost(self)
        self.goodput = (
            GoodputPolicy(
                self.gamma,
                self.cost,
                proposer.parallel,
                tree=self.tree,
                batched=self.batched_drafting,
                tree_nodes=proposer.tree_nodes,
            )
            if policy == "goodput" and self.gamma
            else None
        )
        if type(proposer).side_branch is not Proposer.side_branch and not (
            runner.carries_side_branches
        ):
            raise BatchError(side_branch_refusal(proposer))
        # what only batch 1 asks of the loop (``decoder._OneSequence`` sets them): the target
        # rows that chose each token (``logits``: {key: rows} of the last run), acceptance
        # traces and a learned stop rule (both read the draft's signals, ``signals``)
        self.sides = type(proposer).side_branch is not Proposer.side_branch
        self.record_logits = False
        self.traces: list | None = None
        self.stop_rule = None
        self.signals = False
        self.logits: dict = {}
        self.stats = BatchStats()

    # -- helpers -------------------------------------------------------------------------

    def _drafter(self):
        """The batched drafter for a run, with no rows: on the static runner's graphs the
        proposer's fixed-shape one where it has one (built once, its graphs kept from run to
        run), else a fresh ``batched()`` (None: the proposer drafts row by row)."""
        if self.fixed_drafter is not None:
            self.fixed_drafter.reset()
            return self.fixed_drafter
        return self.template.batched()

    def _controller(self):
        if self.policy != "adaptive" or not self.gamma:
            return None
        t = self.t_verify1 or [1.0 + 0.01 * k for k in range(self.gamma + 1)]
        if self.tree:
            return TreeController(self.gamma, True, t[0])
        return GammaController(self.gamma, True, t, parallel=self.template.parallel)

    # -- the loop: its phases ------------------------------------------------------------

    @torch.no_grad()
    def run(
        self,
        requests: list[GenRequest],
        max_new_tokens: int,
        stop_ids: set[int] | frozenset[int] = frozenset(),
        progress=None,
        on_done=None,
        should_stop=None,
        longest: int | None = None,
    ) -> dict:
        """Decode every request; ``progress(n)`` is called with each finished request's token
        count (a progress bar's update). Each iteration: admit waiting requests, draft for
        the rows, verify every row in one forward, let each row accept its own, book the
        iteration (the policies' measures, the statistics), retire the finished rows.

        A data generator's hooks (``flow/regenerate.py``): ``on_done(key, reply,
        truncated)`` gets each finished reply (its stop token left out) and whether it ran to
        its budget, and may return new requests, served next (a conversation's next turn);
        once ``should_stop()`` says True no waiting request starts and the rows in flight
        finish (a time budget). ``longest``: the most tokens (prompt and reply) a request
        may reach, where later requests come from ``on_done`` (the caches are sized for it
        before the first forward)."""
        for r in requests:
            self._check_request(r)
        self.stats = BatchStats()
        self.logits = {}
        self.bp = self._drafter()  # for this run (None: row-by-row drafting)
        longest = max(
            max((len(r.prompt) + r.budget(max_new_tokens) for r in requests), default=0),
            longest or 0,
        )
        longest += 8
        self._reserve_drafters(longest)
        self.runner.reset()
        self.runner.reserve(longest)
        # in order of arrival (all at 0: the given order)
        run = _Run(deque(sorted(requests, key=lambda r: r.arrival)), max_new_tokens, stop_ids)
        run.on_done, run.longest = on_done, longest
        while run.queue or run.rows:
            if run.queue and should_stop is not None and should_stop():
                run.queue.clear()  # no one else starts; the rows in flight finish
                if not run.rows:
                    break
            self._admit(run)
            length = self.runner.columns
            props, t_draft, step_times = self._draft(run, length)
            logits, feats, side_logits, t_verify = self._verify(run, props, length)
            finished, tested, accepted = self._accept(
                run, props, logits, feats, side_logits, t_draft, t_verify
            )
            self._book(run, props, length, t_draft, t_verify, step_times, tested, accepted)
            self._retire(run, finished, progress)
        st = self.stats
        st.wall = time.perf_counter() - run.t0
        st.rows.t_total = st.wall
        if self.bp is not None:
            st.rows.draft_calls += self.bp.draft_calls
        return run.done

    # -- what a row is made of (batch 1 keeps one proposer, controller and stream) -----------

    #: at T > 0, whether every row's rejection sampling runs on the device with one read for
    #: the batch (``verify.sampled_on_device``) or row by row on the host; None: on the
    #: device where the logits are on a GPU (there a host test reads the device each time)
    sample_on_device: bool | None = None

    #: whether a row's proposer reads its prompt when the row is admitted (batch 1: its
    #: prefill then, as timed prefill) rather than when it first drafts
    start_at_admission = False

    def _row_parts(self, request: GenRequest):
        """A new row's proposer (a fresh copy of the template: its own caches and state), its
        controller (``adaptive``: a gamma or tree controller of its own; else None) and its
        random stream (at T > 0, seeded by the request: what it samples does not depend on the
        rows beside it; None at T = 0)."""
        gen = None
        if not self.sampling.greedy:
            gen = torch.Generator(device=self.device).manual_seed(int(request.seed))
        return self.template.fresh(), self._controller(), gen

    def _reserve_drafters(self, longest: int) -> None:
        """The drafter's static buffers sized for rows of ``longest`` tokens, before a run."""
        if self.bp is not None:
            self.bp.reserve(longest)

    @staticmethod
    def _check_request(r: GenRequest) -> None:
        if not r.prompt:
            raise BatchError(f"request {r.key!r}: empty prompt")
        if not (r.arrival >= 0 and math.isfinite(r.arrival)):
            raise BatchError(f"request {r.key!r}: arrival={r.arrival} (seconds >= 0)")

    def _admit(self, run: _Run) -> None:
        """Waiting requests that have arrived take the free slots (once ``admit`` of them are
        free, or at once when no row runs): the runner prefills them, each becomes a row. With
        nothing to decode, wait for the next arrival."""
        st, queue = self.stats, run.queue
        if not queue:
            return
        free = self.batch_size - len(run.rows)
        now = time.perf_counter() - run.t0
        if not run.rows and queue[0].arrival > now:  # nothing to decode until the next arrives
            time.sleep(queue[0].arrival - now)
            st.idle += time.perf_counter() - run.t0 - now
            now = time.perf_counter() - run.t0
        arrived = 0  # the requests waiting now (the queue is in order of arrival)
        while arrived < len(queue) and queue[arrived].arrival <= now:
            arrived += 1
        if not (arrived and free and (not run.rows or free >= min(self.admit, arrived))):
            return
        reqs = [queue.popleft() for _ in range(min(free, arrived))]
        t = time.perf_counter()
        order, feats, views = self.runner.admit([r.prompt[:-1] for r in reqs])
        reqs = [reqs[i] for i in order]  # as the runner holds them
        sync(self.device)
        st.rows.t_prefill += time.perf_counter() - t
        st.prefills += 1
        for r, f, view in zip(reqs, feats, views, strict=True):
            prop, ctl, gen = self._row_parts(r)
            state = DecodeState(
                ids=list(r.prompt),
                features=f,
                sampling=self.draft_sampling,
                generator=gen,
                device=self.device,
                signals=self.signals,
                stop=self.stop_rule,
                prefill_cache=view,
            )
            acc = self.goodput.new_request() if self.goodput else _Acceptance()
            # its proposer starts when the row first drafts; a batched drafter reads the
            # newcomers' prompts when the batch next drafts (``_join_drafter``): while the
            # policy decodes plain, newcomers cost it nothing
            row = _Row(
                r.key,
                list(r.prompt),
                state,
                prop,
                ctl,
                acc,
                t_admit=time.perf_counter(),
                t_arrive=run.t0 + r.arrival,
                budget=r.budget(run.max_new_tokens),
                calls0=prop.draft_calls,
            )
            run.rows.append(row)
            if self.start_at_admission:
                dt = self._start_row(row)
                st.rows.t_prefill += dt
                st.rows.t_draft_start += dt

    def _draft(self, run: _Run, length: int) -> tuple[list[Proposal], float, list]:
        """How much each row drafts (the policy) and its proposal. Returns the proposals, the
        drafting seconds (a drafter's reading of newcomers counted as prefill instead) and
        the draft steps' own timings."""
        rows, st = run.rows, self.stats
        # a request's first token is the prefill's (as engines start a request): nothing is
        # drafted for it; drafting starts from the second, after a reply token (where heads
        # that read the target's features were trained)
        limits = [r.budget - len(r.new) - 1 if r.new else 0 for r in rows]
        props: list[Proposal] = []
        run.t_start = 0.0
        t = time.perf_counter()
        step_times: list[float] = []
        gs: list[int] | None = None  # per-row lengths for a drafter sized before drafting
        if self.goodput is not None:
            caps = [max(0, min(self.gamma, lim)) for lim in limits]
            if self.template.free:  # a lookup drafts first; the policy sizes it
                found = [
                    self._propose(run, r, c) if c else Proposal([], [])
                    for r, c in zip(rows, caps, strict=True)
                ]
                for r, f in zip(rows, found, strict=True):
                    r.drafted = len(f)
                caps = [min(c, len(p)) for c, p in zip(caps, found, strict=True)]
            unread = (
                0
                if self.template.free
                else sum(max(0, len(r.state.ids) - 1 - r.read) for r in rows)
            )
            # no request waiting: the batch drains, its time set by its last rows
            remaining = [r.budget - len(r.new) for r in rows] if not run.queue else None
            g = self.goodput.choose([r.acc for r in rows], caps, length, unread, remaining)
            st.probes += self.goodput.probing
            if self.template.free:
                props = [f.truncated(min(g, c)) for f, c in zip(found, caps, strict=True)]
            else:
                gs = [min(g, c) if not self.tree else (c if g else 0) for c in caps]
        elif self.template.free:
            for r, lim in zip(rows, limits, strict=True):
                cap = max(0, min(self.gamma, lim))
                ctl = r.controller
                p = self._propose(run, r, cap) if cap else Proposal([], [])
                r.drafted = len(p)
                gg = ctl.choose(len(p), p.bucket) if (ctl and len(p)) else len(p)
                props.append(p.truncated(gg))
        else:
            gs = []
            for r, lim in zip(rows, limits, strict=True):
                cap = max(0, min(self.gamma, lim))
                gs.append(r.controller.choose(cap) if r.controller else cap)
        if gs is not None and self.bp is not None:
            if max(gs, default=0):
                self._join_drafter(run)
                props = self.bp.propose([r.state for r in rows], gs)
                for r, p in zip(rows, props, strict=True):  # it caught every row up
                    r.read = len(r.state.ids) - 1
                    r.drafted = len(p)
                if self.bp.last_step_seconds is not None:
                    step_times.append(self.bp.last_step_seconds)
            else:
                props = [Proposal([], []) for _ in rows]
                for r in rows:
                    r.drafted = 0
        elif gs is not None:
            for r, gg in zip(rows, gs, strict=True):
                props.append(self._propose(run, r, gg) if gg else Proposal([], []))
                r.drafted = len(props[-1])
                if gg:
                    r.read = len(r.state.ids) - 1
                self._step_time(r, props[-1], step_times)
        if self.sides:  # batch 1: a proposer's side branch, in iterations that draft
            chosen = gs if gs is not None else [len(p) for p in props]
            for r, g in zip(rows, chosen, strict=True):
                r.side = r.proposer.side_branch(r.state) if (g > 0 or r.drafted) else None
        sync(self.device)
        st.rows.t_prefill += run.t_start
        return props, time.perf_counter() - t - run.t_start, step_times

    def _verify(self, run: _Run, props: list[Proposal], length: int):
        """One forward for the batch: each row's last committed token and its proposal (a
        chain, or a tree with its ancestor mask), padded to the longest, and at batch 1 a
        side branch. Returns the logits, the features, the side branches' logits and its
        seconds."""
        rows = run.rows
        self.stats.cache_columns += len(rows) * length
        self.stats.valid_columns += self.runner.valid_columns()
        inputs = self.runner.inputs([r.state.ids for r in rows], props, [r.side for r in rows])
        t = time.perf_counter()
        logits, feats, side_logits = self.runner.verify_rows(inputs)
        sync(self.device)
        return logits, feats, side_logits, time.perf_counter() - t

    def _accept(
        self, run: _Run, props, logits, feats, side_logits, t_draft: float, t_verify: float
    ):
        """Each row accepts its own (``verify.accept``: greedy or exact rejection sampling;
        at batch 1 also lenient or typical), emits its tokens up to a stop token, its proposer
        rolls back, and its controller and acceptance tracker learn; the runner keeps the
        accepted entries. Returns the finished rows and the tokens tested and accepted."""
        rows, st = run.rows, self.stats
        rule = self.rule
        gens = [r.state.generator for r in rows]
        on_device = self.sample_on_device
        if on_device is None:
            on_device = logits.is_cuda
        outcomes = accept_rows(rule, props, logits, gens, on_device)
        # rows taking their first token (nothing drafted: ``_draft``): the prefill's, booked
        # as prefill, not as a verification (``Stats.first_tokens``)
        firsts = [not r.new for r in rows]
        run.firsts = sum(firsts)
        if on_device and samples_on_device(rule, props):
            st.rows.sampled_on_device += len(rows) - run.firsts
        keeps: list[list[int]] = []
        finished: list[int] = []
        it_tested = it_accepted = 0
        drafted_all = sum(r.drafted for r in rows)
        for b, (r, p) in enumerate(zip(rows, props, strict=True)):
            got = outcomes[b]
            verdict = got.verdict
            first = firsts[b]
            path = verdict.path
            keep = [0] + [i + 1 for i in path]
            keeps.append(keep)
            if self.record_logits:  # the target rows that decided each emitted token
                r.step_logits.extend(logits[b, keep].float().cpu())
            emitted = until_stop([p.tokens[i] for i in path] + [verdict.token], run.stop_ids)
            # a proposal deeper than asked (a Falcon tree drafts whole k-token blocks) can
            # accept past the request's budget: what lies past it is neither emitted nor
            # counted (its positions were not the request's to test); a budget of 0 (a
            # warm-up of no tokens) still takes its one forward's token, left out at retirement
            room = max(1, r.budget - len(r.new))
            over = len(emitted) > room
            if over:
                emitted = emitted[:room]
            counted = path[:room] if over else path
            r.state.ids.extend(emitted)
            r.new.extend(emitted)
            if got.tvd is not None:  # a lossy rule: how far each emitted token moved
                st.rows.tvd_sum += sum(got.tvd[: len(emitted)])
                st.rows.tvd_tokens += len(emitted)
            st.rows.off_argmax += got.off_argmax
            if r.started and self.bp is None:
                r.proposer.rollback(r.state, len(path))
            if r.side is not None:
                r.proposer.side_logits(r.state, side_logits[b])
            if self.traces is not None and p.signals is not None and len(p):
                self.traces.append(
                    {
                        "signals": [[round(v, 6) for v in x] for x in p.signals.tolist()],
                        "accepted": len(path),
                        "drafted": len(p),
                    }
                )
            tested = 0 if first else count_iteration(st.rows, p, counted, ended=over)
            it_tested += tested
            it_accepted += len(counted)
            # a tree proposer's every tree counts as one, a chain-shaped one too (a tree
            # sized by min_prob is a chain where the draft is sure: counting only the
            # branching ones would count its doubts alone)
            as_tree = bool(p.tokens) and (self.tree or not p.is_chain)
            r.acc.update(tested, len(counted), as_tree)
            if self.goodput is not None and as_tree:
                self.goodput.saw_row_tree(len(counted))
            # a draft step's seconds: the drafter's own measure where it has one (catching up
            # on tokens committed while it was idle left out), else drafting time per token
            if self.bp is not None:
                step = self.bp.last_step_seconds
            elif r.proposer.measures_steps:
                step = r.proposer.last_step_seconds
            else:
                step = t_draft / drafted_all if r.drafted else None
            if step is not None and len(p):
                st.rows.step_seconds_sum += step
                st.rows.step_samples += 1
            if r.controller is not None and not first:
                # an iteration that carried a side branch cost more than a plain step even
                # with nothing drafted: a controller must not book it as plain decoding
                g_used = len(p) if r.side is None else max(1, len(p))
                r.controller.update(
                    g_used,
                    tested,
                    len(counted),
                    step,
                    t_verify,
                    p.bucket,
                    t_draft=t_draft / len(rows),
                )
            if emitted[-1] in run.stop_ids or len(r.new) >= r.budget:
                finished.append(b)
        if feats is not None:  # every row's kept features in one gather
            for r, f in zip(rows, kept_rows(feats, keeps), strict=True):
                r.append_features(f)
        self.runner.keep(keeps)
        return finished, it_tested, it_accepted

    def _book(self, run: _Run, props, length, t_draft, t_verify, step_times, tested, accepted):
        """The iteration's measures for the goodput policy and its cost model, and the run's
        statistics."""
        st, R = self.stats, len(run.rows)
        n = 1 + max(len(p) for p in props)
        if self.goodput is not None:
            self.cost.observe(R, n, length, t_verify)
            clean = [s for s in step_times if s is not None]
            steps = sum((1 if self.template.parallel else max(depths(p), default=0)) for p in props)
            if self.bp is not None:  # one step drafts for every row
                steps = max((len(p) for p in props), default=0)
            if not clean and steps:  # a proposer without its own measure: time / steps
                clean = [t_draft / steps]
            self.goodput.update(
                sum(clean) / len(clean) if clean else None,
                tested,
                accepted,
                # a probe also pays for the drafter reading the rows that joined since it
                # last drafted (``run.t_start``, counted as prefill in the report)
                iteration_seconds=t_draft + t_verify + run.t_start,
            )
            if self.tree and n > 1:
                self.goodput.saw_tree(n - 1)
        if R == run.firsts == 1:  # batch 1, the request's first token: the prefill's forward
            st.rows.t_prefill += t_verify + t_draft
        else:
            st.rows.t_target += t_verify
            st.rows.t_draft += t_draft
        st.forwards += 1
        st.drain_forwards += not run.queue
        st.row_slots += R
        st.verified_tokens += R * n
        st.batch_gamma[n - 1] += 1

    def _retire(self, run: _Run, finished: list[int], progress) -> None:
        """Finished rows leave (their tokens and latencies recorded); the runner and the
        batched drafter keep the rest, and tidy their caches."""
        st, rows = self.stats, run.rows
        now = time.perf_counter()
        for r in rows:
            if r.t_first is None and r.new:
                r.t_first = now
        if finished:
            for b in finished:
                r = rows[b]
                out_tokens = r.new[: r.budget]
                run.done[r.key] = out_tokens
                if self.record_logits:
                    self.logits[r.key] = r.step_logits[: len(out_tokens)]
                st.rows.new_tokens += len(out_tokens)
                st.rows.first_tokens += bool(out_tokens)
                if self.bp is None:
                    st.rows.draft_calls += r.proposer.draft_calls - r.calls0
                st.requests.append((len(out_tokens), now - r.t_admit))
                st.latencies.append((r.t_first - r.t_arrive, now - r.t_arrive, len(out_tokens)))
                if progress is not None:
                    progress(1)
                if run.on_done is not None:
                    self._hand_over(run, r.key, out_tokens)
            keep = retire_order(len(rows), finished, run.joined if self.bp is not None else 0)
            run.rows = [rows[b] for b in keep]
            self.runner.retire(keep)
            if self.bp is not None:
                kept = [b for b in keep if b < run.joined]
                self.bp.select(kept)
                run.joined = len(kept)
            if not run.rows:
                return
        if self.bp is not None:
            self.bp.rollback([r.state for r in run.rows[: run.joined]], [])
        self.runner.tidy()

    def _hand_over(self, run: _Run, key, tokens: list[int]) -> None:
        """A finished reply to ``on_done`` (its stop token left out; truncated: it ran to its
        budget), and the requests it returns queued first."""
        stopped = bool(tokens) and tokens[-1] in run.stop_ids
        follow = list(run.on_done(key, tokens[:-1] if stopped else tokens, not stopped) or ())
        for nxt in reversed(follow):
            self._check_request(nxt)
            if len(nxt.prompt) + nxt.budget(run.max_new_tokens) + 8 > run.longest:
                raise BatchError(
                    f"request {nxt.key!r}: {len(nxt.prompt)} prompt tokens and a budget of "
                    f"{nxt.budget(run.max_new_tokens)}: past the run's longest={run.longest - 8}"
                )
            run.queue.appendleft(nxt)

    def _join_drafter(self, run: _Run) -> None:
        """Let the batched drafter read the rows it has not seen (``rows[joined:]``) before
        the batch drafts: its prefill of their prompts and of what they decoded since, counted
        as prefill, as a row-by-row proposer's start (``_propose``)."""
        rows, joined = run.rows, run.joined
        if joined < len(rows):
            t = time.perf_counter()
            self.bp.join([r.state for r in rows[joined:]])
            for r in rows[joined:]:
                r.state.prefill_cache = None  # read once: the batch's prefill can go
            dt = time.perf_counter() - t
            run.t_start += dt
            if self.goodput is not None:  # what reading costs, for pricing the next probe
                self.goodput.saw_reading(sum(len(r.state.ids) - 1 for r in rows[joined:]), dt)
        run.joined = len(rows)

    def _propose(self, run: _Run, r: _Row, g: int) -> Proposal:
        """Row ``r``'s proposal of ``g`` tokens. A row's proposer starts (reads the sequence
        so far: a draft model's or head's prefill) when the row first drafts, so rows that
        never draft (a policy that chose 0 all along) never pay for it; that time counts as
        prefill, not drafting."""
        if not r.started:
            dt = self._start_row(r)
            run.t_start += dt
            if self.goodput is not None:
                self.goodput.saw_reading(len(r.state.ids) - 1, dt)
        return r.proposer.propose(r.state, g)

    def _start_row(self, r: _Row) -> float:
        """Row ``r``'s proposer reads the sequence so far (its prefill); returns the seconds."""
        t = time.perf_counter()
        r.proposer.start(r.state)
        r.state.prefill_cache = None
        r.started = True
        sync(self.device)
        return time.perf_counter() - t

    @staticmethod
    def _step_time(row: _Row, p: Proposal, out: list) -> None:
        if len(p) and row.proposer.measures_steps:
            out.append(row.proposer.last_step_seconds)


def retire_order(rows: int, finished: list[int], joined: int = 0) -> list[int]:
    """The rows that stay once ``finished`` leave, in their new order: ``keep[i]`` is the row
    that takes slot i. A survivor keeps its slot where it can and the slots freed are filled
    from the end, so a cache moves about as many rows as left (keeping the order would move
    every row after the first to leave: at 512 rows, most of the cache at most steps). The
    first ``joined`` rows (those a batched drafter has read) stay the first."""
    gone = set(finished)
    keep: list[int] = []
    for group in (range(0, joined), range(joined, rows)):
        stay = [b for b in group if b not in gone]
        slots = range(len(keep), len(keep) + len(stay))
        # survivors already in the group's slots stay put; the others fill its free slots
        movers = iter([b for b in stay if b not in slots])
        keep += [i if (i in group and i not in gone) else next(movers) for i in slots]
    return keep


def kept_rows(feats: torch.Tensor, keeps: list[list[int]]) -> list[torch.Tensor]:
    """Each row's kept positions of ``feats`` (R, n, ...) by ``keeps`` (row b keeps
    ``keeps[b]``): one gather for the batch, split into views."""
    R, n = feats.shape[:2]
    if R == 1:  # batch 1: a view where every position is kept, else one gather
        (ks,) = keeps
        return [feats[0, : len(ks)] if ks == list(range(len(ks))) else feats[0, ks]]
    flat = [b * n + k for b, ks in enumerate(keeps) for k in ks]
    idx = torch.tensor(flat).to(feats.device, non_blocking=True)
    got = feats.reshape(R * n, *feats.shape[2:]).index_select(0, idx)
    return list(got.split([len(ks) for ks in keeps]))
