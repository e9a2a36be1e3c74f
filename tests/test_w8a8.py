"""w8a8 (ragfast.ops.w8a8): the compiled row quantiser and sum scaler against their references, bit for bit."""
import numpy as np
import pytest
import torch

from ragfast.ops.registry import available
from ragfast.ops.w8a8 import dequantize_sums, quantize_rows

pytestmark = pytest.mark.skipif(not available()["cpp"], reason="ragfast._C not built")


def seeded():
    return torch.Generator().manual_seed(int(np.random.SeedSequence().entropy % 2**31))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_quantize_rows_equals_the_reference(isa_level, dtype):
    g = seeded()
    for M, K in [(1, 1), (2, 7), (17, 48), (5, 203), (64, 896), (3, 4864)]:
        x = (torch.randn(M, 2 * K + 3, generator=g) * torch.rand(M, 1, generator=g) * 50).to(dtype)
        x = x[:, 3::2]  # strided columns: copied once
        x[0, 0] = 0.0
        if M > 2:
            x[1] = 0.0  # a zero row: scale 1, codes 0
            # exact ties: multiples of half a step, where rounding goes to the even code
            s = float(x[2].float().abs().max()) / 127.0
            x[2, : min(K, 9)] = torch.tensor([(j - 4) * 0.5 * s for j in range(min(K, 9))]).to(dtype)
        for xx in (x, x.contiguous()):
            c1, s1 = quantize_rows(xx, backend="ref")
            c2, s2 = quantize_rows(xx, backend="cpp")
            assert c2.dtype == torch.int8 and c2.shape == (M, K) and c2.is_contiguous()
            assert torch.equal(s1, s2) and torch.equal(c1, c2)
            assert int(c2.abs().max()) <= 127


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bias", [False, True])
def test_dequantize_sums_equals_the_reference(isa_level, dtype, bias):
    g = seeded()
    for M, N in [(1, 1), (3, 7), (17, 29), (64, 4864)]:
        acc = torch.randint(-2**24, 2**24, (M, N), generator=g, dtype=torch.int32)
        xs, ws = torch.rand(M, generator=g) / 100, torch.rand(N, generator=g) / 100
        b = torch.randn(N, generator=g) if bias else None
        want = dequantize_sums(acc, xs, ws, b, dtype, backend="ref")
        got = dequantize_sums(acc, xs, ws, b, dtype, backend="cpp")
        assert got.dtype == dtype and torch.equal(got, want)
        wide = torch.full((M, N + 11), float("nan"), dtype=dtype)  # poisoned; the sums go to a column slice
        out = dequantize_sums(acc, xs, ws, b, out=wide[:, 5:5 + N], backend="cpp")
        assert torch.equal(out, want) and torch.equal(wide[:, 5:5 + N], want)
        assert torch.isnan(wide[:, :5].float()).all() and torch.isnan(wide[:, 5 + N:].float()).all()


def test_the_results_do_not_depend_on_threads():
    from ragfast.ops.w8a8 import dequantize_sums_cpp, quantize_rows_cpp

    g = seeded()
    x = torch.randn(33, 4099, generator=g).to(torch.bfloat16)
    acc = torch.randint(-2**20, 2**20, (33, 5001), generator=g, dtype=torch.int32)
    xs, ws = torch.rand(33, generator=g), torch.rand(5001, generator=g)
    before = torch.get_num_threads()
    outs = []
    try:
        for t in (1, 2, 3):
            torch.set_num_threads(t)
            outs.append((*quantize_rows_cpp(x), dequantize_sums_cpp(acc, xs, ws, None, torch.bfloat16)))
    finally:
        torch.set_num_threads(before)
    for o in outs:
        assert all(torch.equal(a, b) for a, b in zip(o, outs[0]))


@pytest.mark.parametrize("backend", ["cpp", "ref"])
def test_bad_input_is_one_line(backend):
    for bad in (torch.zeros(3, 0), torch.zeros(3, 4, dtype=torch.float16), torch.zeros(4)):
        with pytest.raises(ValueError, match="w8a8: x must be") as e:
            quantize_rows(bad, backend=backend)
        assert "\n" not in str(e.value)
    acc = torch.zeros(2, 3, dtype=torch.int32)
    for args, match in (((acc.float(), torch.ones(2), torch.ones(3)), "sums must be"),
                        ((acc, torch.ones(3), torch.ones(3)), "row scales"),
                        ((acc, torch.ones(2), torch.ones(3), torch.ones(4)), "bias")):
        with pytest.raises(ValueError, match=match):
            dequantize_sums(*args, backend=backend)
    with pytest.raises(ValueError, match="out must be"):
        dequantize_sums(acc, torch.ones(2), torch.ones(3), out=torch.zeros(3, 2), backend=backend)


def test_a_wide_w8a8_layer_runs_in_column_blocks_and_equals_its_reference():
    """A layer wider than 2 x W8A8_COLUMNS (the lm head's case) takes the blocked path: the same
    values as the reference, each block's scales and bias in their own columns."""
    from ragfast.models.weight_quant import (KERNEL_ROWS, W8A8_COLUMNS, apply_weights, int8_matmul_exact,
                                             quantize_int8, w8a8_linear_ref)

    if not int8_matmul_exact():
        pytest.skip("torch's int8 matmul is not exact on this CPU: w8a8 is refused")
    g = seeded()
    n = 2 * W8A8_COLUMNS + 37
    lin = torch.nn.Linear(48, n).to(torch.bfloat16)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(n, 48, generator=g) * torch.rand(n, 1, generator=g))
        lin.bias.copy_(torch.randn(n, generator=g))
    model = torch.nn.Sequential(lin)
    scales = quantize_int8(lin.weight)[1]
    apply_weights(model, "w8a8")
    x = torch.randn(KERNEL_ROWS + 3, 48, generator=g).to(torch.bfloat16)
    with torch.inference_mode():
        got = model(x)
    want = w8a8_linear_ref(x, model[0].codes, scales, lin.bias)
    assert got.shape == (KERNEL_ROWS + 3, n)
    torch.testing.assert_close(got.float(), want.float(), rtol=2 ** -8, atol=2 ** -8 * float(want.abs().max()))


def _int8(shape, g):
    return torch.randint(-127, 128, shape, generator=g, dtype=torch.int8)


def test_packed_codes_round_trip_and_bad_shapes():
    from ragfast.ops.w8a8 import pack_codes

    g = seeded()
    for n, k in [(1, 64), (15, 128), (16, 64), (33, 192)]:
        codes = _int8((n, k), g)
        p = pack_codes(codes)
        assert p.data.shape == ((n + 15) // 16, k // 4, 16, 4) and p.data.is_contiguous()
        assert torch.equal(p.codes(), codes)
        assert not p.data.permute(0, 2, 1, 3).reshape(-1, k)[n:].any()  # columns past N are zero
    for bad, match in ((torch.zeros(4, 48, dtype=torch.int8), "multiple of 64"),
                       (torch.zeros(4, 64), "int8 CPU tensor"), (torch.zeros(0, 64, dtype=torch.int8), "N >= 1")):
        with pytest.raises(ValueError, match=match) as e:
            pack_codes(bad)
        assert "\n" not in str(e.value)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bias", [False, True])
def test_matmul_equals_the_reference_at_each_level(isa_level, dtype, bias):
    """The compiled product with its scales fused, bit for bit against the integer matmul and the
    reference scaler, on odd sizes (partial 16-row and 16-column groups, one 32-column strip
    and several), rows given with a stride, outputs poisoned in a column slice of a wider tensor.
    Below MATMUL_LEVELS (VNNI, AMX) the compiled path is refused and the default falls back to the
    reference."""
    from ragfast.ops.w8a8 import MATMUL_LEVELS, matmul, matmul_available, pack_codes

    g = seeded()
    if isa_level not in MATMUL_LEVELS:
        assert not matmul_available()
        xq, w = _int8((3, 64), g), pack_codes(_int8((5, 64), g))
        with pytest.raises(RuntimeError, match="avx512vnni"):
            matmul(xq, torch.ones(3), w, torch.ones(5), backend="cpp")
        assert torch.equal(matmul(xq, torch.ones(3), w, torch.ones(5)),
                           matmul(xq, torch.ones(3), w, torch.ones(5), backend="ref"))
        return
    assert matmul_available()
    for M, K, N in [(1, 64, 1), (5, 128, 17), (6, 64, 64), (7, 64, 80), (16, 64, 16), (17, 192, 33), (33, 64, 130),
                    (64, 896, 259), (100, 320, 47), (31, 256, 1000)]:
        wide_x = _int8((M, K + 64), g)
        xq = wide_x[:, 32:32 + K]  # strided rows: copied once
        w = pack_codes(_int8((N, K), g))
        xs, ws = torch.rand(M, generator=g) / 50, torch.rand(N, generator=g) / 50
        xs[0] = 1.0
        b = torch.randn(N, generator=g) if bias else None
        want = matmul(xq, xs, w, ws, b, dtype, backend="ref")
        got = matmul(xq, xs, w, ws, b, dtype, backend="cpp")
        assert got.dtype == dtype and got.shape == (M, N) and torch.equal(got, want)
        poisoned = torch.full((M, N + 9), float("nan"), dtype=dtype)
        out = matmul(xq, xs, w, ws, b, out=poisoned[:, 4:4 + N], backend="cpp")
        assert torch.equal(out, want) and torch.equal(poisoned[:, 4:4 + N], want)
        assert torch.isnan(poisoned[:, :4].float()).all() and torch.isnan(poisoned[:, 4 + N:].float()).all()


def test_matmul_equals_int_mm_with_extreme_codes_and_any_threads(isa_level):
    """All-±127 codes at the deepest depth of the models (the 1.5B's 8,960): exact int32 sums (VNNI's
    unsigned-operand offset taken off exactly), the same bits as torch._int_mm + dequantize_sums,
    and the same for 1, 2 and 3 threads."""
    from ragfast.ops.w8a8 import MATMUL_LEVELS, matmul, pack_codes

    if isa_level not in MATMUL_LEVELS:
        pytest.skip(f"the compiled matmul runs at {', '.join(MATMUL_LEVELS)} only")
    g = seeded()
    M, K, N = 37, 8960, 48
    xq = torch.where(torch.rand(M, K, generator=g) < 0.5, 127, -127).to(torch.int8)
    xq[1] = 127
    codes = torch.where(torch.rand(N, K, generator=g) < 0.5, 127, -127).to(torch.int8)
    codes[2] = 127
    xs, ws = torch.rand(M, generator=g), torch.rand(N, generator=g)
    want = dequantize_sums(torch.mm(xq.int(), codes.int().t()), xs, ws, None, torch.float32, backend="ref")
    w = pack_codes(codes)
    before = torch.get_num_threads()
    try:
        for t in (1, 2, 3):
            torch.set_num_threads(t)
            assert torch.equal(matmul(xq, xs, w, ws, backend="cpp"), want)
    finally:
        torch.set_num_threads(before)
    assert float(want[1, 2]) == pytest.approx(127 * 127 * K * float(xs[1]) * float(ws[2]), rel=1e-6)


def test_bad_matmul_input_is_one_line():
    from ragfast.ops.w8a8 import matmul, pack_codes

    w = pack_codes(torch.zeros(5, 64, dtype=torch.int8))
    xq = torch.zeros(3, 64, dtype=torch.int8)
    for args, match in (((xq.float(), torch.ones(3), w, torch.ones(5)), "codes must be"),
                        ((torch.zeros(3, 128, dtype=torch.int8), torch.ones(3), w, torch.ones(5)), r"\[rows, 64\]"),
                        ((xq, torch.ones(2), w, torch.ones(5)), "row scales"),
                        ((xq, torch.ones(3), w, torch.ones(4)), "column scales")):
        with pytest.raises(ValueError, match=match) as e:
            matmul(*args, backend="ref")
        assert "\n" not in str(e.value)


def test_gate_up_interleaving_round_trips_and_bad_widths():
    from ragfast.ops.w8a8 import interleave_gate_up, pack_gate_up

    g = seeded()
    gate, up = _int8((128, 64), g), _int8((128, 64), g)
    both = interleave_gate_up(gate, up)
    assert torch.equal(both[:64], gate[:64]) and torch.equal(both[64:128], up[:64])
    assert torch.equal(both[128:192], gate[64:]) and torch.equal(both[192:], up[64:])
    assert torch.equal(pack_gate_up(gate, up).codes(), both)
    s = interleave_gate_up(torch.arange(64.0), -torch.arange(64.0))
    assert torch.equal(s[:64], torch.arange(64.0)) and torch.equal(s[64:], -torch.arange(64.0))
    for a, b, match in ((gate[:96], up[:96], "multiple of 64"), (gate, up[:64], "one shape")):
        with pytest.raises(ValueError, match=match) as e:
            interleave_gate_up(a, b)
        assert "\n" not in str(e.value)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gate_up_equals_its_two_products_then_silu_mul_at_each_level(isa_level, dtype):
    """The paired product (tiles or VNNI): bit for bit the two dequantised products (the compiled matmul)
    followed by ragfast's silu_mul kernel, and within silu_mul's tolerance of the reference (torch's
    SiLU); odd row counts, strided rows, outputs poisoned in a column slice of a wider tensor, 1-3
    threads alike. Below MATMUL_LEVELS the compiled path is refused and the default is the reference."""
    from ragfast.ops.silu_mul import silu_mul
    from ragfast.ops.w8a8 import MATMUL_LEVELS, gate_up, interleave_gate_up, matmul, matmul_available, pack_gate_up

    g = seeded()
    if isa_level not in MATMUL_LEVELS:
        w = pack_gate_up(_int8((64, 64), g), _int8((64, 64), g))
        xq, xs, ws = _int8((3, 64), g), torch.ones(3), torch.ones(128)
        with pytest.raises(RuntimeError, match="avx512vnni"):
            gate_up(xq, xs, w, ws, backend="cpp")
        assert torch.equal(gate_up(xq, xs, w, ws), gate_up(xq, xs, w, ws, backend="ref"))
        return
    assert matmul_available()
    before = torch.get_num_threads()
    try:
        for M, K, F in [(1, 64, 64), (17, 128, 192), (33, 192, 64), (64, 896, 320), (100, 64, 1024)]:
            xq = _int8((M, K + 64), g)[:, 16:16 + K]  # strided rows
            gate_c, up_c = _int8((F, K), g), _int8((F, K), g)
            gs, us = torch.rand(F, generator=g) / 300, torch.rand(F, generator=g) / 300
            xs = torch.rand(M, generator=g) / 50
            w, ws = pack_gate_up(gate_c, up_c), interleave_gate_up(gs, us)
            two = matmul(xq, xs, w, ws, None, dtype, backend="cpp")  # [M, 2F]: interleaved gate and up
            gate = two.view(M, F // 64, 2, 64)[:, :, 0].reshape(M, F)
            up = two.view(M, F // 64, 2, 64)[:, :, 1].reshape(M, F)
            want = silu_mul(gate, up, backend="cpp")
            for t in (1, 2, 3):
                torch.set_num_threads(t)
                poisoned = torch.full((M, F + 9), float("nan"), dtype=dtype)
                got = gate_up(xq, xs, w, ws, out=poisoned[:, 5:5 + F], backend="cpp")
                assert got.dtype == dtype and got.shape == (M, F) and torch.equal(got, want), (M, K, F, t)
                assert torch.isnan(poisoned[:, :5].float()).all() and torch.isnan(poisoned[:, 5 + F:].float()).all()
            torch.set_num_threads(before)
            assert torch.equal(gate_up(xq, xs, w, ws, dtype, backend="cpp"), want)
            ref = gate_up(xq, xs, w, ws, dtype, backend="ref")
            assert torch.equal(ref, torch.nn.functional.silu(gate) * up)
            # silu_mul's kernel against torch's SiLU (tests/test_silu_mul.py holds the exact bounds)
            tol = 2 ** -6 if dtype == torch.bfloat16 else 1e-5
            torch.testing.assert_close(want.float(), ref.float(), rtol=tol, atol=tol * float(ref.abs().max()))
    finally:
        torch.set_num_threads(before)
