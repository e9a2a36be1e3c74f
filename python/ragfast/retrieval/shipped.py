"""Embeddings shipped with the package for the bundled passages, so a first run need not embed.

The bundled default corpus (the context paragraphs of the HotpotQA dev sample plus the wiki
sample, ~4k passages) costs minutes to embed with MiniLM on a small CPU. ragfast ships their
MiniLM vectors instead, in ``ragfast/samples/embeddings/``:

``<encoder>.npz``
    ``vectors`` (float16 ``[n, dim]``) and ``keys`` (uint64 ``[n]``: an 8-byte BLAKE2b digest
    of the exact text that was embedded, prefix included). Keys, not passage ids, so any corpus
    made of bundled passages (a subset of questions' contexts, another concatenation order)
    finds its vectors.
``<encoder>.json``
    The encoder's identity (preset settings and the SHA-256 of its weights, config and
    tokenizer), the npz file's SHA-256, its shape and how it was made.

Both the identity and the file hash are checked at load: vectors from another model, or a
damaged file, are never used (the caller embeds instead). The shipped vectors are fp16; their
cosine scores differ from fp32 ones by < 1e-3, which can swap near-tied neighbours only.

Regenerate after changing the bundled samples or the default encoder::

    python -m ragfast.retrieval.shipped
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
from pathlib import Path
from typing import Any, Sequence

import numpy as np

__all__ = ["shipped_dir", "encoder_identity", "text_keys", "lookup", "build"]

log = logging.getLogger(__name__)

_HASHES: dict[tuple[str, int, int], str] = {}


def shipped_dir() -> Path:
    """``ragfast/samples/embeddings``: where shipped vectors live."""
    return Path(__file__).resolve().parent.parent / "samples" / "embeddings"


def _file_sha256(path: Path) -> str:
    # The weights are ~90 MB: hash once per process (keyed by size and mtime).
    st = path.stat()
    key = (str(path), st.st_size, st.st_mtime_ns)
    if key not in _HASHES:
        h = hashlib.sha256()
        with open(path, "rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                h.update(block)
        _HASHES[key] = h.hexdigest()
    return _HASHES[key]


def encoder_identity(encoder: Any) -> dict[str, Any]:
    """What determines an encoder's vectors, by content (not by path or file time).

    Parameters
    ----------
    encoder : ragfast.retrieval.Encoder

    Returns
    -------
    dict
        Preset settings (prefixes, pooling, normalisation, max length) and the SHA-256 of every
        weight, config and tokenizer file present in the checkpoint directory.
    """
    p = encoder.preset
    files = {}
    for name in ("config.json", "model.safetensors", "pytorch_model.bin", "tokenizer.json", "vocab.txt",
                 "tokenizer_config.json"):
        f = Path(encoder.path) / name
        if f.exists():
            files[name] = _file_sha256(f)
    return {"preset": p.name, "query_prefix": p.query_prefix, "passage_prefix": p.passage_prefix,
            "pooling": p.pooling, "normalize": p.normalize, "max_length": int(encoder.max_length), "files": files}


def text_keys(texts: Sequence[str]) -> np.ndarray:
    """uint64 BLAKE2b digest of each text (the lookup key of a shipped vector)."""
    out = np.empty(len(texts), dtype=np.uint64)
    for i, t in enumerate(texts):
        out[i] = int.from_bytes(hashlib.blake2b(t.encode("utf-8"), digest_size=8).digest(), "little")
    return out


def _paths(name: str, root: Path | None) -> tuple[Path, Path]:
    d = root or shipped_dir()
    return d / f"{name}.npz", d / f"{name}.json"


def lookup(encoder: Any, passages: Sequence[str], *, root: Path | None = None) -> np.ndarray | None:
    """Shipped float32 vectors of ``passages`` under ``encoder``, or None when they cannot be used.

    None when no file ships for this encoder, its identity differs (another checkpoint or
    preset), the file's hash does not match its manifest, or any passage is not in it. The
    reason is logged at debug level (warning for a damaged file).

    Parameters
    ----------
    encoder : ragfast.retrieval.Encoder
    passages : sequence of str
        Passage texts, without the preset's passage prefix (it is added here).
    root : Path, optional
        Directory of the shipped files (default :func:`shipped_dir`).
    """
    npz, manifest = _paths(encoder.preset.name, root)
    if not (npz.exists() and manifest.exists()):
        return None
    meta = json.loads(manifest.read_text(encoding="utf-8"))
    if meta.get("identity") != encoder_identity(encoder):
        log.debug("shipped embeddings %s were made by another encoder; embedding instead", npz.name)
        return None
    if _file_sha256(npz) != meta.get("sha256"):
        log.warning("shipped embeddings %s do not match their recorded hash (damaged?); embedding instead", npz)
        return None
    with np.load(npz) as z:
        keys, vectors = z["keys"], z["vectors"]
    pos = {int(k): i for i, k in enumerate(keys)}
    want = text_keys([encoder.preset.passage_prefix + t for t in passages])
    rows = [pos.get(int(k), -1) for k in want]
    missing = sum(r < 0 for r in rows)
    if missing:
        log.debug("%d of %d passages have no shipped vector; embedding instead", missing, len(rows))
        return None
    return np.ascontiguousarray(vectors[np.asarray(rows, dtype=np.int64)], dtype=np.float32)


def build(encoder: Any, passages: Sequence[str], *, root: Path | None = None, note: str = "") -> Path:
    """Embed ``passages`` and write the shipped npz + manifest for ``encoder``'s preset.

    Returns
    -------
    Path
        The npz file written.
    """
    texts = list(dict.fromkeys(passages))  # unique, first-seen order
    vecs = encoder.encode_passages(texts).numpy().astype(np.float16)
    keys = text_keys([encoder.preset.passage_prefix + t for t in texts])
    npz, manifest = _paths(encoder.preset.name, root)
    npz.parent.mkdir(parents=True, exist_ok=True)
    tmp = npz.with_suffix(f".{os.getpid()}.tmp.npz")
    np.savez(tmp, keys=keys, vectors=vecs)
    os.replace(tmp, npz)
    _HASHES.clear()
    meta = {"identity": encoder_identity(encoder), "sha256": _file_sha256(npz), "n": len(texts),
            "dim": int(vecs.shape[1]), "dtype": "float16", "made_with": "python -m ragfast.retrieval.shipped",
            "note": note}
    manifest.write_text(json.dumps(meta, indent=1) + "\n", encoding="utf-8")
    return npz


def main() -> None:
    """Rebuild the shipped MiniLM vectors of the bundled passages (HotpotQA dev contexts + wiki sample)."""
    from ragfast.data import corpus_from_contexts, load_corpus
    from ragfast.encoders.encoder import Encoder

    passages: list[str] = []
    for corpus in (corpus_from_contexts("hotpotqa-dev"), load_corpus("wiki-sample")):
        passages += list(corpus.contents(range(len(corpus))))
    path = build(Encoder("minilm"), passages, note="HotpotQA dev sample contexts + wiki sample")
    print(f"wrote {path} ({path.stat().st_size / 1e6:.1f} MB)")


if __name__ == "__main__":
    main()
