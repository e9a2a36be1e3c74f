"""Stopping judges: score a retrieval state "stop now, the evidence is sufficient".

Two backends behind :class:`ragfast.models.Judge`:

- :class:`ragfast.models.causal_judge.CausalJudge`: a causal LM (S2G protocol, see
  ``shared/PROTOCOLS.md``), scoring the next token after the prompt of
  :mod:`ragfast.models.judge_prompt`.
- :class:`EncoderJudge` (here): a frozen sentence encoder (the bundled all-MiniLM-L6-v2) with a small
  logistic head over question/evidence features; trained by :func:`train_encoder_judge`
  (``ragfast train-judge``) on states labelled by supporting facts.

:func:`load_judge` turns a CLI spec (``encoder``, a head file, or an LM directory) into a judge.
"""
from __future__ import annotations

import json
import math
import time
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from ragfast.cost import CostLedger
from ragfast.errors import ConfigError, DataError, ModelError
from ragfast.models.base import Judge
from ragfast.models.causal_judge import CausalJudge
from ragfast.models.judge_prompt import as_states, context_blocks
from ragfast.protocol import split_documents
from ragfast.text import content_words
from ragfast.types import State

__all__ = ["EncoderJudge", "load_judge", "default_encoder_judge_path", "build_training_states",
           "train_encoder_judge"]

# ---------------------------------------------------------------------------------------------
# EncoderJudge
# ---------------------------------------------------------------------------------------------
#: Bumped when the feature layout changes; a head trained on another layout will not load.
FEATURE_VERSION = 1
_N_SCALARS = 7


def default_encoder_judge_path() -> Path:
    """The bundled EncoderJudge head (``ragfast/models/weights/encoder_judge.safetensors``)."""
    return Path(__file__).resolve().parent / "weights" / "encoder_judge.safetensors"


def _content_words(text: str) -> set[str]:
    return set(content_words(text, min_len=3))


class _FeatureMaker:
    """Question/evidence features on a frozen sentence encoder, with an embedding cache.

    Per state: the question vector q, the mean c of its document vectors, q*c, |q-c|, then
    seven scalars: the three highest and the mean question-document cosines, log(1 + #docs),
    an empty-state flag, and the fraction of the question's content words found in the
    evidence text. Documents are embedded one by one (the encoder reads 256 tokens), and each
    distinct text only once: the states of a trajectory share their documents.
    """

    def __init__(self, encoder: Any, cache_bytes: int | None = None):
        from ragfast.encoders.encoder import EmbeddingCache

        self.encoder = encoder
        self.dim = int(encoder.dim)
        # Least recently used first out once over the byte cap; a hit is charged as a miss.
        self._q = EmbeddingCache(encoder, "query", cache_bytes)
        self._d = EmbeddingCache(encoder, "passage", cache_bytes)

    @property
    def n_features(self) -> int:
        return 4 * self.dim + _N_SCALARS

    def embed_documents(self, texts: Sequence[str]) -> None:
        """Embed document texts into the cache (as the judge reads them)."""
        self._d.embed(list(texts))

    def doc_vector(self, text: str) -> np.ndarray:
        v = self._d.get(text)
        return v if v is not None else self._d.embed([text]).vectors[text]

    def __call__(self, states: Sequence[State], question_ids: Sequence[Any] | None = None,
                 ledger: CostLedger | None = None) -> np.ndarray:
        """Features ``[len(states), n_features]``; the embeddings are charged to ``ledger`` as ``judge``."""
        from ragfast.encoders.encoder import record_embedded

        qids = list(question_ids) if question_ids is not None else [None] * len(states)
        docs = [[d for b in context_blocks(s) for d in split_documents(b)] for s in states]
        qe = self._q.embed([s.question for s in states], qids)
        flat = [(d, qid) for ds, qid in zip(docs, qids) for d in ds]
        de = self._d.embed([d for d, _ in flat], [q for _, q in flat])
        record_embedded(ledger, "judge", [qe, de])
        qv, dv = qe.vectors, de.vectors
        X = np.zeros((len(states), self.n_features), dtype=np.float32)
        D = self.dim
        for i, (s, ds) in enumerate(zip(states, docs)):
            q = qv[s.question]
            if ds:
                E = np.stack([dv[d] for d in ds])
                c = E.mean(0)
                sims = np.sort(E @ q)[::-1]
            else:
                c = np.zeros(D, dtype=np.float32)
                sims = np.zeros(0, dtype=np.float32)
            top = np.zeros(3, dtype=np.float32)
            top[:min(3, len(sims))] = sims[:3]
            qw = _content_words(s.question)
            ev = _content_words(" ".join(ds)) if ds else set()
            overlap = len(qw & ev) / len(qw) if qw else 0.0
            X[i, :D] = q
            X[i, D:2 * D] = c
            X[i, 2 * D:3 * D] = q * c
            X[i, 3 * D:4 * D] = np.abs(q - c)
            X[i, 4 * D:] = [top[0], top[1], top[2], float(sims.mean()) if len(sims) else 0.0,
                            math.log1p(len(ds)), float(not ds), overlap]
        return X


class EncoderJudge(Judge):
    """A frozen sentence encoder with a logistic head; STOP score = the head's logit.

    Parameters
    ----------
    path : str or Path, optional
        A head file (``*.safetensors`` with its ``.json`` card beside it) or a directory holding
        ``encoder_judge.safetensors``; default: the bundled head (:func:`default_encoder_judge_path`),
        trained by ``ragfast train-judge`` on the bundled HotpotQA train sample.
    device : str
        Encoder device.
    encoder : ragfast.encoders.encoder.Encoder, optional
        Reuse an already loaded encoder (must match the card's encoder).

    Notes
    -----
    ``describe()`` carries the card's validation metrics: the bundled head is trained on real
    sufficiency labels but on 240 questions only, so its scores are a weak, honest signal.
    """

    def __init__(self, path: str | Path | None = None, device: str = "cpu", encoder: Any = None):
        from safetensors.numpy import load_file

        p = default_encoder_judge_path() if path is None else Path(path).expanduser()
        if p.is_dir():
            p = p / "encoder_judge.safetensors"
        card_path = p.with_suffix(".json")
        if not p.exists() or not card_path.exists():
            raise ModelError(f"EncoderJudge head not found: need {p} and {card_path} "
                             "(train one with `ragfast train-judge`)")
        self.card = json.loads(card_path.read_text())
        if self.card.get("format") != "ragfast-encoder-judge" or self.card.get("feature_version") != FEATURE_VERSION:
            raise ModelError(f"{card_path} is not a ragfast encoder-judge card of feature version {FEATURE_VERSION}")
        t = load_file(str(p))
        self.weight = t["weight"].astype(np.float64).reshape(-1)
        self.bias = float(t["bias"].reshape(-1)[0])
        if encoder is None:
            from ragfast.encoders.encoder import Encoder

            encoder = Encoder(self.card["encoder"], device=device)
        self.encoder = encoder
        self.features = _FeatureMaker(encoder)
        if self.features.n_features != self.weight.size:
            raise ModelError(f"{p}: head has {self.weight.size} weights but the encoder gives "
                             f"{self.features.n_features} features")
        self.path = p
        self.name = f"encoder-judge:{p.name} on {self.card['encoder']}"
        self.meaningful = True

    def describe(self) -> dict[str, Any]:
        """Head path, encoder, training data and the held-out metrics from the card."""
        return {"name": self.name, "class": type(self).__name__, "meaningful": self.meaningful,
                "why": "logistic head trained on supporting-fact sufficiency labels; see metrics",
                "path": str(self.path), "encoder": self.card["encoder"], "trained_on": self.card.get("data"),
                "metrics": self.card.get("metrics")}

    def stop_scores(self, states: Sequence[State | tuple[str, list[str]]], *, ledger: CostLedger | None = None,
                    question_ids: Sequence[str] | None = None) -> np.ndarray:
        """The head's logit per state (float64). Encoder compute goes to the ledger as ``judge``."""
        sts = as_states(states)
        if question_ids is not None and len(question_ids) != len(sts):
            raise DataError(f"{len(question_ids)} question ids for {len(sts)} states")
        if not sts:
            return np.zeros(0, dtype=np.float64)
        X = self.features(sts, question_ids, ledger)
        return X.astype(np.float64) @ self.weight + self.bias


def load_judge(spec: str, device: str = "cpu") -> Any:
    """A judge from a CLI spec.

    ``encoder``: the bundled default judge (:class:`ragfast.models.doc_judge.DocSetJudge`);
    ``head``: the bundled frozen-feature :class:`EncoderJudge`; or a path: a doc-set judge or a
    cross-encoder judge (``docset_judge.safetensors`` / ``cross_judge.safetensors`` or a directory
    holding one), an encoder-judge head (``.safetensors`` or a directory with
    ``encoder_judge.safetensors``), or a causal-LM directory.

    Raises
    ------
    ragfast.errors.ConfigError
        When the spec names nothing loadable.
    """
    from ragfast.models.cross_judge import CrossEncoderJudge
    from ragfast.models.doc_judge import DocSetJudge

    if spec == "encoder":
        return DocSetJudge(device=device)
    if spec == "head":
        return EncoderJudge(device=device)
    from ragfast.models.catalogue import is_catalogued, resolve

    if is_catalogued(spec):  # e.g. smollm2: the structured zero-shot causal judge
        return CausalJudge(resolve(spec), device=device)
    p = Path(spec).expanduser()
    for name, cls in (("docset_judge.safetensors", DocSetJudge), ("cross_judge.safetensors", CrossEncoderJudge)):
        if p.name == name or (p.is_dir() and (p / name).exists()):
            return cls(p, device=device)
    if p.suffix == ".safetensors" or (p.is_dir() and (p / "encoder_judge.safetensors").exists()):
        return EncoderJudge(p, device=device)
    if p.is_dir() and (p / "config.json").exists():
        return CausalJudge(p, device=device)
    raise ConfigError(f"--judge {spec!r}: expected 'encoder' (the bundled doc-set judge), 'head' (the bundled "
                      "frozen-feature head), a docset_judge/cross_judge .safetensors (or a directory with one), an "
                      "encoder-judge head (.safetensors or a directory with encoder_judge.safetensors), or a "
                      "causal-LM directory with config.json")


# ---------------------------------------------------------------------------------------------
# training the EncoderJudge head
# ---------------------------------------------------------------------------------------------
def _observation(passages: Sequence[Any]) -> str:
    docs = "".join(f"Doc {i + 1}(Title: {p.title}) {p.text}\n" for i, p in enumerate(passages))
    return f"<information>{docs.strip()}</information>"


def build_training_states(questions: Sequence[Any], corpus: Any, features: "_FeatureMaker", *, k: int = 3,
                          turns: int = 4) -> tuple[list[State], np.ndarray, list[str]]:
    """Retrieval states with gold sufficiency labels, from questions with supporting titles.

    Per question, state 0 has no evidence; turn 1 adds the top-``k`` passages for the
    question; turn t >= 2 adds the top-``k`` unseen passages for "question + title of the best
    hit of turn t-1" (a crude bridge query, as a multi-hop reasoner would issue). Retrieval is
    dense inner product with the judge's own encoder over ``corpus``: each passage is embedded
    once, in exactly the form the judge reads it inside an observation, and that vector is
    stored in the judge's feature cache, so building the states costs one corpus pass. Each
    evidence block is a Search-R1 observation (``<information>Doc i(Title: ...) ...</information>``).
    A state is labelled 1 when every supporting title has been retrieved
    (:func:`ragfast.metrics.sufficient`).

    Returns
    -------
    states, labels (int8), question ids (one per state)
    """
    from ragfast.metrics import normalize_title, sufficient

    qs = [q for q in questions if q.supporting_titles]
    if not qs:
        raise DataError("no question has supporting titles; cannot label sufficiency")
    n = len(corpus)
    if n < k:
        raise DataError(f"corpus has {n} passages, fewer than k={k}")
    passages = [corpus.passage(i) for i in range(n)]
    doc_texts = [split_documents(_observation([p]))[0] for p in passages]
    features.embed_documents(doc_texts)
    P = np.stack([features.doc_vector(t) for t in doc_texts])
    # Turn by turn over all questions, so each turn's queries are one batched encoder call.
    per_q: list[list[tuple[State, int]]] = [[(State(q.question, [], q.id, 0), 0)] for q in qs]
    seen: list[set[int]] = [set() for _ in qs]
    evs: list[list[str]] = [[] for _ in qs]
    titles: list[list[str]] = [[] for _ in qs]
    best: list[str] = [""] * len(qs)
    for t in range(turns):
        texts = [q.question if t == 0 else f"{q.question} {normalize_title(best[i])}" for i, q in enumerate(qs)]
        sims = features.encoder.encode_queries(texts).numpy() @ P.T
        for i, q in enumerate(qs):
            s = sims[i]
            s[list(seen[i])] = -np.inf
            hits = [int(j) for j in np.argsort(-s, kind="stable")[:k]]
            seen[i].update(hits)
            best[i] = passages[hits[0]].title
            titles[i] += [passages[j].title for j in hits]
            evs[i] = evs[i] + [_observation([passages[j] for j in hits])]
            per_q[i].append((State(q.question, list(evs[i]), q.id, t + 1),
                             int(sufficient(titles[i], q.supporting_titles))))
    states = [st for rows in per_q for st, _ in rows]
    labels = [lab for rows in per_q for _, lab in rows]
    qids = [st.trajectory_id for st in states]
    return states, np.asarray(labels, dtype=np.int8), qids


def _metrics(labels: np.ndarray, logits: np.ndarray) -> dict[str, float]:
    from sklearn.metrics import brier_score_loss

    probs = 1.0 / (1.0 + np.exp(-logits))
    return {"ap": _ap(labels, logits), "brier": float(brier_score_loss(labels, probs)),
            "n_states": int(labels.size), "base_rate": float(labels.mean())}


def _fmt(x: float | None) -> str:
    return "undefined (one class)" if x is None else f"{x:.4f}"


def _ap(labels: np.ndarray, scores: np.ndarray) -> float | None:
    """Average precision, or None when the labels hold one class only (AP is undefined)."""
    from sklearn.metrics import average_precision_score

    if labels.size == 0 or labels.min() == labels.max():
        return None
    return float(average_precision_score(labels, scores))


def train_encoder_judge(data: str | Path, out_dir: str | Path, *, dev: str | Path | None = None,
                        val_fraction: float = 0.2, seed: int = 0, k: int = 3, turns: int = 4,
                        encoder: str = "minilm", device: str = "cpu", log: Any = print) -> dict[str, Any]:
    """Train the EncoderJudge head; write ``encoder_judge.safetensors`` and its JSON card.

    Parameters
    ----------
    data : str or Path
        A QA file with supporting facts and context paragraphs (HotpotQA layout) or a sample
        name (e.g. ``"hotpotqa-train"``). The retrieval corpus is its context paragraphs
        (:func:`ragfast.data.corpus_from_contexts`).
    out_dir : str or Path
        Output directory.
    dev : str or Path, optional
        A second QA file evaluated with its own context corpus (reported, never trained on).
    val_fraction : float
        Share of questions held out (grouped by question) for the validation metrics.
    seed, k, turns
        Split seed; passages per turn; search turns per question.
    encoder : str
        Encoder preset or checkpoint directory (frozen).

    Returns
    -------
    dict
        The card written next to the weights.
    """
    from safetensors.numpy import save_file
    from sklearn.linear_model import LogisticRegression
    from sklearn.model_selection import GroupKFold

    import ragfast
    from ragfast.data import corpus_from_contexts, load_qa
    from ragfast.encoders.encoder import Encoder

    if not 0.0 < val_fraction < 0.9:
        raise ConfigError(f"val_fraction must be in (0, 0.9), got {val_fraction}")
    t_start = time.perf_counter()
    questions = load_qa(data)
    corpus = corpus_from_contexts(questions)
    enc = Encoder(encoder, device=device)
    feats = _FeatureMaker(enc)
    log(f"train-judge: {len(questions)} questions, corpus of {len(corpus)} context paragraphs, encoder {enc.name}")
    states, y, qids = build_training_states(questions, corpus, feats, k=k, turns=turns)
    X = feats(states)
    uq = sorted(set(qids))
    rng = np.random.default_rng(seed)
    val_q = set(rng.permutation(uq)[: max(1, int(round(len(uq) * val_fraction)))].tolist())
    is_val = np.array([q in val_q for q in qids])
    Xtr, ytr, gtr = X[~is_val], y[~is_val], [q for q, v in zip(qids, is_val) if not v]
    mu = Xtr.mean(0)
    sd = Xtr.std(0) + 1e-6
    Z = (Xtr - mu) / sd
    # C by question-grouped 5-fold CV on the training questions only (validation stays unseen).
    best_c, best_ap = None, -1.0
    from sklearn.metrics import average_precision_score

    for c in (0.001, 0.003, 0.01, 0.03, 0.1, 0.3):
        aps = []
        for tr, te in GroupKFold(n_splits=min(5, len(set(gtr)))).split(Z, ytr, gtr):
            if len(set(ytr[tr].tolist())) < 2 or ytr[te].sum() == 0:
                continue  # a fold without both classes says nothing about ranking
            m = LogisticRegression(C=c, max_iter=2000).fit(Z[tr], ytr[tr])
            aps.append(average_precision_score(ytr[te], m.decision_function(Z[te])))
        if not aps:
            raise DataError("too few sufficient/insufficient states to choose the head's regularisation")
        ap = float(np.mean(aps))
        log(f"  C={c:g}: grouped-CV AP {ap:.4f}")
        if ap > best_ap:
            best_c, best_ap = c, ap
    model = LogisticRegression(C=best_c, max_iter=5000).fit(Z, ytr)
    # Fold the standardisation into the weights: logit = x @ (w / sd) + (b - sum(w * mu / sd)).
    w = (model.coef_[0] / sd).astype(np.float32)
    b = np.float32(model.intercept_[0] - float(np.sum(model.coef_[0] * mu / sd)))
    val_logits = X[is_val].astype(np.float64) @ w.astype(np.float64) + float(b)
    ndocs = X[:, 4 * feats.dim + 4]
    metrics: dict[str, Any] = {
        "train": {**_metrics(ytr, Z @ model.coef_[0] + model.intercept_[0]), "n_questions": len(uq) - len(val_q)},
        "validation": {**_metrics(y[is_val], val_logits), "n_questions": len(val_q),
                       "ap_ndocs_baseline": _ap(y[is_val], ndocs[is_val])},
        "cv_ap": best_ap,
    }
    log(f"  chose C={best_c:g}; validation AP {_fmt(metrics['validation']['ap'])} "
        f"(#docs baseline {_fmt(metrics['validation']['ap_ndocs_baseline'])}), Brier {metrics['validation']['brier']:.4f}")
    if dev is not None:
        dq = load_qa(dev)
        ds, dy, _ = build_training_states(dq, corpus_from_contexts(dq), feats, k=k, turns=turns)
        DX = feats(ds)
        dl = DX.astype(np.float64) @ w.astype(np.float64) + float(b)
        metrics["dev"] = {**_metrics(dy, dl), "n_questions": len(set(s.trajectory_id for s in ds)),
                          "ap_ndocs_baseline": _ap(dy, DX[:, 4 * feats.dim + 4]),
                          "source": str(dev)}
        log(f"  dev ({dev}): AP {_fmt(metrics['dev']['ap'])} (#docs baseline {_fmt(metrics['dev']['ap_ndocs_baseline'])}), "
            f"Brier {metrics['dev']['brier']:.4f}")
    out = Path(out_dir).expanduser()
    out.mkdir(parents=True, exist_ok=True)
    save_file({"weight": w, "bias": np.asarray([b], dtype=np.float32)}, str(out / "encoder_judge.safetensors"))
    card = {
        "format": "ragfast-encoder-judge", "feature_version": FEATURE_VERSION, "encoder": encoder,
        "n_features": int(w.size), "head": "logistic regression (L2, sklearn lbfgs) on standardised features; "
                                          "standardisation folded into weight/bias",
        "features": ("question vector q, mean document vector c, q*c, |q-c|, top-3 and mean q-doc cosine, "
                     "log(1+#docs), empty flag, question content-word overlap"),
        "data": str(data),
        "states": (f"per question: an empty state, then {turns} turns of top-{k} dense (encoder) retrieval over "
                   "the questions' context paragraphs; turn 1 queries the question, later turns the question "
                   "plus the best previous hit's title; label = all supporting titles retrieved"),
        "split": {"val_fraction": val_fraction, "seed": seed, "grouped_by": "question"},
        "C": best_c, "metrics": metrics, "ragfast_version": ragfast.__version__,
        "seconds": round(time.perf_counter() - t_start, 1),
    }
    (out / "encoder_judge.json").write_text(json.dumps(card, indent=2) + "\n")
    return card
