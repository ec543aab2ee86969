"""What a decoding run reports and how it is shown: the conventions behind tau and alpha, one
row of figures from two runs' statistics (``stats_row``), whether greedy outputs that part are
near-ties (``classify_divergence``), and the printed tables and plots of ``specdraft-eval``
(batch 1, batch sweeps, arrival rates). Nothing here decodes."""

from __future__ import annotations

import json
import math
from collections import Counter
from pathlib import Path
from typing import Any

import torch

from .contention import busy_note
from .engines.base import same_text_note
from .stats import Stats, predicted_speedup

CONVENTION = (
    "tau = tokens emitted per target verification forward, counting the corrected/bonus token "
    "(plain decoding has tau = 1); a request's first token is the prompt's prefill's, drafted by "
    "no one, and it and its forward are not counted (as vLLM's mean acceptance length). "
    "alpha = accepted draft tokens / tested draft tokens, a draft token at position k being "
    "tested when positions 1..k-1 were accepted (the per-token acceptance probability of the speedup formula); "
    "alpha_per_position[k-1] = P(position k accepted | positions 1..k-1 accepted). "
    "draft_acceptance_rate = accepted / drafted tokens (vLLM's convention). tau and alpha pool "
    "all tokens of all prompts (not a mean of per-prompt means)."
)


# Greedy speculative and plain decoding may part where two tokens' logits are (nearly) tied: a
# forward over k tokens rounds differently from a forward over one. A divergence is a near-tie
# when, in plain decoding's own logits at that point, the two tokens are within this many
# logits of each other; anything wider is a real divergence (a bug). The bf16 figure covers
# what the embedded target's 1-token vs k-token forwards were measured to differ by
# (docs/benchmarks.md), with margin; fp32 differences are ~1e-5.
NEAR_TIE_TOLERANCE = {torch.float32: 1e-3, torch.bfloat16: 0.5, torch.float16: 0.1}


def adaptive_chain(r: dict) -> bool:
    """Whether the gamma controller sized the report's chains (not an engine's run, nor a stop
    rule that replaces it)."""
    st = r["settings"]
    d = r.get("decoder") or {}
    if "adaptive" in d:  # what the built-in decoder ran (lookahead drafts every iteration)
        return bool(d["adaptive"]) and not r.get("engine")
    return (
        bool(st["adaptive"])
        and not r.get("engine")
        and st.get("stop") not in ("disco", "confidence")
    )


def classify_divergence(
    plain: list[int], spec: list[int], plain_logits: list[torch.Tensor], tolerance: float
) -> dict[str, Any] | None:
    """Where two greedy outputs of the same prompt first part, and whether that is a near-tie.

    plain, spec: the new tokens of plain and speculative decoding; plain_logits[i]: (V,) the
    target logits that chose plain[i]. Returns None when the outputs are identical, else
    ``{"position", "plain_token", "spec_token", "logit_gap", "near_tie"}`` where logit_gap =
    logit[plain token] - logit[spec token] in plain decoding's logits (>= 0: plain took the
    argmax). Outputs of different length with one a prefix of the other part where the
    shorter one ended (a stop token on one side): the stop token is the one compared."""
    n = min(len(plain), len(spec))
    i = next((k for k in range(n) if plain[k] != spec[k]), None)
    if i is None:
        if len(plain) == len(spec):
            return None
        i = n
    if i >= len(plain) or i >= len(spec) or i >= len(plain_logits):
        # one side stopped (max_new_tokens) where the other went on: no token to compare
        return {
            "position": i,
            "plain_token": None,
            "spec_token": None,
            "logit_gap": None,
            "near_tie": False,
        }
    row = plain_logits[i]
    gap = float(row[plain[i]] - row[spec[i]])
    return {
        "position": i,
        "plain_token": plain[i],
        "spec_token": spec[i],
        "logit_gap": gap,
        "near_tie": abs(gap) <= tolerance,
    }


def stats_row(spec: Stats, ar: Stats, c: float, parallel: bool = False) -> dict[str, Any]:
    tps = spec.new_tokens / spec.t_total if spec.t_total else float("nan")
    ar_tps = ar.new_tokens / ar.t_total if ar.t_total else float("nan")
    drafted = sum(spec.drafted.values())
    accepted = sum(spec.accepted.values())
    drafting = sum(n for g, n in spec.gamma_used.items() if g)
    other = spec.t_total - spec.t_target - spec.t_draft - spec.t_prefill
    return {
        "tau": spec.tau,
        "alpha": spec.alpha,
        "alpha_per_position": spec.alpha_per_position(),
        "draft_acceptance_rate": accepted / drafted if drafted else float("nan"),
        "tokens_per_second": tps,
        "ar_tokens_per_second": ar_tps,
        "speedup": tps / ar_tps if ar_tps else float("nan"),
        # the same after the prompt's prefill (long prompts: where a draft's own prefill or
        # the target's dominates the wall time, this is what decoding gains)
        "decode_speedup": decode_rate(spec) / decode_rate(ar) if decode_rate(ar) else float("nan"),
        # the formula is for chains; a tree's expected length depends on its shape
        "predicted_speedup": (
            predicted_speedup(spec.alpha, spec.gamma_used, c, parallel)
            if not spec.tree_iterations
            else float("nan")
        ),
        # what the decoder would give if verifying cost a plain step and nothing but drafting
        # were added: tau / (1 + drafting per iteration over a plain step). Measured speedup
        # below it is the decoder's cost (wider forwards, bookkeeping); the bound itself below
        # the goal is the draft's (its tau) or its drafting cost
        "speedup_bound": speedup_bound(spec, ar),
        "target_calls": spec.target_calls,
        # what drafting costs per iteration that drafted (a chain drafter: its steps; a
        # parallel one: its one forward), over one plain target step
        "draft_ms_per_iteration": 1e3 * spec.t_draft / drafting if drafting else float("nan"),
        "draft_cost_per_iteration": (
            (spec.t_draft / drafting) / (ar.t_target / ar.target_calls)
            if drafting and ar.target_calls
            else float("nan")
        ),
        # the share of verification forwards that verified a draft: the adaptive controller
        # drafts only where the head's acceptance pays for drafting and verifying here
        "drafted_share": (
            drafting / sum(spec.gamma_used.values()) if spec.gamma_used else float("nan")
        ),
        "tree_iterations": spec.tree_iterations,
        "draft_calls": spec.draft_calls,
        "new_tokens": spec.new_tokens,
        "ar_new_tokens": ar.new_tokens,
        "gamma_used": {str(k): v for k, v in sorted(spec.gamma_used.items())},
        "accept_length_hist": {str(k): v for k, v in sorted(spec.accept_len.items())},
        "time_s": {
            "total": spec.t_total,
            "target_forward": spec.t_target,
            "prefill": spec.t_prefill,
            # of which the drafter's start (its reading of the prompt), and plain's prefill
            "prefill_draft_start": spec.t_draft_start,
            "plain_prefill": ar.t_prefill,
            "draft": spec.t_draft,
            "other": other,
            "other_fraction": other / spec.t_total if spec.t_total else float("nan"),
        },
    }


def plain_token_seconds(ar: Stats) -> float:
    """The plain run's wall seconds a token after its prefill (bookkeeping included): the
    plain step of ``speedup_bound`` (nan where it decoded nothing)."""
    rate = decode_rate(ar)
    return 1 / rate if rate > 0 else float("nan")


def speedup_bound(spec: Stats, ar: Stats) -> float:
    """What speculative decoding gives after the prefill if each iteration cost one plain step
    (the plain run's wall seconds a token after its prefill, bookkeeping included) plus its
    drafting: tau / (1 + drafting's share of a plain step). A bound on ``decode_speedup``, the
    measure on the same basis (the speedup with the prefill, the same in both runs, lies
    nearer 1: above a bound below 1)."""
    plain_step = plain_token_seconds(ar)
    if not (spec.target_calls and plain_step > 0):
        return float("nan")
    return spec.tau / (1 + (spec.t_draft / spec.target_calls) / plain_step)


def decode_rate(s: Stats) -> float:
    """Tokens per second after the prefill (the prompt's forwards, the first token's included,
    and a draft's own), as vLLM's from a request's first token to its last."""
    t = s.t_total - s.t_prefill
    return s.decoded_tokens / t if t > 0 else float("nan")


def print_report(r: dict[str, Any], out=print) -> None:
    def f(x, nd=2):
        return "-" if x is None else f"{x:.{nd}f}"

    out(
        f"\ndraft: {r['settings']['draft_description']}   target: {r['settings']['target_identity']}"
        + (f"   {len(r['outputs'])} prompts" if "outputs" in r else "")
        + f"   T={r['settings']['temperature']}   "
        + (
            "trees verified whole"
            + (" (drafted while they pay: adaptive)" if adaptive_chain(r) else "")
            if r.get("tree_iterations")
            else "no draft (plain decoding)"
            if (r.get("decoder") or {}).get("gamma") == 0
            # an engine's n_max where it ran another length than asked (a DFlash block's)
            else f"gamma<={r['settings'].get('n_max', r['settings']['gamma'])}"
            f"{' (adaptive)' if adaptive_chain(r) else ''}"
        )
    )
    head = f"{'category':<16}{'tau':>6}{'alpha':>7}  {'alpha by position':<28}{'tok/s':>7}{'AR tok/s':>9}{'speedup':>8}"
    out(head)
    out("-" * len(head))
    rows = list(r["per_category"].items()) + [("all", r)]
    for name, s in rows:
        pos = " ".join(f(a) for a in (s["alpha_per_position"] or [])[:6])
        out(
            f"{name:<16}{f(s['tau']):>6}{f(s['alpha']):>7}  {pos:<28}{f(s['tokens_per_second'], 1):>7}"
            f"{f(s['ar_tokens_per_second'], 1):>9}{f(s['speedup']):>8}"
        )
    t = r["time_s"]
    if r.get("engine"):
        c = r.get("costs") or {}
        fwd = c.get("target_forward_ms_by_tokens") or {}
        out(
            f"engine: {r['engine']} ({r['settings'].get('spec_type')}, n_max "
            f"{r['settings'].get('n_max')}, p_min {r['settings'].get('p_min')}); "
            f"draft_acceptance_rate {f(r['draft_acceptance_rate'], 3)}"
        )
        if c and "speculative_step_ms" in c:
            out(
                f"engine costs: plain step {f(c['plain_ms_per_token'])} ms, speculative step "
                f"{f(c['speculative_step_ms'])} ms ({f(c['speculative_step_over_plain_step'])} "
                f"plain steps: the draft's {r['settings'].get('n_max')} tokens and their "
                "verification)"
            )
            out(
                f"predicted speedup {f(r['predicted_speedup'])} (measured {f(r['speedup'])}, "
                f"ratio {f(r.get('predicted_vs_measured'))}); ceiling (a draft always right) "
                f"{f(r['ceiling_speedup'])}; lossless: {r['lossless']} ({r['lossless_note']})"
            )
        elif c:
            out(
                f"engine costs: plain step {f(c['plain_ms_per_token'])} ms; target forward over "
                + ", ".join(f"{k}: {f(v)}" for k, v in list(fwd.items())[:6])
                + f" tokens (ms); draft {f(c['draft_ms_per_iteration'])} ms per iteration + "
                f"{f(c['draft_ms_per_drafted_token'])} ms per drafted token "
                f"({f(100 * c['draft_step_over_target_step'], 1)}% of a target step)"
            )
            out(
                f"predicted speedup {f(r['predicted_speedup'])} (measured {f(r['speedup'])}, "
                f"ratio {f(r['predicted_vs_measured'])}); ceiling (a draft always right) "
                f"{f(r['ceiling_speedup'])} at n_max {r['ceiling_n_max']}; lossless: "
                f"{r['lossless']} ({r['lossless_note']})"
            )
        else:
            out(f"lossless: {r['lossless']} ({r['lossless_note']})")
        o = r.get("ours")
        if o:
            diff = " ".join(f(d, 3) for d in (o["difference_per_position"] or [])[:6])
            rule = (
                f"rule {o['acceptance']} with {o['draft_sampling']} drafts"
                if o.get("draft_sampling")
                else "greedy"
            )
            out(
                f"built-in decoder, same prompts and draft, {rule}: tau {f(o['tau'])}, alpha by "
                "position "
                + " ".join(f(a) for a in (o["alpha_per_position"] or [])[:6])
                + f"; engine minus ours: {diff}{same_text_note(o.get('same_text'))}; its "
                f"speedup {f(o['speedup'])} over its own plain decoding "
                f"({f(o['ar_tokens_per_second'], 1)} tok/s)"
            )
        for line in r.get("engine_repairs") or []:
            out(f"engine repaired before loading: {line} (engine_repair=false to serve it as is)")
        if r.get("engine_flag"):
            out(f"ENGINE FLAGGED: {r['engine_flag']}")
        if r.get("finished") is False:
            out(
                f"ENGINE FAILED part way: {r.get('engine_error')}; the figures above cover "
                f"the {len(r['outputs'])} prompts that finished"
            )
    else:
        d = r.get("decoder") or {}
        if d:
            out(
                f"decoder: {d['runner']} (compile={d['compile']}; plain: {d['plain_runner']}, "
                f"{f(d['plain_ms_per_step'])} ms a step"
                + (
                    f"; graphs captured in {f(d['capture_seconds'], 1)} s"
                    if d["capture_seconds"]
                    else ""
                )
                + (f"; acceptance: {d['acceptance']}" if d.get("acceptance") else "")
                + f"); after the prefill {f(r.get('decode_speedup'))}x against a bound of "
                f"{f(r.get('speedup_bound'))} (tau over 1 + drafting's share of a plain step)"
            )
        predicted = (
            "- (the formula is for chains; a tree's expected length depends on its shape)"
            if r.get("tree_iterations")
            else f"{f(r['predicted_speedup'])}"
        )
        out(
            f"predicted speedup {predicted} (alpha {f(r['alpha'], 3)}, c "
            f"{f(r['draft_cost_ratio'], 3)}); gamma used {r['gamma_used']}; time outside model "
            f"forwards {f(100 * (t['other_fraction'] or 0), 1)}%; lossless: {r['lossless']} "
            f"({r['lossless_note']})"
        )
    sc = r.get("sample_check")
    if sc:
        out(
            "sample check (T > 0, decoding/sample_check.py): z of argmax hits / of log p, "
            f"speculative {_z(sc['spec']['z_argmax'])} / {_z(sc['spec']['z_logp'])} over "
            f"{sc['spec']['tokens']} tokens, plain {_z(sc['plain']['z_argmax'])} / "
            f"{_z(sc['plain']['z_logp'])} over {sc['plain']['tokens']}: "
            + (
                f"SAMPLER FLAGGED: {sc['flag']}"
                if sc["flag"]
                else (
                    f"not flagged (|z| <= {sc['z_flag']:g}), which says nothing of "
                    f"{sc['lossy_rule']}: these scores catch a broken sampler, not a rule that "
                    "reshapes the distribution on purpose (its TVD above is the measure)"
                )
                if sc.get("lossy_rule")
                else f"consistent with the target's distribution (|z| <= {sc['z_flag']:g})"
            )
        )
    if r.get("verifier_changed"):
        out(f"NOTE: {r['verifier_changed']}")
        o = r.get("against_original")
        if o and o.get("tokens"):
            out(
                f"  against the original target on these outputs: mean per-token TVD "
                f"{f(o['mean_tvd_adapted_vs_original'], 4)}, original's greedy token emitted "
                f"{f(100 * o['original_greedy_agreement'], 1)}% of the time"
            )
    if "hf_assisted" in r and "hf_tokens_per_second" in r["hf_assisted"]:
        h = r["hf_assisted"]
        out(
            f"HF assisted generation: {f(h['hf_tokens_per_second'], 1)} tok/s; ours "
            f"{f(h['ours_tokens_per_second'], 1)} tok/s ({f(h['ours_over_hf'])}x)"
        )
    out(f"convention: {r['convention']}")
    busy = busy_note(r.get("other_load"))
    if busy:
        out(busy)
    if r.get("stopped"):
        st = r["stopped"]
        out(
            f"STOPPED by {st['signal']} after {st['prompts']} of {st['asked']} prompts: the "
            "figures above cover those"
            + (f"; left out: {st['left_out']}" if st.get("left_out") else "")
        )


def mark_stopped(r: dict[str, Any], signum: int, asked: int) -> None:
    """Mark a report whose run a signal ended at a prompt boundary (``StopSignals``): its
    figures cover the prompts in ``outputs``, of ``asked``; a step it skipped for the stop is
    named in ``left_out`` (set by the run)."""
    import signal

    r["stopped"] = {
        "signal": signal.Signals(signum).name,
        "prompts": len(r.get("outputs") or []),
        "asked": asked,
        **(r.get("stopped") or {}),  # what the run left out, where it says (``left_out``)
    }


def run_label(r: dict[str, Any]) -> str:
    """Where and how a report's figures were taken, for a plot's title: the engine, the target,
    the bench and temperature, the machine (GPU, else CPU), the date, and whether other
    processes kept it busy."""
    s = r["settings"]
    where = s.get("gpu") or s.get("cpu") or s.get("machine") or "?"
    parts = [
        r.get("engine") or "built-in decoder",
        f"target {s.get('target_identity') or s.get('target', {}).get('name', '?')}",
        f"{s.get('bench')}, T={s.get('temperature')}",
        where,
        str(s.get("date", ""))[:10],
    ]
    if busy_note(r.get("other_load")):
        parts.append("busy machine: timings not its own")
    return " · ".join(p for p in parts if p)


def plot_report(r: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4.1))
    alphas = list(r["alpha_per_position"] or [])
    a.bar(range(1, len(alphas) + 1), [x or 0.0 for x in alphas], color="#4878d0")
    for k, x in enumerate(alphas, start=1):  # no token reached it: not a measured 0
        if x is None:
            a.text(k, 0.02, "not\nreached", ha="center", va="bottom", fontsize=7, color="gray")
    a.set_xticks(range(1, len(alphas) + 1))
    a.set_xlabel("draft position k")
    a.set_ylabel("P(accepted | 1..k-1 accepted)")
    a.set_ylim(0, 1)
    a.set_title(f"acceptance by position (alpha {r['alpha'] or 0:.2f})")
    hist = Counter({int(k): v for k, v in r["accept_length_hist"].items()})
    xs = list(range(0, max(hist, default=0) + 1))
    b.bar(xs, [hist[x] for x in xs], color="#ee854a")
    b.set_xlabel("accepted draft tokens per verification (iterations that drafted)")
    b.set_ylabel("iterations")
    b.set_xticks(xs)
    b.set_title(f"accepted length (tau {r['tau'] or 0:.2f})")
    fig.suptitle(f"{r['settings']['draft_description']}\n{run_label(r)}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _f(x, nd=2, signed=False) -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "n/a"
    return f"{x:+.{nd}f}" if signed else f"{x:.{nd}f}"


def _z(x) -> str:
    """A z-score, or n/a where the statistic has no variance (every step one-hot: top-k 1, a
    temperature near 0), so nothing tells samples apart."""
    return _f(x, 1, signed=True)


def has_rates(rows: list[dict]) -> bool:
    """Whether a sweep's rows are at arrival rates (``request_rates``)."""
    return any(r.get("request_rate") is not None for r in rows)


def _rate(row: dict) -> str:
    """A sweep row's arrival rate as a table cell."""
    rate = row.get("request_rate")
    return "all at 0" if rate is None else f"{rate:g}"


def speedup_table(rows: list[dict]) -> str:
    """A Markdown table of a batch sweep (``decoding.eval`` rows); a column of arrival rates
    where the sweep has them."""
    rated = has_rates(rows)
    head = (
        "| batch | "
        + ("requests/s | " if rated else "")
        + "policy | plain tok/s | spec tok/s | speedup | after prefill | per-request "
        "tok/s (plain / spec) | rows per forward (plain / spec) | tau | alpha | mean gamma | "
        "lossless (T > 0: sample check) |\n"
        "|---|---|---|---|---|---|---|---|---|---|---|---|" + ("---|" if rated else "")
    )
    lines = [head]
    f = _f
    for r in rows:
        lines.append(
            f"| {r['batch_size']} | "
            + (f"{_rate(r)} | " if rated else "")
            + f"{r['policy']} | {f(r['plain_tokens_per_second'], 1)} | "
            f"{f(r['tokens_per_second'], 1)} | {f(r['speedup'])}x | "
            f"{f(r.get('decode_speedup'))}x | {f(r['plain_request_tokens_per_second'], 1)} / "
            f"{f(r['request_tokens_per_second'], 1)} | "
            f"{f(r.get('plain_mean_rows_per_forward'), 1)} / {f(r.get('mean_rows_per_forward'), 1)} | "
            f"{f(r['tau'])} | {f(r['alpha'])} | "
            f"{f(r['mean_gamma'])} | {_exactness(r)} |"
        )
    return "\n".join(lines)


def _exactness(row: dict) -> str:
    """A sweep row's lossless cell: True/False at T = 0; at T > 0 the sample check's verdict
    and the speculative samples' two z-scores (argmax hits, log p)."""
    sc = row.get("sample_check")
    if not sc:
        return str(row["lossless"])
    z = sc["spec"]
    return (
        f"{'FLAGGED' if sc['flag'] else 'ok'} "
        f"(z {_f(z['z_argmax'], 1, signed=True)} / {_f(z['z_logp'], 1, signed=True)})"
    )


def latency_table(rows: list[dict]) -> str:
    """Per-request latency of a sweep with arrival rates (``decoding.eval`` rows), plain /
    speculative: mean and p99 end-to-end latency and time to first token, mean time per
    output token after the first, and plain's mean latency over speculation's."""
    lines = [
        "| batch | requests/s | policy | latency mean, s | latency p99, s | TTFT mean, s | "
        "TPOT mean, ms | latency speedup | mean gamma |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    f = _f
    for r in rows:
        p, s = r["plain_latency"], r["latency"]
        lines.append(
            f"| {r['batch_size']} | {_rate(r)} | "
            f"{r['policy']} | {f(p['latency']['mean'])} / {f(s['latency']['mean'])} | "
            f"{f(p['latency']['p99'])} / {f(s['latency']['p99'])} | "
            f"{f(p['ttft']['mean'])} / {f(s['ttft']['mean'])} | "
            f"{f(1e3 * p['tpot']['mean'], 1)} / {f(1e3 * s['tpot']['mean'], 1)} | "
            f"{f(r['latency_speedup'])}x | {f(r['mean_gamma'])} |"
        )
    return "\n".join(lines)


BATCH_CONVENTION = (
    "batch rows: tokens_per_second = all requests' new tokens / wall time of the whole run "
    "(prefills included), for plain and speculative decoding at the same batch size; "
    "request_tokens_per_second = mean over requests of new tokens / (last token - admission); "
    "tau and alpha pool every row-iteration (a row's verification counts once per forward it "
    "rode in); mean_gamma = draft tokens per row-iteration; decode_speedup = the ratio of new "
    "tokens per second of wall time less the prefills (a drafter's reading of a newcomer counts "
    "as prefill)."
)


def print_batch_report(r: dict[str, Any], out=print) -> None:
    s = r["settings"]
    out(
        f"\ndraft: {s['draft_description']}   target: {s['target_identity']}   "
        f"T={s['temperature']}   {r['num_requests']} requests x "
        + (
            f"{s['max_new_tokens']} tokens"
            if not r.get("request_tokens")
            else "{}-{} tokens (mixed lengths)".format(*r["request_tokens"])
        )
        + f"   waiting requests join when {s.get('batch_admit', 1)} slot(s) are free"
    )
    out(speedup_table(r["batch"]))
    if has_rates(r["batch"]):
        out("\nper-request latency from arrival, plain / speculative:")
        out(latency_table(r["batch"]))
    for row in r["batch"]:
        if row["policy"] == "goodput" and row.get("cost_model"):
            c = row["cost_model"]
            out(
                f"goodput cost model at batch {row['batch_size']}"
                + (
                    f", {row['request_rate']:g} requests/s"
                    if row.get("request_rate") is not None
                    else ""
                )
                + f": step = {c['c0_s'] * 1e3:.1f} ms"
                f" + {c['per_row_s'] * 1e3:.2f} ms/row"
                f" + {c['per_wide_row_s'] * 1e3:.2f} ms/row verifying more than one token"
                f" + {c['per_further_token_s'] * 1e3:.2f} ms/token after a row's first + "
                f"{c['per_token_per_1k_columns_s'] * 1e3:.3f} ms/token/1k cache columns "
                f"(fit's relative error {c.get('relative_error', float('nan')):.1%})"
                + (
                    f"; the drafter reads in {c.get('read_ms_fixed', 0.0):.2f} ms a reading"
                    f" + {c['read_ms_per_token']:.4f} ms/token"
                    if c.get("read_ms_per_token") is not None
                    else ""
                )
                + (
                    f", a draft step {c['draft_step_ms']:.1f} ms before the run"
                    if c.get("draft_step_ms") is not None
                    else ""
                )
                + f"; {row.get('probes', 0)} probes"
                + (
                    f"; {row['drain_forwards']} of {row['forwards']} forwards with no request"
                    " waiting"
                    if row.get("drain_forwards") is not None
                    else ""
                )
            )
    if r.get("verifier_changed"):
        out(f"NOTE: {r['verifier_changed']}")
    d = r.get("decoder")
    if d:
        out(
            f"decoder: {', '.join(d['runner'])} (compile={d['compile']}"
            + (f"; graphs captured in {d['capture_seconds']:.1f} s" if d["capture_seconds"] else "")
            + ")"
        )
    out(f"lossless: {r['lossless']} ({r['lossless_note']})")
    out(f"convention: {r['convention']}")
    busy = busy_note(r.get("other_load"))
    if busy:
        out(busy)


def plot_batch_report(r: dict[str, Any], path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if has_rates(r["batch"]):
        _plot_latency(r, plt, path)
        return
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 3.8))
    by_policy: dict[str, list] = {}
    for row in r["batch"]:
        by_policy.setdefault(row["policy"], []).append(row)
    for pol, rs in by_policy.items():
        xs = [x["batch_size"] for x in rs]
        a.plot(xs, [x["speedup"] for x in rs], "o-", label=pol)
        b.plot(xs, [x["tokens_per_second"] for x in rs], "o-", label=f"spec ({pol})")
    first = next(iter(by_policy.values()))
    b.plot(
        [x["batch_size"] for x in first],
        [x["plain_tokens_per_second"] for x in first],
        "k--",
        label="plain",
    )
    a.axhline(1.0, color="grey", lw=0.8)
    _finish(
        plt,
        fig,
        r,
        path,
        "batch size",
        [
            ("speedup over plain at the same batch", "speculation vs batch size"),
            ("total tokens/s", "throughput"),
        ],
    )


def _finish(plt, fig, r: dict[str, Any], path, xlabel: str, labels: list[tuple[str, str]]) -> None:
    """Both panels on a log2 x axis with their legends, (y label, title) each; saved."""
    for ax, (ylabel, title) in zip(fig.axes, labels, strict=True):
        ax.set_xscale("log", base=2)
        ax.set_xlabel(xlabel)
        ax.legend(fontsize=8)
        ax.set_ylabel(ylabel)
        ax.set_title(title)
    fig.suptitle(f"{r['settings']['draft_description']}\n{run_label(r)}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _plot_latency(r: dict[str, Any], plt, path) -> None:
    """Mean end-to-end latency and time per output token against the arrival rate, plain and
    each policy, one line per batch size (SmartSpec's figures)."""
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 3.8))
    rows = r["batch"]  # every row is at a rate (``has_rates``)
    sizes = sorted({x["batch_size"] for x in rows})
    for size in sizes:
        at = [x for x in rows if x["batch_size"] == size]
        tag = f"B={size} " if len(sizes) > 1 else ""
        first = [x for x in at if x["policy"] == at[0]["policy"]]
        xs = [x["request_rate"] for x in first]
        a.plot(
            xs, [x["plain_latency"]["latency"]["mean"] for x in first], "k--", label=f"{tag}plain"
        )
        b.plot(
            xs,
            [1e3 * x["plain_latency"]["tpot"]["mean"] for x in first],
            "k--",
            label=f"{tag}plain",
        )
        for pol in dict.fromkeys(x["policy"] for x in at):
            ps = [x for x in at if x["policy"] == pol]
            xs = [x["request_rate"] for x in ps]
            a.plot(xs, [x["latency"]["latency"]["mean"] for x in ps], "o-", label=f"{tag}{pol}")
            b.plot(xs, [1e3 * x["latency"]["tpot"]["mean"] for x in ps], "o-", label=f"{tag}{pol}")
    _finish(
        plt,
        fig,
        r,
        path,
        "arrival rate, requests/s (Poisson)",
        [
            ("mean latency per request, s", "end-to-end latency"),
            ("mean time per output token, ms", "time per output token"),
        ],
    )


def json_safe(x):
    """``x`` with every non-finite float as None (JSON has no NaN), through dicts and lists."""
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if isinstance(x, dict):
        return {k: json_safe(v) for k, v in x.items()}
    if isinstance(x, list):
        return [json_safe(v) for v in x]
    return x


def report_paths(cfg) -> tuple[Path, Path]:
    """Where the report (JSON) and its plot (PNG) go, checked before anything is measured: a
    folder, a path under a file, or an existing file that is no report of this command (data,
    say) is an ``EvalError``; an earlier report or plot is replaced. ``traces=`` is checked
    alike (an earlier traces file is replaced)."""
    from models.base import unwritable

    from .settings import EvalError

    path = Path(cfg.report).expanduser()
    png = Path(cfg.plot).expanduser() if cfg.plot else path.with_suffix(".png")
    outs = [("report", path, _is_report), ("plot", png, _is_plot)]
    if cfg.get("traces"):
        outs.append(("traces", Path(cfg.traces).expanduser(), _is_traces))
    seen: dict[Path, str] = {}
    for key, p, _ in outs:  # each its own file: one written over another loses it
        same = seen.setdefault(p.resolve(), key)
        if same != key:
            hint = " (the plot defaults to the report's name with .png)" if not cfg.plot else ""
            raise EvalError(f"{same}= and {key}= name the same file, {p}{hint}; give each its own")
    for key, p, ours in outs:
        if p.is_dir():
            raise EvalError(f"{key}={p} is a folder; name a file in it ({key}={p / path.name})")
        why = unwritable(p)
        if why is not None:
            raise EvalError(f"{key}={p}: {why}")
        if p.exists() and not ours(p):
            raise EvalError(
                f"{key}={p} exists and is no {key} of specdraft-eval; choose another path, or "
                "remove the file"
            )
    if png.suffix.lstrip(".").lower() not in _PLOT_HEADS:
        raise EvalError(
            f"plot={png}: a plot is written as {', '.join('.' + k for k in _PLOT_HEADS)} "
            "(by its name's ending)"
        )
    return path, png


def replaced_outputs(cfg) -> list[str]:
    """A line for each output of this run (report, plot, traces) that will replace an earlier
    one of this command's at its path (``report_paths`` refused anything else there), so a
    run's figures are not written over in silence."""
    path = Path(cfg.report).expanduser()
    png = Path(cfg.plot).expanduser() if cfg.plot else path.with_suffix(".png")
    outs = [("report", path), ("plot", png)]
    if cfg.get("traces"):
        outs.append(("traces", Path(cfg.traces).expanduser()))
    lines = []
    for key, p in outs:
        if p.is_file():
            when = ""
            if key == "report":
                try:
                    date = json.loads(p.read_text()).get("settings", {}).get("date")
                except (OSError, UnicodeDecodeError, json.JSONDecodeError, AttributeError):
                    date = None
                when = f" (its run of {str(date)[:19]})" if date else ""
            lines.append(
                f"note: {key}={p} holds an earlier {key}{when}; this run replaces it "
                f"({key}= names another file to keep it)"
            )
    return lines


def _is_report(p: Path) -> bool:
    """A report this command wrote: its settings and the conventions its figures follow (a
    file of another command's with settings, prepare's ``.meta.json``, is not one)."""
    try:
        r = json.loads(p.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return False
    return isinstance(r, dict) and "settings" in r and "convention" in r


def _is_traces(p: Path) -> bool:
    """A traces file ``specdraft-eval traces=`` wrote: its first line is its ``meta``."""
    try:
        with open(p, errors="replace") as f:
            first = json.loads(f.readline())
    except (OSError, json.JSONDecodeError):
        return False
    return isinstance(first, dict) and "signal_names" in (first.get("meta") or {})


#: the plot formats written, each with how its file begins (a plot there is replaced: a file
#: that begins otherwise is someone's data)
_PLOT_HEADS: dict[str, tuple[bytes, ...]] = {
    "png": (b"\x89PNG\r\n\x1a\n",),
    "pdf": (b"%PDF",),
    "svg": (b"<?xml", b"<svg"),
    "jpg": (b"\xff\xd8\xff",),
    "jpeg": (b"\xff\xd8\xff",),
    "eps": (b"%!PS",),
    "ps": (b"%!PS",),
}


def plot_path_problem(p: Path) -> str | None:
    """Why a plot cannot be written at ``p``, in a few words, or None (an earlier plot there,
    of the format its name's ending says, is replaced): a folder, a path under a file, a name
    no plot format has, or an existing file that is no such plot (data, say)."""
    from models.base import unwritable

    if p.is_dir():
        return "a folder; name a file in it"
    why = unwritable(p)
    if why is not None:
        return why
    if p.suffix.lstrip(".").lower() not in _PLOT_HEADS:
        kinds = ", ".join("." + k for k in _PLOT_HEADS)
        return f"a plot is written as {kinds} (by its name's ending)"
    try:
        if p.exists() and not _is_plot(p):
            return f"exists and is no {p.suffix.lstrip('.').upper()} plot"
    except OSError as e:
        return f"cannot read it ({e.strerror})"
    return None


def _is_plot(p: Path) -> bool:
    with open(p, "rb") as f:
        head = f.read(16)
    return head.startswith(_PLOT_HEADS.get(p.suffix.lstrip(".").lower(), (b"\x89PNG",)))
