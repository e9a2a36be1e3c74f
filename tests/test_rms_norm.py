"""rms_norm (ragfast.ops.rms_norm): every compiled level against the reference, on fresh random inputs."""
import numpy as np
import pytest
import torch

from ragfast.ops.registry import available
from ragfast.ops.rms_norm import rms_norm, rms_norm_cpp, rms_norm_ref

pytestmark = pytest.mark.skipif(not available()["cpp"], reason="ragfast._C not built")

SIZES = [(1, 1), (1, 7), (2, 16), (3, 17), (5, 63), (4, 64), (2, 65), (7, 896), (3, 1000), (65, 1536)]


def seeded():
    return torch.Generator().manual_seed(int(np.random.SeedSequence().entropy % 2**31))


def assert_close_to_ref(got, x, w, eps):
    """fp32: within a few units in the last place (the sum of squares in another order); bf16: within
    two bf16 steps of the reference, and equal on nearly every value (a systematic error is not)."""
    expect = rms_norm_ref(x, w, eps)
    assert got.dtype == expect.dtype and got.shape == expect.shape
    if x.dtype == torch.float32:
        torch.testing.assert_close(got, expect, rtol=4e-6, atol=1e-30)
        return
    e, g = expect.float(), got.float()
    step = torch.exp2(torch.floor(torch.log2(e.abs().clamp_min(1e-30))) - 7)  # one bf16 step at e's scale
    assert ((g - e).abs() <= 2 * step).all(), (g - e).abs().max()
    assert (g == e).float().mean() >= 0.98


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_every_level_matches_the_reference(isa_level, dtype):
    g = seeded()
    for M, N in SIZES:
        x = (torch.randn(M, N, generator=g) * torch.rand(M, 1, generator=g) * 8).to(dtype)
        w = (torch.randn(N, generator=g) + 1).to(dtype)
        eps = float(10 ** torch.randint(-8, -3, (1,), generator=g).item())
        out = torch.full((M, N), float("nan"), dtype=dtype)  # poisoned: every value must be written
        got = rms_norm_cpp(x, w, eps, out=out)
        assert got.data_ptr() == out.data_ptr()
        assert_close_to_ref(got, x, w, eps)
        assert_close_to_ref(rms_norm(x, w, eps, backend="cpp"), x, w, eps)


def test_zero_rows_special_values_and_big_magnitudes(isa_level):
    for dtype in (torch.float32, torch.bfloat16):
        w = torch.ones(33, dtype=dtype)
        z = torch.zeros(2, 33, dtype=dtype)  # all zeros: 0 * 1/sqrt(eps) = 0
        assert torch.equal(rms_norm(z, w, 1e-6, backend="cpp"), rms_norm_ref(z, w, 1e-6))
        x = torch.randn(3, 33).to(dtype)
        x[1, 5] = float("nan")
        x[2, 0] = float("inf")
        got, ref = rms_norm(x, w, 1e-6, backend="cpp"), rms_norm_ref(x, w, 1e-6)
        assert torch.equal(got.isnan(), ref.isnan())  # NaN where the reference has it (inf * 0 too)
        assert_close_to_ref(got[:1], x[:1], w, 1e-6)
        big = (torch.randn(2, 100) * 1e18).to(dtype)  # squares near fp32's largest: fp32 inside holds it
        assert_close_to_ref(rms_norm(big, w.new_ones(100), 1e-6, backend="cpp"), big, w.new_ones(100), 1e-6)


def test_strided_rows_and_leading_dimensions(isa_level):
    g = seeded()
    big = torch.randn(6, 2 * 301 + 5, generator=g).to(torch.bfloat16)
    w = torch.randn(301, generator=g).to(torch.bfloat16)
    for x in (big[:, :301], big[:, ::2][:, :301], big[::2, 3:304], big.T[:301].T):
        assert not x.is_contiguous()
        assert_close_to_ref(rms_norm(x, w, 1e-6, backend="cpp"), x, w, 1e-6)
    x = torch.randn(2, 3, 4, 97, generator=g)
    got = rms_norm(x, torch.ones(97), 1e-5, backend="cpp")
    assert got.shape == (2, 3, 4, 97) and got.is_contiguous()
    assert_close_to_ref(got, x, torch.ones(97), 1e-5)
    w = torch.randn(2 * 97, generator=g)[::2]  # a strided weight
    assert_close_to_ref(rms_norm(x, w, 1e-5, backend="cpp"), x, w, 1e-5)


def test_the_result_does_not_depend_on_threads():
    g = seeded()
    x = torch.randn(129, 896, generator=g).to(torch.bfloat16)
    w = torch.randn(896, generator=g).to(torch.bfloat16)
    outs = [rms_norm_cpp(x, w, 1e-6, threads=t) for t in (1, 2, 3, 8)]
    for o in outs:
        assert torch.equal(o, outs[0])


def test_bad_input_is_one_line():
    for x, w, what in ((torch.zeros(3, 0), torch.zeros(0), "x must be"),
                       (torch.zeros(3, 4, dtype=torch.float16), torch.zeros(4, dtype=torch.float16), "x must be"),
                       (torch.zeros(3, 4), torch.zeros(5), "weight must be"),
                       (torch.zeros(3, 4), torch.zeros(4, dtype=torch.bfloat16), "weight must be")):
        for backend in ("cpp", "ref"):
            with pytest.raises(ValueError, match=f"rms_norm: {what}") as e:
                rms_norm(x, w, 1e-6, backend=backend)
            assert "\n" not in str(e.value)
