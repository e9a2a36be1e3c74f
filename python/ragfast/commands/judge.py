"""``ragfast train-judge`` and ``ragfast serve-judge``: the stopping judge's trainer and server.

The server exposes ``POST /score``: states in (``[{"question", "evidence": [...],
"trajectory_id"?}]``), STOP scores out. Requests that arrive close together are merged into one
micro-batch, so the CausalJudge packs the states of every trajectory in it (prefix sharing)
whichever request they came from.
"""
# No `from __future__ import annotations`: FastAPI must see the request models as classes.
import asyncio
import contextlib
import math
import threading
import time
from concurrent.futures import Future
from pathlib import Path
from queue import Empty, Queue
from typing import Any, Optional

import typer

MAX_STATES_PER_REQUEST = 4096


class _Batcher:
    """Merges concurrent /score requests into one judge call (a worker thread owns the model)."""

    def __init__(self, judge: Any, max_wait_s: float = 0.005, max_states: int = 1024):
        self.judge = judge
        self.max_wait_s = max_wait_s
        self.max_states = max_states
        self.q: Queue = Queue()
        self.batches = 0
        self.ledger = None
        self._thread = threading.Thread(target=self._run, name="ragfast-judge-batcher", daemon=True)
        self._thread.start()

    def submit(self, states: list[Any]) -> Future:
        fut: Future = Future()
        self.q.put((states, fut))
        return fut

    def _run(self) -> None:
        while True:
            item = self.q.get()
            if item is None:
                return
            group = [item]
            n = len(item[0])
            deadline = time.perf_counter() + self.max_wait_s
            while n < self.max_states:
                left = deadline - time.perf_counter()
                if left <= 0:
                    break
                try:
                    nxt = self.q.get(timeout=left)
                except Empty:
                    break
                if nxt is None:
                    self.q.put(None)
                    break
                group.append(nxt)
                n += len(nxt[0])
            states = [s for st, _ in group for s in st]
            try:
                scores = self.judge.stop_scores(states, ledger=self.ledger)
                self.batches += 1
                off = 0
                for st, fut in group:
                    fut.set_result(scores[off:off + len(st)])
                    off += len(st)
            except Exception as exc:  # hand the error to every waiting request
                for _, fut in group:
                    if not fut.done():
                        fut.set_exception(exc)

    def close(self) -> None:
        self.q.put(None)
        self._thread.join(timeout=5)


def make_app(judge: Any, *, max_wait_ms: float = 5.0, max_batch_states: int = 1024):
    """The FastAPI app of ``serve-judge`` around an already loaded judge.

    Endpoints: ``POST /score`` -> ``{"scores": [float | null], "judge": str, "meaningful": bool}``
    (null where a state could not be scored); ``GET /health`` -> the judge's ``describe()``.
    Bad requests get 400/422 with the problem named.
    """
    from fastapi import FastAPI, HTTPException
    from pydantic import BaseModel, ConfigDict, Field

    from ragfast.cost import CostLedger
    from ragfast.errors import RagfastError
    from ragfast.types import State

    class StateIn(BaseModel):
        model_config = ConfigDict(extra="forbid")
        question: str
        evidence: list[str] = Field(default_factory=list)
        trajectory_id: Optional[str] = None

    class ScoreIn(BaseModel):
        model_config = ConfigDict(extra="forbid")
        states: list[StateIn]

    batcher = _Batcher(judge, max_wait_ms / 1e3, max_batch_states)
    batcher.ledger = CostLedger()

    @contextlib.asynccontextmanager
    async def lifespan(_app):
        yield
        batcher.close()

    app = FastAPI(title="ragfast judge", description="STOP scores of retrieval states", lifespan=lifespan)
    app.state.batcher = batcher
    desc = judge.describe()

    @app.get("/health")
    def health() -> dict[str, Any]:
        tot = batcher.ledger.totals().get("judge", {})
        return {"judge": judge.describe(), "batches": batcher.batches,
                "cost": {k: tot.get(k, 0) for k in ("calls", "input_tokens", "cached_tokens", "flops", "seconds")}}

    @app.post("/score")
    async def score(req: ScoreIn) -> dict[str, Any]:
        if len(req.states) > MAX_STATES_PER_REQUEST:
            raise HTTPException(400, f"too many states in one request: {len(req.states)} > {MAX_STATES_PER_REQUEST}")
        for i, s in enumerate(req.states):
            if not s.question.strip():
                raise HTTPException(400, f"state {i}: empty question")
        states = [State(s.question, list(s.evidence), s.trajectory_id, 0) for s in req.states]
        if not states:
            return {"scores": [], "judge": desc["name"], "meaningful": desc["meaningful"]}
        try:
            scores = await asyncio.wrap_future(batcher.submit(states))
        except RagfastError as exc:
            raise HTTPException(400, str(exc)) from exc
        return {"scores": [None if not math.isfinite(float(x)) else float(x) for x in scores],
                "judge": desc["name"], "meaningful": desc["meaningful"]}

    return app


def register(app: typer.Typer) -> None:
    @app.command("train-judge")
    def train_judge(
        out: Path = typer.Option(..., "--out", help="Output directory."),
        kind: str = typer.Option("docset", "--kind", help="docset: the bundled default judge (per-document MiniLM "
                                                         "logits + state head); encoder: LoRA-fine-tune MiniLM as a "
                                                         "cross-encoder judge; causal: LoRA SFT of a causal LM on "
                                                         "labelled states; head: the frozen-feature logistic head."),
        data: str = typer.Option("hotpotqa-train", "--data", help="encoder/head: QA file with supporting facts and "
                                                                  "context paragraphs, or a sample name."),
        dev: Optional[str] = typer.Option(None, "--dev", help="encoder/head: extra QA file/sample to report metrics "
                                                              "on (e.g. hotpotqa-dev); never trained on."),
        base: Optional[str] = typer.Option(None, "--base", help="causal: base causal-LM directory."),
        labels: Optional[Path] = typer.Option(None, "--labels", help="causal: labelled_states.jsonl "
                                                                     "(ragfast label-states)."),
        label_source: str = typer.Option("auto", "--label-source", help="causal: teacher | gold | probe | auto."),
        epochs: Optional[int] = typer.Option(None, help="Training epochs (encoder default 3, causal 2)."),
        lr: Optional[float] = typer.Option(None, help="Learning rate (encoder default 1e-3, causal 2e-4)."),
        lora_r: int = typer.Option(8, "--lora-r", help="LoRA rank (encoder, causal)."),
        resume: bool = typer.Option(False, "--resume", help="causal: continue OUT/checkpoint."),
        max_steps: Optional[int] = typer.Option(None, "--max-steps", help="causal: stop after this many steps "
                                                                          "(checkpointed; --resume continues)."),
        limit: Optional[int] = typer.Option(None, "--limit", help="encoder: only the first N questions (quick runs)."),
        threads: Optional[int] = typer.Option(None, "--threads", help="torch CPU threads."),
        val_fraction: float = typer.Option(0.2, help="head: share of questions held out for validation."),
        seed: int = typer.Option(0, help="Split and initialisation seed."),
        k: int = typer.Option(3, help="head: passages retrieved per turn."),
        turns: int = typer.Option(4, help="head: search turns per question."),
        encoder: str = typer.Option("minilm", help="head: frozen encoder, preset or checkpoint directory."),
        device: str = typer.Option("cpu", help="cpu or cuda."),
    ) -> None:
        """Train a stopping judge: the bundled doc-set judge, a cross-encoder, a causal LM (LoRA) or the head."""
        from ragfast.commands.judge_training import train_judge_command

        train_judge_command(kind=kind, out=out, data=data, dev=dev, base=base, labels=labels,
                            label_source=label_source, epochs=epochs, lr=lr, lora_r=lora_r, resume=resume,
                            max_steps=max_steps, limit=limit, threads=threads, val_fraction=val_fraction, seed=seed,
                            k=k, turns=turns, encoder=encoder, device=device)

    @app.command("serve-judge")
    def serve_judge(
        judge: str = typer.Option("encoder", "--judge", help="'encoder' (bundled head), a head file, or a causal-LM "
                                                             "directory."),
        host: str = typer.Option("127.0.0.1", help="Bind address (local only by default)."),
        port: int = typer.Option(8001, help="Port."),
        device: str = typer.Option("cpu", help="cpu or cuda."),
        max_wait_ms: float = typer.Option(5.0, help="How long a request waits for others to share its batch."),
        max_batch_states: int = typer.Option(1024, help="Most states in one micro-batch."),
    ) -> None:
        """Serve POST /score (states in, STOP scores out), micro-batched and prefix-packed."""
        import uvicorn

        from ragfast.models.judge import load_judge

        j = load_judge(judge, device=device)
        d = j.describe()
        typer.echo(f"judge: {d['name']} (meaningful: {d['meaningful']}) on http://{host}:{port}/score", err=True)
        uvicorn.run(make_app(j, max_wait_ms=max_wait_ms, max_batch_states=max_batch_states), host=host, port=port,
                    log_level="warning")
