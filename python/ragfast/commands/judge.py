"""``ragfast train-judge`` and ``ragfast serve-judge``: the command lines of the judge's trainer and server.

The server itself is :mod:`ragfast.judges.server`; the trainers are under :mod:`ragfast.judges.train`.
"""
from pathlib import Path
from typing import Optional

import typer

from ragfast.commands import serve_flags
from ragfast.infra.devices import DEVICE_HELP, device_option
from ragfast.judges.server import MAX_STATES_PER_REQUEST


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
        resume: bool = typer.Option(False, "--resume/--no-resume", help="causal: continue OUT/checkpoint."),
        max_steps: Optional[int] = typer.Option(None, "--max-steps", help="causal: stop after this many steps "
                                                                          "(checkpointed; --resume continues)."),
        bf16: bool = typer.Option(False, "--bf16/--fp32", help="causal: the frozen base in bf16, bf16 autocast for forward and "
                                                                  "backward (LoRA weights and optimizer fp32)."),
        top_layers: Optional[int] = typer.Option(None, "--top-layers", help="causal: LoRA on the last N decoder "
                                                                           "layers only (backward stops there; with 2+ "
                                                                           "epochs the frozen layers run once)."),
        decision_weight: float = typer.Option(1.0, "--decision-weight", help="causal: extra weight of the decision "
                                                                             "token's loss (' true'/' false', the "
                                                                             "token the STOP score reads) beside the "
                                                                             "mean loss of the whole verdict."),
        limit: Optional[int] = typer.Option(None, "--limit", help="encoder: only the first N questions (quick runs)."),
        threads: Optional[int] = typer.Option(None, "--threads", help="torch CPU threads."),
        val_fraction: float = typer.Option(0.2, help="head: share of questions held out for validation."),
        seed: int = typer.Option(0, help="Split and initialisation seed."),
        k: int = typer.Option(3, help="head: passages retrieved per turn."),
        turns: int = typer.Option(4, help="head: search turns per question."),
        encoder: str = typer.Option("minilm", help="head: frozen encoder, preset or checkpoint directory."),
        device: str = typer.Option("auto", "--device", callback=device_option, help=DEVICE_HELP),
    ) -> None:
        """Train a stopping judge: the bundled doc-set judge, a cross-encoder, a causal LM (LoRA) or the head."""
        from ragfast.commands.judge_training import train_judge_command

        train_judge_command(kind=kind, out=out, data=data, dev=dev, base=base, labels=labels,
                            label_source=label_source, epochs=epochs, lr=lr, lora_r=lora_r, resume=resume,
                            max_steps=max_steps, limit=limit, threads=threads, val_fraction=val_fraction, seed=seed,
                            k=k, turns=turns, encoder=encoder, device=device, bf16=bf16, top_layers=top_layers,
                            decision_weight=decision_weight)

    @app.command("serve-judge")
    def serve_judge(
        judge: str = typer.Option("encoder", "--judge", help="'encoder' (the bundled doc-set judge), 'head', a judge "
                                                             "file, or a causal-LM directory."),
        host: str = typer.Option("127.0.0.1", help="Bind address (local only by default)."),
        port: int = typer.Option(8001, help="Port."),
        device: str = typer.Option("auto", "--device", callback=device_option, help=DEVICE_HELP),
        max_wait_ms: float = typer.Option(5.0, help="How long a request waits for others to share its batch."),
        max_batch_states: int = typer.Option(1024, help="Most states in one micro-batch."),
        chunk_states: int = typer.Option(16, "--chunk-states", help="While small requests are about, the most states "
                                                                    "one request puts in a batch (big ones are "
                                                                    "interleaved)."),
        max_states: int = typer.Option(MAX_STATES_PER_REQUEST, "--max-states", help="Most states per request."),
        max_passages: int = typer.Option(64, "--max-passages", help="Most evidence passages per state."),
        max_passage_chars: int = typer.Option(20_000, "--max-passage-chars", help="Longest evidence passage."),
        max_question_chars: int = typer.Option(4096, "--max-question-chars", help="Longest question."),
        max_body_bytes: int = typer.Option(16 * 1024 * 1024, "--max-body-bytes",
                                           help="Largest request body, refused (413) before it is parsed."),
        cache_mb: float = typer.Option(256.0, "--cache-mb", help="Byte cap of the judge's text/embedding caches "
                                                                 "(least recently used entries go first)."),
        graceful_s: float = serve_flags.GRACEFUL_S,
        api_key: Optional[str] = serve_flags.API_KEY,
        head_timeout_s: float = serve_flags.HEAD_TIMEOUT_S,
        keep_alive_s: float = serve_flags.KEEP_ALIVE_S,
        max_connections: int = serve_flags.MAX_CONNECTIONS,
    ) -> None:
        """Serve POST /score (states in, STOP scores out), micro-batched and prefix-packed."""
        import uvicorn

        from ragfast.serving import check_bind, uvicorn_options

        # Before the judge loads: a bad port or an open bind without a token is one line at once.
        key = check_bind(host, port, api_key)
        net = uvicorn_options(host, port, head_timeout_s=head_timeout_s, keep_alive_s=keep_alive_s,
                              max_connections=max_connections)

        from ragfast.judges import load
        from ragfast.judges.server import JudgeLimits, make_app

        from ragfast.infra.cache import set_default_max_bytes
        from ragfast.errors import ConfigError

        if cache_mb < 0:
            raise ConfigError(f"--cache-mb must be >= 0, got {cache_mb}")
        set_default_max_bytes(int(cache_mb * 1024 * 1024))  # the judge's caches read it when built
        j = load(judge, device=device)
        d = j.describe()
        typer.echo(f"judge: {d['name']} (meaningful: {d['meaningful']}) on http://{host}:{port}/score", err=True)
        lim = JudgeLimits(max_states=max_states, max_passages=max_passages, max_passage_chars=max_passage_chars,
                          max_question_chars=max_question_chars, max_body_bytes=max_body_bytes)
        uvicorn.run(make_app(j, max_wait_ms=max_wait_ms, max_batch_states=max_batch_states, chunk_states=chunk_states,
                             limits=lim, api_key=key), **net, log_level="warning",
                    timeout_graceful_shutdown=graceful_s)
