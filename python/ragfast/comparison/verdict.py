"""The bench's verdict: does S2G pay, does StepGap pay, measured here and projected for a 7B on an H200.

``report.md`` and ``report.html`` open with it and ``ragfast bench`` prints it last. Each method
is paired with native Search-R1 over the same questions, every figure with a 95% bootstrap
interval over questions:

- *measured*: what the checker spent against what its method saved on the other components, in
  cache-independent FLOPs (:mod:`ragfast.accounting.savings`), from this run's own models. A component
  that is the scripted oracle is free (a script, not compute) and one whose server reported
  nothing is unknown; the verdict names both.
- *projected*: the same questions' recorded tokens priced with a Qwen2.5-7B reasoner on an H200
  (:mod:`ragfast.accounting.projection`, a nominal roofline), question by question, so its interval is a
  bootstrap over questions too. It is labelled projected, never measured.
- *quality*: ΔEM with its interval, non-inferiority within the S2G study's 2 EM points, and the
  searches saved per question.

Everything is computed once, at the end of the run, into ``summary.json`` (``projection``,
``verdict``); the report and the terminal only render it.
"""
from __future__ import annotations

from dataclasses import asdict
from typing import Any, Mapping, Sequence

from ragfast.accounting.ledger import COMPONENTS
from ragfast.outputs.failures import failure_of
from ragfast.methods.s2g.evaluation import NON_INFERIORITY_MARGIN
from ragfast.accounting.projection import device_profile, project_questions
from ragfast.accounting.savings import balance

__all__ = ["CHECKS", "PROJECTION_DEVICE", "PROJECTION_MODEL", "PROJECTION_BATCH", "PROJECTED_LABEL",
           "component_status", "checker_components", "checker_balance", "projection", "verdict",
           "verdict_blocks", "verdict_lines"]

#: (method, its summary key for the measured balance, its name in the verdict).
CHECKS = (("s2g", "break_even", "S2G"), ("stepgap", "stepgap_balance", "StepGap"))
#: The projection every bench computes: the S2G study's reasoner size on the GPU it names.
PROJECTION_DEVICE = "h200"
PROJECTION_MODEL = "qwen2.5-7b"
PROJECTION_MODEL_NAME = "Qwen2.5-7B"
#: Sequences decoded together, as ``ragfast report cost``'s default.
PROJECTION_BATCH = 64
PROJECTED_LABEL = "projected (nominal roofline), not measured"

_SAVED = ("reasoner", "encoder", "search")


# -- the measured balance -----------------------------------------------------------------------
def component_status(records: Sequence[Sequence[Mapping[str, Any]]], slot_info: Mapping[str, Any]) -> dict[str, str]:
    """measured / unknown / free per component: unknown where a server reported no cost, free
    for the scripted oracle (its tokens are a script's, not a model's compute)."""
    status = {c: "measured" for c in COMPONENTS}
    for recs in records:
        for r in recs:
            for c, v in (r.get("cost") or {}).items():
                if v.get("unknown"):
                    status[c] = "unknown"
    if (slot_info.get("reasoner") or {}).get("class") == "ScriptedGenerator":
        status["reasoner"] = "free"
    return status


def checker_components(method: str, records: Sequence[Mapping[str, Any]]) -> tuple[str, ...]:
    """The ledger components a method's checker books: S2G's judge; StepGap's NLI, and ``judge``
    as well where its LLM stages (A-C) ran (``methods/stepgap/checker.py`` books them there)."""
    if method == "s2g":
        return ("judge",)
    llm = any(((r.get("cost") or {}).get("judge") or {}).get("calls") for r in records)
    return ("nli", "judge") if llm else ("nli",)


def checker_balance(native: Sequence[Mapping[str, Any]], other: Sequence[Mapping[str, Any]], method: str,
                    slot_info: Mapping[str, Any], cfg: Any) -> dict[str, Any]:
    """Does the method's checker (S2G's judge, StepGap's NLI and LLM stages) pay for what its
    method saves? Paired by question, with bootstrap intervals (:func:`ragfast.accounting.savings.balance`);
    ``text`` is the whole account a person reads."""
    b = balance(native, other, spender=checker_components(method, other),
                components=component_status([native, other], slot_info), n_resamples=cfg.n_resamples, seed=cfg.seed)
    d = b.to_dict()
    fail = {r["id"] for r in [*native, *other] if failure_of(r) is not None}
    d["n_failed_either"] = len(fail & {r["id"] for r in native} & {r["id"] for r in other})
    lines = b.lines()
    if d["n_failed_either"]:
        lines.append(f"{d['n_failed_either']} paired question(s) failed in either method: their costs are what was "
                     "spent before the failure")
    d["text"] = f"{method} against native Search-R1, per question with 95% intervals:\n" + "\n".join(
        f"- {line}" for line in lines)
    return d


# -- the projection -----------------------------------------------------------------------------
def projection(records: Mapping[str, Sequence[Mapping[str, Any]]], slot_info: Mapping[str, Any],
               cfg: Any) -> dict[str, Any]:
    """This run's recorded work priced with a Qwen2.5-7B reasoner on an H200 (summary.json's ``projection``).

    The reasoner's calls are priced as the 7B from their recorded token counts (so are StepGap's
    LLM stages when its checker is the reasoner); the encoder, search and judge from their
    recorded FLOPs and bytes, i.e. this run's models and index. Each question is priced on its
    own, and the checkers' balances are paired bootstraps over those per-question figures.
    """
    checker = slot_info.get("checker") or {}
    checker_is_reasoner = getattr(cfg, "checker_llm", None) == "reasoner" and checker.get("name", "none") != "none"
    per_q: dict[str, list[dict[str, Any]]] = {}
    methods: dict[str, Any] = {}
    for m, recs in records.items():
        models = {"reasoner": PROJECTION_MODEL}
        if m == "stepgap" and checker_is_reasoner:
            models["judge"] = PROJECTION_MODEL  # StepGap's checker generates: priced prefill + decode
        q = project_questions(recs, PROJECTION_DEVICE, models, one_pass=() if m == "stepgap" else ("judge",),
                              batch=PROJECTION_BATCH)
        per_q[m] = [{"id": qid, "cost": row} for qid, row in q.items()]
        n = max(1, len(recs))
        comps = [c for c in COMPONENTS if any(c in row for row in q.values())]
        by_comp = {c: {"model": models.get(c, "as recorded"),
                       "flops_per_question": sum(row.get(c, {}).get("flops", 0.0) for row in q.values()) / n,
                       "seconds_per_question": sum(row.get(c, {}).get("seconds", 0.0) for row in q.values()) / n}
                   for c in comps}
        methods[m] = {"questions": len(recs), "components": by_comp,
                      "flops_per_question": sum(v["flops_per_question"] for v in by_comp.values()),
                      "seconds_per_question": sum(v["seconds_per_question"] for v in by_comp.values())}
    status = component_status(list(records.values()), slot_info)
    if status["reasoner"] == "free":
        status["reasoner"] = "measured"  # its recorded tokens are priced as the 7B's: no longer free
    balances = {}
    if "searchr1" in per_q:
        for m, _, _ in CHECKS:
            if m in per_q:
                b = balance(per_q["searchr1"], per_q[m], spender=checker_components(m, records[m]),
                            saved_components=_SAVED, components=status, metrics=("flops", "seconds"),
                            n_resamples=cfg.n_resamples, seed=cfg.seed)
                d = b.to_dict()
                # counted components are projected here, not measured
                d["components"] = {c: "projected" if v == "measured" else v for c, v in d["components"].items()}
                balances[m] = d
    reasoner = (slot_info.get("reasoner") or {}).get("name", "this run's reasoner")
    return {"label": PROJECTED_LABEL, "device": asdict(device_profile(PROJECTION_DEVICE)),
            "reasoner": PROJECTION_MODEL, "batch": PROJECTION_BATCH, "dtype_bytes": 2,
            "stepgap_checker": PROJECTION_MODEL if checker_is_reasoner else "as recorded",
            "priced_from": f"the reasoner's recorded tokens ({reasoner}) priced as {PROJECTION_MODEL_NAME} calls "
                           "(bf16), the encoder, search and judge from their recorded FLOPs and bytes (this run's "
                           "models and index)"
                           + (f", StepGap's checker as {PROJECTION_MODEL_NAME} too (it is the reasoner)"
                              if checker_is_reasoner else ""),
            "methods": methods, "balances": balances}


# -- the verdict ----------------------------------------------------------------------------------
def _answer(metric: Mapping[str, Any] | None) -> str:
    """yes / no / undetermined / nothing to pay for / unknown, from a balance metric's net interval."""
    net = (metric or {}).get("net")
    if not net:
        return "unknown"
    if net["mean"] == net["low"] == net["high"] == 0.0:
        return "nothing to pay for"
    return "yes" if net["low"] > 0 else "no" if net["high"] < 0 else "undetermined"


def _flipped(d: Mapping[str, float] | None) -> dict[str, float] | None:
    """native minus method from a method-minus-native difference (searches saved, not added)."""
    # + 0.0: a saving of exactly 0 reads "0.00", not "-0.00"
    return {"delta": -d["delta"] + 0.0, "low": -d["high"] + 0.0, "high": -d["low"] + 0.0} if d else None


def _side(bal: Mapping[str, Any], metric: str) -> dict[str, Any]:
    m = (bal.get("metrics") or {}).get(metric) or {}
    return {"spent": m.get("spent"), "saved": m.get("saved"), "net": m.get("net"), "answer": _answer(m),
            "why": m.get("verdict", "") if not m.get("net") else ""}


def verdict(summary: Mapping[str, Any]) -> dict[str, Any]:
    """summary.json's ``verdict``: per checked method, the measured and projected answers, ΔEM,
    non-inferiority and searches saved, read from the summary's own figures, with one sentence."""
    from ragfast.scoring.stats import non_inferiority

    out: dict[str, Any] = {}
    methods = summary.get("methods", {})
    proj = summary.get("projection") or {}
    for method, key, name in CHECKS:
        question = f"Does {name} pay?"
        if method not in methods:
            out[method] = {"question": question, "available": False,
                           "reason": f"{name} did not run in this run (`--method {method}` adds it)"}
            continue
        if "searchr1" not in methods:
            out[method] = {"question": question, "available": False,
                           "reason": f"native Search-R1 did not run, so {name} has nothing to be paired with"}
            continue
        s, bal = methods[method], summary.get(key) or {}
        pbal = (proj.get("balances") or {}).get(method) or {}
        d_em = s.get("delta_em")
        ni = None
        if d_em and all(isinstance(d_em[k], (int, float)) and d_em[k] == d_em[k] for k in ("low", "high")):
            ni = non_inferiority((d_em["low"], d_em["high"]), NON_INFERIORITY_MARGIN).to_dict()
        rec = {"question": question, "available": True, "n_paired": s.get("n_paired"),
               "checker": bal.get("spender", " + ".join(checker_components(method, []))),
               "measured": {"metric": "flops", "unit": "cache-independent FLOPs per question",
                            "components": bal.get("components", {}), **_side(bal, "flops")},
               "projected": {"label": PROJECTED_LABEL, "metric": "flops", "unit": "projected FLOPs per question",
                             "device": (proj.get("device") or {}).get("name"), "reasoner": proj.get("reasoner"),
                             "components": pbal.get("components", {}), **_side(pbal, "flops"),
                             "seconds": _side(pbal, "seconds")},
               "delta_em": d_em, "non_inferiority": ni, "searches_saved": _flipped(s.get("delta_searches"))}
        rec["sentence"] = _sentence(name, rec, summary)
        out[method] = rec
    return out


# -- rendering ------------------------------------------------------------------------------------
def _g(x: float) -> str:
    # 3 significant digits, without an exponent up to 10^6 ("1150", not "1.15e+03")
    return f"{float(f'{x:.3g}'):.0f}" if 1e3 <= abs(x) < 1e6 else f"{x:.3g}"


def _iv(d: Mapping[str, float] | None, scale: float = 1.0, *, key: str = "mean", signed: bool = False,
        nd: int | None = None) -> str:
    """``"1.2 [0.9, 1.5]"``: 3 significant digits, or ``nd`` decimals (signed with ``signed``)."""
    if not d:
        return "-"

    def f(x: float) -> str:
        x = x * scale + 0.0  # -0.0 reads "0"
        if nd is not None:
            return f"{x:+.{nd}f}" if signed else f"{x:.{nd}f}"
        return ("+" if signed and x >= 0 else "") + _g(x)

    return f"{f(d[key])} [{f(d['low'])}, {f(d['high'])}]"


def _net_phrase(side: Mapping[str, Any], unit: str, scale: float) -> str:
    a = side["answer"]
    if a == "unknown":
        return f"unknown ({side.get('why') or 'not computed'})"
    if a == "nothing to pay for":
        return "nothing to pay for (no spend, no saving)"
    word = {"yes": "pays", "no": "does not pay", "undetermined": "undetermined (interval includes 0)"}[a]
    return f"{word}: net saving {_iv(side['net'], scale, signed=True)} {unit}"


def _em_phrase(rec: Mapping[str, Any]) -> str:
    ni = rec.get("non_inferiority")
    em = f"ΔEM {_iv(rec.get('delta_em'), key='delta', signed=True, nd=3)}"
    if ni:
        em += (", non-inferior within 2 points" if ni["non_inferior"]
               else f", not shown non-inferior within 2 points (low {ni['low']:+.3f})")
    return em


def _components_phrase(components: Mapping[str, str], slots: Mapping[str, Any]) -> str:
    """What the measured figures leave out: free components (named with their slot) and unknown ones."""
    parts = [f"the {c} counted as free ({(slots.get(c) or {}).get('name', c)}: a script, not compute)"
             for c, v in components.items() if v == "free"]
    unknown = [c for c, v in components.items() if v == "unknown"]
    if unknown:
        parts.append(", ".join(unknown) + " unknown (a server reported no cost)")
    return " and ".join(parts)


_MEASURED = {
    "yes": "pays for itself on this run's measured FLOPs: net saving {net} GFLOPs per question",
    "no": "does not pay for itself on this run's measured FLOPs: it costs {over} GFLOPs per question more than "
          "it saves",
    "undetermined": "may or may not pay for itself on this run's measured FLOPs: net saving {net} GFLOPs per "
                    "question, an interval that includes 0",
    "nothing to pay for": "has nothing to pay for on this run's measured FLOPs: it spent nothing and the other "
                          "components cost the same",
    "unknown": "cannot be judged on this run's measured FLOPs: {why}",
}
_PROJECTED = {"yes": "it would pay", "no": "it would not pay", "undetermined": "it is undetermined",
              "nothing to pay for": "there is nothing to pay for", "unknown": "it cannot be priced"}


def _never_stops(summary: Mapping[str, Any]) -> bool:
    th = summary.get("s2g_threshold") or {}
    try:
        finite = float(th.get("threshold")) < float("inf")
    except (TypeError, ValueError):
        return False
    return not finite or th.get("feasible") is False


def _sentence(name: str, rec: Mapping[str, Any], summary: Mapping[str, Any]) -> str:
    """One plain sentence: measured, projected, quality."""
    who = "S2G's judge" if name == "S2G" else f"StepGap's checker ({rec['checker']})"
    meas, proj = rec["measured"], rec["projected"]
    net = meas.get("net")
    head = who + " " + _MEASURED[meas["answer"]].format(
        net=_iv(net, 1e-9, signed=True), over=_iv(_neg(net), 1e-9) if net else "-", why=meas.get("why"))
    left_out = _components_phrase(meas.get("components") or {}, summary.get("slots") or {})
    if left_out:
        head += f", with {left_out}"
    if name == "S2G" and _never_stops(summary):
        head += " (S2G never stops early on this run's threshold, so it can save nothing)"
    tail = ""
    if proj["answer"] in ("yes", "no", "undetermined"):
        tail = (f": net saving {_iv(proj['net'], 1e-9, signed=True)} GFLOPs "
                f"({_iv(proj['seconds'].get('net'), 1e3, signed=True)} ms) per question")
    elif proj["answer"] == "unknown":
        tail = f": {proj.get('why') or 'no projection in this summary'}"
    return (f"{head}; projected for {PROJECTION_MODEL_NAME} on an {proj.get('device') or 'H200'}, "
            f"{_PROJECTED[proj['answer']]}{tail}; {_em_phrase(rec)}; searches saved per question "
            f"{_iv(rec.get('searches_saved'), key='delta', signed=True, nd=2)}.")


def _neg(d: Mapping[str, float]) -> dict[str, float]:
    return {"mean": -d["mean"], "low": -d["high"], "high": -d["low"]}


VERDICT_HEADERS = ["question", "measured here (cache-independent GFLOPs/q) [95% CI]",
                   f"projected: {PROJECTION_MODEL_NAME} on an H200 (GFLOPs/q; ms/q) [95% CI]",
                   "ΔEM vs native [95% CI]", "searches saved/q [95% CI]"]


def _verdicts(summary: Mapping[str, Any]) -> list[Mapping[str, Any]]:
    """The summary's verdict records, S2G's then StepGap's."""
    v = summary.get("verdict") or {}
    return [v[m] for m, _, _ in CHECKS if v.get(m)]


def verdict_rows(summary: Mapping[str, Any]) -> list[list[str]]:
    """One row per checked method: the answers with their intervals, or why there is none."""
    rows = []
    for rec in _verdicts(summary):
        if not rec["available"]:
            rows.append([rec["question"], f"no verdict: {rec['reason']}", "-", "-", "-"])
            continue
        proj = rec["projected"]
        pcell = _net_phrase(proj, "GFLOPs/q", 1e-9)
        if proj["answer"] in ("yes", "no", "undetermined"):
            pcell += f"; {_iv(proj['seconds'].get('net'), 1e3, signed=True)} ms/q"
        rows.append([rec["question"], _net_phrase(rec["measured"], "GFLOPs/q", 1e-9), f"{pcell} (projected)",
                     _em_phrase(rec).removeprefix("ΔEM "),
                     _iv(rec.get("searches_saved"), key="delta", signed=True, nd=2)])
    return rows


def verdict_blocks(summary: Mapping[str, Any]) -> list[tuple[Any, ...]]:
    """The report's opening section: the table, one sentence per method and what was priced how."""
    v = summary.get("verdict")
    if not v:
        return [("note", "This summary.json holds no verdict (it was written before ragfast computed one); "
                         "run `ragfast bench --resume` on the directory to add it.")]
    some = any(rec.get("available") for rec in v.values())
    blocks: list[tuple[Any, ...]] = [("table", VERDICT_HEADERS, verdict_rows(summary))] if some else []
    for rec in _verdicts(summary):
        blocks.append(("p", f"{rec['question']} " + (rec["sentence"] if rec["available"]
                                                     else f"No verdict: {rec['reason']}.")))
    if not some:
        return blocks
    proj = summary.get("projection") or {}
    if proj:
        d = proj["device"]
        blocks.append(("note", f"{proj['label'][0].upper()}{proj['label'][1:]}: {proj['priced_from']}, on an "
                               f"{d['name']} at its nominal {d['flops_per_s'] / 1e12:.3g} TFLOP/s and "
                               f"{d['bytes_per_s'] / 1e12:.3g} TB/s, {proj['batch']} sequences per batch, each "
                               "question its own roofline. `ragfast report cost DIR` prices a run on other models "
                               "and devices."))
    blocks.append(("p", "Net saving = what the method saved on the reasoner, encoder and search minus what its "
                        "checker spent, per question against native Search-R1, paired; positive pays. Measured "
                        "FLOPs count every prompt token as computed (cache-independent, as in the balances below). "
                        f"Non-inferiority: the ΔEM interval's lower end above −{NON_INFERIORITY_MARGIN * 100:.0f} "
                        "points (the S2G study's margin)."))
    return blocks


def verdict_lines(summary: Mapping[str, Any]) -> list[str]:
    """The verdict for the terminal: one line per checked method."""
    lines = []
    for rec in _verdicts(summary):
        if not rec["available"]:
            lines.append(f"{rec['question']} no verdict: {rec['reason']}")
            continue
        lines.append(f"{rec['question']} measured: {_net_phrase(rec['measured'], 'GFLOPs/q', 1e-9)}; projected "
                     f"{PROJECTION_MODEL_NAME}/H200: {_net_phrase(rec['projected'], 'GFLOPs/q', 1e-9)}; "
                     f"{_em_phrase(rec)}; searches saved/q "
                     f"{_iv(rec.get('searches_saved'), key='delta', signed=True, nd=2)}")
    return lines
