"""LoRA supervised fine-tuning of a causal LM with checkpoints and exact resume.

Shared by ``train-judge --kind causal`` (:mod:`ragfast.judges.train.causal`) and
``train-reasoner`` (:mod:`ragfast.methods.searchr1.reasoner_train`). Each example is a dict with
``input_ids`` and ``labels`` (-100 = out of the loss). An optimizer step takes ``batch_size``
examples in a fixed per-epoch order (seeded permutation) and runs them ``micro_batch`` at a
time (padded on the right), each micro-batch's loss weighted by its share of the step's target
tokens, so the step's loss is the token mean over the step whatever the micro-batch size.

``OUT/checkpoint/`` holds the adapter, the optimizer, the step and torch's random state after
every ``save_every`` steps (written to a temporary directory and renamed, so a kill never
leaves half a checkpoint); ``resume=True`` continues from it with the same data order and
random state, so a resumed run ends on the same adapter as an uninterrupted one.
"""
from __future__ import annotations

import contextlib
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

import numpy as np

from ragfast.errors import ConfigError

__all__ = ["DEFAULT_TARGET_MODULES", "LoraRun", "batches", "target_token_loss", "lora_sft", "load_trainer_state"]

DEFAULT_TARGET_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")

#: A loss function: (peft model, input ids, attention mask, labels) -> scalar tensor.
LossFn = Callable[[Any, Any, Any, Any], Any]


@dataclass
class LoraRun:
    """What :func:`lora_sft` did.

    Attributes
    ----------
    model : peft model
        The trained model (LoRA not merged).
    steps, total : int
        Optimizer steps done in all runs together, and planned.
    finished : bool
        Every planned step of every epoch is done.
    losses : list of float
        Per-step loss of every run so far (restored on resume).
    epoch_loss : dict
        Epoch (as a string) -> its steps' losses.
    seconds : float
        Wall seconds of this run's steps.
    step_seconds : list of float
        Wall seconds of each step of this run.
    all_step_seconds : list of float
        Wall seconds of every step of every run so far (restored on resume).
    cpu_seconds : float
        CPU seconds (all threads) of this run's steps: on a shared machine the better guide
        to what an idle one would take.
    targets : list of str
        The LoRA target modules found in the model.
    """

    model: Any
    steps: int
    total: int
    finished: bool
    losses: list[float]
    epoch_loss: dict[str, list[float]]
    seconds: float
    step_seconds: list[float] = field(default_factory=list)
    targets: list[str] = field(default_factory=list)
    all_step_seconds: list[float] = field(default_factory=list)
    cpu_seconds: float = 0.0


def batches(n: int, batch_size: int, seed: int, epoch: int) -> list[np.ndarray]:
    """The example indices of each step of one epoch (a seeded permutation cut in batches)."""
    order = np.random.default_rng(seed * 1000 + epoch).permutation(n)
    return [order[i:i + batch_size] for i in range(0, n, batch_size)]


def target_token_loss(model: Any, ids: Any, att: Any, lab: Any) -> Any:
    """Mean next-token cross-entropy over the labelled positions.

    The LM head runs only where a label follows (a vocabulary of 49k makes the full head a
    large share of a step when most tokens are prompt or observation).
    """
    import torch.nn.functional as F

    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    h = base.get_decoder()(input_ids=ids, attention_mask=att).last_hidden_state
    nxt = lab[:, 1:]
    sel = nxt != -100
    logits = base.get_output_embeddings()(h[:, :-1][sel]).float()
    return F.cross_entropy(logits, nxt[sel])


def load_trainer_state(path: Path) -> dict:
    """A ``trainer_state.pt`` read with ``weights_only=True``: tensors and plain values only.

    A checkpoint directory may come from anyone; a full unpickle would run whatever code the
    file names. Anything but tensors, numbers, strings, lists and dicts is refused.

    Raises
    ------
    ConfigError
        The file is not a plain trainer state.
    """
    import pickle

    import torch

    try:
        st = torch.load(path, weights_only=True, map_location="cpu")
    except (pickle.UnpicklingError, RuntimeError, EOFError) as exc:
        raise ConfigError(f"{path}: not a plain trainer state (refused to unpickle anything but tensors and plain "
                          f"values: {' '.join(str(exc).split())[:160]})") from None
    if not isinstance(st, dict):
        raise ConfigError(f"{path}: not a trainer state (a {type(st).__name__})")
    return st


def lora_sft(model: Any, examples: Sequence[Mapping[str, Any]], out_dir: str | Path, *, pad_id: int,
             identity: Mapping[str, Any], loss_fn: LossFn = target_token_loss, epochs: int = 1, lr: float = 2e-4,
             r: int = 16, alpha: float = 32.0, dropout: float = 0.05, batch_size: int = 4,
             micro_batch: int | None = None, target_modules: Sequence[str] = DEFAULT_TARGET_MODULES,
             save_every: int = 50, resume: bool = False, max_steps: int | None = None, seed: int = 0,
             device: str = "cpu", bf16: bool = False, lr_floor: float = 0.05, top_layers: int | None = None,
             replay_budget_bytes: int = 4 << 30, on_step: Callable[[int, float, float], None] | None = None,
             log: Callable[[str], None] = print) -> LoraRun:
    """LoRA-fine-tune ``model`` on ``examples``; checkpoints in ``OUT/checkpoint``.

    Parameters
    ----------
    model : transformers causal LM
        Wrapped in peft LoRA here (set to train mode).
    examples : sequence of dict
        ``input_ids`` and ``labels`` lists of equal length.
    out_dir : str or Path
    pad_id : int
        Padding token of micro-batches (masked out of attention and loss).
    identity : mapping
        What the data is (counts, hashes); a checkpoint made on other data is refused on resume.
    loss_fn : callable
        ``loss_fn(model, ids, attention_mask, labels)``; default :func:`target_token_loss`.
    epochs, lr, r, alpha, dropout, batch_size, target_modules
        Optimisation and LoRA settings; the learning rate decays linearly to ``lr_floor * lr``.
    micro_batch : int, optional
        Examples per forward pass (default ``batch_size``).
    save_every : int
        Checkpoint period in optimizer steps.
    resume : bool
        Continue from ``OUT/checkpoint``.
    max_steps : int, optional
        Stop after this many steps in all (a checkpoint is written; resume continues).
    bf16 : bool
        Run forward and backward under bf16 autocast (oneDNN AMX on CPUs that have it); the
        LoRA weights and the optimizer stay fp32.
    top_layers : int, optional
        Adapt only the last ``top_layers`` decoder layers. Backward then stops at the lowest
        adapted layer (nothing below it needs a gradient), so a step costs about
        ``1 + 2 * top_layers / layers`` forward passes instead of 3. With two epochs or more
        (and a Llama, Qwen2 or Qwen3 decoder), the frozen layers run once per example before the
        first step (:mod:`ragfast.models.frozen_layers`) and every step starts at the lowest adapted
        layer: the same losses for a fraction of the time.
    replay_budget_bytes : int
        Memory the cached hidden states may take; past it the frozen layers run in every step.
    on_step : callable, optional
        Called as ``on_step(step, loss, seconds)`` after each step.

    Raises
    ------
    ConfigError
        Bad settings, ``OUT/checkpoint`` exists without ``resume``, no target module in the
        model, peft missing, or a checkpoint made on other data.
    """
    import torch

    try:
        from peft import LoraConfig, get_peft_model, set_peft_model_state_dict
        from peft.utils import get_peft_model_state_dict
    except ImportError as exc:
        raise ConfigError("LoRA fine-tuning needs peft: pip install 'ragfast[train]'") from exc
    from safetensors.torch import load_file, save_file

    from ragfast.models.frozen_layers import cache_frozen_inputs, replay_from, supports_replay

    if epochs < 1 or batch_size < 1 or r < 1 or save_every < 1:
        raise ConfigError("epochs, batch_size, r and save_every must be >= 1")
    mb = batch_size if micro_batch is None else int(micro_batch)
    if mb < 1:
        raise ConfigError(f"micro_batch must be >= 1, got {micro_batch}")
    if not examples:
        raise ConfigError("no examples to train on")
    out = Path(out_dir).expanduser()
    ckpt = out / "checkpoint"
    if not resume and ckpt.exists():
        raise ConfigError(f"{ckpt} exists: pass --resume to continue it, or choose another --out")
    torch.manual_seed(seed)
    present = {n.rsplit(".", 1)[-1] for n, _ in model.named_modules()}
    targets = [t for t in target_modules if t in present]
    if not targets:
        raise ConfigError(f"none of the LoRA target modules {list(target_modules)} is in the model")
    extra: dict[str, Any] = {}
    if top_layers is not None:
        n_layers = int(getattr(model.config, "num_hidden_layers", 0))
        if not 1 <= int(top_layers) <= n_layers:
            raise ConfigError(f"top_layers must be between 1 and the model's {n_layers} layers, got {top_layers}")
        extra["layers_to_transform"] = list(range(n_layers - int(top_layers), n_layers))
    model.train()
    model = get_peft_model(model, LoraConfig(r=r, lora_alpha=alpha, lora_dropout=dropout, target_modules=targets,
                                             task_type="CAUSAL_LM", **extra))
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.0)
    per_epoch = len(batches(len(examples), batch_size, seed, 0))
    planned = epochs * per_epoch
    total = planned if max_steps is None else min(planned, int(max_steps))
    step, losses, epoch_loss, earlier_seconds = 0, [], {}, []
    ident = {k: v for k, v in identity.items()}
    if resume and ckpt.exists():
        st = load_trainer_state(ckpt / "trainer_state.pt")
        if st.get("identity") != ident:
            raise ConfigError(f"{ckpt} was trained on other data or settings ({st.get('identity')}, now {ident})")
        set_peft_model_state_dict(model, load_file(str(ckpt / "adapter_model.safetensors")))
        opt.load_state_dict(st["optimizer"])
        step, losses, epoch_loss = int(st["step"]), list(st["losses"]), dict(st["epoch_loss"])
        earlier_seconds = [float(x) for x in st.get("step_seconds", [])]
        if "rng" in st:
            torch.set_rng_state(st["rng"])
        log(f"resumed at step {step}")

    def save_checkpoint() -> None:
        tmp = out / "checkpoint.tmp"
        if tmp.exists():
            shutil.rmtree(tmp)
        tmp.mkdir(parents=True)
        save_file({k: v.contiguous() for k, v in get_peft_model_state_dict(model).items()},
                  str(tmp / "adapter_model.safetensors"))
        torch.save({"optimizer": opt.state_dict(), "step": step, "losses": losses, "epoch_loss": epoch_loss,
                    "identity": ident, "rng": torch.get_rng_state(), "step_seconds": earlier_seconds + step_seconds},
                   tmp / "trainer_state.pt")
        if ckpt.exists():
            shutil.rmtree(ckpt)
        tmp.rename(ckpt)

    autocast = (lambda: torch.autocast(device_type=str(device).split(":")[0], dtype=torch.bfloat16)) if bf16 \
        else contextlib.nullcontext
    decoder = model.get_base_model().get_decoder()
    first = None if top_layers is None else int(model.config.num_hidden_layers) - int(top_layers)
    cached: list[Any] = []
    if first is not None and epochs >= 2 and step < total and supports_replay(model.get_base_model(), first):
        cached = cache_frozen_inputs(decoder, first, [e["input_ids"] for e in examples], budget_bytes=replay_budget_bytes,
                                     device=device, context=autocast, log=log)

    def pack(idx: Sequence[int]) -> tuple[Any, Any, Any]:
        W = max(len(examples[i]["input_ids"]) for i in idx)
        ids = torch.full((len(idx), W), pad_id, dtype=torch.long)
        lab = torch.full((len(idx), W), -100, dtype=torch.long)
        att = torch.zeros((len(idx), W), dtype=torch.long)
        for j, i in enumerate(idx):
            e = examples[i]
            n = len(e["input_ids"])
            ids[j, :n] = torch.tensor(e["input_ids"])
            lab[j, :n] = torch.tensor(e["labels"])
            att[j, :n] = 1
        return ids.to(device), att.to(device), lab.to(device)

    def packed_hidden(idx: Sequence[int], W: int) -> Any:
        h = cached[idx[0]].new_zeros((len(idx), W, cached[idx[0]].shape[-1]))
        for j, i in enumerate(idx):
            h[j, :cached[i].shape[0]] = cached[i]
        return h

    def n_targets(i: int) -> int:
        # Targets are labels that a position predicts (the first token predicts nothing).
        return sum(1 for x in examples[i]["labels"][1:] if x != -100)

    t0, c0 = time.perf_counter(), time.process_time()
    step_seconds: list[float] = []  # this run's (the checkpoint keeps every run's)
    done = step
    for ep in range(epochs):
        for bi, idx in enumerate(batches(len(examples), batch_size, seed, ep)):
            if ep * per_epoch + bi < done:
                continue  # already trained before the resume
            if step >= total:
                break
            ts = time.perf_counter()
            for g in opt.param_groups:
                g["lr"] = lr * max(lr_floor, 1.0 - step / max(1, planned))
            opt.zero_grad()
            counts = [n_targets(int(i)) for i in idx]
            whole = max(1, sum(counts))
            step_loss = 0.0
            for lo in range(0, len(idx), mb):
                sub = [int(i) for i in idx[lo:lo + mb]]
                w = sum(counts[lo:lo + mb]) / whole if mb < len(idx) else 1.0
                if w == 0.0:
                    continue
                ids, att, lab = pack(sub)
                # The swap lasts one pass only: checkpoints must see the model's own layer names.
                with replay_from(decoder, first) if cached else contextlib.nullcontext() as replayed:
                    if replayed is not None:
                        replayed.hidden = packed_hidden(sub, ids.shape[1])
                    with autocast():
                        loss = loss_fn(model, ids, att, lab)
                (loss.float() * w).backward()
                step_loss += float(loss.detach()) * w
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            opt.step()
            step += 1
            losses.append(step_loss)
            epoch_loss.setdefault(str(ep), []).append(step_loss)
            step_seconds.append(time.perf_counter() - ts)
            if on_step is not None:
                on_step(step, step_loss, step_seconds[-1])
            if step % save_every == 0:
                save_checkpoint()
        if step >= total:
            break
    save_checkpoint()
    return LoraRun(model=model, steps=step, total=planned, finished=step >= planned, losses=losses,
                   epoch_loss=epoch_loss, seconds=time.perf_counter() - t0, step_seconds=step_seconds,
                   targets=targets, all_step_seconds=earlier_seconds + step_seconds,
                   cpu_seconds=time.process_time() - c0)
