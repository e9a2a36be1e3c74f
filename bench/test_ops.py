"""pytest-benchmark entries for every op, each backend beside its reference.

    python -m pytest bench/test_ops.py --benchmark-enable --benchmark-group-by=param:op

(``pyproject.toml`` disables benchmarks in the normal test run; this file is not in
``testpaths``, so CI never runs it.) Triton entries run only on a GPU.
"""
import numpy as np
import pytest
import torch

import ragfast
from ragfast.ops.policy import bootstrap_means, sweep
from ragfast.ops.prefix_attention import prefix_attention
from ragfast.ops.topk_ip import quantize, topk_ip

AVAIL = ragfast.backends()["available"]
CUDA = torch.cuda.is_available()


def _backends(op_has=("ref", "cpp", "triton")):
    out = []
    for b in op_has:
        if b == "triton" and not CUDA:
            continue  # the interpreter is a correctness tool, not something to time
        if AVAIL.get(b):
            out.append(b)
    return out


@pytest.mark.parametrize("op", ["topk_ip"])
@pytest.mark.parametrize("storage", ["fp32", "bf16", "int8"])
@pytest.mark.parametrize("batch", [1, 16, 256])
@pytest.mark.parametrize("backend", _backends())
def test_topk_ip(benchmark, op, storage, batch, backend):
    if backend != "cpp" and storage != "fp32":
        pytest.skip("low-precision storage is a C++ feature")
    dev = "cuda" if backend == "triton" else "cpu"
    g = torch.Generator().manual_seed(0)
    corpus = torch.nn.functional.normalize(torch.randn(100_000, 384, generator=g), dim=1).to(dev)
    stored = corpus if storage == "fp32" else quantize(corpus, storage)
    q = torch.nn.functional.normalize(torch.randn(batch, 384, generator=g), dim=1).to(dev)
    benchmark(lambda: topk_ip(q, stored, 10, backend=backend))


@pytest.mark.parametrize("op", ["sweep"])
@pytest.mark.parametrize("backend", _backends(("ref", "cpp")))
def test_sweep(benchmark, op, backend):
    rng = np.random.default_rng(0)
    scores = rng.normal(size=(800, 5))
    th = np.linspace(-3, 3, 200)
    benchmark(lambda: sweep(scores, th, backend=backend))


@pytest.mark.parametrize("op", ["bootstrap"])
@pytest.mark.parametrize("backend", _backends(("ref", "cpp")))
def test_bootstrap(benchmark, op, backend):
    diffs = np.random.default_rng(0).integers(-1, 2, size=800).astype(np.float64)
    benchmark(lambda: bootstrap_means(diffs, 10000, 0, backend=backend))


@pytest.mark.parametrize("op", ["prefix_attention"])
@pytest.mark.parametrize("backend", _backends(("ref", "triton")))
def test_prefix_attention(benchmark, op, backend):
    dev = "cuda" if backend == "triton" else "cpu"
    B, H, Hkv, Lq, Lk, D = 2, 8, 2, 128, 1024, 64
    q = torch.randn(B, H, Lq, D, device=dev)
    k = torch.randn(B, Hkv, Lk, D, device=dev)
    v = torch.randn(B, Hkv, Lk, D, device=dev)
    a = torch.arange(Lq, device=dev) + (Lk - Lq)
    seg_lo = (a - 16).clamp(min=0).expand(B, Lq).contiguous()
    prefix_hi = torch.full((B, Lq), Lk // 2, device=dev, dtype=torch.int64)
    benchmark(lambda: prefix_attention(q, k, v, prefix_hi, seg_lo, backend=backend))


@pytest.mark.parametrize("op", ["prefill_attention"])
@pytest.mark.parametrize("backend", _backends(("ref", "cpp")))
def test_prefill_attention(benchmark, op, backend):
    from ragfast.ops.prefill_attention import prefill_attention

    B, H, Hkv, L, T, D = 4, 14, 2, 450, 1450, 64  # a Search-R1 turn's observation after 1,000 cached tokens
    q = torch.randn(B, H, L, D).bfloat16()
    k, v = torch.randn(B, Hkv, T, D).bfloat16(), torch.randn(B, Hkv, T, D).bfloat16()
    mask = torch.ones(B, T, dtype=torch.bool)
    mask[0, :100] = False
    benchmark(lambda: prefill_attention(q, k, v, mask, backend=backend))
