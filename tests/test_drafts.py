"""Draft tokens looked up in a row's own context (prompt-lookup decoding) in HFGenerator."""
from __future__ import annotations

import pytest
import torch

from ragfast.accounting.ledger import CostLedger
from ragfast.models.drafts import draft_width, propose, settle
from ragfast.protocol import build_prompt


def test_propose_takes_what_followed_the_latest_longest_match():
    ctx = [1, 2, 3, 9, 9, 7, 2, 3, 4, 5, 6, 1, 2, 3]
    # "1 2 3" occurs at 0 only (not counting the suffix itself): what followed it there.
    assert propose(ctx, 3) == [9, 9, 7]
    # "2 3" alone: its latest earlier occurrence (at 6) wins over the older one.
    assert propose([2, 3, 4, 0, 2, 3, 8, 5, 2, 3], 2, ngram=2) == [8, 5]
    # no 3- or 2-gram match: the last token's latest occurrence
    assert propose([5, 6, 7, 5, 8, 7], 2) == [5, 8]
    assert propose([5, 6, 7, 5, 8, 7], 1) == [5]
    assert propose([1, 2, 3], 4) == []  # nothing recurs
    assert propose([4, 4], 0) == [] and propose([4], 3) == []
    # what followed runs into the end: a loop, which goes round again
    assert propose([7, 8, 7, 8, 7, 8], 5) == [7, 8, 7, 8, 7]
    assert propose([5, 6, 7, 5, 8, 7], 4) == [5, 8, 7, 5]


def test_settle_keeps_each_rows_accepted_drafts_and_leaves_a_stop_out():
    gens = [[10], [20], [30]]
    # row 0 accepts 3 drafts, row 1 two (its third differs), row 2 none (an empty draft)
    k = settle(gens, [[1, 2, 3, 4], [5, 6, 0], []], [[1, 2, 3, 9, 9], [5, 6, 7, 9], [4]], lambda r, g: False)
    assert k == [3, 2, 0] and gens == [[10, 1, 2, 3], [20, 5, 6], [30]]
    # a draft that ends its row's turn is left to the next pick (which ends the turn there)
    gens = [[10]]
    assert settle(gens, [[1, 2, 3]], [[1, 2, 3, 4]], lambda r, g: g[-1] == 2) == [1] and gens == [[10, 1]]
    # the rule sees the drafts before it (a stop string spans tokens)
    gens = [[10]]
    assert settle(gens, [[1, 2, 3]], [[1, 2, 3, 4]], lambda r, g: g[-2:] == [2, 3]) == [2] and gens == [[10, 1, 2]]
    gens = [[10]]
    assert settle(gens, [[1, 2]], [[3, 2, 1]], lambda r, g: False) == [0] and gens == [[10]]


def test_draft_width_drafts_only_for_few_rows():
    from ragfast.models.drafts import DRAFT_ROWS

    assert draft_width(1, 5) == 5 and draft_width(1, 0) == 0 and draft_width(DRAFT_ROWS, 3) == 3
    assert draft_width(DRAFT_ROWS + 1, 5) == 0


@pytest.fixture(scope="module")
def qwen2():
    from ragfast.models.tiny import tiny_path

    n = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny matmuls: one thread (see test_generator.py)
    yield tiny_path("qwen2")
    torch.set_num_threads(n)


def _turns(path, draft_tokens, questions, stop=(), max_new=60, seen=None):
    """Two turns of each question's session (an observation between): the generator, the texts,
    the sessions' tokens and the ledger; ``seen`` gets each turn's (tokens before, generated)."""
    from ragfast.models.generator import HFGenerator

    g = HFGenerator(path, draft_tokens=draft_tokens)
    sids = [f"s{i}" for i in range(len(questions))]
    g.start(sids, [g.format_prompt(build_prompt(q)) for q in questions])
    led = CostLedger()
    out = []
    for turn, n in enumerate((max_new, 40)):
        before = [g.session_tokens(s) for s in sids]
        out.append(g.generate(sids, stop=list(stop), max_new_tokens=n, ledger=led))
        if seen is not None:
            seen.extend((b, g.last_generated[s]) for b, s in zip(before, sids))
        if turn == 0:
            g.append(sids, ["obs 397 1045"] * len(sids))
    return g, out, {s: g.session_tokens(s) for s in sids}, led


def _outputs(led):
    """Each session's output tokens per turn (records come in the order turns finish)."""
    out: dict[str, list[int]] = {}
    for r in led.records:
        out.setdefault(r.question_id, []).append(r.output_tokens)
    return out


def test_drafted_decoding_gives_the_tokens_of_one_token_steps_and_books_every_pass(qwen2):
    """fp32 tiny Qwen2 whose greedy text falls into a loop: drafts are kept, the texts and
    session tokens equal one-token steps', the ledger reads the weights once per pass taken and
    counts every token fed (so FLOPs never fall below the plain run's)."""
    q = ["who wrote hamlet"]
    plain, want, want_tok, led0 = _turns(qwen2, 0, q)
    g, got, tok, led = _turns(qwen2, 5, q)
    assert got == want and tok == want_tok
    kept = g.stats["draft_tokens_kept"]
    assert g.stats["draft_passes"] > 0 and kept > 0 and plain.stats["draft_passes"] == 0
    assert g.stats["decode_steps"] == plain.stats["decode_steps"] - kept
    assert g.describe()["drafts"] == {"draft_tokens": 5, "passes": g.stats["draft_passes"], "tokens_kept": kept}
    read = g.weight_info.read_bytes
    assert sum(r.bytes_scanned for r in led0.records) - sum(r.bytes_scanned for r in led.records) == read * kept
    assert _outputs(led) == _outputs(led0)
    assert all(a.flops >= b.flops for a, b in zip(led.records, led0.records))
    assert sum(a.flops for a in led.records) > sum(b.flops for b in led0.records)  # some drafts were rejected


@pytest.mark.parametrize("questions,wrong_every", [(1, 0), (1, 3), (3, 2)])
def test_a_stop_inside_kept_drafts_ends_the_turn_where_steps_would(qwen2, monkeypatch, questions, wrong_every):
    """Drafts from an oracle (the plain run's own continuation; none wrong, every third, or per
    row every second to fourth, so rows keep different counts and leave masked columns): the
    turns end at the stop string inside a pass's drafts exactly where one-token steps end them."""
    import ragfast.models.drafts as dm
    import ragfast.models.generator as gm

    monkeypatch.setattr(dm, "DRAFT_ROWS", 4)  # every row of the three drafts from the first step
    q = ["who wrote hamlet", "who wrote hamlet and why", "x"][:questions]
    _, first, _, _ = _turns(qwen2, 0, q[:1])
    text = first[0][0]
    stop = text[len(text) // 2:len(text) // 2 + 4]  # mid-turn, past the first passes
    seen: list = []
    _, want, want_tok, led0 = _turns(qwen2, 0, q, stop=[stop], seen=seen)

    def oracle(ctx, k):
        i, before, gen = next((i, b, g) for i, (b, g) in reversed(list(enumerate(seen))) if list(ctx[:len(b)]) == b)
        d = gen[len(ctx) - len(before):][:k]
        every = wrong_every and wrong_every + (i % questions if questions > 1 else 0)
        return [t + 1 if every and j % every == every - 1 else t for j, t in enumerate(d)]

    monkeypatch.setattr(gm, "propose", oracle)
    g, got, tok, led = _turns(qwen2, 5, q, stop=[stop])
    assert got == want and tok == want_tok
    assert _outputs(led) == _outputs(led0)
    assert stop in got[0][0] and g.stats["draft_tokens_kept"] > 0
    if not wrong_every:  # every draft right: a pass keeps all it fed but the turn's end
        assert g.stats["draft_tokens_kept"] >= 3 * g.stats["draft_passes"]


@pytest.mark.parametrize("rows", [2, 4])
def test_rows_that_keep_different_drafts_give_the_tokens_of_one_token_steps(qwen2, monkeypatch, rows):
    import ragfast.models.drafts as dm

    monkeypatch.setattr(dm, "DRAFT_ROWS", rows)
    qs = ["who wrote hamlet", "who wrote hamlet and why", "x", "which river runs through paris"][:rows]
    _, want, want_tok, led0 = _turns(qwen2, 0, qs)
    g, got, tok, led = _turns(qwen2, 5, qs)
    assert got == want and tok == want_tok
    assert _outputs(led) == _outputs(led0)
    assert g.stats["draft_passes"] > 0 and g.stats["draft_tokens_kept"] > 0


def test_draft_tokens_must_not_be_negative(qwen2):
    from ragfast.errors import ConfigError
    from ragfast.models.generator import HFGenerator

    with pytest.raises(ConfigError, match="draft_tokens"):
        HFGenerator(qwen2, draft_tokens=-1)
