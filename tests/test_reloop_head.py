"""RELOOP's chat-LLM head: the short-answer system rule, and answers cut to an evidence span."""
from __future__ import annotations

import pytest

from ragfast.methods.reloop.head_prompt import HEAD_SYSTEM, evidence_span, head_messages, short_span
from ragfast.models.extractive import parse_pack

PACK = [{"rank": 1, "kind": "text", "title": "Jeremy Renner",
         "snippet": "He was nominated for the Academy Award for his role in The Town (2010)."},
        {"rank": 2, "kind": "text", "title": "Arrival (film)", "snippet": "Arrival is a 2016 film starring Amy Adams."}]
Q = "Name the actor who acted in the film Arrival and was nominated for The Town?"


def test_messages_are_the_rule_then_the_pack():
    msgs = head_messages(Q, PACK, "entity")
    assert [m["role"] for m in msgs] == ["system", "user"] and msgs[0]["content"] == HEAD_SYSTEM
    q, at, items = parse_pack(msgs[1]["content"])  # the pack is still the one the extractive head parses
    assert q == Q and at == "entity" and [it["title"] for it in items] == ["Jeremy Renner", "Arrival (film)"]


@pytest.mark.parametrize("raw, want", [
    (" William Shakespeare\n", "William Shakespeare"),
    ("Answer: Dunmore, Ohio.", "Dunmore, Ohio"),
    ('"Jane Austen"', "Jane Austen"),
    ("The answer is 1951", "1951"),
    ("1) 2014\n", "2014"),
    ("(1) Lise Meitner", "Lise Meitner"),
    ("[1] (text | GameFan)", "GameFan"),
    ("[2] (text | Seine)\tthe river", "the river"),
    ("", ""),
    ("yes\nbecause the evidence says so", "yes"),
])
def test_short_span(raw, want):
    assert short_span(raw) == want


@pytest.mark.parametrize("raw, at, want", [
    # a sentence restating the question: the evidence span the question lacks, the later of equals
    ("The actor who acted in the film The Town is Jeremy Renner.", "entity", "Jeremy Renner"),
    ("Yes, both of them were nominated for the award.", "yes/no", "yes"),
    ("The film The Town came out in the year 2010 after Arrival.", "year", "2010"),
    # short answers stay as they are, also when the evidence does not hold them
    ("Amy Adams", "entity", "Amy Adams"),
    ("Tom Hanks", "entity", "Tom Hanks"),
    # no span of the evidence outside the question: the cleaned sentence stays
    ("The actor who acted in the film Arrival was in The Town too.", "entity",
     "The actor who acted in the film Arrival was in The Town too"),
])
def test_evidence_span(raw, at, want):
    assert evidence_span(raw, Q, PACK, at) == want


def test_format_chat_puts_the_system_rule_first():
    pytest.importorskip("torch")
    from ragfast.models.generator import HFGenerator
    from ragfast.models.tiny import tiny_path

    g = HFGenerator(tiny_path("qwen2"))
    text = g.format_chat(head_messages(Q, PACK, "entity"))
    assert text.startswith(f"<|im_start|>system\n{HEAD_SYSTEM}<|im_end|>\n<|im_start|>user\n")
    assert text.endswith("<|im_start|>assistant\n")
