"""LoRA SFT of a causal-LM judge on labelled states (``ragfast train-judge --kind causal``).

Each labelled state becomes one example in the judge's exact format: the token ids
:meth:`ragfast.judges.causal.CausalJudge.prompt_ids` builds (chat-templated system prompt and
``QUESTION/CONTEXT`` user message, then the forced ``{"sufficient":`` prefix), followed by the
JSON target ``" true, "gap_items": []}"`` or ``" false, "gap_items": [...]}"`` and EOS. The
loss covers the target tokens only. So the first target token is exactly the token the STOP
score ``log P(true) - log P(false)`` reads, and the trained model scores through the existing
prefix-packed CausalJudge path with no code change.

A ``false`` target needs a non-empty ``gap_items`` list (the schema's consistency rule). It is
the teacher's own gap items where the label came from a teacher, one ``evidence span`` item per
missing supporting title for gold labels, else one generic item.

Training is :func:`ragfast.models.lora_sft.lora_sft` (peft LoRA, the ``[train]`` extra):
``OUT/checkpoint/`` holds the adapter, the optimizer, the step and the random state after
every ``save_every`` steps; ``resume=True`` continues from it with the same data order. At
the end ``OUT/adapter/`` holds the adapter and ``OUT/merged/``
the merged weights with the tokenizer: a plain causal-LM directory for ``--judge``.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np

from ragfast.errors import ConfigError, DataError, ModelError
from ragfast.models.lora_sft import DEFAULT_TARGET_MODULES, load_trainer_state

__all__ = ["target_text", "sft_examples", "train_causal_judge", "DEFAULT_TARGET_MODULES", "load_trainer_state"]

def target_text(sufficient: bool, gap_items: Sequence[dict[str, str]] = ()) -> str:
    """The JSON continuation after ``{"sufficient":`` (starts with " true" or " false")."""
    items = [] if sufficient else [{k: str(it.get(k, "")) for k in ("category", "target", "slot", "description")}
                                   for it in gap_items]
    if not sufficient and not items:
        items = [{"category": "other", "target": "the question", "slot": "answer",
                  "description": "evidence that answers the question"}]
    rest = json.dumps({"gap_items": items}, ensure_ascii=False)[1:]  # '"gap_items": [...]}'
    return (" true, " if sufficient else " false, ") + rest


def _gap_items(ls: Any, source: str) -> list[dict[str, str]]:
    prov = ls.provenance.get(source, {}) if isinstance(ls.provenance, dict) else {}
    if source == "teacher" and prov.get("gap_items"):
        return list(prov["gap_items"])
    if source == "gold" and prov.get("supporting_titles"):
        from ragfast.scoring.metrics import normalize_title

        got = {normalize_title(t) for t in ls.retrieved_titles}
        return [{"category": "evidence span", "target": normalize_title(t), "slot": "passage",
                 "description": f"the passage about {normalize_title(t)}"}
                for t in prov["supporting_titles"] if normalize_title(t) not in got]
    return []


def sft_examples(judge: Any, labelled: Sequence[Any], source: str, max_length: int) -> list[dict[str, Any]]:
    """Token ids and loss labels (-100 on the prompt) of each state labelled by ``source``.

    Parameters
    ----------
    judge : ragfast.judges.causal.CausalJudge
        Supplies the prompt layout and tokenizer (the base model).
    labelled : sequence of LabelledState
    source : str
        Which label to train on; unlabelled states are skipped.
    max_length : int
        Examples longer than this are skipped (their prompt cannot be cut without changing it).
    """
    tok = judge.tokenizer
    eos = tok.eos_token_id
    out = []
    for ls in labelled:
        y = ls.labels.get(source)
        if y is None:
            continue
        prompt = judge.prompt_ids(ls.to_state())
        text = target_text(bool(y), _gap_items(ls, source) if not y else ())
        word, rest = (" true", text[len(" true"):]) if y else (" false", text[len(" false"):])
        tgt = tok(word, add_special_tokens=False)["input_ids"] + tok(rest, add_special_tokens=False)["input_ids"]
        if eos is not None:
            tgt = tgt + [int(eos)]
        ids = list(prompt) + tgt
        if len(ids) > max_length:
            continue
        out.append({"input_ids": ids, "labels": [-100] * len(prompt) + tgt, "y": int(y), "first": tgt[0]})
    return out


def _sft_loss(model: Any, ids: Any, att: Any, lab: Any, decision_weight: float) -> Any:
    """Mean target-token cross-entropy plus ``decision_weight`` x that of the decision token.

    The LM head runs only at target positions (the prompt is most of each example), and the
    decision token (" true"/" false", the one the STOP score reads) gets extra weight.
    """
    import torch
    import torch.nn.functional as F

    base = model.get_base_model()
    h = base.get_decoder()(input_ids=ids, attention_mask=att).last_hidden_state
    nxt = lab[:, 1:]
    sel = nxt != -100
    logits = base.get_output_embeddings()(h[:, :-1][sel]).float()
    ce = F.cross_entropy(logits, nxt[sel], reduction="none")
    # The first selected position of each row predicts its decision token.
    first = torch.zeros_like(sel)
    first[torch.arange(sel.shape[0]), sel.int().argmax(1)] = True
    is_first = first[sel]
    return ce.mean() + decision_weight * ce[is_first].mean()


def train_causal_judge(labelled: str | Path | Sequence[Any], base: str | Path, out_dir: str | Path, *,
                       source: str = "auto", epochs: int = 2, lr: float = 2e-4, r: int = 16, alpha: float = 32.0,
                       dropout: float = 0.05, batch_size: int = 4, micro_batch: int = 1, max_length: int = 4096,
                       target_modules: Sequence[str] = DEFAULT_TARGET_MODULES, save_every: int = 10,
                       resume: bool = False, max_steps: int | None = None, decision_weight: float = 1.0,
                       seed: int = 0, device: str = "cpu", bf16: bool = False, top_layers: int | None = None,
                       log: Callable[[str], None] = print) -> dict[str, Any]:
    """LoRA-fine-tune a causal LM to emit the judge's JSON verdict for labelled states.

    Parameters
    ----------
    labelled : path or sequence of LabelledState
        A ``labelled_states.jsonl`` (``ragfast label-states``) or the states themselves.
    base : str or Path
        Local causal-LM directory (e.g. Qwen2.5-0.5B-Instruct, or a ragfast tiny model).
    out_dir : str or Path
        Gets ``checkpoint/``, ``adapter/``, ``merged/`` and ``train_judge.json``.
    source : {"auto", "teacher", "gold", "probe"}
        Label source; ``auto`` = the first of teacher, gold, probe present.
    epochs, lr, r, alpha, dropout, batch_size
        Optimisation and LoRA settings.
    micro_batch : int
        Examples per forward pass inside a step (the step's loss is the same token mean). One
        example per pass needs no padding, so attention runs torch's causal kernel; a padded
        batch's masked attention takes the O(length^2) math path.
    max_length : int
        Longer examples are skipped (counted in the card).
    target_modules : sequence of str
        Module names LoRA adapts (those present in the model).
    save_every : int
        Checkpoint period in optimizer steps.
    resume : bool
        Continue from ``OUT/checkpoint`` (same data order and step).
    max_steps : int, optional
        Stop after this many steps in total (a checkpoint is written; resume continues).
    decision_weight : float
        Extra weight of the decision token's loss (the token the STOP score reads).
    bf16, top_layers
        bf16 autocast for forward and backward, and LoRA on the last ``top_layers`` decoder
        layers only (:func:`ragfast.models.lora_sft.lora_sft`): what fits a 0.5B judge's
        training into the time goal on two cores.

    Returns
    -------
    dict
        The training card (also written to ``OUT/train_judge.json``).
    """
    import torch

    import importlib.util

    if importlib.util.find_spec("peft") is None:
        raise ConfigError("train-judge --kind causal needs peft: pip install 'ragfast[train]'")
    from ragfast.judges.causal import CausalJudge
    from ragfast.judges.train.labelled import load_labelled_states

    if epochs < 1 or batch_size < 1 or r < 1 or save_every < 1:
        raise ConfigError("epochs, batch_size, r and save_every must be >= 1")
    states = load_labelled_states(labelled) if isinstance(labelled, (str, Path)) else list(labelled)
    if not states:
        raise DataError("no labelled states to train on")
    if source == "auto":
        present = {k for s in states for k, v in s.labels.items() if v is not None}
        source = next((s for s in ("teacher", "gold", "probe") if s in present), "")
        if not source:
            raise DataError("the labelled states carry no label")
    elif source not in ("teacher", "gold", "probe"):
        raise ConfigError(f"label source must be auto, teacher, gold or probe; got {source!r}")
    out = Path(out_dir).expanduser()
    ckpt = out / "checkpoint"
    if not resume and ckpt.exists():
        raise ConfigError(f"{ckpt} exists: pass --resume to continue it, or choose another --out")
    torch.manual_seed(seed)
    # bf16 holds the frozen base in bf16 (the LoRA weights and the optimizer stay fp32): under
    # autocast alone every linear layer re-cast its fp32 weights and activations at each call.
    judge = CausalJudge(base, device=device, dtype="bf16" if bf16 else "fp32")
    examples = sft_examples(judge, states, source, max_length)
    n_lab = sum(1 for s in states if s.labels.get(source) is not None)
    if not examples:
        raise DataError(f"no state labelled by {source!r} fits max_length={max_length}")
    from ragfast.models.lora_sft import lora_sft

    pad = judge.tokenizer.pad_token_id if judge.tokenizer.pad_token_id is not None else 0

    def on_step(step: int, loss: float, sec: float) -> None:
        if step == 1 or step % 10 == 0:  # progress that moves: a 0.5B judge's step takes tens of seconds
            log(f"step {step}: loss {loss:.4f}, {sec:.1f} s/step")

    try:
        run = lora_sft(judge.model, examples, out, pad_id=pad, identity={"source": source, "n_examples": len(examples)},
                       loss_fn=lambda m, i, a, y: _sft_loss(m, i, a, y, decision_weight), epochs=epochs, lr=lr, r=r,
                       alpha=alpha, dropout=dropout, batch_size=batch_size, micro_batch=micro_batch, target_modules=target_modules,
                       save_every=save_every, resume=resume, max_steps=max_steps, seed=seed, device=device,
                       bf16=bf16, top_layers=top_layers, on_step=on_step, log=log)
    except ConfigError as exc:
        raise ConfigError(str(exc).replace("in the model", f"in {base}")) from None
    model, step, losses, epoch_loss, targets = run.model, run.steps, run.losses, run.epoch_loss, run.targets
    finished = run.finished
    card: dict[str, Any] = {
        "format": "ragfast-causal-judge-lora", "base": str(base), "label_source": source,
        "states_labelled": n_lab, "examples": len(examples), "skipped_too_long": n_lab - len(examples),
        "positives": int(sum(e["y"] for e in examples)), "epochs": epochs, "steps": step, "finished": finished,
        "lora": {"r": r, "alpha": alpha, "dropout": dropout, "target_modules": targets}, "lr": lr,
        "batch_size": batch_size, "micro_batch": micro_batch, "bf16": bf16, "top_layers": top_layers, "decision_weight": decision_weight, "loss_first": losses[0] if losses else None, "loss_last": losses[-1] if losses else None,
        "epoch_mean_loss": {k: float(np.mean(v)) for k, v in epoch_loss.items()},
        "seconds_this_run": round(run.seconds, 1),
        "median_step_seconds": float(np.median(run.all_step_seconds)) if run.all_step_seconds else None,
        "target": 'JSON after {"sufficient": ; loss on the target tokens only',
    }
    if finished:
        model.eval()
        model.save_pretrained(str(out / "adapter"))
        merged = model.merge_and_unload()
        mdir = out / "merged"
        if mdir.exists():
            shutil.rmtree(mdir)
        merged.save_pretrained(str(mdir))
        judge.tokenizer.save_pretrained(str(mdir))
        tiny = Path(base).expanduser() / "ragfast_tiny.json"
        if tiny.exists():  # a tiny random base stays marked as not meaningful
            shutil.copy(tiny, mdir / "ragfast_tiny.json")
        card["adapter"] = str(out / "adapter")
        card["merged"] = str(mdir)
        if not (mdir / "config.json").exists():
            raise ModelError(f"merged model was not written to {mdir}")
    (out / "train_judge.json").write_text(json.dumps(card, indent=2) + "\n")
    def fmt(x: Any) -> str:
        return "n/a" if x is None else f"{x:.4f}"

    log(f"train-judge --kind causal: {step} steps on {len(examples)} {source}-labelled states; "
        f"loss {fmt(card['loss_first'])} -> {fmt(card['loss_last'])}" + ("" if finished else " (stopped early; --resume)"))
    return card
