"""Nested prefixes shared inside one generate call, and rewinding a session.

Oracles: the same calls with sharing off (``share_prefix=False``: every row prefilled on its
own, left-padded) for the greedy tokens and the token books, and a session opened afresh with the
same pieces for ``rewind``. The model is a tiny random-weight Qwen2 (fp32, one thread), the
trajectories are the scripted oracle's native runs over real HotpotQA passages.
"""
from __future__ import annotations

import numpy as np
import pytest

from ragfast.accounting.ledger import CostLedger
from ragfast.methods.s2g.states import prefix_pieces, probe_states
from ragfast.methods.searchr1.loop import SearchR1Config, open_sessions, run_searchr1
from ragfast.models.prefix_share import common_prefix, plan_nested
from ragfast.models.scripted import ScriptedGenerator

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.usefixtures("one_torch_thread")


def test_common_prefix():
    assert common_prefix([1, 2, 3], [1, 2, 4]) == 2
    assert common_prefix([1, 2], [1, 2, 3]) == 2
    assert common_prefix([], [1]) == 0
    assert common_prefix(np.array([5]), [6]) == 0


def _simulate(ids, cached, steps, min_prefix):
    """Replay the plan on token lists: every seed's source must hold the tokens it gives."""
    held = [list(x[:c]) for x, c in zip(ids, cached)]
    for kind, b, src, n in steps:
        assert n <= len(ids[b]) - 1 and n >= len(held[b]) + min_prefix
        if kind == "compute":
            assert src == -1
            held[b] = list(ids[b][:n])
        else:
            assert len(held[src]) >= n and held[src][:n] == list(ids[b][:n])
            held[b] = list(held[src][:n])
    return held


def test_plan_computes_each_chain_once_and_seeds_the_rest():
    prompt = list(range(100, 140))
    chain = [prompt + list(range(k * 50)) + [7, 8] for k in range(4)]  # state k: k blocks, then "<answer>"
    other = [prompt[:6] + [999] * 60]  # another question: shares 6 tokens only
    ids = chain + other
    cached = [0] * len(ids)
    steps = plan_nested(ids, cached, min_prefix=8)
    held = _simulate(ids, cached, steps, 8)
    assert [s for s in steps if s[0] == "compute"] == [("compute", 3, -1, len(chain[3]) - 1)]
    for k in range(3):  # each shorter state takes everything but its own tail from the longest
        assert len(held[k]) == 40 + k * 50
    assert held[4] == []  # 6 shared tokens are under min_prefix
    # A row already holding the instruction gains from nobody: nothing planned for it.
    assert plan_nested([prompt + [1] * 30, prompt + [2] * 30], [40, 40], min_prefix=8) == []
    # A lone row: nothing to share.
    assert plan_nested([prompt + [1] * 30], [0], min_prefix=8) == []


@pytest.mark.parametrize("seed", range(6))
def test_plan_on_random_branching_sessions(seed):
    rng = np.random.default_rng(seed)
    roots = [list(rng.integers(0, 50, 30)) for _ in range(3)]
    ids, cached = [], []
    for _ in range(int(rng.integers(2, 14))):
        r = roots[int(rng.integers(0, 3))]
        cut = int(rng.integers(5, 31))
        ids.append(r[:cut] + list(rng.integers(0, 50, int(rng.integers(1, 20)))))
        cached.append(int(rng.integers(0, min(cut, 12))))
    steps = plan_nested(ids, cached, min_prefix=4)
    held = _simulate(ids, cached, steps, 4)
    # Every row ends holding the longest prefix it shares with a row that holds all but its last
    # token, or within min_prefix of it (a smaller gain is not worth a step).
    for b, x in enumerate(ids):
        for d in range(len(ids)):
            if d != b and len(held[d]) == len(ids[d]) - 1:
                best = min(common_prefix(held[d], x), len(x) - 1)
                assert len(held[b]) > best - 4 or best < cached[b] + 4


@pytest.fixture(scope="module")
def native():
    from ragfast.data import corpus_from_contexts, load_qa, sample
    from ragfast.retrieval.bm25 import BM25Retriever

    qs = load_qa(sample("hotpotqa-dev"))[:5]
    trs = run_searchr1(qs, ScriptedGenerator(), BM25Retriever.build(corpus_from_contexts(qs)),
                       SearchR1Config(batch_size=5, topk=2))
    assert sum(t.searches for t in trs) >= 5  # nested states to share
    return trs


def test_probes_share_nested_prefixes_and_equal_unshared_probes(tiny_qwen2_dir, native):
    from ragfast.models.generator import HFGenerator

    got, books, stats = {}, {}, {}
    for share in (True, False):
        g = HFGenerator(tiny_qwen2_dir, share_prefix=share, min_prefix=8)
        led = CostLedger()
        out = probe_states(native, g, max_new_tokens=6, ledger=led)
        got[share] = [[p["text"] for p in o] for o in out]
        books[share] = led.totals()["reasoner"]
        stats[share] = dict(g.stats)
    assert got[True] == got[False]
    # Every prompt token is booked once, computed or cached, either way; sharing computes fewer.
    assert (books[True]["input_tokens"] + books[True]["cached_tokens"]
            == books[False]["input_tokens"] + books[False]["cached_tokens"])
    assert books[True]["input_tokens"] < 0.6 * books[False]["input_tokens"]
    # What a row took from another is booked cached; what was computed for it is booked input.
    assert [books[k]["cached_tokens"] for k in (True, False)] == [stats[k]["prefix_tokens_reused"] for k in (True, False)]
    assert books[True]["flops"] < 0.6 * books[False]["flops"]
    assert stats[True]["prefill_padding_tokens"] < 0.1 * stats[False]["prefill_padding_tokens"]
    # the longest state of each trajectory was computed (on top of the shared instruction)
    assert stats[True]["prefix_tokens_computed"] > stats[True]["prefix_tokens_reused"] / 10


def test_rewind_keeps_the_prefix_and_equals_a_fresh_session(tiny_qwen2_dir, native):
    from ragfast.methods.searchr1.loop import STOP
    from ragfast.models.generator import HFGenerator

    tr = max(native, key=lambda t: t.searches)
    full, back = prefix_pieces(tr, tr.searches), prefix_pieces(tr, 1)
    g = HFGenerator(tiny_qwen2_dir, min_prefix=8)
    open_sessions(g, ["a"], [tr.question], [full])
    g.generate(["a"], stop=list(STOP), max_new_tokens=5)  # cached: every token but the new ones' last
    g.rewind(["a"], [back])
    open_sessions(g, ["b"], [tr.question], [back])
    assert g.session_tokens("a") == g.session_tokens("b")
    ref = HFGenerator(tiny_qwen2_dir, share_prefix=False)
    open_sessions(ref, ["b"], [tr.question], [back])
    want = ref.generate(["b"], stop=list(STOP), max_new_tokens=8)
    led = CostLedger()
    assert g.generate(["a"], stop=list(STOP), max_new_tokens=8, ledger=led) == want
    assert g.last_generated["a"] == ref.last_generated["b"]
    # The rewound session computed only its last token again (the logits that start its turn).
    assert led.totals()["reasoner"]["input_tokens"] == 1
    # Pieces that differ from what the session holds: only the tokens that still match are kept.
    other = back[:-1] + ["<information>another observation</information>\n\n"]
    g.rewind(["a"], [other])
    ref.end(["b"])
    open_sessions(ref, ["b"], [tr.question], [other])
    assert g.session_tokens("a") == ref.session_tokens("b")
    assert g.generate(["a"], stop=list(STOP), max_new_tokens=8) == ref.generate(["b"], stop=list(STOP),
                                                                                max_new_tokens=8)
    assert g.last_generated["a"] == ref.last_generated["b"]
    with pytest.raises(ValueError, match="rewind"):
        g.rewind(["a"], [])
    with pytest.raises(KeyError, match="rewind"):
        g.rewind(["zz"], [back])


def _live_then_probes(g, native):
    """What S2G's validation does on one generator: the runs' last turns, their sessions ended, then
    the probes of every state."""
    from ragfast.methods.searchr1.loop import STOP

    ids = [t.id for t in native]
    open_sessions(g, ids, [t.question for t in native], [prefix_pieces(t, t.searches) for t in native])
    g.generate(ids, stop=list(STOP), max_new_tokens=4)
    g.end(ids)
    led = CostLedger()
    out = probe_states(native, g, max_new_tokens=6, ledger=led)
    return [[p["text"] for p in o] for o in out], led.totals()["reasoner"]


def test_kept_ended_sessions_seed_the_probes_and_change_no_token(tiny_qwen2_dir, native):
    from ragfast.models.generator import HFGenerator

    ref = HFGenerator(tiny_qwen2_dir, min_prefix=8, memory_budget=None)
    want, ref_book = _live_then_probes(ref, native)
    g = HFGenerator(tiny_qwen2_dir, min_prefix=8, memory_budget=None)
    with g.keep_ended():
        got, book = _live_then_probes(g, native)
    # Every probe is a prefix of its ended session: only its last token (whose logits start the
    # answer) is computed, the rest is taken from the ended session and booked cached.
    n_probes = sum(t.searches + 1 for t in native)
    assert book["input_tokens"] == n_probes
    assert got == want
    assert book["input_tokens"] + book["cached_tokens"] == ref_book["input_tokens"] + ref_book["cached_tokens"]
    assert ref_book["input_tokens"] > 20 * n_probes
    # After the block an ended session keeps nothing: the probes compute their prefixes again.
    again, book2 = _live_then_probes(g, native)
    assert again == want and book2["input_tokens"] == ref_book["input_tokens"]


def test_kept_ended_sessions_give_way_to_the_budget(tiny_qwen2_dir, native):
    """A turn that fits the budget alone but not beside the kept caches: they are dropped (the turn
    runs as one chunk, as on a generator that kept none) and the text is the same."""
    from ragfast.methods.searchr1.loop import STOP
    from ragfast.models.generator import HFGenerator

    def other_turn(g):  # sessions on other prompts, nothing of the kept caches serves them; three times
        # as many as the runs' last turn, whose plan must fit the budget too
        trs = [t for t in native for _ in range(3)]
        ids = [f"{t.id}-other{k % 3}" for k, t in enumerate(trs)]
        open_sessions(g, ids, [f"{t.question} (asked again {k % 3})" for k, t in enumerate(trs)],
                      [prefix_pieces(t, t.searches) for t in trs])
        return g.generate(ids, stop=list(STOP), max_new_tokens=6)

    ref = HFGenerator(tiny_qwen2_dir, min_prefix=8, memory_budget=10 ** 12)  # a budget only to plan the peak
    _live_then_probes(ref, native)
    ref.stats["planned_peak_bytes"] = 0  # the other turn's own
    want = other_turn(ref)
    g = HFGenerator(tiny_qwen2_dir, min_prefix=8, memory_budget=ref.stats["planned_peak_bytes"])
    with g.keep_ended():
        _live_then_probes(g, native)
        assert g.describe()["memory"]["kv_peak_bytes"] > 0
        assert other_turn(g) == want
        assert g.last_chunks == ref.last_chunks == [3 * len(native)]
        # the kept caches went: probes now compute their prefixes again
        led = CostLedger()
        probe_states(native, g, max_new_tokens=6, ledger=led)
    assert led.totals()["reasoner"]["input_tokens"] > 20 * sum(t.searches + 1 for t in native)


def test_shelved_sessions_seed_only_the_block_that_reuses_them(tiny_qwen2_dir, native):
    """The bench's native run shelves its ended sessions for S2G's test-state probes: another live
    session on the same question meanwhile computes and books its whole prompt, the reusing block's
    probes take the shelved keys/values (the same texts, only their last tokens computed), and
    the shelf is emptied by it."""
    from ragfast.methods.searchr1.loop import STOP
    from ragfast.models.generator import HFGenerator

    ids = [t.id for t in native]
    other = [f"{i}-s2g" for i in ids]

    def native_run(g):
        open_sessions(g, ids, [t.question for t in native], [prefix_pieces(t, t.searches) for t in native])
        g.generate(ids, stop=list(STOP), max_new_tokens=4)
        g.end(ids)

    def other_run(g):  # another method's live sessions on the same questions
        open_sessions(g, other, [t.question for t in native], [prefix_pieces(t, 0) for t in native])
        led = CostLedger()
        texts = g.generate(other, stop=list(STOP), max_new_tokens=2, ledger=led)
        g.end(other)
        return texts, led.totals()["reasoner"]

    ref = HFGenerator(tiny_qwen2_dir, min_prefix=8, memory_budget=None)
    want, _ = _live_then_probes(ref, native)
    ref = HFGenerator(tiny_qwen2_dir, min_prefix=8, memory_budget=None)
    native_run(ref)
    want_other = other_run(ref)
    g = HFGenerator(tiny_qwen2_dir, min_prefix=8, memory_budget=None)
    with g.keep_ended(shelve="searchr1"):
        native_run(g)
    assert set(g._shelves) == {"searchr1"} and len(g._shelves["searchr1"]) == len(native)
    # nothing seeds the other sessions from the shelf: the same texts and the same tokens booked
    got_other = other_run(g)
    assert got_other[0] == want_other[0]
    assert (got_other[1]["input_tokens"], got_other[1]["cached_tokens"]) == \
        (want_other[1]["input_tokens"], want_other[1]["cached_tokens"])
    with g.keep_ended(reuse="searchr1"):
        led = CostLedger()
        got = [[p["text"] for p in o] for o in probe_states(native, g, max_new_tokens=6, ledger=led)]
    assert got == want
    assert led.totals()["reasoner"]["input_tokens"] == sum(t.searches + 1 for t in native)
    assert not g._shelves
    with pytest.raises(RuntimeError, match="outermost"):
        with g.keep_ended(), g.keep_ended(reuse="searchr1"):
            pass
