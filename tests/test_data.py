"""QA loaders, the Arrow-backed corpus and the bundled samples, on real files and bad ones."""
import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from ragfast.data import (SAMPLES, Corpus, corpus_from_contexts, detect_layout, load_corpus, load_qa, load_triples,
                          sample)
from ragfast.errors import DataError
from ragfast.scoring.metrics import sufficient
from ragfast.types import Passage

SR1_PROMPT = ("Answer the given question. You must conduct reasoning inside <think> and </think> first ... "
              "For example, <answer> Beijing </answer>. Question: {q}\n")


def _write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


def test_every_sample_exists_and_unknown_name_lists_valid_ones():
    for name in SAMPLES:
        assert sample(name).is_file()
    with pytest.raises(DataError, match="hotpotqa-train.*wiki-sample"):
        sample("hotpot-nope")


@pytest.mark.parametrize("name,count,layout", [
    ("hotpotqa-train", 300, "hotpotqa"), ("hotpotqa-dev", 300, "hotpotqa"), ("tatqa-dev", 1668, "tatqa"),
    ("metaqa-1hop", 300, "metaqa"), ("metaqa-2hop", 300, "metaqa"), ("metaqa-3hop", 300, "metaqa"),
])
def test_bundled_qa_samples(name, count, layout):
    qs = load_qa(name)
    assert len(qs) == count and detect_layout(name) == layout
    assert len({q.id for q in qs}) == count
    assert all(q.question.strip() and q.golden_answers for q in qs)


def test_hotpotqa_fields():
    qs = load_qa("hotpotqa-train")
    q = qs[0]
    assert q.id == "5abf63f15542997ec76fd3ea"
    assert q.golden_answers == ["October 1922"]
    assert q.supporting_titles == ["Socialist Revolutionary Party", "Russian Civil War"]
    assert q.metadata["type"] == "bridge" and q.metadata["level"] == "hard"
    ctx = q.metadata["context"]
    assert len(ctx["title"]) == len(ctx["sentences"]) == 10
    # supporting titles are unique even when several facts come from one paragraph
    assert all(len(set(x.supporting_titles)) == len(x.supporting_titles) for x in qs)
    assert load_qa("hotpotqa-train", limit=5)[4].id == qs[4].id


def test_metaqa_and_tatqa_fields():
    q = load_qa("metaqa-1hop")[0]
    assert q.id == "1hop_test-1"
    assert q.question == "who was the writer of the film The Two of Us"
    assert q.metadata["topic_entity"] == "The Two of Us"
    assert q.golden_answers == ["Claude Berri"]
    tq = load_qa("tatqa-dev")
    first = tq[0]
    assert first.id == "23801627-ff77-4597-8d24-1c99e2452082"
    assert first.metadata["doc_index"] == 0 and first.metadata["answer_from"] == "text"
    assert first.metadata["table_uid"] == "3ffd9053-a45d-491c-957a-1b2fa0af0570"
    multi = tq[2]
    assert multi.metadata["answer_type"] == "multi-span"
    assert multi.golden_answers == ["fixed-price type", "cost-plus type", "time-and-material type"]
    numeric = [q for q in tq if isinstance(q.metadata["answer"], (int, float))]
    assert numeric and all(isinstance(g, str) for q in numeric for g in q.golden_answers)


def test_triples():
    tr = load_triples("metaqa-kb")
    assert len(tr) == 129235 and all(len(t) == 3 for t in tr[:100])


def test_flashrag_and_musique_and_hotpot_original(tmp_path):
    fr = _write_jsonl(tmp_path / "fr.jsonl", [
        {"id": "test_0", "question": "who?", "golden_answers": ["A", "B"], "metadata": {"k": 1}}])
    q = load_qa(fr)[0]
    assert (q.id, q.golden_answers, q.metadata) == ("test_0", ["A", "B"], {"k": 1})

    mu = [{"id": "2hop__1", "question": "Where was X born?", "answer": "Paris", "answer_aliases": ["Paris, France"],
           "answerable": True,
           "paragraphs": [{"idx": 0, "title": "X", "paragraph_text": "X was born in Y.", "is_supporting": True},
                          {"idx": 1, "title": "Z", "paragraph_text": "Noise.", "is_supporting": False},
                          {"idx": 2, "title": "Y", "paragraph_text": "Y is Paris.", "is_supporting": True}]}]
    for path in (_write_jsonl(tmp_path / "mu.jsonl", mu), tmp_path / "mu.json"):
        if path.suffix == ".json":
            path.write_text(json.dumps(mu))
        q = load_qa(path)[0]
        assert q.golden_answers == ["Paris", "Paris, France"]
        assert q.supporting_titles == ["X", "Y"]
        assert corpus_from_contexts([q]).row(2)["contents"] == '"Y"\nY is Paris.'

    orig = [{"_id": "h1", "question": "q?", "answer": "yes", "type": "comparison", "level": "easy",
             "supporting_facts": [["A", 0], ["B", 1], ["A", 1]],
             "context": [["A", ["a0.", " a1."]], ["B", ["b0.", " b1."]]]}]
    (tmp_path / "hp.json").write_text(json.dumps(orig))
    q = load_qa(tmp_path / "hp.json")[0]
    assert q.id == "h1" and q.supporting_titles == ["A", "B"]
    assert corpus_from_contexts([q]).row(0)["contents"] == '"A"\na0. a1.'


def test_searchr1_parquet(tmp_path):
    rows = [{"data_source": "hotpotqa", "prompt": [{"role": "user", "content": SR1_PROMPT.format(q="who is x?")}],
             "ability": "fact-reasoning", "reward_model": {"style": "rule", "ground_truth": {"target": ["X", "Ex"]}},
             "extra_info": {"split": "test", "index": 7}},
            {"data_source": "nq", "prompt": [{"role": "user", "content": SR1_PROMPT.format(q="where is y?")}],
             "ability": "fact-reasoning", "reward_model": {"style": "rule", "ground_truth": {"target": ["Y"]}},
             "extra_info": {"split": "test", "index": 7}}]
    path = tmp_path / "test.parquet"
    pq.write_table(pa.Table.from_pylist(rows), path)
    qs = load_qa(path)
    assert [q.id for q in qs] == ["hotpotqa_7", "nq_7"]
    assert qs[0].question == "who is x?" and qs[0].golden_answers == ["X", "Ex"]
    assert qs[1].metadata["data_source"] == "nq" and qs[1].metadata["split"] == "test"


def test_bad_inputs(tmp_path):
    with pytest.raises(DataError, match="no such file"):
        load_qa(tmp_path / "missing.jsonl")
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"id": "1", "question": "q", "golden_answers": ["a"]}) + "\n{not json\n")
    with pytest.raises(DataError, match=r"bad\.jsonl:2: line does not parse"):
        load_qa(bad)
    with pytest.raises(DataError, match="unknown jsonl layout"):
        load_qa(_write_jsonl(tmp_path / "odd.jsonl", [{"foo": 1}]))
    with pytest.raises(DataError, match="empty question"):
        load_qa(_write_jsonl(tmp_path / "eq.jsonl", [{"id": "1", "question": "  ", "golden_answers": ["a"]}]))
    with pytest.raises(DataError, match="empty gold answer list"):
        load_qa(_write_jsonl(tmp_path / "eg.jsonl", [{"id": "1", "question": "q", "golden_answers": []}]))
    with pytest.raises(DataError, match="duplicate question id"):
        load_qa(_write_jsonl(tmp_path / "dup.jsonl", [{"id": "1", "question": "q", "golden_answers": ["a"]}] * 2))
    with pytest.raises(DataError, match="empty"):
        load_qa(_write_jsonl(tmp_path / "empty.jsonl", []))
    with pytest.raises(DataError, match="unknown file type"):
        load_qa(_write_jsonl(tmp_path / "x.csv", [{"a": 1}]))
    with pytest.raises(DataError, match="use load_corpus"):
        load_qa("wiki-sample")
    mq = tmp_path / "m.txt"
    mq.write_text("what is [X]\tA|B\nwhat is [Y]\t\n")
    with pytest.raises(DataError, match=r"m\.txt:2: empty gold"):
        load_qa(mq)
    kb = tmp_path / "kb.txt"
    kb.write_text("a|r|b\na|r\n")
    with pytest.raises(DataError, match=r"kb\.txt:2"):
        load_triples(kb)


def test_corpus_api_on_wiki_sample():
    c = load_corpus("wiki-sample")
    assert len(c) == 1000
    assert c.ids[:3] == ["0", "1", "2"] and c.ids is c.ids  # cached
    r = c.row(0)
    assert set(r) == {"id", "contents"} and r["contents"].startswith('"Evan Morris"\n')
    p = c.passage(0)
    assert isinstance(p, Passage) and p.title == '"Evan Morris"' and p.contents == r["contents"]
    assert c.titles()[0] == "Evan Morris"
    assert c.contents([2, 0]) == [c.row(2)["contents"], r["contents"]]
    assert c.index_of("17") == 17
    with pytest.raises(KeyError, match="nope"):
        c.index_of("nope")
    with pytest.raises(IndexError):
        c.row(1000)
    batches = list(c.iter_batches(300))
    assert [len(b) for b in batches] == [300, 300, 300, 100]
    assert batches[1][0] == c.row(300)["contents"]


def test_corpus_roundtrip_concat_and_errors(tmp_path):
    c = Corpus.from_rows([{"id": 1, "contents": '"T1"\none'}, {"id": "b", "contents": "T2\ntwo"}])
    assert c.ids == ["1", "b"] and c.titles() == ["T1", "T2"]
    for name in ("c.jsonl", "c.parquet"):
        back = load_corpus(c.save(tmp_path / name))
        assert back.ids == c.ids and back.contents([0, 1]) == c.contents([0, 1])
    both = Corpus.concat([c, Corpus.from_rows([{"id": "z", "contents": "Z\nz"}])])
    assert both.ids == ["1", "b", "z"]
    with pytest.raises(DataError, match="duplicate corpus id 'b'"):
        Corpus.concat([c, Corpus.from_rows([{"id": "b", "contents": "x"}])])
    # numeric ids in a jsonl corpus become strings
    num = _write_jsonl(tmp_path / "num.jsonl", [{"id": i, "contents": f"T{i}\nx"} for i in range(3)])
    assert load_corpus(num).ids == ["0", "1", "2"]
    bad = tmp_path / "badc.jsonl"
    bad.write_text('{"id": "0", "contents": "a"}\n{"id": "1", "contents": \n')
    with pytest.raises(DataError, match=r"badc\.jsonl:2"):
        load_corpus(bad)
    with pytest.raises(DataError, match="not a corpus"):
        load_corpus("hotpotqa-dev")
    with pytest.raises(DataError, match="unknown file type"):
        c.save(tmp_path / "c.csv")


def test_arrow_corpus_is_memory_mapped_and_streams(tmp_path):
    from ragfast.data.passage_store import write_arrow_corpus

    c = Corpus.from_rows([{"id": 1, "contents": '"T1"\none'}, {"id": "b", "contents": "T2\ntwo"}])
    back = load_corpus(c.save(tmp_path / "c.arrow"))
    assert back.ids == c.ids and back.contents([1, 0]) == ["T2\ntwo", '"T1"\none'] and back.titles() == ["T1", "T2"]
    # streamed in batches: 3 batches of 1000 rows, never all rows as Python objects at once
    batches = (([f"p{i}" for i in range(s, s + 1000)], [f"text {i}" for i in range(s, s + 1000)])
               for s in range(0, 3000, 1000))
    import pyarrow as pa

    path = write_arrow_corpus(tmp_path / "big.arrow", batches)
    # what Arrow's pool holds before the load: other tests in this process may keep Arrow data
    before = pa.total_allocated_bytes()
    big = load_corpus(path)
    assert len(big) == 3000 and big.row(2345) == {"id": "p2345", "contents": "text 2345"}
    assert big.index_of("p1999") == 1999
    # the contents buffer is the file's mapping, not a copy (Arrow's memory pool grows by less
    # than one 8-byte offset per row)
    assert pa.total_allocated_bytes() - before < 3000 * 8
    with pytest.raises(DataError, match="not an Arrow IPC"):
        load_corpus(_write_jsonl(tmp_path / "x.arrow", [{"id": "a", "contents": "b"}]))
    with pytest.raises(DataError, match="duplicate corpus id 'p0'"):
        load_corpus(write_arrow_corpus(tmp_path / "dup.arrow", [(["p0", "p0"], ["a", "b"])]))


def test_corpus_from_contexts_covers_every_supporting_paragraph():
    qs = load_qa("hotpotqa-dev")
    c = corpus_from_contexts(qs)
    assert 2000 < len(c) <= sum(len(q.metadata["context"]["title"]) for q in qs)
    assert c.ids[:2] == ["hp-0", "hp-1"]
    assert corpus_from_contexts(qs).ids == c.ids and corpus_from_contexts(qs).contents([5]) == c.contents([5])
    assert len(set(c.contents(range(len(c))))) == len(c)  # deduplicated
    titles = c.titles()
    assert all(sufficient(titles, q.supporting_titles) for q in qs)
    first = c.row(0)["contents"]
    assert first.startswith('"' + qs[0].metadata["context"]["title"][0] + '"\n')
    with pytest.raises(DataError, match="no context"):
        corpus_from_contexts(load_qa("metaqa-1hop")[:1])


def test_cli_data_commands(tmp_path):
    import subprocess
    import sys

    from typer.testing import CliRunner

    from ragfast.cli import app

    runner = CliRunner()
    res = runner.invoke(app, ["data", "inspect", "hotpotqa-dev"])
    assert res.exit_code == 0, res.output
    assert "300" in res.output and "hotpotqa" in res.output and "Tinted Windows" in res.output
    res = runner.invoke(app, ["data", "inspect", "wiki-sample", "--json"])
    assert res.exit_code == 0, res.output
    summary = json.loads(res.output)
    assert summary["layout"] == "corpus" and summary["count"] == 1000 and summary["fields"] == ["id", "contents"]
    res = runner.invoke(app, ["data", "samples", "--json"])
    assert set(json.loads(res.output)) == set(SAMPLES)
    out = tmp_path / "ctx.jsonl"
    res = runner.invoke(app, ["data", "contexts-corpus", "hotpotqa-train", str(out)])
    assert res.exit_code == 0 and len(load_corpus(out)) == len(corpus_from_contexts("hotpotqa-train"))
    # a bad path is one clear line on stderr, exit code 2, no traceback
    proc = subprocess.run([sys.executable, "-m", "ragfast.cli", "data", "inspect", str(tmp_path / "nope.jsonl")],
                          capture_output=True, text=True)
    assert proc.returncode == 2
    assert "no such file" in proc.stderr and "Traceback" not in proc.stderr


def test_corpus_many_chunks_agree_with_one():
    one = load_corpus("wiki-sample")
    many = load_corpus("wiki-sample", block_size=16 * 1024)  # dozens of Arrow chunks
    assert many.table.column("contents").num_chunks > 10
    assert many.ids == one.ids and many.titles() == one.titles()
    idx = [999, 0, 500, 37, 37]
    assert many.contents(idx) == one.contents(idx)
    assert [many.row(i) for i in idx] == [one.row(i) for i in idx]
    assert [b for b in many.iter_batches(333)] == [b for b in one.iter_batches(333)]
