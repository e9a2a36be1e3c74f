"""The doc-set judge's set features: what a state's documents say together."""
import json

import numpy as np
import pytest

from ragfast.judges.docset import (DOCSET_STATE_FEATURES, SET_FEATURES, comparison_sides, doc_body,
                                      question_entities, set_features)

BRIDGE_Q = 'Which city was the director of the film "Moon Harbor" born in?'
FIRST_HOP = '"Moon Harbor") Moon Harbor is a 2009 drama film directed by Jane Rivera.'
SECOND_HOP = '"Jane Rivera") Jane Rivera is an American director, born in Springfield.'
LOOK_ALIKE = '"Sun Harbor (film)") Sun Harbor is a 2010 drama film directed by Tom Hale.'


def feats(question, docs, logits=None):
    z = np.zeros(len(docs)) if logits is None else np.asarray(logits, dtype=float)
    return dict(zip(SET_FEATURES, set_features(question, docs, z)))


def test_bridge_needs_the_second_hop_named_by_the_first():
    both = feats(BRIDGE_Q, [FIRST_HOP, SECOND_HOP, LOOK_ALIKE])
    assert both["bridge_link"] == 1.0 and both["bridge_from_question"] == 1.0 and both["linked_pair"] == 1.0
    first_only = feats(BRIDGE_Q, [FIRST_HOP, LOOK_ALIKE])
    assert first_only["bridge_link"] == 0.0 and first_only["bridge_from_question"] == 0.0
    assert first_only["linked_pair"] == 0.0
    # the link counts from the question's document only: the second hop alone names nobody
    second_only = feats(BRIDGE_Q, [SECOND_HOP, LOOK_ALIKE])
    assert second_only["bridge_from_question"] == 0.0
    assert feats(BRIDGE_Q, [])["bridge_link"] == 0.0
    # bridge_from_top follows the document logits: the best document must be the one that links
    assert feats(BRIDGE_Q, [FIRST_HOP, SECOND_HOP], logits=[1.0, -1.0])["bridge_from_top"] == 1.0
    assert feats(BRIDGE_Q, [FIRST_HOP, SECOND_HOP], logits=[-1.0, 1.0])["bridge_from_top"] == 0.0


def test_comparison_needs_both_sides():
    q = "Which magazine was started first, Red Herring or GameFan?"
    assert comparison_sides(q) == ("red herring", "gamefan")
    red = '"Red Herring (magazine)") Red Herring is a business magazine founded in 1993.'
    game = '"GameFan") GameFan was a video game magazine founded in 1992.'
    both, one = feats(q, [red, game]), feats(q, [red])
    assert both["comparison_both"] == 1.0 and both["comparison_question"] == 1.0
    assert one["comparison_both"] == 0.0 and one["comparison_question"] == 1.0
    assert feats(BRIDGE_Q, [FIRST_HOP])["comparison_question"] == 0.0


def test_coverage_entities_and_logit_counts():
    one, two = feats(BRIDGE_Q, [LOOK_ALIKE]), feats(BRIDGE_Q, [FIRST_HOP, SECOND_HOP])
    assert 0.0 <= one["union_coverage"] < two["union_coverage"] <= 1.0
    assert "moon harbor" in question_entities(BRIDGE_Q)
    assert two["entity_title_match"] > one["entity_title_match"]
    f = feats(BRIDGE_Q, [FIRST_HOP, SECOND_HOP, LOOK_ALIKE], logits=[2.0, -0.5, -3.0])
    assert f["docs_logit_gt0"] == 1.0 and f["docs_logit_gt_m1"] == 2.0
    assert doc_body(FIRST_HOP).startswith("Moon Harbor is")
    with pytest.raises(ValueError):
        set_features(BRIDGE_Q, [FIRST_HOP], [0.0, 1.0])


def test_v1_card_is_refused_with_a_retrain_hint(tmp_path):
    from ragfast.errors import ModelError
    from ragfast.judges.docset import DocSetJudge

    (tmp_path / "docset_judge.safetensors").write_bytes(b"")
    (tmp_path / "docset_judge.json").write_text(json.dumps({"format": "ragfast-docset-judge-v1"}))
    with pytest.raises(ModelError, match="retrain"):
        DocSetJudge(tmp_path)


def test_bundled_card_lists_the_set_features():
    from ragfast.judges.docset import DOCSET_FORMAT, default_docset_judge_path

    card = json.loads(default_docset_judge_path().with_suffix(".json").read_text())
    assert card["format"] == DOCSET_FORMAT
    assert card["state_features"] == list(DOCSET_STATE_FEATURES)
    assert set(SET_FEATURES) <= set(card["state_features"])
