"""The speculative decoder at batch 1: any proposer, every acceptance rule.

Its loop is the batched decoder's (``batch.py``: admit, draft, verify, accept, book, retire),
run with one row (``_OneSequence``): one decoding core for batch 1 and batch B. What batch 1
adds is set up here: the one-sequence runner (``runner.py``: transformers' dynamic cache, or
the static cache at fixed widths, captured as CUDA graphs on a GPU; a tree's accepted path is
moved into place instead of left as holes), the proposer on fixed shapes where graphs run and
kept from prompt to prompt with its graphs, one gamma or tree controller that learns across
prompts (``policies.py``), one random stream for every call, and what only batch 1 offers:
lossy acceptance rules (lenience, typical acceptance) with their measured TVD, a proposer's
side branch (lookahead's Jacobi window), a learned stop rule and acceptance traces, and the
target rows that chose each token (``record_logits``).

Invariant between iterations: the target's KV cache holds every committed token but the last;
the last committed token is fed together with the draft in the next verification forward. So
each iteration is exactly one target forward (plain decoding: one token fed, gamma = 0), and
tau = emitted tokens / verification forwards is 1 for plain decoding. The prompt's prefill is a
separate forward, not counted in tau (and timed separately).
"""

from __future__ import annotations

import torch

from models.base import DecodeState, Proposal, Proposer
from models.sampling import Sampling
from models.target import GenRequest, Target

from .batch import BatchDecoder
from .batch_runner import SequenceRunner
from .policies import GammaController, TreeController
from .runner import Layout, RunnerError, StaticRunner, TargetRunner, choose_runner
from .stats import Stats
from .timing import interleaved_medians
from .verify import AcceptRule


class NoDraft(Proposer):
    """Plain autoregressive decoding through the same loop (gamma is always 0)."""

    name = "none"

    def propose(self, state: DecodeState, gamma: int) -> Proposal:
        return Proposal([], [])


class SpeculativeDecoder:
    """Batch-size-1 speculative decoding of ``target`` with any proposer.

    ``generate`` returns the new tokens; ``stats`` accumulates counters over calls, ``last``
    holds the last call's. The loop is the batched decoder's (``_OneSequence``), with one row.
    """

    def __init__(
        self,
        target: Target,
        proposer,
        sampling: Sampling,
        gamma: int = 4,
        adaptive: bool = True,
        seed: int = 0,
        calibrate: bool = True,
        acceptance: str = "exact",
        typical_epsilon: float = 0.09,
        typical_delta: float = 0.3,
        record_logits: bool = False,
        lenience: float = 1.0,
        stop_rule=None,
        traces: list | None = None,
        compile: str = "auto",
        max_len: int = 2048,
        draft_sampling: str = "sample",
    ):
        """``acceptance``: ``exact`` (speculative sampling: the output follows the target
        exactly), ``block`` (block verification of chains at T > 0: exact too, Sun et al.) or
        ``typical`` (Medusa's typical acceptance at T > 0 with ``typical_epsilon``
        and ``typical_delta``: longer accepted runs, but the output distribution moves; the
        per-token TVD is measured in ``stats``). Greedy decoding (T = 0) is exact either way.

        ``lenience`` l in (0, 1]: 1 is exact; below 1 a drafted x is accepted with probability
        min(1, p(x) / (l q(x))) at T > 0 (chains only; the per-token TVD from the target is
        measured in ``stats``), and when p(x) >= l * max p at T = 0 (``stats.off_argmax``
        counts accepted tokens that are not the argmax). NOT lossless below 1.

        ``stop_rule``: a learned rule (DISCO, ``decoding.disco.DiscoStop``) that the proposer
        consults after each drafted token of a chain, stopping the draft early where it
        predicts a rejection; it decides only how many tokens are drafted, so the output
        distribution is the target's whatever it says. ``traces``: a list that receives, per
        drafting iteration, the draft's signals for each drafted token and how many were
        accepted (what the stop rule is trained on).

        ``compile``: the target's forward (``decoding/runner.py``): ``true`` the lean forward
        over a static cache at fixed widths (CUDA graphs on a GPU), ``false`` transformers'
        forward over its dynamic cache, ``auto`` the first wherever it runs (``self.runner.kind``
        says which ran), ``fused`` the first with each layer's elementwise ops compiled by
        torch.compile. ``max_len``: the static cache's columns allocated up front.

        ``draft_sampling``: at T > 0, ``sample`` (drafts drawn from the draft's q and tested
        with it) or ``greedy`` (the draft's argmax, tested as a point mass: exact as well; what
        vLLM serves by default). T = 0 drafts greedily either way."""
        if gamma < 0:
            raise ValueError(f"gamma={gamma}: must be >= 0")
        if acceptance not in ("exact", "typical", "block"):
            raise ValueError(f"acceptance={acceptance!r}: use exact, block or typical")
        if draft_sampling not in ("sample", "greedy"):
            raise ValueError(f"draft_sampling={draft_sampling!r}: use sample or greedy")
        if not 0.0 < lenience <= 1.0:
            raise ValueError(f"lenience={lenience}: must be in (0, 1] (1: exact)")
        if lenience < 1.0 and acceptance == "typical":
            raise ValueError(
                f"lenience={lenience} with acceptance=typical: two lossy acceptance rules at "
                "once; use one"
            )
        if not isinstance(proposer, Proposer):
            raise TypeError(
                f"{type(proposer).__name__} is not a models.base.Proposer (the decoder's contract)"
            )
        tree = proposer.tree_depth is not None
        if (stop_rule is not None or traces is not None) and (not proposer.gives_signals or tree):
            what = "a learned stop rule" if stop_rule is not None else "acceptance traces"
            raise ValueError(
                f"{what} needs a drafter that reports its signals while drafting a chain "
                f"(EAGLE chains, draft LMs); {type(proposer).__name__}"
                f"{' (a tree)' if tree else ''} does not"
            )
        self.stop_rule, self.traces = stop_rule, traces
        if acceptance == "block" and tree and not sampling.greedy:
            raise ValueError("acceptance=block verifies chains: use tree=chain, or T = 0")
        if lenience < 1.0 and acceptance == "block":
            raise ValueError(f"lenience={lenience} with acceptance=block: use one")
        if lenience < 1.0 and tree and not sampling.greedy:
            raise ValueError(
                f"lenience={lenience} at T > 0 is implemented for chains (its TVD is exact "
                "there); use tree=chain, or T = 0"
            )
        # keep, for the last generate() call, the target's logits row that decided each new
        # token (``last_logits``): how a divergence between two decodings is classified
        self.record_logits = record_logits
        self.last_logits: list[torch.Tensor] | None = None
        self.target, self.proposer, self.sampling = target, proposer, sampling
        # how drafted tokens are accepted (``verify.accept``, the batched decoder's too)
        self.rule = AcceptRule(
            sampling, lenience, acceptance, (typical_epsilon, typical_delta), draft_sampling
        )
        self.device = target.device
        self.gamma = 0 if isinstance(proposer, NoDraft) else gamma
        # a proposer whose proposals gain from every drafting iteration (lookahead's pool) is
        # verified every iteration: a per-iteration controller would switch it off early
        adaptive = adaptive and proposer.adaptive
        self.adaptive = adaptive
        self.generator = torch.Generator(device=self.device).manual_seed(seed)
        self.layers = tuple(proposer.feature_layers)
        # the widest verification: a chain of gamma, a tree of its node budget (a proposer whose
        # trees have no fixed budget, or a side branch, runs wider forwards eagerly)
        widest = 1 + (proposer.tree_nodes or self.gamma) if self.gamma else 1
        try:
            self.runner: TargetRunner = choose_runner(
                compile, target, proposer, self.layers, (1, widest), max_len
            )
        except RunnerError as e:
            raise ValueError(str(e)) from None
        if isinstance(self.runner, StaticRunner):  # the drafter on fixed shapes too, if it can
            fast = proposer.fixed_shape(self.gamma, self.runner.graphs)
            if fast is not None:
                self.proposer = proposer = fast
        t_verify = (
            self._calibrate()
            if (calibrate and self.gamma and adaptive)
            else [1.0 + 0.01 * k for k in range(self.gamma + 1)]
        )
        if tree and self.gamma:
            self.controller = TreeController(self.gamma, adaptive, t_verify[0])
        else:
            self.controller = GammaController(
                self.gamma, adaptive, t_verify, parallel=proposer.parallel
            )
        self.stats = Stats()
        self.last = Stats()
        self._loop = _OneSequence(self)

    # -- target forwards ----------------------------------------------------------------

    def _calibrate(self, prefix: int = 256, reps: int = 5) -> list[float]:
        """Time target forwards over k + 1 tokens (k = 0..gamma) after a ``prefix``-token
        context. This is the real cost of each shape on this machine: where verifying 2-3
        tokens is slower than 5 (MKL's fp32 path for 2-3 rows on some CPUs), the controller
        sees it; in bf16 the table is flat (docs/benchmarks.md). Iterations keep refining it (a
        decayed average of measured verification times)."""
        return self.forward_costs(range(1, self.gamma + 2), prefix, reps)

    @torch.no_grad()
    def forward_costs(self, sizes, prefix: int = 256, reps: int = 5) -> list[float]:
        """Seconds of a target forward over each of ``sizes`` tokens after a ``prefix``-token
        context, in the target's own dtype: the median of ``reps`` after a warm-up, the sizes
        taken in turn within each repetition, so that a slow spell of the machine falls on
        every size alike instead of on one."""
        sizes = list(sizes)
        for n in sizes:
            if not 1 <= n <= prefix:
                raise ValueError(f"forward of {n} tokens: must be in [1, {prefix}]")
        vocab = self.target.config.vocab_size
        g = torch.Generator().manual_seed(0)
        ctx = torch.randint(0, vocab, (prefix,), generator=g).tolist()
        runner = self.runner
        runner.reserve(2 * prefix)

        def setup(n: int):
            runner.prefill(ctx)
            return lambda: runner.forward(Layout(ctx[0], Proposal.chain(ctx[1:n])))

        med = interleaved_medians(sizes, setup, self.device, reps)
        runner.reset()
        return [med[n] for n in sizes]

    # -- generation ---------------------------------------------------------------------

    @torch.no_grad()
    def generate(
        self,
        prompt: list[int],
        max_new_tokens: int,
        stop_ids: set[int] | frozenset[int] = frozenset(),
    ) -> list[int]:
        """Up to ``max_new_tokens`` new tokens after ``prompt`` (ending at a stop token):
        the decoding loop with this prompt as its one row."""
        if not prompt:
            raise ValueError("empty prompt")
        loop = self._loop
        if loop.runner.one is not self.runner:  # a runner swapped in since (tests, benches)
            loop.runner = SequenceRunner(self.runner)
        new = loop.run([GenRequest(0, list(prompt))], max_new_tokens, frozenset(stop_ids))[0]
        st = loop.stats.rows
        st.prefill_calls = 1 if len(prompt) > 1 else 0
        self.stats.merge(st)
        self.last = st
        self.last_logits = loop.logits.get(0) if self.record_logits else None
        return new


class _OneSequence(BatchDecoder):
    """The decoding loop (``BatchDecoder``'s) with one row, as ``SpeculativeDecoder`` runs
    it: the front's one-sequence runner, its proposer (started at admission, so its prompt is
    read as prefill, and kept with its caches and graphs from prompt to prompt), its
    controller and its random stream for every request, its acceptance rule, stop rule,
    traces and recorded logits."""

    start_at_admission = True

    def __init__(self, front: SpeculativeDecoder):
        self.front = front
        super().__init__(
            front.target,
            front.proposer,
            front.sampling,
            batch_size=1,
            gamma=front.gamma,
            calibrate=False,
            runner=SequenceRunner(front.runner),
            rule=front.rule,
        )
        self.gamma = front.gamma  # a tree is drafted as deep as the front's controller says
        self.record_logits = front.record_logits
        self.traces, self.stop_rule = front.traces, front.stop_rule
        self.signals = front.stop_rule is not None or front.traces is not None

    def _row_parts(self, request: GenRequest):
        f = self.front
        return f.proposer, f.controller, f.generator

    def _drafter(self):
        return None  # the row's own proposer drafts (a fixed-shape one where graphs run)

    def _reserve_drafters(self, longest: int) -> None:
        self.front.proposer.reserve(longest)
