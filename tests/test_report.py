"""The bench report from a hand-made summary: plots, report.md, report.html, CSV, console table.

The numbers are made up here (the end-to-end bench test checks real ones); these tests check
what a reader sees: captions, CIs, colours, missing-plot notes, an HTML page that loads.
"""
import base64
import csv
import io
import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from ragfast.comparison import report

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _cost(reasoner_flops, seconds, remote=False):
    c = {"reasoner": {"calls": 10, "tokens": 900, "flops": 0.0 if remote else reasoner_flops, "seconds": seconds},
         "encoder": {"calls": 10, "tokens": 100, "flops": 0.0 if remote else 1e8, "seconds": seconds / 4},
         "search": {"calls": 10, "tokens": 0, "flops": 0.0 if remote else 5e7, "seconds": seconds / 8}}
    c["total"] = {k: sum(v[k] for v in c.values()) for k in ("calls", "tokens", "flops", "seconds")}
    return c


def _summary(remote=False):
    d = lambda a, lo, hi: {"delta": a, "low": lo, "high": hi}  # noqa: E731
    ci = {"em": {"low": 0.3, "high": 0.6}, "flops_per_q": {"low": 1e9, "high": 3e9},
          "seconds_per_q": {"low": 0.01, "high": 0.03}}
    methods = {
        "searchr1": {"em": 0.45, "f1": 0.5, "searches_per_question": 2.0, "n_questions": 10,
                     "cost": _cost(2e10, 0.2, remote), "ci": ci},
        "s2g": {"em": 0.40, "f1": 0.47, "searches_per_question": 1.5, "n_questions": 10,
                "cost": _cost(1.5e10, 0.15, remote), "ci": ci, "delta_em": d(-0.05, -0.15, 0.05),
                "delta_searches": d(-0.5, -0.8, -0.2), "delta_flops": d(-5e8, -7e8, -3e8),
                "delta_seconds": d(-0.005, -0.008, -0.001)},
    }
    bins = [{"lo": i / 10, "hi": (i + 1) / 10, "count": c, "mean_prob": (i + 0.5) / 10 if c else float("nan"),
             "frac_positive": min(1.0, i / 9) if c else float("nan")} for i, c in enumerate([5, 0, 3, 8, 0, 0, 2, 1, 0, 9])]
    return {
        "methods": methods,
        "slots": {"reasoner": {"name": "scripted evidence oracle", "meaningful": False,
                               "answers_meaningful": "NO: knows the gold answers; EM = evidence reachability"},
                  "judge": {"name": "encoder judge", "meaningful": False,
                            "answers_meaningful": "NO: no better than counting documents (validation AP 0.305 vs 0.31)"}},
        # s2g_threshold.json's one schema (methods/s2g/study.threshold_record + study_files.validation_threshold)
        "s2g_threshold": {"threshold": 4.170672377972388, "source": "hotpotqa-dev[0:12]", "judge": "encoder",
                          "labels": "probe", "val_questions": 12, "definition": "per validation state (states 0..S-1)",
                          "feasible": True, "min_precision": 0.9, "min_stops": 10, "val_states": 40,
                          "val_positives": 9, "val_precision": 0.91, "val_recall": 0.2, "val_stops": 11,
                          "val_ap": 0.305, "val_brier": 0.2, "val_ece10": 0.07,
                          "judge_vs_doc_count": {"judge_ap": 0.305, "doc_count_ap": 0.31, "delta": -0.005, "low": -0.1,
                                                 "high": 0.08, "n_questions": 12, "n_states": 40, "meaningful": False,
                                                 "label": "NO: no better than counting documents", "n_positives": 9,
                                                 "measured": True, "judge_ap_merged_ties": 0.29,
                                                 "doc_count_ap_merged_ties": 0.33}},
        "s2g_analysis": {"sweep": {"thresholds": [0, 1, 2], "em": [0.3, 0.4, 0.45], "searches": [0.5, 1, 2],
                                   "unsafe": [0.2, 0.1, 0]}, "calibration": bins, "ece": 0.123, "brier": 0.211},
        "break_even": {"text": "Per question, S2G's early stops saved 0.5 GFLOPs."},
        "run": {"data": "hotpotqa-dev", "n_questions": 10, "corpus_size": 240, "budget": 4, "topk": 3,
                "wall_seconds": 12.3, "seed": 0, "cpus": 2},
    }


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    out = tmp_path_factory.mktemp("report")
    s = _summary()
    plots, missing = report.write_plots(s, out)
    report.write_markdown(s, out, plots, missing)
    report.write_html(s, out, plots, missing)
    report.write_csv(s, out / "summary.csv")
    return out, s, plots, missing


def test_every_plot_written_with_a_caption(written):
    out, _, plots, missing = written
    assert set(plots) == {"pareto.png", "cost_bars.png", "cost_bars_flops.png", "threshold_sweep.png", "reliability.png"}
    assert missing == {}
    for p in plots:
        assert (out / p).read_bytes()[:8] == PNG_MAGIC
        assert len(report.CAPTIONS[p]) > 60


def test_empty_flops_plot_is_not_written_and_the_report_says_why(tmp_path):
    s = _summary(remote=True)
    plots, missing = report.write_plots(s, tmp_path)
    assert "cost_bars_flops.png" not in plots and not (tmp_path / "cost_bars_flops.png").exists()
    assert "remote" in missing["cost_bars_flops.png"]
    md = report.write_markdown(s, tmp_path, plots, missing).read_text()
    assert "cost_bars_flops.png was not drawn" in md
    # the Pareto plot falls back to time when no FLOPs are known
    assert "pareto.png" in plots


def test_component_colours_agree_across_plots(tmp_path, monkeypatch):
    import matplotlib.axes

    seen = []
    orig = matplotlib.axes.Axes.bar

    def spy(self, *a, **k):
        seen.append((k.get("label"), k.get("color")))
        return orig(self, *a, **k)

    monkeypatch.setattr(matplotlib.axes.Axes, "bar", spy)
    s = _summary()
    report.plot_cost_bars(s, tmp_path / "a.png", "seconds")
    report.plot_cost_bars(s, tmp_path / "b.png", "flops")
    by_label = {}
    for label, color in seen:
        assert color == report.COMPONENT_COLORS[label]
        by_label.setdefault(label, set()).add(color)
    assert all(len(c) == 1 for c in by_label.values()) and len(by_label) == 3


def test_markdown_has_every_section_and_readable_numbers(written):
    out, s, _, _ = written
    md = (out / "report.md").read_text()
    for title in ("## Run", "## Slots", "## Methods", "## Against native", "## Cost per question",
                  "## S2G threshold", "## Does the judge pay", "## What the numbers mean", "## Plots"):
        assert title in md, title
    assert "4.171" in md and "4.170672377972388" not in md
    assert "no better than counting documents" in md and "knows the gold answers" in md
    # the threshold paragraph reads s2g_threshold.json's one schema
    assert "12 validation questions" in md and "40 states 0..S-1, 9 right to stop" in md
    assert "validation precision 0.910 over 11 STOP states" in md and "ECE-10 0.070" in md
    assert "stop AP 0.305 vs 0.310" in md and "merged-tie AP 0.290 vs 0.330" in md
    assert "[0.300, 0.600]" in md  # EM CI
    assert "[-0.150, +0.050]" in md  # ΔEM CI
    assert report.CAPTIONS["reliability.png"] in md


def test_html_is_self_contained_with_every_section(written):
    out, _, plots, _ = written
    page = (out / "report.html").read_text()
    md = (out / "report.md").read_text()
    for title in re.findall(r"^## (.+)$", md, flags=re.M):
        assert f">{title.replace('&', '&amp;')}</h2>" in page, title
    imgs = re.findall(r"<img src='data:image/png;base64,([^']+)'", page)
    assert len(imgs) == len(plots)
    for b in imgs:
        assert base64.b64decode(b)[:8] == PNG_MAGIC
    assert "src='http" not in page and "<script" not in page and "summary.json</h2>" not in page
    assert page.count("<figcaption>") == len(plots)


def test_csv_has_ci_columns(written):
    out, s, _, _ = written
    rows = list(csv.DictReader(open(out / "summary.csv", encoding="utf-8")))
    s2g = [r for r in rows if r["method"] == "s2g"]
    assert s2g and float(s2g[0]["delta_em_low"]) == -0.15 and float(s2g[0]["em_ci_high"]) == 0.6
    native = [r for r in rows if r["method"] == "searchr1"]
    assert native[0]["delta_em"] == ""


def test_console_tables_fit_80_columns():
    from rich.console import Console

    buf = io.StringIO()
    report.print_table(_summary(), Console(file=buf, width=80, force_terminal=False))
    text = buf.getvalue()
    assert "…" not in text, text
    assert "[-0.150, +0.050]" in text


def test_fmt_num():
    assert report.fmt_num(4.170672377972388) == "4.171"
    assert report.fmt_num(float("nan")) == "-" and report.fmt_num(float("inf")) == "+inf" and report.fmt_num(7) == "7"


CHROMIUM = shutil.which("chromium") or ("/usr/bin/chromium" if Path("/usr/bin/chromium").exists() else None)


@pytest.mark.skipif(CHROMIUM is None, reason="headless Chromium not installed (apt-get install chromium)")
def test_report_page_loads_in_headless_chromium(written, tmp_path):
    """No console errors, and every image decodes (naturalWidth > 0), in a real browser."""
    out, _, plots, _ = written
    page = (out / "report.html").read_text()
    # a probe script appended to a copy: writes what the browser saw into the DOM, which --dump-dom prints
    probe = ("<script>window.addEventListener('load',()=>{const im=[...document.images];"
             "const ok=im.filter(i=>i.complete&&i.naturalWidth>0).length;"
             "document.body.setAttribute('data-probe',JSON.stringify({n:im.length,ok:ok}));});</script>")
    copy = tmp_path / "probe.html"
    copy.write_text(page.replace("</body>", probe + "</body>"), encoding="utf-8")
    args = [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
            "--enable-logging=stderr", "--v=0", "--virtual-time-budget=5000", "--dump-dom", copy.as_uri()]
    r = subprocess.run(args, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    m = re.search(r"data-probe=\"([^\"]+)\"", r.stdout)
    assert m, r.stdout[-2000:]
    probe_res = json.loads(m.group(1).replace("&quot;", '"'))
    assert probe_res == {"n": len(plots), "ok": len(plots)}
    # the page itself has no script, and the probe logs nothing: any console message is an error
    # (a failed resource, a blocked load...)
    console_msgs = [ln for ln in r.stderr.splitlines() if ":CONSOLE" in ln]
    assert not console_msgs, console_msgs
    # and a screenshot renders
    shot = tmp_path / "shot.png"
    r2 = subprocess.run([CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                         "--hide-scrollbars", f"--screenshot={shot}", "--window-size=1200,2400",
                         (out / "report.html").as_uri()], capture_output=True, text=True, timeout=120)
    assert r2.returncode == 0 and shot.read_bytes()[:8] == PNG_MAGIC, r2.stderr[-2000:]


def test_judge_verdict_not_measured_is_said_so(tmp_path):
    s = _summary()
    s["s2g_threshold"]["judge_vs_doc_count"] = {
        "judge_ap": float("nan"), "doc_count_ap": float("nan"), "delta": float("nan"), "low": float("nan"),
        "high": float("nan"), "n_questions": 12, "n_states": 40, "meaningful": False, "n_positives": 1,
        "measured": False, "label": "too few positives: not measured (1 positive of 40 validation states; "
                                    "a verdict needs 5)"}
    report.write_markdown(s, tmp_path, {}, {})
    md = (tmp_path / "report.md").read_text()
    assert "validation states: too few positives: not measured (1 positive of 40" in md and "nan" not in md


def _balance(net, spent, saved):
    iv = lambda m, lo, hi: {"mean": m, "low": lo, "high": hi}  # noqa: E731
    return {"spender": "judge", "components": {"judge": "measured", "reasoner": "measured", "encoder": "measured",
                                               "search": "measured"},
            "metrics": {"flops": {"spent": iv(*spent), "saved": iv(*saved), "net": iv(*net), "verdict": "x"}},
            "text": "s2g against native Search-R1:\n- flops: judge pays for itself"}


def test_verdict_opens_both_pages_with_the_summary_numbers_and_empty_slots_read_as_such(tmp_path):
    """The verdict section comes first in report.md and report.html and prints the summary's
    figures (written out here by hand); an empty slot reads as empty, never as a bare False."""
    from ragfast.comparison import verdict as bench_verdict

    s = _summary()
    s["slots"]["checker"] = {"name": "none", "meaningful": False}
    s["break_even"] = _balance((2e9, 1e9, 3e9), (5e8, 4e8, 6e8), (2.5e9, 1.5e9, 3.5e9))
    s["projection"] = {"label": "projected (nominal roofline), not measured", "reasoner": "qwen2.5-7b", "batch": 64,
                       "device": {"name": "NVIDIA H200 SXM", "flops_per_s": 989e12, "bytes_per_s": 4.8e12},
                       "priced_from": "the reasoner's recorded tokens priced as Qwen2.5-7B calls",
                       "balances": {"s2g": _balance((4.2e11, 3e11, 5.5e11), (5e8, 4e8, 6e8), (4.2e11, 3e11, 5.5e11))}}
    s["projection"]["balances"]["s2g"]["metrics"]["seconds"] = {
        "net": {"mean": 1.5e-3, "low": 1e-3, "high": 2e-3}, "spent": None, "saved": None}
    s["verdict"] = bench_verdict.verdict(s)
    md = report.write_markdown(s, tmp_path, [], {}).read_text()
    page = report.write_html(s, tmp_path, [], {}).read_text()
    assert re.findall(r"^## (.+)$", md, flags=re.M)[:2] == ["Verdict", "Run"]
    assert re.findall(r"<h2 id='s\d+'>([^<]+)</h2>", page)[:2] == ["Verdict", "Run"]
    sec = md.split("## Verdict\n", 1)[1].split("\n## ", 1)[0]
    row = next(x for x in sec.splitlines() if x.startswith("| Does S2G pay?"))
    # measured: net 2 [1, 3] GFLOPs/q pays; projected: 420 [300, 550] GFLOPs/q and 1.5 [1, 2] ms/q
    assert "pays: net saving +2 [+1, +3] GFLOPs/q" in row
    assert "pays: net saving +420 [+300, +550] GFLOPs/q; +1.5 [+1, +2] ms/q (projected)" in row
    assert "-0.050 [-0.150, +0.050], not shown non-inferior within 2 points" in row  # ΔEM low -0.15 < -0.02
    assert "+0.50 [+0.20, +0.80]" in row  # searches saved = -Δsearches
    assert "Does StepGap pay? No verdict: StepGap did not run in this run" in sec
    assert "Projected (nominal roofline), not measured" in sec
    assert "| checker | none | empty: nothing runs in this slot |" in md and "False" not in md
    assert ">False<" not in page and "empty: nothing runs in this slot" in page
