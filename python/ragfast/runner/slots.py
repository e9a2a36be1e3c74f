"""The one factory: a slot spec (a plain string, or a mapping with a ``spec`` key) to a component.

Every command, the bench and the Ray actors build their reasoner, corpus, encoder, retriever,
judge, NLI model, checker LLM and RELOOP head here, so a spec means the same thing everywhere
and the defaults are the same everywhere (:data:`DEFAULTS`).

Specs
-----
reasoner
    ``scripted`` (the evidence oracle), ``tiny`` (random-weight Qwen2), a catalogue model
    (``smollm2``: ``ragfast models list``; so in every LLM slot below), a trained Search-R1
    reasoner (``smollm2-searchr1``: the catalogue base with the bundled LoRA adapter merged,
    :mod:`ragfast.models.searchr1_reasoner`), a local model directory,
    or an OpenAI-compatible URL (``URL#served-name``, or ``served_model=``; default: the one
    model the server lists). A URL reasoner keeps the prompt budget (``max_context``) as the
    local backend does, and its slot entry (written again after the run) says which token
    source and how many calls it used.
corpus
    A list of parts: ``contexts`` (the questions' own paragraphs), a sample name or a jsonl path.
retriever
    ``default`` / ``flat`` (the encoder over the corpus, flat kernel, embeddings cached on
    disk), ``bm25``, ``faiss:<factory>``, an index path, or a ``/retrieve`` URL.
judge
    ``encoder`` (bundled doc-set judge), ``head`` (bundled frozen-feature head), ``tiny``,
    ``heuristic`` (RELOOP's rule), ``none``, a URL of ``ragfast serve-judge`` or a local path.
nli
    ``tiny`` (random-weight DeBERTa-v2), ``none``, a local cross-encoder directory, or a
    catalogue / causal-LM directory as an LLM-prompted scorer (``smollm2``).
checker
    ``reasoner`` (reuse the reasoner when it is a language model), ``tiny``, ``none`` or a directory.
head
    ``extractive`` (RELOOP's span picker, not an LLM) or a local model directory.
"""
from __future__ import annotations

import importlib.util
import logging
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

from ragfast.errors import ConfigError
from ragfast.infra.http import is_url
from ragfast.models.drafts import DRAFT_TOKENS
from ragfast.models.hub import local_model

log = logging.getLogger(__name__)

__all__ = ["DEFAULTS", "DEFAULT_CORPUS", "split_spec", "reasoner", "corpus", "encoder", "retriever",
           "judge", "nli", "checker", "head", "on_backend", "absolute", "retriever_over", "RETRIEVERS"]

#: The corpus every command searches by default: the questions' own paragraphs plus the bundled
#: wiki sample. One default means the second command reuses the first one's cached embeddings.
DEFAULT_CORPUS: tuple[str, ...] = ("contexts", "wiki-sample")

#: Defaults shared by every command that runs methods.
DEFAULTS: dict[str, Any] = {"batch_size": 64, "corpus": list(DEFAULT_CORPUS),
                            "retriever": "default", "judge": "encoder", "nli": "tiny", "nli_backend": "auto",
                            "encoder": "minilm"}


def split_spec(spec: str | Mapping[str, Any]) -> tuple[str, dict[str, Any]]:
    """``spec`` as (name, options): a string has no options; a mapping holds ``spec`` plus options."""
    if isinstance(spec, Mapping):
        if "spec" not in spec:
            raise ConfigError(f"a slot mapping needs a 'spec' key, got {sorted(spec)}")
        rest = {k: v for k, v in spec.items() if k != "spec"}
        return str(spec["spec"]), rest
    if not isinstance(spec, str) or not spec:
        raise ConfigError(f"a slot spec must be a non-empty string or a mapping, got {spec!r}")
    return spec, {}


def absolute(spec: str | None) -> str | None:
    """``spec`` made absolute when it names an existing local path (Ray actors may run elsewhere)."""
    if spec is None or is_url(spec):
        return spec
    p = Path(spec)
    return str(p.resolve()) if p.exists() else spec


def on_backend(make: Callable[[str], Any], choice: str, device: str, what: str) -> Any:
    """``make(backend)`` on the chosen backend; ``auto`` = ONNX Runtime on the CPU, torch if that fails."""
    if choice not in ("auto", "torch", "onnx"):
        raise ConfigError(f"the {what} backend must be auto, torch or onnx, got {choice!r}")
    if choice != "auto":
        return make(choice)
    if device == "cpu" and importlib.util.find_spec("onnxruntime") is not None:
        try:
            return make("onnx")
        except Exception as exc:  # an exporter/runtime mismatch must not stop the run: torch works
            log.warning("ONNX Runtime %s unavailable (%s); using torch", what, exc)
    return make("torch")


def reasoner(spec: str | Mapping[str, Any], *, seed: int = 0, device: str = "cpu", dtype: str | None = None,
             weights: str = "native",
             batch_size: int = 64, max_context: int | None = None, max_turns: int = 4,
             served_model: str | None = None, tokenizer: str | None = None, model_config: str | None = None,
             api_key: str | None = None, concurrency: int = 16, check: bool = True,
             memory_budget: str | int | None = "auto", draft_tokens: int = DRAFT_TOKENS) -> Any:
    """The reasoner: ``scripted``, ``tiny``, a local model directory or an OpenAI-compatible URL.

    Parameters
    ----------
    spec : str or mapping
        See the module docstring; a mapping's other keys override the keyword arguments.
    max_turns : int
        The scripted oracle's search budget.
    served_model, tokenizer, model_config : str, optional
        For a URL: the served model's name, a local tokenizer (chat template, token-exact
        truncation and prompt budget) and a local config (analytic FLOPs).
    max_context : int, optional
        The prompt budget in tokens, for a local model and a URL alike.
    check : bool
        Check a URL is reachable first (one clear error instead of a failure mid-run).
    memory_budget : str, int or None
        A local model's memory budget beyond its weights (:class:`~ragfast.models.generator.HFGenerator`).
    draft_tokens : int
        A local model's prompt-lookup drafts (:class:`~ragfast.models.generator.HFGenerator`; 0: none).
    weights : str
        A local model's linear layers: ``"native"``, ``"int8"`` (weight-only), ``"w8a8"`` or ``"auto"``
        (:func:`ragfast.models.weight_quant.auto_weights`).

    Raises
    ------
    ConfigError
        When ``spec`` is none of these.
    """
    name, opts = split_spec(spec)
    kw = dict(seed=seed, device=device, dtype=dtype, weights=weights, batch_size=batch_size,
              max_context=max_context, max_turns=max_turns, served_model=served_model, tokenizer=tokenizer,
              model_config=model_config, api_key=api_key, concurrency=concurrency, memory_budget=memory_budget,
              draft_tokens=draft_tokens)
    kw.update(opts)
    from ragfast.models.generator import HFGenerator
    from ragfast.models.scripted import ScriptedGenerator
    from ragfast.models.openai_generator import OpenAIGenerator

    if name == "scripted":
        return ScriptedGenerator(seed=kw["seed"], max_searches=kw["max_turns"])
    hf = dict(device=kw["device"], dtype=kw["dtype"], weights=kw["weights"], max_batch=kw["batch_size"],
              max_context=kw["max_context"], memory_budget=kw["memory_budget"], draft_tokens=kw["draft_tokens"])
    if name == "tiny":
        from ragfast.models.tiny import tiny_path

        return HFGenerator(tiny_path("qwen2"), **hf)
    if is_url(name):
        base, _, served = name.partition("#")
        if check:
            from ragfast.retrieval.remote import check_reachable

            check_reachable(base, "reasoner server")
        return OpenAIGenerator(base, kw["served_model"] or served or None, api_key=kw["api_key"],
                               concurrency=kw["concurrency"], tokenizer=kw["tokenizer"],
                               model_config=kw["model_config"], seed=kw["seed"], max_context=kw["max_context"])
    from ragfast.models.searchr1_reasoner import ADAPTERS, SearchR1Reasoner, is_adapter

    if is_adapter(name) or (Path(name) / "adapter_config.json").is_file():
        return SearchR1Reasoner(name, **hf)
    name = local_model(name, "reasoner")
    if Path(name).is_dir():
        return HFGenerator(name, **hf)
    raise ConfigError(f"reasoner {name!r} is not 'scripted', 'tiny', a catalogue model (ragfast models list), a "
                      f"Hugging Face id (owner/name), a trained reasoner ({', '.join(ADAPTERS)}, or a "
                      "train-reasoner OUT/adapter directory), an http(s) URL or a local model directory")


def corpus(parts: str | Sequence[str] | None, questions: Sequence[Any]) -> Any:
    """The corpus from its parts (default :data:`DEFAULT_CORPUS`); ``contexts`` = the questions' paragraphs.

    Build it from every question of the data file, not a ``--limit`` slice, so document ids and
    distractors do not depend on the slice (and the embedding cache is shared across slices).
    """
    from ragfast.data import Corpus, corpus_from_contexts, load_corpus

    names = list(DEFAULT_CORPUS) if parts is None else [parts] if isinstance(parts, str) else list(parts)
    if not names:
        raise ConfigError("the corpus needs at least one part (contexts, a sample name or a jsonl path)")
    built = [corpus_from_contexts(questions) if c == "contexts" else load_corpus(c) for c in names]
    return built[0] if len(built) == 1 else Corpus.concat(built)


def encoder(spec: str = "minilm", *, backend: str = "auto", device: str = "cpu") -> Any:
    """The retrieval encoder (``minilm``, ``hashing`` or a checkpoint path) on ``backend``.

    ``auto`` uses ONNX Runtime on the CPU when it is installed (exported once, cached) and falls
    back to torch, with a warning in the log, if the export fails.
    """
    if spec == "hashing":
        from ragfast.encoders.hashing import HashingEncoder

        return HashingEncoder()
    from ragfast.retrieval import Encoder

    return on_backend(lambda b: Encoder(spec, device=device, backend=b), backend, device, "encoder")


def _flat(corpus: Any, *, make_encoder: Callable[[], Any], device: str, progress: bool) -> Any:
    from ragfast.retrieval import build_default_retriever

    return build_default_retriever(corpus, encoder=make_encoder(), device=device, progress=progress)


def _bm25(corpus: Any, *, make_encoder: Callable[[], Any], device: str, progress: bool) -> Any:
    from ragfast.retrieval.server import load_retriever

    return load_retriever(corpus, None, "bm25", device=device, progress=progress)


#: The retriever backends a spec names (not a file, not a URL): name -> builder
#: ``(corpus, make_encoder=, device=, progress=)``, ``make_encoder()`` giving the run's (shared)
#: encoder. A new backend is its module in ``retrieval/`` plus one entry here (CONTRIBUTING.md);
#: ``check_paths`` and the error below read the names from this table.
RETRIEVERS: dict[str, Callable[..., Any]] = {"default": _flat, "flat": _flat, "bm25": _bm25}


def retriever(spec: str | Mapping[str, Any], corpus: Any = None, *, shared_encoder: Any = None,
              encoder_spec: str = "minilm", encoder_backend: str = "auto", device: str = "cpu",
              progress: bool = True, check: bool = True) -> Any:
    """The retriever: a name of :data:`RETRIEVERS` (``default``/``flat``, ``bm25``), ``faiss:<factory>``, an
    index path or a URL.

    Parameters
    ----------
    corpus : Corpus
        The passages (not needed for a URL).
    shared_encoder : optional
        An already built encoder to share (the judge may use the same one); else one is built
        from ``encoder_spec`` on ``encoder_backend``.

    Raises
    ------
    ConfigError
        When ``spec`` names nothing that exists.
    """
    name, opts = split_spec(spec)
    if is_url(name):
        from ragfast.retrieval import RemoteRetriever

        if check:
            from ragfast.retrieval.remote import check_reachable

            check_reachable(name, "retriever server")
        return RemoteRetriever(name, **opts)
    if corpus is None:
        raise ConfigError(f"retriever {name!r} needs a corpus")
    from ragfast.retrieval import DenseIndex, DenseRetriever, build_default_retriever

    def enc() -> Any:
        return shared_encoder if shared_encoder is not None else encoder(encoder_spec, backend=encoder_backend,
                                                                                device=device)

    if name in RETRIEVERS:
        return RETRIEVERS[name](corpus, make_encoder=enc, device=device, progress=progress)
    if name.startswith("faiss:") and not Path(name[6:]).exists():
        base = build_default_retriever(corpus, encoder=enc(), device=device, progress=progress)
        import numpy as np

        index = DenseIndex.build(np.asarray(base.index.vectors), backend="faiss", factory=name[6:])
        return DenseRetriever(base.encoder, index, corpus)
    p = Path(name.removeprefix("faiss:"))
    if p.exists():
        from ragfast.retrieval.server import load_retriever

        if p.is_dir():
            return load_retriever(corpus, p, device=device, progress=progress)
        return DenseRetriever(enc(), DenseIndex.load(p), corpus)
    raise ConfigError(f"retriever {name!r} is not {', '.join(repr(n) for n in RETRIEVERS)}, 'faiss:<factory>', an "
                      "existing index path or an http(s) URL")


def retriever_over(spec: str | Mapping[str, Any], questions: Sequence[Any], *, corpus_parts: Any = None,
                   encoder_spec: str = "minilm", encoder_backend: str = "auto", device: str = "cpu",
                   progress: bool = True, check: bool = True) -> Any:
    """:func:`retriever` over :func:`corpus` of ``questions``: one picklable call, for Ray actors too."""
    corp = None if is_url(split_spec(spec)[0]) else corpus(corpus_parts, questions)
    return retriever(spec, corp, encoder_spec=encoder_spec, encoder_backend=encoder_backend, device=device,
                     progress=progress, check=check)


def judge(spec: str | Mapping[str, Any], *, device: str = "cpu", shared_encoder: Any = None,
          encoder_device: str | None = None, kind: str = "text", check: bool = True) -> Any:
    """The STOP / sufficiency judge; ``None`` for ``none``, RELOOP's rule for ``heuristic``, else
    :func:`ragfast.judges.load` (the one factory from a judge spec to a judge).

    Parameters
    ----------
    shared_encoder : optional
        The retrieval encoder. A bundled encoder judge whose own encoder is the same model on
        the same device shares it (the model is loaded once, on its faster backend).
    kind : {"text", "tatqa", "kg"}
        What the judge reads: ``auto`` (RELOOP) picks the trained doc-set judge on text and the
        heuristic rule on tables, where no trained judge exists.
    """
    name, _ = split_spec(spec)
    if name == "none":
        return None
    if name == "auto":
        name = "encoder" if kind == "text" else "heuristic"
    if name == "heuristic":
        from ragfast.methods.reloop.sufficiency import HeuristicSufficiency

        return HeuristicSufficiency(multi_doc=(kind == "text"))
    from ragfast.judges import load

    return load(name, device=device, shared_encoder=shared_encoder, encoder_device=encoder_device, check=check)


def nli(spec: str | Mapping[str, Any], *, backend: str = "auto", device: str = "cpu", max_length: int = 512,
        token_budget: int = 8192) -> Any:
    """The NLI scorer on ``backend``; ``None`` for ``none``.

    ``tiny`` (random-weight DeBERTa-v2) or a local cross-encoder directory: :class:`NLIScorer`.
    A catalogue model (``smollm2``) or a local causal-LM directory: the LLM-prompted
    :class:`~ragfast.models.llm_nli.LLMNLIScorer` (torch only, labelled as such).
    """
    name, _ = split_spec(spec)
    if name == "none":
        return None
    from ragfast.models.llm_nli import LLMNLIScorer, is_causal_lm_dir
    from ragfast.models.nli import NLIScorer

    if name == "tiny":
        from ragfast.models.tiny import tiny_path

        name = str(tiny_path("deberta-v2"))
    name = local_model(name, "nli")
    if not Path(name).is_dir():
        raise ConfigError(f"nli {name!r} is not 'tiny', 'none', a catalogue model, a Hugging Face id or a local model "
                          "directory")
    if is_causal_lm_dir(name):
        return LLMNLIScorer(name, device=device, max_length=max_length, token_budget=token_budget)
    return on_backend(lambda b: NLIScorer(name, backend=b, device=device, max_length=max_length,
                                          token_budget=token_budget), backend, device, "NLI model")


def checker(spec: str | Mapping[str, Any], reasoner: Any = None, *, device: str = "cpu") -> Any:
    """The LLM of StepGap's stages A-C: ``reasoner``, ``tiny``, ``none`` or a local directory.

    ``reasoner`` reuses the reasoner when it is a language model; the scripted evidence oracle
    cannot answer JSON prompts, so with it the LLM stages are skipped (``None``).
    """
    name, _ = split_spec(spec)
    if name == "none":
        return None
    from ragfast.models.generator import HFGenerator
    from ragfast.models.scripted import ScriptedGenerator

    if name == "reasoner":
        return None if reasoner is None or isinstance(reasoner, ScriptedGenerator) else reasoner
    if name == "tiny":
        from ragfast.models.tiny import tiny_path

        return HFGenerator(tiny_path("qwen2"), device=device)
    name = local_model(name, "checker LLM")
    if Path(name).is_dir():
        return HFGenerator(name, device=device)
    raise ConfigError(f"checker LLM {name!r} is not 'none', 'reasoner', 'tiny', a catalogue model, a Hugging Face id or "
                      "a local model directory")


def head(spec: Any = None, *, device: str = "cpu") -> Any:
    """RELOOP's answer head: ``extractive`` (default; a span picker, not an LLM) or a local LM directory.

    A generator instance is returned as it is (the bench passes its reasoner).
    """
    if spec is not None and not isinstance(spec, (str, Mapping)):
        return spec
    name = "extractive" if spec in (None, "") else split_spec(spec)[0]
    if name == "extractive":
        from ragfast.models.extractive import ExtractiveHead

        return ExtractiveHead()
    if Path(name).is_dir() or name == "tiny" or local_model(name, "head") != name:
        return reasoner(name, device=device)
    raise ConfigError(f"head {name!r} is not 'extractive', a catalogue model, a Hugging Face id or a local model "
                      "directory")
