"""``ragfast train-reasoner``: LoRA SFT of a causal LM on Search-R1 trajectories.

The data are :mod:`ragfast.methods.searchr1.sft_data`'s oracle trajectories (real retrieval,
exact prompt and protocol, an over-searching behaviour mix chosen on the training questions);
the loss covers the generated ``<think>``/``<search>``/``<answer>`` turns and never the
observations. Training is :func:`ragfast.models.lora_sft.lora_sft` (checkpoints, exact
``--resume``). ``OUT/`` gets ``data.jsonl`` (the token ids and labels, so a resume trains on the
very same data), ``data_card.json``, ``checkpoint/`` and, when every step is done, ``adapter/``
(``adapter_model.safetensors``, ``adapter_config.json`` and the card ``ragfast_reasoner.json``).
"""
from __future__ import annotations

import hashlib
import json
import time
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np

from ragfast.errors import ConfigError, DataError
from ragfast.ops.topk_ip_choice import cpu_model

__all__ = ["REASONER_CARD", "train_reasoner", "data_digest"]

#: The card inside an adapter directory.
REASONER_CARD = "ragfast_reasoner.json"


def data_digest(examples: Sequence[dict[str, Any]]) -> str:
    """sha256 over every example's ids and labels (a resume must train on the same data)."""
    h = hashlib.sha256()
    for e in examples:
        h.update(json.dumps([e["input_ids"], e["labels"]]).encode())
    return h.hexdigest()


def _load_avg() -> list[float] | None:
    try:
        import os

        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None


def _build_data(out: Path, base_dir: Path, tokenizer: Any, *, parts: Sequence[str], limit: int | None,
                max_obs_tokens: int, max_turns: int, topk: int, quote_words: int, distinct_queries: bool,
                final_answer_only: bool, seed: int,
                make_retriever: Callable[[Any], Any],
                log: Callable[[str], None]) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    from ragfast.methods.searchr1.sft_data import STUDY_SEARCHES_PER_QUESTION, build_training_set, training_questions

    t0 = time.perf_counter()
    qs = training_questions(parts, limit)
    ret = make_retriever(qs)
    corp = getattr(ret, "corpus", None)

    def fmt(u: str) -> str:
        return tokenizer.apply_chat_template([{"role": "user", "content": u}], add_generation_prompt=True,
                                             tokenize=False) if getattr(tokenizer, "chat_template", None) else u

    eos = tokenizer.eos_token_id
    examples, mix, stats = build_training_set(qs, ret, tokenizer, fmt, eos_id=eos, max_turns=max_turns, topk=topk,
                                              max_obs_tokens=max_obs_tokens, quote_words=quote_words,
                                              distinct_queries=distinct_queries, final_answer_only=final_answer_only,
                                              seed=seed,
                                              log=log)
    card = {"parts": list(parts), "limit": limit, "base": str(base_dir), "questions": len(qs),
            "corpus": ["contexts of these questions", "wiki-sample"], "corpus_passages": None if corp is None else len(corp),
            "retriever": getattr(ret, "name", type(ret).__name__),
            "max_turns": max_turns, "topk": topk, "max_obs_tokens": max_obs_tokens, "quote_words": quote_words,
            "distinct_queries": distinct_queries, "final_answer_only": final_answer_only,
            "mix": {"min_searches_low": mix.low, "fraction_low_plus_one": round(mix.fraction_high, 4),
                    "target_safe_prevalence": mix.target, "expected": round(mix.expected, 4),
                    "safe_prevalence_by_min_searches": {str(k): round(v, 4) for k, v in mix.prevalence_by_min.items()},
                    "study_searches_per_question": STUDY_SEARCHES_PER_QUESTION,
                    "rule": "the oracle answers a found answer only after min_searches searches; min_searches is "
                            "low or low+1 (by a hash of the question id); low and the fraction are chosen so that "
                            "the share of eligible states (states followed by a search) that were already "
                            "answerable, on these training questions, is nearest the S2G study's 0.251 for "
                            "Search-R1 7B; no dev or test question is read"},
            **stats, "seconds": round(time.perf_counter() - t0, 1)}
    out.mkdir(parents=True, exist_ok=True)
    tmp = out / "data.jsonl.tmp"
    with tmp.open("w") as f:
        for e in examples:
            f.write(json.dumps({"id": e["id"], "input_ids": e["input_ids"], "labels": e["labels"]}) + "\n")
    tmp.rename(out / "data.jsonl")
    (out / "data_card.json").write_text(json.dumps(card, indent=2) + "\n")
    return examples, card


def train_reasoner(out_dir: str | Path, *, base: str = "smollm2", parts: Sequence[str] | None = None,
                   limit: int | None = None, max_obs_tokens: int = 128, max_turns: int = 4, topk: int = 3,
                   quote_words: int = 0, distinct_queries: bool = False, final_answer_only: bool = False,
                   epochs: int = 1, lr: float = 3e-4, r: int = 16, alpha: float = 32.0, dropout: float = 0.05,
                   batch_size: int = 4, top_layers: int | None = None, save_every: int = 10, resume: bool = False, max_steps: int | None = None,
                   bf16: bool = False, seed: int = 0, make_retriever: Callable[[Any], Any] | None = None,
                   threads: int | None = None, log: Callable[[str], None] = print) -> dict[str, Any]:
    """Build the trajectories (once), LoRA-train ``base`` on them, write the adapter and its card.

    Parameters
    ----------
    out_dir : str or Path
    base : str
        Catalogue name (``smollm2``) or a local causal-LM directory.
    parts : sequence of str, optional
        Training QA files or sample names (default: hotpotqa-train and hotpotqa-train-extra).
    limit : int, optional
        Use the first ``limit`` training questions only.
    max_obs_tokens : int
        Observation cap in the base's tokens while building the trajectories. The protocol's
        cap is 500; 128 keeps about the first document of three. On the 615 bundled training
        questions (BM25) a trajectory then has 1,075 tokens on average, 476 of them
        observation (almost every observation reaches the cap), which is what lets a CPU run
        fit its time. Evaluate with the same ``--max-obs-tokens``.
    max_turns, topk
        The loop's search budget and documents per search.
    quote_words : int
        Words the oracle's claims quote from a document (0: none; ``Doc 1 (Title) names X.``).
        0 because an adapter trained on 25-40-word quotes copied them into runaway turns.
    distinct_queries, final_answer_only : bool
        :class:`~ragfast.models.scripted.ScriptedGenerator`'s options of the same names (no query
        searched twice; the forced final turn as ``<answer> X </answer>``). Off: the bundled
        adapter's data. On, with ``max_obs_tokens`` 256, the adapters held out worse (see README).
    epochs, lr, r, alpha, dropout, batch_size, save_every, max_steps, seed
        :func:`ragfast.models.lora_sft.lora_sft` settings (one example per forward pass).
    top_layers : int, optional
        LoRA on the last ``top_layers`` decoder layers only (backward stops there; faster).
    resume : bool
        Continue ``OUT/checkpoint`` on ``OUT/data.jsonl``.
    make_retriever : callable
        ``make_retriever(questions)``: the retriever over the default corpus of the training
        questions (their own paragraphs plus the wiki sample); needed unless resuming.
    bf16 : bool
        bf16 autocast for forward and backward.
    threads : int, optional
        torch CPU threads.

    Returns
    -------
    dict
        The card (also ``OUT/train_reasoner.json``; with the adapter, ``adapter/ragfast_reasoner.json``).
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from ragfast.models.lora_sft import lora_sft
    from ragfast.methods.searchr1.sft_data import TRAIN_PARTS

    if max_obs_tokens < 1 or max_turns < 1 or topk < 1:
        raise ConfigError("max_obs_tokens, max_turns and topk must be >= 1")
    if threads is not None:
        torch.set_num_threads(int(threads))
    parts = list(parts or TRAIN_PARTS)
    from ragfast.models.hub import local_model

    base_dir = Path(local_model(base, "--base")).expanduser()
    if not (base_dir / "config.json").is_file():
        raise ConfigError(f"--base {base!r} is neither a catalogue model nor a local model directory")
    out = Path(out_dir).expanduser()
    if not resume and (out / "checkpoint").exists():
        raise ConfigError(f"{out / 'checkpoint'} exists: pass --resume to continue it, or choose another --out")
    tok = AutoTokenizer.from_pretrained(str(base_dir), local_files_only=True)
    data_file = out / "data.jsonl"
    settings = {"parts": parts, "limit": limit, "max_obs_tokens": max_obs_tokens, "max_turns": max_turns,
                "topk": topk, "quote_words": quote_words, "distinct_queries": distinct_queries,
                "final_answer_only": final_answer_only, "base": str(base_dir)}
    old_card = json.loads((out / "data_card.json").read_text()) if (out / "data_card.json").is_file() else None
    if data_file.exists() and old_card is not None and {k: old_card.get(k) for k in settings} == settings:
        # The same settings built these trajectories already (or a resume): train on the very same tokens.
        examples = [json.loads(line) for line in data_file.read_text().splitlines() if line.strip()]
        data_card = old_card
        log(f"{len(examples)} trajectories from {data_file}")
    elif resume and (out / "checkpoint").exists():
        raise ConfigError(f"{out} has a checkpoint but no data.jsonl of these settings: cannot resume it")
    else:
        if make_retriever is None:
            raise ConfigError("train_reasoner needs make_retriever to build its trajectories")
        examples, data_card = _build_data(out, base_dir, tok, parts=parts, limit=limit, max_obs_tokens=max_obs_tokens,
                                          max_turns=max_turns, topk=topk, quote_words=quote_words,
                                          distinct_queries=distinct_queries, final_answer_only=final_answer_only, seed=seed,
                                          make_retriever=make_retriever,
                                          log=log)
        log(f"{len(examples)} trajectories, {data_card['searches_per_question']:.2f} searches/q, "
            f"{data_card['tokens']} tokens ({data_card['target_tokens']} in the loss), {data_card['seconds']:.0f} s")
    if not examples:
        raise DataError("no training trajectories")
    digest = data_digest(examples)
    model = AutoModelForCausalLM.from_pretrained(str(base_dir), local_files_only=True, dtype=torch.float32)
    pad = tok.pad_token_id if tok.pad_token_id is not None else (tok.eos_token_id or 0)
    t_start = time.perf_counter()
    every = max(1, save_every)

    def on_step(step: int, loss: float, sec: float) -> None:
        if step % every == 0 or step == 1:
            log(f"step {step}: loss {loss:.4f}, {sec:.1f} s/step, load {_load_avg()}")

    run = lora_sft(model, examples, out, pad_id=pad,
                   identity={"n_examples": len(examples), "data_sha256": digest, "bf16": bool(bf16),
                             "top_layers": top_layers},
                   epochs=epochs, lr=lr, r=r, alpha=alpha, dropout=dropout, batch_size=batch_size, micro_batch=1,
                   top_layers=top_layers, save_every=save_every, resume=resume, max_steps=max_steps, seed=seed, bf16=bf16,
                   on_step=on_step, log=log)
    tokens = sum(len(e["input_ids"]) for e in examples)
    sps = float(np.median(run.all_step_seconds)) if run.all_step_seconds else None
    card: dict[str, Any] = {
        "format": "ragfast-searchr1-reasoner-lora", "base": base, "base_dir": str(base_dir),
        "data": data_card, "data_sha256": digest, "examples": len(examples), "tokens": tokens,
        "epochs": epochs, "steps": run.steps, "planned_steps": run.total, "finished": run.finished,
        "lora": {"r": r, "alpha": alpha, "dropout": dropout, "target_modules": run.targets,
                 "top_layers": top_layers}, "lr": lr,
        "batch_size": batch_size, "bf16_autocast": bool(bf16),
        "loss_first": run.losses[0] if run.losses else None, "loss_last": run.losses[-1] if run.losses else None,
        "epoch_mean_loss": {k: float(np.mean(v)) for k, v in run.epoch_loss.items()},
        "loss_last10_mean": float(np.mean(run.losses[-10:])) if run.losses else None,
        "seconds_this_run": round(run.seconds, 1), "steps_this_run": len(run.step_seconds),
        "training_seconds_all_runs": round(float(sum(run.all_step_seconds)), 1),
        "cpu_seconds_this_run": round(run.cpu_seconds, 1),
        "median_seconds_per_step": None if sps is None else round(sps, 2),
        "projected_seconds_all_steps": None if sps is None else round(sps * run.total, 0),
        "machine": {"cpu": cpu_model(), "threads": torch.get_num_threads(), "load_at_end": _load_avg()},
        "loss": "mean cross-entropy over the generated turns' tokens; prompt and observations are -100",
    }
    if run.finished:
        adir = out / "adapter"
        run.model.save_pretrained(str(adir))
        (adir / REASONER_CARD).write_text(json.dumps(card, indent=2) + "\n")
        card["adapter"] = str(adir)
    (out / "train_reasoner.json").write_text(json.dumps(card, indent=2) + "\n")
    log(f"train-reasoner: {run.steps}/{run.total} steps on {len(examples)} trajectories in "
        f"{time.perf_counter() - t_start:.0f} s; loss {card['loss_first']} -> {card['loss_last']}"
        + ("" if run.finished else " (stopped early; --resume continues)"))
    return card
