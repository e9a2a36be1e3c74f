"""Training the frozen-feature head judge (``ragfast train-judge --kind head``).

:func:`build_training_states` retrieves states with gold sufficiency labels from questions with
supporting facts; :func:`train_encoder_judge` fits the logistic head of
:class:`ragfast.judges.head.EncoderJudge` on them and writes ``encoder_judge.safetensors`` with
its JSON card.
"""
from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from ragfast.errors import ConfigError, DataError
from ragfast.judges.head import FEATURE_VERSION, FeatureMaker
from ragfast.types import State

__all__ = ["build_training_states", "train_encoder_judge"]


def build_training_states(questions: Sequence[Any], corpus: Any, features: "FeatureMaker", *, k: int = 3,
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
    (:func:`ragfast.scoring.metrics.sufficient`). The turns are :func:`ragfast.judges.train.states.dense_turns`,
    as for the doc-set and cross-encoder judges' trajectory states.

    Returns
    -------
    states, labels (int8), question ids (one per state)
    """
    from ragfast.judges.train.states import dense_turns, document_text

    qs = [q for q in questions if q.supporting_titles]
    if not qs:
        raise DataError("no question has supporting titles; cannot label sufficiency")
    n = len(corpus)
    if n < k:
        raise DataError(f"corpus has {n} passages, fewer than k={k}")
    passages = [corpus.passage(i) for i in range(n)]
    doc_texts = [document_text(p) for p in passages]
    features.embed_documents(doc_texts)
    P = np.stack([features.doc_vector(t) for t in doc_texts])
    per_q = dense_turns(qs, passages, P, lambda t: features.encoder.encode_queries(t).numpy(), k=k, turns=turns)
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
    feats = FeatureMaker(enc)
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
