"""``ragfast bench``: the main job."""
from __future__ import annotations

from typing import List, Optional

import typer

from ragfast.commands import options as opt


def register(app: typer.Typer) -> None:
    @app.command("bench")
    def bench(
        limit: Optional[int] = typer.Option(None, "--limit", "-n", help="Run only the first N test questions; also caps "
                                            "the S2G validation questions at N unless --val-limit is given."),
        val_limit: Optional[int] = typer.Option(None, "--val-limit", help="S2G validation questions used to choose "
                                                "the STOP threshold (default 100, or --limit when smaller)."),
        out: Optional[str] = typer.Option(None, "--out", "-o", help="Results directory (default ./ragfast-bench)."),
        resume: bool = typer.Option(False, "--resume/--no-resume", help="Continue an interrupted bench in --out; finished work is not redone."),
        preset: str = typer.Option("default", "--preset", help="'default' (bundled data and models, offline) or 'paper' "
                                   "(the S2G study's setting; needs its models under $RAGFAST_MODELS)."),
        config: Optional[str] = typer.Option(None, "--config", help="A YAML file of settings (any BenchConfig field); "
                                             "the run commands read the same keys."),
        data: Optional[str] = typer.Option(None, "--data", help="QA file or sample name (default hotpotqa-dev)."),
        offset: Optional[int] = typer.Option(None, "--offset", help="Skip the first N questions of --data (default "
                                             "100: the first 100 are the S2G validation split)."),
        val_data: Optional[str] = opt.VAL_DATA,
        val_offset: Optional[int] = opt.VAL_OFFSET,
        batch_size: Optional[int] = opt.BATCH_SIZE,
        corpus: Optional[List[str]] = opt.CORPUS,
        reasoner: Optional[str] = typer.Option(None, "--reasoner", help="scripted | tiny | local HF path | OpenAI-compatible URL."),
        judge: Optional[str] = typer.Option(None, "--judge", help="encoder (bundled doc-set judge) | head (frozen-feature head) | tiny | judge path | none."),
        nli: Optional[str] = typer.Option(None, "--nli", help="tiny | local cross-encoder path."),
        encoder: Optional[str] = typer.Option(None, "--encoder", help="minilm | local encoder path (e5, bge)."),
        encoder_backend: Optional[str] = typer.Option(None, "--encoder-backend", help="auto (ONNX Runtime on CPU, "
                                                      "measured faster; torch on GPU) | torch | onnx."),
        nli_backend: Optional[str] = typer.Option(None, "--nli-backend", help="auto (ONNX Runtime on CPU, measured "
                                                  "faster; torch on GPU) | torch | onnx."),
        index: Optional[str] = typer.Option(None, "--index", help="flat | bm25 | faiss:<factory> | saved index path | /retrieve URL."),
        budget: Optional[int] = typer.Option(None, "--budget", help="Search turns per question (default 4)."),
        topk: Optional[int] = typer.Option(None, "--topk", help="Documents per search (default 3)."),
        threshold: Optional[float] = typer.Option(None, "--threshold", help="S2G STOP threshold (default: selected on validation questions)."),
        methods: Optional[List[str]] = typer.Option(None, "--method", "-m", help="Repeat to pick methods: searchr1 s2g stepgap reloop."),
        seed: Optional[int] = typer.Option(None, "--seed", help="Seed of the scripted reasoner, the bootstrap and "
                                           "sampling (default 0)."),
        ray: Optional[str] = typer.Option(None, "--ray", help="Run searchr1/s2g/stepgap on Ray: 'local' or a cluster address."),
        ray_workers: Optional[int] = typer.Option(None, "--ray-workers", help="Reasoner replicas (Ray worker actors); default 2."),
        device: Optional[str] = typer.Option(None, "--device", help="Where local models run: auto (GPU if any; default) | cpu | cuda | cuda:N."),
        reasoner_device: Optional[str] = typer.Option(None, "--reasoner-device", help="Override --device for the reasoner."),
        encoder_device: Optional[str] = typer.Option(None, "--encoder-device", help="Override --device for the retrieval encoder."),
        judge_device: Optional[str] = typer.Option(None, "--judge-device", help="Override --device for the judge."),
        nli_device: Optional[str] = typer.Option(None, "--nli-device", help="Override --device for the NLI model."),
        served_model: Optional[str] = typer.Option(None, "--served-model", help="URL reasoner: the served model name (default: the server's only model)."),
        reasoner_tokenizer: Optional[str] = typer.Option(None, "--reasoner-tokenizer", help="URL reasoner: local tokenizer dir (chat template, token counts)."),
        reasoner_config: Optional[str] = typer.Option(None, "--reasoner-config", help="URL reasoner: config.json or model dir, for analytic FLOPs."),
    ) -> None:
        """Run native Search-R1, S2G stopping, StepGap and RELOOP on the same questions.

        Prints a side-by-side table (EM, F1, searches, tokens/FLOPs/seconds per component, total
        cost, ΔEM and Δcost against native with paired-bootstrap CIs) and writes trajectories,
        summary.json, summary.csv, report.md, report.html and PNG plots to --out. With no
        arguments it runs offline on the bundled HotpotQA dev sample, and says which model
        filled each slot and whether its answers mean anything.
        """
        from ragfast.bench import make_config, run_bench

        cfg = make_config(preset, config, limit=limit, out=out, data=data, offset=offset, val_data=val_data,
                          val_offset=val_offset, batch_size=batch_size, corpus=list(corpus) if corpus else None,
                          reasoner=reasoner, judge=judge, nli=nli,
                          encoder=encoder, encoder_backend=encoder_backend, nli_backend=nli_backend, index=index, budget=budget, topk=topk, threshold=threshold,
                          methods=list(methods) if methods else None, seed=seed, ray=ray, ray_workers=ray_workers,
                          val_limit=val_limit, device=device, served_model=served_model,
                          reasoner_tokenizer=reasoner_tokenizer, reasoner_config=reasoner_config,
                          devices={k: v for k, v in (("reasoner", reasoner_device), ("encoder", encoder_device),
                                                     ("judge", judge_device), ("nli", nli_device)) if v} or None)
        if limit is not None and val_limit is None and cfg.val_limit > limit:
            # A quick look (--limit) should be quick everywhere, validation included.
            import dataclasses

            cfg = dataclasses.replace(cfg, val_limit=limit)
        from ragfast.outdir import output_dir

        with output_dir(cfg.out):
            run_bench(cfg, resume=resume)
