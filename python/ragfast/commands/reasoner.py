"""``ragfast train-reasoner``, ``merge-reasoner`` and ``eval-reasoner``: a trained Search-R1 reasoner.

``train-reasoner`` LoRA-fine-tunes a causal LM (default ``smollm2``) on the scripted oracle's
Search-R1 trajectories over the default corpus of the bundled training questions
(:func:`ragfast.methods.searchr1.reasoner_train.train_reasoner`); ``merge-reasoner`` writes a
trained reasoner (the bundled ``smollm2-searchr1`` or an adapter directory) merged into its
base as a plain Hugging Face directory an OpenAI-compatible server can serve;
``eval-reasoner`` reads a run with search and a closed-book one on the same questions
(:func:`ragfast.methods.searchr1.reasoner_eval.evaluate_reasoner`).
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, List, Optional

import typer

__all__ = ["train_reasoner_command", "eval_reasoner_command", "register"]


def _echo(m: str) -> None:
    typer.echo(m, err=True)


def train_reasoner_command(*, out: Path, base: str = "smollm2", data: Optional[List[str]] = None,
                           limit: Optional[int] = None, max_obs_tokens: int = 128, quote_words: int = 0,
                           distinct_queries: bool = False, final_answer_only: bool = False, epochs: int = 1, lr: float = 3e-4,
                           lora_r: int = 16, batch_size: int = 4, top_layers: Optional[int] = None, save_every: int = 10, resume: bool = False,
                           max_steps: Optional[int] = None, bf16: bool = False, seed: int = 0, retriever: str = "default",
                           encoder: str = "minilm",
                           threads: Optional[int] = None, merge_out: Optional[Path] = None) -> dict[str, Any]:
    """What ``ragfast train-reasoner`` does; returns the card."""
    from ragfast.errors import ConfigError
    from ragfast.methods.searchr1.reasoner_train import train_reasoner
    from ragfast.runner import slots

    if limit is not None and limit < 1:
        raise ConfigError(f"--limit must be >= 1, got {limit}")
    if max_steps is not None and max_steps < 1:
        raise ConfigError(f"--max-steps must be >= 1, got {max_steps}")

    def make_retriever(questions: Any) -> Any:
        return slots.retriever_over(retriever, questions, encoder_spec=encoder, progress=False)

    card = train_reasoner(out, base=base, parts=data or None, limit=limit, max_obs_tokens=max_obs_tokens,
                          quote_words=quote_words, distinct_queries=distinct_queries,
                          final_answer_only=final_answer_only, epochs=epochs, lr=lr, r=lora_r, batch_size=batch_size, top_layers=top_layers, save_every=save_every,
                          resume=resume,
                          max_steps=max_steps, bf16=bf16, seed=seed, make_retriever=make_retriever, threads=threads,
                          log=_echo)
    if merge_out is not None:
        if not card.get("adapter"):
            raise ConfigError("--merge-out needs a finished run (every step done); --resume first")
        from ragfast.models.searchr1_reasoner import merge_reasoner

        typer.echo(f"merged model: {merge_reasoner(card['adapter'], merge_out, base=str(card['base_dir']))}")
    return card


def register(app: typer.Typer) -> None:
    """Add ``train-reasoner`` and ``merge-reasoner``."""

    @app.command("train-reasoner")
    def train_reasoner_cmd(
        out: Path = typer.Option(..., "--out", help="Output directory: data.jsonl, checkpoint/, adapter/, "
                                 "train_reasoner.json."),
        base: str = typer.Option("smollm2", "--base", help="Base causal LM: a catalogue name or a local directory."),
        data: Optional[List[str]] = typer.Option(None, "--data", help="Training QA files or sample names (repeatable; "
                                                 "default hotpotqa-train and hotpotqa-train-extra)."),
        limit: Optional[int] = typer.Option(None, "--limit", help="Use the first N training questions."),
        max_obs_tokens: int = typer.Option(128, "--max-obs-tokens", help="Observation cap (base tokens) of the "
                                           "training trajectories (the protocol's is 500; shorter trains faster)."),
        quote_words: int = typer.Option(0, "--quote-words", help="Words the oracle's <think> claims quote from a "
                                        "document (0: none, 'Doc 1 (Title) names X.'; quoting made SmolLM2 copy "
                                        "into runaway turns)."),
        distinct_queries: bool = typer.Option(False, "--distinct-queries/--repeat-queries", help="The oracle never "
                                              "searches a query twice (later queries: an unsearched title read, then "
                                              "the question) and answers when no title is left. Default: the bundled "
                                              "adapter's data, which repeats."),
        final_answer_only: bool = typer.Option(False, "--final-answer-only/--final-think", help="The turn the loop "
                                               "forces is '<answer> X </answer>', as the trained reasoner opens it "
                                               "with <answer>. Default: '<think> ... </think> <answer> X </answer>'."),
        epochs: int = typer.Option(1, "--epochs", help="Passes over the training trajectories."),
        lr: float = typer.Option(3e-4, "--lr", help="AdamW learning rate of the LoRA weights."),
        lora_r: int = typer.Option(16, "--lora-r", help="LoRA rank (alpha stays 32)."),
        batch_size: int = typer.Option(4, "--batch-size", help="Trajectories per optimizer step."),
        top_layers: Optional[int] = typer.Option(None, "--top-layers", help="LoRA on the last N decoder layers only "
                                                 "(backward stops there: faster steps)."),
        save_every: int = typer.Option(10, "--save-every", help="Checkpoint period in steps."),
        resume: bool = typer.Option(False, "--resume/--no-resume", help="Continue OUT/checkpoint on OUT/data.jsonl."),
        max_steps: Optional[int] = typer.Option(None, "--max-steps", help="Stop after N steps in all (resumable)."),
        bf16: bool = typer.Option(False, "--bf16/--fp32", help="bf16 autocast for forward and backward."),
        seed: int = typer.Option(0, "--seed", help="Seed of the behaviour mix and of training (order, LoRA init)."),
        retriever: str = typer.Option("default", "--retriever", help="Retriever of the trajectories over the default "
                                      "corpus of the training questions (default: the encoder, flat; bm25 needs no "
                                      "embedding of the corpus)."),
        encoder: str = typer.Option("minilm", "--encoder", help="Retrieval encoder of the trajectories."),
        threads: Optional[int] = typer.Option(None, "--threads", help="torch CPU threads."),
        merge_out: Optional[Path] = typer.Option(None, "--merge-out", help="Also write the merged model here (a "
                                                 "plain Hugging Face directory for an OpenAI-compatible server)."),
    ) -> None:
        """LoRA SFT of a causal LM on Search-R1 trajectories (observations out of the loss); resumable."""
        train_reasoner_command(out=out, base=base, data=data, limit=limit, max_obs_tokens=max_obs_tokens,
                               quote_words=quote_words, distinct_queries=distinct_queries,
                               final_answer_only=final_answer_only, epochs=epochs,
                               lr=lr, lora_r=lora_r, batch_size=batch_size, top_layers=top_layers, save_every=save_every,
                          resume=resume,
                               max_steps=max_steps, bf16=bf16, seed=seed, retriever=retriever, encoder=encoder,
                               threads=threads,
                               merge_out=merge_out)

    @app.command("merge-reasoner")
    def merge_reasoner_cmd(
        name: str = typer.Argument("smollm2-searchr1", help="A bundled reasoner (qwen2.5-coder-0.5b-searchr1, "
                                   "qwen2.5-coder-1.5b-searchr1, smollm2-searchr1) or an adapter directory "
                                   "(train-reasoner's OUT/adapter)."),
        out: Path = typer.Option(..., "--out", help="Where the merged Hugging Face directory goes (new or empty)."),
        base: Optional[str] = typer.Option(None, "--base", help="Base model of an adapter directory (catalogue name "
                                           "or local directory); a bundled reasoner knows its own."),
    ) -> None:
        """Write a trained reasoner merged into its base: a directory vLLM or any OpenAI-compatible server loads."""
        from ragfast.models.searchr1_reasoner import merge_reasoner

        typer.echo(str(merge_reasoner(name, out, base=base)))

    register_eval(app)


def eval_reasoner_command(search: Path, closed: Path, card: Optional[Path] = None) -> dict[str, Any]:
    """What ``ragfast eval-reasoner`` does: print the figures; with ``card``, store them in it."""
    import json

    from ragfast.methods.searchr1.reasoner_eval import evaluate_reasoner

    ev = evaluate_reasoner(search, closed)
    s, c, g = ev["search"], ev["closed_book"], ev["em_gain"]

    def f(x: Any) -> str:
        return "n/a" if x is None else f"{x:.3f}"

    typer.echo(f"search: {s['questions']} questions, valid actions {f(s['valid_action_fraction'])} of {s['turns']} "
               f"turns ({f(s['valid_action_fraction_free_turns'])} of the free turns), {s['searches_per_question']:.2f} "
               f"searches/q, EM {s['em']:.3f}, F1 {s['f1']:.3f}, {f(s['seconds_per_question'])} s/q")
    typer.echo(f"closed-book: EM {c['em']:.3f}, F1 {c['f1']:.3f}, answered {c['answered_fraction']:.3f}, "
               f"{f(c['seconds_per_question'])} s/q")
    typer.echo(f"EM gain of search: {g['delta']:+.3f} [{g['low']:+.3f}, {g['high']:+.3f}] (paired 95% CI)")
    if card is not None:
        data = json.loads(card.read_text()) if card.is_file() else {}
        data["evaluation"] = ev
        card.write_text(json.dumps(data, indent=2) + "\n")
    return ev


def register_eval(app: typer.Typer) -> None:
    """Add ``eval-reasoner``."""

    @app.command("eval-reasoner")
    def eval_reasoner_cmd(
        search: Path = typer.Option(..., "--search", help="`run searchr1` output directory with search."),
        closed: Path = typer.Option(..., "--closed", help="The same questions closed-book (`run searchr1 --budget 0`)."),
        card: Optional[Path] = typer.Option(None, "--card", help="Write the figures into this reasoner card "
                                            "(ragfast_reasoner.json) under 'evaluation'."),
    ) -> None:
        """Protocol validity, searches/q, EM/F1 with search and closed-book, and the paired CI of the EM gain."""
        eval_reasoner_command(search, closed, card)
