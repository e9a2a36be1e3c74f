"""Judge training: state labelling (probe / gold / teacher), LoRA SFT of a causal judge on tiny
Qwen2, the bundled cross-encoder judge and its trainer."""
import json
import subprocess
import sys

import numpy as np
import pytest

from ragfast.accounting.ledger import CostLedger
from ragfast.errors import ConfigError, DataError, ModelError
from ragfast.types import State, Trajectory, Turn

WORDS = "river mountain album film born played city capital director singer novel".split()


# -- a recorded native run ------------------------------------------------------------------------
def _obs(titles):
    docs = "".join(f'Doc {i + 1}(Title: "{t}") {t} is a {WORDS[i % len(WORDS)]} of note.\n' for i, t in enumerate(titles))
    return f"\n\n<information>{docs.strip()}</information>\n\n"


def _native_run(d, n=6, early=()):
    """native.jsonl + states.jsonl as `ragfast run s2g` writes them (two searches per question;
    questions in ``early`` find both supporting titles in their first search)."""
    d.mkdir(parents=True, exist_ok=True)
    trs, recs = [], []
    for i in range(n):
        sup = [f"A{i}", f"B{i}"]
        first, second = [f"A{i}", f"X{i}"], ([f"B{i}", f"Y{i}"] if i % 2 == 0 else [f"Y{i}", f"Z{i}"])
        if i in early:
            first, second = [f"A{i}", f"B{i}"], [f"Y{i}", f"Z{i}"]
        turns = [Turn(0, "<search>q</search>", "search", "q", [], first, [], _obs(first)),
                 Turn(1, "<search>q2</search>", "search", "q2", [], second, [], _obs(second)),
                 Turn(2, "<answer>x</answer>", "answer", "x")]
        tr = Trajectory(f"q{i}", f"Which {WORDS[i % len(WORDS)]} did A{i} make?", ["x"], turns, "x", 1.0, 1.0, "answer",
                        supporting_titles=sup)
        trs.append(tr)
        recs.append({"id": tr.id, "split": "val" if i < 2 else "test", "scores": [None, 0.1, 0.2],
                     "probe_em": [0.0, float(i % 3 == 0), 1.0], "probe_answers": [None, "y", "x"],
                     "native_em": 1.0, "native_searches": 2, "native_answer": "x"})
    (d / "native.jsonl").write_text("".join(json.dumps(t.to_dict()) + "\n" for t in trs))
    (d / "states.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    return trs


def test_label_states_probe_gold_agreement(tmp_path):
    from ragfast.methods.s2g.labelling import label_states, load_labelled_states

    _native_run(tmp_path / "run")
    s = label_states(tmp_path / "run", ["probe", "gold"])
    assert s["n_states"] == 12 and s["n_questions"] == 6
    got = load_labelled_states(s["file"])
    by = {(x.id, x.state): x for x in got}
    # gold: sufficient only after the second search of even questions (B_i retrieved)
    assert [by[(f"q{i}", 2)].labels["gold"] for i in range(6)] == [1, 0, 1, 0, 1, 0]
    assert all(by[(f"q{i}", 1)].labels["gold"] == 0 for i in range(6))
    assert [by[(f"q{i}", 1)].labels["probe"] for i in range(6)] == [1, 0, 0, 1, 0, 0]
    assert by[("q0", 2)].provenance["gold"]["supporting_titles"] == ["A0", "B0"]
    assert by[("q0", 1)].provenance["probe"]["answer"] == "y" and by[("q1", 1)].split == "val"
    a = s["agreement"]["probe~gold"]
    labs = [(x.labels["probe"], x.labels["gold"]) for x in got]
    assert a["n"] == 12 and a["agreement"] == pytest.approx(np.mean([p == g for p, g in labs]))
    from sklearn.metrics import cohen_kappa_score

    assert a["kappa"] == pytest.approx(cohen_kappa_score([p for p, _ in labs], [g for _, g in labs]), abs=1e-12)
    summ = json.loads((tmp_path / "run" / "labelled_states.summary.json").read_text())
    assert summ["sources"]["gold"]["positives"] == 3


@pytest.fixture
def teacher_server():
    """An OpenAI-compatible /v1/chat/completions on loopback (FastAPI + uvicorn in a thread) that
    answers each state by its content: ``replies[2 * i + state - 1]`` for question ``q{i}``."""
    import re
    import socket
    import threading
    import time

    uvicorn = pytest.importorskip("uvicorn")
    from fastapi import FastAPI, Request
    from fastapi.responses import JSONResponse

    app = FastAPI()
    st = {"replies": [], "bodies": [], "auth": set(), "fail_once": set()}

    @app.post("/v1/chat/completions")
    async def chat(body: dict, request: Request):
        st["bodies"].append(body)
        st["auth"].add(request.headers.get("authorization"))
        user = body["messages"][-1]["content"]
        i = int(re.search(r"did A(\d+) make", user).group(1))
        k = 2 * i + (1 if f"Y{i}" in user else 0)
        if k in st["fail_once"]:  # a server shedding load: 503 once, the client retries
            st["fail_once"].discard(k)
            return JSONResponse({"error": "busy"}, status_code=503)
        return {"id": "c", "object": "chat.completion", "model": body["model"],
                "choices": [{"index": 0, "finish_reason": "stop",
                             "message": {"role": "assistant", "content": st["replies"][k]}}]}

    with socket.socket() as sk:
        sk.bind(("127.0.0.1", 0))
        port = sk.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="error"))
    th = threading.Thread(target=server.run, daemon=True)
    th.start()
    deadline = time.monotonic() + 20
    while not server.started:
        if time.monotonic() > deadline or not th.is_alive():
            pytest.fail("teacher server did not start")
        time.sleep(0.02)
    yield f"http://127.0.0.1:{port}", st
    server.should_exit = True
    th.join(timeout=10)


def test_label_states_teacher_url_counts_parse_failures(tmp_path, teacher_server):
    from ragfast.methods.s2g import labelling
    from ragfast.judges.prompt import SYSTEM_PROMPT

    url, st = teacher_server
    _native_run(tmp_path / "run", n=3)
    st["replies"] = ['{"sufficient": true, "gap_items": []}', "I think yes",
                     ' false, "gap_items": [{"category": "attribute", "target": "A", "slot": "b", "description": "c"}]}',
                     '{"sufficient": true, "gap_items": []}', "{oops", '{"sufficient": false, "gap_items": []}']
    st["fail_once"] = {3}
    s = labelling.label_states(tmp_path / "run", ["gold", "teacher"], teacher=url)
    t = s["sources"]["teacher"]
    # "I think yes", "{oops" and sufficient=false with no gap items are not verdicts
    assert t["parse_failures"] == 3 and t["labelled"] == 3 and t["positives"] == 2
    assert len(st["bodies"]) == 7 and not st["fail_once"]  # six states, one retried after its 503
    users = [b["messages"][1]["content"] for b in st["bodies"]]
    assert all(b["temperature"] == 0.0 and b["messages"][0] == {"role": "system", "content": SYSTEM_PROMPT}
               for b in st["bodies"])
    assert sum(u.startswith("QUESTION:\nWhich") and "CONTEXT:" in u for u in users) == 7
    got = labelling.load_labelled_states(s["file"])
    assert [x.labels["teacher"] for x in got] == [1, None, 0, 1, None, None]
    assert got[2].provenance["teacher"]["gap_items"][0]["category"] == "attribute"
    assert s["agreement"]["gold~teacher"]["n"] == 3


def test_chat_teacher_client_errors(teacher_server):
    from ragfast.methods.s2g.labelling import ChatTeacher

    url, st = teacher_server
    st["replies"] = ["ok"] * 2
    st["fail_once"] = {0}
    state = State("Which river did A0 make?", [])
    tc = ChatTeacher(url + "/v1/", "m", api_key="sekrit", retries=1)
    assert tc.verdict_texts([state]) == ["ok"]  # a 503, then the answer
    assert st["auth"] == {"Bearer sekrit"} and st["bodies"][-1]["model"] == "m"
    st["fail_once"] = {0}
    with pytest.raises(ModelError, match="503"):
        ChatTeacher(url, retries=0).verdict_texts([state])
    with pytest.raises(ConfigError, match="http"):
        ChatTeacher("127.0.0.1:1")


def test_label_states_errors(tmp_path):
    from ragfast.methods.s2g.labelling import label_states

    with pytest.raises(DataError, match="neither native.jsonl"):
        label_states(tmp_path, ["gold"])
    _native_run(tmp_path / "run", n=2)
    with pytest.raises(ConfigError, match="needs --teacher"):
        label_states(tmp_path / "run", ["teacher"])
    with pytest.raises(ConfigError, match="label sources"):
        label_states(tmp_path / "run", ["bogus"])
    (tmp_path / "run" / "states.jsonl").unlink()
    with pytest.raises(DataError, match="states.jsonl"):
        label_states(tmp_path / "run", ["probe"])
    r = subprocess.run([sys.executable, "-m", "ragfast.cli", "label-states", str(tmp_path / "nope"), "--source", "gold"],
                       capture_output=True, text=True)
    assert r.returncode == 2 and "not a directory" in r.stderr


def test_train_judge_cli_errors(tmp_path):
    for args, msg in ((["--kind", "bogus"], "--kind must be"), (["--kind", "causal"], "needs --base")):
        r = subprocess.run([sys.executable, "-m", "ragfast.cli", "train-judge", "--out", str(tmp_path / "o"), *args],
                           capture_output=True, text=True)
        assert r.returncode == 2 and msg in r.stderr, r.stderr


# -- several judges side by side ----------------------------------------------------------------
class _CountJudge:
    name, meaningful = "count", False

    def describe(self):
        return {"name": self.name}

    def stop_scores(self, states, **kw):
        return np.array([float(len(s.evidence)) for s in states])


class _LeakJudge(_CountJudge):
    """Knows the gold rule: high once B<i> is in the evidence."""
    name = "leak"

    def stop_scores(self, states, **kw):
        return np.array([3.0 if any(f'"B{s.trajectory_id[1:]}"' in e for e in s.evidence) else -3.0 for s in states])


def test_compare_judges_gold_labels(tmp_path):
    from ragfast.methods.s2g.judges import compare_judges, render_judges

    _native_run(tmp_path / "run", n=12, early=(0, 3, 6, 9, 1, 4))
    # first two questions are validation states; the study's states are 0 and 1 (S = 2)
    cmp = compare_judges(tmp_path / "run", [("count", _CountJudge()), ("leak", _LeakJudge())], labels="gold",
                         min_stops=1, n_resamples=200)
    leak, count = cmp["judges"]["leak"]["gold"], cmp["judges"]["count"]["gold"]
    assert leak["test"]["ap"] == pytest.approx(1.0)
    # count: every state 1 scores 1 (one evidence block, tied), in question order q2..q11 with q3, q4, q6, q9 right:
    # ranks 2, 3, 5, 8 -> (1/2 + 2/3 + 3/5 + 4/8) / 4; sklearn merges the tie -> 4/10
    assert count["test"]["ap"] == pytest.approx((1 / 2 + 2 / 3 + 3 / 5 + 4 / 8) / 4)
    assert count["test"]["extra_ap_merged_ties_sklearn"] == pytest.approx(0.4)
    assert leak["threshold"]["threshold"] == 3.0 and count["threshold"]["threshold"] == 1.0
    ls, cs = leak["test"]["system"], count["test"]["system"]
    assert ls["early_stops"] == 4 and ls["unsafe_early_stops"] == 0 and ls["accepted_risk"] == 0
    assert ls["searches_saved"] == pytest.approx(0.4) and ls["first_safe_stop_delay"] == 0
    assert cs["early_stops"] == 10 and cs["safe_early_stops"] == 4 and cs["searches_saved"] == pytest.approx(1.0)
    assert leak["test"]["recall_at_p90"] == pytest.approx(1.0) and leak["test"]["threshold_at_p90"] == pytest.approx(3.0)
    dap = cmp["delta_ap"]["leak - count"]
    assert dap["delta"] > 0 and dap["low"] <= dap["delta"] <= dap["high"]
    md = render_judges(cmp)
    assert "| leak | gold |" in md and "ΔAP" in md
    with pytest.raises(ConfigError, match="labels"):
        compare_judges(tmp_path / "run", [("c", _CountJudge())], labels="bogus")


# -- LoRA SFT of a causal judge -----------------------------------------------------------------
def _labelled(n=6):
    from ragfast.methods.s2g.labelling import LabelledState

    out = []
    for i in range(n):
        ev = [f'<information>Doc 1(Title: "{WORDS[i]}") {" ".join(WORDS[i:i + 4])}</information>']
        out.append(LabelledState(f"q{i}", 1, f"Which {WORDS[i]}?", ev, [WORDS[i]], labels={"gold": i % 2},
                                 provenance={"gold": {"supporting_titles": [WORDS[i], "other"]}}))
    return out


def test_target_text_is_a_strict_verdict():
    from ragfast.judges.train.causal import target_text
    from ragfast.judges.prompt import ANSWER_PREFIX, parse_verdict

    for y in (True, False):
        v = parse_verdict(ANSWER_PREFIX + target_text(y))
        assert v.parse == "strict" and v.sufficient is y and (v.gap_items == []) is y


def test_causal_lora_sft_tiny_qwen2(tmp_path):
    from ragfast.judges.train.causal import sft_examples, train_causal_judge
    from ragfast.judges.causal import CausalJudge
    from ragfast.models.tiny import tiny_path

    base = tiny_path("qwen2")
    states = _labelled()
    out = tmp_path / "j"
    card = train_causal_judge(states, base, out, epochs=4, lr=3e-2, batch_size=3, r=4, dropout=0.0, save_every=2,
                              log=lambda m: None)
    ep = card["epoch_mean_loss"]
    assert card["finished"] and card["steps"] == 8 and ep["3"] < ep["0"]
    base_j = CausalJudge(base, attention="ref")
    ex = sft_examples(base_j, states, "gold", 4096)
    # the first target token is the one the STOP score reads
    assert all(e["first"] in (base_j._true_ids if e["y"] else base_j._false_ids) for e in ex)
    j = CausalJudge(out / "merged", attention="ref")
    assert j.meaningful is False  # still a random-weight tiny base
    sts = [s.to_state() for s in states]
    packed, naive = j.stop_scores(sts), j.stop_scores(sts, packed=False)
    assert np.isfinite(packed).all() and np.abs(packed - naive).max() < 1e-4
    assert np.abs(packed - base_j.stop_scores(sts)).max() > 1e-3  # the adapter changed the scores
    assert (out / "adapter" / "adapter_config.json").exists()
    with pytest.raises(ConfigError, match="--resume"):
        train_causal_judge(states, base, out, epochs=4, log=lambda m: None)
    # interrupted after 3 steps, then resumed: same adapter as the uninterrupted run
    out2 = tmp_path / "k"
    part = train_causal_judge(states, base, out2, epochs=4, lr=3e-2, batch_size=3, r=4, dropout=0.0, save_every=2,
                              max_steps=3, log=lambda m: None)
    assert not part["finished"] and not (out2 / "merged").exists()
    full = train_causal_judge(states, base, out2, epochs=4, lr=3e-2, batch_size=3, r=4, dropout=0.0, save_every=2,
                              resume=True, log=lambda m: None)
    assert full["finished"] and full["steps"] == 8
    np.testing.assert_allclose(CausalJudge(out2 / "merged", attention="ref").stop_scores(sts), packed, atol=1e-5)


def test_causal_judge_top_layers_and_bf16(tmp_path):
    """--top-layers adapts only the last layers, and bf16 autocast trains (the loss falls)."""
    from pathlib import Path

    from safetensors import safe_open

    from ragfast.judges.train.causal import train_causal_judge
    from ragfast.models.tiny import tiny_path

    base = tiny_path("qwen2")
    layers = json.loads((Path(base) / "config.json").read_text())["num_hidden_layers"]
    said = []
    card = train_causal_judge(_labelled(), base, tmp_path / "j", epochs=4, lr=3e-2, batch_size=3, r=4, dropout=0.0,
                              bf16=True, top_layers=1, log=said.append)
    ep = card["epoch_mean_loss"]
    assert card["finished"] and card["bf16"] is True and card["top_layers"] == 1 and ep["3"] < ep["0"]
    assert any(m.startswith("step 1: loss ") for m in said) and card["median_step_seconds"] > 0  # progress moves
    with safe_open(str(tmp_path / "j" / "adapter" / "adapter_model.safetensors"), "pt") as f:
        adapted = {int(k.split(".layers.")[1].split(".")[0]) for k in f.keys()}
    assert adapted == {layers - 1}


def test_train_judge_cli_decision_weight(tmp_path):
    """--decision-weight reaches the loss: one step from the same start costs more with a heavier decision token."""
    from ragfast.models.tiny import tiny_path

    labels = tmp_path / "labelled_states.jsonl"
    labels.write_text("".join(json.dumps(s.to_dict()) + "\n" for s in _labelled()))
    cards = {}
    for w in ("0", "5"):
        out = tmp_path / f"w{w}"
        r = subprocess.run([sys.executable, "-m", "ragfast.cli", "train-judge", "--kind", "causal", "--base",
                            str(tiny_path("qwen2")), "--labels", str(labels), "--out", str(out), "--max-steps", "1",
                            "--decision-weight", w, "--lora-r", "4"], capture_output=True, text=True)
        assert r.returncode == 0, r.stderr
        cards[w] = json.loads((out / "train_judge.json").read_text())
    assert cards["0"]["decision_weight"] == 0.0 and cards["5"]["decision_weight"] == 5.0
    # same seed, data and adapter start: the step-1 loss differs only by 5 x the decision token's loss
    assert cards["5"]["loss_first"] > cards["0"]["loss_first"] + 1.0


def test_load_causal_judge_dtype():
    """The factory's dtype reaches a causal-LM judge (report s2g --judge-dtype); a bad one is one error."""
    import torch

    from ragfast.judges import load as load_judge

    assert next(load_judge("tiny").model.parameters()).dtype == torch.float32  # the CPU default
    j = load_judge("tiny", dtype="bf16")
    assert next(j.model.parameters()).dtype == torch.bfloat16 and j.describe()["dtype"] == "bfloat16"
    with pytest.raises(ConfigError, match="unknown dtype"):
        load_judge("tiny", dtype="int3")


# -- the bundled doc-set judge (default) and the cross-encoder judge ---------------------------------
@pytest.fixture(scope="module")
def docset_judge():
    from ragfast.judges.docset import DocSetJudge

    return DocSetJudge()


def test_split_documents_and_state_features():
    from ragfast.judges.base import STATE_FEATURES, state_features
    from ragfast.protocol import split_documents
    from ragfast.judges.docset import doc_title

    obs = '\n\n<information>Doc 1(Title: "A (film)") x y\nDoc 2(Title: B) z</information>\n\n'
    assert split_documents(obs) == ['"A (film)") x y', "B) z"]
    assert split_documents("plain text") == ["plain text"]
    assert doc_title('"Paris Hilton (film)") text') == "paris hilton" and doc_title("no title here") == ""
    f0, f2 = state_features([]), state_features([3.0, -1.0])
    assert f0.shape == (len(STATE_FEATURES),) and f0[-1] == 1.0 and f2[-1] == 0.0
    assert f2[0] == 3.0 and f2[1] == -1.0 and f2[3] < 0 and 0 < f2[4] < 2


def _gold_states(n=10):
    from ragfast.data import load_qa, sample

    qs = load_qa(sample("hotpotqa-dev"))[:n]
    full, half, empty = [], [], []
    for q in qs:
        ctx = q.metadata["context"]
        gold = [f'<information>Doc 1(Title: "{t}") {"".join(s)}</information>'
                for t, s in zip(ctx["title"], ctx["sentences"]) if t in q.supporting_titles]
        full.append(State(q.question, gold, q.id))
        half.append(State(q.question, gold[:1], q.id))
        empty.append(State(q.question, [], q.id))
    return qs, full, half, empty


def test_bundled_docset_judge_scores_and_card(docset_judge):
    from ragfast.judges.docset import default_docset_judge_path

    assert default_docset_judge_path().stat().st_size < 5_000_000
    assert default_docset_judge_path().with_suffix(".md").exists()
    d = docset_judge.describe()
    assert d["meaningful"] is True and d["trained_on"] == "hotpotqa-train"
    dev = d["metrics"]["dev"]
    for kind in ("subsets", "trajectories"):
        assert dev[kind]["ap"] > dev[kind]["ap_ndocs_baseline"]
    qs, full, half, empty = _gold_states()
    led = CostLedger()
    s_full = docset_judge.stop_scores(full, ledger=led, question_ids=[q.id for q in qs])
    s_half, s_empty = docset_judge.stop_scores(half), docset_judge.stop_scores(empty)
    assert s_full.dtype == np.float64 and np.isfinite(s_full).all()
    assert (s_full > s_empty).mean() >= 0.9 and (s_full > s_half).mean() >= 0.7
    t = led.totals()["judge"]
    assert t["input_tokens"] > 0 and t["flops"] > 0
    led2 = CostLedger()  # texts already embedded are charged as computed; reused only on a second read
    np.testing.assert_allclose(docset_judge.stop_scores(full, ledger=led2), s_full)
    t2 = led2.totals()["judge"]
    assert [t2[k] for k in ("calls", "input_tokens", "flops")] == [t[k] for k in ("calls", "input_tokens", "flops")]
    assert t2["reused"] == t["reused"] == 0
    docset_judge.stop_scores(full, ledger=led, question_ids=[q.id for q in qs])
    assert led.totals()["judge"]["reused"] == t["calls"] > 0


def test_load_judge_specs(tmp_path, docset_judge):
    from ragfast.judges.cross import CrossEncoderJudge
    from ragfast.judges.docset import DocSetJudge, default_docset_judge_path
    from ragfast.judges import load as load_judge
    from ragfast.judges.head import EncoderJudge

    assert isinstance(load_judge("encoder"), DocSetJudge)
    assert isinstance(load_judge("head"), EncoderJudge)
    assert isinstance(load_judge(str(default_docset_judge_path().parent)), DocSetJudge)
    with pytest.raises(ConfigError, match="expected 'encoder'"):
        load_judge(str(tmp_path))
    for name, cls in (("cross_judge", CrossEncoderJudge), ("docset_judge", DocSetJudge)):
        bad = tmp_path / f"{name}.safetensors"
        bad.write_bytes(b"x")
        (tmp_path / f"{name}.json").write_text('{"format": "other"}')
        with pytest.raises(ModelError, match="card"):
            cls(bad)


def test_train_cross_judge_small(tmp_path):
    from ragfast.judges.cross import CrossEncoderJudge
    from ragfast.judges.train.documents import train_cross_judge

    card = train_cross_judge("hotpotqa-train", tmp_path / "cj", limit=14, epochs=1, n_subsets=4, log=lambda m: None)
    assert card["split"]["document_scorer"] + card["split"]["state_head"] + card["split"]["validation"] == 14
    assert (tmp_path / "cj" / "cross_judge.safetensors").stat().st_size < 1_000_000
    j = CrossEncoderJudge(tmp_path / "cj")
    s = j.stop_scores([("Who?", []), ("Who?", ["<information>Doc 1(Title: x) y</information>"])])
    assert s.shape == (2,) and np.isfinite(s).all()
    # what training must change: LoRA's B factors start at zero (the adapted model equals the
    # base), and the state head is saved as zeros before it is fitted
    from safetensors.numpy import load_file

    w = load_file(str(tmp_path / "cj" / "cross_judge.safetensors"))
    lora_b = [v for k, v in w.items() if k.endswith("lora_B")]
    assert lora_b and all(np.abs(v).max() > 0 for v in lora_b)
    assert np.abs(w["state_head.weight"]).max() > 0 and np.isfinite(card["training"]["loss_per_epoch"]).all()
    assert s[0] != s[1]  # the fitted head reads the evidence
    with pytest.raises(ConfigError, match="top_layers"):
        train_cross_judge("hotpotqa-train", tmp_path / "x", limit=14, top_layers=0)


def test_cross_fitted_scorer_uses_each_questions_held_out_head():
    from ragfast.judges.train.documents import CrossFittedScorer

    class Feats:
        def __call__(self, pairs, ledger=None, question_ids=None):
            return np.array([[1.0, float(len(d))] for _, d in pairs])

    class Judge:
        features = Feats()

        def state_inputs(self, question, docs, doc_logits):
            return np.asarray(doc_logits, dtype=float)

    heads = [(np.array([1.0, 0.0]), 0.5), (np.array([0.0, 2.0]), -1.0)]
    sc = CrossFittedScorer(Judge(), {"qa": 0, "qb": 1}, heads)
    z = sc.doc_logits([("qa", "xx"), ("qb", "xx"), ("qa", "xxx")])
    np.testing.assert_allclose(z, [1.5, 3.0, 1.5])
    assert sc.doc_logits([]).shape == (0,)
    with pytest.raises(KeyError):
        sc.doc_logits([("unseen", "x")])


def test_train_docset_judge_small(tmp_path):
    from ragfast.judges.train.documents import train_docset_judge
    from ragfast.judges.docset import DOCSET_FORMAT, DOCSET_STATE_FEATURES, DocSetJudge

    card = train_docset_judge("hotpotqa-train", tmp_path / "dj", limit=16, n_subsets=4, threads=1,
                              log=lambda m: None)
    sp = card["split"]
    assert card["format"] == DOCSET_FORMAT and card["state_features"] == list(DOCSET_STATE_FEATURES)
    # the state head also trains on the document questions' states (cross-fitted logits): more
    # states than the state-head questions alone give (4 subsets + 5 trajectory states each)
    assert card["state_head"]["states"] > sp["state_head"] * 9
    assert "cross-fitted" in card["state_head"]["states_built"]
    assert "bridge_link" in card["training"]["set_features"]
    j = DocSetJudge(tmp_path / "dj")
    assert j.state_w.size == len(DOCSET_STATE_FEATURES)
    s = j.stop_scores([("Who?", []), ("Who?", ['<information>Doc 1(Title: "x") y</information>'])])
    assert s.shape == (2,) and np.isfinite(s).all()
    # what training must change: both heads are fitted (the state head is saved as zeros first)
    from safetensors.numpy import load_file

    w = load_file(str(tmp_path / "dj" / "docset_judge.safetensors"))
    assert np.abs(w["doc_head.weight"]).max() > 0 and np.abs(j.state_w).max() > 0
    assert s[0] != s[1]  # the fitted head reads the evidence
    assert "set features" in (tmp_path / "dj" / "docset_judge.md").read_text()
