"""Answer metrics (Search-R1 normalisation, HotpotQA F1) and retrieval sufficiency/recall."""
import pytest
from hypothesis import given, settings, strategies as st

from ragfast.scoring.metrics import (exact_match, extract_answer, f1, normalize_answer, recall_at_k, sub_exact_match,
                             sufficient)


@pytest.mark.parametrize("raw,expected", [
    ("The Eiffel Tower!", "eiffel tower"),
    ("  a   cat,  an  apple; the end.  ", "cat apple end"),
    ("Theatre and anthem", "theatre and anthem"),  # articles only as whole words
    ("A-ha", "aha"),  # punctuation goes first, so 'a-ha' is one word
    ("a.b", "ab"),
    ("\tNew\nYork\r\n", "new york"),
    ("Café “Zürich”", "café “zürich”"),  # unicode letters and non-ASCII quotes are kept
    ("ÉCOLE the Straße", "école straße"),
    ("'Hello,' said O'Brien.", "hello said obrien"),
    ("", ""),
    ("the a an", ""),
    ("1,000,000", "1000000"),
])
def test_normalize(raw, expected):
    assert normalize_answer(raw) == expected


def test_normalize_rejects_non_str():
    with pytest.raises(TypeError, match="expects a str"):
        normalize_answer(None)
    with pytest.raises(TypeError, match="expects a str, got int"):
        normalize_answer(3)
    with pytest.raises(TypeError, match="gold answers must be strings, got int: 3"):
        exact_match("x", ["a", 3])


def test_exact_match_multiple_golds_and_none():
    assert exact_match("the Beatles", ["Rolling Stones", "Beatles"]) == 1.0
    assert exact_match("Beatles band", ["Beatles"]) == 0.0
    assert exact_match(None, ["x"]) == 0.0
    assert exact_match("Paris", "paris.") == 1.0


def test_sub_exact_match():
    assert sub_exact_match("It was the Beatles, I think", ["beatles"]) == 1.0
    assert sub_exact_match("Beat", ["Beatles"]) == 0.0
    assert sub_exact_match(None, ["a b"]) == 0.0


def test_f1_values():
    assert f1("the cat sat", ["cat sat on mat"]) == pytest.approx(2 * (1.0 * 0.5) / 1.5)
    assert f1("cat", ["dog", "cat"]) == 1.0  # max over golds
    assert f1("dog", ["cat"]) == 0.0
    # repeated tokens are counted with multiplicity (Counter intersection)
    assert f1("cat cat", ["cat"]) == pytest.approx(2 * 0.5 * 1.0 / 1.5)


def test_f1_yes_no_rule():
    assert f1("yes", ["yes"]) == 1.0
    assert f1("yes it is", ["yes"]) == 0.0  # gold is yes, prediction differs
    assert f1("no", ["no way"]) == 0.0  # prediction is no, gold differs
    assert f1("noanswer", ["no answer"]) == 0.0
    assert f1("Yes.", ["yes"]) == 1.0


@pytest.mark.parametrize("fn", [exact_match, sub_exact_match, f1])
def test_empty_gold_list_is_an_error(fn):
    with pytest.raises(ValueError, match="^empty gold answer list: a metric needs at least one gold answer$"):
        fn("x", [])


@given(st.text(max_size=40), st.text(max_size=40))
@settings(max_examples=100, deadline=None)
def test_metric_invariants(p, g):
    em, sem, score = exact_match(p, [g]), sub_exact_match(p, [g]), f1(p, [g])
    assert 0.0 <= score <= 1.0
    if em == 1.0:
        assert sem == 1.0
        if normalize_answer(g):
            assert score == 1.0
    assert normalize_answer(normalize_answer(p)) == normalize_answer(p)


@pytest.mark.parametrize("text,expected", [
    ("<think>x</think><answer> Paris </answer>", "Paris"),
    ("<answer>a</answer> then <answer>\n b \n</answer>", "b"),  # the last block wins
    ("<answer>x <answer> y </answer></answer>", "y"),  # nested: innermost
    ("<answer> a <answer> b <answer> c </answer>", "c"),  # doubled twice: after the last opening tag
    ("<answer><answer> x </answer>", "x"),  # a doubled tag at the very start of the block
    ("<answer>unclosed", None),
    ("closed only</answer>", None),
    ("<answer>first</answer><answer>unclosed", "first"),
    ("no tags at all", None),
    ("", None),
    (None, None),
    ("<answer></answer>", ""),
    ("<ANSWER>x</ANSWER>", None),  # tags are case sensitive, as the model emits them
])
def test_extract_answer(text, expected):
    assert extract_answer(text) == expected


def test_sufficient_and_recall():
    sup = ["Scott Derrickson", "Ed Wood"]
    assert sufficient(['"Ed Wood"', " Scott Derrickson ", "Other"], sup)
    assert not sufficient(['"Ed Wood"', "Other"], sup)
    assert sufficient(["Ed Wood", "Scott Derrickson"], ["Ed Wood", "Ed Wood", "Scott Derrickson"])
    ranked = ["Other", '"Ed Wood"', "X", "Scott Derrickson"]
    assert recall_at_k(ranked, sup, 1) == 0.0
    assert recall_at_k(ranked, sup, 2) == 0.5
    assert recall_at_k(ranked, sup, 4) == 1.0
    assert recall_at_k(ranked, sup) == 1.0
    assert recall_at_k(ranked, sup, 0) == 0.0
    with pytest.raises(ValueError, match="k must be"):
        recall_at_k(ranked, sup, -1)
    assert not sufficient(["XX"], ["X"])  # only whitespace and quotes are stripped from titles
    with pytest.raises(ValueError, match="^no supporting titles: sufficiency and recall are undefined for this "
                                         "question$"):
        sufficient(["a"], [])
    with pytest.raises(ValueError, match="no supporting titles"):
        recall_at_k(["a"], [], 3)
