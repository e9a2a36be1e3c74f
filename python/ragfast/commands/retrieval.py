"""``ragfast serve-retriever`` and ``ragfast index build``."""
from __future__ import annotations

import json
import shutil
import time
from pathlib import Path
from typing import Optional

import typer

from ragfast.commands import serve_flags
from ragfast.infra.devices import DEVICE_HELP, device_option


def register(app: typer.Typer) -> None:
    @app.command("serve-retriever")
    def serve_retriever(
        corpus: str = typer.Option(..., "--corpus", help="Corpus jsonl/parquet ({id, contents} rows) or a sample "
                                                         "name (wiki-sample)."),
        index: Optional[str] = typer.Option(None, "--index", help="Index from `ragfast index build`, a faiss file "
                                                                  "(e.g. Search-R1's e5_Flat.index) or a .npy matrix. "
                                                                  "Without it the corpus is embedded at start-up."),
        encoder: Optional[str] = typer.Option(None, "--encoder", help="Encoder preset (minilm, e5, bge), checkpoint "
                                                                      "path, or 'bm25'. Default: the index's, else minilm."),
        topk: int = typer.Option(3, "--topk", help="Default top-k when a request's topk is null."),
        host: str = typer.Option("127.0.0.1", "--host", help="Bind address (loopback by default)."),
        port: int = typer.Option(8000, "--port", help="TCP port to listen on."),
        workers: int = typer.Option(1, "--workers", help="uvicorn worker processes sharing the memory-mapped index."),
        storage: Optional[str] = typer.Option(None, "--storage", help="Flat storage: fp32, fp16, bf16, int8."),
        device: str = typer.Option("auto", "--device", callback=device_option, help=DEVICE_HELP),
        max_queries: int = typer.Option(1024, "--max-queries", help="Most queries per request."),
        max_query_chars: int = typer.Option(4096, "--max-query-chars", help="Longest query accepted."),
        max_topk: int = typer.Option(100, "--max-topk", help="Largest topk accepted."),
        max_body_bytes: int = typer.Option(16 * 1024 * 1024, "--max-body-bytes",
                                           help="Largest request body, refused (413) before it is parsed."),
        max_batch: int = typer.Option(256, "--max-batch", help="Most queries gathered into one retriever call."),
        chunk: int = typer.Option(8, "--chunk", help="While small requests are about, the most queries one "
                                                     "request puts in a batch (big requests are interleaved "
                                                     "with small ones)."),
        max_wait_ms: float = typer.Option(2.0, "--max-wait-ms", help="How long a request waits for batch company."),
        no_batching: bool = typer.Option(False, "--no-batching", help="Serve one request at a time."),
        threads: Optional[int] = typer.Option(None, "--threads", help="torch threads per worker (default: torch's; "
                                                                      "keep workers x threads <= cores)."),
        graceful_s: float = serve_flags.GRACEFUL_S,
        api_key: Optional[str] = serve_flags.API_KEY,
        head_timeout_s: float = serve_flags.HEAD_TIMEOUT_S,
        keep_alive_s: float = serve_flags.KEEP_ALIVE_S,
        max_connections: int = serve_flags.MAX_CONNECTIONS,
    ) -> None:
        """Serve Search-R1's POST /retrieve (and GET /health) over a corpus, micro-batching requests."""
        from ragfast.retrieval.server import serve

        serve(corpus, index, encoder, topk=topk, host=host, port=port, workers=workers, storage=storage,
              device=device, threads=threads, graceful_s=graceful_s, api_key=api_key, head_timeout_s=head_timeout_s,
              keep_alive_s=keep_alive_s, max_connections=max_connections,
              app_options={"max_queries": max_queries, "max_query_chars": max_query_chars, "max_topk": max_topk,
                           "max_body_bytes": max_body_bytes, "max_batch": max_batch, "chunk": chunk,
                           "max_wait_ms": max_wait_ms, "batching": not no_batching})

    index_app = typer.Typer(help="Build dense or BM25 indexes over a corpus.", no_args_is_help=True)

    @index_app.command("build")
    def build(
        corpus: str = typer.Option(..., "--corpus", help="Corpus jsonl/parquet or a sample name."),
        out: str = typer.Option(..., "--out", help="Output directory."),
        encoder: str = typer.Option("minilm", "--encoder", help="Encoder preset, checkpoint path, or 'bm25'."),
        backend: Optional[str] = typer.Option(None, "--backend", help="flat (ragfast kernel) or faiss; default "
                                                                      "faiss when --factory is given, else flat."),
        factory: Optional[str] = typer.Option(None, "--factory", help="faiss index factory (Flat, HNSW32, "
                                                                      "IVF4096,PQ64, ...)."),
        storage: str = typer.Option("fp32", "--storage", help="Flat storage: fp32, fp16, bf16, int8."),
        chunk_size: int = typer.Option(4096, "--chunk-size", help="Passages per embedding chunk (resume unit)."),
        batch_size: int = typer.Option(64, "--batch-size", help="Encoder batch size."),
        device: str = typer.Option("auto", "--device", callback=device_option, help=DEVICE_HELP),
        keep_chunks: bool = typer.Option(False, "--keep-chunks", help="Keep the embedding chunks after the build."),
        shards: int = typer.Option(1, "--shards", help="Split a flat index into this many memory-mapped shards."),
    ) -> None:
        """Embed a corpus (resumable, with progress) and build an index, printing the timing."""
        from rich.console import Console

        from ragfast.outputs.outdir import output_dir

        con = Console(stderr=True)
        with output_dir(out):
            _build(corpus, out, encoder, backend, factory, storage, chunk_size, batch_size, device, keep_chunks,
                   shards, con)

    def _build(corpus, out, encoder, backend, factory, storage, chunk_size, batch_size, device, keep_chunks, shards,
               con) -> None:
        from ragfast.data import load_corpus
        from ragfast.errors import ConfigError
        from ragfast.encoders.encoder import corpus_fingerprint

        t0 = time.perf_counter()
        corp = load_corpus(corpus)
        outp = Path(out)
        outp.mkdir(parents=True, exist_ok=True)
        key = corpus_fingerprint(corp)
        settings = {"corpus": {"passages": len(corp), "sha256": key}, "encoder": encoder,
                    "backend": None if encoder == "bm25" else (backend or ("faiss" if factory else "flat")),
                    "factory": factory, "storage": storage, "chunk_size": chunk_size, "shards": shards}
        _claim(outp, settings)
        report = {"corpus": corpus, "passages": len(corp), "load_s": round(time.perf_counter() - t0, 3)}
        if encoder == "bm25":
            from ragfast.retrieval.bm25 import BM25

            t1 = time.perf_counter()
            BM25.build(corp, progress=True).save(outp)
            report.update(encoder="bm25", build_s=round(time.perf_counter() - t1, 3))
        else:
            from ragfast.retrieval.dense import DenseIndex
            from ragfast.encoders.encoder import Encoder, encode_corpus, load_embeddings

            be = backend or ("faiss" if factory else "flat")
            enc = Encoder(encoder, device=device, batch_size=batch_size)
            _claim(outp, {**settings, "encoder_fingerprint": enc.fingerprint()})
            t1 = time.perf_counter()
            chunks = outp / "chunks"
            encode_corpus(enc, corp, chunks, chunk_size=chunk_size, progress=True, corpus_key=key)
            enc_s = time.perf_counter() - t1
            t2 = time.perf_counter()
            if shards > 1:
                from ragfast.retrieval.dense import ShardedIndex

                if be != "flat":
                    raise ConfigError("--shards splits flat indexes; faiss shards over GPUs by itself")
                idx = ShardedIndex.split(load_embeddings(chunks), shards, storage=storage)
            else:
                idx = DenseIndex.build(load_embeddings(chunks), be, storage=storage, factory=factory or "Flat",
                                       progress=True)
            idx.save(outp)
            build_s = time.perf_counter() - t2
            (outp / "encoder.json").write_text(json.dumps({"encoder": encoder, "describe": enc.describe()}, indent=1))
            if not keep_chunks:
                shutil.rmtree(chunks)
            report.update(encoder=enc.name, index=idx.describe(), encode_s=round(enc_s, 3),
                          passages_per_s=round(len(corp) / enc_s, 1) if enc_s > 0 else None,
                          build_s=round(build_s, 3))
        report["total_s"] = round(time.perf_counter() - t0, 3)
        done = {**json.loads((outp / "build.json").read_text()), **report, "finished": True}
        _write_json(outp / "build.json", done)
        con.print(f"[green]index written to {outp}[/]")
        print(json.dumps(report, indent=1))

    app.add_typer(index_app, name="index")


def _write_json(path: Path, obj: dict) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(obj, indent=1))
    tmp.replace(path)  # atomic: never half a build.json


def _claim(out: Path, settings: dict) -> None:
    """Record what ``index build`` makes in ``out/build.json``, or refuse an ``out`` made from other inputs.

    ``settings`` holds the corpus's content hash and every option that changes the index. A
    directory whose ``build.json`` names other settings is refused, naming the first that
    changed; one that holds files but no ``build.json`` is refused too (what made them is
    unknown). The same settings continue: the finished embedding chunks are kept.
    """
    from ragfast.errors import ConfigError
    from ragfast.outputs.outdir import LOCK_FILE
    from ragfast.runner.recording import first_difference

    path = out / "build.json"
    if path.exists():
        try:
            old = json.loads(path.read_text()).get("settings")
        except (json.JSONDecodeError, AttributeError):
            old = None
        if not isinstance(old, dict):
            raise ConfigError(f"{path} does not record what the index in {out} was built from; use another --out "
                              "or delete it")
        # Only the keys recorded so far (the encoder's fingerprint joins once the encoder is loaded).
        common = [k for k in settings if k in old]
        diff = first_difference({k: old[k] for k in common}, {k: settings[k] for k in common})
        if diff:
            raise ConfigError(f"{out} holds an index built from other inputs ({diff}); use another --out or "
                              "delete it")
        _write_json(path, {**json.loads(path.read_text()), "settings": {**old, **settings}})
        return
    held = sorted(str(p.relative_to(out)) for p in out.rglob("*") if p.is_file() and p.name != LOCK_FILE)
    if held:
        raise ConfigError(f"{out} holds files ({held[0]}, ...) but no build.json, so what made them is unknown; "
                          "use another --out or delete them")
    _write_json(path, {"settings": settings, "finished": False})
