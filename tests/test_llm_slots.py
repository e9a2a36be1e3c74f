"""One name in every LLM slot: catalogue names resolve (or fail in one line naming `ragfast models
get`), the teacher's scoring route for small models, the StepGap defaults, and (slow) smollm2 in
each slot on a few questions."""
import dataclasses
import json

import numpy as np
import pytest

from ragfast.errors import ModelError
from ragfast.methods.s2g.labelling import LabelledState, teacher_labels
from ragfast.models.hub import local_model
from ragfast.runner import slots


@pytest.fixture
def empty_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("RAGFAST_CACHE", str(tmp_path))
    return tmp_path


@pytest.mark.parametrize("slot", ["reasoner", "judge", "checker", "head", "train-base"])
def test_uncached_model_names_the_command_in_every_slot(slot, empty_cache):
    make = {"reasoner": lambda: slots.reasoner("smollm2"), "judge": lambda: slots.judge("smollm2"),
            "checker": lambda: slots.checker("smollm2"), "head": lambda: slots.head("smollm2"),
            "train-base": lambda: local_model("smollm2")}[slot]
    with pytest.raises(ModelError, match=r"run `ragfast models get smollm2`"):
        make()
    assert local_model("/some/dir") == "/some/dir"


def test_stepgap_defaults_name_a_backend():
    # `ragfast run stepgap` with no flags once passed backend=None to the NLI factory.
    from ragfast.runner.settings import RunSettings

    s = dataclasses.asdict(RunSettings(methods=["stepgap"]))
    assert s["nli_backend"] == "auto" and s["nli"] == "tiny"
    assert slots.nli(s["nli"], backend=s["nli_backend"]) is not None


def _labelled(n_traj=3):
    rng = np.random.default_rng(3)
    words = "river album film born city capital singer novel treaty king".split()
    out = []
    for t in range(n_traj):
        q = f"Which {rng.choice(words)} is number {t}?"
        ev = []
        for k in range(3):
            out.append(LabelledState(id=f"q{t}", state=k, question=q, evidence=list(ev), retrieved_titles=[]))
            ev.append("\n\n<information>Doc 1(Title: \"X\") " + " ".join(rng.choice(words, 6)) + "</information>\n\n")
    return out


@pytest.fixture(scope="module")
def tiny_dir():
    from ragfast.models.tiny import tiny_path

    return tiny_path("qwen2")


def test_teacher_score_route_labels_by_true_false_logp(tiny_dir):
    from ragfast.judges.causal import CausalJudge

    states = _labelled()
    counts = teacher_labels(states, str(tiny_dir), route="score")
    assert counts["scored"] == len(states) and counts["failed"] == 0
    # Independent reference: every state as its own full prompt (no packing).
    ref = CausalJudge(tiny_dir).stop_scores([s.to_state() for s in states], packed=False)
    assert [s.labels["teacher"] for s in states] == [int(x > 0) for x in ref]
    assert all(s.provenance["teacher"]["route"] == "score" for s in states)
    np.testing.assert_allclose([s.provenance["teacher"]["score"] for s in states], ref, atol=1e-4)


def test_teacher_auto_route_scores_only_the_parse_failures(tiny_dir):
    states = _labelled(2)
    gen = _labelled(2)
    g = teacher_labels(gen, str(tiny_dir), route="generate", max_new_tokens=8)
    a = teacher_labels(states, str(tiny_dir), route="auto", max_new_tokens=8)
    # The random tiny model rarely writes a parseable verdict in 8 tokens: those get the score.
    assert a["failed"] == g["failed"] > 0 and a["scored"] == g["failed"]
    assert sum(s.labels["teacher"] is None for s in gen) == g["failed"]
    assert all(s.labels["teacher"] in (0, 1) for s in states)
    for s, r in zip(states, gen):
        if r.labels["teacher"] is not None:  # parsed verdicts are kept as they were
            assert s.labels["teacher"] == r.labels["teacher"] and "route" not in s.provenance["teacher"]
    with pytest.raises(Exception, match="teacher route"):
        teacher_labels(states, str(tiny_dir), route="vote")


def test_reloop_head_reads_the_pack_through_the_chat_template(tmp_path):
    """An instruction-tuned head gets the evidence pack as a user message; the extractive head raw."""
    from ragfast.commands.methods import run_one
    from ragfast.models.base import Generator

    class Templated(Generator):
        name = "templated recorder (test, not an LLM)"
        meaningful = False

        def __init__(self):
            self.seen = []

        def format_prompt(self, text):
            return f"<user>{text}</user><assistant>"

        def start(self, ids, prompts):
            self.seen += list(prompts)

        def generate(self, ids, *, stop, max_new_tokens, ledger=None):
            return ["Paris\n"] * len(ids)

        def append(self, ids, texts):
            pass

        def end(self, ids):
            pass

    lm = Templated()
    s = run_one("reloop", reasoner="scripted",
                data="hotpotqa-dev", out=str(tmp_path / "o"), budget=2, batch_size=2, limit=2, offset=0,
                encoder="hashing", judge="heuristic", progress=False, components={"head": lm})
    assert s["methods"]["reloop"]["n_questions"] == 2 and lm.seen
    assert all(p.startswith("<user>Answer the question using only the evidence below.") and
               p.endswith("Answer:</user><assistant>") for p in lm.seen)
