"""train-reasoner: the training trajectories, the loss mask, exact resume, the mix, the reasoner slot.

Every model here is a tiny random one (a Llama built in the test, the cached tiny Qwen2's
tokenizer), so the quick suite needs no real weights. 57 s for the file on the shared 2-core box.
"""
from __future__ import annotations

import json

import numpy as np
import pytest

from ragfast.errors import ConfigError
from ragfast.types import Question, Trajectory, Turn

torch = pytest.importorskip("torch")
pytest.importorskip("peft")


@pytest.fixture(scope="module")
def tok_dir():
    from ragfast.models.tiny import tiny_path

    return tiny_path("qwen2")


@pytest.fixture(scope="module")
def tokenizer(tok_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tok_dir), local_files_only=True)


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory, tokenizer):
    """A tiny random Llama (the family smollm2 is) with the tiny Qwen2's tokenizer."""
    from transformers import LlamaConfig, LlamaForCausalLM

    d = tmp_path_factory.mktemp("llama")
    torch.manual_seed(3)
    cfg = LlamaConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                      eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    LlamaForCausalLM(cfg).save_pretrained(str(d))
    tokenizer.save_pretrained(str(d))
    return d


def _traj() -> Trajectory:
    tr = Trajectory(id="q1", question="Who wrote Emma?", golden_answers=["Jane Austen"])
    tr.turns = [Turn(index=0, generated="<think> I will search. </think>\n<search> Emma novel </search>",
                     action="search", content="Emma novel",
                     observation="\n\n<information>Doc 1(Title: Emma) Emma is a novel by Jane Austen.</information>\n\n"),
                Turn(index=1, generated="<think> Doc 1 says so. </think>\n<answer> Jane Austen </answer>",
                     action="answer", content="Jane Austen")]
    return tr


def test_sft_example_masks_prompt_and_observations(tokenizer):
    from ragfast.methods.searchr1.sft_data import sft_example

    tr = _traj()
    enc = lambda t: tokenizer(t, add_special_tokens=False)["input_ids"]  # noqa: E731
    prompt = "PROMPT: Who wrote Emma?\n"
    e = sft_example(tokenizer, tr, prompt, eos_id=7)
    p, g0, o0, g1 = enc(prompt), enc(tr.turns[0].generated), enc(tr.turns[0].observation), enc(tr.turns[1].generated)
    # the session exactly as HFGenerator builds it: every piece tokenised alone
    assert e["input_ids"] == p + g0 + o0 + g1 + [7]
    assert e["labels"] == [-100] * len(p) + g0 + [-100] * len(o0) + g1 + [7]
    assert e["n_observation"] == len(o0) and e["n_target"] == len(g0) + len(g1) + 1
    # no end token after a trajectory that did not answer
    tr.turns = tr.turns[:1]
    assert sft_example(tokenizer, tr, prompt, eos_id=7)["input_ids"][-1] != 7


def test_target_token_loss_matches_a_hand_computation(llama_dir, tokenizer):
    from transformers import AutoModelForCausalLM

    from ragfast.models.lora_sft import target_token_loss
    from ragfast.methods.searchr1.sft_data import sft_example

    model = AutoModelForCausalLM.from_pretrained(str(llama_dir)).eval()
    e = sft_example(tokenizer, _traj(), "Question: Who wrote Emma?\n", eos_id=tokenizer.eos_token_id)
    ids = torch.tensor([e["input_ids"]])
    lab = torch.tensor([e["labels"]])
    with torch.no_grad():
        got = float(target_token_loss(model, ids, torch.ones_like(ids), lab))
        logits = model(input_ids=ids).logits[0].double().numpy()
    # by hand: position t predicts token t+1; only positions whose next label is kept count
    logp = logits - np.log(np.exp(logits - logits.max(1, keepdims=True)).sum(1, keepdims=True)) - logits.max(1, keepdims=True)
    nll = [-logp[t, e["labels"][t + 1]] for t in range(len(e["labels"]) - 1) if e["labels"][t + 1] != -100]
    assert len(nll) == e["n_target"]
    assert got == pytest.approx(float(np.mean(nll)), rel=1e-5)
    # an observation token's prediction is not in it: changing the observation's labels to
    # targets changes the loss
    lab2 = torch.tensor([[x if x != -100 else y for x, y in zip(e["labels"], e["input_ids"])]])
    with torch.no_grad():
        assert float(target_token_loss(model, ids, torch.ones_like(ids), lab2)) != pytest.approx(got, rel=1e-4)


def _examples(tokenizer, n=7):
    from ragfast.methods.searchr1.sft_data import sft_example

    rng = np.random.default_rng(0)
    out = []
    for i in range(n):
        tr = _traj()
        tr.id = f"q{i}"
        tr.turns[0].observation += " filler" * int(rng.integers(1, 9))
        out.append(sft_example(tokenizer, tr, f"Question {i}: who?\n", eos_id=tokenizer.eos_token_id))
    return out


def _adapter(out):
    from safetensors.torch import load_file

    return load_file(str(out / "checkpoint" / "adapter_model.safetensors"))


@pytest.mark.parametrize("bf16", [False, True])
def test_lora_sft_stopped_and_resumed_ends_on_the_same_adapter(llama_dir, tokenizer, tmp_path, bf16):
    from transformers import AutoModelForCausalLM

    from ragfast.models.lora_sft import lora_sft

    ex = _examples(tokenizer)
    kw = dict(pad_id=tokenizer.pad_token_id, identity={"n": len(ex)}, epochs=2, lr=5e-2, r=4, batch_size=3,
              micro_batch=1, dropout=0.1, save_every=2, bf16=bf16, log=lambda m: None)
    load = lambda: AutoModelForCausalLM.from_pretrained(str(llama_dir))  # noqa: E731
    full = lora_sft(load(), ex, tmp_path / "a", **kw)
    assert full.finished and full.steps == 6 == full.total
    assert np.mean(full.epoch_loss["1"]) < np.mean(full.epoch_loss["0"])
    part = lora_sft(load(), ex, tmp_path / "b", max_steps=4, **kw)  # stopped after 4 steps (dropout on)
    assert not part.finished and part.steps == 4
    with pytest.raises(ConfigError, match="--resume"):
        lora_sft(load(), ex, tmp_path / "b", **kw)
    with pytest.raises(ConfigError, match="other data"):
        lora_sft(load(), ex[:-1], tmp_path / "b", resume=True, **{**kw, "identity": {"n": 6}})
    rest = lora_sft(load(), ex, tmp_path / "b", resume=True, **kw)
    assert rest.finished and rest.steps == 6 and len(rest.step_seconds) == 2
    a, b = _adapter(tmp_path / "a"), _adapter(tmp_path / "b")
    assert set(a) == set(b) and a
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=0, atol=1e-6)
    assert rest.losses == pytest.approx(full.losses, rel=1e-5)


def test_micro_batches_give_the_step_loss_of_one_padded_batch(llama_dir, tokenizer, tmp_path):
    from transformers import AutoModelForCausalLM

    from ragfast.models.lora_sft import lora_sft

    ex = _examples(tokenizer, 4)
    kw = dict(pad_id=tokenizer.pad_token_id, identity={}, epochs=1, lr=1e-2, r=4, batch_size=4, dropout=0.0,
              max_steps=1, log=lambda m: None)
    one = lora_sft(AutoModelForCausalLM.from_pretrained(str(llama_dir)), ex, tmp_path / "a", micro_batch=1, **kw)
    four = lora_sft(AutoModelForCausalLM.from_pretrained(str(llama_dir)), ex, tmp_path / "b", micro_batch=4, **kw)
    # one padded batch averages over all its target tokens: the micro-batch weights must too
    assert one.losses[0] == pytest.approx(four.losses[0], rel=1e-5)


def test_safe_eligible_counts_states_past_the_first_answerable_one():
    from ragfast.methods.searchr1.sft_data import safe_eligible

    e, s = safe_eligible([1, 3, 4, 2], [1, 1, None, 3])
    # searched once and first answerable after 1: the only eligible state (0) is not safe;
    # 3 searches from first answerable 1: states 1 and 2 are safe; never answerable: none;
    # answered before reaching its first answerable state cannot happen but counts 0
    assert e.tolist() == [1, 3, 4, 2] and s.tolist() == [0, 2, 0, 0]


def test_choose_mix_hits_the_target_prevalence_on_the_training_questions():
    from ragfast.methods.searchr1.sft_data import MixChoice, assign_min_searches, choose_mix

    qids = [f"q{i}" for i in range(200)]
    n = len(qids)
    # min_searches 1: nobody over-searches (0 safe of 2 eligible each): prevalence 0
    # min_searches 2: half the questions get one safe state of 3: 100 / 500 = 0.2
    # min_searches 3: 300 / 800 = 0.375
    runs = {1: ([2] * n, [0] * n), 2: ([2] * 100 + [3] * 100, [0] * 100 + [1] * 100),
            3: ([3] * 100 + [5] * 100, [1] * 100 + [2] * 100)}
    mix = choose_mix(runs, qids, target=0.251)
    assert mix.low == 2 and 0.0 < mix.fraction_high < 1.0
    assert mix.prevalence_by_min == pytest.approx({1: 0.0, 2: 0.2, 3: 0.375})
    got = assign_min_searches(qids, mix)
    el = sum(runs[m][0][i] for i, m in enumerate(got))
    sa = sum(runs[m][1][i] for i, m in enumerate(got))
    assert sa / el == pytest.approx(mix.expected) and abs(sa / el - 0.251) < 0.005
    assert set(got) == {2, 3} and assign_min_searches(qids, mix) == got  # deterministic
    assert assign_min_searches(["x"], MixChoice(1, 0.0, 0.251, 0.0)) == [1]
    with pytest.raises(ConfigError):
        choose_mix({1: ([1] * 10, [0] * 10)}, qids)


class _Retriever:
    """Top-k by shared words over a fixed list of passages (a brute-force oracle retriever)."""

    def __init__(self, passages):
        from ragfast.retrieval.base import Hit

        self.hits = [Hit(id=str(i), score=0.0, document={"id": str(i), "contents": p}) for i, p in enumerate(passages)]

    def search(self, queries, k, exclude=None, ledger=None, question_ids=None):
        out = []
        for q in queries:
            w = set(q.lower().split())
            out.append(sorted(self.hits, key=lambda h: -len(w & set(h.document["contents"].lower().split())))[:k])
        return out


def test_oracle_with_min_searches_searches_past_the_first_answerable_state():
    from ragfast.methods.searchr1.loop import SearchR1Config, SearchR1Loop
    from ragfast.models.scripted import ScriptedGenerator

    ret = _Retriever(['"Emma"\nEmma is a novel written by Jane Austen.', '"Bath"\nBath is a city.',
                      '"Jane Austen"\nJane Austen lived in Bath.'])
    q = Question("q1", "Who wrote the novel Emma?", ["Jane Austen"])
    cfg = SearchR1Config(max_turns=4, topk=1, batch_size=2)
    for m, searches in ((1, 1), (2, 2), (3, 3), (9, 4)):  # capped by the budget
        tr = SearchR1Loop(ScriptedGenerator(min_searches=m), ret, cfg).run([q])[0]
        assert tr.searches == searches and tr.em == 1.0 and tr.turns[-1].action == "answer"
    with pytest.raises(ConfigError):
        ScriptedGenerator(min_searches=-1)


def test_distinct_queries_oracle_never_repeats_a_search():
    """train-reasoner's oracle searches no query twice: with every title read already searched it
    answers (found answer or best guess); the default oracle repeats (the data a model looped on)."""
    from ragfast.methods.searchr1.loop import SearchR1Config, SearchR1Loop
    from ragfast.methods.searchr1.sft_data import repeated_queries
    from ragfast.models.scripted import ScriptedGenerator

    ret = _Retriever(['"Emma"\nEmma is a novel written by Jane Austen.', '"Bath"\nBath is a city.',
                      '"Jane Austen"\nJane Austen lived in Bath.'])
    found = Question("q1", "Who wrote the novel Emma?", ["Jane Austen"])
    missing = Question("q2", "Which novel is set in Bath?", ["Persuasion"])
    cfg = SearchR1Config(max_turns=4, topk=1, batch_size=2)
    old = SearchR1Loop(ScriptedGenerator(min_searches=4), ret, cfg).run([found, missing])
    new = SearchR1Loop(ScriptedGenerator(min_searches=4, distinct_queries=True), ret, cfg).run([found, missing])
    assert repeated_queries(old) > 0 and repeated_queries(new) == 0
    assert [t.searches for t in old] == [4, 4]
    # Jane Austen: the question, then the question with "Emma"; both brought only "Emma" back.
    assert new[0].searches == 2 and new[0].em == 1.0 and new[0].turns[-1].action == "answer"
    assert [t.content for t in new[0].turns[:2]] == ["Who wrote the novel Emma?", "Emma Who wrote the novel Emma?"]
    # No answer anywhere: it stops searching when no unsearched title is left and guesses.
    assert new[1].turns[-1].action == "answer" and "My best guess is" in new[1].turns[-1].generated
    assert new[1].searches < 4 and new[1].em == 0.0


def test_final_answer_only_oracle_writes_the_forced_turn_as_the_reasoner_opens_it():
    """The turn the loop forces (budget spent) is `<answer> X </answer>` alone, as SearchR1Reasoner
    prefixes `<answer>`; other answers keep their <think>; the default oracle thinks first."""
    from ragfast.methods.searchr1.loop import SearchR1Config, SearchR1Loop
    from ragfast.models.scripted import ScriptedGenerator

    ret = _Retriever(['"Emma"\nEmma is a novel written by Jane Austen.', '"Bath"\nBath is a city.'])
    qs = [Question("q1", "Who wrote the novel Emma?", ["Jane Austen"]), Question("q2", "Where is Bath?", ["Somerset"])]
    cfg = SearchR1Config(max_turns=1, topk=1, batch_size=2)
    forced = SearchR1Loop(ScriptedGenerator(min_searches=2, final_answer_only=True), ret, cfg).run(qs)
    plain = SearchR1Loop(ScriptedGenerator(min_searches=2), ret, cfg).run(qs)
    assert [t.stop_reason for t in forced] == ["max_turns", "max_turns"]
    assert forced[0].turns[-1].generated == "<answer> Jane Austen </answer>" and forced[0].em == 1.0
    assert forced[1].turns[-1].generated == "<answer> Emma </answer>"  # its best guess: the one title read
    assert all(t.turns[-1].generated.startswith("<think> ") for t in plain)
    assert [t.answer for t in plain] == [t.answer for t in forced]


def test_oracle_claims_quote_at_most_quote_words():
    """train-reasoner's oracle (quote_words=0) names the document and the answer, and copies no text."""
    from ragfast.methods.searchr1.loop import SearchR1Config, SearchR1Loop
    from ragfast.models.scripted import ScriptedGenerator

    ret = _Retriever(['"Bath"\nBath is a city in Somerset, England, with Roman baths and Georgian houses.',
                      '"Emma"\nEmma is a novel written by Jane Austen.'])
    q = Question("q1", "Who wrote the novel Emma?", ["Jane Austen"])
    cfg = SearchR1Config(max_turns=4, topk=1, batch_size=2)
    turns = {}
    for words in (None, 3, 0):
        tr = SearchR1Loop(ScriptedGenerator(min_searches=2, quote_words=words), ret, cfg).run([q])[0]
        assert tr.em == 1.0
        turns[words] = [t.generated for t in tr.turns]
    assert "says Emma is a novel written by Jane Austen." in turns[None][-1]
    assert "says Emma is a ..." in turns[3][-1]
    assert turns[0][-1] == ("<think> Doc 1 (Emma) names Jane Austen. So the answer is Jane Austen. </think>\n"
                            "<answer> Jane Austen </answer>")
    assert not any("says" in t for t in turns[0])
    with pytest.raises(ConfigError, match="quote_words"):
        ScriptedGenerator(quote_words=-1)


def test_train_reasoner_command_end_to_end_and_the_reasoner_slot(llama_dir, tmp_path):
    """train-reasoner on 6 training questions (BM25), resume, merge, then the adapter as a reasoner."""
    from typer.testing import CliRunner

    from ragfast.cli import app
    from ragfast.models.searchr1_reasoner import SearchR1Reasoner

    out = tmp_path / "r"
    args = ["train-reasoner", "--out", str(out), "--base", str(llama_dir), "--limit", "6", "--retriever", "bm25",
            "--batch-size", "2", "--lora-r", "4", "--save-every", "1", "--max-obs-tokens", "40",
            "--distinct-queries", "--final-answer-only"]
    res = CliRunner().invoke(app, args + ["--max-steps", "2"])
    assert res.exit_code == 0, res.output
    part = json.loads((out / "train_reasoner.json").read_text())
    assert part["steps"] == 2 and not part["finished"] and not (out / "adapter").exists()
    dc = part["data"]
    assert dc["questions"] == 6 and dc["mix"]["target_safe_prevalence"] == pytest.approx(0.251)
    assert 1.0 <= dc["searches_per_question"] <= 4.0 and dc["target_tokens"] < dc["tokens"]
    assert dc["distinct_queries"] and dc["final_answer_only"] and dc["repeated_queries"] == 0
    res = CliRunner().invoke(app, args)  # a second run over a checkpoint is refused (main() prints it, exit 2)
    assert isinstance(res.exception, ConfigError) and "--resume" in str(res.exception)
    res = CliRunner().invoke(app, args + ["--resume", "--merge-out", str(tmp_path / "merged")])
    assert res.exit_code == 0, res.output
    card = json.loads((out / "adapter" / "ragfast_reasoner.json").read_text())
    assert card["finished"] and card["steps"] == 3 and card["examples"] == 6 and card["data"]["quote_words"] == 0
    assert (tmp_path / "merged" / "config.json").exists()
    # the adapter as a reasoner, its base read from its card, through the slot factory too
    from ragfast.runner import slots

    assert isinstance(slots.reasoner(str(out / "adapter")), SearchR1Reasoner)
    gen = SearchR1Reasoner(str(out / "adapter"))
    # observations are cut at the training cap (40) under any longer loop cap, not under a shorter one
    long = " ".join(f"word{i}" for i in range(300))
    assert gen.max_obs_tokens == 40 and "40" in gen.describe()["observation_cap"]
    assert len(gen.encode(gen.truncate_tokens([long], 500)[0])) == 40
    assert len(gen.encode(gen.truncate_tokens([long], 7)[0])) == 7
    # a final turn opens with <answer>, other turns are free
    gen.start(["a", "b"], ["Question: who?\n", "Question: who?\n"])
    gen.mark_final(["a"])
    ta, tb = gen.generate(["a", "b"], stop=["</answer>"], max_new_tokens=3)
    assert ta.startswith("<answer>") and not tb.startswith("<answer>")
    # the merged directory computes what the in-memory merge does
    from transformers import AutoModelForCausalLM

    merged = AutoModelForCausalLM.from_pretrained(str(tmp_path / "merged")).eval()
    ids = torch.tensor([gen.encode("Question: who wrote Emma?")])
    with torch.no_grad():
        torch.testing.assert_close(merged(input_ids=ids).logits, gen.model(input_ids=ids).logits, rtol=1e-4, atol=1e-4)
    gen.end(["a", "b"])


def test_unknown_reasoner_and_missing_base_are_one_clear_error(tmp_path):
    from ragfast.models.searchr1_reasoner import SearchR1Reasoner, merge_reasoner

    with pytest.raises(ConfigError, match="neither a bundled reasoner adapter"):
        SearchR1Reasoner(str(tmp_path))
    (tmp_path / "adapter_config.json").write_text("{}")
    with pytest.raises(ConfigError, match="needs its base"):
        SearchR1Reasoner(str(tmp_path))
    with pytest.raises(ConfigError, match="needs its base"):
        merge_reasoner(str(tmp_path), tmp_path / "m")


def _write_run(d, trajs):
    d.mkdir()
    (d / "results.jsonl").write_text("".join(json.dumps(t.to_dict()) + "\n" for t in trajs))


def test_eval_reasoner_counts_valid_turns_and_pairs_em_by_question(tmp_path):
    from ragfast.methods.searchr1.reasoner_eval import evaluate_reasoner

    def traj(i, turns, em, stop="answer"):
        tr = Trajectory(id=f"q{i}", question="?", golden_answers=["x"], em=em, stop_reason=stop, answer="x" if em else "y")
        tr.turns = [Turn(index=k, generated=g, action=a, content=None) for k, (g, a) in enumerate(turns)]
        return tr

    s = [traj(0, [("<search> a </search>", "search"), ("<answer> x </answer>", "answer")], 1.0),
         traj(1, [("prose", "invalid"), ("<answer> y </answer>", "answer")], 0.0),
         traj(2, [("<search> b </search>", "search"), ("<answer> x </answer>", "answer")], 1.0, "max_turns")]
    c = [traj(i, [("<answer> y </answer>", "answer")], float(i == 2), "max_turns") for i in range(4)]
    _write_run(tmp_path / "s", s)
    _write_run(tmp_path / "c", c)
    ev = evaluate_reasoner(tmp_path / "s", tmp_path / "c", n_resamples=2000)
    se = ev["search"]
    assert se["turns"] == 6 and se["valid_action_fraction"] == pytest.approx(5 / 6)
    # the last turn of a max_turns trajectory is the answer-only one: not a free turn
    assert se["free_turns"] == 5 and se["valid_action_fraction_free_turns"] == pytest.approx(4 / 5)
    assert se["searches_per_question"] == pytest.approx(2 / 3) and se["em"] == pytest.approx(2 / 3)
    # paired on the search run's 3 questions (the closed run's 4th is left out): EM 2/3 vs 1/3
    assert ev["closed_book"]["questions"] == 3 and ev["em_gain"]["delta"] == pytest.approx(1 / 3)
    assert ev["em_gain"]["low"] <= 1 / 3 <= ev["em_gain"]["high"]
    _write_run(tmp_path / "c2", c[:2])
    from ragfast.errors import DataError

    with pytest.raises(DataError, match="lacks 1 of the 3"):
        evaluate_reasoner(tmp_path / "s", tmp_path / "c2")
