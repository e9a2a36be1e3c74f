"""gemv (ragfast.ops.gemv): every compiled level against the reference, on fresh random inputs."""
from pathlib import Path

import numpy as np
import pytest
import torch

from ragfast.ops.gemv import GemvWeight, gemv, gemv_ref
from ragfast.ops.registry import available

pytestmark = pytest.mark.skipif(not available()["cpp"], reason="ragfast._C not built")

STORAGE = {"fp32": torch.float32, "bf16": torch.bfloat16, "int8": torch.int8}


def seeded():
    return torch.Generator().manual_seed(int(np.random.SeedSequence().entropy % 2**31))


def weights(storage, n, k, g, row_stride=None):
    """A [n, k] weight (a row-strided view when row_stride > k), its scales for int8."""
    cols = row_stride or k
    if storage == "int8":
        full = torch.randint(-127, 128, (n, cols), generator=g, dtype=torch.int8)
        return full[:, :k], torch.rand(n, generator=g) * 0.02 + 1e-3
    return torch.randn(n, cols, generator=g).to(STORAGE[storage])[:, :k], None


def bound(x, w, scales, bias, ref32, x_dtype):
    """How far a correct kernel may land from the reference: fp32 sums in another order
    (K ulps of the absolute sum), plus the output's rounding in bf16 (twice: ours and the ref's)."""
    wf = w.float() if scales is None else w.float() * scales[:, None]
    mag = x.float().abs().reshape(-1, x.shape[-1]) @ wf.abs().T
    tol = 4e-7 * x.shape[-1] * mag + 1e-6
    if bias is not None:
        tol = tol + 1e-6 * bias.abs()
    if x_dtype == torch.bfloat16:
        tol = tol + 2 ** -7 * ref32.abs().reshape(tol.shape)
    return tol


@pytest.mark.parametrize("storage", ["fp32", "bf16", "int8"])
@pytest.mark.parametrize("x_dtype", [torch.float32, torch.bfloat16])
def test_every_level_matches_the_reference(isa_level, storage, x_dtype):
    g = seeded()
    for M, K, N in [(1, 1, 1), (1, 15, 3), (2, 16, 4), (3, 17, 5), (4, 100, 130), (5, 33, 9), (9, 896 + 3, 67),
                    (17, 64, 8)]:
        w, scales = weights(storage, N, K, g, row_stride=K + 5)
        assert w.stride(0) == K + 5  # the kernel reads row-strided weights in place
        bias = torch.randn(N, generator=g) if N % 2 else None
        x = torch.randn(M, K, generator=g).to(x_dtype)
        op = GemvWeight(w, scales, bias)
        out = torch.full((M, N), float("nan"), dtype=x_dtype)  # poisoned: every element must be written
        got = op(x, out=out)
        assert got is out
        ref32 = gemv_ref(x.float(), w, scales, bias)
        err = (got.float() - ref32).abs()
        assert torch.isfinite(got).all()
        assert (err <= bound(x, w, scales, bias, ref32, x_dtype)).all(), (isa_level, storage, M, K, N, err.max())
        # The public op, on either backend, agrees too.
        for backend in ("cpp", "ref"):
            y = gemv(x, w, scales, bias, backend=backend)
            assert y.dtype == x_dtype and y.shape == (M, N)
            assert ((y.float() - ref32).abs() <= bound(x, w, scales, bias, ref32, x_dtype)).all()


def test_strided_inputs_and_outputs(isa_level):
    g = seeded()
    M, K, N = 6, 77, 41
    w, _ = weights("bf16", N, K, g)
    big = torch.randn(M, 2 * K + 3, generator=g).to(torch.bfloat16)
    op = GemvWeight(w)
    ref32 = gemv_ref(big[:, :K].float(), w)
    for x in (big[:, :K], big[:, ::2][:, :K], big[:, :K].unsqueeze(0).expand(2, M, K)[1]):
        assert not x.is_contiguous()
        out_big = torch.full((M, N + 9), float("nan"), dtype=torch.bfloat16)
        out = out_big[:, 3:N + 3]
        op(x, out=out)
        expect = gemv_ref(x.float(), w)
        assert ((out.float() - expect).abs() <= bound(x, w, None, None, expect, torch.bfloat16)).all()
        assert torch.isnan(out_big[:, :3]).all() and torch.isnan(out_big[:, N + 3:]).all()  # nothing outside
    # Leading dimensions are kept: [2, 3, K] -> [2, 3, N].
    x3 = big[:, :K].reshape(2, 3, K)
    y3 = op(x3)
    assert y3.shape == (2, 3, N)
    assert ((y3.reshape(M, N).float() - ref32).abs() <= bound(big[:, :K], w, None, None, ref32, torch.bfloat16)).all()


def test_threads_split_rows_without_changing_a_bit(isa_level):
    g = seeded()
    w, scales = weights("int8", 517, 260, g)
    x = torch.randn(3, 260, generator=g).to(torch.bfloat16)
    op = GemvWeight(w, scales, torch.randn(517, generator=g))
    one = op(x, threads=1)
    for t in (2, 3, 8):
        assert torch.equal(op(x, threads=t), one)


def test_nan_and_empty_rows():
    g = seeded()
    w, _ = weights("bf16", 70, 40, g)
    x = torch.randn(2, 40, generator=g).to(torch.bfloat16)
    x[1, 7] = float("nan")
    y = GemvWeight(w)(x)
    assert torch.isfinite(y[0]).all() and torch.isnan(y[1]).all()
    assert GemvWeight(w)(x[:0]).shape == (0, 70)


def test_int8_weights_keep_bf16_activations_precision(isa_level):
    """At VNNI levels bf16 activations meet int8 weights as 23-bit fixed point per row
    (csrc/isa/gemv_avx512vnni.cpp); an outlier 10^4 times the row's other values, an all-zero
    row and the deepest layer's sums with every code at +-127 stay within the fp32 path's bound."""
    g = seeded()
    for M, K, N in [(3, 4864, 37), (1, 8960, 21), (6, 200, 9)]:
        w, scales = weights("int8", N, K, g)
        x = torch.randn(M, K, generator=g)
        x[0, int(torch.randint(0, K, (1,), generator=g))] = 1e4  # one outlier in the first row
        if M > 2:
            x[2] = 0.0  # a row of zeros: its sums are exactly 0, the bias remains
        x = x.to(torch.bfloat16)
        bias = torch.randn(N, generator=g)
        ref32 = gemv_ref(x.float(), w, scales, bias)
        got = GemvWeight(w, scales, bias)(x, out=torch.full((M, N), float("nan"), dtype=torch.bfloat16))
        assert ((got.float() - ref32).abs() <= bound(x, w, scales, bias, ref32, torch.bfloat16)).all(), (isa_level, M, K)
        if M > 2:
            assert torch.equal(got[2], bias.to(torch.bfloat16))
    # Every lane at its largest: codes +-127, activations at +-max, 8,960 deep (the 1.5B's MLP).
    K, N = 8960, 5
    w = (torch.randint(0, 2, (N, K), generator=g, dtype=torch.int8) * 2 - 1) * 127
    x = ((torch.randint(0, 2, (2, K), generator=g) * 2 - 1) * 3.0).to(torch.bfloat16)
    x[:, 0::2] = 3.0
    scales = torch.full((N,), 1e-3)
    exact = (x.double() @ w.double().T) * 1e-3
    got = GemvWeight(w, scales)(x).double()
    assert ((got - exact).abs() <= 2 ** -8 * exact.abs() + 1e-3).all(), (isa_level, (got - exact).abs().max())


def test_int8_weights_carry_nan_and_infinity_as_the_reference():
    g = seeded()
    w, scales = weights("int8", 70, 40, g)
    x = torch.randn(3, 40, generator=g).to(torch.bfloat16)
    x[1, 7] = float("nan")
    x[2, 3] = float("inf")
    y = GemvWeight(w, scales)(x)
    ref = gemv_ref(x.float(), w, scales)
    assert torch.isfinite(y[0]).all() and torch.isnan(y[1]).all()
    assert torch.equal(torch.isinf(y[2]), torch.isinf(ref[2])) and torch.equal(torch.isnan(y[2]), torch.isnan(ref[2]))


def test_bad_input_is_refused_with_what_is_wrong():
    w = torch.zeros(8, 16, dtype=torch.int8)
    with pytest.raises(ValueError, match="scales"):
        GemvWeight(w)
    with pytest.raises(ValueError, match="scales"):
        GemvWeight(w.float(), torch.ones(8))
    with pytest.raises(ValueError, match="2-D fp32, bf16 or int8"):
        GemvWeight(w.half())
    with pytest.raises(ValueError, match="bias has 7 values for 8"):
        GemvWeight(w.float(), bias=torch.ones(7))
    op = GemvWeight(w.float())
    with pytest.raises(ValueError, match=r"x must be .*\[\.\.\., 16\]"):
        op(torch.zeros(2, 15))
    with pytest.raises(ValueError, match=r"x must be"):
        op(torch.zeros(2, 16, dtype=torch.float16))
    with pytest.raises(ValueError, match="out must be"):
        op(torch.zeros(2, 16), out=torch.zeros(2, 8, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="x must be"):
        gemv(torch.zeros(2, 15), w.float(), backend="ref")  # the reference checks alike


def test_default_rows_follow_the_level(isa_level, monkeypatch):
    """Each storage takes this machine's rows at the level in use; bf16 only where vdpbf16ps reads
    the weights as they are."""
    from ragfast.ops import gemv_rows
    from ragfast.ops.gemv import default_rows

    asked = []
    monkeypatch.setattr(gemv_rows, "machine_rows",
                        lambda level, calibrate_with: asked.append(level) or {"fp32": 5, "bf16": 7, "int8": 3})
    assert default_rows(torch.float32) == 5 and default_rows(torch.int8) == 3
    assert default_rows(torch.bfloat16) == (7 if isa_level in ("avx512bf16", "amx") else 0)
    assert default_rows(torch.float16) == 0
    assert set(asked) == {isa_level}


def test_rows_from_ratios_stop_at_the_first_loss():
    from ragfast.ops.gemv_rows import rows_from_ratios

    assert rows_from_ratios({1: 1.46, 2: 1.07, 3: 0.92, 4: 1.2}) == 2  # the Xeon's bf16: a later win does not count
    assert rows_from_ratios({8: 1.1, 1: 1.8, 4: 1.4, 2: 1.7}) == 8
    assert rows_from_ratios({1: 0.95, 4: 1.12}) == 0  # the Xeon's fp32: MKL's sgemv wins at one row
    assert rows_from_ratios({1: 1.0}) == 0  # a tie keeps torch


def test_shipped_rows_are_valid_and_keyed_by_machine():
    from ragfast.ops.gemv_rows import STORAGES, shipped_tables

    tables = shipped_tables()
    assert {t["cpu"] for t in tables} >= {"AMD EPYC", "Intel(R) Xeon(R) Processor"}
    for t in tables:
        assert t["features"] == sorted(t["features"]) and t["machine"].startswith(t["cpu"])
        for level, rows in t["rows"].items():
            assert level in t["runs"] and set(rows) <= set(STORAGES)
            assert t["runs"][level]["command"].startswith("python bench/bench_gemv.py")


def test_machine_rows_shipped_then_cached_then_calibrated_else_fallback(tmp_path, monkeypatch, caplog):
    import json
    import logging

    from ragfast.ops import gemv_rows

    key = {"cpu": "Test CPU 9000", "features": ["avx2", "fma"]}
    monkeypatch.setattr(gemv_rows, "machine_key", lambda: dict(key))
    monkeypatch.setattr(gemv_rows, "_MACHINE", {})
    monkeypatch.setenv("RAGFAST_CACHE", str(tmp_path))
    table = tmp_path / "shipped.json"
    table.write_text(json.dumps({"machines": [dict(key, rows={"avx2": {"fp32": 4, "bf16": 0, "int8": 2}},
                                                   runs={"avx2": {"command": "python bench/bench_gemv.py"}})]}))
    monkeypatch.setattr(gemv_rows, "TABLE_PATH", table)
    calls = []

    def calib():
        calls.append(1)
        return {"fp32": 6, "bf16": 1, "int8": 0}

    monkeypatch.setenv("RAGFAST_CALIBRATE", "0")
    assert gemv_rows.machine_rows("avx2", calib) == {"fp32": 4, "bf16": 0, "int8": 2}  # shipped
    assert gemv_rows.machine_rows("avx512", calib) == gemv_rows.FALLBACK and not calls  # no calibration asked
    monkeypatch.setattr(gemv_rows, "_MACHINE", {})
    monkeypatch.setenv("RAGFAST_CALIBRATE", "1")
    assert gemv_rows.machine_rows("avx512") == gemv_rows.FALLBACK  # nothing to calibrate with
    monkeypatch.setattr(gemv_rows, "_MACHINE", {})
    with caplog.at_level(logging.INFO, logger="ragfast.ops.gemv_rows"):
        assert gemv_rows.machine_rows("avx512", calib) == {"fp32": 6, "bf16": 1, "int8": 0}
    assert len(calls) == 1 and "calibrated" in caplog.text
    assert gemv_rows.machine_rows("avx512", calib) == {"fp32": 6, "bf16": 1, "int8": 0} and len(calls) == 1
    monkeypatch.setattr(gemv_rows, "_MACHINE", {})
    assert gemv_rows.machine_rows("avx512", calib)["fp32"] == 6 and len(calls) == 1  # the cache, in a new process
    cached = json.loads(gemv_rows.cache_file("gemv_rows", key).read_text())
    assert cached["cpu"] == key["cpu"] and cached["rows"]["avx512"] == {"fp32": 6, "bf16": 1, "int8": 0}
    monkeypatch.setattr(gemv_rows, "_MACHINE", {})
    assert gemv_rows.machine_rows("avx512vnni", lambda: 1 / 0) == gemv_rows.FALLBACK  # a failure never fails a load


def test_bench_writes_this_machines_rows_and_keeps_the_others(tmp_path, monkeypatch):
    import importlib.util
    import json

    from ragfast.ops import gemv_rows

    spec = importlib.util.spec_from_file_location("bench_gemv_t", Path(__file__).resolve().parent.parent / "bench" / "bench_gemv.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    path = tmp_path / "rows.json"
    other = {"cpu": "Other", "features": ["avx2"], "rows": {"avx2": {"fp32": 1}}, "runs": {"avx2": {"command": "x"}}}
    path.write_text(json.dumps({"machines": [other]}))
    monkeypatch.setattr(mod, "machine_key", lambda: {"cpu": "Test CPU", "features": ["avx2", "fma"]})
    mod.write_table({"fp32": 0, "bf16": 2, "int8": 3}, "amx", ["bench/bench_gemv.py", "--write-table"], path)
    mod.write_table({"fp32": 8}, "avx2", ["bench/bench_gemv.py", "--write-table"], path)
    tables = gemv_rows.shipped_tables(str(path))
    assert tables[0] == other
    mine = tables[1]
    assert mine["rows"] == {"amx": {"fp32": 0, "bf16": 2, "int8": 3}, "avx2": {"fp32": 8}}
    assert mine["runs"]["amx"]["command"] == "python bench/bench_gemv.py --write-table"


def _vnni(level):
    return level in ("avx512vnni", "avx512bf16", "amx")


@pytest.mark.parametrize("strided", [False, True])
def test_packed_codes_match_the_reference_at_every_level(isa_level, strided):
    """gemv_packed on w8a8's packed layout: every output within the bound of the reference, rows
    of x strided in a wider buffer, the output poisoned; None (nothing written) at levels without
    VNNI, where the caller runs the row-major gemv."""
    from ragfast.ops.gemv import gemv_packed, gemv_packed_ref
    from ragfast.ops.w8a8 import pack_codes

    g = seeded()
    for M, K, N in [(1, 64, 1), (1, 896, 1152), (2, 128, 17), (3, 192, 130), (4, 64, 48), (5, 4864, 37), (7, 320, 200)]:
        codes, scales = weights("int8", N, K, g)
        bias = torch.randn(N, generator=g) if N % 2 else None
        wide = torch.randn(M, K + (9 if strided else 0), generator=g).to(torch.bfloat16)
        x = wide[:, :K]
        out = torch.full((M, N), float("nan"), dtype=torch.bfloat16)
        got = gemv_packed(x, pack_codes(codes), scales, bias, out=out)
        if not _vnni(isa_level):
            assert got is None and torch.isnan(out).all()
            continue
        ref32 = gemv_ref(x.float(), codes, scales, bias)
        assert got.data_ptr() == out.data_ptr() and torch.isfinite(got).all()
        err = (got.float() - ref32).abs()
        assert (err <= bound(x, codes, scales, bias, ref32, torch.bfloat16)).all(), (isa_level, M, K, N, err.max())
        ref = gemv_packed_ref(x, pack_codes(codes), scales, bias)
        assert ((ref.float() - ref32).abs() <= bound(x, codes, scales, bias, ref32, torch.bfloat16)).all()


def test_packed_silu_pair_matches_gate_and_up_through_silu_mul(isa_level):
    """A gate/up pair packed as one (interleaved by 64 rows): silu(gate) * up as silu_mul computes it
    from the two projections' bf16 outputs (the row-major gemv's, which the packed sums equal up to
    the fp32 order), for 1-4 rows; the reference agrees."""
    from ragfast.ops.gemv import gemv_packed, gemv_packed_ref
    from ragfast.ops.silu_mul import silu_mul
    from ragfast.ops.w8a8 import interleave_gate_up, pack_gate_up

    if not _vnni(isa_level):
        pytest.skip(f"gemv_packed runs at VNNI levels only, not {isa_level}")
    g = seeded()
    for M, K, F in [(1, 896, 256), (2, 64, 64), (4, 320, 192)]:
        (gate, gs), (up, us) = weights("int8", F, K, g), weights("int8", F, K, g)
        x = torch.randn(M, K, generator=g).to(torch.bfloat16)
        out = torch.full((M, F), float("nan"), dtype=torch.bfloat16)
        got = gemv_packed(x, pack_gate_up(gate, up), interleave_gate_up(gs, us), silu=True, out=out)
        want = silu_mul(GemvWeight(gate, gs)(x), GemvWeight(up, us)(x))
        gate32, up32 = gemv_ref(x.float(), gate, gs), gemv_ref(x.float(), up, us)
        exact = torch.nn.functional.silu(gate32) * up32
        tol = 2 ** -6 * exact.abs() + 2 ** -6 * (gate32.abs() + 1) * up32.abs() * 2 ** -7 + 1e-3
        assert ((got.float() - exact).abs() <= tol).all(), (isa_level, M, K, F)
        # Bit-equal to the two projections' gemv outputs through silu_mul except where the two
        # orders of the fp32 additions round a projection's output to neighbouring bf16 values.
        assert (got == want).float().mean() > 0.95
        ref = gemv_packed_ref(x, pack_gate_up(gate, up), interleave_gate_up(gs, us), silu=True)
        assert ((ref.float() - exact).abs() <= tol).all()


def test_packed_codes_give_none_on_nan_and_refuse_bad_input():
    from ragfast.ops.gemv import gemv_packed
    from ragfast.ops.w8a8 import pack_codes

    g = seeded()
    codes, scales = weights("int8", 32, 64, g)
    p = pack_codes(codes)
    x = torch.randn(2, 64, generator=g).to(torch.bfloat16)
    x[1, 3] = float("nan")
    assert gemv_packed(x, p, scales) is None  # the row-major gemv carries NaN as the reference does
    with pytest.raises(ValueError, match="bf16"):
        gemv_packed(x.float(), p, scales)
    with pytest.raises(ValueError, match="scales"):
        gemv_packed(x, p, scales[:5])
    with pytest.raises(ValueError, match="SiLU pair"):
        gemv_packed(x, p, scales, silu=True)
    with pytest.raises(ValueError, match="out must be"):
        gemv_packed(x, p, scales, out=torch.empty(2, 16, dtype=torch.bfloat16))
