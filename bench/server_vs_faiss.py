"""``bench/bench_server.py --vs-faiss``: ragfast serve-retriever against a Search-R1-shaped faiss server.

The anchor is a FastAPI app of the same shape as Search-R1's ``search_r1/search/retrieval_server.py``
(written here from its documented behaviour, not copied): a pydantic ``QueryRequest``, a sync
``POST /retrieve`` handler (so FastAPI runs concurrent requests on its thread pool), the queries
encoded in one padded batch (``padding=True``, mean pooling, L2 norm, under ``torch.no_grad``),
a faiss ``IndexFlatIP`` search, and the corpus rows looked up by position. Both servers use the
same MiniLM checkpoint, the same corpus rows and the same passage vectors, the same torch and
faiss thread count, and run on loopback.

Corpus: the ``ragfast bench`` corpus (HotpotQA dev contexts + the Wikipedia sample, embedded
for real) padded to ``--passages`` rows with synthetic rows whose vectors are random unit
vectors (seed 0): the scan costs what a corpus of that size costs, and the real passages still
win the real questions. Clients send Search-R1 payloads of ``--batch-queries`` questions
(``topk=3``, ``return_scores=true``) in closed loops; windows alternate between the servers.
Top-k agreement is checked tie-aware on every question: the two servers must return the same
scores (to 1e-4) and the same ids except where scores tie.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

LOOPBACK = "127.0.0.1"


def build_corpus(out: Path, passages: int, seed: int = 0) -> dict[str, Any]:
    """Write ``corpus.jsonl`` and ``vectors.npy`` (float32, unit rows) of ``passages`` rows to ``out``."""
    from bench.bench_server import bench_corpus
    from ragfast.retrieval.dense import build_default_retriever

    corpus = bench_corpus("bench")
    real = np.asarray(build_default_retriever(corpus, progress=False).index.vectors, dtype=np.float32)
    n_real = min(len(corpus), passages)
    n_syn = max(0, passages - n_real)
    rng = np.random.default_rng(seed)
    syn = rng.standard_normal((n_syn, real.shape[1]), dtype=np.float32)
    syn /= np.linalg.norm(syn, axis=1, keepdims=True)
    out.mkdir(parents=True, exist_ok=True)
    np.save(out / "vectors.npy", np.concatenate([real[:n_real], syn]))
    with open(out / "corpus.jsonl", "w") as f:
        for i in range(n_real):
            f.write(json.dumps(corpus.row(i), ensure_ascii=False) + "\n")
        for i in range(n_syn):
            f.write(json.dumps({"id": f"syn-{i}", "contents": f'"Synthetic {i}"\nfiller passage number {i}.'}) + "\n")
    return {"real": n_real, "synthetic": n_syn}


def _threads(threads: int) -> None:
    import faiss
    import torch

    torch.set_num_threads(threads)
    faiss.omp_set_num_threads(threads)


def serve_ragfast(data: str, threads: int, port: int, ready) -> None:
    from ragfast.retrieval.server import create_app, load_retriever

    _threads(threads)
    r = load_retriever(str(Path(data) / "corpus.jsonl"), str(Path(data) / "vectors.npy"), "minilm", progress=False)
    r.search(["warm-up query"], 3)
    app = create_app(r, default_topk=3)
    ready.send("ready")
    ready.close()
    serve_app(app, port)


def serve_anchor(data: str, threads: int, port: int, ready) -> None:
    """The Search-R1-shaped server over ``data``'s corpus and vectors, with the MiniLM encoder."""
    from ragfast.encoders.encoder import minilm_path

    _threads(threads)
    rows = [json.loads(line) for line in open(Path(data) / "corpus.jsonl")]
    app = anchor_app(rows, np.load(Path(data) / "vectors.npy"), str(minilm_path()))
    ready.send("ready")
    ready.close()
    serve_app(app, port)


def serve_app(app, port: int) -> None:
    """Run ``app`` with uvicorn on loopback (blocks)."""
    import uvicorn

    uvicorn.run(app, host=LOOPBACK, port=port, log_level="warning", access_log=False)


def anchor_app(rows, vectors, model_path: str):
    """The Search-R1-shaped app: sync handler, padded batch encode, faiss IndexFlatIP.

    Parameters
    ----------
    rows : sequence
        ``rows[j]`` is corpus row ``j`` as a dict (a list, or any lazy sequence such as a
        memory-mapped corpus: Search-R1 reads its corpus through a memory-mapped HF dataset).
    vectors : np.ndarray or iterable of np.ndarray
        float32 ``[N, d]`` unit rows, or chunks of them in row order (added chunk by chunk, so
        the index holds the only full copy).
    model_path : str
        A Hugging Face encoder directory (mean pooling, L2 norm).
    """
    from typing import List, Optional

    import faiss
    import torch
    from fastapi import FastAPI
    from pydantic import BaseModel
    from transformers import AutoModel, AutoTokenizer

    index = None
    for chunk in ([vectors] if isinstance(vectors, np.ndarray) else vectors):
        chunk = np.ascontiguousarray(chunk, dtype=np.float32)
        if index is None:
            index = faiss.IndexFlatIP(chunk.shape[1])
        index.add(chunk)
    tok = AutoTokenizer.from_pretrained(model_path)
    model = AutoModel.from_pretrained(model_path).eval()

    @torch.no_grad()
    def encode(queries: list[str]) -> np.ndarray:
        inp = tok(queries, max_length=256, padding=True, truncation=True, return_tensors="pt")
        out = model(**inp).last_hidden_state
        m = inp["attention_mask"].unsqueeze(-1).to(out.dtype)
        emb = (out * m).sum(1) / m.sum(1)
        emb = torch.nn.functional.normalize(emb, dim=-1)
        return emb.cpu().numpy().astype(np.float32)

    def batch_search(queries: list[str], k: int, batch_size: int = 512):
        results, scores = [], []
        for s in range(0, len(queries), batch_size):
            sc, ix = index.search(encode(queries[s:s + batch_size]), k)
            results += [[rows[j] for j in row] for row in ix.tolist()]
            scores += sc.tolist()
        return results, scores

    class QueryRequest(BaseModel):
        queries: List[str]
        topk: Optional[int] = None
        return_scores: bool = False

    app = FastAPI()

    def retrieve(request: QueryRequest):  # sync, as Search-R1's: FastAPI's thread pool runs it
        k = request.topk or 3
        results, scores = batch_search(request.queries, k)
        resp = []
        for i, docs in enumerate(results):
            if request.return_scores:
                resp.append([{"document": d, "score": s} for d, s in zip(docs, scores[i])])
            else:
                resp.append(docs)
        return {"result": resp}

    retrieve.__annotations__["request"] = QueryRequest  # this module's annotations are strings
    app.post("/retrieve")(retrieve)
    encode(["warm-up query"])
    return app


def agree(a: list[list[dict]], b: list[list[dict]], tol: float = 1e-4) -> tuple[int, int, int]:
    """(queries, identical top-k lists, lists equal up to ties).

    Equal up to ties: the scores agree to ``tol`` position by position, and the ids agree as a
    set within every run of tied scores, except a run that reaches the cut-off (rows tied with
    the k-th may be any of them).
    """
    same = tied = 0
    for ra, rb in zip(a, b):
        ia = [h["document"]["id"] for h in ra]
        ib = [h["document"]["id"] for h in rb]
        if ia == ib:
            same += 1
            continue
        sa = np.array([h["score"] for h in ra])
        sb = np.array([h["score"] for h in rb])
        if len(sa) != len(sb) or np.max(np.abs(sa - sb)) > tol:
            continue
        ok, j = True, 0
        while j < len(ia):
            end = j + 1
            while end < len(ia) and abs(sa[end - 1] - sa[end]) <= tol:
                end += 1
            if end < len(ia) and set(ia[j:end]) != set(ib[j:end]):
                ok = False
                break
            j = end
        tied += ok
    return len(a), same, tied
