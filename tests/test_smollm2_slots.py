"""smollm2 (SmolLM2-135M-Instruct, the real model of `ragfast models get smollm2`) in every LLM slot,
end to end on a few bundled questions. Slow: .ci/run fetches the model before the slow tests.

What each test can catch: a slot that does not accept the catalogue name, a real tokenizer or chat
template that breaks a path the tiny random models pass, and the packed judge disagreeing with
the per-state reference on a real Llama-architecture model.
"""
import json
import subprocess
import sys

import numpy as np
import pytest

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def smollm2():
    from ragfast.errors import ModelError
    from ragfast.models.catalogue import resolve

    try:
        return resolve("smollm2")
    except ModelError as exc:
        pytest.skip(str(exc))


def _cli(*args, timeout=1800):
    r = subprocess.run([sys.executable, "-m", "ragfast.cli", *map(str, args)], capture_output=True, text=True,
                       timeout=timeout)
    assert r.returncode == 0, r.stderr[-3000:]
    return r


def _summary(out):
    return json.loads((out / "summary.json").read_text())


def _states():
    from ragfast.data import load_qa
    from ragfast.types import State

    out = []
    for q in load_qa("hotpotqa-dev")[:2]:
        ctx = q.metadata["context"]
        docs = [f'\n\n<information>Doc 1(Title: "{t}") {"".join(s)}</information>\n\n'
                for t, s in zip(ctx["title"][:2], ctx["sentences"][:2])]
        out += [State(q.question, docs[:i], q.id, i) for i in range(3)]
    return out


def test_reasoner_and_closed_book(smollm2, tmp_path):
    # Short turns keep this to minutes on a loaded 2-core machine: the untrained model writes prose
    # (no tags), so every turn runs to the token cap.
    _cli("run", "searchr1", "--reasoner", "smollm2", "--offset", 0, "--limit", 2, "--budget", 1, "--max-new-tokens", 16,
         "--out", tmp_path / "rag")
    _cli("run", "searchr1", "--reasoner", "smollm2", "--budget", 0, "--offset", 0, "--limit", 2, "--max-new-tokens", 16,
         "--out", tmp_path / "cb")
    rag, cb = (_summary(tmp_path / d)["methods"]["searchr1"] for d in ("rag", "cb"))
    man = json.loads((tmp_path / "rag" / "manifest.json").read_text())
    assert "smollm2" in man["slots"]["reasoner"]["name"] and man["slots"]["reasoner"]["meaningful"]
    assert rag["n_questions"] == cb["n_questions"] == 2
    assert cb["searches_per_question"] == 0.0  # closed book: not one retrieval


def test_bundled_searchr1_adapter_runs_on_the_real_base(smollm2, tmp_path):
    # The shipped adapter (ragfast/adapters/smollm2_searchr1) on the real SmolLM2 base: it must
    # load from the installed package, change the weights (an adapter that merged to nothing would
    # pass every tiny-model test), and run the Search-R1 loop; the closed-book run's answer-only
    # turn opens with <answer>.
    import torch
    from transformers import AutoModelForCausalLM

    from ragfast.models.searchr1_reasoner import adapter_dir, load_merged

    base = AutoModelForCausalLM.from_pretrained(str(smollm2), local_files_only=True, dtype=torch.float32)
    merged, _ = load_merged(smollm2, adapter_dir("smollm2-searchr1"))
    name = next(n for n, _ in merged.named_parameters() if n.endswith("layers.29.self_attn.q_proj.weight"))
    delta = (dict(merged.named_parameters())[name] - dict(base.named_parameters())[name]).abs().max().item()
    assert delta > 1e-6, delta
    _cli("run", "searchr1", "--reasoner", "smollm2-searchr1", "--offset", 0, "--limit", 2, "--budget", 0, "--max-new-tokens", 16,
         "--out", tmp_path / "cb")
    man = json.loads((tmp_path / "cb" / "manifest.json").read_text())
    assert man["slots"]["reasoner"]["name"] == "smollm2-searchr1"
    assert man["slots"]["reasoner"]["adapter"].endswith("smollm2_searchr1")
    turns = [json.loads(line) for line in (tmp_path / "cb" / "trajectories" / "searchr1.jsonl").read_text().splitlines()]
    assert len(turns) == 2
    assert all(t["turns"][-1]["generated"].startswith("<answer>") for t in turns), [t["turns"][-1] for t in turns]


def test_zero_shot_judge_packed_equals_reference(smollm2):
    from ragfast.judges.causal import CausalJudge
    from ragfast.runner import slots

    judge = slots.judge("smollm2")
    assert isinstance(judge, CausalJudge) and judge.meaningful
    assert judge.config.architectures == ["LlamaForCausalLM"]
    states = _states()
    naive = judge.stop_scores(states, packed=False)
    assert np.isfinite(naive).all() and np.ptp(naive) > 1e-3
    np.testing.assert_allclose(judge.stop_scores(states), naive, atol=2e-3, rtol=0)


def test_teacher_labels_every_state(smollm2):
    from ragfast.methods.s2g.labelling import LabelledState, teacher_labels

    states = [LabelledState(s.trajectory_id, s.index, s.question, list(s.evidence), []) for s in _states()[:3]]
    counts = teacher_labels(states, "smollm2", route="auto", max_new_tokens=24)
    assert counts["strict"] + counts["lenient"] + counts["failed"] == 3
    assert counts["scored"] == counts["failed"]
    assert all(s.labels["teacher"] in (0, 1) for s in states)


def test_train_judge_base(smollm2, tmp_path):
    from ragfast.methods.s2g.labelling import LabelledState

    rows = [LabelledState(s.trajectory_id, s.index, s.question, list(s.evidence), [], labels={"gold": int(s.index == 2)})
            for s in _states()]
    lab = tmp_path / "labels.jsonl"
    lab.write_text("".join(json.dumps(r.to_dict()) + "\n" for r in rows))
    _cli("train-judge", "--kind", "causal", "--base", "smollm2", "--labels", lab, "--label-source", "gold",
         "--max-steps", 1, "--out", tmp_path / "j")
    assert (tmp_path / "j" / "checkpoint").exists() or (tmp_path / "j" / "merged").exists()


def test_stepgap_checker_and_reloop_head(smollm2, tmp_path):
    _cli("run", "stepgap", "--reasoner", "scripted", "--checker-llm", "smollm2", "--limit", 1, "--budget", 2, "--out", tmp_path / "sg")
    sg = _summary(tmp_path / "sg")
    assert sg
    _cli("run", "reloop", "--reasoner", "scripted", "--generator", "smollm2", "--limit", 1, "--out", tmp_path / "rl")
    man = json.loads((tmp_path / "rl" / "manifest.json").read_text())
    assert "smollm2" in json.dumps(man["slots"])


def test_stepgap_llm_prompted_nli(smollm2, tmp_path):
    # No checker LLM, so stages D-E decide every claim through the LLM-prompted NLI scorer.
    _cli("run", "stepgap", "--reasoner", "scripted", "--checker-llm", "none", "--nli", "smollm2", "--limit", 1, "--budget", 2,
         "--out", tmp_path / "sg")
    assert _summary(tmp_path / "sg")["methods"]["stepgap"]["report"]["checker_cost_per_question"]["nli_pairs"] > 0
    nli = json.loads((tmp_path / "sg" / "manifest.json").read_text())["slots"]["nli"]
    assert nli["class"] == "LLMNLIScorer" and "LLM-prompted" in nli["kind"]
