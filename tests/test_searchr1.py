"""The Search-R1 loop: exact protocol strings, action parsing, turn budget, hooks, resume."""
from __future__ import annotations

import json
import math
import re
from collections import Counter

import pytest

from ragfast.accounting.ledger import CostLedger
from ragfast.errors import ConfigError, DataError
from ragfast.models.base import Generator
from ragfast.models.scripted import ScriptedGenerator
from ragfast.methods.searchr1.loop import (INVALID_OBSERVATION, SearchR1Config, SearchR1Loop, build_prompt,
                                        format_observation, parse_action, run_searchr1,
                                        truncate_whitespace_tokens)
from ragfast.outputs.results import ResultsWriter, read_results, strip_timing
from ragfast.retrieval.base import Hit, Retriever
from ragfast.types import Question


# -- helpers -----------------------------------------------------------------------------------
class LexicalRetriever(Retriever):
    """IDF-weighted word overlap over a corpus: deterministic, dependency-free, for these tests."""

    name = "lexical (test)"

    def __init__(self, rows):
        self.rows = list(rows)
        self.toks = [set(re.findall(r"\w+", r["contents"].lower())) for r in self.rows]
        df = Counter(w for t in self.toks for w in t)
        self.idf = {w: math.log(len(self.rows) / c) for w, c in df.items()}
        self.calls = 0

    def search(self, queries, k, *, exclude=None, ledger=None, question_ids=None):
        self.calls += 1
        out = []
        for qi, q in enumerate(queries):
            qt = set(re.findall(r"\w+", q.lower()))
            ex = set(exclude[qi]) if exclude else set()
            sc = sorted(((sum(self.idf[w] for w in qt & t), i) for i, t in enumerate(self.toks)),
                        key=lambda x: (-x[0], x[1]))
            out.append([Hit(self.rows[i]["id"], s, self.rows[i]) for s, i in sc if self.rows[i]["id"] not in ex][:k])
        if ledger is not None:
            ledger.add_batch("search", list(question_ids), seconds=0.0, calls=[1] * len(queries))
        return out


class ListGenerator(Generator):
    """Replays a fixed list of outputs per session and records everything it was sent."""

    name = "replay (test)"
    meaningful = False

    def __init__(self, scripts):
        self.scripts = scripts  # qid -> list of outputs, one per generation
        self.sessions = {}
        self.calls = []

    def start(self, ids, prompts):
        for i, p in zip(ids, prompts):
            self.sessions[i] = {"text": p, "n": 0}

    def generate(self, ids, *, stop, max_new_tokens, ledger=None):
        self.calls.append(list(ids))
        out = []
        for i in ids:
            s = self.sessions[i]
            script = self.scripts[i]
            t = script[min(s["n"], len(script) - 1)]
            s["n"] += 1
            s["text"] += t
            out.append(t)
        if ledger is not None:
            ledger.add_batch("reasoner", list(ids), seconds=0.0, output_tokens=[len(t.split()) for t in out])
        return out

    def append(self, ids, texts):
        for i, t in zip(ids, texts):
            self.sessions[i]["text"] += t

    def end(self, ids):
        for i in ids:
            self.sessions[i]["ended"] = True


ROWS = [
    {"id": "d0", "contents": '"Paris"\nParis is the capital of France.\nIt has many museums.'},
    {"id": "d1", "contents": '"France"\nFrance is a country in Europe. Its capital is Paris.'},
    {"id": "d2", "contents": '"Berlin"\nBerlin is the capital of Germany.'},
    {"id": "d3", "contents": '"Eiffel Tower"\nThe Eiffel Tower was designed by Gustave Eiffel.'},
]


def _q(i, question="What is the capital of France", golds=("Paris",)):
    return Question(id=f"q{i}", question=question, golden_answers=list(golds))


# -- exact strings -----------------------------------------------------------------------------
def test_build_prompt_is_byte_exact():
    expected = (
        "Answer the given question. You must conduct reasoning inside <think> and </think> first every time you get "
        "new information. After reasoning, if you find you lack some knowledge, you can call a search engine by "
        "<search> query </search> and it will return the top searched results between <information> and "
        "</information>. You can search as many times as your want. If you find no further external knowledge "
        "needed, you can directly provide the answer inside <answer> and </answer>, without detailed illustrations. "
        "For example, <answer> Beijing </answer>. Question: who wrote hamlet?\n")
    assert build_prompt("  who wrote hamlet \n") == expected
    assert build_prompt("who wrote hamlet?") == expected  # no second "?"
    assert build_prompt(Question("x", "who wrote hamlet", ["Shakespeare"])) == expected
    assert "as your want" in expected
    with pytest.raises(DataError, match="empty question"):
        build_prompt("   ")


def test_observation_format_is_byte_exact():
    hits = [Hit(r["id"], 1.0, r) for r in ROWS[:2]]
    obs = format_observation(hits)
    assert obs == ('\n\n<information>Doc 1(Title: "Paris") Paris is the capital of France.\nIt has many museums.\n'
                   'Doc 2(Title: "France") France is a country in Europe. Its capital is Paris.</information>\n\n')
    assert format_observation([]) == "\n\n<information></information>\n\n"
    # Raw contents strings and corpus rows format the same way as hits.
    assert format_observation([r["contents"] for r in ROWS[:2]]) == obs == format_observation(ROWS[:2])


def test_invalid_observation_is_byte_exact():
    assert INVALID_OBSERVATION == (
        "\nMy previous action is invalid. If I want to search, I should put the query between <search> and "
        "</search>. If I want to give the final answer, I should put the answer between <answer> and </answer>. "
        "Let me try again.\n")


@pytest.mark.parametrize("text, expected", [
    ("<think>x</think>\n<search> capital of France </search>", ("search", "capital of France")),
    ("<answer>\n Paris\n</answer>", ("answer", "Paris")),  # DOTALL, stripped
    ("<answer> a </answer><search> b </search>", ("answer", "a")),  # both tags: first match wins
    ("<search> b </search> then <answer> a </answer>", ("search", "b")),
    ("<search> b </answer>", ("invalid", None)),  # mismatched closing tag
    ("<search> unterminated", ("invalid", None)),
    ("<Search> x </Search>", ("invalid", None)),  # tags are case-sensitive in the reference
    ("just thinking", ("invalid", None)),
    ("", ("invalid", None)),
    ("<search></search>", ("search", "")),
])
def test_parse_action(text, expected):
    assert parse_action(text) == expected


def test_truncate_whitespace_tokens_keeps_spacing():
    assert truncate_whitespace_tokens("a  b\nc d", 3) == "a  b\nc"
    assert truncate_whitespace_tokens("a b", 5) == "a b"
    assert truncate_whitespace_tokens("a b", 0) == ""


def test_config_validation():
    with pytest.raises(ConfigError, match="topk"):
        SearchR1Config(topk=0)
    with pytest.raises(ConfigError, match="max_turns"):
        SearchR1Config(max_turns=-1)


# -- the loop on replayed outputs --------------------------------------------------------------
def test_loop_actions_budget_and_one_batched_call_per_turn():
    search = "<think>need it</think>\n<search> capital of France </search>"
    scripts = {
        "q0": ["<think>I know</think>\n<answer> Paris </answer>"],  # answer at turn 0
        "q1": ["no tags at all", "<answer> Paris </answer>"],  # invalid, then answer
        "q2": [search],  # searches forever: budget exhaustion, search disabled in the final turn
        "q3": [search, "<answer> Berlin </answer><search> again </search>"],  # both tags: answer wins
        "q4": [search, search, "<search> x </answer>", search, "<think>done</think> <answer> Paris </answer>"],
    }
    qs = [_q(i) for i in range(5)]
    gen, ret = ListGenerator(scripts), LexicalRetriever(ROWS)
    led = CostLedger()
    tr = {t.id: t for t in run_searchr1(qs, gen, ret, SearchR1Config(max_turns=4, topk=2), ledger=led)}

    assert tr["q0"].stop_reason == "answer" and tr["q0"].answer == "Paris" and tr["q0"].em == 1.0
    assert tr["q0"].searches == 0 and len(tr["q0"].turns) == 1

    assert [t.action for t in tr["q1"].turns] == ["invalid", "answer"]
    assert tr["q1"].turns[0].observation == INVALID_OBSERVATION
    assert INVALID_OBSERVATION in gen.sessions["q1"]["text"]
    assert tr["q1"].em == 1.0

    t2 = tr["q2"]
    assert t2.searches == 4 and len(t2.turns) == 5 and t2.stop_reason == "max_turns"
    assert t2.turns[-1].action == "none" and t2.turns[-1].extra["search_disabled"] is True
    assert t2.turns[-1].retrieved_ids == [] and t2.answer is None and t2.em == 0.0
    assert t2.turns[0].retrieved_ids[0] == "d0" and len(t2.turns[0].retrieved_ids) == 2
    # The observation appended to the session is the formatted top-2 retrieval, byte for byte.
    assert t2.turns[0].observation == format_observation([ROWS[0], ROWS[1]])
    assert gen.sessions["q2"]["text"].count("<information>") == 4 + 1  # 4 observations + the prompt's mention
    assert len(t2.states()) == 5

    assert tr["q3"].turns[1].action == "answer" and tr["q3"].answer == "Berlin" and tr["q3"].em == 0.0
    assert tr["q3"].searches == 1

    t4 = tr["q4"]
    assert [t.action for t in t4.turns] == ["search", "search", "invalid", "search", "answer"]
    assert t4.stop_reason == "max_turns" and t4.answer == "Paris" and t4.searches == 3

    # One batched generator call per turn, over the active trajectories only.
    assert [len(c) for c in gen.calls] == [5, 4, 2, 2, 2]
    assert ret.calls <= 4
    assert all(s.get("ended") for s in gen.sessions.values())
    # Per-question costs are on the trajectories and add up to the ledger.
    assert sum(t.cost["reasoner"]["calls"] for t in tr.values()) == led.totals()["reasoner"]["calls"] == 15
    assert tr["q2"].turns[0].extra["cost"]["search"]["calls"] == 1


def test_answer_comes_from_response_not_prompt():
    # The prompt holds "<answer> Beijing </answer>"; a response without an answer must give None.
    gen = ListGenerator({"q0": ["<think>hmm</think>"]})
    (t,) = run_searchr1([_q(0, golds=("Beijing",))], gen, LexicalRetriever(ROWS), SearchR1Config(max_turns=0))
    assert t.answer is None and t.em == 0.0 and t.stop_reason == "max_turns"
    assert t.turns[0].observation == INVALID_OBSERVATION


def test_hooks_force_answer_finish_and_injected_search():
    search = "<search> capital of France </search>"
    scripts = {f"q{i}": [search, search, search, search, "<answer> Paris </answer>"] for i in range(3)}
    gen, ret = ListGenerator(scripts), LexicalRetriever(ROWS)
    seen = []

    def hook(ctx):
        seen.append((ctx.turn, sorted(it.qid for it in ctx.active)))
        by = {it.qid: it for it in ctx.active}
        if ctx.turn == 0:
            ctx.force_answer([by["q0"]], "judge", text="\nnudge\n")
            ctx.finish([by["q1"]], "checker")
            hits = ctx.search([by["q2"]], ["Eiffel Tower"], reason="repair")
            assert hits[0][0].id == "d3"
            ctx.ledger.add("judge", "q2", input_tokens=7)

    tr = {t.id: t for t in run_searchr1([_q(i) for i in range(3)], gen, ret, SearchR1Config(max_turns=3),
                                        hooks=[hook])}
    assert tr["q0"].stop_reason == "judge" and tr["q0"].searches == 1 and tr["q0"].answer is None
    assert "\nnudge\n" in gen.sessions["q0"]["text"]
    assert tr["q1"].stop_reason == "checker" and len(tr["q1"].turns) == 1
    t2 = tr["q2"]
    assert t2.turns[1].extra["injected"] == "repair" and t2.turns[1].retrieved_ids[0] == "d3"
    # 1 generated search + 1 injected + 1 generated = max_turns 3, then the final generation.
    assert [t.action for t in t2.turns] == ["search", "search", "search", "none"] and t2.searches == 3
    assert t2.cost["judge"]["input_tokens"] == 7
    assert t2.turns[0].extra["cost"]["judge"]["input_tokens"] == 7
    assert seen[0] == (0, ["q0", "q1", "q2"]) and seen[1] == (1, ["q2"])


def test_bad_input_is_named():
    gen, ret = ListGenerator({}), LexicalRetriever(ROWS)
    with pytest.raises(DataError, match="duplicate question id"):
        run_searchr1([_q(0), _q(0)], gen, ret)
    with pytest.raises(DataError, match="no golden answers"):
        run_searchr1([Question("z", "q?", [])], gen, ret)


# -- the scripted oracle -----------------------------------------------------------------------
def _hotpot(n):
    from ragfast.data import corpus_from_contexts, load_qa, sample

    qs = load_qa(sample("hotpotqa-dev"))[:n]
    corpus = corpus_from_contexts(qs)
    return qs, corpus


def test_scripted_oracle_text_is_protocol_faithful():
    qs = [_q(0), _q(1, "Who designed the Eiffel Tower", ("Gustave Eiffel",))]
    gen = ScriptedGenerator()
    tr = run_searchr1(qs, gen, LexicalRetriever(ROWS), SearchR1Config(topk=1))
    assert gen.meaningful is False and "evidence reachability" in gen.describe()["note"]
    for t in tr:
        assert t.em == 1.0
        first = t.turns[0]
        assert first.action == "search" and first.content == t.question  # first search = the question
        for turn in t.turns:
            assert re.fullmatch(r"<think> .* </think>\n<(search|answer)> .* </\1>", turn.generated, re.DOTALL)
        assert re.search(r"Doc \d+ \(.+\) says", t.turns[-1].generated)  # claims cite their document


def test_scripted_oracle_best_guess_when_budget_spent():
    qs = [_q(0, "Who painted the Mona Lisa", ("Leonardo da Vinci",))]
    (t,) = run_searchr1(qs, ScriptedGenerator(), LexicalRetriever(ROWS), SearchR1Config(max_turns=2, topk=1))
    assert t.searches == 2 and t.stop_reason == "max_turns"
    assert t.answer and t.turns[-1].action == "answer" and t.em == 0.0
    # Each later search adds a title read from the previous observation.
    assert t.turns[1].content.startswith(qs[0].question) and t.turns[1].content != qs[0].question


def test_scripted_oracle_reaches_evidence_on_hotpotqa_with_lexical_search():
    qs, corpus = _hotpot(30)
    rows = [corpus.row(i) for i in range(len(corpus))]
    tr = run_searchr1(qs, ScriptedGenerator(), LexicalRetriever(rows), SearchR1Config(batch_size=8))
    em = sum(t.em for t in tr) / len(tr)
    assert em > 0.2, em  # an oracle: EM = how often the gold answer string was retrieved
    assert all(1 <= t.searches <= 4 for t in tr)


def test_determinism_and_resume_after_injected_crash(tmp_path):
    qs, corpus = _hotpot(12)
    rows = [corpus.row(i) for i in range(len(corpus))]
    cfg = SearchR1Config(batch_size=5, seed=3)

    def run(path, crash_after=None, resume=False):
        with ResultsWriter(path, resume=resume) as w:
            n = [0]

            def on_finish(t):
                if crash_after is not None and n[0] == crash_after:
                    raise RuntimeError("injected crash")
                w.write(t.to_dict())
                n[0] += 1

            SearchR1Loop(ScriptedGenerator(seed=3), LexicalRetriever(rows), cfg).run(qs, on_finish=on_finish,
                                                                                   skip_ids=w.done)

    full = tmp_path / "full.jsonl"
    run(full)
    again = tmp_path / "again.jsonl"
    run(again)
    crashed = tmp_path / "crashed.jsonl"
    with pytest.raises(RuntimeError, match="injected crash"):
        run(crashed, crash_after=7)
    assert len(read_results(crashed)) == 7
    with open(crashed, "ab") as f:  # a crash in the middle of a write leaves a partial line
        f.write(b'{"id": "half-writ')
    run(crashed, resume=True)

    def key(path):
        return {r["id"]: strip_timing(r) for r in read_results(path, allow_partial_tail=False)}

    a, b, c = key(full), key(again), key(crashed)
    assert len(a) == 12 and a == b  # deterministic
    assert c == a  # resumed: same ids, same content (timing aside), nothing duplicated
    ids = [json.loads(line)["id"] for line in crashed.read_text().splitlines()]
    assert len(ids) == len(set(ids)) == 12


def test_scripted_oracle_with_the_default_minilm_retriever():
    # The CLI's default retriever: MiniLM over the corpus built from the questions' contexts
    # (embeddings cached on disk after the first run, so later runs only encode the queries).
    torch = pytest.importorskip("torch")
    from ragfast.retrieval import build_default_retriever

    n = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny batches on a shared box: one thread avoids OpenMP spin contention
    try:
        qs, corpus = _hotpot(12)
        ret = build_default_retriever(corpus, progress=False)
        led = CostLedger()
        tr = run_searchr1(qs, ScriptedGenerator(), ret, SearchR1Config(), ledger=led)
    finally:
        torch.set_num_threads(n)
    em = sum(t.em for t in tr) / len(tr)
    assert em >= 0.25, em  # an evidence oracle over the questions' own contexts must often reach the answer
    tot = led.totals()
    assert tot["encoder"]["calls"] > 0 and tot["search"]["calls"] == sum(t.searches for t in tr)
    sup = [t for t in tr if t.supporting_titles]
    assert sup and any(set(t.supporting_titles) <= {x for turn in t.turns for x in turn.retrieved_titles} for t in sup)


def test_refill_keeps_the_batch_full_and_gives_the_same_trajectories():
    search = "<search> capital of France </search>"
    # Question i needs i searches before answering: mixed lengths leave holes in fixed batches.
    scripts = {f"q{i}": [search] * (i % 4) + ["<answer> Paris </answer>"] for i in range(10)}
    qs = [_q(i) for i in range(10)]
    res, calls = {}, {}
    for refill in (False, True):
        gen = ListGenerator(scripts)
        done = []
        tr = run_searchr1(qs, gen, LexicalRetriever(ROWS), SearchR1Config(batch_size=4, refill=refill),
                          on_finish=lambda t: done.append(t.id))
        assert [t.id for t in tr] == [q.id for q in qs] and sorted(done) == sorted(t.id for t in tr)
        res[refill] = [strip_timing(t.to_dict()) for t in tr]
        calls[refill] = [len(c) for c in gen.calls]
    assert res[True] == res[False]
    assert max(calls[True]) == 4 and sum(calls[True]) == sum(calls[False]) == 23
    assert len(calls[True]) < len(calls[False])  # fewer, fuller turns
    assert calls[True][:4] == [4, 4, 4, 4]  # finished slots refilled from the queue

    qs, corpus = _hotpot(10)
    rows = [corpus.row(i) for i in range(len(corpus))]
    a = run_searchr1(qs, ScriptedGenerator(), LexicalRetriever(rows), SearchR1Config(batch_size=3))
    b = run_searchr1(qs, ScriptedGenerator(), LexicalRetriever(rows), SearchR1Config(batch_size=3, refill=True))
    assert [strip_timing(t.to_dict()) for t in a] == [strip_timing(t.to_dict()) for t in b]
