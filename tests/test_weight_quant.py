"""Weight-only int8 linear layers (models/weight_quant.py) against their reference, and in HFGenerator."""
from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from ragfast.errors import ConfigError  # noqa: E402
from ragfast.ops.w8a8 import MATMUL_LEVELS  # noqa: E402
from ragfast.models.weight_quant import (KERNEL_ROWS, apply_weights, int8_linear_ref, quantize_int8,  # noqa: E402
                                         w8a8_linear_ref)

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def test_codes_are_in_range_and_dequantise_within_half_a_step():
    g = torch.Generator().manual_seed(7)
    w = torch.randn(53, 37, generator=g) * torch.rand(53, 1, generator=g) * 3
    w[5] = 0.0  # an all-zero row
    codes, scales = quantize_int8(w)
    assert codes.dtype == torch.int8 and codes.shape == w.shape and scales.shape == (53,)
    assert int(codes.abs().max()) <= 127 and int(codes.abs().amax(1)[torch.arange(53) != 5].min()) == 127
    assert bool((codes[5] == 0).all()) and float(scales[5]) == 1.0
    err = (codes.float() * scales[:, None] - w).abs()
    assert bool((err <= scales[:, None] / 2 + 1e-6).all())


def check_layer(dtype, bias: bool, depth: int, seed: int = 11) -> None:
    """One int8 layer (53 outputs, ``depth`` inputs) against the reference on non-contiguous inputs."""
    g = torch.Generator().manual_seed(seed)
    lin = torch.nn.Linear(depth, 53, bias=bias).to(dtype)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(53, depth, generator=g))
        if bias:
            lin.bias.copy_(torch.randn(53, generator=g))
    model = torch.nn.Sequential(lin)
    info = apply_weights(model, "int8")
    layer = model[0]
    assert info.scheme == "int8" and info.linear_layers == 1 and layer.codes.dtype == torch.int8
    # non-contiguous: a transposed view and a 3-D batch with strides (rows for the int8 kernel),
    # and more rows than KERNEL_ROWS (in bf16, the dequantised matmul)
    x = torch.randn(depth, 9, generator=g).to(dtype).t()
    x3 = torch.randn(3, 10, 2 * depth, generator=g).to(dtype)[:, ::2, ::2]
    xl = torch.randn(2 * depth, KERNEL_ROWS + 7, generator=g).to(dtype)[::2].t()
    assert not x.is_contiguous() and not x3.is_contiguous() and not xl.is_contiguous()
    for inp in (x, x3, xl):
        with torch.inference_mode():
            got = model(inp)
        want = int8_linear_ref(inp, layer.codes, layer.scales, layer.bias)
        assert got.shape == (*inp.shape[:-1], 53) and got.dtype == dtype
        kernel = layer.kernel and inp.numel() // depth <= layer.kernel_rows
        # the kernel takes bf16 inputs; the dequantised path computes in the activations' dtype
        tol = 1e-4 if dtype == torch.float32 and not kernel else 3e-2
        torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=tol * float(want.abs().max()))


# depth 37 with bf16 takes the dequantised path (torch's kernel needs a multiple of 16 there)
@pytest.mark.parametrize("depth", [37, 48])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bias", [False, True])
def test_int8_layer_equals_the_reference_on_odd_noncontiguous_inputs(dtype, bias, depth):
    check_layer(dtype, bias, depth)


@pytest.mark.parametrize("level", ["avx2", "avx512"])
def test_int8_layer_at_each_torch_isa_level(level):
    """torch's int8 kernels at each CPU level they dispatch to (ATEN_CPU_CAPABILITY, oneDNN's cap), in a fresh process."""
    import platform
    import subprocess
    import sys
    from pathlib import Path

    if platform.machine() not in ("x86_64", "AMD64"):
        pytest.skip("ATEN_CPU_CAPABILITY levels are x86's")
    flags = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").is_file() else ""
    if level == "avx512" and " avx512bw" not in flags:
        pytest.skip("this CPU has no AVX-512")
    code = ("import sys, torch; sys.path.insert(0, %r); from test_weight_quant import check_layer\n"
            "assert torch.backends.cpu.get_cpu_capability().lower().startswith(%r), torch.backends.cpu.get_cpu_capability()\n"
            "from test_weight_quant import check_w8a8\n"
            "for dt in (torch.float32, torch.bfloat16):\n"
            "    for depth in (37, 48, 96):\n"
            "        check_layer(dt, True, depth, seed=depth)\n"
            "        check_w8a8(dt, True, depth)\n" % (str(Path(__file__).parent), level))
    # torch._int_mm (w8a8) runs oneDNN, which picks its own level: capped alike
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                       env={**__import__("os").environ, "ATEN_CPU_CAPABILITY": level,
                            "ONEDNN_MAX_CPU_ISA": {"avx2": "AVX2", "avx512": "ALL"}[level]})
    assert r.returncode == 0, r.stderr[-2000:]


@pytest.mark.parametrize("depth", [37, 48])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bias", [False, True])
def test_w8a8_layer_equals_its_reference_above_the_kernel_rows(dtype, bias, depth):
    check_w8a8(dtype, bias, depth)


def check_w8a8(dtype, bias: bool, depth: int) -> None:
    """Passes of more than KERNEL_ROWS rows round the activations to int8 (torch._int_mm); fewer
    take the weight-only path. Fresh random, odd-sized, non-contiguous inputs; a zero row too.
    Where torch's int8 matmul is not exact (no VNNI or AMX), asking for w8a8 is one error."""
    from ragfast.models.weight_quant import int8_matmul_exact

    g = torch.Generator().manual_seed(depth + 3 * bias)
    lin = torch.nn.Linear(depth, 29, bias=bias).to(dtype)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(29, depth, generator=g) * torch.rand(29, 1, generator=g) * 2)
        if bias:
            lin.bias.copy_(torch.randn(29, generator=g))
    model = torch.nn.Sequential(lin)
    a = torch.randint(-127, 128, (KERNEL_ROWS + 1, depth), generator=g, dtype=torch.int8)
    exact = torch.equal(torch._int_mm(a, a.t().contiguous()).long(), a.long() @ a.long().T)
    assert int8_matmul_exact() == exact
    if not exact:
        with pytest.raises(ConfigError, match="w8a8 needs exact int8 matmuls"):
            apply_weights(model, "w8a8")
        return
    info = apply_weights(model, "w8a8")
    layer = model[0]
    assert info.scheme == "w8a8" and layer.codes.dtype == torch.int8
    many = torch.randn(2 * depth, 3 * KERNEL_ROWS + 5, generator=g).to(dtype)[::2].t()  # strided rows
    many[4] = 0.0  # an all-zero row keeps scale 1 and gives the bias alone
    big = torch.randn(2, KERNEL_ROWS + 3, depth, generator=g).to(dtype) * 40  # 3-D, wide range
    few = torch.randn(depth, KERNEL_ROWS, generator=g).to(dtype).t()
    assert not many.is_contiguous() and not few.is_contiguous()
    for inp in (many, big):
        with torch.inference_mode():
            got = model(inp)
        want = w8a8_linear_ref(inp, layer.codes, quantize_int8(lin.weight)[1], layer.bias)
        assert got.shape == (*inp.shape[:-1], 29) and got.dtype == dtype
        # integer sums are exact: only the final scaling (fp32) and the output's rounding differ
        tol = 1e-5 if dtype == torch.float32 else 2 ** -8
        torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=tol * float(want.abs().max()))
        if dtype == torch.float32:  # and it is not the weight-only computation
            assert float((got - int8_linear_ref(inp, layer.codes, layer.scales, layer.bias)).abs().max()) > 1e-4
    if bias:
        torch.testing.assert_close(model(many)[4].float(), layer.bias.float(), rtol=0, atol=0)
    with torch.inference_mode():
        got = model(few)
    want = int8_linear_ref(few, layer.codes, layer.scales, layer.bias)
    torch.testing.assert_close(got.float(), want.float(), rtol=3e-2, atol=3e-2 * float(want.abs().max()))


def test_unknown_scheme_is_one_line():
    with pytest.raises(ConfigError, match="unknown weights 'int4'"):
        apply_weights(torch.nn.Sequential(torch.nn.Linear(4, 4)), "int4")


@pytest.fixture(scope="module")
def qwen_dir(tmp_path_factory, random_lm):
    from transformers import Qwen2Config

    out = tmp_path_factory.mktemp("q8")
    random_lm(Qwen2Config, out, seed=3, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512, tie_word_embeddings=True)
    return out


def test_generator_int8_reads_a_quarter_of_the_linear_bytes_and_books_them(qwen_dir):
    from ragfast.accounting.ledger import CostLedger
    from ragfast.models.generator import HFGenerator

    native = HFGenerator(qwen_dir, dtype="float32", memory_budget=None)
    q8 = HFGenerator(qwen_dir, dtype="float32", memory_budget=None, weights="int8")
    lin = [m for m in native.model.modules() if isinstance(m, torch.nn.Linear)]
    lin_bytes = sum(m.weight.nbytes + (m.bias.nbytes if m.bias is not None else 0) for m in lin)
    other = native.weight_info.read_bytes - lin_bytes
    assert other > 0  # the norms
    assert not any(isinstance(m, torch.nn.Linear) for m in q8.model.modules())
    # int8 codes (a quarter of fp32) plus one fp32 scale per output row, biases kept in fp32
    rows = sum(m.weight.shape[0] for m in lin)
    bias = sum(m.bias.nbytes for m in lin if m.bias is not None)
    assert q8.weight_info.read_bytes == other + sum(m.weight.numel() for m in lin) + 4 * rows + bias
    gemv = native.weight_info.gemv_rows
    assert q8.describe()["weights"].startswith("int8 weight-only") and native.describe()["weights"] == (
        f"float32 weights; passes of <= {gemv} rows on ragfast's gemv" if gemv else "float32 weights")
    # the same greedy turn: the ledger books the weights once per forward pass of each row
    for gen in (native, q8):
        led = CostLedger()
        gen.start(["a", "b"], [gen.format_prompt("Who wrote Hamlet?"), gen.format_prompt("Capital of Peru?")])
        gen.generate(["a", "b"], stop=[], max_new_tokens=6, ledger=led)
        per_q = led.per_question()
        for sid in ("a", "b"):
            passes = len(gen.last_generated[sid])  # the prefill, then one pass per token after the first
            assert per_q[sid]["reasoner"]["bytes_scanned"] == gen.weight_info.read_bytes * passes
    # the int8 model's logits follow the native model's: within a tenth or so of their range on
    # this random-weight model (its wide weights compound the error; measured 0.095), where a
    # wrong layer would put them anywhere
    ids = torch.tensor([native.encode("The quick brown fox jumps over the lazy dog")])
    with torch.inference_mode():
        a = native.model(input_ids=ids).logits
        b = q8.model(input_ids=ids).logits
    assert float((a - b).abs().max()) < 0.2 * float(a.abs().max())
    assert float((a - b).abs().max()) > 0  # it really is another computation


def test_generator_w8a8_follows_the_native_model(qwen_dir):
    """A prompt of more than KERNEL_ROWS tokens takes the integer path in every linear layer."""
    from ragfast.models.generator import HFGenerator

    native = HFGenerator(qwen_dir, dtype="float32", memory_budget=None)
    w8 = HFGenerator(qwen_dir, dtype="float32", memory_budget=None, weights="w8a8")
    q8 = HFGenerator(qwen_dir, dtype="float32", memory_budget=None, weights="int8")
    assert w8.weight_info.read_bytes == q8.weight_info.read_bytes  # the same int8 weights are read
    assert w8.describe()["weights"].startswith("int8 weights per output channel, int8 activations per token")
    ids = torch.tensor([native.encode("The quick brown fox jumps over the lazy dog while the cat sleeps in the "
                                      "warm afternoon sun by the old river bank")])
    assert ids.shape[1] > KERNEL_ROWS
    with torch.inference_mode():
        a, b, c = (g.model(input_ids=ids).logits for g in (native, w8, q8))
    assert float((a - b).abs().max()) < 0.2 * float(a.abs().max())  # see the int8 test above
    assert float((b - c).abs().max()) > 0  # the activations were rounded too
    w8.start(["a"], [w8.format_prompt("Who wrote Hamlet?")])
    assert len(w8.generate(["a"], stop=[], max_new_tokens=4)) == 1


def test_weights_setting_is_checked():
    from ragfast.runner.settings import RunSettings

    with pytest.raises(ConfigError, match="--weights must be one of auto, native, int8"):
        RunSettings(weights="int4").validate()


def test_head_of_a_frozen_model_runs_one_mm_not_a_bmm_over_weight_copies(qwen_dir):
    """A merged adapter leaves weights that do not require grad; the last position's strided hidden
    state must still reach the head as one matmul (a bmm copied the weight per row: 18 GB at B=64)."""
    from torch.profiler import profile

    from ragfast.models.generator import HFGenerator

    from ragfast.models.weight_quant import set_gemv_rows

    gen = HFGenerator(qwen_dir, dtype="float32", memory_budget=None)
    gen.model.requires_grad_(False)
    set_gemv_rows(gen.model, 0)  # torch's matmul for the head: the path this guards
    ids = torch.randint(0, 100, (4, 9))
    with torch.inference_mode(), profile() as prof:
        gen.model(input_ids=ids, logits_to_keep=1)
    ops = {e.key for e in prof.key_averages()}
    assert "aten::bmm" not in ops, sorted(ops)


needs_cpp = pytest.mark.skipif(not __import__("ragfast.ops.registry", fromlist=["available"]).available()["cpp"],
                               reason="ragfast._C not built")


@needs_cpp
@pytest.mark.parametrize("scheme,dtype", [("native", torch.float32), ("native", torch.bfloat16),
                                          ("int8", torch.bfloat16), ("int8", torch.float32)])
def test_few_row_passes_run_gemv_and_the_rest_torch(scheme, dtype, monkeypatch):
    from ragfast.models.weight_quant import set_gemv_rows
    from ragfast.ops.gemv import GemvWeight, default_rows, gemv_ref

    g = torch.Generator().manual_seed(5)
    lin = torch.nn.Linear(37, 29, bias=True).to(dtype)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(29, 37, generator=g))
        lin.bias.copy_(torch.randn(29, generator=g))
    keys = set(lin.state_dict())
    w32, b32 = lin.weight.detach().float().clone(), lin.bias.detach().float().clone()
    model = torch.nn.Sequential(lin)
    info = apply_weights(model, scheme)
    layer = model[0]
    assert info.gemv_rows == layer.ragfast_gemv_rows == default_rows(layer.ragfast_gemv.weight.dtype)
    GEMV_ROWS = 3  # any count: the layer takes what it is given
    assert set_gemv_rows(model, GEMV_ROWS) == GEMV_ROWS
    if scheme == "native":
        assert isinstance(layer, torch.nn.Linear) and set(layer.state_dict()) == keys  # loads and saves as before
    calls = []
    real = GemvWeight.__call__
    monkeypatch.setattr(GemvWeight, "__call__", lambda self, *a, **k: calls.append(1) or real(self, *a, **k))
    for rows in (1, GEMV_ROWS, GEMV_ROWS + 1):
        x = torch.randn(rows, 2, 37, generator=g)[:, 1].to(dtype)  # strided rows
        calls.clear()
        with torch.inference_mode():
            y = layer(x)
        assert len(calls) == (rows <= GEMV_ROWS)
        if scheme == "native":
            expect = gemv_ref(x.float(), w32, None, b32)
        else:
            expect = gemv_ref(x.float(), *quantize_int8(w32), b32)  # fp32 scales: the more exact of the two paths
        mag = x.float().abs() @ w32.abs().T + b32.abs()
        tol = 1e-4 * mag + (2 ** -7 if dtype == torch.bfloat16 else 1e-6) * expect.abs()
        if rows > GEMV_ROWS and dtype == torch.bfloat16:
            tol = tol + 2 ** -7 * mag  # torch's bf16 paths round the dequantised weight and the bias too
        assert y.dtype == dtype and bool(((y.float() - expect).abs() <= tol + 1e-5).all()), rows
    # Off: every pass on torch.
    assert set_gemv_rows(model, 0) == 0
    calls.clear()
    with torch.inference_mode():
        layer(torch.randn(1, 37).to(dtype))
    assert not calls


@needs_cpp
def test_gradients_never_take_gemv(monkeypatch):
    from ragfast.ops.gemv import GemvWeight

    lin = torch.nn.Linear(8, 3)
    model = torch.nn.Sequential(lin)
    apply_weights(model, "native")
    monkeypatch.setattr(GemvWeight, "__call__", lambda *a, **k: pytest.fail("gemv under autograd"))
    x = torch.randn(1, 8, requires_grad=True)
    model[0](x).sum().backward()
    assert x.grad is not None and model[0].weight.grad is not None


@needs_cpp
def test_generator_greedy_tokens_with_and_without_gemv(qwen_dir):
    from ragfast.models.generator import HFGenerator
    from ragfast.models.weight_quant import set_gemv_rows

    from ragfast.ops.gemv import default_rows

    gen = HFGenerator(qwen_dir, dtype="float32", memory_budget=None)
    assert ("gemv" in gen.describe()["weights"]) == (default_rows(torch.float32) > 0)  # this machine's rows
    prompts = [gen.format_prompt("Who wrote Hamlet?"), gen.format_prompt("Capital of Peru?")]
    out = {}
    for rows in (4, 0):
        assert set_gemv_rows(gen.model, rows) == rows
        gen.start(["a", "b"], prompts)
        gen.generate(["a", "b"], stop=[], max_new_tokens=8)
        out[rows] = [list(gen.last_generated[s]) for s in ("a", "b")]
        gen.end(["a", "b"])
    assert out[4] == out[0] and all(len(t) == 8 for t in out[0])
    assert set_gemv_rows(gen.model) == default_rows(torch.float32)  # back to this machine's default


def _packable(dtype) -> bool:
    from ragfast.models.weight_quant import packing_supported

    return packing_supported(torch.empty(1, dtype=dtype))


def _ran_packed(fn) -> bool:
    """Whether ``fn()`` ran oneDNN's prepacked linear (the profiler's op names)."""
    from torch.profiler import profile

    with profile() as prof:
        fn()
    return any("_linear_pointwise" in e.key for e in prof.key_averages())


@pytest.mark.parametrize("bias", [False, True])
def test_packed_passes_equal_f_linear_on_odd_noncontiguous_inputs(bias):
    from ragfast.models.weight_quant import set_gemv_rows, set_packed

    dtype = torch.bfloat16
    if not _packable(dtype):
        pytest.skip("oneDNN has no bf16 on this CPU: nothing is packed")
    g = torch.Generator().manual_seed(int(bias))
    lin = torch.nn.Linear(37, 53, bias=bias).to(dtype)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(53, 37, generator=g))
        if bias:
            lin.bias.copy_(torch.randn(53, generator=g))
    keys = set(lin.state_dict())
    ref = torch.nn.Linear(37, 53, bias=bias).to(dtype)
    ref.load_state_dict(lin.state_dict())
    model = torch.nn.Sequential(lin)
    info = apply_weights(model, "native")
    assert info.packed_layers == 1 and "prepacked" in info.describe(str(dtype))
    assert set(lin.state_dict()) == keys  # saves and loads as before
    set_gemv_rows(model, 0)  # every pass on the packed weight, one row included
    inputs = [torch.randn(37, 9, generator=g).to(dtype).t(),  # transposed view
              torch.randn(3, 10, 74, generator=g).to(dtype)[:, ::2, ::2],  # 3-D, strided both ways
              torch.randn(1, 37, generator=g).to(dtype),
              torch.randn(70, 37, generator=g).to(dtype)]
    tol = 2 ** -7
    for x in inputs:
        with torch.inference_mode():
            assert _ran_packed(lambda: lin(x))
            got, want = lin(x), ref(x)
        assert got.shape == want.shape and got.dtype == dtype
        mag = x.float().abs() @ ref.weight.float().abs().T + (ref.bias.float().abs() if bias else 0)
        assert bool(((got.float() - want.float()).abs() <= tol * mag + 1e-6).all())
    # Off: F.linear, the copy dropped.
    assert set_packed(model, False) == 0 and lin.ragfast_packed is None
    with torch.inference_mode():
        assert not _ran_packed(lambda: lin(inputs[3]))
        torch.testing.assert_close(lin(inputs[3]), ref(inputs[3]))


def test_only_bf16_weights_are_packed():
    """fp32 layers keep MKL's sgemm (packing them gained 1.04-1.11x for twice their bytes)."""
    models = {dt: torch.nn.Sequential(torch.nn.Linear(16, 24).to(dt)) for dt in (torch.float32, torch.bfloat16)}
    infos = {dt: apply_weights(m, "native") for dt, m in models.items()}
    assert infos[torch.float32].packed_layers == 0 and models[torch.float32][0].ragfast_packed is None
    assert infos[torch.bfloat16].packed_layers == int(_packable(torch.bfloat16))


@pytest.mark.skipif(not _packable(torch.bfloat16), reason="oneDNN has no bf16 on this CPU: nothing is packed")
def test_packed_weight_follows_an_in_place_change_and_never_serves_gradients():
    from ragfast.models.weight_quant import set_gemv_rows

    lin = torch.nn.Linear(16, 24).to(torch.bfloat16)
    model = torch.nn.Sequential(lin)
    apply_weights(model, "native")
    set_gemv_rows(model, 0)
    x = torch.randn(5, 16).to(torch.bfloat16)
    with torch.no_grad():
        lin.weight.mul_(-2.0)  # as merging an adapter after the weights were prepared does
        lin.bias.zero_()
        assert _ran_packed(lambda: lin(x))
        torch.testing.assert_close(lin(x), x @ lin.weight.T)
    # Gradients take nn.Linear's path and reach the weight.
    xg = torch.randn(5, 16, dtype=torch.bfloat16, requires_grad=True)
    assert not _ran_packed(lambda: lin(xg).sum().backward())
    assert xg.grad is not None and lin.weight.grad is not None


def test_generator_greedy_tokens_with_and_without_packed_weights(qwen_dir):
    from ragfast.models.generator import HFGenerator
    from ragfast.models.weight_quant import set_packed

    gen = HFGenerator(qwen_dir, dtype="bfloat16", memory_budget=None)
    if not gen.weight_info.packed_layers:
        pytest.skip("oneDNN has no bf16 on this CPU: nothing is packed")
    assert "prepacked" in gen.describe()["weights"]
    prompts = [gen.format_prompt("Who wrote Hamlet?"), gen.format_prompt("Capital of Peru?"),
               gen.format_prompt("Name a prime.")]
    out = {}
    for on in (True, False):
        assert (set_packed(gen.model, on) > 0) == on
        gen.start(["a", "b", "c"], prompts)
        gen.generate(["a", "b", "c"], stop=[], max_new_tokens=8)
        out[on] = [list(gen.last_generated[s]) for s in ("a", "b", "c")]
        gen.end(["a", "b", "c"])
    assert out[True] == out[False] and all(len(t) == 8 for t in out[False])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_w8a8_layer_on_packed_codes_equals_int_mm(isa_level, dtype):
    """At the packed product's levels (AMX tiles, AVX-512 VNNI) a w8a8 layer whose depth is a
    multiple of 64 keeps its codes packed and every pass its gemv does not take runs
    ragfast.ops.w8a8.matmul (counted): many rows the same bits as torch._int_mm's path (set_packed
    off), 4-16 rows those of the int8 activations' reference (not torch's weight-only kernel, which
    ran them up to 12x slower); other levels never call it, and the report names the engine."""
    import ragfast.ops.w8a8 as w8a8_ops
    from ragfast.models import weight_quant
    from ragfast.models.weight_quant import int8_matmul_exact, set_packed
    from ragfast.ops.w8a8 import dequantize_sums, quantize_rows

    if not int8_matmul_exact():
        pytest.skip("torch's int8 matmul is not exact on this CPU: w8a8 is refused")
    g = torch.Generator().manual_seed(7)
    model = torch.nn.Sequential(torch.nn.Linear(128, 70), torch.nn.Linear(70, 9)).to(dtype)
    info = apply_weights(model, "w8a8")
    tiles = isa_level in MATMUL_LEVELS
    assert info.packed_layers == (1 if tiles else 0)  # depth 70 is not a multiple of 64
    assert (model[0].ragfast_packed is not None) == tiles and model[1].ragfast_packed is None
    calls = []
    real = w8a8_ops.matmul
    x = torch.randn(3 * KERNEL_ROWS + 1, 128, generator=g).to(dtype)
    few = model[0].ragfast_gemv_rows
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(weight_quant, "matmul", lambda *a, **k: calls.append(1) or real(*a, **k))
        with torch.inference_mode():
            got = model[0](x)
            mid = model[0](x[:KERNEL_ROWS])  # the weight-only kernel's rows elsewhere
            if few:
                model[0](x[:few])  # gemv's rows: never the packed product
    assert len(calls) == (2 if tiles else 0)
    if tiles:
        xq, xs = quantize_rows(x[:KERNEL_ROWS])
        want_mid = dequantize_sums(torch._int_mm(xq, model[0].codes.t()), xs, model[0].scales32, model[0].bias32, dtype)
        assert torch.equal(mid, want_mid)
    assert set_packed(model, False) == 0 and model[0].ragfast_packed is None
    with torch.inference_mode():
        want = model[0](x)
    assert torch.equal(got, want)
    engine = {"amx": "AMX tiles", "avx512vnni": "AVX-512 VNNI", "avx512bf16": "AVX-512 VNNI"}.get(isa_level)
    described = info.describe("bfloat16")
    assert f"1 of them on {engine}," in described if tiles else "of them on" not in described


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_auto_weights_take_w8a8_only_where_every_product_runs_packed(isa_level, dtype):
    """``weights="auto"``: w8a8 for a bf16 CPU model at a packed product's level (AMX tiles, AVX-512
    VNNI) whose every linear layer's depth is a multiple of 64 (each counted packed), native
    otherwise: fp32, another ISA level, or one layer of depth 70."""
    from ragfast.models.weight_quant import auto_weights, int8_matmul_exact

    def build(depth: int):
        return torch.nn.Sequential(torch.nn.Linear(128, depth), torch.nn.Linear(depth, 9)).to(dtype)

    tiles = isa_level in MATMUL_LEVELS and dtype == torch.bfloat16 and int8_matmul_exact()
    model = build(64)
    assert auto_weights(model) == ("w8a8" if tiles else "native")
    info = apply_weights(model, "auto")
    assert info.scheme == ("w8a8" if tiles else "native")
    assert info.packed_layers == (2 if tiles else info.packed_layers)
    if tiles:
        assert all(m.ragfast_packed is not None for m in model)
    assert auto_weights(build(70)) == "native"  # its second layer would run on _int_mm


def test_w8a8_mlp_pairs_gate_and_up_on_packed_codes(isa_level):
    """At a packed product's level (AMX tiles, AVX-512 VNNI) a SiLU MLP's w8a8 gate and up
    projections are paired (one packed copy, their own packed copies dropped) and its passes of more than KERNEL_ROWS rows run one gate_up call
    (counted): the same bits as the two layers on _int_mm followed by the silu_mul kernel (the
    pair dropped by set_packed(False)); gemv's few rows and other levels never call it."""
    from transformers import Qwen2Config
    from transformers.models.qwen2.modeling_qwen2 import Qwen2MLP

    from ragfast.models import weight_quant
    from ragfast.models.fused_layers import SILU_MIN_ROWS, set_fused_layers
    from ragfast.models.weight_quant import int8_matmul_exact, set_packed

    if not int8_matmul_exact():
        pytest.skip("torch's int8 matmul is not exact on this CPU: w8a8 is refused")
    cfg = Qwen2Config(hidden_size=64, intermediate_size=192, hidden_act="silu")
    model = torch.nn.Sequential(Qwen2MLP(cfg)).to(torch.bfloat16)
    set_fused_layers(model)  # as HFGenerator does, before the weights (a w8a8 MLP has no parameters left)
    info = apply_weights(model, "w8a8")
    mlp, tiles = model[0], isa_level in MATMUL_LEVELS
    assert info.packed_layers == (3 if tiles else 0)
    assert (getattr(mlp, "ragfast_gate_up", None) is not None) == tiles
    assert mlp.gate_proj.ragfast_packed is None and mlp.up_proj.ragfast_packed is None
    g = torch.Generator().manual_seed(5)
    x = torch.randn(SILU_MIN_ROWS + 3, 64, generator=g).to(torch.bfloat16)
    calls = []
    real = weight_quant.gate_up
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(weight_quant, "gate_up", lambda *a, **k: calls.append(1) or real(*a, **k))
        with torch.inference_mode():
            got = mlp(x)
            mlp(x[:max(1, mlp.gate_proj.ragfast_gemv_rows)])  # gemv's rows (or one, with no gemv)
            mlp(x[:KERNEL_ROWS])
    few = mlp.gate_proj.ragfast_gemv_rows > 0
    assert len(calls) == ((1 if few else 2) + 1 if tiles else 0)
    set_packed(model, False)
    assert getattr(mlp, "ragfast_gate_up", None) is None
    with torch.inference_mode():
        want = mlp(x)  # gate and up on _int_mm, then silu_mul's kernel (at least SILU_MIN_ROWS rows)
    assert torch.equal(got, want)


@needs_cpp
@pytest.mark.parametrize("scheme", ["int8", "w8a8"])
def test_int8_mlp_stacks_gate_and_up_for_gemv(scheme, monkeypatch):
    """An int8 MLP's gate and up codes become views of one stack that gemv reads in one call at
    the rows gemv takes: the same bits as the two layers' own calls, one call fewer; other
    passes never call the stack."""
    from transformers import Qwen2Config
    from transformers.models.qwen2.modeling_qwen2 import Qwen2MLP

    from ragfast.models.fused_layers import set_fused_layers
    from ragfast.models.weight_quant import int8_matmul_exact, set_gemv_rows, set_packed
    from ragfast.ops.gemv import GemvWeight

    if scheme == "w8a8" and not int8_matmul_exact():
        pytest.skip("torch's int8 matmul is not exact on this CPU: w8a8 is refused")
    cfg = Qwen2Config(hidden_size=64, intermediate_size=192, hidden_act="silu")
    model = torch.nn.Sequential(Qwen2MLP(cfg)).to(torch.bfloat16)
    set_fused_layers(model)
    apply_weights(model, scheme)
    set_packed(model, False)  # w8a8's few rows run the packed codes where they exist (the test below)
    mlp = model[0]
    stacked = mlp.ragfast_gate_up_gemv
    assert stacked.N == 2 * 192 and stacked.K == 64
    assert mlp.gate_proj.codes.data_ptr() == stacked.weight.data_ptr()
    assert mlp.up_proj.codes.data_ptr() == stacked.weight.data_ptr() + 192 * 64  # views: no second copy
    set_gemv_rows(model, 2)
    calls = []
    real = GemvWeight.__call__
    monkeypatch.setattr(GemvWeight, "__call__", lambda self, *a, **k: calls.append(self) or real(self, *a, **k))
    g = torch.Generator().manual_seed(3)
    for rows in (1, 2):
        x = torch.randn(rows, 2, 64, generator=g)[:, 0].to(torch.bfloat16)  # strided rows
        calls.clear()
        with torch.inference_mode():
            got = mlp(x)
        assert len(calls) == 2 and calls[0] is stacked  # the stack, then the down projection
        with torch.inference_mode():
            want = mlp.down_proj(mlp.act_fn(mlp.gate_proj(x)) * mlp.up_proj(x))
        assert torch.equal(got, want), rows
    set_gemv_rows(model, 0)
    calls.clear()
    with torch.inference_mode():
        mlp(torch.randn(1, 64, generator=g).to(torch.bfloat16))
    assert stacked not in calls


@needs_cpp
def test_w8a8_few_rows_run_the_packed_codes(isa_level, monkeypatch):
    """At the packed product's VNNI levels a w8a8 layer's few-row bf16 passes run gemv_packed on its
    packed codes, an MLP's gate and up one call on the pair (SiLU inside), and an attention's q, k
    and v codes become views of one stack that qkv_pass reads in one call with the layers' own
    bits; within the row-major gemv's bound of it, and never at other levels or in fp32."""
    from transformers import Qwen2Config
    from transformers.models.qwen2.modeling_qwen2 import Qwen2Attention, Qwen2MLP

    from ragfast.models import weight_quant
    from ragfast.models.fused_layers import set_fused_layers
    from ragfast.models.weight_quant import int8_matmul_exact, qkv_pass, set_gemv_rows, set_packed

    if not int8_matmul_exact():
        pytest.skip("torch's int8 matmul is not exact on this CPU: w8a8 is refused")
    cfg = Qwen2Config(hidden_size=128, intermediate_size=192, hidden_act="silu", num_attention_heads=4,
                      num_key_value_heads=2)
    model = torch.nn.Sequential(Qwen2MLP(cfg), Qwen2Attention(cfg, 0)).to(torch.bfloat16)
    set_fused_layers(model)
    apply_weights(model, "w8a8")
    set_gemv_rows(model, 2)
    mlp, attn = model[0], model[1]
    packed = isa_level in MATMUL_LEVELS
    stack = getattr(attn, "ragfast_qkv", None)
    assert (stack is not None) == packed
    if packed:
        assert stack[3] == (128, 64, 64) and stack[0].n == 256
        base = stack[0].data.data_ptr()  # the layers' packed codes are views of the stack
        assert [t.ragfast_packed.data.data_ptr() - base for t in (attn.q_proj, attn.k_proj, attn.v_proj)] == \
            [0, 128 * 128, 192 * 128]
    calls = []
    real = weight_quant.gemv_packed
    monkeypatch.setattr(weight_quant, "gemv_packed", lambda *a, **k: calls.append(k.get("silu", False)) or real(*a, **k))
    g = torch.Generator().manual_seed(9)
    x = torch.randn(2, 3, 128, generator=g)[:, 1].to(torch.bfloat16)  # strided rows
    with torch.inference_mode():
        got_mlp, got_q = mlp(x), attn.q_proj(x)
        got_qkv = qkv_pass(attn, x)
        mlp(x.float()), mlp(torch.randn(3, 128, generator=g).to(torch.bfloat16))  # fp32, and past gemv's rows
    assert calls == ([True, False, False, False] if packed else [])  # pair, down, q, then the stack
    assert (got_qkv is not None) == packed
    if packed:
        for y, layer in zip(got_qkv, (attn.q_proj, attn.k_proj, attn.v_proj)):
            with torch.inference_mode():
                assert torch.equal(y, layer(x))
    set_packed(model, False)
    assert getattr(attn, "ragfast_qkv", None) is None and attn.q_proj.ragfast_packed is None
    with torch.inference_mode():
        want_q = attn.q_proj(x)  # the row-major codes' gemv
        want_mlp = mlp.down_proj(mlp.act_fn(mlp.gate_proj(x)) * mlp.up_proj(x))
    for got, want in ((got_q, want_q), (got_mlp, want_mlp)):
        assert ((got.float() - want.float()).abs() <= 2 ** -6 * want.float().abs() + 2e-2).all()
