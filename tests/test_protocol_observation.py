"""protocol.parse_observation / split_documents: the one reader of the ``Doc i(Title: ...)`` format.

Oracles: hand-written observations, and the regular expressions the judges and StepGap's checker
used before they shared this reader (kept here, independent of the package's code).
"""
from __future__ import annotations

import random
import re

from ragfast.protocol import format_observation, observation_blocks, parse_observation, split_documents
from ragfast.text import truncate_whitespace_tokens

# The readers as they were before issue 25 (stepgap/checker.py and models/judge.py, cross_judge.py).
OLD_DOC = re.compile(r"Doc (\d+)\(Title: (.*?)\) (.*?)(?=\nDoc \d+\(Title: |\Z)", re.DOTALL)
OLD_INFO = re.compile(r"<information>(.*?)(?:</information>|\Z)", re.DOTALL)
OLD_SPLIT = re.compile(r"(?:^|\n)\s*Doc \d+\(Title: ")
OLD_TAGS = re.compile(r"^\s*<information>|</information>\s*$")
# The scripted oracle's reader before issue 25 (models/scripted.py): one list per block, one block per search.
OLD_SCRIPTED_DOC = re.compile(r"Doc (\d+)\(Title: (.*?)\) (.*?)(?=\nDoc \d+\(Title: |</information>|\Z)", re.DOTALL)


def old_parse(observation):
    return [(int(m.group(1)), m.group(2).strip().strip('"'), m.group(3).strip())
            for b in OLD_INFO.findall(observation) for m in OLD_DOC.finditer(b.strip())]


def old_split(block):
    body = OLD_TAGS.sub("", block.strip()).strip()
    docs = [p.strip() for p in OLD_SPLIT.split(body) if p.strip()]
    return docs if docs else ([body] if body else [])


def test_hand_written_observations():
    obs = format_observation(['"Paris"\nParis is the capital of France.', "Lyon\nA city.\nSecond line."])
    assert obs == ('\n\n<information>Doc 1(Title: "Paris") Paris is the capital of France.\n'
                   "Doc 2(Title: Lyon) A city.\nSecond line.</information>\n\n")
    docs = parse_observation("I searched." + obs)
    assert [(d.rank, d.title, d.text) for d in docs] == [(1, "Paris", "Paris is the capital of France."),
                                                         (2, "Lyon", "A city.\nSecond line.")]
    assert [d.raw for d in docs] == ['"Paris") Paris is the capital of France.', "Lyon) A city.\nSecond line."]
    # truncated before </information>: the last document is cut where the truncation cut it
    assert [(d.rank, d.text) for d in parse_observation(obs.strip()[:-len(" line.</information>")])] == [
        (1, "Paris is the capital of France."), (2, "A city.\nSecond")]
    assert parse_observation("no information here") == [] and parse_observation("") == []
    # the judges' reading: one string per Doc, a preamble or a plain block is a document of its own
    assert split_documents(obs) == ['"Paris") Paris is the capital of France.', "Lyon) A city.\nSecond line."]
    assert split_documents("<information>note\nDoc 1(Title: A) x</information>") == ["note", "A) x"]
    assert split_documents("  plain evidence  ") == ["plain evidence"] and split_documents("  ") == []


def test_the_one_reader_equals_the_four_old_ones_on_random_observations():
    rng = random.Random(7)
    words = ["alpha", "Beta", "(gamma)", "d) e", "Doc", "Title:", "x\ny", '"q"', "2(Title", ""]
    for _ in range(400):
        n = rng.randint(0, 5)
        rows = ["\n".join(" ".join(rng.choice(words) for _ in range(rng.randint(0, 6)))
                          for _ in range(rng.randint(1, 3))) for _ in range(n)]
        obs = format_observation(rows)
        if rng.random() < 0.3:  # truncation cuts the closing tag and part of the text
            obs = obs[: rng.randint(len("<information>") + 2, max(len("<information>") + 2, len(obs)))]
        got = [(d.rank, d.title, d.text) for d in parse_observation(obs)]
        assert got == old_parse(obs), (obs, got)
        block = obs.strip()
        assert split_documents(block) == old_split(block), block


def test_blocks_equal_the_scripted_oracles_old_reader_on_random_turns():
    """observation_blocks (what the scripted reasoner reads) keeps the blocks apart, one per search,
    exactly as the oracle's own regular expressions did: several searches in one appended text,
    text between them, and a last block truncated at a whitespace token (the scripted reasoner's
    ``max_obs_tokens`` cut, :func:`ragfast.text.truncate_whitespace_tokens`)."""
    rng = random.Random(11)
    words = ["alpha", "Beta", "(gamma)", "d) e", "Doc", "Title:", "x\ny", '"q"', "2(Title", ""]
    for _ in range(300):
        parts = []
        for _ in range(rng.randint(0, 3)):
            rows = ["\n".join(" ".join(rng.choice(words) for _ in range(rng.randint(0, 6)))
                              for _ in range(rng.randint(1, 3))) for _ in range(rng.randint(0, 4))]
            parts.append(rng.choice(["", "<search> q </search>", "I read."]) + format_observation(rows))
        turn = "".join(parts)
        if parts and rng.random() < 0.3:  # cut as the loop cuts the oracle's observations: at a token's end
            turn = truncate_whitespace_tokens(turn, rng.randint(1, max(1, len(turn.split()))))
        want = [[(int(m.group(1)), m.group(2).strip().strip('"'), m.group(3).strip()) for m in OLD_SCRIPTED_DOC.finditer(b)]
                for b in OLD_INFO.findall(turn)]
        got = [[(d.rank, d.title, d.text) for d in block] for block in observation_blocks(turn)]
        assert got == want, (turn, got, want)
        assert [d for b in observation_blocks(turn) for d in b] == parse_observation(turn)
