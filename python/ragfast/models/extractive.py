"""The evidence-pack prompt (rendered and parsed) and a rule-based extractive head that answers from it.

:func:`render_pack` writes the only prompt a pack-reading head gets; :func:`parse_pack` reads it
back, so :class:`ExtractiveHead` provably answers from the pack and nothing else.
"""
from __future__ import annotations

import re
import time
from typing import Any, Sequence

from ragfast.accounting.ledger import CostLedger
from ragfast.models.base import Generator
from ragfast.text import (EXTENDED_STOPWORDS, NAME_SPAN_PATTERN, NUMBER_PATTERN, QUOTED_PATTERN, YEAR_PATTERN,
                          content_words, parse_number, whitespace_tokens, words)

__all__ = ["render_pack", "parse_pack", "ExtractiveHead"]


def render_pack(question: str, pack: Sequence[dict[str, Any]], answer_type: str = "span") -> str:
    """The head's prompt: the question and the numbered evidence pack, nothing else."""
    lines = [f"Answer the question using only the evidence below. Answer type: {answer_type}.",
             f"Question: {question}", "Evidence:"]
    for it in pack:
        if it["kind"] == "cell":
            tag = f"cell r{it['row']} c{it['col']} | {it['row_header']} | {it['col_header']}"
        elif it["kind"] == "triple":
            tag = f"triple {it['triple_index']} | reached: {it['reached']}"
        else:
            tag = f"text | {it.get('title', 'paragraph %s' % it.get('para_index'))}"
        snip = " ".join(it["snippet"].split())
        # a tab ends the tag: titles may hold parentheses, whitespace-normalised snippets hold no tab
        lines.append(f"[{it['rank']}] ({tag})\t{snip}")
    lines.append("Answer:")
    return "\n".join(lines)


_PACK_LINE = re.compile(r"^\[(\d+)\] \((text|cell|triple) (.*)\)\t(.*)$")


def parse_pack(prompt: str) -> tuple[str, str, list[dict[str, Any]]]:
    at = re.search(r"Answer type: ([\w/]+)\.", prompt)
    qm = re.search(r"^Question: (.*)$", prompt, re.M)
    items = []
    for line in prompt.splitlines():
        m = _PACK_LINE.match(line)
        if not m:
            continue
        kind, tag, text = m.group(2), m.group(3), m.group(4)
        it: dict[str, Any] = {"rank": int(m.group(1)), "kind": kind, "text": text}
        parts = [p.strip() for p in tag.split("|")]
        if kind == "cell":
            it["row_header"], it["col_header"] = (parts + ["", ""])[1:3]
        elif kind == "triple":
            it["reached"] = tag.split("reached:", 1)[1].strip() if "reached:" in tag else ""
        else:
            it["title"] = parts[1] if len(parts) > 1 else ""
        items.append(it)
    return (qm.group(1) if qm else ""), (at.group(1) if at else "span"), items

_DATE = re.compile(r"\b(?:(?:January|February|March|April|May|June|July|August|September|October|November|December)"
                   r"(?:\s+\d{1,2},)?\s+)?(?:1[5-9]\d\d|20\d\d)\b")
_MONTHS = "January|February|March|April|May|June|July|August|September|October|November|December"


def _fmt_num(x: float) -> str:
    s = f"{round(x, 2):.2f}".rstrip("0").rstrip(".")
    return "0" if s in ("-0", "") else s


class ExtractiveHead(Generator):
    """Rule-based answer extraction from the evidence pack in the prompt. NOT a language model.

    It reads only the rendered pack (so the answer provably comes from the pack) and returns:

    - text evidence: the best span of the highest-ranked item that fits the answer type and is
      not already in the question (a year or date for "when", a number for "how many", a
      capitalised name otherwise; "yes" for yes/no questions, the more frequent HotpotQA answer);
    - table evidence: the cell whose row and column headers overlap the question most; for
      "change / difference / average / percentage change" questions with two years it computes
      the value from the two cells of the best row;
    - triples: the entity each triple reached, best-ranked first.

    ``meaningful = False``: its answers measure whether the pack holds the answer, not reasoning.
    """

    name = "extractive span/cell head (rule-based, NOT an LLM)"
    meaningful = False

    def __init__(self) -> None:
        self._sessions: dict[str, str] = {}

    def start(self, ids: Sequence[str], prompts: Sequence[str]) -> None:
        for i, p in zip(ids, prompts):
            self._sessions[i] = p

    def append(self, ids: Sequence[str], texts: Sequence[str]) -> None:
        for i, t in zip(ids, texts):
            self._sessions[i] += t

    def end(self, ids: Sequence[str]) -> None:
        for i in ids:
            self._sessions.pop(i, None)

    def generate(self, ids: Sequence[str], *, stop: Sequence[str] = (), max_new_tokens: int = 32,
                 ledger: CostLedger | None = None, question_ids: Sequence[str] | None = None) -> list[str]:
        t0 = time.perf_counter()
        outs = [" ".join(self.extract(self._sessions[i]).split()[:max_new_tokens]) for i in ids]
        if ledger is not None and ids:
            # sessions opened under question ids (e.g. by RELOOP's ``lm_complete``) book their cost to them
            qids = list(question_ids) if question_ids is not None else list(ids)
            ledger.add_batch("reasoner", qids, seconds=time.perf_counter() - t0,
                             input_tokens=[whitespace_tokens(self._sessions[i]) for i in ids],
                             output_tokens=[whitespace_tokens(o) for o in outs])
        return outs

    def complete(self, prompts: Sequence[str], *, stop: Sequence[str] = (), max_new_tokens: int = 32,
                 ledger: CostLedger | None = None, question_ids: Sequence[str] | None = None,
                 settled: Any = None) -> list[str]:
        ids = [f"_x{i}" for i in range(len(prompts))]  # an extract: nothing to end early (settled)
        self.start(ids, prompts)
        try:
            return self.generate(ids, stop=stop, max_new_tokens=max_new_tokens, ledger=ledger,
                                 question_ids=question_ids)
        finally:
            self.end(ids)

    # -- extraction ----------------------------------------------------------------------------
    def extract(self, prompt: str) -> str:
        question, atype, items = parse_pack(prompt)
        if not items:
            return ""
        if items[0]["kind"] == "triple":
            return items[0]["reached"]
        if atype == "yes/no":
            return "yes"
        cells = [it for it in items if it["kind"] == "cell"]
        choice = "" if cells else self._choose_option(question, items)
        if choice:
            return choice
        if cells:
            got = self._from_cells(question, atype, cells, items)
            if got:
                return got
        return self._from_text(question, atype, [it for it in items if it["kind"] == "text"] or items)

    def _from_cells(self, question: str, atype: str, cells: list[dict[str, Any]], items: list[dict[str, Any]]) -> str:
        qw = set(content_words(question, EXTENDED_STOPWORDS, min_len=2))
        years = YEAR_PATTERN.findall(question)

        def row_score(it: dict[str, Any]) -> float:
            rw = content_words(it["row_header"], EXTENDED_STOPWORDS, min_len=2)
            return sum(w in qw for w in rw) / (len(rw) or 1) + 0.01 * sum(w in qw for w in rw)

        def col_score(it: dict[str, Any]) -> float:
            ch = it["col_header"]
            return sum(y in ch for y in years) + 0.1 * sum(w in qw for w in content_words(ch, EXTENDED_STOPWORDS, min_len=2))

        best_row = max(cells, key=lambda it: (row_score(it), -it["rank"]))
        if row_score(best_row) == 0 and any(it["kind"] == "text" for it in items) and atype not in ("number", "percent"):
            return ""
        row = [it for it in cells if it["row_header"] == best_row["row_header"]]
        q = question.lower()
        # "In which year was X the largest?": the year column holding the extreme value of the row
        m = re.search(r"\bwhich year\b.*\b(largest|highest|most|greatest|larger|higher|smallest|lowest|least|"
                      r"smaller|lower|fewest)\b", q)
        if m:
            yv = [(YEAR_PATTERN.search(it["col_header"]).group(0), parse_number(it["text"])) for it in row
                  if YEAR_PATTERN.search(it["col_header"]) and parse_number(it["text"]) is not None]
            if yv:
                big = m.group(1) in ("largest", "highest", "most", "greatest", "larger", "higher")
                return (max if big else min)(yv, key=lambda x: x[1])[0]
        # TAT-QA's "2019 average X" is the mean of the 2019 and 2018 values
        if len(years) == 1 and "average" in q:
            years = [years[0], str(int(years[0]) - 1)]
        if len(years) >= 2 and re.search(r"\b(change|difference|increase|decrease|average|growth)\b", q):
            vals = {}
            for y in years[:2]:
                c = next((it for it in row if y in it["col_header"] and parse_number(it["text"]) is not None), None)
                if c is not None:
                    vals[y] = parse_number(c["text"])
            if len(vals) == 2:
                a, b = vals[years[0]], vals[years[1]]
                old, new = (a, b) if years[0] < years[1] else (b, a)
                if "average" in q:
                    return _fmt_num((a + b) / 2)
                if "percent" in q or "%" in q:
                    return _fmt_num((new - old) / old * 100) if old else ""
                return _fmt_num(new - old)
        pick = max(row, key=lambda it: (col_score(it), -it["rank"]))
        return pick["text"]

    def _choose_option(self, question: str, items: list[dict[str, Any]]) -> str:
        """Comparison questions "..., A or B?": the answer is one of the two options.

        With an age/order cue (older, first, earlier / younger, later) the option whose evidence
        shows the earlier / later year wins; otherwise the option whose evidence shares more of
        the question's other content words.
        """
        m = re.search(r"[,:]\s*([^,?:]+?)\s+or\s+([^,?]+?)\s*\??\s*$", question)
        if not m:
            return ""
        opts = [m.group(1).strip(" \"'"), m.group(2).strip(" \"'")]
        if not all(opts):
            return ""
        qlow = question.lower()
        rest = set(content_words(question[:m.start()], EXTENDED_STOPWORDS, min_len=2))
        info = []
        for o in opts:
            ow = set(content_words(o, EXTENDED_STOPWORDS, min_len=2)) or set(words(o))
            mine = [it for it in items
                    if ow and len(ow & set(words(it["text"] + " " + it.get("title", "")))) >= 0.6 * len(ow)]
            years = [int(y) for it in mine for y in YEAR_PATTERN.findall(it["text"])]
            overlap = sum(len(rest & set(words(it["text"]))) for it in mine)
            info.append((min(years) if years else None, overlap))
        dated = all(y is not None for y, _ in info)
        if re.search(r"\b(older|oldest|first|earlier|earliest|before)\b", qlow) and dated:
            return opts[0] if info[0][0] <= info[1][0] else opts[1]
        if re.search(r"\b(younger|youngest|later|latest|newer|most recent|last)\b", qlow) and dated:
            return opts[0] if info[0][0] >= info[1][0] else opts[1]
        return opts[0] if info[0][1] >= info[1][1] else opts[1]

    def _from_text(self, question: str, atype: str, items: list[dict[str, Any]]) -> str:
        # Score every typed candidate span of every item: the item's overlap with the question's
        # content words, its rank, and the span's distance (in words) to the nearest question
        # word in the same sentence (answers sit next to what the question asks about).
        qlow = question.lower()
        qwords = set(words(question))
        qcontent = set(content_words(question, EXTENDED_STOPWORDS, min_len=2))
        best: tuple[float, str] | None = None
        for it in items:
            text = it["text"]
            toks = words(text)
            hits = [k for k, w in enumerate(toks) if w in qcontent]
            base = len(set(toks) & qcontent) + 1.0 / it["rank"]
            cands: list[tuple[str, int]] = []
            if atype == "year":
                cands = [(m.group(0), m.start()) for m in _DATE.finditer(text)]
            elif atype in ("number", "percent", "money"):
                cands = [(m.group(0).strip("()"), m.start()) for m in NUMBER_PATTERN.finditer(text)]
            else:
                cands = [(m.group(1), m.start(1)) for m in QUOTED_PATTERN.finditer(text)]
                for m in NAME_SPAN_PATTERN.finditer(text):
                    span = m.group(0).strip(" .,")
                    parts = span.split()
                    while parts and parts[0].lower() in EXTENDED_STOPWORDS:  # "The 2012 ...", "In March ..."
                        parts = parts[1:]
                    span = " ".join(parts).strip(" .,")
                    # names do not hold digits or month names ("June 12, 1835" is a date)
                    if span and not re.search(r"\d", span) and not re.search(_MONTHS, span):
                        cands.append((span, m.start()))
                title = re.sub(r"\s*\([^)]*\)\s*$", "", it.get("title") or "").strip()
                if title:
                    cands.append((title, -1))
            for c, pos in cands:
                cw = set(words(c))
                if not cw or cw <= qwords or c.lower() in qlow or cw <= EXTENDED_STOPWORDS:
                    continue
                if atype == "person" and not re.match(r"[A-Z]", c):
                    continue
                score = base
                if pos >= 0 and hits:
                    at = len(words(text[:pos]))
                    score += 1.0 / (1.0 + min(abs(at - h) for h in hits) / 4.0)
                elif pos < 0:
                    score += 0.3  # the item's title: a fair guess for "which ..." questions
                if atype == "person" and 2 <= len(c.split()) <= 4:
                    score += 0.5
                if best is None or score > best[0]:
                    best = (score, c)
        if best is not None:
            return best[1]
        # nothing typed: the lead of the best item, cut to a short phrase
        return " ".join(items[0]["text"].split()[:6]) if items else ""
