"""Trained Search-R1 reasoners: a catalogue base plus a bundled LoRA adapter, merged in memory.

``--reasoner smollm2-searchr1`` is SmolLM2-135M-Instruct (``ragfast models get smollm2``) with
the adapter ``ragfast train-reasoner`` trained (``ragfast/adapters/smollm2_searchr1``; its card
``ragfast_reasoner.json`` says on what data, how long, on which machine, and what it scored).
The adapter is merged into the weights at load time (peft ``merge_and_unload``), so generation
costs exactly what the base model costs. :func:`merge_reasoner` writes the merged weights as a
plain Hugging Face directory, which an OpenAI-compatible server (vLLM, ``--reasoner URL``) can
serve.

The answer-only turn. A model trained on Search-R1 trajectories searches first; when the loop
tells it that its next generation is the final one (``mark_final``: the search budget is spent,
``--budget 0`` closed-book, S2G's stop and its answer-only probe), :class:`SearchR1Reasoner`
opens that generation with ``<answer>``, so the model answers from what it has read instead of
writing a search the loop will not run. The forced text is part of the returned turn.
"""
from __future__ import annotations

import json
from importlib import resources
from pathlib import Path
from typing import Any, Sequence

from ragfast.errors import ConfigError, ModelError
from ragfast.models.generator import HFGenerator

__all__ = ["ADAPTERS", "ANSWER_PREFIX", "SearchR1Reasoner", "adapter_dir", "is_adapter", "merge_reasoner",
           "load_merged"]

#: Bundled adapters: slot name -> (catalogue base, adapter directory inside the package).
ADAPTERS: dict[str, tuple[str, str]] = {
    "qwen2.5-coder-0.5b-searchr1": ("qwen2.5-coder-0.5b", "adapters/qwen2_5_coder_0_5b_searchr1"),
    "qwen2.5-coder-1.5b-searchr1": ("qwen2.5-coder-1.5b", "adapters/qwen2_5_coder_1_5b_searchr1"),
    "smollm2-searchr1": ("smollm2", "adapters/smollm2_searchr1"),
}

#: What opens a forced answer-only generation.
ANSWER_PREFIX = "<answer>"


def is_adapter(name: str) -> bool:
    """Whether ``name`` is a bundled reasoner adapter (a key of :data:`ADAPTERS`)."""
    return name in ADAPTERS


def adapter_dir(name: str) -> Path:
    """The bundled adapter directory of ``name``.

    Raises
    ------
    ModelError
        When the adapter is not in the installation.
    """
    if name not in ADAPTERS:
        raise ConfigError(f"unknown reasoner adapter {name!r}; bundled: {', '.join(ADAPTERS)}")
    p = Path(str(resources.files("ragfast") / ADAPTERS[name][1]))
    if not (p / "adapter_model.safetensors").is_file():
        raise ModelError(f"the bundled adapter {name!r} is missing from the installation: {p}")
    return p


def load_merged(base_dir: str | Path, adapter: str | Path, dtype: Any = None) -> tuple[Any, Any]:
    """(model, tokenizer): ``base_dir`` with the LoRA ``adapter`` merged in."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    try:
        from peft import PeftModel
    except ImportError as exc:
        raise ConfigError("a reasoner adapter needs peft: pip install 'ragfast[train]'") from exc
    kw = {"dtype": dtype} if dtype is not None else {"dtype": torch.float32}
    model = AutoModelForCausalLM.from_pretrained(str(base_dir), local_files_only=True, **kw)
    model = PeftModel.from_pretrained(model, str(adapter)).merge_and_unload()
    return model.eval(), AutoTokenizer.from_pretrained(str(base_dir), local_files_only=True)


class SearchR1Reasoner(HFGenerator):
    """:class:`HFGenerator` over a catalogue base with a LoRA adapter merged in, and a forced answer turn.

    Parameters
    ----------
    name : str
        A bundled adapter (:data:`ADAPTERS`) or a directory holding ``adapter_model.safetensors``
        and ``adapter_config.json`` (``ragfast train-reasoner``'s ``OUT/adapter``; its card
        ``ragfast_reasoner.json`` names the base, else ``base`` is required).
    base : str, optional
        The base model: a catalogue name or a local directory (default: the adapter's).
    **kwargs
        :class:`HFGenerator` options (``device``, ``dtype``, ``max_batch``, ``max_context``,
        ``weights``: int8 weights are made after the adapter is merged).
    """

    def __init__(self, name: str, base: str | None = None, **kwargs: Any):
        from ragfast.models.hub import local_model

        if is_adapter(name):
            adir, base = adapter_dir(name), base or ADAPTERS[name][0]
        else:
            adir = Path(name)
            if not (adir / "adapter_config.json").is_file():
                raise ConfigError(f"{name!r} is neither a bundled reasoner adapter ({', '.join(ADAPTERS)}) nor an "
                                  "adapter directory")
        card_file = adir / "ragfast_reasoner.json"
        card = json.loads(card_file.read_text(encoding="utf-8")) if card_file.is_file() else {}
        if base is None:  # a train-reasoner output names its base in its card
            base = card.get("base")
            if base is None:
                raise ConfigError(f"the adapter {adir} needs its base model (its card ragfast_reasoner.json names none)")
        # A bundled adapter's catalogue base is fetched on first use (the default bench needs no
        # separate `models get`); a user's own adapter names a base they already have.
        base_dir = Path(local_model(base, "reasoner base", fetch=is_adapter(name)))
        weights = kwargs.pop("weights", "native")
        super().__init__(base_dir, **kwargs)
        try:
            from peft import PeftModel
        except ImportError as exc:
            raise ConfigError("a reasoner adapter needs peft: pip install 'ragfast[train]'") from exc
        self.model = PeftModel.from_pretrained(self.model, str(adir)).merge_and_unload().eval()
        self.weight_info = None
        self.set_weights(weights)  # on the merged weights
        self.adapter = adir
        self.base_name = str(base)
        self.name = name
        self.card = card
        #: The observation cap the adapter was trained with (its card's data.max_obs_tokens).
        #: Its training observations were cut there, closing tag included, so under a longer cap
        #: it never saw what follows; measured on dev 100-139 under the protocol's 500 it wrote
        #: runaway turns after the first search. None: the loop's cap alone.
        cap = self.card.get("data", {}).get("max_obs_tokens")
        self.max_obs_tokens: int | None = int(cap) if cap else None
        self._final: set[str] = set()
        self._answering: set[str] = set()  # final turns begun, their text not yet returned

    def describe(self) -> dict[str, Any]:
        d = super().describe()
        d.update({"name": self.name, "base": self.base_name, "adapter": str(self.adapter),
                  "answer_turn": f"a final (answer-only) generation opens with {ANSWER_PREFIX!r}",
                  "observation_cap": (f"observations cut at min(the loop's cap, {self.max_obs_tokens}) tokens, the "
                                      "adapter's training cap" if self.max_obs_tokens else "the loop's cap")})
        ev = self.card.get("evaluation")
        if ev:
            d["card_evaluation"] = ev
        return d

    def truncate_tokens(self, texts: Sequence[str], max_tokens: int) -> list[str]:
        """:meth:`HFGenerator.truncate_tokens` at the smaller of ``max_tokens`` and the training cap."""
        cap = max_tokens if self.max_obs_tokens is None else min(max_tokens, self.max_obs_tokens)
        return super().truncate_tokens(texts, cap)

    def mark_final(self, ids: Sequence[str]) -> None:
        """The next generation of these sessions is the answer-only one: it opens with ``<answer>``."""
        from ragfast.models.base import check_sessions

        check_sessions(self._sessions, ids, "SearchR1Reasoner.mark_final")
        self._final.update(ids)

    def end(self, ids: Sequence[str]) -> None:
        self._final.difference_update(ids)
        self._answering.difference_update(ids)
        super().end(ids)

    def generate(self, ids: Sequence[str], **kw: Any) -> list[str | None]:
        forced = [i for i in ids if i in self._final]
        if forced:
            super().append(forced, [ANSWER_PREFIX] * len(forced))
            self._final.difference_update(forced)
            self._answering.update(forced)  # until their text comes back (a partial call may not return it)
        texts = super().generate(ids, **kw)
        out = []
        for i, t in zip(ids, texts):
            if t is not None and i in self._answering:
                self._answering.discard(i)
                t = ANSWER_PREFIX + t
            out.append(t)
        return out


def merge_reasoner(name: str, out_dir: str | Path, *, base: str | None = None) -> Path:
    """Write ``name`` (base + adapter, merged) as a plain Hugging Face directory at ``out_dir``.

    The directory holds config, fp32 safetensors, the tokenizer with its chat template and the
    adapter's card; any OpenAI-compatible server that loads Hugging Face directories serves it.
    A server has no ``mark_final``: the answer-only turn is the plain one, as in the reference.
    """
    from ragfast.models.hub import local_model

    if is_adapter(name):
        adir, base = adapter_dir(name), base or ADAPTERS[name][0]
    else:
        adir = Path(name)
        if base is None:
            raise ConfigError(f"the adapter {adir} needs its base model")
    base_dir = Path(local_model(base, "reasoner base"))
    out = Path(out_dir).expanduser()
    if out.exists() and any(out.iterdir()):
        raise ConfigError(f"{out} exists and is not empty")
    model, tok = load_merged(base_dir, adir)
    model.save_pretrained(str(out))
    tok.save_pretrained(str(out))
    card = adir / "ragfast_reasoner.json"
    if card.is_file():
        (out / "ragfast_reasoner.json").write_text(card.read_text())
    if not (out / "config.json").is_file():
        raise ModelError(f"the merged model was not written to {out}")
    return out
