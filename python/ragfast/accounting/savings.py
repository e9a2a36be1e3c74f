"""Does a checker pay for what it saves? Paired cost accounting with bootstrap intervals.

S2G's judge (or StepGap's checker) spends compute on every state it scores; in return the
method changes how much the other components spend (S2G's early stops skip reasoner turns and
searches; StepGap's repairs add some). This module compares, question by question, what the
checker spent with what the other components saved against the native run, in FLOPs, tokens
and seconds, each with a paired-bootstrap interval over questions.

The verdict's currency is FLOPs and tokens, counted cache-independently: every prompt token as
if it were computed (``flops_uncached`` and input + cached + output tokens). A server's prefix
cache makes the FLOPs it actually computed depend on what ran before (136.9 vs 76.4 GFLOPs for
identical work on vLLM), so a comparison on them would depend on the order of the methods;
the cache-independent figures depend only on each call's token counts, so identical
trajectories differ by exactly zero. What was actually computed (``flops_computed``,
``tokens_computed``) and wall-clock ``seconds`` are reported beside the verdict, never as a
saving by themselves: identical trajectories once showed "saved 190 ms/q" from timing drift.

Three rules keep the verdict honest:

- a saving whose interval includes 0 is "no measurable saving", never a negative number;
  an interval wholly below 0 is reported as an *extra* spend, never as a negative saving;
- a component whose cost was not measured (a remote server that reports nothing) is
  "unknown", and a component that costs nothing real (the scripted oracle) is "free": both are
  named next to the verdict, and a metric that rests on an unknown component has no verdict;
- only :data:`VERDICT_METRICS` get a verdict; :data:`BESIDE_METRICS` are differences shown
  beside it.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Mapping, Sequence

import numpy as np

from ragfast.scoring.stats import paired_bootstrap

__all__ = ["Interval", "MetricBalance", "Balance", "METRICS", "VERDICT_METRICS", "BESIDE_METRICS", "balance",
           "cost_value", "judged_states"]

#: What each metric reads from a trajectory's ``cost[component]`` record. ``flops`` and
#: ``tokens`` are cache-independent (every prompt token as if computed; records written before
#: ``flops_uncached`` existed fall back to ``flops``); ``flops_computed`` and
#: ``tokens_computed`` are what was computed (fresh input + output: tokens served from a KV or
#: prefix cache cost no compute); ``seconds`` is wall-clock.
METRICS = {"flops": ("flops_uncached",), "tokens": ("input_tokens", "cached_tokens", "output_tokens"),
           "flops_computed": ("flops",), "tokens_computed": ("input_tokens", "output_tokens"),
           "seconds": ("seconds",)}
#: The metrics a verdict ("pays for itself") is given in.
VERDICT_METRICS = ("flops", "tokens")
#: Reported beside the verdict as a difference, never as a saving by itself.
BESIDE_METRICS = ("flops_computed", "tokens_computed", "seconds")

STATUSES = ("measured", "unknown", "free")


def cost_value(traj: Mapping[str, Any], component: str, metric: str) -> float:
    """One question's cost of ``component`` in ``metric`` (0 when the component did not run)."""
    rec = (traj.get("cost") or {}).get(component) or {}
    if metric == "flops" and "flops_uncached" not in rec:
        return float(rec.get("flops", 0.0) or 0.0)
    return float(sum(float(rec.get(f, 0.0) or 0.0) for f in METRICS[metric]))


@dataclass
class Interval:
    """A per-question mean with its paired-bootstrap interval."""

    mean: float
    low: float
    high: float

    @property
    def excludes_zero(self) -> bool:
        return self.low > 0 or self.high < 0

    def describe(self, unit: str = "") -> str:
        """``"1.2 [0.9, 1.5] unit"``, rounded to 3 significant digits."""
        u = f" {unit}" if unit else ""
        return f"{_g(self.mean)} [{_g(self.low)}, {_g(self.high)}]{u}"


def _g(x: float) -> str:
    return f"{x:.3g}"


# Display units: FLOPs in GFLOPs, seconds in ms (values are stored unscaled).
_UNITS = {"flops": ("GFLOPs", 1e-9), "tokens": ("tokens", 1.0), "flops_computed": ("GFLOPs", 1e-9),
          "tokens_computed": ("tokens", 1.0), "seconds": ("ms", 1e3)}
# What each metric is, as the verdict lines name it.
_LABELS = {"flops": "FLOPs, cache-independent (every prompt token counted as computed)",
           "tokens": "tokens, cache-independent (input + cached + output)",
           "flops_computed": "FLOPs the backends computed (with their KV / prefix caches)",
           "tokens_computed": "tokens computed (fresh input + output)",
           "seconds": "wall-clock"}


def _scaled(x: "Interval", metric: str) -> "Interval":
    f = _UNITS[metric][1]
    return Interval(x.mean * f, x.low * f, x.high * f)


@dataclass
class MetricBalance:
    """Checker spend against other components' saving, in one metric, per question."""

    metric: str
    spent: Interval | None  # what the checker spent (None: unknown)
    saved: Interval | None  # native minus method over the saved components (None: unknown)
    net: Interval | None  # saved - spent
    saved_by_component: dict[str, float] = field(default_factory=dict)
    unknown: list[str] = field(default_factory=list)
    verdict: str = ""
    saving_text: str = ""
    role: str = "verdict"  # "verdict" or "beside" (a difference, never a saving by itself)


@dataclass
class Balance:
    """The whole verdict: one :class:`MetricBalance` per metric and what each component was."""

    spender: str
    questions: int
    checked_states: int
    components: dict[str, str]
    metrics: dict[str, MetricBalance]
    confidence: float

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def lines(self) -> list[str]:
        """Human-readable verdict lines, one per metric, plus what was measured."""
        out = []
        for m, b in self.metrics.items():
            label = f"{m}: {_LABELS[m]}" if m in _LABELS else m
            if b.spent is None or b.saved is None:
                out.append(f"{label}: {b.verdict or 'unknown'}")
                continue
            if b.role == "beside":
                out.append(f"beside the verdict, {label} ({_UNITS[m][0]} per question): {b.saving_text}")
                continue
            out.append(f"{label} ({_UNITS[m][0]} per question): {self.spender} spent {_scaled(b.spent, m).describe()}; "
                       f"{b.saving_text}; {b.verdict}")
        kinds = {s: sorted(c for c, v in self.components.items() if v == s) for s in STATUSES}
        out.append("measured: " + (", ".join(kinds["measured"]) or "none")
                   + "; unknown: " + (", ".join(kinds["unknown"]) or "none")
                   + "; free (not real compute): " + (", ".join(kinds["free"]) or "none"))
        return out


def _interval(x: np.ndarray, n_resamples: int, seed: int, confidence: float) -> Interval:
    r = paired_bootstrap(x, None, n_resamples=n_resamples, seed=seed, confidence=confidence)
    return Interval(float(r.delta), float(r.low), float(r.high))


def judged_states(row: Mapping[str, Any]) -> int:
    """States the S2G judge scored in one result row: ``extra["judged_states"]``; a row written
    before that count existed holds ``judge_scores`` with state 0 unjudged (``None``)."""
    extra = row.get("extra") or {}
    if "judged_states" in extra:
        return int(extra["judged_states"])
    return max(0, len(extra.get("judge_scores") or [None]) - 1)


def balance(native: Sequence[Mapping[str, Any]], method: Sequence[Mapping[str, Any]], *,
            spender: str | Sequence[str] = "judge",
            saved_components: Sequence[str] = ("reasoner", "encoder", "search"),
            components: Mapping[str, str] | None = None, metrics: Sequence[str] = tuple(METRICS),
            n_resamples: int = 10000, seed: int = 0, confidence: float = 0.95) -> Balance:
    """Compare what ``spender`` cost with what the method saved, paired by question id.

    Parameters
    ----------
    native, method : sequence of trajectory records
        Each with ``id`` and ``cost`` (component -> ledger sums), as written by the runs.
        Questions present in both are paired; the rest are left out.
    spender : str or sequence of str
        The checker's ledger component(s): ``"judge"`` for S2G; ``"nli"`` for StepGap, with
        ``"judge"`` too when its LLM stages ran. Their costs add up; the verdict names them
        joined by " + ".
    saved_components : sequence of str
        Components whose native-minus-method difference is the saving.
    components : mapping, optional
        Component -> ``"measured"`` | ``"unknown"`` | ``"free"``. Unlisted components count as
        measured. A metric whose spender or saved components include an unknown one gets no
        interval and the verdict "unknown"; free components count as 0 and are named.
    metrics : sequence of str
        Which of :data:`METRICS` to compute (all by default).
    n_resamples, seed, confidence
        Paired bootstrap settings (:func:`ragfast.scoring.stats.paired_bootstrap`).

    Returns
    -------
    Balance
    """
    spenders = (spender,) if isinstance(spender, str) else tuple(spender)
    unknown_metrics = sorted(set(metrics) - set(METRICS))
    if unknown_metrics:
        raise ValueError(f"unknown metric(s) {unknown_metrics}; expected some of {list(METRICS)}")
    status = {c: "measured" for c in (*spenders, *saved_components)}
    for c, s in (components or {}).items():
        if s not in STATUSES:
            raise ValueError(f"component {c!r}: status must be one of {STATUSES}, got {s!r}")
        if c in status:
            status[c] = s
    nat = {r["id"]: r for r in native}
    pairs = [(nat[r["id"]], r) for r in method if r["id"] in nat]
    states = sum(judged_states(b) for _, b in pairs)
    out: dict[str, MetricBalance] = {}
    label = " + ".join(spenders)
    for m in metrics:
        unknown = [c for c in (*spenders, *saved_components) if status[c] == "unknown"]
        live = [c for c in saved_components if status[c] == "measured"]
        by_comp = {c: float(sum(cost_value(a, c, m) - cost_value(b, c, m) for a, b in pairs)) / max(1, len(pairs))
                   for c in live}
        if not pairs or unknown:
            why = ("no paired questions" if not pairs else
                   "unknown: " + ", ".join(unknown) + " reported no cost")
            out[m] = MetricBalance(m, None, None, None, by_comp, unknown, verdict=why)
            continue
        spent_q = np.array([sum(cost_value(b, c, m) for c in spenders if status[c] == "measured") for _, b in pairs])
        saved_q = np.array([sum(cost_value(a, c, m) - cost_value(b, c, m) for c in live) for a, b in pairs])
        spent = _interval(spent_q, n_resamples, seed, confidence)
        saved = _interval(saved_q, n_resamples, seed, confidence)
        net = _interval(saved_q - spent_q, n_resamples, seed, confidence)
        if m in BESIDE_METRICS:
            out[m] = MetricBalance(m, spent, saved, net, by_comp, [], role="beside",
                                   saving_text=_difference_text(_scaled(saved, m), _scaled(spent, m), label))
            continue
        out[m] = MetricBalance(m, spent, saved, net, by_comp, [], verdict=_verdict(label, _scaled(net, m)),
                               saving_text=_saving_text(_scaled(saved, m)))
    return Balance(label, len(pairs), states, status, out, confidence)


def _by_sign(iv: Interval, above: Callable[[Interval], str], below: Callable[[Interval], str],
             across: Callable[[Interval], str]) -> str:
    """Describe an interval above 0, below 0 (given its negation), or including 0."""
    if iv.low > 0:
        return above(iv)
    if iv.high < 0:
        return below(Interval(-iv.mean, -iv.high, -iv.low))
    return across(iv)


def _is_zero(iv: Interval) -> bool:
    return iv.mean == iv.low == iv.high == 0.0


def _saving_text(saved: Interval) -> str:
    if _is_zero(saved):
        return "no saving: exactly 0 on every question (the same cost)"
    return _by_sign(saved, lambda s: f"the method saved {s.describe()}",
                    lambda extra: f"no saving: the other components spent {extra.describe()} extra",
                    lambda s: f"no measurable saving (interval {s.describe()} includes 0)")


def _difference_text(diff: Interval, spent: Interval, spender: str) -> str:
    # A plain signed difference with its interval: never worded as a saving or a verdict.
    return (f"native minus method on the other components {diff.describe()} (interval, not a saving by itself); "
            f"{spender} {spent.describe()}")


def _verdict(spender: str, net: Interval) -> str:
    if _is_zero(net):
        return f"nothing to pay for: {spender} spent nothing and the other components cost the same (net exactly 0)"
    return _by_sign(net, lambda n: f"{spender} pays for itself (net {n.describe()})",
                    lambda over: f"{spender} does not pay for itself: it costs {over.describe()} more than it saves",
                    lambda n: f"undetermined: saving minus spend is {n.describe()}, an interval that includes 0")
