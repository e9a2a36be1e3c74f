"""silu_mul (ragfast.ops.silu_mul): every compiled level against the reference, on fresh random inputs."""
import numpy as np
import pytest
import torch

from ragfast.ops.registry import available
from ragfast.ops.silu_mul import silu_mul, silu_mul_cpp, silu_mul_ref

pytestmark = pytest.mark.skipif(not available()["cpp"], reason="ragfast._C not built")


def seeded():
    return torch.Generator().manual_seed(int(np.random.SeedSequence().entropy % 2**31))


def assert_close_to_ref(got, gate, up, min_equal=0.98):
    """fp32: within a few units in the last place (the exponential); bf16: within two bf16 steps
    of the reference and equal on nearly every value; NaN and infinities where the reference has them."""
    expect = silu_mul_ref(gate, up)
    assert got.dtype == expect.dtype and got.shape == expect.shape
    assert torch.equal(got.isnan(), expect.isnan())
    fin = expect.isfinite()
    assert torch.equal(got[~fin & ~expect.isnan()], expect[~fin & ~expect.isnan()])
    e, g = expect[fin].float(), got[fin].float()
    if gate.dtype == torch.float32:
        torch.testing.assert_close(g, e, rtol=4e-6, atol=1e-35)  # below e^-87 torch divides by an overflowing e^-g
        return
    step = torch.exp2(torch.floor(torch.log2(e.abs().clamp_min(1e-30))) - 7)
    assert ((g - e).abs() <= 2 * step).all(), (g - e).abs().max()
    assert (g == e).float().mean() >= min_equal


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_every_level_matches_the_reference(isa_level, dtype):
    g = seeded()
    for M, N in [(1, 1), (1, 7), (2, 16), (3, 17), (5, 63), (4, 64), (2, 65), (7, 4864), (33, 1000)]:
        gate = (torch.randn(M, N, generator=g) * 6).to(dtype)
        up = torch.randn(M, N, generator=g).to(dtype)
        out = torch.full((M, N), float("nan"), dtype=dtype)  # poisoned: every value must be written
        got = silu_mul_cpp(gate, up, out=out)
        assert got.data_ptr() == out.data_ptr()
        assert_close_to_ref(got, gate, up)
        assert_close_to_ref(silu_mul(gate, up, backend="cpp"), gate, up)


def test_the_whole_range_of_the_exponential(isa_level):
    for dtype in (torch.float32, torch.bfloat16):
        gate = torch.tensor([0.0, -0.0, 1e-30, -1e-30, 0.5, -0.5, 20, -20, 87, -87, 88.5, -88.5, 89.5, -89.5, 103,
                             -103, 104, -104, 200, -200, 3e38, -3e38, float("inf"), float("-inf"), float("nan")])
        gate = gate.to(dtype)
        up = torch.linspace(-2, 3, gate.numel()).to(dtype)
        # a few values: below e^-87 torch divides by an overflowing e^-g (-0), here a denormal
        assert_close_to_ref(silu_mul(gate, up, backend="cpp"), gate, up, min_equal=0.9)
        dense = torch.linspace(-87, 120, 20011).to(dtype)  # every region of the reduction above e^-87 (see above)
        assert_close_to_ref(silu_mul(dense, torch.ones_like(dense), backend="cpp"), dense, torch.ones_like(dense))


def test_strided_inputs_and_leading_dimensions(isa_level):
    g = seeded()
    big = torch.randn(6, 2 * 301 + 5, generator=g).to(torch.bfloat16)
    for a, b in ((big[:, :301], big[:, 301:602]), (big[:, ::2][:, :301], big[:, 1::2][:, :301]),
                 (big[::2, 3:304], big[1::2, 3:304]), (big.T[:301].T, big[:, :301].contiguous())):
        assert_close_to_ref(silu_mul(a, b, backend="cpp"), a, b)
    gate, up = torch.randn(2, 3, 97, generator=g), torch.randn(2, 3, 97, generator=g)
    got = silu_mul(gate, up, backend="cpp")
    assert got.shape == (2, 3, 97) and got.is_contiguous()
    assert_close_to_ref(got, gate, up)


def test_the_result_does_not_depend_on_threads():
    g = seeded()
    gate, up = (torch.randn(129, 4864, generator=g).to(torch.bfloat16) for _ in range(2))
    outs = [silu_mul_cpp(gate, up, threads=t) for t in (1, 2, 3, 8)]
    for o in outs:
        assert torch.equal(o, outs[0])


def test_bad_input_is_one_line():
    for gate, up, what in ((torch.zeros(3, 0), torch.zeros(3, 0), "gate must be"),
                           (torch.zeros(3, 4, dtype=torch.float16), torch.zeros(3, 4, dtype=torch.float16),
                            "gate must be"),
                           (torch.zeros(3, 4), torch.zeros(3, 5), "up must be"),
                           (torch.zeros(3, 4), torch.zeros(3, 4, dtype=torch.bfloat16), "up must be")):
        for backend in ("cpp", "ref"):
            with pytest.raises(ValueError, match=f"silu_mul: {what}") as e:
                silu_mul(gate, up, backend=backend)
            assert "\n" not in str(e.value)


def test_signed_zeros_keep_torch_signs(isa_level):
    for dtype in (torch.float32, torch.bfloat16):
        gate = torch.tensor([0.0, -0.0, -200.0, -1e30, 0.0, -0.0]).to(dtype)
        up = torch.tensor([1.0, 1.0, 1.0, 1.0, -1.0, -1.0]).to(dtype)
        got, ref = silu_mul(gate, up, backend="cpp"), silu_mul_ref(gate, up)
        assert torch.equal(got, ref) and torch.equal(got.signbit(), ref.signbit())
