"""``ragfast bench``: the main job."""
from __future__ import annotations

from typing import Any, List, Optional

import typer

from ragfast.commands import options as opt


def register(app: typer.Typer) -> None:
    @app.command("bench")
    @opt.with_flags("model", "retriever", "data", "config", "batch_size", "corpus", "encoder", "device", "val_data",
                    "val_offset", "max_turns", "topk", "seed")
    def bench(
        limit: Optional[int] = typer.Option(None, "--limit", "-n", help="Run only the first N test questions; also "
                                            "caps the S2G validation questions at N unless --val-limit is given."),
        val_limit: Optional[int] = typer.Option(None, "--val-limit", help="S2G validation questions used to choose "
                                                "the STOP threshold (default 100, or --limit when smaller)."),
        out: Optional[str] = typer.Option(None, "--out", "-o", help="Results directory (default ./ragfast-bench)."),
        offset: Optional[int] = typer.Option(None, "--offset", help="Skip the first N questions of --data (default "
                                             "100: the first 100 are the S2G validation split)."),
        resume: bool = typer.Option(False, "--resume/--no-resume", help="Continue an interrupted bench in --out; "
                                    "finished work is not redone; other data, questions, slots or settings are "
                                    "refused."),
        preset: str = typer.Option("default", "--preset", help="'default' (bundled data and models, offline) or "
                                   "'paper' (the S2G study's setting; needs its models under $RAGFAST_MODELS)."),
        judge: Optional[str] = typer.Option(None, "--judge", help="encoder (bundled doc-set judge) | head "
                                            "(frozen-feature head) | tiny | judge path | serve-judge URL | none."),
        nli: Optional[str] = typer.Option(None, "--nli", help="tiny | local cross-encoder path."),
        encoder_backend: Optional[str] = typer.Option(None, "--encoder-backend", help="auto (ONNX Runtime on CPU, "
                                                      "measured faster; torch on GPU) | torch | onnx."),
        nli_backend: Optional[str] = typer.Option(None, "--nli-backend", help="auto (ONNX Runtime on CPU, measured "
                                                  "faster; torch on GPU) | torch | onnx."),
        threshold: Optional[float] = typer.Option(None, "--threshold", help="S2G STOP threshold (default: selected "
                                                  "on validation questions)."),
        methods: Optional[List[str]] = typer.Option(None, "--method", "-m", help="Repeat to pick methods: searchr1 "
                                                    "s2g stepgap reloop."),
        ray: Optional[str] = typer.Option(None, "--ray", help="Run searchr1/s2g/stepgap on Ray: 'local' or a "
                                          "cluster address."),
        ray_workers: Optional[int] = typer.Option(None, "--ray-workers", help="Reasoner replicas (Ray worker "
                                                  "actors); default 2."),
        reasoner_device: Optional[str] = typer.Option(None, "--reasoner-device", help="Override --device for the "
                                                      "reasoner."),
        encoder_device: Optional[str] = typer.Option(None, "--encoder-device", help="Override --device for the "
                                                     "retrieval encoder."),
        judge_device: Optional[str] = typer.Option(None, "--judge-device", help="Override --device for the judge."),
        nli_device: Optional[str] = typer.Option(None, "--nli-device", help="Override --device for the NLI model."),
        served_model: Optional[str] = typer.Option(None, "--served-model", help="URL reasoner: the served model "
                                                   "name (default: the server's only model)."),
        reasoner_tokenizer: Optional[str] = typer.Option(None, "--reasoner-tokenizer", "--tokenizer",
                                                         help="URL reasoner: local tokenizer dir (chat template, "
                                                              "token counts)."),
        reasoner_config: Optional[str] = typer.Option(None, "--reasoner-config", "--model-config",
                                                      help="URL reasoner: config.json or model dir, for analytic "
                                                           "FLOPs."),
        **flags: Any,
    ) -> None:
        """Run native Search-R1, S2G stopping, StepGap and RELOOP on the same questions.

        Prints a side-by-side table (EM, F1, searches, tokens/FLOPs/seconds per component, total
        cost, ΔEM and Δcost against native with paired-bootstrap CIs) and writes trajectories,
        summary.json, summary.csv, report.md, report.html and PNG plots to --out. With no
        arguments it runs offline on the bundled HotpotQA dev sample, and says which model
        filled each slot and whether its answers mean anything.
        """
        from ragfast.bench import make_config, run_bench

        from ragfast.settings import BENCH_NAMES

        shared = {BENCH_NAMES.get(k, k): v for k, v in flags.items() if k != "config"}
        if shared.get("corpus"):
            shared["corpus"] = list(shared["corpus"])
        cfg = make_config(preset, flags["config"], limit=limit, out=out, offset=offset, judge=judge, nli=nli,
                          encoder_backend=encoder_backend, nli_backend=nli_backend, threshold=threshold,
                          methods=list(methods) if methods else None, ray=ray, ray_workers=ray_workers,
                          val_limit=val_limit, served_model=served_model, reasoner_tokenizer=reasoner_tokenizer,
                          reasoner_config=reasoner_config,
                          devices={k: v for k, v in (("reasoner", reasoner_device), ("encoder", encoder_device),
                                                     ("judge", judge_device), ("nli", nli_device)) if v} or None,
                          **shared)
        if limit is not None and val_limit is None and cfg.val_limit > limit:
            # A quick look (--limit) should be quick everywhere, validation included.
            import dataclasses

            cfg = dataclasses.replace(cfg, val_limit=limit)
        from ragfast.outdir import output_dir

        with output_dir(cfg.out):
            run_bench(cfg, resume=resume)
