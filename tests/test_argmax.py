"""argmax (ragfast.ops.argmax): every compiled level against the reference, on fresh random inputs."""
import numpy as np
import pytest
import torch

from ragfast.ops.argmax import argmax, argmax_ref
from ragfast.ops.registry import available

pytestmark = pytest.mark.skipif(not available()["cpp"], reason="ragfast._C not built")


def seeded():
    return torch.Generator().manual_seed(int(np.random.SeedSequence().entropy % 2**31))


def assert_first_max(got, x):
    """Tie-aware and exact: the answer is torch's, the first index holding the row's largest value."""
    expect = argmax_ref(x)
    assert got.dtype == torch.long and got.shape == expect.shape
    assert torch.equal(got, expect), (got, expect)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_every_level_matches_the_reference(isa_level, dtype):
    g = seeded()
    for M, N in [(1, 1), (1, 7), (2, 8), (3, 15), (4, 16), (5, 17), (2, 31), (3, 63), (7, 64), (1, 65), (9, 100),
                 (2, 1001), (3, 151936)]:
        x = torch.randn(M, N, generator=g).to(dtype)
        assert_first_max(argmax(x, backend="cpp"), x)
        # Many ties: bf16-coarse values on a small range, so the first of equals must win.
        t = torch.randint(-3, 4, (M, N), generator=g).to(dtype)
        assert_first_max(argmax(t, backend="cpp"), t)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_special_values(isa_level, dtype):
    g = seeded()
    nan, inf = float("nan"), float("inf")
    for N in (5, 8, 33, 200):
        for where in sorted({0, 1, N // 2, N - 1}):
            for special in (nan, inf, -inf):
                x = torch.randn(3, N, generator=g).to(dtype)
                x[1, where] = special
                x[2, where] = special
                x[2, N - 1] = special  # a second one later in the row
                assert_first_max(argmax(x, backend="cpp"), x)
        every = torch.full((2, N), -inf, dtype=dtype)  # nothing but -inf: index 0
        assert_first_max(argmax(every, backend="cpp"), every)
        zeros = torch.zeros(1, N, dtype=dtype)
        zeros[0, 1::2] = -0.0  # -0 and +0 are equal: the first wins
        zeros[0, 0] = -0.0
        assert_first_max(argmax(zeros, backend="cpp"), zeros)


def test_strided_rows_and_leading_dimensions(isa_level):
    g = seeded()
    big = torch.randn(6, 2 * 301 + 5, generator=g).to(torch.bfloat16)
    for x in (big[:, :301], big[:, ::2][:, :301], big[::2, 3:304], big.T[:301].T):
        assert not x.is_contiguous()
        assert_first_max(argmax(x, backend="cpp"), x)
    x = torch.randn(2, 3, 4, 97, generator=g)
    got = argmax(x, backend="cpp")
    assert got.shape == (2, 3, 4)
    assert_first_max(got, x)
    assert_first_max(argmax(x[0, 0, 0], backend="cpp"), x[0, 0, 0])  # one row, 0-d answer


def test_the_result_does_not_depend_on_threads():
    from ragfast.ops.argmax import argmax_cpp

    g = seeded()
    x = torch.randn(33, 4099, generator=g).to(torch.bfloat16)
    x[::3, 17] = x.float().max() + 1  # ties across rows too
    outs = [argmax_cpp(x, threads=t) for t in (1, 2, 3, 8)]
    for o in outs:
        assert torch.equal(o, outs[0])
    assert_first_max(outs[0], x)


def test_bad_input_is_one_line():
    for bad in (torch.zeros(3, 0), torch.zeros(3, dtype=torch.float16), torch.zeros(2, 3, dtype=torch.long),
                torch.tensor(1.0)):
        for backend in ("cpp", "ref"):
            with pytest.raises(ValueError, match="argmax: x must be") as e:
                argmax(bad, backend=backend)
            assert "\n" not in str(e.value)
