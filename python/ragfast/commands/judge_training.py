"""What ``ragfast train-judge`` and ``ragfast label-states`` do (the judge-training commands).

``train-judge --kind docset`` (the default) retrains the bundled judge
(:func:`ragfast.judges.train.documents.train_docset_judge`), ``--kind encoder`` fine-tunes MiniLM as a
cross-encoder judge (:func:`ragfast.judges.train.documents.train_cross_judge`), ``--kind causal`` LoRA-fine-tunes a causal
LM on labelled states (:func:`ragfast.judges.train.causal.train_causal_judge`), ``--kind head``
fits the frozen-feature head (:func:`ragfast.judges.train.head.train_encoder_judge`).
``label-states`` labels the states of a native run (:func:`ragfast.methods.s2g.labelling.label_states`).
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, List, Optional

import typer

from ragfast.infra.devices import DEVICE_HELP, device_option

from ragfast.errors import ConfigError

__all__ = ["train_judge_command", "register"]


def _echo(m: str) -> None:
    typer.echo(m, err=True)


def _f(x: Any) -> str:
    return "undefined" if x is None else f"{x:.4f}"


def _echo_metrics(card: dict[str, Any], weights: Path) -> None:
    m = card["metrics"]
    parts = [f"{name} {sset}: AP {_f(m[name][sset]['ap'])} vs #docs {_f(m[name][sset]['ap_ndocs_baseline'])}"
             for name in ("validation", "dev") if name in m for sset in ("subsets", "trajectories")]
    typer.echo(f"wrote {weights} ({card['size_bytes'] / 1e3:.0f} kB, {card['seconds']:.0f} s); " + "; ".join(parts))


def train_judge_command(*, kind: str, out: Path, data: str = "hotpotqa-train", dev: str | None = None,
                        base: str | None = None, labels: Path | None = None, label_source: str = "auto",
                        epochs: int | None = None, lr: float | None = None, lora_r: int = 8, resume: bool = False,
                        max_steps: int | None = None, limit: int | None = None, threads: int | None = None,
                        val_fraction: float = 0.2, seed: int = 0, k: int = 3, turns: int = 4,
                        encoder: str = "minilm", device: str = "cpu", bf16: bool = False,
                        top_layers: int | None = None, decision_weight: float = 1.0) -> dict[str, Any]:
    """Dispatch ``train-judge`` by ``kind``; prints one summary line; returns the card."""
    if kind == "docset":
        from ragfast.judges.train.documents import train_docset_judge

        card = train_docset_judge(data, out, dev=dev, seed=seed, limit=limit, threads=threads, log=_echo)
        _echo_metrics(card, Path(out) / "docset_judge.safetensors")
        return card
    if kind == "encoder":
        from ragfast.judges.train.documents import train_cross_judge

        card = train_cross_judge(data, out, dev=dev, seed=seed, r=lora_r, epochs=epochs or 3, lr=lr or 1e-3,
                                 limit=limit, threads=threads, log=_echo)
        _echo_metrics(card, Path(out) / "cross_judge.safetensors")
        return card
    if kind == "causal":
        if not base or labels is None:
            raise ConfigError("train-judge --kind causal needs --base PATH (causal LM) and --labels FILE "
                              "(ragfast label-states)")
        from ragfast.judges.train.causal import train_causal_judge
        from ragfast.models.hub import local_model

        base = local_model(base, "--base")  # a catalogue name or hub id -> its local directory

        card = train_causal_judge(labels, base, out, source=label_source, epochs=epochs or 2, lr=lr or 2e-4,
                                  r=lora_r, resume=resume, max_steps=max_steps, seed=seed, device=device, bf16=bf16,
                                  top_layers=top_layers, decision_weight=decision_weight, log=_echo)
        typer.echo(f"{'wrote ' + card['merged'] if card['finished'] else 'checkpointed ' + str(Path(out) / 'checkpoint')}: "
                   f"{card['steps']} steps, loss {_f(card['loss_first'])} -> {_f(card['loss_last'])}")
        return card
    if kind == "head":
        from ragfast.judges.train.head import train_encoder_judge

        card = train_encoder_judge(data, out, dev=dev, val_fraction=val_fraction, seed=seed, k=k, turns=turns,
                                   encoder=encoder, device=device, log=_echo)
        m = card["metrics"]
        typer.echo(f"wrote {Path(out) / 'encoder_judge.safetensors'}: validation AP {_f(m['validation']['ap'])}, "
                   f"Brier {m['validation']['brier']:.4f}"
                   + (f"; dev AP {_f(m['dev']['ap'])}, Brier {m['dev']['brier']:.4f}" if "dev" in m else ""))
        return card
    raise ConfigError(f"--kind must be docset, encoder, causal or head; got {kind!r}")


def register(app: typer.Typer) -> None:
    @app.command("label-states")
    def label_states_cmd(
        results_dir: Path = typer.Argument(..., help="A `ragfast study s2g` or `ragfast bench` results directory."),
        source: List[str] = typer.Option(["probe"], "--source", help="probe | gold | teacher (repeatable)."),
        teacher: Optional[str] = typer.Option(None, "--teacher", help="Teacher LLM: an OpenAI-compatible URL or a "
                                                                      "causal-LM directory."),
        teacher_model: str = typer.Option("teacher", "--teacher-model", help="Model name sent to a teacher URL."),
        api_key: Optional[str] = typer.Option(None, "--api-key", envvar="RAGFAST_TEACHER_API_KEY",
                                              help="Bearer token for a teacher URL."),
        out: Optional[Path] = typer.Option(None, "--out", help="Output file (default RESULTS_DIR/labelled_states.jsonl)."),
        max_new_tokens: int = typer.Option(256, help="Teacher verdict budget."),
        teacher_route: str = typer.Option("auto", "--teacher-route", help="A local teacher's verdict: generate (JSON, "
                                          "parsed) | score (log P(true) > log P(false), nothing to parse) | auto "
                                          "(generate, score the parse failures)."),
        device: str = typer.Option("auto", "--device", callback=device_option, help=DEVICE_HELP),
    ) -> None:
        """Label the recorded states of a native run (probe, gold support, teacher LLM), with agreement."""
        from ragfast.methods.s2g.labelling import label_states

        s = label_states(results_dir, source, teacher=teacher, teacher_model=teacher_model, api_key=api_key, out=out,
                         max_new_tokens=max_new_tokens, device=device, teacher_route=teacher_route, log=_echo)
        parts = [f"{k}: {v['labelled']} labelled, {v['positives']} sufficient" for k, v in s["sources"].items()]
        if "teacher" in s["sources"]:
            parts.append(f"teacher parse failures {s['sources']['teacher']['parse_failures']}, "
                         f"scored {s['sources']['teacher']['scored']}")
        for pair, a in s.get("agreement", {}).items():
            if a["n"]:
                parts.append(f"{pair} agree {a['agreement']:.3f} (kappa {_f(a['kappa'])}, n={a['n']})")
        typer.echo(f"wrote {s['file']} ({s['n_states']} states of {s['n_questions']} questions): " + "; ".join(parts))
