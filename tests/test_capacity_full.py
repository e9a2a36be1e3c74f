"""bench/bench_capacity.py --measure-full at a tiny size: build, reuse, resume, recall, timing path.

The oracle is numpy brute force over the whole regenerated fp32 corpus (20,000 x 64 here), which
the paper-scale run cannot afford. No timing is asserted. Costs about 10 s on 2 cores.
"""
import json
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench import capacity_full as cf  # noqa: E402

ROWS, DIM, SEED, NQ = 20_000, 64, 5, 16


@pytest.fixture(scope="module")
def small_chunks(monkeypatch_module):
    # several chunks, a short last one: 20,000 = 2 x 8,192 + 3,616
    monkeypatch_module.setattr(cf, "CHUNK_ROWS", 8192)
    monkeypatch_module.setattr(cf, "CHECKPOINT_CHUNKS", 1)


@pytest.fixture(scope="module")
def monkeypatch_module():
    mp = pytest.MonkeyPatch()
    yield mp
    mp.undo()


@pytest.fixture(scope="module")
def corpus(small_chunks):
    x = np.concatenate([cf.chunk_vectors(SEED, c, ROWS, DIM).numpy() for c in range(3)])
    assert x.shape == (ROWS, DIM)
    return x


@pytest.fixture(scope="module")
def built(tmp_path_factory, small_chunks):
    wd = tmp_path_factory.mktemp("cap")
    return wd, cf.build_index(wd, ROWS, DIM, SEED, recall_queries=NQ, log=lambda m: None)


def _brute(x, q, k=cf.K):
    s = q @ x.T
    ids = np.argsort(-s, axis=1, kind="stable")[:, :k]
    return np.take_along_axis(s, ids, axis=1), ids


def test_build_truth_matches_numpy_brute_force(built, corpus):
    wd, b = built
    path = Path(b["path"])
    assert not b["reused"] and not (path / "progress.json").exists()
    np.testing.assert_allclose(np.linalg.norm(corpus, axis=1), 1, rtol=1e-5)
    q = cf.unit_queries(SEED, 1, NQ, DIM).numpy()
    s, ids = _brute(corpus, q)
    t = np.load(path / "truth.npz")
    np.testing.assert_array_equal(t["ids"], ids)
    np.testing.assert_allclose(t["scores"], s, rtol=1e-5, atol=1e-6)
    # the stored codes are the symmetric per-row int8 quantisation of the regenerated vectors
    codes = np.load(path / "codes.npy", mmap_mode="r")
    scale = np.abs(corpus).max(axis=1) / 127
    np.testing.assert_array_equal(codes, np.clip(np.round(corpus / scale[:, None]), -127, 127))
    np.testing.assert_array_equal(np.load(path / "rescore.npy"), corpus.astype(np.float16))
    # a second call reuses it
    again = cf.build_index(wd, ROWS, DIM, SEED, recall_queries=NQ, log=lambda m: None)
    assert again["reused"] and again["path"] == b["path"]


def test_search_recall_and_memory_against_brute_force(built, corpus):
    _, b = built
    out = cf.measure_search(Path(b["path"]), batches=(1, 7, 64), reps=1, threads=2, seed=SEED, log=lambda m: None)
    assert out["rows"] == ROWS and out["scan_bytes"] == ROWS * (DIM + 8)
    assert set(out["search_s"]) == {1, 7, 64} and all(len(v) == 1 for v in out["search_s"].values())
    # recall, recomputed here from numpy brute force: exact scores against the fp16 copy, and
    # against the dequantised codes for int8 alone
    from ragfast.retrieval.dense import DenseIndex

    q = cf.unit_queries(SEED, 1, NQ, DIM).numpy()
    _, truth = _brute(corpus, q)
    _, got = DenseIndex.load(b["path"], kernel_backend="cpp").search(q, cf.K)
    expect = np.mean([len(set(a) & set(t)) / cf.K for a, t in zip(got.numpy().tolist(), truth.tolist())])
    assert out["recall_rescore"] == pytest.approx(expect)
    assert out["recall_rescore"] >= 0.95  # 20k random rows: near-ties are rare at k=10
    assert 0 < out["recall_int8_alone"] <= 1
    assert out["rss_after_search"]["RssAnon"] > 0
    # the report names every measured figure
    res = {"machine_start": cf.machine_facts(), "machine_end": cf.machine_facts(), "rows": ROWS, "dim": DIM,
           "seed": SEED, "phases_s": {"build": 1.0, "search_and_recall": 2.0}, "build": {"reused": False},
           "disk_bytes": 1, "search": out}
    md = cf.report_markdown(res)
    assert f"**{out['recall_rescore']:.4f}**" in md and "| 7 |" in md and "search and recall" in md


def test_measure_full_refuses_bad_arguments_in_one_line(capsys):
    from bench import bench_capacity

    for argv, msg in ((["--dim", "60", "--no-serve"], "multiple of 8"), (["--dim", "64"], "--no-serve"),
                      (["--batches", "1,x"], "--batches"), (["--rows", "0"], "positive")):
        with pytest.raises(SystemExit) as exc:
            bench_capacity.main(["--measure-full", *argv])
        assert exc.value.code == 2 and msg in capsys.readouterr().err


def test_interrupted_build_resumes_to_the_same_index(tmp_path, small_chunks, corpus, monkeypatch):
    calls = []
    real = cf.chunk_vectors

    def failing(seed, c, rows, dim):
        calls.append(c)
        if c == 2 and len([x for x in calls if x == 2]) == 1:
            raise KeyboardInterrupt  # the build dies while making the last chunk
        return real(seed, c, rows, dim)

    monkeypatch.setattr(cf, "chunk_vectors", failing)
    with pytest.raises(KeyboardInterrupt):
        cf.build_index(tmp_path, ROWS, DIM, SEED, recall_queries=NQ, log=lambda m: None)
    path = next(tmp_path.glob("int8-*"))
    assert not (path / "meta.json").exists()  # not an index yet
    assert json.loads((path / "progress.json").read_text())["chunks_done"] == 2
    b = cf.build_index(tmp_path, ROWS, DIM, SEED, recall_queries=NQ, log=lambda m: None)
    assert b["resumed_from"] == 2 and calls.count(0) == 1  # chunks 0 and 1 were not regenerated
    codes = np.load(Path(b["path"]) / "codes.npy")
    scale = np.abs(corpus).max(axis=1) / 127
    np.testing.assert_array_equal(codes, np.clip(np.round(corpus / scale[:, None]), -127, 127))
    _, ids = _brute(corpus, cf.unit_queries(SEED, 1, NQ, DIM).numpy())
    np.testing.assert_array_equal(np.load(Path(b["path"]) / "truth.npz")["ids"], ids)
