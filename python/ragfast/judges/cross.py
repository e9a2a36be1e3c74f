"""A cross-encoder sufficiency judge: a LoRA-tuned MiniLM reads (question, document) together.

:class:`CrossEncoderJudge` scores a retrieval state in two steps:

1. every document of the state is read TOGETHER with the question by a cross-encoder (the
   bundled all-MiniLM-L6-v2 with LoRA adapters on its top layers and a linear head on the
   mean-pooled output), giving a document logit "this document is one the answer needs"
   (trained on HotpotQA supporting paragraphs);
2. a small logistic head turns the sorted document logits of the state (the best three, the
   log-probability that the best two are both needed, the expected number of needed documents
   found, the number of documents) into the STOP logit "every needed document is here".

A document's logit depends only on (question, document), so the states of one trajectory share
them: each document is read once per question (a bounded cache). The ledger charges a
question every pair it reads in a call as if read then, counting as ``reused`` the pairs that
question read in an earlier call, so its cost does not depend on what the judge scored before. The weights are LoRA factors plus the two heads (about 225 kB) and are merged
into the base encoder at load time, so loading needs neither a hub nor peft. Trained by
:func:`ragfast.judges.train.documents.train_cross_judge` (``ragfast train-judge --kind encoder``).
No cross-encoder weights are bundled: on this project's 2-core CPU budget the adapters did not
get past the constant-prediction loss in one epoch (see the issue-j17 notes); the bundled
default judge is :class:`ragfast.judges.docset.DocSetJudge`.
"""
from __future__ import annotations

import json
import time
from collections import OrderedDict
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from ragfast.infra.cache import text_key
from ragfast.accounting.ledger import CostLedger
from ragfast.errors import ModelError
from ragfast.judges.base import STATE_FEATURES, DocumentStateJudge

__all__ = ["CROSS_FORMAT", "CrossEncoderJudge", "default_cross_judge_path", "merge_lora", "cross_encoder_inputs"]

#: ``format`` field of the card; bumped when the weight layout or the state features change.
CROSS_FORMAT = "ragfast-cross-judge-v1"
def default_cross_judge_path() -> Path:
    """Where an installed cross-encoder judge lives (``ragfast/judges/weights/cross_judge.safetensors``; none ships)."""
    return Path(__file__).resolve().parent / "weights" / "cross_judge.safetensors"


def cross_encoder_inputs(tokenizer: Any, questions: Sequence[str], docs: Sequence[str], max_length: int
                         ) -> list[dict[str, list[int]]]:
    """Token ids of (question, document) pairs, the document truncated first (BERT pair layout)."""
    enc = tokenizer(list(questions), list(docs), truncation="only_second", max_length=max_length, padding=False)
    keys = [k for k in ("input_ids", "token_type_ids") if k in enc]
    return [{k: enc[k][i] for k in keys} for i in range(len(questions))]


def merge_lora(model: Any, factors: dict[str, Any], scale: float) -> int:
    """Add ``scale * B @ A`` into each named linear layer of ``model`` (in place).

    Parameters
    ----------
    model : torch.nn.Module
    factors : dict
        ``{"<module>.lora_A": [r, in], "<module>.lora_B": [out, r]}`` tensors.
    scale : float
        LoRA's ``alpha / r``.

    Returns
    -------
    int
        Number of layers merged.
    """
    import torch

    mods = dict(model.named_modules())
    names = sorted({k[: -len(".lora_A")] for k in factors if k.endswith(".lora_A")})
    with torch.no_grad():
        for name in names:
            if name not in mods or f"{name}.lora_B" not in factors:
                raise ModelError(f"LoRA factor {name!r} does not match a layer of the base encoder")
            w = mods[name].weight
            a = torch.as_tensor(factors[f"{name}.lora_A"]).to(torch.float32)
            b = torch.as_tensor(factors[f"{name}.lora_B"]).to(torch.float32)
            w += (scale * (b @ a)).to(w.dtype)
    return len(names)


class CrossEncoderJudge(DocumentStateJudge):
    """Cross-encoder document scores + a state head; STOP score = the state head's logit.

    Parameters
    ----------
    path : str or Path, optional
        ``cross_judge.safetensors`` (with ``cross_judge.json`` beside it) or a directory holding
        them; default: :func:`default_cross_judge_path` (the package's weights folder, where a
        trained cross-judge can be installed; none ships).
    device : str
        ``"cpu"`` or ``"cuda[:i]"``.
    batch_size : int
        (question, document) pairs per forward pass.
    cache_size : int
        Document logits kept (keyed by question and document text).
    """

    def __init__(self, path: str | Path | None = None, device: str = "cpu", batch_size: int = 64,
                 cache_size: int = 200_000):
        import torch
        from safetensors.torch import load_file
        from transformers import AutoModel, AutoTokenizer

        p = default_cross_judge_path() if path is None else Path(path).expanduser()
        if p.is_dir():
            p = p / "cross_judge.safetensors"
        card_path = p.with_suffix(".json")
        if not p.exists() or not card_path.exists():
            raise ModelError(f"cross-encoder judge not found: need {p} and {card_path} "
                             "(train one with `ragfast train-judge --kind encoder`)")
        self.card = json.loads(card_path.read_text())
        if self.card.get("format") != CROSS_FORMAT:
            raise ModelError(f"{card_path} is not a {CROSS_FORMAT} card (format {self.card.get('format')!r})")
        if list(self.card.get("state_features", [])) != list(STATE_FEATURES):
            raise ModelError(f"{card_path}: state features {self.card.get('state_features')} differ from this "
                             f"ragfast's {list(STATE_FEATURES)}")
        t = load_file(str(p))
        base = self.card.get("base", "minilm")
        if base == "minilm":
            from ragfast.encoders.encoder import minilm_path

            base_dir = minilm_path()
        else:
            base_dir = Path(base).expanduser()
        try:
            self.tokenizer = AutoTokenizer.from_pretrained(base_dir, local_files_only=True)
            self.model = AutoModel.from_pretrained(base_dir, local_files_only=True, dtype=torch.float32)
        except Exception as exc:
            raise ModelError(f"cannot load the cross-judge base encoder from {base_dir}: {exc}") from exc
        lora = {k[len("lora."):]: v for k, v in t.items() if k.startswith("lora.")}
        merge_lora(self.model, lora, float(self.card["lora"]["alpha"]) / float(self.card["lora"]["r"]))
        self.model.eval().to(device)
        self.doc_w = t["doc_head.weight"].to(torch.float32).reshape(-1).to(device)
        self.doc_b = float(t["doc_head.bias"].reshape(-1)[0])
        self.state_w = t["state_head.weight"].double().numpy().reshape(-1)
        self.state_b = float(t["state_head.bias"].reshape(-1)[0])
        if self.state_w.size != len(STATE_FEATURES):
            raise ModelError(f"{p}: state head has {self.state_w.size} weights, expected {len(STATE_FEATURES)}")
        self.max_length = int(self.card.get("max_length", 128))
        self.device = str(device)
        self.batch_size = int(batch_size)
        self.cache_size = int(cache_size)
        # (question, document) -> (logit, tokens read): a hit is charged what the miss was
        self._cache: OrderedDict[tuple[str, str], tuple[float, int]] = OrderedDict()
        self.path = p
        self.name = f"cross-judge:{p.name} on {base}"
        self.meaningful = True

    def describe(self) -> dict[str, Any]:
        """Weights path, base encoder, training data and the held-out metrics from the card."""
        return {"name": self.name, "class": type(self).__name__, "meaningful": self.meaningful,
                "why": "cross-encoder (LoRA-tuned MiniLM) trained on supporting-fact sufficiency labels; see metrics",
                "path": str(self.path), "encoder": self.card.get("base", "minilm"),
                "trained_on": self.card.get("data"), "metrics": self.card.get("metrics")}

    # -- document logits ---------------------------------------------------------------------
    def _forward(self, rows: list[dict[str, list[int]]]) -> np.ndarray:
        import torch

        W = max(len(r["input_ids"]) for r in rows)
        pad = self.tokenizer.pad_token_id or 0
        ids = torch.full((len(rows), W), pad, dtype=torch.long)
        tt = torch.zeros((len(rows), W), dtype=torch.long)
        mask = torch.zeros((len(rows), W), dtype=torch.long)
        for i, r in enumerate(rows):
            n = len(r["input_ids"])
            ids[i, :n] = torch.tensor(r["input_ids"])
            if "token_type_ids" in r:
                tt[i, :n] = torch.tensor(r["token_type_ids"])
            mask[i, :n] = 1
        with torch.inference_mode():
            h = self.model(input_ids=ids.to(self.device), attention_mask=mask.to(self.device),
                           token_type_ids=tt.to(self.device)).last_hidden_state.float()
            m = mask.to(self.device).unsqueeze(-1).float()
            pooled = (h * m).sum(1) / m.sum(1).clamp_min(1.0)
            return (pooled @ self.doc_w + self.doc_b).double().cpu().numpy()

    def doc_logits(self, pairs: Sequence[tuple[str, str]], *, ledger: CostLedger | None = None,
                   question_ids: Sequence[Any] | None = None) -> np.ndarray:
        """Cross-encoder logit per (question, document) pair; cached pairs are charged as if read now.

        Parameters
        ----------
        pairs : sequence of (str, str)
        ledger : CostLedger, optional
            Receives one ``judge`` record per distinct pair (tokens, FLOPs; seconds for those read now).
        question_ids : sequence, optional
            One id per pair, for the per-question ledger split.
        """
        from ragfast.accounting.flops import forward_flops_per_sequence

        # Each question is charged each distinct pair it reads once per call, whether read now,
        # by another question of the call or from the cache (counted as reused only when the same
        # question read it in an earlier call on this ledger): a cached
        # logit keeps its token count, so the charge is the same and a question's cost depends
        # on neither what ran before nor its batch. This call's cached values are read before
        # anything is evicted, so none is lost midway.
        qids = list(question_ids) if question_ids is not None else [None] * len(pairs)
        reads = list(dict.fromkeys((qid, tuple(pair)) for qid, pair in zip(qids, pairs)))
        known: dict[tuple[str, str], tuple[float, int]] = {}
        for key in dict.fromkeys(key for _, key in reads):
            if key in self._cache:
                self._cache.move_to_end(key)
                known[key] = self._cache[key]
        keys = list(dict.fromkeys(key for _, key in reads if key not in known))
        t0 = time.perf_counter()
        if keys:
            rows = cross_encoder_inputs(self.tokenizer, [q for q, _ in keys], [d for _, d in keys], self.max_length)
            lengths = np.array([len(r["input_ids"]) for r in rows])
            order = np.argsort(-lengths, kind="stable")
            out = np.zeros(len(keys))
            for s in range(0, len(keys), self.batch_size):
                idx = order[s:s + self.batch_size]
                out[idx] = self._forward([rows[i] for i in idx])
            for key, v, n in zip(keys, out, lengths):
                known[key] = self._cache[key] = (float(v), int(n))
            while len(self._cache) > self.cache_size:
                self._cache.popitem(last=False)
        if ledger is not None and reads:
            tokens = [known[key][1] for _, key in reads]
            ledger.add_batch("judge", [qid for qid, _ in reads], seconds=time.perf_counter() - t0 if keys else 0.0,
                             input_tokens=tokens, flops=forward_flops_per_sequence(self.model.config, tokens),
                             reused=ledger.first_reads("judge", [qid for qid, _ in reads],
                                                       [("pair", text_key(q + "\x00" + d)) for _, (q, d) in reads]))
        return np.array([known[(q, d)][0] for q, d in pairs], dtype=np.float64)

